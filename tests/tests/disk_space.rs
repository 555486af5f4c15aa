//! Disk space is reserved, not checked once (docs/images.md, docs/backup.md): an import, a
//! snapshot or an export reserves what it will write before it writes a byte, so a second one
//! that fits alone but not next to the first is 3002 and writes nothing.
//!
//! The images directory and the backups directory are one small tmpfs the test mounts (64 MiB,
//! two bind mounts of it, so one file system), and the first import is a download from a
//! server that sends the first MiB and then waits for the test: the download is still running,
//! deterministically, while the other operations are asked for.

use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;
use vmhost_tests::{boot_sector, run_ok, sha256_file, HostOptions, TestHost};

const MIB: usize = 1 << 20;

/// Serves `body` once on a loopback port: the headers and the first `first` bytes, then the
/// rest when `gate` is sent to. Returns the port, a receiver told when the request came and
/// the gate.
fn gated_server(body: Vec<u8>, first: usize) -> (u16, mpsc::Receiver<()>, mpsc::Sender<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let port = listener.local_addr().expect("local address").port();
    let (asked_tx, asked) = mpsc::channel();
    let (gate, gate_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let Ok((stream, _)) = listener.accept() else { return };
        let mut reader = BufReader::new(&stream);
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
            line.clear();
        }
        let _ = asked_tx.send(());
        let mut out = &stream;
        let head = format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
        if out.write_all(head.as_bytes()).and_then(|()| out.write_all(&body[..first])).is_err() {
            return;
        }
        let _ = out.flush();
        let _ = gate_rx.recv();
        let _ = out.write_all(&body[first..]);
    });
    (port, asked, gate)
}

/// Lazily unmounts what it holds when dropped (also when the test fails).
struct Mounts(Vec<PathBuf>);

impl Drop for Mounts {
    fn drop(&mut self) {
        for path in self.0.iter().rev() {
            let _ = std::process::Command::new("umount").arg("-l").arg(path).status();
        }
    }
}

/// Mounts `dir` over `target` (a bind mount), keeping `target`'s owner and mode on `dir`.
fn bind_over(dir: &Path, target: &Path, mounts: &mut Mounts) {
    std::fs::create_dir_all(target).unwrap();
    let meta = std::fs::metadata(target).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::os::unix::fs::chown(dir, Some(meta.uid()), Some(meta.gid())).unwrap();
    std::fs::set_permissions(dir, meta.permissions()).unwrap();
    run_ok(std::process::Command::new("mount").arg("--bind").arg(dir).arg(target));
    mounts.0.push(target.to_path_buf());
}

/// `len` bytes that are not zero (a copy skips zero blocks: these take their space).
fn full_bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn two_imports_that_each_fit_alone_but_not_together_the_second_is_3002_and_writes_nothing() {
    // 40 MiB by URL and 30 MiB from the import directory: each fits in 90 % of a 64 MiB file
    // system, both do not.
    let served = full_bytes(40 * MIB, 7);
    let served_sha = vmhost_tests::sha256_hex(&served);
    let (port, asked, gate) = gated_server(served, MIB);
    // The server is on loopback: a URL import reaches it only with `allow_private`.
    let mut host = TestHost::prepare(HostOptions {
        extra: format!("[images]\ndownload_ports = [{port}]\nallow_private = true\n"),
        ..HostOptions::default()
    });
    let mut mounts = Mounts(Vec::new());
    let small_fs = host.dir.path().join("small-fs");
    std::fs::create_dir_all(&small_fs).unwrap();
    run_ok(
        std::process::Command::new("mount").args(["-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs"]).arg(&small_fs),
    );
    mounts.0.push(small_fs.clone());
    bind_over(&small_fs.join("images"), &host.images(), &mut mounts);
    let backups = host.state().join("backups");
    bind_over(&small_fs.join("backups"), &backups, &mut mounts);
    host.spawn_daemon();

    // A VM booting from a 2 MiB image (on the small file system) to export.
    let small = host.state().join("import").join("small.raw");
    boot_sector::write_image(&small, &boot_sector::serial_print("VMHOST-SMALL"));
    let mut bytes = std::fs::read(&small).unwrap();
    bytes[4096..].copy_from_slice(&full_bytes(MIB - 4096, 3));
    bytes.extend(full_bytes(MIB, 5));
    std::fs::write(&small, &bytes).unwrap();
    host.call("image.import", json!({"name": "small.raw", "sha256": sha256_file(&small), "source": "small.raw"}));
    let spec = json!({"name": "keep", "cpu": 1, "memory_mib": 64, "state": "stopped",
                      "boot": {"image": "small.raw", "disk_gib": 1}});
    host.call("vm.create", json!({ "spec": spec }));

    let mid = host.state().join("import").join("mid.raw");
    std::fs::write(&mid, full_bytes(30 * MIB, 11)).unwrap();
    let mid_sha = sha256_file(&mid);
    // A failed import releases what it reserved (else the download below could not take 40 MiB).
    let (code, _) =
        host.call_err("image.import", json!({"name": "mid.raw", "sha256": "0".repeat(64), "source": "mid.raw"}));
    assert_eq!(code, 2003);

    let url = format!("http://127.0.0.1:{port}/big.raw");
    std::thread::scope(|s| {
        // Moved in: a failed assertion drops it, which lets the server finish and the first
        // import answer, rather than the scope waiting for it in vain.
        let gate = gate;
        let first =
            s.spawn(|| host.call("image.import", json!({"name": "big.raw", "sha256": served_sha, "source": url})));
        // curl asked: the download has reserved its room (before curl started) and is running.
        asked.recv_timeout(Duration::from_secs(60)).expect("the download never reached the server");
        let images_before = host.image_dir_entries();
        let backups_before = entries(&backups);

        let (code, e) =
            host.call_err("image.import", json!({"name": "mid.raw", "sha256": mid_sha, "source": "mid.raw"}));
        assert_eq!((code, e.field.as_deref()), (3002, Some("source")), "{e:?}");
        assert_eq!(e.details["resource"], "image_bytes", "{e:?}");
        assert_eq!(e.details["requested"], 30 * MIB, "{e:?}");
        assert!(e.details["reserved"].as_u64().unwrap() > 30 * MIB as u64, "the download holds its room: {e:?}");
        assert_eq!(host.image_dir_entries(), images_before, "the refused import wrote nothing");

        // An export to the same file system is refused too, before it writes anything.
        let (code, e) = host.call_err("vm.export", json!({"name": "keep"}));
        assert_eq!(
            (code, e.field.as_deref(), e.details["resource"].as_str()),
            (3002, Some("name"), Some("disk_bytes")),
            "{e:?}"
        );
        assert_eq!(entries(&backups), backups_before, "the refused export wrote nothing");

        gate.send(()).unwrap();
        let v = first.join().unwrap();
        assert_eq!(v["changed"], true, "{v}");
    });

    // The download's room is released with it: the export fits now.
    let v = host.call("vm.export", json!({"name": "keep"}));
    assert!(v["backup"].is_string(), "{v}");
    // And the second import fits alone.
    host.call("image.delete", json!({"name": "big.raw"}));
    let v = host.call("image.import", json!({"name": "mid.raw", "sha256": mid_sha, "source": "mid.raw"}));
    assert_eq!(v["changed"], true, "{v}");
    drop(mounts);
}
