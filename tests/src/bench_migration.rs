//! vmhost-bench's live migration figures (`--only migration`, docs/performance.md "Live
//! migration"): a running counter guest moved between two vmhostds in two network namespaces
//! joined by a veth ([`crate::migration_pair`]): 256 MiB and 1 GiB of guest memory with a
//! sparse 1 GiB data disk, and 256 MiB with a 2 GiB data disk filled with data before the
//! guest starts. Per row: `vm.migrate`'s own `total_ms` and `downtime_ms` (QEMU's), the bytes
//! it sent, and the longest gap between two counter lines the guest printed (what a user of
//! the guest saw, measured on the consoles to 5 ms). Prints figures; asserts nothing about time.

use crate::migration_pair::{continuity, data_disk, with_mac, CounterWatch, Pair, PairOptions};
use serde_json::{json, Value};
use std::io::Write;
use std::time::{Duration, Instant};

/// One row: the guest's memory, the data disk's size, and whether it is filled.
struct Case {
    label: &'static str,
    memory_mib: u64,
    disk_gib: u64,
    filled: bool,
}

/// Writes `gib` GiB of non-zero data over `path` after its first 4 KiB (the guest's marker),
/// so the mirror has real data to copy (a sparse or zero disk costs it almost nothing).
fn fill(path: &std::path::Path, gib: u64) {
    let mut f = std::fs::OpenOptions::new().write(true).open(path).expect("open the data disk");
    let mut block = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in block.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
    }
    use std::io::Seek;
    f.seek(std::io::SeekFrom::Start(4096)).expect("seek");
    for _ in 0..(gib << 10) - 1 {
        f.write_all(&block).expect("fill the data disk");
    }
    f.sync_all().expect("sync the data disk");
}

/// Runs each case `rounds` times and prints a table.
pub fn migration(rounds: usize) {
    if rounds == 0 {
        return;
    }
    let cases = [
        Case { label: "256 MiB, 1 GiB sparse disk", memory_mib: 256, disk_gib: 1, filled: false },
        Case { label: "1 GiB, 1 GiB sparse disk", memory_mib: 1024, disk_gib: 1, filled: false },
        Case { label: "256 MiB, 2 GiB filled disk", memory_mib: 256, disk_gib: 2, filled: true },
    ];
    println!("\n== live migration (two vmhostds, veth between two namespaces, TCG) ==");
    println!(
        "{:<28} {:>6} {:>10} {:>12} {:>12} {:>10} {:>11}",
        "guest", "round", "total ms", "downtime ms", "console gap", "RAM MiB", "disk MiB"
    );
    for case in &cases {
        for round in 0..rounds {
            let pair = Pair::start(PairOptions::default());
            let name = "bench-mig";
            let mut spec = with_mac(pair.spec(name, case.memory_mib, "bench", false));
            spec["disks"][0]["size_gib"] = json!(case.disk_gib);
            if case.filled {
                let mut stopped = spec.clone();
                stopped["state"] = json!("stopped");
                pair.hosts[0].call("vm.create", json!({ "spec": stopped }));
                fill(&data_disk(&pair.hosts[0], name), case.disk_gib);
                pair.hosts[0].call("vm.start", json!({ "name": name }));
                pair.hosts[0].wait_serial_count(name, "VMHOST-COUNT ", 3, Duration::from_secs(120));
            } else {
                pair.create(0, &spec);
            }
            let watch = CounterWatch::start(&pair, name);
            let prepared = pair.migrate_in(0, 1, name);
            let started = Instant::now();
            let answer: Result<Value, String> = pair.migrate(0, name, &prepared);
            let wall = started.elapsed();
            let done = match answer {
                Ok(v) => v,
                Err(e) => {
                    println!("{:<28} {round:>6} failed: {e}", case.label);
                    continue;
                }
            };
            // A few lines on the destination close the gap measurement.
            let _ = crate::wait::poll(Duration::from_secs(30), || {
                if watch.ticks().iter().filter(|t| t.host == 1).count() >= 3 {
                    Ok(())
                } else {
                    Err(String::new())
                }
            });
            let c = continuity(&watch.finish(), 0, 1);
            let mib = |k: &str| done[k].as_u64().unwrap_or(0) as f64 / (1 << 20) as f64;
            println!(
                "{:<28} {round:>6} {:>10} {:>12} {:>12} {:>10.0} {:>11.0}   (call {:.0} ms)",
                case.label,
                done["total_ms"],
                done["downtime_ms"],
                format!("{:.0} ms", c.largest_gap.as_secs_f64() * 1000.0),
                mib("ram_bytes"),
                mib("disk_bytes"),
                wall.as_secs_f64() * 1000.0
            );
        }
    }
}
