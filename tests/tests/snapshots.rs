//! Snapshots (docs/snapshots.md): a running guest's data disk snapshotted with a marker, the
//! marker overwritten, the VM stopped and reverted: the guest reads the first marker again; an
//! image VM's overlay snapshotted while stopped, overwritten so it no longer boots, reverted and
//! booting again; a tampered snapshot refused with the VM's disks untouched; a destroy removes
//! the snapshots.

use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;
use vmhost_tests::{boot_sector, disk_report, disk_spec, run_ok, HostOptions, TestHost};

const BOOT: Duration = Duration::from_secs(120);

fn host() -> TestHost {
    TestHost::start(HostOptions { memory_gib: 4, ..HostOptions::default() })
}

fn marks(host: &TestHost, vm: &str, boot: usize) -> Vec<String> {
    disk_report(host, vm, boot, BOOT).into_iter().map(|(_, serial, _, mark)| format!("{serial}={mark}")).collect()
}

fn names(list: &Value) -> Vec<&str> {
    list.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect()
}

#[test]
fn a_guest_reads_its_first_marker_again_after_a_revert_of_a_live_snapshot() {
    let host = host();
    let disks = json!([{"name": "nsm", "size_gib": 1, "format": "raw"}, {"name": "logs", "size_gib": 1}]);
    host.call("vm.create", json!({ "spec": disk_spec(&host, "db", disks.clone(), "vmhost.writemark=nsm:first") }));
    assert_eq!(marks(&host, "db", 1), ["nsm=first", "logs=-"]);

    let s = host.call("vm.snapshot", json!({"name": "db", "snapshot": "s1"}));
    assert_eq!((&s["live"], &s["name"]), (&json!(true), &json!("s1")), "{s}");
    let files: Vec<&str> = s["disks"].as_array().unwrap().iter().map(|d| d["file"].as_str().unwrap()).collect();
    assert_eq!(files, ["nsm.raw", "logs.qcow2"]);
    let (code, e) = host.call_err("vm.snapshot", json!({"name": "db", "snapshot": "s1"}));
    assert_eq!((code, e.field.as_deref()), (2001, Some("snapshot")), "taken");
    assert_eq!(host.call_err("vm.snapshot", json!({"name": "db", "snapshot": "../x"})).0, 2001);

    // The guest overwrites its marker.
    host.call(
        "vm.apply",
        json!({ "spec": disk_spec(&host, "db", disks.clone(), "vmhost.writemark=nsm:second"), "timeout_s": 5 }),
    );
    assert_eq!(marks(&host, "db", 2), ["nsm=second", "logs=-"]);
    let (code, _) = host.call_err("vm.revert", json!({"name": "db", "snapshot": "s1"}));
    assert_eq!(code, 4090, "a running VM is not reverted");

    host.call("vm.stop", json!({"name": "db", "force": true}));
    // The spec no longer writes a marker; the disks are the snapshot's.
    let mut quiet = disk_spec(&host, "db", disks.clone(), "");
    quiet["state"] = json!("stopped");
    host.call("vm.apply", json!({ "spec": quiet }));
    let v = host.call("vm.revert", json!({"name": "db", "snapshot": "s1"}));
    assert_eq!(v["vm"]["status"], "stopped", "{v}");
    host.call("vm.start", json!({"name": "db"}));
    assert_eq!(marks(&host, "db", 3), ["nsm=first", "logs=-"], "the first marker again");

    // Listed, deleted, gone with the VM.
    host.call("vm.snapshot", json!({"name": "db", "snapshot": "s2"}));
    assert_eq!(names(&host.call("vm.snapshots", json!({"name": "db"}))), ["s1", "s2"]);
    let out = host.ctl(&["snapshots", "db"]);
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(table.lines().any(|l| l.starts_with("s2 ")) && table.contains("true"), "{table}");
    let out = host.ctl(&["snapshot", "db", "s3"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("db: snapshot s3 taken (live)"), "{out:?}");
    let out = host.ctl(&["snapshot-delete", "db", "s3"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("db: snapshot s3 deleted"), "{out:?}");
    assert_eq!(host.call("vm.snapshot_delete", json!({"name": "db", "snapshot": "s1"}))["changed"], true);
    assert_eq!(host.call_err("vm.revert", json!({"name": "db", "snapshot": "s1"})).0, 4040);
    let dir = host.state().join("snapshots").join("db");
    assert!(dir.join("s2").join("snapshot.json").is_file());
    host.call("vm.destroy", json!({"name": "db"}));
    assert!(!dir.exists(), "a destroy removes the VM's snapshots");
}

#[test]
fn an_image_vms_overlay_is_put_back_and_a_tampered_snapshot_changes_nothing() {
    let host = host();
    boot_sector::write_image(&host.images().join("base.raw"), &boot_sector::serial_print("VMHOST-SNAP-BOOT"));
    let spec = json!({"name": "web", "cpu": 1, "memory_mib": 64, "boot": {"image": "base.raw", "disk_gib": 1}});
    host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial("web", "VMHOST-SNAP-BOOT", BOOT), "{}", host.serial("web"));
    host.call("vm.stop", json!({"name": "web", "force": true}));
    let s = host.call("vm.snapshot", json!({"name": "web", "snapshot": "good"}));
    assert_eq!((&s["live"], &s["disks"][0]["file"]), (&json!(false), &json!("root.qcow2")), "{s}");

    // The VM's disk changes (its boot sector zeroed in the overlay): it no longer boots.
    let overlay = host.state().join("disks").join("web.qcow2");
    run_ok(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write -z 0 512"]).arg(&overlay));
    let before = std::fs::read(&overlay).unwrap();

    // A snapshot file one byte of which changed: refused, the VM's disk as it was.
    let copy = host.state().join("snapshots/web/good/root.qcow2");
    let mut data = std::fs::read(&copy).unwrap();
    let last = data.len() - 1;
    data[last] ^= 0xff;
    std::fs::write(&copy, &data).unwrap();
    let (code, e) = host.call_err("vm.revert", json!({"name": "web", "snapshot": "good"}));
    assert_eq!((code, e.details["file"].as_str()), (2003, Some("root.qcow2")), "{e:?}");
    assert_eq!(std::fs::read(&overlay).unwrap(), before, "nothing reverted");
    data[last] ^= 0xff;
    std::fs::write(&copy, &data).unwrap();

    host.call("vm.revert", json!({"name": "web", "snapshot": "good"}));
    assert_ne!(std::fs::read(&overlay).unwrap(), before);
    let marker_count = |h: &TestHost| h.serial("web").matches("VMHOST-SNAP-BOOT").count();
    let seen = marker_count(&host);
    host.call("vm.start", json!({"name": "web"}));
    let deadline = std::time::Instant::now() + BOOT;
    while marker_count(&host) == seen {
        assert!(std::time::Instant::now() < deadline, "no boot after the revert: {}", host.serial("web"));
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn the_guest_agent_freezes_the_guests_file_systems_around_a_live_copy() {
    let host = host();
    let g = vmhost_tests::agent_guest();
    let spec = json!({"name": "ag", "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"},
        "disks": [{"name": "nsm", "size_gib": 1, "format": "raw"}]});
    host.call("vm.create", json!({ "spec": spec }));
    let deadline = std::time::Instant::now() + BOOT;
    while host.call("vm.get", json!({"name": "ag"}))["agent"]["connected"] != true {
        assert!(std::time::Instant::now() < deadline, "no agent: {}", host.serial("ag"));
        std::thread::sleep(Duration::from_millis(200));
    }
    let s = host.call("vm.snapshot", json!({"name": "ag", "snapshot": "quiet"}));
    // The test guest's root is its initramfs: nothing on a block device to freeze (the agent's
    // kernel test freezes a real ext4); the agent says what it did on the console.
    assert_eq!((&s["live"], &s["frozen"]), (&json!(true), &json!([])), "{s}");
    assert!(host.wait_serial("ag", "fs.thaw: thawed", BOOT), "{}", host.serial("ag"));
    let log = host.serial("ag");
    let (freeze, thaw) = (log.find("fs.freeze: froze").unwrap(), log.find("fs.thaw: thawed").unwrap());
    assert!(freeze < thaw, "frozen, then thawed: {log}");
    let e = host.call("vm.export", json!({"name": "ag"}));
    assert_eq!(e["manifest"]["frozen"], json!([]), "{e}");
    let deadline = std::time::Instant::now() + BOOT;
    while host.serial("ag").matches("fs.thaw: thawed").count() < 2 {
        assert!(std::time::Instant::now() < deadline, "the export froze and thawed too: {}", host.serial("ag"));
        std::thread::sleep(Duration::from_millis(200));
    }
}
