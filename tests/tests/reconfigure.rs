//! Day-2 changes without data loss (docs/lifecycle.md, "Changing a VM"): `vm.apply` of an
//! existing VM changes it in place and keeps its disk; only a new `boot.image` needs
//! `replace: true`. An image-booted VM gets a marker written into its overlay with `qemu-io`
//! before it first starts; every check reads the marker back and compares the overlay's inode.
//!
//! The base image is empty (QEMU runs, the guest has no OS), so stops use `timeout_s: 1` and end
//! with a kill, as they would for a guest that ignores ACPI.

use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::Command;
use vmhost_tests::{run_ok, HostOptions, TestHost};

/// Offset and pattern of the marker.
const MARKER_AT: &str = "1M";
const MARKER_LEN: &str = "64k";
const PATTERN: &str = "0xa5";

fn host(cpu: u32, extra: &str) -> TestHost {
    let host =
        TestHost::start(HostOptions { cpu, memory_gib: 4, netns: true, extra: extra.into(), ..HostOptions::default() });
    run_ok(
        Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(host.images().join("base.qcow2")).arg("64M"),
    );
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(host.images().join("other.qcow2"))
            .arg("64M"),
    );
    host
}

fn spec(name: &str) -> Value {
    json!({"name": name, "cpu": 1, "memory_mib": 128, "boot": {"image": "base.qcow2", "disk_gib": 1}})
}

fn overlay(host: &TestHost, name: &str) -> PathBuf {
    host.state().join("disks").join(format!("{name}.qcow2"))
}

/// Defines `name` stopped, writes the marker into its fresh overlay, starts it.
fn create_with_marker(host: &TestHost, spec: &Value) -> u64 {
    let name = spec["name"].as_str().unwrap();
    let mut stopped = spec.clone();
    stopped["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": stopped }));
    let disk = overlay(host, name);
    let write = format!("write -P {PATTERN} {MARKER_AT} {MARKER_LEN}");
    run_ok(Command::new("qemu-io").args(["-f", "qcow2", "-c", &write]).arg(&disk));
    host.call("vm.start", json!({ "name": name }));
    std::fs::metadata(&disk).unwrap().ino()
}

/// The marker is still there (read while QEMU may hold the image: `-U`).
fn assert_marker(host: &TestHost, name: &str) {
    let read = format!("read -P {PATTERN} {MARKER_AT} {MARKER_LEN}");
    let out = run_ok(Command::new("qemu-io").args(["-U", "-r", "-f", "qcow2", "-c", &read]).arg(overlay(host, name)));
    assert!(!out.contains("Pattern verification failed"), "marker lost: {out}");
    assert!(out.contains("read 65536/65536 bytes"), "{out}");
}

fn view(host: &TestHost, name: &str) -> Value {
    host.call("vm.get", json!({ "name": name }))
}

fn virtual_size(host: &TestHost, name: &str) -> u64 {
    let out = run_ok(Command::new("qemu-img").args(["info", "-U", "--output=json"]).arg(overlay(host, name)));
    serde_json::from_str::<Value>(&out).unwrap()["virtual-size"].as_u64().unwrap()
}

#[test]
fn cpu_and_memory_change_in_place_keeping_the_disk() {
    let host = host(8, "");
    let ino = create_with_marker(&host, &spec("sensor"));
    let before = view(&host, "sensor");
    let old_pid = before["pid"].as_i64().unwrap();
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(old_pid), "-m"), "128");

    let mut changed = spec("sensor");
    changed["cpu"] = json!(2);
    changed["memory_mib"] = json!(256);
    let r = host.call("vm.apply", json!({ "spec": changed, "timeout_s": 1 }));
    assert_eq!(r["changed"], true);
    assert_eq!(r["vm"]["status"], "running", "{r}");
    assert_eq!(r["vm"]["pending_restart"], false);
    let pid = r["vm"]["pid"].as_i64().unwrap();
    assert_ne!(pid, old_pid, "restarted");
    let argv = vmhost_tests::argv_of(pid);
    assert_eq!(
        (vmhost_tests::value_after(&argv, "-smp"), vmhost_tests::value_after(&argv, "-m")),
        ("2".into(), "256".into())
    );
    assert_eq!(std::fs::metadata(overlay(&host, "sensor")).unwrap().ino(), ino, "same overlay inode");
    assert_marker(&host, "sensor");
    assert_eq!(host.qemu_pids().len(), 1, "one QEMU");

    // restart: false records the change for the next start; the VM keeps running as it was.
    let mut later = changed.clone();
    later["memory_mib"] = json!(384);
    let r = host.call("vm.apply", json!({ "spec": later, "restart": false }));
    assert_eq!((r["vm"]["pid"].as_i64(), r["vm"]["pending_restart"].clone()), (Some(pid), json!(true)));
    assert_eq!(r["vm"]["spec"]["memory_mib"], 384);
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(pid), "-m"), "256", "the running QEMU is untouched");
    let r = host.call("vm.restart", json!({ "name": "sensor", "timeout_s": 1 }));
    let newest = r["vm"]["pid"].as_i64().unwrap();
    assert_ne!(newest, pid);
    assert_eq!(r["vm"]["pending_restart"], false);
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(newest), "-m"), "384", "the next start applied it");
    assert_eq!(std::fs::metadata(overlay(&host, "sensor")).unwrap().ino(), ino);
    assert_marker(&host, "sensor");
    host.call("vm.destroy", json!({ "name": "sensor" }));
}

#[test]
fn refusals_leave_the_vm_running_as_it_was() {
    // 4 CPUs, 1 reserved: 3 allocatable; "other" holds 2.
    let host = host(4, "");
    let mut other = spec("other");
    other["cpu"] = json!(2);
    other["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": other }));
    let mut keep = spec("keep");
    keep["boot"]["disk_gib"] = json!(2);
    let ino = create_with_marker(&host, &keep);
    let before = view(&host, "keep");

    let mut too_big = keep.clone();
    too_big["cpu"] = json!(2);
    let (code, e) = host.call_err("vm.apply", json!({ "spec": too_big }));
    assert_eq!(code, 3002, "{e:?}");
    let mut new_image = keep.clone();
    new_image["boot"]["image"] = json!("other.qcow2");
    let (code, e) = host.call_err("vm.apply", json!({ "spec": new_image }));
    assert_eq!((code, e.field.as_deref()), (2002, Some("spec.boot.image")), "{e:?}");
    assert_eq!(e.details["fields"], json!(["boot.image"]));
    let mut smaller = keep.clone();
    smaller["boot"]["disk_gib"] = json!(1);
    let (code, e) = host.call_err("vm.apply", json!({ "spec": smaller }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.boot.disk_gib")), "{e:?}");

    let after = view(&host, "keep");
    assert_eq!((after["pid"].clone(), after["spec"].clone()), (before["pid"].clone(), before["spec"].clone()));
    assert_eq!(after["status"], "running");
    assert_eq!(std::fs::metadata(overlay(&host, "keep")).unwrap().ino(), ino);
    assert_marker(&host, "keep");
}

#[test]
fn a_larger_disk_grows_live_and_offline() {
    let host = host(8, "");
    let ino = create_with_marker(&host, &spec("grow"));
    let pid = view(&host, "grow")["pid"].clone();
    assert_eq!(virtual_size(&host, "grow"), 1 << 30);
    let mut bigger = spec("grow");
    bigger["boot"]["disk_gib"] = json!(2);
    let r = host.call("vm.apply", json!({ "spec": bigger }));
    assert_eq!(r["vm"]["pid"], pid, "a disk grows without a restart");
    assert_eq!(r["vm"]["pending_restart"], false);
    assert_eq!(virtual_size(&host, "grow"), 2 << 30, "QMP block_resize grew it");

    host.call("vm.stop", json!({ "name": "grow", "timeout_s": 1 }));
    bigger["boot"]["disk_gib"] = json!(3);
    bigger["state"] = json!("stopped");
    let r = host.call("vm.apply", json!({ "spec": bigger }));
    assert_eq!(r["vm"]["status"], "stopped");
    assert_eq!(virtual_size(&host, "grow"), 3 << 30, "qemu-img resize grew it");
    assert_eq!(std::fs::metadata(overlay(&host, "grow")).unwrap().ino(), ino);
    assert_marker(&host, "grow");
}

#[test]
fn a_failed_restart_rolls_back_to_the_old_spec() {
    // A network whose bridge does not exist: admitted (it is configured), but the tap cannot be
    // attached, so the start with the new spec fails after the stop.
    let host = host(8, "[networks.void]\nbridge = \"br-void-none\"\n");
    let ino = create_with_marker(&host, &spec("rb"));
    let old_pid = view(&host, "rb")["pid"].as_i64().unwrap();
    let mut broken = spec("rb");
    broken["memory_mib"] = json!(256);
    broken["nics"] = json!([{ "network": "void" }]);
    let (code, e) = host.call_err("vm.apply", json!({ "spec": broken, "timeout_s": 1 }));
    assert_eq!(code, 4001, "{e:?}");
    assert!(e.message.contains("runs again with its previous spec"), "{}", e.message);
    assert_eq!(e.details["rolled_back"], true);
    let after = view(&host, "rb");
    assert_eq!(after["status"], "running", "{after}");
    assert_eq!(after["spec"]["memory_mib"], 128);
    assert!(after["spec"]["nics"].as_array().is_none_or(Vec::is_empty), "{after}");
    let pid = after["pid"].as_i64().unwrap();
    assert_ne!(pid, old_pid);
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(pid), "-m"), "128");
    assert_eq!(std::fs::metadata(overlay(&host, "rb")).unwrap().ino(), ino);
    assert_marker(&host, "rb");
}

#[test]
fn a_change_sent_with_state_stopped_stops_the_vm_and_keeps_the_disk() {
    let host = host(8, "");
    let ino = create_with_marker(&host, &spec("halt"));
    let pid = view(&host, "halt")["pid"].as_i64().unwrap() as i32;
    let mut changed = spec("halt");
    changed["memory_mib"] = json!(256);
    changed["state"] = json!("stopped");
    let r = host.call("vm.apply", json!({ "spec": changed, "timeout_s": 1 }));
    assert_eq!(
        (r["vm"]["status"].as_str(), r["vm"]["desired_state"].as_str()),
        (Some("stopped"), Some("stopped")),
        "{r}"
    );
    assert_eq!(r["vm"]["spec"]["memory_mib"], 256);
    assert!(!vmhost_tests::alive(pid), "stopped, not restarted");
    assert!(host.qemu_pids().is_empty());
    assert_eq!(std::fs::metadata(overlay(&host, "halt")).unwrap().ino(), ino);
    assert_marker(&host, "halt");
}

#[test]
fn a_pending_change_stays_pending_through_a_disk_only_change() {
    let host = host(8, "");
    create_with_marker(&host, &spec("later"));
    let pid = view(&host, "later")["pid"].clone();
    let mut more = spec("later");
    more["memory_mib"] = json!(256);
    let r = host.call("vm.apply", json!({ "spec": more, "restart": false }));
    assert_eq!(r["vm"]["pending_restart"], true);
    // Only the disk grows now (live): the memory change still waits for a restart.
    more["boot"]["disk_gib"] = json!(2);
    let r = host.call("vm.apply", json!({ "spec": more, "restart": false }));
    assert_eq!((r["vm"]["pid"].clone(), r["vm"]["pending_restart"].clone()), (pid, json!(true)), "{r}");
    // And applying it with the default restart: true applies the pending change.
    let r = host.call("vm.apply", json!({ "spec": more, "timeout_s": 1 }));
    assert_eq!(r["vm"]["pending_restart"], false, "{r}");
    let new_pid = r["vm"]["pid"].as_i64().unwrap();
    assert_eq!(vmhost_tests::value_after(&vmhost_tests::argv_of(new_pid), "-m"), "256");
    assert_marker(&host, "later");
}

#[test]
fn a_pending_change_holds_the_larger_of_the_two_specs_not_their_sum() {
    // 4 CPUs, 1 reserved: 3 to hand out.
    let host = host(4, "");
    create_with_marker(&host, &spec("grow"));
    let mut more = spec("grow");
    more["cpu"] = json!(2);
    more["memory_mib"] = json!(256);
    let r = host.call("vm.apply", json!({ "spec": more, "restart": false }));
    assert_eq!(r["vm"]["pending_restart"], true, "{r}");
    // Its QEMU runs with 1 CPU and 128 MiB, the restart will need 2 and 256: it holds 2 and 256,
    // never 3 and 384.
    let info = host.call("host.info", json!({}));
    assert_eq!((&info["cpu"]["allocated"], &info["memory_mib"]["allocated"]), (&json!(2), &json!(256)), "{info}");
    let mut two = spec("other");
    two["cpu"] = json!(2);
    let (code, e) = host.call_err("vm.create", json!({ "spec": two }));
    assert_eq!((code, e.field.as_deref(), e.details["available"].as_u64()), (3002, Some("spec.cpu"), Some(1)), "{e:?}");
    let r = host.call("vm.create", json!({ "spec": spec("other") }));
    assert_eq!(r["vm"]["spec"]["cpu"], 1, "the CPU left is there to take: {r}");
}
