//! vmhost-bench's data disk figures (docs/performance.md, docs/storage.md): `vm.create` of a
//! direct-kernel VM (to QEMU running) with 0, 1 and 4 data disks of 1 GiB (sparse qcow2, sparse
//! raw, preallocated raw), growing a running VM's data disk (`vm.apply`, QMP `block_resize`),
//! and a hot-plug round trip (a disk added to a running VM, then removed: `vm.apply` each, the
//! unplug waiting for the guest to release it). Prints figures; asserts nothing about time.

use crate::{HostOptions, TestHost};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    crate::percentile(&v, 0.5)
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

/// `count` data disks of 1 GiB in `format`, preallocated or not.
fn disks(count: usize, format: &str, preallocate: bool) -> Value {
    json!((0..count)
        .map(|i| json!({"name": format!("d{i}"), "size_gib": 1, "format": format, "preallocate": preallocate}))
        .collect::<Vec<_>>())
}

/// `rounds` creates (and destroys) per layout, then `rounds` live grows of one data disk.
pub fn storage(rounds: usize) {
    if rounds == 0 {
        return;
    }
    let host = TestHost::start(HostOptions::default());
    let layouts: [(&str, usize, &str, bool); 6] = [
        ("no data disk", 0, "qcow2", false),
        ("1 qcow2", 1, "qcow2", false),
        ("4 qcow2", 4, "qcow2", false),
        ("1 raw", 1, "raw", false),
        ("4 raw", 4, "raw", false),
        ("4 raw, preallocated", 4, "raw", true),
    ];
    println!();
    println!("vm.create (direct kernel, to QEMU running) with data disks of 1 GiB, median of {rounds}");
    println!("| data disks | create (ms) | destroy (ms) |");
    println!("|---|---:|---:|");
    for (what, count, format, preallocate) in layouts {
        let (mut created, mut destroyed) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let mut spec = host.kernel_spec("disky");
            spec["disks"] = disks(count, format, preallocate);
            let t = Instant::now();
            host.call("vm.create", json!({ "spec": spec }));
            created.push(t.elapsed());
            let t = Instant::now();
            host.call("vm.destroy", json!({ "name": "disky" }));
            destroyed.push(t.elapsed());
        }
        println!("| {what} | {} | {} |", ms(median(created)), ms(median(destroyed)));
    }

    for format in ["qcow2", "raw"] {
        let mut spec = host.kernel_spec("grow");
        spec["disks"] = disks(1, format, false);
        host.call("vm.create", json!({ "spec": spec }));
        let mut took = Vec::new();
        for i in 0..rounds {
            spec["disks"][0]["size_gib"] = json!(2 + i);
            let t = Instant::now();
            let r = host.call("vm.apply", json!({ "spec": spec }));
            took.push(t.elapsed());
            assert_eq!(r["vm"]["status"], "running", "{r}");
        }
        host.call("vm.destroy", json!({ "name": "grow" }));
        println!();
        println!("Live grow of a running VM's {format} data disk by 1 GiB (vm.apply, QMP block_resize): median {} ms of {rounds}", ms(median(took)));
    }

    // Hot-plug round trip: the guest must be up to release an unplugged disk.
    let mut spec = host.kernel_spec("plug");
    spec["disks"] = disks(1, "qcow2", false);
    host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial("plug", "VMHOST-GUEST-READY", Duration::from_secs(120)), "{}", host.serial("plug"));
    let (mut plugged, mut unplugged) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        spec["disks"] = disks(2, "qcow2", false);
        let t = Instant::now();
        let r = host.call("vm.apply", json!({ "spec": spec }));
        plugged.push(t.elapsed());
        assert_eq!(r["vm"]["pending_restart"], false, "hot-plugged: {r}");
        spec["disks"] = disks(1, "qcow2", false);
        let t = Instant::now();
        let r = host.call("vm.apply", json!({ "spec": spec }));
        unplugged.push(t.elapsed());
        assert_eq!(r["vm"]["pending_restart"], false, "unplugged: {r}");
    }
    host.call("vm.destroy", json!({ "name": "plug" }));
    println!();
    println!(
        "Hot-plug round trip of a 1 GiB qcow2 data disk on a running VM (vm.apply): add (make, add-fd, blockdev-add, device_add) median {} ms, remove (device_del until the guest releases it, delete) median {} ms, of {rounds}",
        ms(median(plugged)),
        ms(median(unplugged))
    );
}
