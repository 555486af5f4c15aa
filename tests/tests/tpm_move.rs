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
use vmhost_tests::{wait, TestHost, QEMU_USER};

/// How long a TCG boot may take on a busy 2-core machine.
const BOOT: Duration = Duration::from_secs(120);

/// The reset counts the guest printed on `host`, one per boot, in order.
fn reset_counts(host: &TestHost, name: &str) -> Vec<u64> {
    host.serial(name)
        .lines()
        .filter_map(|l| l.split("VMHOST-TPM present reset_count=").nth(1))
        .map(|n| n.trim().parse().unwrap_or_else(|_| panic!("an unreadable TPM answer: {n}")))
        .collect()
}

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
        if !exe.as_deref().is_some_and(|p| p.file_name().is_some_and(|n| n == "swtpm")) {
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

#[test]
fn a_running_tpm_vm_moves_live_with_its_tpm_state() {
    let pair = Pair::start(PairOptions::default());
    let name = "tpmlive";
    let before = create_with_two_boots(&pair, name);

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
    println!("live move: reset counts on the source {before:?}, on the destination after a restart {there:?}");
    assert_state_file(dest, name);
    dest.call("vm.destroy", json!({ "name": name }));
    assert_no_tpm_left(dest, name);
}
