//! End to end through the socket: real vmhostd, real QEMU (TCG), real guest kernel.

use serde_json::{json, Value};
use std::time::Duration;
use vmhost_tests::{alive, wait, HostOptions, TestHost, GUEST_READY};

const BOOT: Duration = Duration::from_secs(90);

fn names(list: &Value) -> Vec<String> {
    list.as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap().to_string()).collect()
}

#[test]
fn create_stop_start_destroy_with_a_real_guest() {
    let host = TestHost::start(HostOptions::default());
    let spec = host.kernel_spec("alpha");
    let created = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(created["changed"], true);
    assert_eq!(created["vm"]["status"], "running");
    let pid = created["vm"]["pid"].as_i64().unwrap() as i32;
    assert!(alive(pid));
    assert!(host.wait_serial("alpha", GUEST_READY, BOOT), "guest never reached userspace:\n{}", host.serial("alpha"));
    assert!(host.run().join("alpha/qmp").exists());
    assert!(host.run().join("alpha/agent").exists(), "agent chardev socket");

    // Graceful stop: the test guest runs acpid, so ACPI powerdown ends QEMU by itself.
    let stopped = host.call("vm.stop", json!({ "name": "alpha", "timeout_s": 30 }));
    assert_eq!(stopped["changed"], true);
    assert_eq!(stopped["vm"]["status"], "stopped");
    assert_eq!(stopped["vm"]["desired_state"], "stopped");
    assert!(!alive(pid));
    assert!(!host.run().join("alpha").exists(), "run dir removed on stop");
    assert!(host.serial("alpha").contains("VMHOST-GUEST-POWEROFF"), "stop went through ACPI");
    let again = host.call("vm.stop", json!({ "name": "alpha" }));
    assert_eq!(again["changed"], false);

    let started = host.call("vm.start", json!({ "name": "alpha" }));
    assert_eq!(started["vm"]["status"], "running");
    let pid2 = started["vm"]["pid"].as_i64().unwrap() as i32;
    assert_ne!(pid, pid2);
    assert_eq!(host.call("vm.start", json!({ "name": "alpha" }))["changed"], false, "never started twice");
    assert_eq!(host.qemu_pids(), vec![pid2]);

    let destroyed = host.call("vm.destroy", json!({ "name": "alpha" }));
    assert_eq!(destroyed, json!({ "changed": true, "vm": null }));
    assert!(!alive(pid2));
    assert!(host.qemu_pids().is_empty());
    assert!(!host.state().join("vms/alpha.json").exists());
    assert!(!host.state().join("logs/alpha.serial.log").exists());
    let (code, _) = host.call_err("vm.get", json!({ "name": "alpha" }));
    assert_eq!(code, 4040);
}

#[test]
fn two_vms_at_once_then_capacity_and_conflicts_are_refused() {
    // 5 CPUs - 1 reserved = 4 allocatable; sfp 5 and 6 exist in the model (not on this machine:
    // the VM holding sfp 5 stays stopped, so nothing is passed through).
    let host = TestHost::start(HostOptions {
        cpu: 5,
        extra: "[hardware.sfp]\n5 = \"0000:ca:00.0\"\n6 = \"0000:ca:00.1\"\n".into(),
        ..HostOptions::default()
    });
    let mut holder = host.kernel_spec("holder");
    holder["hardware"] = json!({ "sfp": [5] });
    holder["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": holder }));
    let a = host.kernel_spec("vm-a");
    let mut b = host.kernel_spec("vm-b");
    b["cpu"] = json!(2);
    // Create both concurrently, over two connections.
    let (ra, rb) = std::thread::scope(|s| {
        let ha = s.spawn(|| host.call("vm.create", json!({ "spec": a })));
        let hb = s.spawn(|| host.call("vm.create", json!({ "spec": b })));
        (ha.join().unwrap(), hb.join().unwrap())
    });
    assert_eq!(ra["vm"]["status"], "running");
    assert_eq!(rb["vm"]["status"], "running");
    assert!(host.wait_serial("vm-a", GUEST_READY, BOOT));
    assert!(host.wait_serial("vm-b", GUEST_READY, BOOT));
    assert_eq!(host.qemu_pids().len(), 2);

    let info = host.call("host.info", json!({}));
    assert_eq!(info["accel"], "tcg");
    assert_eq!(info["cpu"], json!({"total": 5, "reserved": 1, "allocated": 4, "available": 0}));
    let sfp5 = info["hardware"].as_array().unwrap().iter().find(|h| h["index"] == 5).unwrap().clone();
    assert_eq!(sfp5["holder"], "holder");
    assert_eq!(sfp5["pci"], "0000:ca:00.0");

    let before = std::fs::read_dir(host.state().join("vms")).unwrap().count();
    let (code, e) = host.call_err("vm.create", json!({ "spec": host.kernel_spec("vm-c") }));
    assert_eq!(code, 3002, "{e:?}");
    assert_eq!(e.field.as_deref(), Some("spec.cpu"));
    let mut c = host.kernel_spec("vm-c");
    c["cpu"] = json!(1);
    c["hardware"] = json!({ "sfp": [6, 5] });
    // Free CPUs so only the conflict remains.
    host.call("vm.destroy", json!({ "name": "vm-b" }));
    let (code, e) = host.call_err("vm.create", json!({ "spec": c }));
    assert_eq!(code, 3003);
    assert_eq!(
        e.details["conflicts"],
        json!([{"class": "sfp", "index": 5, "pci": "0000:ca:00.0", "holder": "holder"}])
    );
    let mut c = host.kernel_spec("vm-c");
    c["hardware"] = json!({ "sfp": [7] });
    assert_eq!(host.call_err("vm.create", json!({ "spec": c })).0, 3001);
    // Refusals changed nothing.
    assert_eq!(std::fs::read_dir(host.state().join("vms")).unwrap().count(), before - 1);
    assert_eq!(names(&host.call("vm.list", json!({}))), vec!["holder", "vm-a"]);
    assert_eq!(host.qemu_pids().len(), 1);
}

#[test]
fn apply_is_idempotent_and_reports_drift() {
    let host = TestHost::start(HostOptions::default());
    let mut spec = host.kernel_spec("app");
    spec["state"] = json!("stopped");
    let r = host.call("vm.apply", json!({ "spec": spec }));
    assert_eq!((r["changed"].clone(), r["vm"]["status"].clone()), (json!(true), json!("stopped")));
    assert!(host.qemu_pids().is_empty(), "a stopped spec launches nothing");
    let r = host.call("vm.apply", json!({ "spec": spec }));
    assert_eq!(r["changed"], false);
    spec["state"] = json!("running");
    let r = host.call("vm.apply", json!({ "spec": spec }));
    assert_eq!((r["changed"].clone(), r["vm"]["status"].clone()), (json!(true), json!("running")));
    assert_eq!(host.call("vm.apply", json!({ "spec": spec }))["changed"], false);

    // Anything but a new boot.image changes in place (a restart), without replace.
    let mut changed = spec.clone();
    changed["memory_mib"] = json!(320);
    changed["role"] = json!("sensor");
    let old_pid = host.call("vm.get", json!({"name": "app"}))["pid"].clone();
    let r = host.call("vm.apply", json!({ "spec": changed, "timeout_s": 1 }));
    assert_eq!(r["changed"], true);
    assert_eq!(r["vm"]["spec"]["memory_mib"], 320);
    assert_ne!(r["vm"]["pid"], old_pid);
    assert_eq!(host.qemu_pids().len(), 1);
    // A new boot.image needs replace (a new disk): 2002 naming the field, nothing touched.
    let mut imaged = changed.clone();
    imaged["boot"] = json!({ "image": "base.qcow2", "disk_gib": 1 });
    let pid = r["vm"]["pid"].clone();
    let (code, e) = host.call_err("vm.apply", json!({ "spec": imaged }));
    assert_eq!((code, e.field.as_deref()), (2002, Some("spec.boot.image")));
    assert_eq!(host.call("vm.get", json!({"name": "app"}))["pid"], pid);
}

#[test]
fn reconcile_plans_validates_the_set_and_converges() {
    // 5 CPUs - 1 reserved = 4 allocatable; stopped VMs hold their CPUs too.
    let host = TestHost::start(HostOptions { cpu: 5, ..HostOptions::default() });
    host.call("vm.create", json!({ "spec": host.kernel_spec("old") }));
    let mut big = host.kernel_spec("big");
    big["cpu"] = json!(3);
    let mut small = host.kernel_spec("small");
    small["state"] = json!("stopped");
    let desired = json!([small, big]);

    // Dry run without prune: "old" keeps its CPU, so "big" (3) does not fit next to old + small.
    let r = host.call("host.reconcile", json!({ "vms": desired, "dry_run": true }));
    assert_eq!(r["ok"], false);
    assert_eq!(r["results"], json!([]));
    let plan = r["plan"].as_array().unwrap();
    assert_eq!(plan[0]["action"], "create");
    assert_eq!(plan[0]["error"], Value::Null);
    assert_eq!(plan[1]["error"]["code"], 3002);
    assert_eq!(plan[2]["vm"], "old");
    assert_eq!(plan[2]["action"], "none");
    assert_eq!(names(&host.call("vm.list", json!({}))), vec!["old"], "dry run changed nothing");

    // With prune, "old" is destroyed first and the set fits.
    let r = host.call("host.reconcile", json!({ "vms": desired, "prune": true }));
    assert_eq!(r["ok"], true, "{r}");
    let results = r["results"].as_array().unwrap();
    assert!(results.iter().all(|x| x["ok"] == true && x["changed"] == true), "{r}");
    let list = host.call("vm.list", json!({}));
    assert_eq!(names(&list), vec!["big", "small"]);
    let status: Vec<_> = list.as_array().unwrap().iter().map(|v| v["status"].as_str().unwrap().to_string()).collect();
    assert_eq!(status, vec!["running", "stopped"]);

    // A second run is a no-op; one bad VM does not stop the others.
    let mut bad = host.kernel_spec("bad");
    bad["hardware"] = json!({ "disk": [1] });
    let mut small_running = host.kernel_spec("small");
    small_running["state"] = json!("running");
    let mut big2 = host.kernel_spec("big");
    big2["cpu"] = json!(2);
    let r = host.call("host.reconcile", json!({ "vms": [small_running, big2, bad], "prune": true }));
    assert_eq!(r["ok"], false);
    let by_vm = |n: &str| r["results"].as_array().unwrap().iter().find(|x| x["vm"] == n).unwrap().clone();
    assert_eq!(by_vm("bad")["error"]["code"], 3001);
    assert_eq!(by_vm("small")["ok"], true);
    assert_eq!(by_vm("big")["action"], "reconfigure");
    assert_eq!(by_vm("big")["ok"], true);
    let r = host.call("host.reconcile", json!({ "vms": [small_running, big2], "prune": true }));
    assert!(r["plan"].as_array().unwrap().iter().all(|p| p["action"] == "none"), "{r}");
}

#[test]
fn events_report_state_changes_and_a_killed_qemu_is_dead() {
    let host = TestHost::start(HostOptions::default());
    let mut sub = host.client();
    sub.subscribe_events().expect("subscribe");
    // restart_policy never: a killed QEMU stays dead (tests/tests/restart_policy.rs covers restarts).
    let mut ev = host.kernel_spec("ev");
    ev["restart_policy"] = json!("never");
    host.call("vm.create", json!({ "spec": ev }));
    let mut seen = Vec::new();
    while let Some(e) = sub.next_event(Duration::from_secs(10)).expect("event") {
        seen.push((e.from.map(|s| s.to_string()), e.to.map(|s| s.to_string())));
        if e.to.map(|s| s.to_string()).as_deref() == Some("running") {
            break;
        }
    }
    assert_eq!(seen.first().unwrap(), &(None, Some("creating".to_string())));
    assert_eq!(seen, vec![(None, Some("creating".to_string())), (Some("creating".into()), Some("running".into()))]);

    let pid = host.call("vm.get", json!({ "name": "ev" }))["pid"].as_i64().unwrap() as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let e = sub.next_event(Duration::from_secs(20)).expect("event").expect("a dead event");
    assert_eq!(
        (e.vm.as_str(), e.from.map(|s| s.to_string()), e.to.map(|s| s.to_string())),
        ("ev", Some("running".into()), Some("dead".into()))
    );
    let v = host.wait_status("ev", "dead", Duration::from_secs(5));
    assert_eq!(v["pid"], Value::Null);
    assert!(v["last_error"]["message"].as_str().unwrap().contains("exited unexpectedly"));
    // The exit is recorded first, then the run dir goes, under the VM's busy flag: a start
    // meanwhile is 4090 (it would otherwise lose its new run dir and taps to that cleanup).
    let started = wait::until("ev's exit handling to end (vm.start not 4090)", Duration::from_secs(60), || match host
        .client()
        .call::<Value>("vm.start", json!({ "name": "ev" }))
    {
        Ok(v) => Ok(v),
        Err(vmhost::client::ClientError::Api(e)) if e.code.as_i32() == 4090 => Err(e.to_string()),
        Err(e) => panic!("vm.start: {e}"),
    });
    // A dead VM can be started again.
    assert_eq!(started["vm"]["status"], "running");
}

#[test]
fn vms_survive_a_daemon_kill_and_are_adopted() {
    // Autostart off: this test is about adoption and recording deaths (tests/tests/autostart.rs
    // covers starting the dead ones again).
    let mut host =
        TestHost::start(HostOptions { extra: "[lifecycle]\nautostart = false\n".into(), ..HostOptions::default() });
    let never = |name: &str| {
        let mut s = host.kernel_spec(name);
        s["restart_policy"] = json!("never");
        s
    };
    host.call("vm.create", json!({ "spec": never("keep") }));
    host.call("vm.create", json!({ "spec": never("gone") }));
    let keep = host.call("vm.get", json!({ "name": "keep" }))["pid"].as_i64().unwrap() as i32;
    let gone = host.call("vm.get", json!({ "name": "gone" }))["pid"].as_i64().unwrap() as i32;
    assert!(host.wait_serial("keep", GUEST_READY, BOOT));

    host.kill_daemon();
    assert!(alive(keep), "QEMU outlives a kill -9 of vmhostd");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(gone), nix::sys::signal::Signal::SIGKILL).unwrap();
    host.spawn_daemon();

    let v = host.call("vm.get", json!({ "name": "keep" }));
    assert_eq!(v["status"], "running");
    assert_eq!(v["pid"], keep, "adopted, not restarted");
    let v = host.call("vm.get", json!({ "name": "gone" }));
    assert_eq!(v["status"], "dead");
    assert_eq!(host.qemu_pids(), vec![keep], "nothing started twice");
    assert!(host.daemon_log().contains("re-adopted running VM"));

    // The adopted VM is fully manageable: stop goes through its QMP socket.
    let r = host.call("vm.stop", json!({ "name": "keep", "timeout_s": 30 }));
    assert_eq!(r["vm"]["status"], "stopped");
    assert!(!alive(keep));
    // And a clean SIGTERM leaves VMs running too.
    host.call("vm.start", json!({ "name": "keep" }));
    let pid = host.call("vm.get", json!({ "name": "keep" }))["pid"].as_i64().unwrap() as i32;
    assert!(host.stop_daemon().success());
    assert!(alive(pid));
    host.spawn_daemon();
    assert_eq!(host.call("vm.get", json!({ "name": "keep" }))["pid"], pid);
    // The re-adopted VM is watched again: its death is recorded, not just noticed on reads.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let on_disk =
        || -> Value { serde_json::from_slice(&std::fs::read(host.state().join("vms/keep.json")).unwrap()).unwrap() };
    wait::until_true(
        "the record to say dead",
        Duration::from_secs(60),
        || on_disk()["status"] == "dead",
        || on_disk().to_string(),
    );
}

#[test]
fn a_create_whose_qemu_cannot_start_leaves_nothing_behind() {
    let host = TestHost::start(HostOptions::default());
    // A file that is not a kernel: QEMU refuses it during initialisation.
    let junk = host.images().join("junk-kernel");
    std::fs::write(&junk, vec![0u8; 4096]).unwrap();
    let mut spec = host.kernel_spec("broken");
    spec["boot"]["kernel"] = json!(junk);
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!(code, 4001, "{e:?}");
    assert!(!e.details["stderr"].as_str().unwrap_or("").is_empty(), "stderr tail carried: {e:?}");
    let v = host.call("vm.get", json!({ "name": "broken" }));
    assert_eq!(v["status"], "failed");
    assert_eq!(v["last_error"]["code"], 4001);
    assert!(host.qemu_pids().is_empty());
    assert!(!host.run().join("broken").exists(), "no socket or pid file left");
    assert_eq!(host.call("host.info", json!({}))["cpu"]["allocated"], 0, "reservation released");
    host.call("vm.destroy", json!({ "name": "broken" }));
}

#[test]
fn image_boot_uses_an_overlay_and_rolls_it_back_on_failure() {
    let host = TestHost::start(HostOptions::default());
    let base = host.images().join("base.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&base)
        .arg("64M")
        .status()
        .unwrap();
    assert!(st.success());
    let base_bytes = std::fs::read(&base).unwrap();
    let spec = json!({"name": "img", "cpu": 1, "memory_mib": 128, "boot": {"image": "base.qcow2", "disk_gib": 1}});
    let r = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(r["vm"]["status"], "running");
    let overlay = host.state().join("disks/img.qcow2");
    let info =
        std::process::Command::new("qemu-img").args(["info", "-U", "--output=json"]).arg(&overlay).output().unwrap();
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["backing-filename"], base.to_string_lossy().as_ref());
    assert_eq!(info["virtual-size"], 1024 * 1024 * 1024u64);
    host.call("vm.destroy", json!({ "name": "img" }));
    assert!(!overlay.exists());
    assert_eq!(std::fs::read(&base).unwrap(), base_bytes, "the base image is never written");

    // Unknown image: refused before anything exists.
    let bad = json!({"name": "img2", "cpu": 1, "memory_mib": 128, "boot": {"image": "nope.qcow2", "disk_gib": 1}});
    let (code, e) = host.call_err("vm.create", json!({ "spec": bad }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.boot.image")));
    assert_eq!(host.call("vm.list", json!({})), json!([]));
}

#[test]
fn a_qemu_failure_after_the_overlay_removes_the_overlay() {
    let host = TestHost::start(HostOptions { machine: "no-such-machine".into(), ..HostOptions::default() });
    let base = host.images().join("base.qcow2");
    assert!(std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&base)
        .arg("64M")
        .status()
        .unwrap()
        .success());
    let spec = json!({"name": "img", "cpu": 1, "memory_mib": 128, "boot": {"image": "base.qcow2", "disk_gib": 1}});
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!(code, 4001);
    assert!(e.details["stderr"].as_str().unwrap().contains("unsupported machine type"), "{e:?}");
    assert!(!host.state().join("disks/img.qcow2").exists(), "overlay rolled back");
    assert!(!host.run().join("img").exists());
    assert!(host.qemu_pids().is_empty());
    assert_eq!(host.call("vm.get", json!({"name": "img"}))["status"], "failed");
}

#[test]
fn an_invalid_config_refuses_to_start_naming_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "[hardware]\ncpu = 4\nmemory_gib = 8\n[hardware.sfp]\n5 = \"zz:00.0\"\n").unwrap();
    let out = std::process::Command::new(vmhost_tests::bin("vmhostd")).arg("--config").arg(&cfg).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&*cfg.to_string_lossy()) && err.contains("hardware.sfp.5"), "{err}");
}

/// A kernel spec whose guest ignores the ACPI power button.
fn deaf_spec(host: &TestHost, name: &str) -> Value {
    let mut s = host.kernel_spec(name);
    s["boot"]["cmdline"] = json!("console=ttyS0 panic=-1 quiet vmhost.noacpi");
    s
}

#[test]
fn a_busy_vm_refuses_a_second_operation_and_stop_timeouts_are_bounded() {
    let host = TestHost::start(HostOptions::default());
    host.call("vm.create", json!({ "spec": deaf_spec(&host, "deaf") }));
    assert!(host.wait_serial("deaf", GUEST_READY, BOOT));
    let (code, e) = host.call_err("vm.stop", json!({ "name": "deaf", "timeout_s": 3601 }));
    assert_eq!((code, e.field.as_deref()), (-32602, Some("timeout_s")));
    let pid = host.call("vm.get", json!({ "name": "deaf" }))["pid"].as_i64().unwrap() as i32;
    std::thread::scope(|s| {
        // A timeout long enough for the calls below to see the stop in progress on a loaded machine.
        let stopper = s.spawn(|| host.call("vm.stop", json!({ "name": "deaf", "timeout_s": 20 })));
        host.wait_status("deaf", "stopping", Duration::from_secs(60));
        let (code, _) = host.call_err("vm.start", json!({ "name": "deaf" }));
        assert_eq!(code, 4090);
        assert_eq!(host.call_err("vm.destroy", json!({ "name": "deaf" })).0, 4090);
        // Other VMs and reads are not held up meanwhile.
        assert_eq!(host.call("vm.get", json!({ "name": "deaf" }))["status"], "stopping");
        host.call("vm.create", json!({ "spec": host.kernel_spec("other") }));
        let r = stopper.join().unwrap();
        assert_eq!(r["vm"]["status"], "stopped");
    });
    assert!(!alive(pid), "killed after the timeout");
    assert!(!host.serial("deaf").contains("VMHOST-GUEST-POWEROFF"));
}

#[test]
fn a_refused_replace_leaves_the_old_vm_running() {
    let host = TestHost::start(HostOptions {
        extra: "[hardware.sfp]\n5 = \"0000:ca:00.0\"\n".into(),
        ..HostOptions::default()
    });
    let mut holder = host.kernel_spec("holder");
    holder["hardware"] = json!({ "sfp": [5] });
    holder["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": holder }));
    host.call("vm.create", json!({ "spec": host.kernel_spec("app") }));
    let before = host.call("vm.get", json!({ "name": "app" }));
    let mut new = host.kernel_spec("app");
    new["hardware"] = json!({ "sfp": [5] });
    let (code, _) = host.call_err("vm.apply", json!({ "spec": new, "replace": true }));
    assert_eq!(code, 3003);
    let after = host.call("vm.get", json!({ "name": "app" }));
    assert_eq!(after["status"], "running");
    assert_eq!(after["pid"], before["pid"]);
    assert_eq!(after["spec"], before["spec"]);
}

#[test]
fn a_second_daemon_on_the_same_state_dir_is_refused_and_changes_nothing() {
    let host = TestHost::start(HostOptions::default());
    host.call("vm.create", json!({ "spec": host.kernel_spec("one") }));
    let record = std::fs::read(host.state().join("vms/one.json")).unwrap();
    let out =
        std::process::Command::new(vmhost_tests::bin("vmhostd")).arg("--config").arg(&host.config).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("another vmhostd"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(host.state().join("vms/one.json")).unwrap(), record);
    assert_eq!(host.call("vm.get", json!({ "name": "one" }))["status"], "running");
}

#[test]
fn a_stop_interrupted_by_a_daemon_kill_is_finished_after_restart() {
    let mut host = TestHost::start(HostOptions::default());
    host.call("vm.create", json!({ "spec": deaf_spec(&host, "half") }));
    assert!(host.wait_serial("half", GUEST_READY, BOOT));
    let pid = host.call("vm.get", json!({ "name": "half" }))["pid"].as_i64().unwrap() as i32;
    let socket = host.socket.clone();
    let stopper = std::thread::spawn(move || {
        let mut c = vmhost::client::Client::connect(&socket).unwrap();
        let _ = c.call::<Value>("vm.stop", json!({ "name": "half", "timeout_s": 600 }));
    });
    // The stop has begun (recorded before its event) and waits on the deaf guest.
    host.wait_status("half", "stopping", Duration::from_secs(60));
    host.kill_daemon();
    let _ = stopper.join();
    assert!(alive(pid), "QEMU outlives the daemon");
    host.spawn_daemon();
    let v = host.call("vm.get", json!({ "name": "half" }));
    assert_eq!(v["status"], "stopped");
    assert_eq!(v["desired_state"], "stopped");
    assert!(!alive(pid), "the interrupted stop was completed");
    assert!(host.qemu_pids().is_empty());
}
