//! The source side of `vm.migrate` against a real destination: two vmhostds on 127.0.0.1 (no
//! namespaces, no NIC), each with its own migration port, a direct-kernel guest with a raw data
//! disk. What the source must make true: the guest runs on the destination, the source keeps
//! no record, no QEMU and no disk of the VM (the data disk is not `keep_on_destroy`), its
//! `migration` events went out and `vmhostctl migrate` drew them; and a refused destination
//! changes nothing here. The full proof (namespaces, crash points, the counter guest) is
//! tests/tests/migration.rs.

use serde_json::{json, Value};
use std::time::Duration;
use vmhost_tests::{HostOptions, TestHost, GUEST_READY};

/// A free TCP port on 127.0.0.1 (bound and let go: nothing else on this host takes ports
/// from the same range meanwhile).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// A vmhostd with a migration port, sandboxed as every test host is unless
/// `VMHOST_TEST_SANDBOX` says otherwise (`off`: to tell a sandbox refusal from a defect here).
fn host() -> TestHost {
    let port = free_port();
    TestHost::start(HostOptions {
        extra: format!("[migration]\nlisten = \"127.0.0.1:{port}\"\n"),
        sandbox: std::env::var("VMHOST_TEST_SANDBOX").unwrap_or_else(|_| "require".into()),
        ..HostOptions::default()
    })
}

/// A running guest named `name` with a 1 GiB raw data disk, booted.
fn running_guest(h: &TestHost, name: &str) {
    let spec = vmhost_tests::disk_spec(h, name, json!([{ "name": "data", "size_gib": 1, "format": "raw" }]), "");
    h.call("vm.create", json!({ "spec": spec }));
    assert!(h.wait_serial(name, GUEST_READY, Duration::from_secs(120)), "guest did not boot: {}", h.serial(name));
}

fn qmp_status(h: &TestHost, name: &str) -> String {
    let replies = vmhost_tests::qmp_commands(&h.run().join(name).join("qmp"), &[json!({"execute": "query-status"})]);
    replies.last().and_then(|r| r["return"]["status"].as_str()).unwrap_or_default().to_string()
}

#[test]
fn a_running_vm_moves_and_the_source_ends_it_as_a_destroy_does() {
    let (src, dst) = (host(), host());
    running_guest(&src, "mover");
    let data_disk = src.state().join("disks/mover");
    assert!(data_disk.exists(), "the data disk's directory is where the test looks");

    let mut events = src.client();
    events.subscribe_events().expect("subscribe");
    let dst_socket = dst.socket.display().to_string();
    let out = src.ctl(&["migrate", "mover", "--to-socket", &dst_socket]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "vmhostctl migrate failed: {}\nstdout: {}\nstderr: {stderr}\n--- source:\n{}\n--- destination:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        src.daemon_log(),
        dst.daemon_log()
    );
    // Not a terminal: one plain line per progress event.
    assert!(stderr.lines().any(|l| l.starts_with("memory ") || l.contains("  memory ")), "no progress line: {stderr}");

    let view = dst.wait_status("mover", "running", Duration::from_secs(60));
    assert_eq!(qmp_status(&dst, "mover"), "running", "the destination's guest runs: {view}");
    let (code, _) = src.call_err("vm.get", json!({ "name": "mover" }));
    assert_eq!(code, 4040, "the source still has the VM");
    assert!(src.qemu_pids().is_empty(), "a QEMU is left on the source");
    assert!(!data_disk.exists(), "the source kept the data disk of a VM that is not keep_on_destroy");
    assert_eq!(dst.qemu_pids().len(), 1);

    // Phase events, in order, then the record's removal with the destination named.
    let mut phases = Vec::new();
    let mut gone = None;
    while gone.is_none() {
        let e = events.next_event(Duration::from_secs(10)).expect("event").expect("an event in time");
        if e.vm != "mover" {
            continue;
        }
        if let Some(p) = e.migration {
            if phases.last() != Some(&p.phase) {
                phases.push(p.phase.clone());
            }
        } else if e.to.is_none() {
            gone = Some(e.reason);
        }
    }
    assert_eq!(phases, ["preparing", "disks", "memory", "switching", "committing", "done"]);
    let gone = gone.unwrap_or_default();
    assert!(gone.starts_with("migrated to 127.0.0.1:"), "{gone}");
}

#[test]
fn a_destination_that_refuses_changes_nothing_here() {
    let (src, dst) = (host(), host());
    running_guest(&src, "stayer");
    let before: Value = src.call("vm.get", json!({ "name": "stayer" }));
    let address = dst.call("host.info", json!({})); // the destination runs, but expects no such VM
    assert!(address.is_object());
    let port = {
        let cfg = std::fs::read_to_string(&dst.config).expect("config");
        cfg.lines().find_map(|l| l.strip_prefix("listen = \"127.0.0.1:")).map(|p| p.trim_end_matches('"').to_string())
    }
    .expect("port");
    let secret = "ab".repeat(32);
    let (code, e) = src.call_err(
        "vm.migrate",
        json!({ "name": "stayer", "destination": format!("127.0.0.1:{port}"), "secret": secret }),
    );
    assert_eq!((code, e.details["step"].as_str()), (4001, Some("connect")), "{e:?}");
    let after: Value = src.call("vm.get", json!({ "name": "stayer" }));
    assert_eq!((after["status"].as_str(), after.get("migration")), (Some("running"), None));
    assert_eq!(after["pid"], before["pid"]);
    assert_eq!(qmp_status(&src, "stayer"), "running");

    let (code, e) =
        src.call_err("vm.migrate", json!({ "name": "stayer", "destination": "127.0.0.1:1", "secret": "x" }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("secret")));
    src.call("vm.stop", json!({ "name": "stayer", "force": true }));
    let (code, e) = src.call_err(
        "vm.migrate",
        json!({ "name": "stayer", "destination": format!("127.0.0.1:{port}"), "secret": "ab".repeat(32) }),
    );
    assert_eq!((code, e.details["reason"].as_str()), (4097, Some("status")));
}

/// The source daemon killed at `step` of a `vm.migrate`, then restarted: the VM ends on
/// exactly one host (`on_destination`), with one QEMU across both and no record on the other.
fn crash_case(step: &str, on_destination: bool) {
    let (mut src, dst) = (host(), host());
    running_guest(&src, "crashy");
    let view: Value = src.call("vm.get", json!({ "name": "crashy" }));
    let prepared = dst.call("vm.migrate_in", json!({ "spec": view["spec"] }));
    src.crash_during(
        step,
        "vm.migrate",
        json!({ "name": "crashy", "destination": prepared["address"], "secret": prepared["secret"] }),
    );
    let (runs, other) = if on_destination { (&dst, &src) } else { (&src, &dst) };
    runs.wait_status("crashy", "running", Duration::from_secs(120));
    vmhost_tests::wait::until("the other host to forget the VM", Duration::from_secs(120), || {
        match other.client().call::<Value>("vm.get", json!({ "name": "crashy" })) {
            Err(_) => Ok(()),
            Ok(v) => Err(format!("{v}")),
        }
    });
    assert_eq!(qmp_status(runs, "crashy"), "running");
    let view: Value = runs.call("vm.get", json!({ "name": "crashy" }));
    if on_destination {
        // The destination keeps the committed migration to answer the source's queries.
        assert_eq!(view["migration"]["phase"], "committed", "{view}");
    } else {
        assert_eq!(view.get("migration"), None, "the source cleared the migration: {view}");
    }
    assert_eq!((runs.qemu_pids().len(), other.qemu_pids().len()), (1, 0));
}

#[test]
fn a_restart_at_migrate_memory_keeps_the_guest_here() {
    crash_case("migrate:memory", false);
}

#[test]
fn a_restart_at_migrate_commit_keeps_the_guest_here() {
    crash_case("migrate:commit", false);
}

#[test]
fn a_restart_at_migrate_confirmed_ends_the_vm_here() {
    crash_case("migrate:confirmed", true);
}

#[test]
fn a_restart_at_migrate_recorded_keeps_the_guest_here() {
    crash_case("migrate:recorded", false);
}

#[test]
fn a_restart_at_migrate_mirroring_keeps_the_guest_here() {
    crash_case("migrate:mirroring", false);
}
