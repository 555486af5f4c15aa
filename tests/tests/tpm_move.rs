//! A VM with a TPM (`tpm: true`) moves between two vmhostds with its TPM state (docs/moving.md
//! "TPM"): live, QEMU carries swtpm's state blobs in the migration stream (the destination's
//! swtpm stores them in its state directory); cold, the source reads the state files and sends
//! them as files of the move, and the destination puts them back as QEMU's user's before the
//! VM first starts there.
//!
//! The guest (tests/guest/init.sh) prints `VMHOST-TPM present reset_count=N` at each boot: N
//! is the TPM's resetCount, kept in its persistent state and raised at each boot. So a boot on
//! the destination showing a count larger than the last boot on the source proves the guest met
//! the same TPM there (a new TPM starts at 1 again).

use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;
use vmhost_tests::migration_pair::{tail, Pair, PairOptions};
use vmhost_tests::{tpm_reset_counts as reset_counts, wait, TestHost, QEMU_USER};

/// How long a TCG boot may take on a busy 2-core machine.
const BOOT: Duration = Duration::from_secs(120);

/// `host`'s TPM state directory of `name`.
fn state_dir(host: &TestHost, name: &str) -> PathBuf {
    host.state().join("disks").join(name).join("tpm")
}

/// The live swtpm processes whose state directory (their fd 4) is under `host`'s state
/// directory: those of this host's VMs, whichever other tests run swtpm beside.
fn swtpms_of(host: &TestHost) -> Vec<i32> {
    let state = host.state();
    let mut found = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
        let is_swtpm = exe.as_deref().and_then(|p| p.file_name()).is_some_and(|n| n == "swtpm");
        if !is_swtpm {
            continue;
        }
        let dir = fs::read_link(format!("/proc/{pid}/fd/4")).ok();
        if dir.is_some_and(|d| d.starts_with(&state)) && vmhost_tests::alive(pid) {
            found.push(pid);
        }
    }
    found
}

/// Asserts the persistent state file of `name` on `host` is there, QEMU's user's, 0600.
fn assert_state_file(host: &TestHost, name: &str) {
    let permall = state_dir(host, name).join("tpm2-00.permall");
    let m = fs::metadata(&permall).unwrap_or_else(|e| panic!("{}: {e}", permall.display()));
    let uid = nix::unistd::User::from_name(QEMU_USER).unwrap().expect("the test's QEMU user").uid.as_raw();
    assert_eq!((m.uid(), m.mode() & 0o7777), (uid, 0o600), "{}", permall.display());
    assert!(m.len() > 0, "{} is empty", permall.display());
}

/// Asserts host `on` has nothing of `name`'s TPM left: no swtpm of its own, no state directory.
fn assert_no_tpm_left(host: &TestHost, name: &str) {
    wait::until_true(
        "the source's swtpm to end",
        Duration::from_secs(10),
        || swtpms_of(host).is_empty(),
        || format!("swtpm still runs: {:?}", swtpms_of(host)),
    );
    assert!(!state_dir(host, name).exists(), "the source kept the TPM state {}", state_dir(host, name).display());
}

/// A counter guest with a TPM and no data disk kept.
fn tpm_spec(pair: &Pair, name: &str) -> Value {
    let mut spec = pair.spec(name, 256, "tpm-mark", false);
    spec["tpm"] = true.into();
    spec
}

/// Creates the TPM guest on host 0, restarts it once there (so its count is past a new TPM's),
/// and returns the counts it showed on host 0.
fn create_with_two_boots(pair: &Pair, name: &str) -> Vec<u64> {
    pair.create(0, &tpm_spec(pair, name));
    let h = &pair.hosts[0];
    h.wait_serial_count(name, "VMHOST-TPM present", 1, BOOT);
    h.call("vm.restart", json!({ "name": name, "timeout_s": 1, "force": true }));
    h.wait_serial_count(name, "VMHOST-TPM present", 2, BOOT);
    h.wait_serial_count(name, "VMHOST-COUNT ", 3, BOOT);
    let counts = reset_counts(h, name);
    assert!(counts.len() == 2 && counts[1] > counts[0], "{counts:?}");
    assert_eq!(swtpms_of(h).len(), 1, "one swtpm on the source");
    counts
}

/// The log lines of `name`'s QEMU (and swtpm: its stderr goes there) on `host`, for failures.
fn qemu_log(host: &TestHost, name: &str) -> String {
    fs::read_to_string(host.state().join("logs").join(format!("{name}.qemu.log"))).unwrap_or_default()
}

/// A live move first fails: the destination is killed once QEMU there has the memory and the
/// TPM's state (`migrate_in:commit`, before its commit write); on its restart it gives the move
/// up, ending its swtpm and removing the state it stored, and the guest runs on at the source
/// with its own. The next move succeeds and carries the TPM, and the snapshot taken on the
/// source (with its TPM copy) reverts there to its TPM.
#[test]
fn a_running_tpm_vm_moves_live_with_its_tpm_state() {
    let mut pair = Pair::start(PairOptions::default());
    let name = "tpmlive";
    let before = create_with_two_boots(&pair, name);
    let snap = pair.hosts[0].call("vm.snapshot", json!({ "name": name, "snapshot": "s1" }));
    assert!(snap["tpm"]["files"].as_array().is_some_and(|f| !f.is_empty()), "no TPM copy: {snap}");

    let out = pair.ctl_while_destination_dies("migrate", name, "migrate_in:commit");
    assert!(!out.status.success(), "the move succeeded although its destination died before the commit");
    assert_eq!(pair.settled(name, Duration::from_secs(180)), 0, "the guest stays on the source");
    wait::until_true(
        "the destination's swtpm to end",
        Duration::from_secs(10),
        || swtpms_of(&pair.hosts[1]).is_empty(),
        || format!("{:?}", swtpms_of(&pair.hosts[1])),
    );
    assert!(!pair.hosts[1].state().join("disks").join(name).exists(), "the destination kept files of the move");
    assert_eq!(swtpms_of(&pair.hosts[0]).len(), 1, "the source's swtpm runs on");
    assert_state_file(&pair.hosts[0], name);

    let out = pair.migrate_ctl(0, 1, name);
    assert!(
        out.status.success(),
        "vmhostctl migrate failed: {}\nstderr: {}\n--- source log:\n{}\n--- destination log:\n{}\n--- source QEMU log:\n{}\n--- destination QEMU log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        tail(&pair.hosts[0].daemon_log(), 40),
        tail(&pair.hosts[1].daemon_log(), 40),
        qemu_log(&pair.hosts[0], name),
        qemu_log(&pair.hosts[1], name),
    );
    assert_eq!(pair.settled(name, Duration::from_secs(60)), 1);
    let dest = &pair.hosts[1];
    // The guest runs on there, without a boot: the counter goes on.
    let seen = dest.serial(name).matches("VMHOST-COUNT ").count();
    dest.wait_serial_count(name, "VMHOST-COUNT ", seen + 5, Duration::from_secs(60));
    assert!(reset_counts(dest, name).is_empty(), "the guest booted again on the destination");
    // swtpm there stored the state QEMU gave it from the stream.
    assert_eq!(swtpms_of(dest).len(), 1, "one swtpm on the destination");
    assert_state_file(dest, name);
    assert_no_tpm_left(&pair.hosts[0], name);

    // A restart there meets the same TPM: its count goes on from the source's last.
    dest.call("vm.restart", json!({ "name": name, "timeout_s": 1, "force": true }));
    dest.wait_serial_count(name, "VMHOST-TPM present", 1, BOOT);
    let there = reset_counts(dest, name);
    assert!(
        there[0] > before[1],
        "the moved VM met a new TPM: {there:?} after {before:?} on the source\n{}",
        qemu_log(dest, name)
    );
    assert_state_file(dest, name);

    // The snapshot taken on the source came with its TPM copy: a revert there puts it back.
    revert_puts_back_the_snapshots_tpm(dest, name, &before, "live move");
}

/// `vmhostctl move NAME --to-socket (host 1)` run against host 0.
fn move_ctl(pair: &Pair, name: &str) -> std::process::Output {
    let to = pair.hosts[1].socket.display().to_string();
    pair.hosts[0].ctl(&["move", name, "--to-socket", to.as_str()])
}

/// `vm.get` of `name` on `host`, `None` when it has no such VM.
fn view(host: &TestHost, name: &str) -> Option<Value> {
    host.client().call::<Value>("vm.get", json!({ "name": name })).ok()
}

/// A cold move carries the TPM state as files: a snapshot (with its TPM copy) taken on the
/// source, the VM stopped; the destination killed at `move:tpm` (the state put in place, not
/// committed) gives the move up on its restart and keeps nothing, the source keeps the VM
/// stopped with its state; moved again, the destination has the state as QEMU's user's files,
/// the source nothing; the VM's first boot there goes on from the source's count; a revert
/// there to the snapshot taken on the source puts its TPM state back too.
#[test]
fn a_stopped_tpm_vm_moves_cold_with_its_tpm_state_and_its_snapshots_tpm_copies() {
    let mut pair = Pair::start(PairOptions::default());
    let name = "tpmcold";
    let before = create_with_two_boots(&pair, name);
    let snap = pair.hosts[0].call("vm.snapshot", json!({ "name": name, "snapshot": "s1" }));
    assert!(snap["tpm"]["files"].as_array().is_some_and(|f| !f.is_empty()), "no TPM copy: {snap}");
    let taps = pair.taps(0, name);
    pair.hosts[0].call("vm.stop", json!({ "name": name }));
    let source_state = state_dir(&pair.hosts[0], name).join("tpm2-00.permall");
    wait::until_true(
        "the source's swtpm to end",
        Duration::from_secs(10),
        || swtpms_of(&pair.hosts[0]).is_empty(),
        || format!("{:?}", swtpms_of(&pair.hosts[0])),
    );
    let kept = fs::read(&source_state).expect("the source's state");

    // The destination dies once the state is in place, before its commit: on its restart it
    // gives the move up; the source keeps the VM and its state.
    let out = pair.ctl_while_destination_dies("move", name, "move:tpm");
    assert!(!out.status.success(), "the move succeeded although its destination died before the commit");
    wait::until("the move given up on both hosts", Duration::from_secs(120), || {
        match (view(&pair.hosts[0], name), view(&pair.hosts[1], name)) {
            (Some(v), None) if v["status"] == "stopped" && v.get("migration").is_none_or(Value::is_null) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    assert!(!pair.hosts[1].state().join("disks").join(name).exists(), "the destination kept files of the move");
    assert_eq!(fs::read(&source_state).expect("the source's state"), kept, "the source's TPM state");

    // Moved for good.
    let out = move_ctl(&pair, name);
    assert!(
        out.status.success(),
        "vmhostctl move failed: {}\nstderr: {}\n--- source log:\n{}\n--- destination log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        tail(&pair.hosts[0].daemon_log(), 40),
        tail(&pair.hosts[1].daemon_log(), 40),
    );
    let dest = &pair.hosts[1];
    let v = view(dest, name).expect("the destination has the VM");
    assert_eq!(v["status"], "stopped", "{v}");
    assert_state_file(dest, name);
    assert_eq!(fs::read(state_dir(dest, name).join("tpm2-00.permall")).unwrap(), kept, "the same state");
    let staged: Vec<String> = fs::read_dir(dest.state().join("disks").join(name))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".moving"))
        .collect();
    assert!(staged.is_empty(), "the state as it arrived was left: {staged:?}");
    pair.assert_clean(0, name, &taps);
    assert_no_tpm_left(&pair.hosts[0], name);

    // Its first boot there meets the same TPM.
    dest.call("vm.start", json!({ "name": name }));
    dest.wait_serial_count(name, "VMHOST-TPM present", 1, BOOT);
    let there = reset_counts(dest, name);
    assert!(there[0] > before[1], "the moved VM met a new TPM: {there:?} after {before:?} on the source");
    assert_eq!(swtpms_of(dest).len(), 1);

    // The snapshot taken on the source came with its TPM copy: a revert there puts it back.
    revert_puts_back_the_snapshots_tpm(dest, name, &before, "cold move");
}

/// On the destination `dest` after a move, snapshot `s1` (taken on the source after `before`,
/// its counts there) reverted: the next boot shows the count the boot after the snapshot
/// showed, not a larger one (the TPM copy came with the snapshot and was put back); then the
/// VM is destroyed and no TPM is left.
fn revert_puts_back_the_snapshots_tpm(dest: &TestHost, name: &str, before: &[u64], how: &str) {
    dest.call("vm.stop", json!({ "name": name, "timeout_s": 1, "force": true }));
    wait::until_true(
        "the destination's swtpm to end",
        Duration::from_secs(10),
        || swtpms_of(dest).is_empty(),
        || format!("{:?}", swtpms_of(dest)),
    );
    dest.call("vm.revert", json!({ "name": name, "snapshot": "s1" }));
    assert_state_file(dest, name);
    dest.call("vm.start", json!({ "name": name }));
    dest.wait_serial_count(name, "VMHOST-TPM present", 2, BOOT);
    let after = reset_counts(dest, name);
    println!("{how}: reset counts on the source {before:?}, on the destination {after:?} (a revert between)");
    assert!(after[1] > before[1] && after[1] <= after[0], "the revert did not put back the snapshot's TPM: {after:?}");
    dest.call("vm.destroy", json!({ "name": name }));
    assert_no_tpm_left(dest, name);
}
