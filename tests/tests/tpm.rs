//! `tpm: true` (docs/images.md#tpm): a TPM 2.0 per VM, swtpm started by vmhostd before QEMU
//! as QEMU's user, its control channel a socket pair, its state in the VM's disk directory.
//!
//! The guest (tests/guest/init.sh) prints `VMHOST-TPM present reset_count=N`: N is the TPM's
//! resetCount (TPM2_ReadClock), which the TPM keeps in its persistent state and raises at each
//! boot. So a second boot showing a larger count proves the guest met the same TPM state again,
//! not a new TPM (which starts at 1). Between the boots the daemon is killed and restarted (the
//! VM and its swtpm run on, recognised by the new daemon), the VM is stopped (swtpm ends with
//! QEMU) and later restarted at once (the next swtpm starts only once the last let go of the
//! state), and swtpm is taken away (host.check names the VM that needs it, a start is refused with
//! 2001 on `spec.tpm`) and put back. The destroy removes the state. swtpm is a copy in a
//! directory of the test's own, so that it can go and come back, and so that the test finds
//! its own swtpm processes by their executable.

use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;
use vmhost_tests::{
    alive, argv_of, tpm_reset_counts as reset_counts, wait, HostOptions, TestHost, GUEST_READY, QEMU_USER,
};

/// How long a TCG boot may take on a busy 2-core machine.
const BOOT: Duration = Duration::from_secs(120);

/// The `host.check` item `tpm`.
fn tpm_item(host: &TestHost) -> Value {
    let report = host.call("host.check", json!({}));
    report["items"].as_array().unwrap().iter().find(|i| i["name"] == "tpm").cloned().expect("the item")
}

/// Live processes executing `binary` (swtpm runs from the test's own copy).
fn processes_of(binary: &Path) -> Vec<i32> {
    let mut found = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if fs::read_link(format!("/proc/{pid}/exe")).ok().as_deref() == Some(binary) && alive(pid) {
            found.push(pid);
        }
    }
    found
}

/// The one swtpm running from `binary`, waited for.
fn the_swtpm(binary: &Path) -> i32 {
    wait::until("one swtpm", Duration::from_secs(10), || match processes_of(binary).as_slice() {
        [pid] => Ok(*pid),
        other => Err(format!("swtpm processes: {other:?}")),
    })
}

/// A field of /proc/PID/status.
fn status_field(pid: i32, name: &str) -> String {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string()).unwrap_or_default()
}

/// Checks how swtpm `pid` runs: as QEMU's user with no capabilities, in a session of its own,
/// under a seccomp filter, holding the state directory and its control channel as descriptors
/// (3, a socket; 4, the directory) and nothing of the host by path.
fn assert_sandboxed(pid: i32, state: &Path) {
    let uid = nix::unistd::User::from_name(QEMU_USER).unwrap().expect("the test's QEMU user").uid.as_raw();
    assert_eq!(status_field(pid, "Uid:"), format!("{uid}\t{uid}\t{uid}\t{uid}"));
    assert_eq!(status_field(pid, "CapEff:"), "0000000000000000");
    assert_eq!(status_field(pid, "Seccomp:"), "2", "under a filter");
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    assert_eq!(rest[3], pid.to_string(), "a session of its own");
    // (The command line ends with a NUL, which argv_of keeps as an empty last argument.)
    let argv = argv_of(i64::from(pid));
    assert_eq!(
        argv[1..argv.len() - 1],
        [
            "socket",
            "--tpm2",
            "--ctrl",
            "type=unixio,clientfd=3",
            "--tpmstate",
            "dir=/proc/self/fd/4,mode=0600",
            "--terminate"
        ]
    );
    assert!(fs::read_link(format!("/proc/{pid}/fd/3")).unwrap().to_string_lossy().starts_with("socket:"));
    assert_eq!(fs::read_link(format!("/proc/{pid}/fd/4")).unwrap(), state);
}

#[test]
fn a_vm_keeps_its_tpm_across_restarts_of_the_vm_and_the_daemon_until_the_destroy() {
    let dir = tempfile::Builder::new().prefix("vmhtpm").tempdir_in("/tmp").unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let swtpm = dir.path().join("swtpm");
    fs::copy("/usr/bin/swtpm", &swtpm).unwrap();
    let mut host = TestHost::start(HostOptions {
        qemu_extra: format!("swtpm = {:?}\n", swtpm.display()),
        ..HostOptions::default()
    });
    let item = tpm_item(&host);
    assert_eq!(item["status"], "ok", "{item}");
    assert!(item["detail"].as_str().unwrap().contains("TPM emulator version"), "{item}");

    let mut spec = host.kernel_spec("tpm");
    spec["tpm"] = true.into();
    let vm = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    assert_eq!(vm["vm"]["spec"]["tpm"], true);
    host.wait_serial_count("tpm", "VMHOST-TPM present", 1, BOOT);
    assert!(host.wait_serial("tpm", GUEST_READY, BOOT));
    let first = reset_counts(&host, "tpm");
    assert_eq!(first.len(), 1, "{}", host.serial("tpm"));

    // swtpm: one, sandboxed like QEMU, on the VM's state directory (root's, 0703: others create
    // and rename by name only, and only swtpm holds a way in); its files are QEMU's user's.
    let state = host.state().join("disks/tpm/tpm");
    let pid = the_swtpm(&swtpm);
    assert_sandboxed(pid, &state);
    let m = fs::metadata(&state).unwrap();
    assert_eq!((m.mode() & 0o7777, m.uid()), (0o703, 0));
    assert_eq!(fs::metadata(state.parent().unwrap()).unwrap().mode() & 0o7777, 0o700);
    let permall = state.join("tpm2-00.permall");
    let m = fs::metadata(&permall).unwrap_or_else(|e| panic!("{}: {e}", permall.display()));
    assert_eq!(m.mode() & 0o7777, 0o600);
    assert_ne!(m.uid(), 0, "swtpm's");
    // QEMU holds the other end of the channel and the TPM device.
    let qemu = host.call("vm.get", json!({"name": "tpm"}))["pid"].as_i64().unwrap();
    let argv = argv_of(qemu);
    assert!(argv.iter().any(|a| a == "emulator,id=tpm0,chardev=tpm0-ctrl"), "{argv:?}");
    assert!(argv.iter().any(|a| a == "tpm-crb,tpmdev=tpm0,id=tpm0-dev"), "{argv:?}");

    // A daemon restart: QEMU and swtpm run on, and the new daemon keeps both.
    host.kill_daemon();
    host.spawn_daemon();
    assert_eq!(host.call("vm.get", json!({"name": "tpm"}))["status"], "running");
    assert_eq!(host.call("vm.get", json!({"name": "tpm"}))["pid"].as_i64(), Some(qemu));
    assert_eq!(processes_of(&swtpm), [pid], "the swtpm is the one that ran before");

    // A clean stop (the guest powers off): swtpm ends with QEMU, the state stays.
    host.call("vm.stop", json!({"name": "tpm", "timeout_s": 60}));
    wait::until_true("swtpm ended", Duration::from_secs(10), || !alive(pid), || format!("swtpm {pid} still runs"));
    assert!(processes_of(&swtpm).is_empty());
    assert!(permall.is_file(), "the state outlives the stop");

    // swtpm gone: host.check names the VM that needs it, a start is refused with nothing made.
    fs::remove_file(&swtpm).unwrap();
    let item = tpm_item(&host);
    assert_eq!(item["status"], "missing", "{item}");
    assert!(item["detail"].as_str().unwrap().contains("used by tpm"), "{item}");
    let (c, e) = host.call_err("vm.start", json!({"name": "tpm"}));
    assert_eq!((c, e.field.as_deref()), (2001, Some("spec.tpm")), "{e:?}");
    assert!(e.message.contains("swtpm"), "{e:?}");
    assert_eq!(host.call("vm.get", json!({"name": "tpm"}))["status"], "stopped");
    assert!(host.qemu_pids().is_empty(), "no QEMU");

    // Back: the second boot meets the same TPM (its reset count went on, a new one says 1).
    fs::copy("/usr/bin/swtpm", &swtpm).unwrap();
    let vm = host.call("vm.start", json!({"name": "tpm"}));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    host.wait_serial_count("tpm", "VMHOST-TPM present", 2, BOOT);
    let counts = reset_counts(&host, "tpm");
    assert_eq!(counts.len(), 2, "{counts:?}");
    assert!(counts[1] > counts[0], "the TPM state did not survive the restart: {counts:?}");
    let second = the_swtpm(&swtpm);
    assert_ne!(second, pid);
    // A restart kills QEMU and starts the VM again at once: the next swtpm waits for the last
    // one to let go of the state, and the third boot meets it too.
    host.call("vm.restart", json!({"name": "tpm", "timeout_s": 1, "force": true}));
    host.wait_serial_count("tpm", "VMHOST-TPM present", 3, BOOT);
    let counts = reset_counts(&host, "tpm");
    assert!(counts[2] > counts[1], "the TPM state did not survive the restart: {counts:?}");
    assert!(!alive(second), "the last swtpm ended");
    let third = the_swtpm(&swtpm);

    // The destroy ends swtpm and removes the state with the VM's disk directory.
    host.call("vm.destroy", json!({"name": "tpm"}));
    assert!(!alive(third), "swtpm ended");
    assert!(!state.exists(), "the destroy removed the TPM state");
    assert!(!host.state().join("disks/tpm").exists(), "and the VM's disk directory");
}

#[test]
fn a_vm_without_a_tpm_has_none_and_a_missing_swtpm_refuses_only_tpm_vms() {
    let host = TestHost::start(HostOptions {
        qemu_extra: "swtpm = \"/nonexistent/swtpm\"\n".into(),
        ..HostOptions::default()
    });
    // Needed by no VM: ok, saying what is wrong.
    let item = tpm_item(&host);
    assert_eq!(item["status"], "ok", "{item}");
    assert!(item["detail"].as_str().unwrap().contains("no VM uses"), "{item}");
    let mut spec = host.kernel_spec("tpm");
    spec["tpm"] = true.into();
    let (c, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!((c, e.field.as_deref()), (2001, Some("spec.tpm")), "{e:?}");
    assert_eq!(host.call("vm.list", json!({})), json!([]), "nothing made");
    // A VM without one starts and its guest finds no TPM; its spec leaves the field out.
    let vm = host.call("vm.create", json!({ "spec": host.kernel_spec("plain") }));
    assert!(vm["vm"]["spec"].get("tpm").is_none(), "{vm}");
    host.wait_serial_count("plain", "VMHOST-TPM absent", 1, BOOT);
    assert!(!host.state().join("disks/plain/tpm").exists());
    host.call("vm.destroy", json!({"name": "plain"}));
}

#[test]
fn a_daemon_killed_once_swtpm_runs_leaves_no_swtpm_and_a_failed_vm_that_starts() {
    let dir = tempfile::Builder::new().prefix("vmhtpm").tempdir_in("/tmp").unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let swtpm = dir.path().join("swtpm");
    fs::copy("/usr/bin/swtpm", &swtpm).unwrap();
    let mut host = TestHost::start(HostOptions {
        qemu_extra: format!("swtpm = {:?}\n", swtpm.display()),
        extra: "[lifecycle]\nautostart = false\n".into(),
        ..HostOptions::default()
    });
    let mut spec = host.kernel_spec("tpm");
    spec["tpm"] = true.into();
    host.crash_during("launch:tpm", "vm.create", json!({ "spec": spec }));
    // The daemon held QEMU's end of the channel: with it gone, swtpm ended by itself.
    wait::until_true(
        "swtpm to end with the daemon",
        Duration::from_secs(10),
        || processes_of(&swtpm).is_empty(),
        || format!("{:?}", processes_of(&swtpm)),
    );
    assert!(host.qemu_pids().is_empty());
    assert_eq!(host.call("vm.get", json!({"name": "tpm"}))["status"], "failed");
    // The state it made is the VM's, and the next start uses it.
    let vm = host.call("vm.start", json!({"name": "tpm"}));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    host.wait_serial_count("tpm", "VMHOST-TPM present", 1, BOOT);
    the_swtpm(&swtpm);
    host.call("vm.destroy", json!({"name": "tpm"}));
    assert!(processes_of(&swtpm).is_empty());
    assert!(!host.state().join("disks/tpm").exists());
}

/// The sha256 (hex) of a file the test reads as root.
fn sha256_of(path: &Path) -> String {
    let out = std::process::Command::new("sha256sum").arg(path).output().unwrap();
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

/// A snapshot keeps the TPM state (snapshot.json's `tpm`, each file with its sha256) and a
/// revert puts it back: the guest's reset count after the revert is at most the one the boot
/// after the snapshot showed, not a larger one, and the files put back are QEMU's user's again
/// (swtpm loads them: the guest finds its TPM). Then a backup of the running VM, imported on a
/// second vmhostd, boots with the same TPM (its count goes on from the last boot).
#[test]
fn a_snapshot_keeps_the_tpm_state_and_a_revert_puts_it_back() {
    let mut host = TestHost::start(HostOptions::default());
    let mut spec = host.kernel_spec("tpm");
    spec["tpm"] = true.into();
    let vm = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    host.wait_serial_count("tpm", "VMHOST-TPM present", 1, BOOT);
    assert!(host.wait_serial("tpm", GUEST_READY, BOOT));

    // Of the running VM: swtpm's files read while it runs.
    host.call("vm.snapshot", json!({"name": "tpm", "snapshot": "s1"}));
    let dir = host.state().join("snapshots/tpm/s1");
    let record: Value = serde_json::from_slice(&fs::read(dir.join("snapshot.json")).unwrap()).unwrap();
    let files = record["tpm"]["files"].as_array().unwrap_or_else(|| panic!("no tpm entry: {record}")).clone();
    let permall = files.iter().find(|f| f["name"] == "tpm2-00.permall").expect("the persistent state");
    assert_eq!(permall["file"], "tpm-tpm2-00.permall");
    let copy = dir.join("tpm-tpm2-00.permall");
    assert_eq!(permall["sha256"].as_str().unwrap(), sha256_of(&copy));
    assert_eq!(permall["bytes"].as_u64().unwrap(), fs::metadata(&copy).unwrap().len());
    let kept = fs::read(&copy).unwrap();

    // Two more boots: the count grows.
    host.call("vm.restart", json!({"name": "tpm", "timeout_s": 1, "force": true}));
    host.wait_serial_count("tpm", "VMHOST-TPM present", 2, BOOT);
    let counts = reset_counts(&host, "tpm");
    assert!(counts[1] > counts[0], "{counts:?}");
    host.call("vm.stop", json!({"name": "tpm", "timeout_s": 1, "force": true}));
    let state = host.state().join("disks/tpm/tpm/tpm2-00.permall");
    wait::until_true(
        "swtpm to let go",
        Duration::from_secs(10),
        || fs::read(&state).is_ok_and(|now| now != kept),
        || "the state did not change after the snapshot".into(),
    );

    // A revert killed after the disks were put back, before the TPM state was: the VM does not
    // start until the revert is run again, which puts the TPM state back too.
    host.crash_during("revert:placed", "vm.revert", json!({"name": "tpm", "snapshot": "s1"}));
    assert_ne!(fs::read(&state).unwrap(), kept, "the TPM state was not put back before the kill");
    assert_eq!(host.call_err("vm.start", json!({"name": "tpm"})).0, 4090);

    // The revert: the state is the snapshot's again, QEMU's user's, 0600.
    host.call("vm.revert", json!({"name": "tpm", "snapshot": "s1"}));
    assert_eq!(fs::read(&state).unwrap(), kept, "the TPM state put back");
    let uid = nix::unistd::User::from_name(QEMU_USER).unwrap().expect("the test's QEMU user").uid.as_raw();
    let m = fs::metadata(&state).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o7777), (uid, 0o600));
    let leftovers: Vec<_> = fs::read_dir(state.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("vmhost-restore"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // The next boot meets the snapshot's TPM: the count the boot after the snapshot showed.
    host.call("vm.start", json!({"name": "tpm"}));
    host.wait_serial_count("tpm", "VMHOST-TPM present", 3, BOOT);
    let counts = reset_counts(&host, "tpm");
    assert!(counts[2] > counts[0] && counts[2] <= counts[1], "the revert did not put back the TPM: {counts:?}");

    // A backup of the running VM holds the state (manifest, SHA256SUMS); imported on another
    // vmhostd, the VM's first boot there meets the same TPM: its count goes on.
    let export = host.call("vm.export", json!({"name": "tpm"}));
    let m = &export["manifest"];
    let files = m["tpm"]["files"].as_array().unwrap_or_else(|| panic!("no tpm entry: {m}"));
    assert!(files.iter().any(|f| f["file"] == "tpm-tpm2-00.permall"), "{m}");
    let backup = export["backup"].as_str().unwrap().to_string();
    let from = host.state().join("backups").join(&backup);
    let sums = fs::read_to_string(from.join("SHA256SUMS")).unwrap();
    assert!(sums.contains("  tpm-tpm2-00.permall\n"), "{sums}");
    let check =
        std::process::Command::new("sha256sum").args(["--check", "--quiet", "SHA256SUMS"]).current_dir(&from).status();
    assert!(check.unwrap().success());
    let mut other = TestHost::start(HostOptions::default());
    let to = other.state().join("backups").join(&backup);
    fs::create_dir_all(&to).unwrap();
    for e in fs::read_dir(&from).unwrap().flatten() {
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    // An import killed once it created the VM, before the TPM state was in: the restart removes
    // that VM (a start would have met a new TPM), the backup stays, and importing it again works.
    other.crash_during("import:created", "vm.import", json!({"backup": backup}));
    assert_eq!(other.call_err("vm.get", json!({"name": "tpm"})).0, 4040);
    assert!(!other.state().join("import/.tpm.placing").exists(), "the import's marker is gone");
    let v = other.call("vm.import", json!({"backup": backup}));
    assert_eq!(v["vm"]["status"], "running", "{v}");
    let state = other.state().join("disks/tpm/tpm/tpm2-00.permall");
    assert_ne!(fs::metadata(&state).unwrap().uid(), 0, "QEMU's user's");
    other.wait_serial_count("tpm", "VMHOST-TPM present", 1, BOOT);
    let there = reset_counts(&other, "tpm");
    assert!(there[0] > counts[2], "the imported VM met a new TPM: {there:?} after {counts:?}");
    other.call("vm.destroy", json!({"name": "tpm"}));
    host.call("vm.destroy", json!({"name": "tpm"}));
}
