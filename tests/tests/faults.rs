//! Faults: vmhostd killed with SIGKILL at every step boundary of a create and a destroy (the
//! debug-build crash points of `vmhost::crashpoint`), then restarted. After each restart: no QEMU
//! without a running record, no tap without a live QEMU, no overlay or run-dir socket without a
//! record that owns it, and converging the same spec again ends with exactly one QEMU.
//!
//! The VM boots from an image (so there is an overlay and a cloud-init seed) with a NIC on a
//! bridge vmhostd owns (so there is a tap), in the daemon's own network namespace, and has two
//! data disks: `nsm`, kept on destroy (so from the second round on a create takes it back), and
//! `logs`. Whatever the crash, `nsm` exists exactly once, in the VM's disks or kept, never both.

use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use vmhost_tests::{HostOptions, TestHost, LAN_NETWORK};

const CREATE_STEPS: [&str; 11] = [
    "create:recorded",
    "create:overlay",
    "data_disk:reclaimed",
    "data_disk:made",
    "create:disks",
    "launch:recorded",
    "launch:bound",
    "launch:taps",
    "launch:spawned",
    "launch:launched",
    "create:running",
];
const DESTROY_STEPS: [&str; 4] = ["destroy:recorded", "teardown:killed", "destroy:torn-down", "destroy:disks"];
const RECONFIGURE_STEPS: [&str; 2] = ["reconfigure:recorded", "reconfigure:stopped"];

/// Autostart off: each test checks what a restart settles before anything is started again, then
/// converges itself (tests/tests/autostart.rs covers autostart).
fn host() -> TestHost {
    let extra = format!("{LAN_NETWORK}\n[lifecycle]\nautostart = false\n");
    let host = TestHost::start(HostOptions { netns: true, extra, ..HostOptions::default() });
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(host.images().join("base.qcow2"))
        .arg("64M")
        .status()
        .expect("qemu-img");
    assert!(st.success());
    host
}

fn spec(name: &str) -> Value {
    json!({"name": name, "cpu": 1, "memory_mib": 128, "boot": {"image": "base.qcow2", "disk_gib": 1},
           "nics": [{"network": "lan", "ipv4": {"mode": "static", "address": "10.0.0.9/24", "gateway": "10.0.0.1"}}],
           "disks": [{"name": "nsm", "size_gib": 1, "format": "raw", "keep_on_destroy": true},
                     {"name": "logs", "size_gib": 1}]})
}

fn crash_during(host: &mut TestHost, step: &str, method: &str, params: Value) {
    host.crash_during(step, method, params);
}

fn files_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

/// What a restarted daemon must show: everything on the host belongs to a record that says so.
fn assert_consistent(host: &TestHost, step: &str) {
    let vms = host.call("vm.list", json!({}));
    let vms = vms.as_array().expect("list");
    let running: Vec<&str> =
        vms.iter().filter(|v| v["status"] == "running").filter_map(|v| v["name"].as_str()).collect();
    let names: Vec<&str> = vms.iter().filter_map(|v| v["name"].as_str()).collect();
    let pids = host.qemu_pids();
    assert_eq!(pids.len(), running.len(), "{step}: QEMUs {pids:?}, running VMs {running:?}");
    for l in host.links() {
        if let Some(owner) = l["ifalias"].as_str().and_then(|a| a.strip_prefix("vmhost:vm=")) {
            if l["linkinfo"]["info_kind"] == "bridge" {
                continue;
            }
            assert!(running.contains(&owner), "{step}: link {} of {owner} without a live QEMU", l["ifname"]);
        }
    }
    for dir in files_in(&host.run()) {
        let path = host.run().join(&dir);
        if path.is_dir() {
            assert!(running.contains(&dir.as_str()), "{step}: run dir {dir} without a running VM");
        }
    }
    for f in files_in(&host.state().join("disks")) {
        assert!(names.iter().any(|n| f.starts_with(n)), "{step}: disk file {f} without a record");
        assert!(!f.contains("partial"), "{step}: half-made overlay {f} left");
        for d in files_in(&host.state().join("disks").join(&f)) {
            assert!(!d.contains("partial"), "{step}: half-made data disk {f}/{d} left");
        }
    }
    // The kept disk is never copied or lost: in the VM's disks or kept, not both.
    for vm in files_in(&host.state().join("kept-disks")) {
        let in_vm = host.state().join("disks").join(&vm).join("nsm.raw").exists();
        let kept = host.state().join("kept-disks").join(&vm).join("nsm.raw").exists();
        assert!(!(in_vm && kept), "{step}: nsm of {vm} both in use and kept");
    }
}

/// `nsm.raw` of VM `name` exists exactly once: in its disks or kept.
fn assert_nsm_once(host: &TestHost, name: &str, step: &str) {
    let in_vm = host.state().join("disks").join(name).join("nsm.raw").exists();
    let kept = host.state().join("kept-disks").join(name).join("nsm.raw").exists();
    assert!(in_vm ^ kept, "{step}: nsm of {name}: in the VM's disks {in_vm}, kept {kept}");
}

#[test]
fn a_daemon_killed_at_any_step_of_a_create_leaves_nothing_behind_and_never_starts_a_vm_twice() {
    let mut host = host();
    for step in CREATE_STEPS {
        let name = "crashy";
        crash_during(&mut host, step, "vm.create", json!({ "spec": spec(name) }));
        assert_consistent(&host, step);
        if step != CREATE_STEPS[0] {
            // From the second round on, nsm was kept by the last round's destroy.
            assert_nsm_once(&host, name, step);
        }
        // Converging the same spec again ends with one running VM, one QEMU.
        let v = host.call("vm.apply", json!({ "spec": spec(name) }));
        assert_eq!(v["vm"]["status"], "running", "{step}: {v}");
        assert_eq!(host.qemu_pids().len(), 1, "{step}: exactly one QEMU");
        assert_consistent(&host, step);
        host.call("vm.destroy", json!({ "name": name }));
        assert!(host.qemu_pids().is_empty(), "{step}");
        assert_consistent(&host, step);
        assert_nsm_once(&host, name, step);
    }
}

#[test]
fn a_daemon_killed_at_any_step_of_a_destroy_finishes_it_after_restart() {
    let mut host = host();
    for step in DESTROY_STEPS {
        let name = "doomed";
        host.call("vm.create", json!({ "spec": spec(name) }));
        crash_during(&mut host, step, "vm.destroy", json!({ "name": name }));
        assert_consistent(&host, step);
        let (code, _) = host.call_err("vm.get", json!({ "name": name }));
        assert_eq!(code, 4040, "{step}: the interrupted destroy was finished at start");
        assert_nsm_once(&host, name, step);
        assert!(!host.state().join("disks").join(name).exists(), "{step}: logs deleted, nsm kept");
        assert!(host.qemu_pids().is_empty(), "{step}");
    }
}

/// A reconfigure (memory changed, restart) interrupted at each of its steps: the restarted daemon
/// shows a consistent VM (never two QEMUs), the disk is the same file with the same bytes, and
/// applying the new spec again ends with one QEMU running it.
#[test]
fn a_daemon_killed_at_any_step_of_a_reconfigure_keeps_the_disk_and_converges() {
    use std::os::unix::fs::MetadataExt;
    let mut host = host();
    for step in RECONFIGURE_STEPS {
        let name = "changing";
        host.call("vm.create", json!({ "spec": spec(name) }));
        let disk = host.state().join("disks").join(format!("{name}.qcow2"));
        let write = "write -P 0x5a 2M 64k";
        host.call("vm.stop", json!({ "name": name, "timeout_s": 1 }));
        vmhost_tests::run_ok(Command::new("qemu-io").args(["-f", "qcow2", "-c", write]).arg(&disk));
        host.call("vm.start", json!({ "name": name }));
        let ino = std::fs::metadata(&disk).expect("overlay").ino();
        let mut changed = spec(name);
        changed["memory_mib"] = json!(192);
        crash_during(&mut host, step, "vm.apply", json!({ "spec": changed, "timeout_s": 1 }));
        assert_consistent(&host, step);
        assert!(host.qemu_pids().len() <= 1, "{step}: never two QEMUs");
        let v = host.call("vm.get", json!({ "name": name }));
        assert_eq!(v["spec"]["memory_mib"], 192, "{step}: the new spec was recorded before the crash");
        assert_eq!(std::fs::metadata(&disk).expect("overlay").ino(), ino, "{step}: same disk");
        // Converging the new spec again: one QEMU, running it.
        let v = host.call("vm.apply", json!({ "spec": changed, "timeout_s": 1 }));
        assert_eq!(
            (v["vm"]["status"].clone(), v["vm"]["pending_restart"].clone()),
            (json!("running"), json!(false)),
            "{step}: {v}"
        );
        let pids = host.qemu_pids();
        assert_eq!(pids.len(), 1, "{step}: exactly one QEMU");
        let argv = std::fs::read(format!("/proc/{}/cmdline", pids[0])).unwrap();
        let argv: Vec<&[u8]> = argv.split(|b| *b == 0).collect();
        assert!(argv.windows(2).any(|w| w[0] == b"-m" && w[1] == b"192"), "{step}: QEMU runs the new spec");
        assert_eq!(std::fs::metadata(&disk).expect("overlay").ino(), ino, "{step}: same disk");
        let read = "read -P 0x5a 2M 64k";
        let out =
            vmhost_tests::run_ok(Command::new("qemu-io").args(["-U", "-r", "-f", "qcow2", "-c", read]).arg(&disk));
        assert!(!out.contains("verification failed"), "{step}: marker lost: {out}");
        assert_consistent(&host, step);
        host.call("vm.destroy", json!({ "name": name }));
    }
}

/// Restarts vmhostd itself does (the restart policy, then autostart) go through the create's
/// launch steps: killed at one of them while restarting a crashed VM, the next daemon ends with
/// the VM running on exactly one QEMU, its disk the same file.
#[test]
fn a_daemon_killed_during_a_policy_restart_ends_with_one_qemu() {
    use std::os::unix::fs::MetadataExt;
    let mut host = TestHost::start(HostOptions { netns: true, extra: LAN_NETWORK.into(), ..HostOptions::default() });
    vmhost_tests::run_ok(
        Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(host.images().join("base.qcow2")).arg("64M"),
    );
    for step in ["launch:taps", "launch:spawned", "launch:launched"] {
        let name = "phoenix";
        let v = host.call("vm.create", json!({ "spec": spec(name) }));
        let disk = host.state().join("disks").join(format!("{name}.qcow2"));
        let ino = std::fs::metadata(&disk).expect("overlay").ino();
        host.arm_crash(step);
        let qemu = nix::unistd::Pid::from_raw(v["vm"]["pid"].as_i64().expect("pid") as i32);
        nix::sys::signal::kill(qemu, nix::sys::signal::Signal::SIGKILL).expect("kill QEMU");
        // The policy restarts it after 1 s and the daemon dies at the crash point.
        host.restart_after_crash(step);
        // Re-adopted or started by autostart: running, one QEMU, the same disk.
        host.wait_status(name, "running", Duration::from_secs(300));
        assert_eq!(host.qemu_pids().len(), 1, "{step}: exactly one QEMU");
        assert_eq!(std::fs::metadata(&disk).expect("overlay").ino(), ino, "{step}: same disk");
        assert_consistent(&host, step);
        host.call("vm.destroy", json!({ "name": name }));
    }
}

/// A state file system with no space left: a create is refused with a clear error naming the
/// record, earlier records stay intact and loadable, and nothing of the refused VM is left.
#[test]
fn a_full_state_disk_refuses_clearly_and_keeps_old_records() {
    let mut host = TestHost::prepare(HostOptions::default());
    let state = host.state();
    std::fs::create_dir_all(&state).expect("state dir");
    let st = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "vmhost-full-state"]).arg(&state).status();
    assert!(st.is_ok_and(|s| s.success()), "mount a small tmpfs on the state dir");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(state.clone());
    host.spawn_daemon();
    let mut keep = host.kernel_spec("keep");
    keep["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": keep }));
    let before = host.call("vm.get", json!({ "name": "keep" }));

    // Fill the file system.
    let filler = state.join("filler");
    let mut f = std::fs::File::create(&filler).expect("filler");
    let chunk = vec![0u8; 64 * 1024];
    while std::io::Write::write_all(&mut f, &chunk).is_ok() {}
    drop(f);

    let (code, e) = host.call_err("vm.create", json!({ "spec": host.kernel_spec("refused") }));
    assert_eq!(code, 4001, "{e:?}");
    assert!(e.message.contains("refused") && e.message.to_lowercase().contains("space"), "{}", e.message);
    assert_eq!(e.details["step"], "state", "{e:?}");
    assert!(host.qemu_pids().is_empty(), "nothing was launched");
    assert_eq!(host.call_err("vm.get", json!({ "name": "refused" })).0, 4040);

    // The old record survived, also across a restart with space again.
    std::fs::remove_file(&filler).expect("remove filler");
    host.stop_daemon();
    host.spawn_daemon();
    let after = host.call("vm.get", json!({ "name": "keep" }));
    assert_eq!(after["spec"], before["spec"]);
    assert_eq!(host.call_err("vm.get", json!({ "name": "refused" })).0, 4040);
    let names: Vec<String> = files_in(&state);
    assert!(!names.iter().any(|n| n.contains("refused")), "no file of the refused VM: {names:?}");
    host.stop_daemon();
}

/// A create importing an existing disk (`boot.disk`) killed at each step from the move on: the
/// restarted daemon gives the disk back to the import directory (same inode, its mode again) and
/// records the VM failed, and a start imports it again; killed once the VM runs, the disk stays
/// the VM's. Whatever the crash, the disk exists exactly once.
#[test]
fn a_daemon_killed_while_importing_a_disk_gives_it_back_or_keeps_it() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let extra = "[lifecycle]\nautostart = false\n".to_string();
    let mut host = TestHost::start(HostOptions { extra, ..HostOptions::default() });
    let source = host.state().join("import").join("old.qcow2");
    let root = host.state().join("disks").join("imp").join("root.qcow2");
    let spec = json!({"name": "imp", "cpu": 1, "memory_mib": 128, "boot": {"disk": "old.qcow2"}});
    let fixture = || {
        vmhost_tests::run_ok(Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(&source).arg("64M"));
        std::fs::set_permissions(&source, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        std::fs::metadata(&source).expect("fixture").ino()
    };
    for step in ["root_disk:moved", "create:recorded", "create:disks", "launch:spawned", "launch:launched"] {
        let ino = fixture();
        crash_during(&mut host, step, "vm.create", json!({ "spec": spec }));
        let v = host.call("vm.get", json!({ "name": "imp" }));
        assert_eq!(v["status"], "failed", "{step}: {v}");
        assert!(!root.exists(), "{step}: the disk is still in the VM's directory");
        let meta = std::fs::metadata(&source).unwrap_or_else(|e| panic!("{step}: not given back: {e}"));
        assert_eq!((meta.ino(), meta.mode() & 0o777), (ino, 0o640), "{step}: the same file, its mode again");
        assert!(host.qemu_pids().is_empty(), "{step}: no QEMU of an undone create");
        // A start of the failed VM imports it again.
        let v = host.call("vm.start", json!({ "name": "imp" }));
        assert_eq!(v["vm"]["status"], "running", "{step}: {v}");
        assert!(root.is_file() && !source.exists(), "{step}: imported again");
        host.call("vm.destroy", json!({ "name": "imp" }));
        assert!(!root.exists() && !source.exists(), "{step}: a destroy deletes it");
    }
    // Killed after the VM runs on it: the import is done, the disk is the VM's.
    let ino = fixture();
    crash_during(&mut host, "create:running", "vm.create", json!({ "spec": spec }));
    let v = host.call("vm.get", json!({ "name": "imp" }));
    assert_eq!(v["status"], "running", "re-adopted: {v}");
    assert_eq!(std::fs::metadata(&root).expect("root disk").ino(), ino);
    assert!(!source.exists());
    host.call("vm.destroy", json!({ "name": "imp" }));
    assert!(!root.exists() && !source.exists());
}

/// A live disk change killed at each of its steps: a disk made for a hot-plug but not attached
/// yet, one attached but not recorded, one the guest released but not recorded. The restarted
/// daemon re-adopts the same QEMU and takes what QEMU has as the truth: the unattached disk is
/// deleted (nothing half-attached stays in QEMU, the change stays pending), the attached one is
/// the VM's, the released one's file is gone. Applying the spec again converges live, same QEMU.
#[test]
fn a_daemon_killed_during_a_hot_plug_or_unplug_settles_from_what_qemu_has() {
    let extra = "[lifecycle]\nautostart = false\n".to_string();
    let mut host = TestHost::start(HostOptions { netns: true, extra, ..HostOptions::default() });
    let spec = |disks: Value| {
        let mut s = host.kernel_spec("hot");
        s["disks"] = disks;
        s
    };
    let one = spec(json!([{"name": "a", "size_gib": 1}]));
    let two = spec(json!([{"name": "a", "size_gib": 1}, {"name": "b", "size_gib": 1}]));
    let b = host.state().join("disks").join("hot").join("b.qcow2");
    let pid_of = |host: &TestHost| host.call("vm.get", json!({ "name": "hot" }))["pid"].clone();
    for (step, pending_after, b_after) in [("data_disk:made", true, false), ("hotplug:attached", false, true)] {
        host.call("vm.create", json!({ "spec": one }));
        let pid = pid_of(&host);
        crash_during(&mut host, step, "vm.apply", json!({ "spec": two, "timeout_s": 5 }));
        assert_consistent(&host, step);
        let v = host.call("vm.get", json!({ "name": "hot" }));
        assert_eq!((&v["status"], &v["pid"]), (&json!("running"), &pid), "{step}: the same QEMU re-adopted: {v}");
        assert_eq!(v["pending_restart"], pending_after, "{step}: {v}");
        assert_eq!(b.exists(), b_after, "{step}: b made but not attached is deleted; attached, it stays");
        let v = host.call("vm.apply", json!({ "spec": two, "timeout_s": 5 }));
        assert_eq!((&v["vm"]["pid"], &v["vm"]["pending_restart"]), (&pid, &json!(false)), "{step}: live: {v}");
        assert!(b.is_file(), "{step}");
        host.call("vm.destroy", json!({ "name": "hot" }));
    }
    // Unplugged (the guest let go) but not recorded: the file goes after the restart.
    host.call("vm.create", json!({ "spec": two }));
    assert!(host.wait_serial("hot", "VMHOST-GUEST-READY", Duration::from_secs(120)), "{}", host.serial("hot"));
    let pid = pid_of(&host);
    crash_during(&mut host, "hotplug:detached", "vm.apply", json!({ "spec": one, "timeout_s": 5 }));
    assert_consistent(&host, "hotplug:detached");
    let v = host.call("vm.get", json!({ "name": "hot" }));
    assert_eq!((&v["pid"], &v["pending_restart"]), (&pid, &json!(false)), "{v}");
    assert!(!b.exists(), "the released disk's file is deleted");
    host.call("vm.destroy", json!({ "name": "hot" }));
}

#[test]
fn an_image_import_killed_before_or_after_its_rename_leaves_no_temp_file_and_no_half_image() {
    let mut host = TestHost::start(HostOptions::default());
    let data = vec![0x5au8; 3 * 1024 * 1024 + 17];
    let sha = vmhost_tests::sha256_hex(&data);
    std::fs::write(host.state().join("import").join("up.raw"), &data).unwrap();
    let params = json!({"name": "base.raw", "sha256": sha, "source": "up.raw"});

    // Hashed, not yet renamed: the temp file is all there is, and the restart removes it.
    crash_during(&mut host, "image:hashed", "image.import", params.clone());
    assert_eq!(files_in(&host.images()), Vec::<String>::new(), "no image and no temp file");
    assert_eq!(host.call("image.list", json!({})), json!([]));

    // Renamed, not yet recorded: a whole image without a record (as if put there by hand),
    // which the same import then records where it is.
    crash_during(&mut host, "image:placed", "image.import", params.clone());
    assert_eq!(files_in(&host.images()), vec!["base.raw".to_string()]);
    assert_eq!(std::fs::read(host.images().join("base.raw")).unwrap(), data, "whole");
    assert_eq!(host.call("image.list", json!({}))[0]["sha256"], Value::Null);
    let v = host.call("image.import", params);
    assert_eq!((&v["changed"], &v["image"]["sha256"]), (&json!(true), &json!(sha)), "{v}");
}

#[test]
fn an_interrupted_revert_keeps_the_vm_from_starting_until_a_revert_completes() {
    let mut host = TestHost::start(HostOptions::default());
    let mut spec = host.kernel_spec("rv");
    spec["state"] = json!("stopped");
    spec["disks"] = json!([{"name": "nsm", "size_gib": 1, "format": "raw"}]);
    host.call("vm.create", json!({ "spec": spec }));
    host.call("vm.snapshot", json!({"name": "rv", "snapshot": "s"}));

    crash_during(&mut host, "revert:recorded", "vm.revert", json!({"name": "rv", "snapshot": "s"}));
    let (code, e) = host.call_err("vm.start", json!({"name": "rv"}));
    assert_eq!(code, 4090, "{e:?}");
    assert!(e.message.contains("interrupted"), "{e:?}");
    assert!(host.qemu_pids().is_empty(), "nothing started");
    host.call("vm.revert", json!({"name": "rv", "snapshot": "s"}));
    assert_eq!(files_in(&host.state().join("disks").join("rv")), vec!["nsm.raw".to_string()], "no copy left");
    let v = host.call("vm.start", json!({"name": "rv"}));
    assert_eq!(v["vm"]["status"], "running", "{v}");
}
