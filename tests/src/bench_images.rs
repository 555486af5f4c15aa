//! vmhost-bench's image store figures (docs/performance.md, docs/images.md): `image.import` of
//! an image of `mib` MiB (incompressible, no zero blocks) from a file in the import directory
//! and from an http URL on loopback (curl as `qemu.user` into the daemon's pipe), each to the
//! image recorded; and the same file through `sha256sum` alone, the floor of any verified copy.
//! Then a running VM whose data disk holds `mib` MiB of written data: `vm.snapshot` (live, its
//! QEMU copying), `vm.export` (live) and, stopped, `vm.revert`. Prints figures; asserts nothing
//! about time.

use crate::{serve_http, sha256_file, HostOptions, TestHost};
use serde_json::json;
use std::io::Write;
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    crate::percentile(&v, 0.5)
}

/// Writes `mib` MiB of xorshift output to `path`: no block of zeros for the copy to skip.
fn write_noise(path: &std::path::Path, mib: usize) {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).expect("create the image"));
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut block = vec![0u8; 1 << 20];
    for _ in 0..mib {
        for chunk in block.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        file.write_all(&block).expect("write the image");
    }
    file.flush().expect("flush the image");
}

/// `rounds` imports of a `mib` MiB image from a file and from a URL (each deleted after).
pub fn images(rounds: usize, mib: usize) {
    if rounds == 0 || mib == 0 {
        return;
    }
    let served = tempfile::tempdir().expect("tempdir");
    let source = served.path().join("big.raw");
    write_noise(&source, mib);
    let t = Instant::now();
    let sha = sha256_file(&source);
    let floor = t.elapsed();
    let port = serve_http(vec![("/big.raw".into(), source.clone())]);
    let host = TestHost::start(HostOptions {
        extra: format!("[images]\ndownload_ports = [{port}]\n"),
        ..HostOptions::default()
    });
    let import_dir = host.state().join("import");
    std::fs::copy(&source, import_dir.join("big.raw")).expect("copy into the import directory");
    let url = format!("http://127.0.0.1:{port}/big.raw");
    let mut rows = Vec::new();
    for (what, from) in [("file in paths.import", "big.raw".to_string()), ("http URL on loopback (curl)", url)] {
        let mut took = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            let v = host.call("image.import", json!({"name": "big.raw", "sha256": sha, "source": from}));
            took.push(t.elapsed());
            assert_eq!(v["changed"], true, "{v}");
            host.call("image.delete", json!({"name": "big.raw"}));
        }
        rows.push((what, median(took)));
    }
    println!();
    println!("image.import of a {mib} MiB image (incompressible), to recorded, median of {rounds}");
    println!("| source | import (ms) | MiB/s |");
    println!("|---|---:|---:|");
    for (what, d) in rows {
        println!("| {what} | {:.0} | {:.0} |", d.as_secs_f64() * 1000.0, mib as f64 / d.as_secs_f64());
    }
    println!(
        "| (sha256sum of the file alone) | {:.0} | {:.0} |",
        floor.as_secs_f64() * 1000.0,
        mib as f64 / floor.as_secs_f64()
    );
    disk_copies(&host, &source, rounds, mib);
}

/// A running VM whose raw data disk holds `mib` MiB of data (the noise file, written into the
/// disk before the start): snapshot, export (both live) and revert (stopped), each timed.
fn disk_copies(host: &TestHost, noise: &std::path::Path, rounds: usize, mib: usize) {
    let gib = (mib as u64).div_ceil(1024).max(1);
    let mut spec = host.kernel_spec("full");
    spec["state"] = json!("stopped");
    spec["disks"] = json!([{"name": "data", "size_gib": gib, "format": "raw"}]);
    host.call("vm.create", json!({ "spec": spec }));
    let disk = host.state().join("disks").join("full").join("data.raw");
    let mut file = std::fs::OpenOptions::new().write(true).open(&disk).expect("open the data disk");
    std::io::copy(&mut std::fs::File::open(noise).expect("open the noise"), &mut file).expect("fill the disk");
    drop(file);
    host.call("vm.start", json!({"name": "full"}));
    let (mut snap, mut export, mut revert) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        let t = Instant::now();
        let s = host.call("vm.snapshot", json!({"name": "full", "snapshot": format!("s{i}")}));
        snap.push(t.elapsed());
        assert_eq!(s["live"], true, "{s}");
        let t = Instant::now();
        let e = host.call("vm.export", json!({"name": "full"}));
        export.push(t.elapsed());
        let _ = std::fs::remove_dir_all(e["path"].as_str().unwrap_or_default());
    }
    host.call("vm.stop", json!({"name": "full", "force": true}));
    for i in 0..rounds {
        let t = Instant::now();
        host.call("vm.revert", json!({"name": "full", "snapshot": format!("s{i}")}));
        revert.push(t.elapsed());
    }
    host.call("vm.destroy", json!({"name": "full"}));
    println!();
    println!("A VM with {mib} MiB written on its raw data disk, median of {rounds}");
    println!("| operation | ms | MiB/s |");
    println!("|---|---:|---:|");
    for (what, took) in [
        ("vm.snapshot, running (QEMU copies, then sha256)", snap),
        ("vm.export, running", export),
        ("vm.revert, stopped (copy out, sha256, rename)", revert),
    ] {
        let d = median(took);
        println!("| {what} | {:.0} | {:.0} |", d.as_secs_f64() * 1000.0, mib as f64 / d.as_secs_f64());
    }
}
