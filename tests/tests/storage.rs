//! Data disks (docs/storage.md): what the guest sees (order, serials, sizes), that what it wrote
//! survives a reconfigure, a stop and start, a grow and a replace, that a dropped disk goes and
//! an added one comes, and that `keep_on_destroy` keeps a disk for the next VM of that name.
//!
//! The guest is the test initramfs with its `vmhost.disks` hook: it reports every virtio disk as
//! `VMHOST-DISK <dev> serial=<serial> sectors=<n> mark=<marker>` on its console, and
//! `vmhost.writemark=SERIAL:WORD` writes a marker to the disk with that serial first.

use serde_json::{json, Value};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use vmhost_tests::{disk_spec, run_ok, HostOptions, TestHost};

const BOOT: Duration = Duration::from_secs(120);
const GIB_SECTORS: u64 = (1 << 30) / 512;

fn host() -> TestHost {
    TestHost::start(HostOptions { memory_gib: 4, ..HostOptions::default() })
}

fn data_disk(host: &TestHost, vm: &str, file: &str) -> PathBuf {
    host.state().join("disks").join(vm).join(file)
}

fn kept_disk(host: &TestHost, vm: &str, file: &str) -> PathBuf {
    host.state().join("kept-disks").join(vm).join(file)
}

fn disk_report(host: &TestHost, name: &str, boot: usize) -> Vec<(String, String, u64, String)> {
    vmhost_tests::disk_report(host, name, boot, BOOT)
}

fn apply(host: &TestHost, spec: &Value) -> Value {
    host.call("vm.apply", json!({ "spec": spec, "timeout_s": 5 }))
}

#[test]
fn the_guest_sees_its_data_disks_and_keeps_what_it_wrote_through_every_change() {
    let host = host();
    let disks = json!([
        {"name": "nsm", "size_gib": 1, "format": "raw", "keep_on_destroy": true},
        {"name": "logs", "size_gib": 1}
    ]);
    // First boot: the guest writes its marker to nsm, then reports.
    host.call("vm.create", json!({ "spec": disk_spec(&host, "sensor", disks.clone(), "vmhost.writemark=nsm:first") }));
    assert!(host.wait_serial("sensor", "VMHOST-WROTE nsm first", BOOT), "{}", host.serial("sensor"));
    let report = disk_report(&host, "sensor", 1);
    assert_eq!(
        report,
        [
            ("vda".into(), "nsm".into(), GIB_SECTORS, "first".into()),
            ("vdb".into(), "logs".into(), GIB_SECTORS, "-".into())
        ],
        "a direct-kernel VM has no boot disk: the data disks are vda, vdb in spec order"
    );
    let nsm = data_disk(&host, "sensor", "nsm.raw");
    let meta = std::fs::metadata(&nsm).unwrap();
    assert_eq!((meta.len(), meta.uid(), meta.permissions().mode() & 0o777), (1 << 30, 0, 0o600));
    assert!(data_disk(&host, "sensor", "logs.qcow2").is_file());
    let ino = meta.ino();

    // A reconfigure (the kernel command line changes: a restart) without the write: still there.
    let plain = disk_spec(&host, "sensor", disks.clone(), "");
    apply(&host, &plain);
    assert_eq!(disk_report(&host, "sensor", 2)[0], ("vda".into(), "nsm".into(), GIB_SECTORS, "first".into()));

    // Stop and start.
    host.call("vm.stop", json!({ "name": "sensor", "timeout_s": 10 }));
    host.call("vm.start", json!({ "name": "sensor" }));
    assert_eq!(disk_report(&host, "sensor", 3)[0].3, "first");

    // nsm grows to 2 GiB while the guest runs: same QEMU, and the guest sees the new size.
    let pid = host.call("vm.get", json!({ "name": "sensor" }))["pid"].clone();
    let grown = json!([
        {"name": "nsm", "size_gib": 2, "format": "raw", "keep_on_destroy": true},
        {"name": "logs", "size_gib": 1}
    ]);
    let v = apply(&host, &disk_spec(&host, "sensor", grown, ""));
    assert_eq!(v["vm"]["pid"], pid, "grown live, no restart: {v}");
    assert!(
        host.wait_serial("sensor", &format!("VMHOST-DISK-SIZES vda={} vdb={GIB_SECTORS}", 2 * GIB_SECTORS), BOOT),
        "{}",
        host.serial("sensor")
    );
    assert_eq!(std::fs::metadata(&nsm).unwrap().len(), 2 << 30);

    // logs is unplugged and extra hot-plugged: the same QEMU; the guest sees one go, the other come.
    let changed = json!([
        {"name": "nsm", "size_gib": 2, "format": "raw", "keep_on_destroy": true},
        {"name": "extra", "size_gib": 1, "format": "qcow2"}
    ]);
    let v = apply(&host, &disk_spec(&host, "sensor", changed.clone(), ""));
    assert_eq!((&v["vm"]["pid"], &v["vm"]["pending_restart"]), (&pid, &json!(false)), "live, nothing pending: {v}");
    assert!(
        host.wait_serial("sensor", "VMHOST-DISK-REMOVED vdb", BOOT),
        "{}\n{}",
        host.serial("sensor"),
        host.daemon_log()
    );
    assert!(wait_added(&host, "sensor", "extra"), "{}", host.serial("sensor"));
    assert!(!data_disk(&host, "sensor", "logs.qcow2").exists(), "an unplugged disk without keep_on_destroy is deleted");
    assert!(data_disk(&host, "sensor", "extra.qcow2").is_file());
    let stats = host.call("vm.stats", json!({ "name": "sensor" }));
    let devices: Vec<&str> =
        stats["vms"][0]["disks"].as_array().unwrap().iter().filter_map(|d| d["device"].as_str()).collect();
    assert!(devices.contains(&"data-extra") && !devices.contains(&"data-logs"), "{stats}");

    // The next start puts the disks in spec order.
    host.call("vm.restart", json!({ "name": "sensor", "timeout_s": 5 }));
    let report = disk_report(&host, "sensor", 4);
    assert_eq!(
        report,
        [
            ("vda".into(), "nsm".into(), 2 * GIB_SECTORS, "first".into()),
            ("vdb".into(), "extra".into(), GIB_SECTORS, "-".into())
        ]
    );
    assert_eq!(std::fs::metadata(&nsm).unwrap().ino(), ino, "the same file, grown");

    // Refused changes leave the VM as it is.
    let mut smaller = disk_spec(&host, "sensor", changed.clone(), "");
    smaller["disks"][0]["size_gib"] = json!(1);
    let (code, e) = host.call_err("vm.apply", json!({ "spec": smaller }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.disks[0].size_gib")), "{e:?}");
    let mut other_format = disk_spec(&host, "sensor", changed.clone(), "");
    other_format["disks"][0]["format"] = json!("qcow2");
    let (code, e) = host.call_err("vm.apply", json!({ "spec": other_format }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.disks[0].format")), "{e:?}");

    // Destroy keeps nsm (and says where), deletes extra.
    let destroyed = host.call("vm.destroy", json!({ "name": "sensor" }));
    let kept = kept_disk(&host, "sensor", "nsm.raw");
    assert_eq!(destroyed["kept_disks"], json!([kept]), "{destroyed}");
    assert!(kept.is_file());
    assert!(!host.state().join("disks").join("sensor").exists(), "nothing else of the VM is left");
    let info = host.call("host.info", json!({}));
    assert_eq!(info["kept_disks"][0]["vm"], "sensor", "{info}");
    assert_eq!(info["kept_disks"][0]["name"], "nsm");
    let listed = String::from_utf8_lossy(&host.ctl(&["info"]).stdout).into_owned();
    assert!(listed.contains("nsm") && listed.contains(&kept.display().to_string()), "{listed}");

    // A new VM of the same name takes it back, with what the old one wrote.
    host.call("vm.create", json!({ "spec": disk_spec(&host, "sensor", changed.clone(), "") }));
    // (The destroy removed the old console log: this is the new VM's first boot.)
    assert_eq!(disk_report(&host, "sensor", 1)[0], ("vda".into(), "nsm".into(), 2 * GIB_SECTORS, "first".into()));
    assert!(!kept.exists(), "taken back, not copied");
    assert_eq!(host.call("host.info", json!({}))["kept_disks"], json!([]));

    // Purge: only what is kept, only by name.
    host.call("vm.destroy", json!({ "name": "sensor" }));
    assert!(kept.is_file());
    let (code, _) = host.call_err("host.purge_kept_disks", json!({ "vm": "nobody" }));
    assert_eq!(code, 4040);
    let (code, e) = host.call_err("host.purge_kept_disks", json!({ "vm": "../etc" }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("vm")));
    let purged = host.call("host.purge_kept_disks", json!({ "vm": "sensor" }));
    assert_eq!(purged["deleted"], json!([kept]));
    assert!(!kept.exists() && !host.state().join("kept-disks").join("sensor").exists());
}

#[test]
fn a_failed_create_returns_the_disks_it_took_back_and_deletes_the_ones_it_made() {
    let host = host();
    let keep = json!([{"name": "pcap", "size_gib": 1, "format": "raw", "keep_on_destroy": true}]);
    let mut stopped = disk_spec(&host, "rebuilt", keep, "");
    stopped["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": stopped }));
    let disk = data_disk(&host, "rebuilt", "pcap.raw");
    std::fs::write(&disk, b"the old sensor's data").unwrap();
    std::fs::OpenOptions::new().write(true).open(&disk).unwrap().set_len(1 << 30).unwrap();
    host.call("vm.destroy", json!({ "name": "rebuilt" }));
    let kept = kept_disk(&host, "rebuilt", "pcap.raw");
    assert!(kept.is_file());

    // A create of the same name takes pcap back, makes fresh, and then QEMU cannot start.
    let junk = host.images().join("junk-kernel");
    std::fs::write(&junk, vec![0u8; 4096]).unwrap();
    let disks = json!([
        {"name": "pcap", "size_gib": 1, "format": "raw", "keep_on_destroy": true},
        {"name": "fresh", "size_gib": 1}
    ]);
    let mut broken = disk_spec(&host, "rebuilt", disks, "");
    broken["boot"]["kernel"] = json!(junk);
    let (code, e) = host.call_err("vm.create", json!({ "spec": broken }));
    assert_eq!(code, 4001, "{e:?}");
    assert!(kept.is_file(), "the disk it took back is returned");
    assert!(std::fs::read(&kept).unwrap().starts_with(b"the old sensor's data"));
    assert!(!data_disk(&host, "rebuilt", "fresh.qcow2").exists(), "the disk it made is gone");
    assert!(!host.state().join("disks").join("rebuilt").exists());
    host.call("vm.destroy", json!({ "name": "rebuilt" }));
    assert!(kept.is_file(), "destroying the failed VM does not touch the kept disk");
}

#[test]
fn a_replace_makes_a_new_boot_disk_and_keeps_every_data_disk() {
    let host = host();
    // Two base images without an OS: a boot sector that prints which image it is, then the
    // first sector of every other disk the BIOS sees (the data disk among them).
    for image in ["base", "other"] {
        let code = vmhost_tests::boot_sector::print_disks(&format!("VMHOST-IMAGE {image}"));
        vmhost_tests::boot_sector::write_image(&host.images().join(format!("{image}.img")), &code);
    }
    let spec = |image: &str| {
        json!({"name": "img", "cpu": 1, "memory_mib": 128, "boot": {"image": image, "disk_gib": 1},
               "disks": [{"name": "nsm", "size_gib": 1, "format": "raw"}]})
    };
    let mut stopped = spec("base.img");
    stopped["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": stopped }));
    let nsm = data_disk(&host, "img", "nsm.raw");
    std::fs::write(&nsm, b"VMHOST-NSM kept across a replace").unwrap();
    std::fs::OpenOptions::new().write(true).open(&nsm).unwrap().set_len(1 << 30).unwrap();
    let ino = std::fs::metadata(&nsm).unwrap().ino();
    host.call("vm.start", json!({ "name": "img" }));
    let booted = |image: &str| {
        let after = format!("VMHOST-IMAGE {image}");
        let kept =
            |log: &str| log.split(&after).nth(1).is_some_and(|rest| rest.contains("VMHOST-NSM kept across a replace"));
        vmhost_tests::wait::poll(BOOT, || if kept(&host.serial("img")) { Ok(()) } else { Err(String::new()) }).is_ok()
    };
    assert!(booted("base"), "the guest reads the data disk: {}", host.serial("img"));
    let pid = host.call("vm.get", json!({ "name": "img" }))["pid"].as_i64().unwrap();
    let argv = vmhost_tests::argv_of(pid);
    let devices: Vec<&String> = argv.iter().filter(|a| a.starts_with("virtio-blk-pci")).collect();
    assert_eq!(
        devices,
        [
            "virtio-blk-pci,drive=virtio0,id=boot-disk",
            "virtio-blk-pci,drive=data-nsm,id=data-nsm,serial=nsm,bus=hp0",
            "virtio-blk-pci,drive=seed,id=seed,bus=seedport"
        ],
        "boot disk, then data disks (each behind its root port), then the seed (behind its own port)"
    );
    let overlay = host.state().join("disks").join("img.qcow2");

    let v = host.call("vm.apply", json!({ "spec": spec("other.img"), "replace": true, "timeout_s": 1 }));
    assert_eq!(v["vm"]["status"], "running", "{v}");
    // The new boot disk runs, and the guest reads the same data disk's bytes.
    assert!(booted("other"), "after the replace: {}", host.serial("img"));
    // (An inode number can be reused at once: the new overlay is told by the base it records.)
    let info = run_ok(Command::new("qemu-img").args(["info", "-U", "--output=json"]).arg(&overlay));
    let backing = serde_json::from_str::<Value>(&info).unwrap()["backing-filename"].clone();
    assert_eq!(backing, json!(host.images().join("other.img")), "a new boot disk on the new base");
    assert_eq!(std::fs::metadata(&nsm).unwrap().ino(), ino, "the same data disk");
    host.call("vm.destroy", json!({ "name": "img" }));
    assert!(!nsm.exists());
}

#[test]
fn bad_disk_lists_are_refused_naming_the_field_and_nothing_is_made() {
    let host = host();
    let cases: Vec<(Value, &str)> = vec![
        (json!((0..17).map(|i| json!({"name": format!("d{i}"), "size_gib": 1})).collect::<Vec<_>>()), "spec.disks"),
        (json!([{"name": "a", "size_gib": 1}, {"name": "a", "size_gib": 1}]), "spec.disks[1].name"),
        (json!([{"name": "Bad_Name", "size_gib": 1}]), "spec.disks[0].name"),
        (json!([{"name": "twenty-one-characters", "size_gib": 1}]), "spec.disks[0].name"),
        (json!([{"name": "z", "size_gib": 0}]), "spec.disks[0].size_gib"),
        (json!([{"name": "n", "size_gib": 1, "cache": "writeback", "aio": "native"}]), "spec.disks[0].aio"),
    ];
    for (disks, field) in cases {
        let (code, e) = host.call_err("vm.create", json!({ "spec": disk_spec(&host, "bad", disks, "") }));
        assert_eq!((code, e.field.as_deref()), (2001, Some(field)), "{e:?}");
    }
    let (code, _) = host.call_err("vm.get", json!({ "name": "bad" }));
    assert_eq!(code, 4040);
    assert!(!host.state().join("disks").join("bad").exists());
}

#[test]
fn disks_larger_than_the_free_space_are_refused_before_anything_is_made() {
    let host = host();
    let info = host.call("host.info", json!({}));
    let free = info["storage"]["free_bytes"].as_u64().unwrap();
    assert!(free > 0 && info["storage"]["total_bytes"].as_u64().unwrap() >= free, "{info}");
    let too_big = free / (1 << 30) + 1;
    let disks = json!([{"name": "nsm", "size_gib": too_big, "format": "raw"}]);
    let (code, e) = host.call_err("vm.create", json!({ "spec": disk_spec(&host, "huge", disks, "") }));
    assert_eq!((code, e.field.as_deref()), (3002, Some("spec.disks")), "{e:?}");
    assert_eq!(e.details["resource"], "disk_gib");
    assert_eq!(e.details["requested"], too_big);
    assert_eq!(host.call_err("vm.get", json!({ "name": "huge" })).0, 4040);
    assert!(!host.state().join("disks").join("huge").exists(), "nothing made");

    // Preallocated disks keep a 10 % margin whatever the overcommit: 95 % of the free space (in
    // whole GiB, rounded up so it stays above 90 % however the free space moves meanwhile) is
    // refused on a host whose overcommit would let it in sparse.
    let roomy = TestHost::start(HostOptions {
        memory_gib: 4,
        extra: "[storage]\novercommit = 10.0\n".into(),
        ..HostOptions::default()
    });
    let free = roomy.call("host.info", json!({}))["storage"]["free_bytes"].as_u64().unwrap();
    let most = (free * 95 / 100).div_ceil(1 << 30);
    let preallocated = json!([{"name": "nsm", "size_gib": most, "format": "raw", "preallocate": true}]);
    let (code, e) = roomy.call_err("vm.create", json!({ "spec": disk_spec(&roomy, "pre", preallocated.clone(), "") }));
    assert_eq!((code, e.field.as_deref()), (3002, Some("spec.disks")), "{e:?}");
    assert!(e.message.contains("less than 10 % free"), "refused for the margin: {e:?}");
    let mut sparse = preallocated;
    sparse[0]["preallocate"] = json!(false);
    let mut spec = disk_spec(&roomy, "pre", sparse, "");
    spec["state"] = json!("stopped");
    roomy.call("vm.create", json!({ "spec": spec }));

    // Growing a VM's disk past the free space: refused, the VM as it was.
    let mut spec = disk_spec(&host, "small", json!([{"name": "nsm", "size_gib": 1}]), "");
    spec["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": spec }));
    let provisioned = host.call("host.info", json!({}))["storage"]["provisioned_bytes"].as_u64().unwrap();
    assert_eq!(provisioned, 1 << 30, "the VM's disks at full size");
    spec["disks"][0]["size_gib"] = json!(too_big + 1);
    let (code, _) = host.call_err("vm.apply", json!({ "spec": spec }));
    assert_eq!(code, 3002);
    assert_eq!(host.call("vm.get", json!({ "name": "small" }))["spec"]["disks"][0]["size_gib"], 1);
    assert!(std::fs::metadata(data_disk(&host, "small", "nsm.qcow2")).unwrap().len() < (1 << 30), "a sparse qcow2");
}

#[test]
fn disks_come_and_go_while_running_and_a_restart_puts_them_in_order() {
    let host = host();
    let both = json!([{"name": "a", "size_gib": 1}, {"name": "b", "size_gib": 1, "keep_on_destroy": true}]);
    host.call("vm.create", json!({ "spec": disk_spec(&host, "pend", both, "vmhost.writemark=b:kept") }));
    assert!(host.wait_serial("pend", "VMHOST-WROTE b kept", BOOT), "{}", host.serial("pend"));
    assert_eq!(disk_report(&host, "pend", 1).len(), 2);
    let pid = host.call("vm.get", json!({ "name": "pend" }))["pid"].clone();

    // b is unplugged even with restart: false; kept, as it says.
    let only_a = disk_spec(&host, "pend", json!([{"name": "a", "size_gib": 1}]), "vmhost.writemark=b:kept");
    let v = host.call("vm.apply", json!({ "spec": only_a, "restart": false }));
    assert_eq!((&v["vm"]["pid"], &v["vm"]["pending_restart"]), (&pid, &json!(false)), "{v}");
    assert!(host.wait_serial("pend", "VMHOST-DISK-REMOVED vdb", BOOT), "{}", host.serial("pend"));
    assert!(!data_disk(&host, "pend", "b.qcow2").exists());
    let kept = kept_disk(&host, "pend", "b.qcow2");
    assert!(kept.is_file(), "unplugged with keep_on_destroy: kept");

    // b comes back (taken back from kept-disks) and c is new, together with a change that
    // needs a restart, not made: the disks are hot-plugged now, the rest waits.
    let mut more = disk_spec(
        &host,
        "pend",
        json!([{"name": "c", "size_gib": 2}, {"name": "a", "size_gib": 1}, {"name": "b", "size_gib": 1, "keep_on_destroy": true}]),
        "vmhost.writemark=b:kept",
    );
    more["memory_mib"] = json!(more["memory_mib"].as_u64().unwrap() + 16);
    let v = host.call("vm.apply", json!({ "spec": more, "restart": false }));
    assert_eq!((&v["vm"]["pid"], &v["vm"]["pending_restart"]), (&pid, &json!(true)), "{v}");
    assert!(wait_added(&host, "pend", "b") && wait_added(&host, "pend", "c"), "{}", host.serial("pend"));
    assert!(!kept.exists(), "taken back");
    let c = data_disk(&host, "pend", "c.qcow2");
    assert!(c.is_file());

    // c goes again while b, also hot-plugged, stays: only c's node and descriptors are removed.
    let removals = host.serial("pend").matches("VMHOST-DISK-REMOVED").count();
    more["disks"] = json!([{"name": "a", "size_gib": 1}, {"name": "b", "size_gib": 1, "keep_on_destroy": true}]);
    let v = host.call("vm.apply", json!({ "spec": more, "restart": false }));
    assert_eq!((&v["vm"]["pid"], &v["vm"]["pending_restart"]), (&pid, &json!(true)), "{v}");
    vmhost_tests::wait::until_true(
        "the guest to report the unplug",
        BOOT,
        || host.serial("pend").matches("VMHOST-DISK-REMOVED").count() > removals,
        || host.serial("pend"),
    );
    assert!(!c.exists(), "an unplugged disk without keep_on_destroy is deleted");

    // The restart applies the rest and the spec's order; b still holds what the guest wrote.
    host.call("vm.restart", json!({ "name": "pend", "timeout_s": 5 }));
    let report = disk_report(&host, "pend", 2);
    let order: Vec<(&str, &str)> = report.iter().map(|r| (r.1.as_str(), r.3.as_str())).collect();
    assert_eq!(order, [("a", "-"), ("b", "kept")], "{report:?}");
    assert_eq!(host.call("vm.get", json!({ "name": "pend" }))["pending_restart"], false);
}

/// VM `track`'s spec with `disks`; its guest writes a marker to disk `x` when it has one.
fn track_spec(host: &TestHost, disks: Value) -> Value {
    disk_spec(host, "track", disks, "vmhost.writemark=x:precious")
}

/// A disk still named by an earlier operation (a hot-plug that a crash cut short while QEMU
/// died too) is the VM's once a QEMU starts on it: a later hot-plug that QEMU refuses undoes
/// only its own disk, never one the guest wrote to.
#[test]
fn a_disk_the_guest_wrote_is_never_undone_by_a_later_failed_hot_plug() {
    let mut host = host();
    let a = json!({"name": "a", "size_gib": 1});
    let x = json!({"name": "x", "size_gib": 1, "format": "raw"});
    host.call("vm.create", json!({ "spec": track_spec(&host, json!([a])) }));
    assert_eq!(disk_report(&host, "track", 1).len(), 1);
    let qemu = host.call("vm.get", json!({ "name": "track" }))["pid"].as_i64().expect("pid") as i32;

    // The daemon dies once x is made for a hot-plug, before QEMU has it, and QEMU dies too.
    host.arm_crash("data_disk:made");
    let answer =
        host.client().call::<Value>("vm.apply", json!({ "spec": track_spec(&host, json!([a, x])), "timeout_s": 5 }));
    assert!(answer.is_err(), "the daemon should have died: {answer:?}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(qemu), nix::sys::signal::Signal::SIGKILL).expect("kill QEMU");
    vmhost_tests::wait::until_true("QEMU to end", BOOT, || !vmhost_tests::alive(qemu), || "alive".into());
    host.restart_after_crash("data_disk:made");

    // Autostart boots it again, now with x, and the guest writes to x.
    assert!(host.wait_serial("track", "VMHOST-WROTE x precious", BOOT), "{}", host.serial("track"));
    let record: Value =
        serde_json::from_slice(&std::fs::read(host.state().join("vms/track.json")).expect("record")).expect("json");
    assert!(record.get("new_disks").is_none(), "x is the VM's now, not the hot-plug's: {record}");

    // A hot-plug QEMU cannot take (y's path is a directory) fails and takes back only y.
    std::fs::create_dir(data_disk(&host, "track", "y.qcow2")).expect("y as a directory");
    let y = json!({"name": "y", "size_gib": 1});
    let (code, e) = host.call_err("vm.apply", json!({ "spec": track_spec(&host, json!([a, x, y])), "timeout_s": 5 }));
    assert_eq!(code, 4001, "{e:?}");
    let written = std::fs::read(data_disk(&host, "track", "x.raw")).expect("x is still there");
    assert!(written.starts_with(b"VMHOSTMARK:precious"), "x keeps what the guest wrote");
}

/// Waits for the guest to report a hot-plugged disk with serial `serial`.
fn wait_added(host: &TestHost, name: &str, serial: &str) -> bool {
    let needle = format!("serial={serial}");
    let added = |log: &str| log.lines().any(|l| l.contains("VMHOST-DISK-ADDED ") && l.trim_end().ends_with(&needle));
    vmhost_tests::wait::poll(BOOT, || if added(&host.serial(name)) { Ok(()) } else { Err(String::new()) }).is_ok()
}

/// `qemu-img info -U` of `path` (as root, from the host).
fn image_info(path: &std::path::Path) -> Value {
    let out = run_ok(Command::new("qemu-img").args(["info", "-U", "--output=json"]).arg(path));
    serde_json::from_str(&out).unwrap()
}

/// A disk made elsewhere (as libvirt's would be): a qcow2 whose boot sector prints `marker` on
/// the serial console, at `path`, mode 0644.
fn bootable_qcow2(host: &TestHost, path: &std::path::Path, marker: &str) {
    let raw = host.dir.path().join("fixture.raw");
    vmhost_tests::boot_sector::write_image(&raw, &vmhost_tests::boot_sector::serial_print(marker));
    run_ok(Command::new("qemu-img").args(["convert", "-q", "-f", "raw", "-O", "qcow2"]).arg(&raw).arg(path));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

fn import_spec(name: &str, file: &str, disk_gib: Option<u64>) -> Value {
    let mut boot = json!({ "disk": file });
    if let Some(g) = disk_gib {
        boot["disk_gib"] = json!(g);
    }
    json!({"name": name, "cpu": 1, "memory_mib": 128, "boot": boot})
}

#[test]
fn an_existing_disk_is_imported_as_the_root_disk_and_goes_with_the_vm() {
    let host = host();
    let import = host.state().join("import");
    assert!(import.is_dir(), "vmhostd makes the default import directory");
    let disk = import.join("old-vm.qcow2");
    bootable_qcow2(&host, &disk, "VMHOST-ROOT-DISK-BOOTED");
    let ino = std::fs::metadata(&disk).unwrap().ino();

    // Refused before anything is recorded or made: a missing file, a qcow2 over a backing
    // file (left exactly as it was), a symlink.
    let overlay = import.join("overlay.qcow2");
    run_ok(
        Command::new("qemu-img").args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"]).arg(&disk).arg(&overlay),
    );
    let before = (std::fs::read(&overlay).unwrap(), std::fs::metadata(&overlay).unwrap().modified().unwrap());
    std::os::unix::fs::symlink(&disk, import.join("link.qcow2")).unwrap();
    for (file, needle) in
        [("missing.qcow2", "no file"), ("overlay.qcow2", "flatten it first"), ("link.qcow2", "symbolic link")]
    {
        let (code, e) = host.call_err("vm.create", json!({ "spec": import_spec("moved", file, None) }));
        assert_eq!((code, e.field.as_deref()), (2001, Some("spec.boot.disk")), "{file}: {e:?}");
        assert!(e.message.contains(needle), "{file}: {}", e.message);
        assert_eq!(host.call_err("vm.get", json!({ "name": "moved" })).0, 4040, "{file}: no record");
        assert!(!host.state().join("disks").join("moved").exists(), "{file}: nothing made");
    }
    assert_eq!(
        (std::fs::read(&overlay).unwrap(), std::fs::metadata(&overlay).unwrap().modified().unwrap()),
        before,
        "the refused overlay is untouched"
    );
    assert!(disk.is_file());
    // A disk_gib below the disk's size (1 MiB is not; a 2 GiB disk is bigger than 1 GiB).
    let big = import.join("big.qcow2");
    run_ok(Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(&big).arg("2G"));
    let (code, e) = host.call_err("vm.create", json!({ "spec": import_spec("moved", "big.qcow2", Some(1)) }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.boot.disk_gib")), "{e:?}");
    assert!(big.is_file());

    // Imported: moved (same inode) into the VM's disk directory, private, grown to 1 GiB, and
    // the BIOS boots it as the VM's boot disk.
    let v = host.call("vm.create", json!({ "spec": import_spec("moved", "old-vm.qcow2", Some(1)) }));
    assert_eq!(v["vm"]["status"], "running", "{v}");
    assert!(host.wait_serial("moved", "VMHOST-ROOT-DISK-BOOTED", BOOT), "{}", host.serial("moved"));
    assert!(!disk.exists(), "no longer in the import directory");
    let root = data_disk(&host, "moved", "root.qcow2");
    let meta = std::fs::metadata(&root).unwrap();
    assert_eq!((meta.ino(), meta.uid(), meta.permissions().mode() & 0o777), (ino, 0, 0o600));
    let dir_mode = std::fs::metadata(root.parent().unwrap()).unwrap().permissions().mode() & 0o777;
    assert_eq!(dir_mode, 0o700);
    assert_eq!(image_info(&root)["virtual-size"], 1u64 << 30);
    let pid = v["vm"]["pid"].as_i64().unwrap();
    let argv = vmhost_tests::argv_of(pid);
    let devices: Vec<&String> = argv.iter().filter(|a| a.starts_with("virtio-blk-pci")).collect();
    assert_eq!(devices, ["virtio-blk-pci,drive=virtio0,id=boot-disk"], "the boot disk and no seed");
    let drive = vmhost_tests::value_after(&argv, "-drive");
    assert!(drive.contains(",id=virtio0,format=qcow2,") && !drive.contains("backing"), "{drive}");
    assert!(!argv.iter().any(|a| a == "-kernel"));

    // disk_gib grows it live: same QEMU, the file's virtual size follows.
    let v = host.call("vm.apply", json!({ "spec": import_spec("moved", "old-vm.qcow2", Some(2)) }));
    assert_eq!(v["vm"]["pid"], pid, "grown live: {v}");
    assert_eq!(image_info(&root)["virtual-size"], 2u64 << 30);
    // Another file is never swapped in; a smaller size is refused.
    let (code, e) =
        host.call_err("vm.apply", json!({ "spec": import_spec("moved", "big.qcow2", Some(2)), "replace": true }));
    assert_eq!((code, e.field.as_deref()), (2002, Some("spec.boot.disk")), "{e:?}");
    let (code, e) = host.call_err("vm.apply", json!({ "spec": import_spec("moved", "old-vm.qcow2", Some(1)) }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.boot.disk_gib")), "{e:?}");
    assert!(big.is_file(), "the other file stays where it is");

    // Stop and start keep it (the guest boots from it again); host.info counts it.
    host.call("vm.stop", json!({ "name": "moved", "timeout_s": 1 }));
    host.call("vm.start", json!({ "name": "moved" }));
    host.wait_serial_count("moved", "VMHOST-ROOT-DISK-BOOTED", 2, BOOT);
    assert_eq!(std::fs::metadata(&root).unwrap().ino(), ino);
    let info = host.call("host.info", json!({}));
    assert_eq!(info["storage"]["provisioned_bytes"], 2u64 << 30, "{info}");

    // Destroy deletes it: the operator asked to destroy the VM.
    host.call("vm.destroy", json!({ "name": "moved" }));
    assert!(!root.exists());
    assert!(!host.state().join("disks").join("moved").exists());
    assert!(!disk.exists(), "not given back either");
}

/// More new disks than spare root ports: QEMU cannot take them live, so the change waits for
/// the next start with `restart: false`, and restarts the VM with `restart: true`; nothing is
/// made or attached half-way.
#[test]
fn more_new_disks_than_spare_ports_wait_for_a_restart_or_take_one() {
    let host = host();
    host.call("vm.create", json!({ "spec": disk_spec(&host, "many", json!([]), "") }));
    assert!(disk_report(&host, "many", 1).is_empty());
    let pid = host.call("vm.get", json!({ "name": "many" }))["pid"].clone();
    let five = json!((0..5).map(|i| json!({"name": format!("d{i}"), "size_gib": 1})).collect::<Vec<_>>());
    let spec = disk_spec(&host, "many", five, "");
    let v = host.call("vm.apply", json!({ "spec": spec, "restart": false, "timeout_s": 5 }));
    assert_eq!((&v["vm"]["pid"], &v["vm"]["pending_restart"]), (&pid, &json!(true)), "{v}");
    assert!(!host.state().join("disks").join("many").exists(), "nothing made for a change that waits");
    let v = host.call("vm.apply", json!({ "spec": spec, "timeout_s": 5 }));
    assert_ne!(v["vm"]["pid"], pid, "restarted: {v}");
    assert_eq!(v["vm"]["pending_restart"], false, "{v}");
    let report = disk_report(&host, "many", 2);
    assert_eq!(report.iter().map(|r| r.1.as_str()).collect::<Vec<_>>(), ["d0", "d1", "d2", "d3", "d4"], "{report:?}");
}
