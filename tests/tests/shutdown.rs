//! `host.shutdown_vms` (`vmhostctl shutdown-vms`, what vmhost-guests.service runs at host
//! shutdown): every running VM gets the ACPI button at once, one that ignores it is killed after
//! the timeout, all stay desired running, and the next daemon start brings them back (autostart).
//! A read-only peer may not call it.

use serde_json::json;
use std::time::{Duration, Instant};
use vmhost_tests::{alive, HostOptions, TestHost, GUEST_READY};

const BOOT: Duration = Duration::from_secs(90);

#[test]
fn shutdown_vms_powers_everything_off_and_autostart_brings_it_back() {
    let mut host = TestHost::start(HostOptions::default());
    host.call("vm.create", json!({ "spec": host.kernel_spec("polite") }));
    let mut deaf = host.kernel_spec("deaf");
    deaf["boot"]["cmdline"] = json!("console=ttyS0 panic=-1 quiet vmhost.noacpi");
    host.call("vm.create", json!({ "spec": deaf }));
    let mut off = host.kernel_spec("off");
    off["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": off }));
    for name in ["polite", "deaf"] {
        assert!(host.wait_serial(name, GUEST_READY, BOOT), "{name} did not boot");
    }
    let pids = host.qemu_pids();
    assert_eq!(pids.len(), 2);

    let (code, _) = host.call_err("host.shutdown_vms", json!({ "timeout_s": 3601 }));
    assert_eq!(code, -32602);
    let started = Instant::now();
    let out = host.ctl(&["shutdown-vms", "--timeout", "5"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("polite") && text.contains("deaf") && !text.contains("off "), "{text}");
    // In parallel: both within one timeout (5 s) plus the kill, not two.
    assert!(started.elapsed() < Duration::from_secs(9), "took {:?}", started.elapsed());
    assert!(pids.iter().all(|p| !alive(*p)), "every QEMU is gone");
    assert!(host.serial("polite").contains("VMHOST-GUEST-POWEROFF"), "the polite guest powered off");
    assert!(!host.serial("deaf").contains("VMHOST-GUEST-POWEROFF"), "the deaf one was killed");
    for name in ["polite", "deaf"] {
        let v = host.call("vm.get", json!({ "name": name }));
        assert_eq!((v["status"].as_str(), v["desired_state"].as_str()), (Some("stopped"), Some("running")), "{v}");
    }

    // The next boot: autostart starts both again; the VM desired stopped stays so.
    host.kill_daemon();
    host.spawn_daemon();
    let deadline = Instant::now() + Duration::from_secs(60);
    while ["polite", "deaf"].iter().any(|n| host.call("vm.get", json!({ "name": n }))["status"] != "running") {
        assert!(Instant::now() < deadline, "autostart did not bring them back");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(host.call("vm.get", json!({ "name": "off" }))["status"], "stopped");
    assert_eq!(host.qemu_pids().len(), 2);
}
