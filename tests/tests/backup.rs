//! `vm.export` and `vm.import` (docs/backup.md) between two real vmhostds: a running VM's data
//! disk (raw) exported live and imported on another daemon, whose guest reads the marker the
//! first one wrote; a stopped image VM exported with its base flattened in and booted on a host
//! that lacks the image; a tampered backup refused with nothing left. A VM stopped by killing
//! its QEMU (and a VM imported stopped from such a backup) exports `crash` and is refused under
//! `requires: "frozen"`; one never started exports `stopped`.

use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use vmhost_tests::{boot_sector, disk_report, disk_spec, run_ok, HostOptions, TestHost};

const BOOT: Duration = Duration::from_secs(120);

fn host() -> TestHost {
    TestHost::start(HostOptions { memory_gib: 4, ..HostOptions::default() })
}

/// Copies backup `name` from `from`'s backups directory to `to`'s.
fn copy_backup(from: &TestHost, to: &TestHost, name: &str) -> std::path::PathBuf {
    let src = from.state().join("backups").join(name);
    let dst = to.state().join("backups").join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn marks(host: &TestHost, vm: &str, boot: usize) -> Vec<String> {
    disk_report(host, vm, boot, BOOT).into_iter().map(|(_, serial, _, mark)| format!("{serial}={mark}")).collect()
}

#[test]
fn a_running_vm_exported_on_one_vmhostd_is_imported_on_another_with_its_data() {
    let a = host();
    let disks = json!([{"name": "nsm", "size_gib": 1, "format": "raw"}, {"name": "logs", "size_gib": 1}]);
    a.call("vm.create", json!({ "spec": disk_spec(&a, "db", disks.clone(), "vmhost.writemark=nsm:first") }));
    assert_eq!(marks(&a, "db", 1), ["nsm=first", "logs=-"]);
    // The guest keeps what it wrote; the spec no longer writes it.
    a.call("vm.apply", json!({ "spec": disk_spec(&a, "db", disks.clone(), ""), "timeout_s": 5 }));
    assert_eq!(marks(&a, "db", 2), ["nsm=first", "logs=-"]);

    let export = a.call("vm.export", json!({ "name": "db" }));
    let m = &export["manifest"];
    assert_eq!((&m["live"], &m["vm"]), (&json!(true), &json!("db")), "{export}");
    let files: Vec<&str> = m["disks"].as_array().unwrap().iter().map(|d| d["file"].as_str().unwrap()).collect();
    assert_eq!(files, ["nsm.raw", "logs.qcow2"], "a kernel VM has no root disk; data disks keep their format");
    let backup = export["backup"].as_str().unwrap().to_string();
    let dir = a.state().join("backups").join(&backup);
    assert_eq!(entries(&dir), ["SHA256SUMS", "logs.qcow2", "manifest.json", "nsm.raw"]);
    run_ok(Command::new("sha256sum").args(["--check", "--quiet", "SHA256SUMS"]).current_dir(&dir));
    let raw = std::fs::metadata(dir.join("nsm.raw")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert!(raw.len() == 1 << 30 && raw.blocks() * 512 < 64 << 20, "a sparse raw copy: {} blocks", raw.blocks());
    assert_eq!(a.call("vm.get", json!({"name": "db"}))["status"], "running", "the guest ran on");

    // Another vmhostd, another state directory: the VM comes back with its data.
    let b = host();
    copy_backup(&a, &b, &backup);
    let v = b.call("vm.import", json!({ "backup": backup }));
    assert_eq!(v["vm"]["status"], "running", "{v}");
    assert_eq!(marks(&b, "db", 1), ["nsm=first", "logs=-"]);
    assert_eq!(b.call_err("vm.import", json!({ "backup": backup })).1.field.as_deref(), Some("name"), "it exists");
    // Under another name, stopped.
    let v = b.call("vm.import", json!({ "backup": backup, "name": "db2", "state": "stopped" }));
    assert_eq!(v["vm"]["status"], "stopped", "{v}");
    assert_eq!(b.call_err("vm.import", json!({ "backup": "none" })).0, 4040);

    // vmhostctl: the same calls.
    let out = b.ctl(&["import", &backup, "--name", "db3", "--stopped"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("db3: changed, stopped"), "{out:?}");
    let out = b.ctl(&["export", "db3"]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success() && text.starts_with("db3: exported to "), "{out:?}");
}

#[test]
fn a_stopped_image_vm_comes_back_on_a_host_without_its_image_and_a_tampered_backup_leaves_nothing() {
    let a = host();
    boot_sector::write_image(&a.images().join("base.raw"), &boot_sector::serial_print("VMHOST-EXPORTED-ROOT"));
    let spec = json!({"name": "web", "cpu": 1, "memory_mib": 64, "boot": {"image": "base.raw", "disk_gib": 1}});
    a.call("vm.create", json!({ "spec": spec }));
    assert!(a.wait_serial("web", "VMHOST-EXPORTED-ROOT", BOOT), "{}", a.serial("web"));
    a.call("vm.stop", json!({ "name": "web", "force": true }));
    // Stopped by killing its QEMU: the copy is crash-consistent and says why; with requires
    // frozen it is refused before anything is made.
    let (code, e) = a.call_err("vm.export", json!({ "name": "web", "requires": "frozen" }));
    assert_eq!(
        (code, e.field.as_deref(), &e.details["consistency"]),
        (4094, Some("requires"), &json!("crash")),
        "{e:?}"
    );
    assert_eq!(entries(&a.state().join("backups")), Vec::<String>::new(), "nothing left");
    let export = a.call("vm.export", json!({ "name": "web" }));
    assert_eq!(export["manifest"]["live"], false);
    assert_eq!(export["manifest"]["disks"][0]["file"], "root.qcow2");
    assert_eq!(export["manifest"]["consistency"], "crash", "{export}");
    let reason = export["manifest"]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("vm.stop had to kill the VM's QEMU"), "{export}");
    let backup = export["backup"].as_str().unwrap().to_string();

    // A backup one byte of which changed: refused, and nothing is left on the host.
    let b = host();
    let copy = copy_backup(&a, &b, &backup);
    let root = copy.join("root.qcow2");
    let mut data = std::fs::read(&root).unwrap();
    let last = data.len() - 1;
    data[last] ^= 0xff;
    std::fs::write(&root, &data).unwrap();
    let (code, e) = b.call_err("vm.import", json!({ "backup": backup }));
    assert_eq!(
        (code, e.field.as_deref(), e.details["file"].as_str()),
        (2003, Some("backup"), Some("root.qcow2")),
        "{e:?}"
    );
    assert_eq!(b.call_err("vm.get", json!({ "name": "web" })).0, 4040);
    assert_eq!(entries(&b.state().join("import")), Vec::<String>::new(), "no copy left");
    assert!(!b.state().join("kept-disks").join("web").exists());

    // The real backup: the VM boots its flattened root disk on a host without base.raw.
    data[last] ^= 0xff;
    std::fs::write(&root, &data).unwrap();
    assert!(!b.images().join("base.raw").exists());
    // It was exported stopped, as its spec says; it is asked to run here.
    let v: Value = b.call("vm.import", json!({ "backup": backup, "state": "running" }));
    assert_eq!(v["vm"]["spec"]["boot"], json!({"disk": "web-root.qcow2", "disk_gib": 1}), "{v}");
    assert!(b.wait_serial("web", "VMHOST-EXPORTED-ROOT", BOOT), "{}", b.serial("web"));
    // Imported stopped from that crash-consistent backup: its disks are still as the kill left them.
    b.call("vm.import", json!({ "backup": backup, "name": "web2", "state": "stopped" }));
    let (code, e) = b.call_err("vm.export", json!({ "name": "web2", "requires": "frozen" }));
    assert_eq!(code, 4094, "{e:?}");
    assert!(e.details["reason"].as_str().is_some_and(|r| r.contains("which is crash-consistent")), "{e:?}");

    // A UEFI VM comes back a UEFI VM (its boot disk becomes boot.disk, its firmware stays).
    let uefi = json!({"name": "efi", "cpu": 1, "memory_mib": 256, "state": "stopped",
                      "boot": {"image": "base.raw", "disk_gib": 1, "firmware": "uefi"}});
    a.call("vm.create", json!({ "spec": uefi }));
    // Never started: nothing wrote its disks, so it meets requires frozen.
    let export = a.call("vm.export", json!({ "name": "efi", "requires": "frozen" }));
    assert_eq!(export["manifest"]["consistency"], "stopped", "{export}");
    let backup = export["backup"].as_str().unwrap().to_string();
    copy_backup(&a, &b, &backup);
    let v = b.call("vm.import", json!({ "backup": backup }));
    assert_eq!(v["vm"]["spec"]["boot"], json!({"disk": "efi-root.qcow2", "disk_gib": 1, "firmware": "uefi"}), "{v}");
    let export = b.call("vm.export", json!({ "name": "efi", "requires": "frozen" }));
    assert_eq!(export["manifest"]["consistency"], "stopped", "a stopped backup's import is clean: {export}");
}
