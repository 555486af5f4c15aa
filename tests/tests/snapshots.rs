//! Snapshots (docs/snapshots.md): a running guest's data disk snapshotted with a marker, the
//! marker overwritten, the VM stopped and reverted: the guest reads the first marker again; an
//! image VM's overlay snapshotted while stopped, overwritten so it no longer boots, reverted and
//! booting again; a tampered copy refused with the VM's disks untouched; a destroy removes
//! the snapshots. Consistency: a guest without an agent is snapshotted `crash` (and refused with
//! 4094 under `requires: "frozen"`, nothing left), one whose agent has nothing to freeze or
//! skips a vfat it cannot freeze too, one with only an ext4 mounted `frozen`; exports the same.
//! A stopped VM's copy is `stopped` only after a clean power-off: killed by `vm.stop`, or its
//! QEMU killed (`dead`), it is `crash` and refused under `requires: "frozen"`, as it is after a
//! revert to a crash snapshot. A revert to a snapshot taken before two replaces (image A, B, A
//! again) is refused: the replace made a new root disk, which does not hold it. Internal
//! snapshots (qcow2 disks): two reverted in either order, deleted out of order, a `snapshot:
//! false` disk left alone, a live move refused; a UEFI VM's variables store comes back; vmhostd
//! killed at every snapshot, delete and revert step leaves every disk readable.

use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use vmhost_tests::{boot_sector, disk_report, disk_spec, run_ok, workspace, Guest, HostOptions, TestHost};

const BOOT: Duration = Duration::from_secs(120);

fn host() -> TestHost {
    TestHost::start(HostOptions { memory_gib: 4, ..HostOptions::default() })
}

fn marks(host: &TestHost, vm: &str, boot: usize) -> Vec<String> {
    disk_report(host, vm, boot, BOOT).into_iter().map(|(_, serial, _, mark)| format!("{serial}={mark}")).collect()
}

fn names(list: &Value) -> Vec<&str> {
    list.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect()
}

/// Every entry of a directory, hidden ones (a `.NAME.partial`) included, sorted; none when it
/// does not exist.
fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// `vm.snapshot` and `vm.export` of `vm` with `requires: "frozen"` are refused with 4094 on
/// `requires`, and leave no snapshot, no snapshot directory entry and no backup. Returns the
/// snapshot's refusal.
fn refused_when_frozen_is_required(host: &TestHost, vm: &str) -> vmhost::api::ApiError {
    let snapshots_before = entries(&host.state().join("snapshots").join(vm));
    let backups_before = entries(&host.state().join("backups"));
    let (code, e) = host.call_err("vm.snapshot", json!({"name": vm, "snapshot": "must-freeze", "requires": "frozen"}));
    assert_eq!((code, e.field.as_deref()), (4094, Some("requires")), "{e:?}");
    assert_eq!(e.details["consistency"], "crash", "{e:?}");
    assert!(e.details["reason"].as_str().is_some_and(|r| !r.is_empty()), "{e:?}");
    assert!(!names(&host.call("vm.snapshots", json!({"name": vm}))).contains(&"must-freeze"));
    assert_eq!(entries(&host.state().join("snapshots").join(vm)), snapshots_before, "nothing left behind");
    let (code, ee) = host.call_err("vm.export", json!({"name": vm, "requires": "frozen"}));
    assert_eq!((code, ee.field.as_deref()), (4094, Some("requires")), "{ee:?}");
    assert_eq!(entries(&host.state().join("backups")), backups_before, "no backup, no partial one");
    e
}

/// The agent guest whose "agent" is tests/snapshots/mount-then-agent.sh: it mounts the data
/// disks `vmhost.fs=SERIAL:TYPE:DIR` names, then runs the real agent (built once per process).
fn mounting_agent_guest() -> Guest {
    static GUEST: std::sync::OnceLock<Guest> = std::sync::OnceLock::new();
    GUEST
        .get_or_init(|| {
            let base = vmhost_tests::agent_guest();
            let root = workspace();
            let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
            let agent = target.join("guest-agent/vmhost-agent");
            let script = root.join("tests/snapshots/mount-then-agent.sh");
            let initramfs = "initramfs-mount-agent.cpio.gz";
            let st = Command::new(root.join("tests/guest/build.sh"))
                .env(
                    "EXTRA_FILES",
                    format!("{}:/bin/vmhost-agent-real {}:/bin/vmhost-agent", agent.display(), script.display()),
                )
                .env("INITRAMFS_NAME", initramfs)
                .arg(root.join("target/guest"))
                .status()
                .expect("run tests/guest/build.sh");
            assert!(st.success(), "tests/guest/build.sh: {st}");
            Guest { kernel: base.kernel, initrd: root.join("target/guest").join(initramfs) }
        })
        .clone()
}

/// Creates VM `name` on the mounting agent guest with `disks` and `cmdline` (its `vmhost.fs=`
/// words) and waits for its mounts (`mounts` of them) and its agent.
fn mounting_vm(host: &TestHost, name: &str, disks: Value, cmdline: &str, mounts: usize) {
    let g = mounting_agent_guest();
    let spec = json!({"name": name, "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": format!("console=ttyS0 panic=-1 quiet {cmdline}")},
        "disks": disks});
    host.call("vm.create", json!({ "spec": spec }));
    vmhost_tests::wait::until("the mounts and the agent", BOOT, || {
        let log = host.serial(name);
        assert!(!log.contains("VMHOST-MOUNT-FAILED"), "{log}");
        let agent = host.call("vm.get", json!({"name": name}))["agent"]["connected"] == true;
        if log.matches("VMHOST-MOUNTED ").count() >= mounts && agent {
            Ok(())
        } else {
            Err(format!("agent connected: {agent}; serial:\n{log}"))
        }
    });
}

#[test]
fn a_guest_reads_its_first_marker_again_after_a_revert_of_a_live_snapshot() {
    let host = host();
    let disks = json!([{"name": "nsm", "size_gib": 1, "format": "raw"}, {"name": "logs", "size_gib": 1}]);
    host.call("vm.create", json!({ "spec": disk_spec(&host, "db", disks.clone(), "vmhost.writemark=nsm:first") }));
    assert_eq!(marks(&host, "db", 1), ["nsm=first", "logs=-"]);

    // This guest runs no agent: crash-consistent, and it says so; required frozen, refused.
    let e = refused_when_frozen_is_required(&host, "db");
    assert!(e.details["reason"].as_str().is_some_and(|r| r.contains("not connected")), "{e:?}");
    let s = host.call("vm.snapshot", json!({"name": "db", "snapshot": "s1"}));
    assert_eq!((&s["live"], &s["name"]), (&json!(true), &json!("s1")), "{s}");
    assert_eq!((&s["consistency"], &s["frozen"]), (&json!("crash"), &json!([])), "{s}");
    assert!(s["reason"].as_str().is_some_and(|r| r.contains("not connected")), "{s}");
    // The raw disk copied, the qcow2 one kept inside its file.
    let files: Vec<&str> = s["disks"].as_array().unwrap().iter().map(|d| d["file"].as_str().unwrap()).collect();
    assert_eq!(files, ["nsm.raw"]);
    assert_eq!((&s["internal"][0]["name"], &s["internal"][0]["kind"]), (&json!("logs"), &json!("internal")), "{s}");
    let (code, e) = host.call_err("vm.snapshot", json!({"name": "db", "snapshot": "s1"}));
    assert_eq!((code, e.field.as_deref()), (2001, Some("snapshot")), "taken");
    assert_eq!(host.call_err("vm.snapshot", json!({"name": "db", "snapshot": "../x"})).0, 2001);

    // The guest overwrites its marker.
    host.call(
        "vm.apply",
        json!({ "spec": disk_spec(&host, "db", disks.clone(), "vmhost.writemark=nsm:second"), "timeout_s": 5 }),
    );
    assert_eq!(marks(&host, "db", 2), ["nsm=second", "logs=-"]);
    let (code, _) = host.call_err("vm.revert", json!({"name": "db", "snapshot": "s1"}));
    assert_eq!(code, 4090, "a running VM is not reverted");

    host.call("vm.stop", json!({"name": "db", "force": true}));
    // The spec no longer writes a marker; the disks are the snapshot's.
    let mut quiet = disk_spec(&host, "db", disks.clone(), "");
    quiet["state"] = json!("stopped");
    host.call("vm.apply", json!({ "spec": quiet }));
    // A copy one byte of which changed: refused before anything changed (the qcow2 disk too).
    let copy = host.state().join("snapshots/db/s1/nsm.raw");
    let logs = host.state().join("disks/db/logs.qcow2");
    let logs_before = std::fs::read(&logs).unwrap();
    let mut data = std::fs::read(&copy).unwrap();
    data[0] ^= 0xff;
    std::fs::write(&copy, &data).unwrap();
    let (code, e) = host.call_err("vm.revert", json!({"name": "db", "snapshot": "s1"}));
    assert_eq!((code, e.details["file"].as_str()), (2003, Some("nsm.raw")), "{e:?}");
    assert_eq!(std::fs::read(&logs).unwrap(), logs_before, "nothing reverted");
    data[0] ^= 0xff;
    std::fs::write(&copy, &data).unwrap();
    let v = host.call("vm.revert", json!({"name": "db", "snapshot": "s1"}));
    assert_eq!(v["vm"]["status"], "stopped", "{v}");
    host.call("vm.start", json!({"name": "db"}));
    assert_eq!(marks(&host, "db", 3), ["nsm=first", "logs=-"], "the first marker again");

    // Listed, deleted, gone with the VM.
    host.call("vm.snapshot", json!({"name": "db", "snapshot": "s2"}));
    assert_eq!(names(&host.call("vm.snapshots", json!({"name": "db"}))), ["s1", "s2"]);
    let out = host.ctl(&["snapshots", "db"]);
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(table.lines().any(|l| l.starts_with("s2 ")) && table.contains("true"), "{table}");
    assert_eq!(host.call("vm.snapshots", json!({"name": "db"}))[0]["consistency"], "crash");
    let out = host.ctl(&["snapshot", "db", "s3"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("db: snapshot s3 taken (live, crash-consistent: "),
        "{out:?}"
    );
    let out = host.ctl(&["snapshot", "db", "s4", "--require-frozen"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("4094"), "{out:?}");
    let out = host.ctl(&["snapshot-delete", "db", "s3"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("db: snapshot s3 deleted"), "{out:?}");
    assert_eq!(host.call("vm.snapshot_delete", json!({"name": "db", "snapshot": "s1"}))["changed"], true);
    assert_eq!(host.call_err("vm.revert", json!({"name": "db", "snapshot": "s1"})).0, 4040);
    let dir = host.state().join("snapshots").join("db");
    assert!(dir.join("s2").join("snapshot.json").is_file());
    host.call("vm.destroy", json!({"name": "db"}));
    assert!(!dir.exists(), "a destroy removes the VM's snapshots");
}

#[test]
fn an_image_vms_overlay_is_put_back_and_a_replace_leaves_its_snapshot_unrevertable() {
    let host = host();
    boot_sector::write_image(&host.images().join("base.raw"), &boot_sector::serial_print("VMHOST-SNAP-BOOT"));
    let spec = json!({"name": "web", "cpu": 1, "memory_mib": 64, "boot": {"image": "base.raw", "disk_gib": 1}});
    host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial("web", "VMHOST-SNAP-BOOT", BOOT), "{}", host.serial("web"));
    let first_id = instance_id(&host, "web");
    host.call("vm.stop", json!({"name": "web", "force": true}));
    // Stopped, but by killing its QEMU: its disks are as a power cut left them, and a copy says
    // so; requires frozen is refused, nothing made.
    let e = refused_when_frozen_is_required(&host, "web");
    assert!(e.details["reason"].as_str().is_some_and(|r| r.contains("vm.stop had to kill")), "{e:?}");
    let s = host.call("vm.snapshot", json!({"name": "web", "snapshot": "good"}));
    // The overlay is qcow2: kept inside it, nothing copied.
    assert_eq!(
        (&s["live"], &s["disks"], &s["internal"][0]["name"]),
        (&json!(false), &json!([]), &json!("root")),
        "{s}"
    );
    assert_eq!(&s["consistency"], &json!("crash"), "{s}");
    assert!(s["reason"].as_str().is_some_and(|r| r.contains("vm.stop had to kill the VM's QEMU")), "{s}");
    assert_eq!(s["instance_id"], first_id.as_str(), "{s}");

    // The VM's disk changes (its boot sector zeroed in the overlay): it no longer boots.
    let overlay = host.state().join("disks").join("web.qcow2");
    run_ok(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write -z 0 512"]).arg(&overlay));
    let before = std::fs::read(&overlay).unwrap();

    // `timeout_s` is checked first, as vm.snapshot checks it: nothing reverted, nothing deleted.
    for bad in [json!(0), json!(86_401)] {
        for method in ["vm.revert", "vm.snapshot_delete"] {
            let (code, e) = host.call_err(method, json!({"name": "web", "snapshot": "good", "timeout_s": bad}));
            assert_eq!((code, e.field.as_deref()), (2001, Some("timeout_s")), "{method} {bad}: {e:?}");
        }
    }
    assert_eq!(std::fs::read(&overlay).unwrap(), before, "nothing reverted");
    host.call("vm.revert", json!({"name": "web", "snapshot": "good", "timeout_s": 600}));
    assert_ne!(std::fs::read(&overlay).unwrap(), before);
    let marker_count = |h: &TestHost| h.serial("web").matches("VMHOST-SNAP-BOOT").count();
    let seen = marker_count(&host);
    host.call("vm.start", json!({"name": "web"}));
    vmhost_tests::wait::until_true(
        "a boot after the revert",
        BOOT,
        || marker_count(&host) > seen,
        || host.serial("web"),
    );
    assert_eq!(instance_id(&host, "web"), first_id, "a revert of the same root disk keeps the instance");

    // Replaced by another image and back (each a new root disk, a new instance id): the new
    // overlay does not hold the snapshot, so a revert to it is refused before anything changes
    // (a copy-kind snapshot of a root disk would put back the instance id its guest booted with:
    // the unit tests of lifecycle::snapshots).
    boot_sector::write_image(&host.images().join("base2.raw"), &boot_sector::serial_print("VMHOST-SNAP-BOOT2"));
    let mut ids = vec![first_id.clone()];
    for image in ["base2.raw", "base.raw"] {
        let mut replaced = host.call("vm.get", json!({"name": "web"}))["spec"].clone();
        replaced["boot"]["image"] = json!(image);
        host.call("vm.apply", json!({"spec": replaced, "replace": true}));
        let id = instance_id(&host, "web");
        assert!(!ids.contains(&id), "{image}: a new instance {id} after {ids:?}");
        ids.push(id);
    }
    host.call("vm.stop", json!({"name": "web", "force": true}));
    let (code, e) = host.call_err("vm.revert", json!({"name": "web", "snapshot": "good"}));
    assert_eq!((code, e.field.as_deref()), (2001, Some("snapshot")), "{e:?}");
    assert!(e.message.contains("replace"), "{e:?}");
    let v = host.call("vm.get", json!({"name": "web"}));
    assert_eq!(v["instance_id"], ids[2].as_str(), "{v}");
    // No revert was recorded: the VM starts.
    assert_eq!(host.call("vm.start", json!({"name": "web"}))["vm"]["status"], "running");
}

/// The instance id in VM `name`'s cloud-init seed (its meta-data), checked against its view.
fn instance_id(host: &TestHost, name: &str) -> String {
    use std::io::Read;
    let seed = host.state().join("seeds").join(format!("{name}.img"));
    let fs = fatfs::FileSystem::new(std::fs::File::open(&seed).unwrap(), fatfs::FsOptions::new()).unwrap();
    let mut text = String::new();
    fs.root_dir().open_file("meta-data").unwrap().read_to_string(&mut text).unwrap();
    let meta: Value = serde_json::from_str(&text).unwrap();
    let id = meta["instance-id"].as_str().unwrap().to_string();
    assert_eq!(host.call("vm.get", json!({"name": name}))["instance_id"], id.as_str(), "the view shows the seed's");
    id
}

#[test]
fn a_copy_of_a_stopped_vm_is_stopped_only_after_a_clean_power_off() {
    let host = host();
    let disks = json!([{"name": "nsm", "size_gib": 1, "format": "raw"}]);
    let mut spec = disk_spec(&host, "pc", disks, "");
    spec["restart_policy"] = json!("never");
    host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial("pc", "VMHOST-GUEST-READY", BOOT), "{}", host.serial("pc"));

    // Its QEMU killed (a crash, an OOM kill): dead, and a copy is crash-consistent.
    let pid = host.call("vm.get", json!({"name": "pc"}))["pid"].as_i64().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    host.wait_status("pc", "dead", Duration::from_secs(30));
    let e = refused_when_frozen_is_required(&host, "pc");
    assert!(e.details["reason"].as_str().is_some_and(|r| r.contains("ended without a clean power-off")), "{e:?}");
    let s = host.call("vm.snapshot", json!({"name": "pc", "snapshot": "dead"}));
    assert_eq!((&s["live"], &s["consistency"]), (&json!(false), &json!("crash")), "{s}");
    assert!(s["reason"].as_str().is_some_and(|r| r.contains("ended without a clean power-off")), "{s}");
    // Stopped now, but nothing cleaned the disks since.
    host.call("vm.stop", json!({"name": "pc"}));
    assert_eq!(host.call("vm.get", json!({"name": "pc"}))["status"], "stopped");
    let e = refused_when_frozen_is_required(&host, "pc");
    assert!(e.details["reason"].as_str().is_some_and(|r| r.contains("ended without a clean power-off")), "{e:?}");

    // Started again and powered off cleanly (the guest answers the ACPI power button): stopped.
    host.call("vm.start", json!({"name": "pc"}));
    host.wait_serial_count("pc", "VMHOST-GUEST-READY", 2, BOOT);
    host.call("vm.stop", json!({"name": "pc", "timeout_s": 60}));
    assert!(host.serial("pc").contains("VMHOST-GUEST-POWEROFF"), "{}", host.serial("pc"));
    let s = host.call("vm.snapshot", json!({"name": "pc", "snapshot": "clean", "requires": "frozen"}));
    assert_eq!((&s["consistency"], s.get("reason")), (&json!("stopped"), None), "{s}");
    let x = host.call("vm.export", json!({"name": "pc", "requires": "frozen"}));
    assert_eq!(x["manifest"]["consistency"], "stopped", "{x}");

    // Reverted to the crash snapshot: the disks are that crash-consistent copy again.
    host.call("vm.revert", json!({"name": "pc", "snapshot": "dead"}));
    let e = refused_when_frozen_is_required(&host, "pc");
    assert!(e.details["reason"].as_str().is_some_and(|r| r.contains("which is crash-consistent")), "{e:?}");
    host.call("vm.revert", json!({"name": "pc", "snapshot": "clean"}));
    let s = host.call("vm.snapshot", json!({"name": "pc", "snapshot": "clean2", "requires": "frozen"}));
    assert_eq!(s["consistency"], "stopped", "{s}");
}

#[test]
fn the_guest_agent_freezes_the_guests_file_systems_around_a_live_copy() {
    let host = host();
    let g = vmhost_tests::agent_guest();
    let spec = json!({"name": "ag", "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"},
        "disks": [{"name": "nsm", "size_gib": 1, "format": "raw"}]});
    host.call("vm.create", json!({ "spec": spec }));
    host.wait_vm("ag", "to have its agent connected", BOOT, |v| v["agent"]["connected"] == true);
    let s = host.call("vm.snapshot", json!({"name": "ag", "snapshot": "quiet"}));
    // The test guest's root is its initramfs: nothing on a block device to freeze. The agent
    // answered, froze nothing: crash-consistent, and it says why.
    assert_eq!((&s["live"], &s["frozen"], &s["consistency"]), (&json!(true), &json!([]), &json!("crash")), "{s}");
    assert!(s["reason"].as_str().is_some_and(|r| r.contains("no file system to freeze")), "{s}");
    assert!(host.wait_serial("ag", "fs.thaw: thawed", BOOT), "{}", host.serial("ag"));
    let log = host.serial("ag");
    let (freeze, thaw) = (log.find("fs.freeze: froze").unwrap(), log.find("fs.thaw: thawed").unwrap());
    assert!(freeze < thaw, "frozen, then thawed: {log}");
    let e = host.call("vm.export", json!({"name": "ag"}));
    assert_eq!((&e["manifest"]["frozen"], &e["manifest"]["consistency"]), (&json!([]), &json!("crash")), "{e}");
    // The export froze and thawed too.
    host.wait_serial_count("ag", "fs.thaw: thawed", 2, BOOT);
    // Required frozen: refused after the freeze found nothing, the guest thawed again.
    let e = refused_when_frozen_is_required(&host, "ag");
    assert!(e.details["reason"].as_str().is_some_and(|r| r.contains("no file system to freeze")), "{e:?}");
    // Each refusal thawed.
    host.wait_serial_count("ag", "fs.thaw: thawed", 4, BOOT);
}

#[test]
fn a_file_system_the_agent_cannot_freeze_makes_the_copy_crash_and_an_ext4_alone_is_frozen() {
    let host = host();
    // An ext4 the agent freezes and a vfat (a UEFI guest's /boot/efi) it cannot.
    let disks =
        json!([{"name": "data", "size_gib": 1, "format": "raw"}, {"name": "efi", "size_gib": 1, "format": "raw"}]);
    mounting_vm(&host, "mixed", disks, "vmhost.fs=data:ext4:/data vmhost.fs=efi:vfat:/efi", 2);
    let e = refused_when_frozen_is_required(&host, "mixed");
    assert_eq!(e.details["frozen"], json!(["/data"]), "{e:?}");
    assert_eq!(
        (&e.details["skipped"][0]["mount"], &e.details["skipped"][0]["fstype"], &e.details["skipped"][0]["errno"]),
        (&json!("/efi"), &json!("vfat"), &json!(95)),
        "{e:?}"
    );
    let s = host.call("vm.snapshot", json!({"name": "mixed", "snapshot": "partly"}));
    assert_eq!((&s["consistency"], &s["frozen"]), (&json!("crash"), &json!(["/data"])), "{s}");
    assert!(s["reason"].as_str().is_some_and(|r| r.contains("/efi (vfat: ")), "{s}");
    assert_eq!(s["skipped"][0]["mount"], "/efi", "{s}");
    let listed = host.call("vm.snapshots", json!({"name": "mixed"}));
    assert_eq!((&listed[0]["consistency"], &listed[0]["skipped"][0]["mount"]), (&json!("crash"), &json!("/efi")));
    // The guest's journal (here its console) says what was skipped, and everything was thawed.
    assert!(host.wait_serial("mixed", "fs.freeze: skipped /efi (vfat)", BOOT), "{}", host.serial("mixed"));
    // Every freeze thawed.
    host.wait_serial_count("mixed", "fs.thaw: thawed [\"/data\"]", 3, BOOT);
    host.call("vm.destroy", json!({"name": "mixed"}));

    // Only the ext4: every file system frozen.
    mounting_vm(
        &host,
        "clean",
        json!([{"name": "data", "size_gib": 1, "format": "raw"}]),
        "vmhost.fs=data:ext4:/data",
        1,
    );
    let s = host.call("vm.snapshot", json!({"name": "clean", "snapshot": "frozen", "requires": "frozen"}));
    assert_eq!((&s["consistency"], &s["frozen"], s.get("reason")), (&json!("frozen"), &json!(["/data"]), None), "{s}");
    assert_eq!(host.call("vm.snapshots", json!({"name": "clean"}))[0]["consistency"], "frozen");
    let out = host.ctl(&["snapshot", "clean", "again", "--require-frozen"]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("clean: snapshot again taken (live, frozen: /data)"),
        "{out:?}"
    );
    let out = host.ctl(&["export", "clean", "--require-frozen"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("(live, frozen: /data)"), "{out:?}");
    let backup = entries(&host.state().join("backups")).into_iter().find(|b| b.starts_with("clean-")).unwrap();
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(host.state().join("backups").join(backup).join("manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!((&manifest["consistency"], &manifest["frozen"]), (&json!("frozen"), &json!(["/data"])), "{manifest}");
}

/// The internal snapshots' names in the qcow2 file `path` (`qemu-img info -U`: read while a
/// QEMU may have it open).
fn tags(path: &std::path::Path) -> Vec<String> {
    let out = run_ok(Command::new("qemu-img").args(["info", "-U", "--output=json"]).arg(path));
    let info: Value = serde_json::from_str(&out).unwrap();
    let list = info["snapshots"].as_array().cloned().unwrap_or_default();
    list.iter().map(|s| s["name"].as_str().unwrap().to_string()).collect()
}

/// `qemu-img check` finds nothing wrong with the qcow2 file `path` (the VM stopped).
fn assert_sound(path: &std::path::Path) {
    run_ok(Command::new("qemu-img").args(["check", "-q"]).arg(path));
}

/// The tag of snapshot `s` (a `vm.snapshot` answer or listing entry) in its qcow2 disks.
fn tag_of(s: &Value) -> String {
    s["internal"][0]["tag"].as_str().unwrap().to_string()
}

/// The spec of the three-disk guest `name` that writes `mark` on each disk at boot (none when
/// empty): a raw disk (copied), a qcow2 disk (kept inside its file) and a qcow2 disk with
/// `snapshot: false` (left out).
fn three_disks(host: &TestHost, name: &str, mark: &str) -> Value {
    let disks = json!([{"name": "nsm", "size_gib": 1, "format": "raw"}, {"name": "logs", "size_gib": 1},
                       {"name": "pcap", "size_gib": 1, "snapshot": false}]);
    let marks = if mark.is_empty() {
        String::new()
    } else {
        format!("vmhost.writemark=nsm:{mark} vmhost.writemark=logs:{mark} vmhost.writemark=pcap:{mark}")
    };
    disk_spec(host, name, disks, &marks)
}

/// Stops VM `name` (forced) and records a spec that writes no marker, stopped.
fn stop_quietly(host: &TestHost, name: &str) {
    host.call("vm.stop", json!({"name": name, "force": true}));
    let mut quiet = three_disks(host, name, "");
    quiet["state"] = json!("stopped");
    host.call("vm.apply", json!({ "spec": quiet }));
}

/// Internal snapshots (docs/snapshots.md): A of a running guest, more writes, B; reverted to A
/// then to B, each disk's marker is as it was then, but the `snapshot: false` disk keeps what
/// the guest wrote last; a live move is refused while they exist; deleted in another order than
/// taken (A live, B stopped), the other stays usable and the qcow2 file holds no tag after both.
#[test]
fn internal_snapshots_revert_either_way_delete_out_of_order_and_leave_a_disk_left_out_alone() {
    let host = host();
    host.call("vm.create", json!({ "spec": three_disks(&host, "is", "a") }));
    assert_eq!(marks(&host, "is", 1), ["nsm=a", "logs=a", "pcap=a"]);
    let v = host.call("vm.get", json!({"name": "is"}));
    assert!(v["spec"]["disks"][1].get("snapshot").is_none(), "the default is left out: {v}");
    assert_eq!(v["spec"]["disks"][2]["snapshot"], false, "{v}");
    let a = host.call("vm.snapshot", json!({"name": "is", "snapshot": "A"}));
    assert_eq!((&a["disks"][0]["file"], a["disks"].as_array().unwrap().len()), (&json!("nsm.raw"), 1), "{a}");
    assert_eq!((&a["internal"][0]["name"], &a["excluded"]), (&json!("logs"), &json!(["pcap"])), "{a}");
    assert!(tag_of(&a).starts_with("vmhost-A-") && tag_of(&a).len() == "vmhost-A-".len() + 8, "{a}");

    host.call("vm.apply", json!({ "spec": three_disks(&host, "is", "b"), "timeout_s": 5 }));
    assert_eq!(marks(&host, "is", 2), ["nsm=b", "logs=b", "pcap=b"]);
    let b = host.call("vm.snapshot", json!({"name": "is", "snapshot": "B"}));
    host.call("vm.apply", json!({ "spec": three_disks(&host, "is", "c"), "timeout_s": 5 }));
    assert_eq!(marks(&host, "is", 3), ["nsm=c", "logs=c", "pcap=c"]);
    let logs = host.state().join("disks/is/logs.qcow2");
    assert_eq!(tags(&logs), [tag_of(&a), tag_of(&b)]);
    assert!(tags(&host.state().join("disks/is/pcap.qcow2")).is_empty(), "the disk left out holds no tag");

    // `snapshot` changes in place, without a restart.
    let pid = host.call("vm.get", json!({"name": "is"}))["pid"].clone();
    let mut all_in = three_disks(&host, "is", "c");
    all_in["disks"][2]["snapshot"] = json!(true);
    host.call("vm.apply", json!({ "spec": all_in }));
    let v = host.call("vm.get", json!({"name": "is"}));
    assert_eq!((&v["pid"], v["spec"]["disks"][2].get("snapshot")), (&pid, None), "{v}");
    host.call("vm.apply", json!({ "spec": three_disks(&host, "is", "c") }));
    assert_eq!(host.call("vm.get", json!({"name": "is"}))["pid"], pid);

    // A live move cannot carry what is inside the disks: refused before anything is made (the
    // destination is not even tried: it would be 4001 `connect`).
    let (code, e) =
        host.call_err("vm.migrate", json!({"name": "is", "destination": "127.0.0.1:9", "secret": "00".repeat(32)}));
    assert_eq!((code, e.details["reason"].as_str()), (4097, Some("internal_snapshots")), "{e:?}");
    assert!(e.message.contains("cold") && e.message.contains("A, B"), "{e:?}");

    stop_quietly(&host, "is");
    host.call("vm.revert", json!({"name": "is", "snapshot": "A"}));
    host.call("vm.start", json!({"name": "is"}));
    assert_eq!(marks(&host, "is", 4), ["nsm=a", "logs=a", "pcap=c"], "A, and the disk left out as it was");
    host.call("vm.stop", json!({"name": "is", "force": true}));
    host.call("vm.revert", json!({"name": "is", "snapshot": "B"}));
    host.call("vm.start", json!({"name": "is"}));
    assert_eq!(marks(&host, "is", 5), ["nsm=b", "logs=b", "pcap=c"], "B after A");

    // A deleted first, by the running QEMU; B still reverts.
    assert_eq!(host.call("vm.snapshot_delete", json!({"name": "is", "snapshot": "A"}))["changed"], true);
    assert_eq!(tags(&logs), [tag_of(&b)]);
    host.call("vm.stop", json!({"name": "is", "force": true}));
    host.call("vm.revert", json!({"name": "is", "snapshot": "B"}));
    assert_sound(&logs);
    host.call("vm.start", json!({"name": "is"}));
    assert_eq!(marks(&host, "is", 6), ["nsm=b", "logs=b", "pcap=c"]);
    host.call("vm.stop", json!({"name": "is", "force": true}));
    // B deleted while stopped (an offline session).
    assert_eq!(host.call("vm.snapshot_delete", json!({"name": "is", "snapshot": "B"}))["changed"], true);
    assert!(tags(&logs).is_empty());
    assert_sound(&logs);
    assert!(names(&host.call("vm.snapshots", json!({"name": "is"}))).is_empty());
    assert!(entries(&host.state().join("snapshots/is")).is_empty(), "nothing left behind");
}

/// A UEFI VM's variables store is in its snapshots (a running VM's copied by its QEMU, a
/// stopped one's read) and comes back at a revert: a byte changed in the store while stopped
/// is undone.
#[test]
fn a_uefi_vms_variables_store_comes_back_at_a_revert() {
    let host = host();
    let mut spec = host.kernel_spec("efi");
    spec["boot"]["firmware"] = json!("uefi");
    host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial("efi", "VMHOST-GUEST-READY", Duration::from_secs(240)), "{}", host.serial("efi"));
    let live = host.call("vm.snapshot", json!({"name": "efi", "snapshot": "live"}));
    assert_eq!(live["uefi_vars"]["file"], "uefi-vars.fd", "{live}");
    host.call("vm.stop", json!({"name": "efi", "force": true}));
    let vars = host.state().join("disks/efi/uefi-vars.fd");
    let taken = std::fs::read(host.state().join("snapshots/efi/live/uefi-vars.fd")).unwrap();
    assert_eq!(taken.len() as u64, live["uefi_vars"]["bytes"].as_u64().unwrap());
    let cold = host.call("vm.snapshot", json!({"name": "efi", "snapshot": "cold"}));
    assert_eq!(cold["uefi_vars"]["file"], "uefi-vars.fd", "{cold}");
    let original = std::fs::read(&vars).unwrap();

    let flip = |at: usize| {
        let mut data = std::fs::read(&vars).unwrap();
        data[at] ^= 0x5a;
        std::fs::write(&vars, &data).unwrap();
        data
    };
    let changed = flip(original.len() / 2);
    host.call("vm.revert", json!({"name": "efi", "snapshot": "cold"}));
    assert_eq!(std::fs::read(&vars).unwrap(), original, "the stopped VM's store is back");
    assert_ne!(changed, original);
    flip(100);
    host.call("vm.revert", json!({"name": "efi", "snapshot": "live"}));
    assert_eq!(std::fs::read(&vars).unwrap(), taken, "the running VM's store as its QEMU copied it");
    host.call("vm.start", json!({"name": "efi"}));
    host.wait_serial_count("efi", "VMHOST-GUEST-READY", 2, Duration::from_secs(240));
}

/// vmhostd killed (SIGKILL) at each step of a snapshot, a delete and a revert, of a running VM
/// (its QEMU deletes the tags at the restart) and a stopped one (an offline session does):
/// after each restart no partial or half-deleted directory and no tag of it remain, the older
/// snapshot still reverts, and every disk is readable by the guest and sound (`qemu-img check`).
#[test]
fn a_crash_at_any_snapshot_step_leaves_every_disk_readable_and_older_snapshots_usable() {
    let mut host = host();
    host.call("vm.create", json!({ "spec": three_disks(&host, "cr", "one") }));
    assert_eq!(marks(&host, "cr", 1), ["nsm=one", "logs=one", "pcap=one"]);
    let base = host.call("vm.snapshot", json!({"name": "cr", "snapshot": "base"}));
    host.call("vm.apply", json!({ "spec": three_disks(&host, "cr", "two"), "timeout_s": 5 }));
    assert_eq!(marks(&host, "cr", 2), ["nsm=two", "logs=two", "pcap=two"]);
    let logs = host.state().join("disks/cr/logs.qcow2");
    let dir = host.state().join("snapshots/cr");
    let only_base = |host: &TestHost| {
        assert_eq!(entries(&dir), ["base"], "no leftover directory");
        assert_eq!(tags(&logs), [tag_of(&base)], "no leftover tag");
        assert_eq!(names(&host.call("vm.snapshots", json!({"name": "cr"}))), ["base"]);
    };

    for running in [true, false] {
        for step in ["snapshot:recorded", "snapshot:tagged"] {
            host.crash_during(step, "vm.snapshot", json!({"name": "cr", "snapshot": "p"}));
            let status = host.call("vm.get", json!({"name": "cr"}))["status"].clone();
            assert_eq!(status, if running { "running" } else { "stopped" }, "{step}");
            only_base(&host);
        }
        for step in ["snapshot-delete:renamed", "snapshot-delete:tags"] {
            host.call("vm.snapshot", json!({"name": "cr", "snapshot": "d"}));
            host.crash_during(step, "vm.snapshot_delete", json!({"name": "cr", "snapshot": "d"}));
            only_base(&host);
        }
        if running {
            stop_quietly(&host, "cr");
        }
    }
    assert_sound(&logs);

    // A revert killed once recorded (nothing loaded yet), then one killed after the qcow2 disks
    // were loaded, before the raw copy was renamed over its disk: no start until the revert is
    // run again, which finishes it.
    for step in ["revert:recorded", "revert:loaded"] {
        host.crash_during(step, "vm.revert", json!({"name": "cr", "snapshot": "base"}));
        assert_eq!(host.call_err("vm.start", json!({"name": "cr"})).0, 4090, "{step}");
        host.call("vm.revert", json!({"name": "cr", "snapshot": "base"}));
        assert_sound(&logs);
    }
    host.call("vm.start", json!({"name": "cr"}));
    assert_eq!(marks(&host, "cr", 3), ["nsm=one", "logs=one", "pcap=two"]);
    only_base(&host);
}
