//! vmhost-bench's incremental backup figures (docs/performance.md "Incremental backups"): a
//! stopped VM with a `gib` GiB qcow2 data disk filled with data, a full `vm.export`, then 1 MiB
//! written into the disk (by qemu-io, which records it in the disk's dirty bitmap as a guest's
//! write would be) and an incremental `vm.export`: each one's time and the size of its copy of
//! the disk. Prints figures; asserts only that the increment is one (not a full copy).

use crate::{HostOptions, TestHost};
use serde_json::json;
use std::process::Command;
use std::time::Instant;

/// The bytes of backup `backup`'s copy of disk `file`.
fn copy_bytes(host: &TestHost, backup: &serde_json::Value, file: &str) -> u64 {
    let dir = host.state().join("backups").join(backup.as_str().unwrap_or_default());
    std::fs::metadata(dir.join(file)).map(|m| m.len()).unwrap_or_default()
}

/// Runs the section (module doc).
pub fn backups(gib: usize) {
    let host = TestHost::start(HostOptions::default());
    let mut spec = host.kernel_spec("inc");
    spec["state"] = json!("stopped");
    spec["disks"] = json!([{"name": "data", "size_gib": gib}]);
    host.call("vm.create", json!({ "spec": spec }));
    let disk = host.state().join("disks/inc/data.qcow2");
    let io = |cmd: &str| {
        crate::run_ok(Command::new("qemu-io").args(["-f", "qcow2", "-c", cmd]).arg(&disk));
    };
    // One request of at most 1 GiB at a time (qemu-io refuses larger ones).
    for g in 0..gib {
        io(&format!("write -P 0x5a {g}G 1G"));
    }

    let t = Instant::now();
    let full = host.call("vm.export", json!({ "name": "inc", "incremental": true }));
    let full_time = t.elapsed();
    io("write -P 0xa5 1G 1M");
    let t = Instant::now();
    let inc = host.call("vm.export", json!({ "name": "inc", "incremental": true }));
    let inc_time = t.elapsed();
    assert_eq!(inc["manifest"]["changes"][0]["kind"], "incremental", "{inc}");

    let (full_bytes, inc_bytes) =
        (copy_bytes(&host, &full["backup"], "data.qcow2"), copy_bytes(&host, &inc["backup"], "data.qcow2"));
    println!("\n## Incremental backups: a {gib} GiB qcow2 disk full of data, then 1 MiB written (stopped VM)\n");
    println!("| Export | Time | Copy of the disk |");
    println!("| --- | --- | --- |");
    println!("| full | {:.2} s | {:.1} MiB |", full_time.as_secs_f64(), full_bytes as f64 / f64::from(1 << 20));
    println!("| incremental | {:.2} s | {:.2} MiB |", inc_time.as_secs_f64(), inc_bytes as f64 / f64::from(1 << 20));
    println!(
        "\nratio: the increment took {:.1}% of the full export's time and {:.2}% of its size",
        100.0 * inc_time.as_secs_f64() / full_time.as_secs_f64().max(1e-9),
        100.0 * inc_bytes as f64 / (full_bytes as f64).max(1.0)
    );
}
