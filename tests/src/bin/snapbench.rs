//! vmhost-snapbench: how long `vm.snapshot` of a running VM takes with a 1 GiB and a 64 GiB
//! qcow2 data disk holding the same data (docs/performance.md "Snapshots"), in the same run,
//! with a raw disk's whole copy beside them for scale.
//!
//! Each VM is the test guest (direct kernel, no agent: crash-consistent snapshots, no freeze)
//! with one data disk; before its first start `--data-mib N` (256) MiB of a pattern are written
//! at the start of the disk (`qemu-io`, the VM stopped), so every disk holds the same allocated
//! data; the 64 GiB qcow2 is otherwise sparse, as vmhostd creates it. Then `--rounds N` (5)
//! times: `vm.snapshot` timed (the call's round trip), then `vm.snapshot_delete` timed. Prints a
//! table of medians and the ratio 64 GiB / 1 GiB. Asserts nothing about time.
//!
//! The host's `storage.overcommit` is 10, so that the sparse 64 GiB disk is admitted on a
//! machine with less free space.
//!
//! Usage: `vmhost-snapbench [--rounds N] [--data-mib N]`.

use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};
use vmhost_tests::{percentile, run_ok, HostOptions, TestHost};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    percentile(&v, 0.5)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Creates VM `name` stopped with one data disk `format` of `gib`, writes `mib` MiB into it,
/// starts it and waits for its guest.
fn vm_with_data(host: &TestHost, name: &str, gib: u64, format: &str, mib: usize) {
    let mut spec = host.kernel_spec(name);
    spec["state"] = json!("stopped");
    spec["disks"] = json!([{ "name": "data", "size_gib": gib, "format": format }]);
    host.call("vm.create", json!({ "spec": spec }));
    host.call("vm.start", json!({ "name": name }));
    host.call("vm.stop", json!({ "name": name, "force": true }));
    let file = host.state().join(format!("disks/{name}/data.{format}"));
    let write = format!("write -P 0x5a 0 {mib}M");
    run_ok(Command::new("qemu-io").args(["-f", format, "-c", &write]).arg(&file));
    host.call("vm.start", json!({ "name": name }));
    assert!(host.wait_serial(name, "VMHOST-GUEST-READY", Duration::from_secs(180)), "{name} did not boot");
}

fn main() {
    let rounds = arg("--rounds", 5).max(1);
    let mib = arg("--data-mib", 256);
    // The sparse 64 GiB disk is admitted only with overcommit (this machine has less free).
    let host = TestHost::start(HostOptions {
        memory_gib: 4,
        extra: "[storage]\novercommit = 10.0\n".into(),
        ..HostOptions::default()
    });
    let layouts: [(&str, &str, u64, &str); 3] = [
        ("small", "qcow2, 1 GiB", 1, "qcow2"),
        ("big", "qcow2, 64 GiB (sparse)", 64, "qcow2"),
        ("rawcopy", "raw, 1 GiB (copied whole)", 1, "raw"),
    ];
    let mut rows: Vec<(&str, Duration, Duration, Value)> = Vec::new();
    for (name, what, gib, format) in layouts {
        vm_with_data(&host, name, gib, format, mib);
        let (mut took, mut deleted) = (Vec::new(), Vec::new());
        let mut last = Value::Null;
        for i in 0..rounds {
            let snap = format!("s{i}");
            let t = Instant::now();
            last = host.call("vm.snapshot", json!({ "name": name, "snapshot": snap }));
            took.push(t.elapsed());
            let t = Instant::now();
            host.call("vm.snapshot_delete", json!({ "name": name, "snapshot": snap }));
            deleted.push(t.elapsed());
        }
        assert_eq!(last["live"], true, "{last}");
        rows.push((what, median(took), median(deleted), last));
        host.call("vm.destroy", json!({ "name": name }));
    }
    println!();
    println!("vm.snapshot of a running VM (TCG test guest, no agent), one data disk with {mib} MiB written, median of {rounds}");
    println!("| data disk | kept as | vm.snapshot (ms) | vm.snapshot_delete (ms) |");
    println!("|---|---|---:|---:|");
    for (what, took, deleted, last) in &rows {
        let kind = if last["internal"].as_array().is_some_and(|a| !a.is_empty()) { "internal" } else { "copy" };
        println!("| {what} | {kind} | {:.1} | {:.1} |", ms(*took), ms(*deleted));
    }
    let ratio = ms(rows[1].1) / ms(rows[0].1);
    println!();
    println!("ratio 64 GiB / 1 GiB qcow2: {ratio:.2}");
}
