//! `host.shutdown_vms` (`vmhostctl shutdown-vms`, what vmhost-guests.service runs at host
//! shutdown): every running VM gets the ACPI button at once, one that ignores it is killed after
//! the timeout, all stay desired running, and the next daemon start brings them back (autostart).
//! A read-only peer may not call it.

use serde_json::json;
use std::time::Duration;
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
    let mut events = host.client();
    events.subscribe_events().expect("events.subscribe");
    let out = host.ctl(&["shutdown-vms", "--timeout", "5"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("polite") && text.contains("deaf") && !text.contains("off "), "{text}");
    // In parallel, not one after the other: both stops began before either ended (the events
    // the daemon sent, in its order; a wait of one timeout instead of two follows from that).
    let mut moves: Vec<(String, String)> = Vec::new();
    while moves.iter().filter(|m| m.1 == "stopped").count() < 2 {
        let Some(e) = events.next_event(BOOT).expect("read events") else { panic!("no stopped events: {moves:?}") };
        moves.push((e.vm, e.to.map(|s| s.to_string()).unwrap_or_default()));
    }
    let began: Vec<usize> = moves.iter().enumerate().filter(|(_, m)| m.1 == "stopping").map(|(i, _)| i).collect();
    let ended = moves.iter().position(|m| m.1 == "stopped");
    assert!(began.len() == 2 && ended.is_some_and(|e| began.iter().all(|b| *b < e)), "{moves:?}");
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
    for name in ["polite", "deaf"] {
        host.wait_status(name, "running", BOOT);
    }
    assert_eq!(host.call("vm.get", json!({ "name": "off" }))["status"], "stopped");
    assert_eq!(host.qemu_pids().len(), 2);
}
