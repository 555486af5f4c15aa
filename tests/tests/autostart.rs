//! Autostart (docs/lifecycle.md): a simulated host reboot (vmhostd and every QEMU killed with
//! SIGKILL) and a new vmhostd brings back every VM desired running, with no client asking, never
//! more than `lifecycle.start_concurrency` starting at once; a VM desired stopped stays stopped;
//! `lifecycle.autostart = false` starts nothing.

use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;
use vmhost_tests::{alive, wait, HostOptions, TestHost};

const DESIRED_RUNNING: [&str; 5] = ["a1", "a2", "a3", "a4", "a5"];

fn statuses(host: &TestHost) -> Vec<(String, String)> {
    let list = host.call("vm.list", json!({}));
    list.as_array()
        .map(|l| {
            l.iter()
                .map(|v| (v["name"].as_str().unwrap_or("").into(), v["status"].as_str().unwrap_or("").into()))
                .collect()
        })
        .unwrap_or_default()
}

/// vmhostd and every QEMU die at once, as in a power cut; waits until the QEMUs are gone.
fn simulate_host_reboot(host: &mut TestHost) {
    let pids = host.qemu_pids();
    assert!(!pids.is_empty());
    host.kill_daemon();
    for pid in &pids {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL);
    }
    wait::until_true(
        "the killed QEMUs to be gone",
        Duration::from_secs(60),
        || !pids.iter().any(|p| alive(*p)),
        || format!("alive: {:?}", pids.iter().filter(|p| alive(**p)).collect::<Vec<_>>()),
    );
}

/// The VM transitions in a daemon log, in order: (vm, from, to).
fn transitions(log: &str) -> Vec<(String, String, String)> {
    let log = vmhost_tests::plain_log(log);
    let field = |line: &str, key: &str| -> String {
        let Some(at) = line.find(key) else { return String::new() };
        let rest = &line[at + key.len()..];
        let end = rest.find(' ').unwrap_or(rest.len());
        rest[..end].trim_matches('"').trim_start_matches("Some(").trim_end_matches(')').to_string()
    };
    log.lines()
        .filter_map(|l| l.split_once("vm event ").map(|(_, rest)| rest))
        .map(|l| (field(l, "vm="), field(l, "from="), field(l, "to=")))
        .collect()
}

#[test]
fn a_rebooted_host_gets_its_vms_back_at_most_n_starting_at_once() {
    let mut host = TestHost::start(HostOptions {
        cpu: 8,
        extra: "[lifecycle]\nstart_concurrency = 2\n".into(),
        ..HostOptions::default()
    });
    for name in DESIRED_RUNNING {
        host.call("vm.create", json!({ "spec": host.kernel_spec(name) }));
    }
    let mut off = host.kernel_spec("off");
    off["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": off }));
    assert_eq!(host.qemu_pids().len(), DESIRED_RUNNING.len());

    simulate_host_reboot(&mut host);
    let log_before = host.daemon_log().len();
    host.spawn_daemon();

    // No client call but reads: every VM desired running comes back.
    for name in DESIRED_RUNNING {
        host.wait_status(name, "running", Duration::from_secs(300));
    }
    assert_eq!(host.qemu_pids().len(), DESIRED_RUNNING.len(), "one QEMU each, none for the stopped VM");
    assert_eq!(host.call("vm.get", json!({ "name": "off" }))["status"], "stopped");

    // The daemon's ordered record of transitions: never more than 2 VMs starting at once.
    let log = host.daemon_log();
    let moves = transitions(&log[log_before..]);
    let mut starting = BTreeSet::new();
    let mut most = 0;
    for (vm, _from, to) in &moves {
        if to == "Starting" {
            starting.insert(vm.clone());
        } else {
            starting.remove(vm);
        }
        most = most.max(starting.len());
    }
    let started: BTreeSet<&str> =
        moves.iter().filter(|(_, _, to)| to == "Running").map(|(vm, _, _)| vm.as_str()).collect();
    assert_eq!(started, DESIRED_RUNNING.into_iter().collect(), "{moves:?}");
    assert!(most <= 2, "at most start_concurrency = 2 starting at once, saw {most}: {moves:?}");
    assert!(most >= 1, "{moves:?}");
    let events = host.call("vm.get", json!({ "name": "a1" }));
    assert_eq!(events["status"], "running");
    assert!(log[log_before..].contains("autostart"), "the events say why");

    // Autostart off: the same reboot leaves them dead.
    let config = std::fs::read_to_string(&host.config).unwrap();
    std::fs::write(&host.config, config.replace("start_concurrency = 2", "autostart = false")).unwrap();
    simulate_host_reboot(&mut host);
    host.spawn_daemon();
    let st = statuses(&host);
    assert!(host.daemon_log().contains("lifecycle.autostart is off"));
    for name in DESIRED_RUNNING {
        let status = st.iter().find(|(n, _)| n == name).map(|(_, s)| s.clone()).unwrap_or_default();
        assert_eq!(status, "dead", "{name}: {st:?}");
    }
    assert!(host.qemu_pids().is_empty());
    let v: Value = host.call("vm.get", json!({ "name": "a1" }));
    assert_eq!(v["desired_state"], "running", "the desire is kept for the next start");
}
