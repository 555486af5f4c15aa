//! The restart policy (docs/lifecycle.md, "When QEMU ends"): a killed QEMU is restarted with
//! backoff and counted, five failures within ten minutes make the VM `failed`; a guest that
//! powers itself off is `stopped` under `on-failure`, started again under `always`; `never`
//! leaves a killed VM `dead`.

use serde_json::{json, Value};
use std::time::Duration;
use vmhost_tests::{alive, HostOptions, TestHost, GUEST_READY};

fn view(host: &TestHost, name: &str) -> Value {
    host.call("vm.get", json!({ "name": name }))
}

/// Waits (on the VM's events) until its view satisfies `ok`; the bound only fails the test.
fn wait_until(host: &TestHost, name: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    host.wait_vm(name, what, Duration::from_secs(300), ok)
}

fn kill9(pid: i64) {
    let pid = nix::unistd::Pid::from_raw(pid as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("kill QEMU");
}

#[test]
fn a_killed_qemu_is_restarted_with_backoff_until_five_failures() {
    let host = TestHost::start(HostOptions::default());
    host.call("vm.create", json!({ "spec": host.kernel_spec("crashy") }));
    let mut pid = view(&host, "crashy")["pid"].as_i64().unwrap();
    for n in 1..=4u64 {
        kill9(pid);
        let v = wait_until(&host, "crashy", "restarted", |v| {
            v["status"] == "running" && v["pid"].as_i64().is_some_and(|p| p != pid) && v["restarts"] == n
        });
        assert!(v["last_exit"].as_str().unwrap_or("").contains("killed"), "{v}");
        pid = v["pid"].as_i64().unwrap();
        assert_eq!(host.qemu_pids().len(), 1, "one QEMU");
    }
    // The fifth failure within ten minutes: failed, not restarted.
    kill9(pid);
    let v = wait_until(&host, "crashy", "failed", |v| v["status"] == "failed");
    assert!(v["last_error"]["message"].as_str().unwrap_or("").contains("5 failures"), "{v}");
    assert_eq!(v["restarts"], 4);
    assert_eq!(v["desired_state"], "running");
    assert!(host.qemu_pids().is_empty());
    assert!(host.daemon_log().contains("restart policy"));
    // An operator's start still works.
    let r = host.call("vm.start", json!({ "name": "crashy" }));
    assert_eq!(r["vm"]["status"], "running");
}

#[test]
fn never_leaves_a_killed_vm_dead() {
    let host = TestHost::start(HostOptions::default());
    let mut spec = host.kernel_spec("fragile");
    spec["restart_policy"] = json!("never");
    host.call("vm.create", json!({ "spec": spec }));
    let pid = view(&host, "fragile")["pid"].as_i64().unwrap();
    kill9(pid);
    let v = wait_until(&host, "fragile", "dead", |v| v["status"] == "dead");
    assert_eq!((v["restarts"].clone(), v["spec"]["restart_policy"].clone()), (json!(0), json!("never")));
    // The daemon decided so (no restart is scheduled), as its log says (written just after the
    // record).
    let decided = || {
        let log = vmhost_tests::plain_log(&host.daemon_log());
        log.lines()
            .find(|l| l.contains("QEMU ended without vmhostd asking") && l.contains("fragile"))
            .map(str::to_string)
    };
    let line = vmhost_tests::wait::poll(Duration::from_secs(60), || decided().ok_or_else(String::new)).ok();
    assert!(line.as_deref().is_some_and(|l| l.contains("verdict=Dead")), "{line:?}");
    assert!(!alive(pid as i32));
}

fn self_powering(host: &TestHost, name: &str, policy: &str) -> Value {
    let mut spec = host.kernel_spec(name);
    spec["boot"]["cmdline"] = json!("console=ttyS0 panic=-1 quiet vmhost.poweroff");
    spec["restart_policy"] = json!(policy);
    spec
}

#[test]
fn a_guest_that_powers_itself_off_is_stopped_or_restarted_by_policy() {
    let host = TestHost::start(HostOptions::default());
    host.call("vm.create", json!({ "spec": self_powering(&host, "quitter", "on-failure") }));
    let v = wait_until(&host, "quitter", "stopped", |v| v["status"] == "stopped");
    assert_eq!((v["desired_state"].as_str(), v["last_exit"].as_str()), (Some("stopped"), Some("guest powered off")));
    assert_eq!(v["restarts"], 0);
    assert!(host.serial("quitter").contains("VMHOST-GUEST-SELF-POWEROFF"));
    assert!(host.qemu_pids().is_empty());

    host.call("vm.create", json!({ "spec": self_powering(&host, "phoenix", "always") }));
    let first = view(&host, "phoenix")["pid"].clone();
    let v = wait_until(&host, "phoenix", "restarted", |v| v["restarts"].as_u64().unwrap_or(0) >= 1);
    assert_ne!(v["pid"], first);
    assert_eq!(v["desired_state"], "running");
    let boots = host.serial("phoenix").matches(GUEST_READY).count();
    assert!(boots >= 1, "booted");
    host.call("vm.stop", json!({ "name": "phoenix", "timeout_s": 1 }));
    assert_eq!(view(&host, "phoenix")["status"], "stopped");
}
