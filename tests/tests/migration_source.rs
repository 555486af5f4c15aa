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
    let status = qmp_status(runs, "crashy");
    let log = |h: &TestHost| h.daemon_log().lines().filter(|l| !l.contains("DEBUG")).collect::<Vec<_>>().join("\n");
    assert_eq!(status, "running", "{step}\n--- source:\n{}\n--- destination:\n{}", log(&src), log(&dst));
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

/// A `vm.migrate` whose outcome the source cannot learn: the source killed right after it
/// recorded `committing` (before `Commit` went out), the destination gone before the source
/// comes back, so nobody answers its questions. Returns the source with the VM `failed`, its
/// migration `committing`, its guest paused.
fn unknown_outcome(name: &str) -> TestHost {
    let (mut src, dst) = (host(), host());
    running_guest(&src, name);
    let view: Value = src.call("vm.get", json!({ "name": name }));
    let prepared = dst.call("vm.migrate_in", json!({ "spec": view["spec"] }));
    src.arm_crash("migrate:commit");
    let params = json!({ "name": name, "destination": prepared["address"], "secret": prepared["secret"] });
    let answer = src.client().call::<Value>("vm.migrate", params);
    assert!(answer.is_err(), "vm.migrate answered although the daemon should have died: {answer:?}");
    drop(dst);
    src.restart_after_crash("migrate:commit");
    let view = src.wait_status(name, "failed", Duration::from_secs(120));
    assert_eq!(view["migration"]["phase"], "committing", "{view}");
    assert_ne!(qmp_status(&src, name), "running", "the guest is kept paused while the outcome is unknown");
    src
}

#[test]
fn an_unknown_outcome_settled_abandoned_runs_the_guest_here_again() {
    let src = unknown_outcome("settle-a");
    let pid = src.call("vm.get", json!({ "name": "settle-a" }))["pid"].clone();
    let out = src.ctl(&["migrate-settle", "settle-a", "--outcome", "abandoned"]);
    assert!(
        out.status.success(),
        "vmhostctl migrate-settle: {}\n{}\n--- source:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        src.daemon_log()
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("unreachable"), "{}", String::from_utf8_lossy(&out.stdout));
    let view: Value = src.call("vm.get", json!({ "name": "settle-a" }));
    assert_eq!((view["status"].as_str(), view.get("migration")), (Some("running"), None), "{view}");
    assert_eq!(view["pid"], pid, "the same QEMU runs the guest");
    assert_eq!(qmp_status(&src, "settle-a"), "running");
    assert_eq!(src.qemu_pids().len(), 1);
    // Settled: a second answer is refused and changes nothing.
    let (code, e) = src.call_err("vm.migrate_settle", json!({ "name": "settle-a", "outcome": "committed" }));
    assert_eq!((code, e.details["reason"].as_str()), (4097, Some("status")), "{e:?}");
    // The re-adopted QEMU is this vmhostd's again: an ordinary stop ends it.
    src.call("vm.stop", json!({ "name": "settle-a", "force": true }));
    src.wait_status("settle-a", "stopped", Duration::from_secs(60));
    assert!(src.qemu_pids().is_empty());
}

#[test]
fn an_unknown_outcome_settled_committed_ends_the_vm_here_as_a_destroy_does() {
    let src = unknown_outcome("settle-c");
    let data_disk = src.state().join("disks/settle-c");
    assert!(data_disk.exists(), "the data disk's directory is where the test looks");
    let settled = src.call("vm.migrate_settle", json!({ "name": "settle-c", "outcome": "committed" }));
    assert_eq!(
        (settled["outcome"].as_str(), settled["destination"].as_str()),
        (Some("committed"), Some("unreachable"))
    );
    assert_eq!(settled.get("status"), None, "{settled}");
    let (code, _) = src.call_err("vm.get", json!({ "name": "settle-c" }));
    assert_eq!(code, 4040, "the source still has the VM");
    assert!(src.qemu_pids().is_empty(), "a QEMU is left on the source");
    assert!(!data_disk.exists(), "the source kept the data disk of a VM that is not keep_on_destroy");
    let (code, _) = src.call_err("vm.migrate_settle", json!({ "name": "settle-c", "outcome": "abandoned" }));
    assert_eq!(code, 4040);
}

#[test]
fn vmhostctl_migrate_takes_the_secret_from_stdin_or_a_file_never_from_its_command_line() {
    use std::io::Write;
    let src = host();
    let secret = "ab".repeat(32);
    let out = src.ctl(&["migrate", "nosuch", "--to", "127.0.0.1:1", "--secret", &secret]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("ps"), "a secret on the command line was taken: {stderr}");
    let out = src.ctl(&["migrate", "nosuch", "--to", "127.0.0.1:1"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--secret-file"));

    // From standard input: a malformed one reaches vmhostd, which names the field.
    let mut child = std::process::Command::new(vmhost_tests::bin("vmhostctl"))
        .arg("--socket")
        .arg(&src.socket)
        .args(["migrate", "nosuch", "--to", "127.0.0.1:1", "--secret", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run vmhostctl");
    child.stdin.take().expect("stdin").write_all(b"not-a-secret\n").expect("write the secret");
    let out = child.wait_with_output().expect("vmhostctl");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error 2001") && stderr.contains("[secret]"), "{stderr}");

    // From a file: a well-formed one passes vmhostd's check, which then finds no such VM.
    let file = src.dir.path().join("secret");
    std::fs::write(&file, format!("{secret}\n")).expect("write the secret file");
    let out = src.ctl(&["migrate", "nosuch", "--to", "127.0.0.1:1", "--secret-file", &file.display().to_string()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error 4040"), "{stderr}");
}
