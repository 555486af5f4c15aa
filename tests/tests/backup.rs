//! `vm.export` and `vm.import` (docs/backup.md) between two real vmhostds: a running VM's data
//! disk (raw) exported live and imported on another daemon, whose guest reads the marker the
//! first one wrote; a stopped image VM exported with its base flattened in and booted on a host
//! that lacks the image; a tampered backup refused with nothing left. A VM stopped by killing
//! its QEMU (and a VM imported stopped from such a backup) exports `crash` and is refused under
//! `requires: "frozen"`; one never started exports `stopped`. A backup is untrusted input, all
//! of it: a data disk whose qcow2 header names a host file as its backing file, one larger than
//! its spec, a root-less manifest naming a staged `boot.disk` are refused (2003) with nothing
//! made and nothing that was there removed; and such a disk put in as a kept disk by hand is
//! started and hot-plugged without QEMU ever opening the host file.

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

/// A host file no VM may read: world-readable in a world-searchable directory, so QEMU as
/// `qemu.user` could open it if anything made it try.
fn host_secret() -> (tempfile::TempDir, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = dir.path().join("vmhostd.toml");
    std::fs::write(&secret, "[auth]\ntoken = \"secret\"\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    (dir, secret)
}

/// `qemu-img create -f qcow2 PATH SIZE`, with `backing` named in its header (never opened: `-u`).
fn qcow2(path: &Path, size: &str, backing: Option<&Path>) {
    let mut cmd = Command::new("qemu-img");
    cmd.args(["create", "-q", "-f", "qcow2"]);
    if let Some(b) = backing {
        cmd.args(["-u", "-F", "raw", "-b"]).arg(b);
    }
    run_ok(cmd.arg(path).arg(size));
}

fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or_default().to_string()
}

/// Writes backup `name` into `host`'s backups directory by hand: `spec`, and each disk
/// `(role, name, format, source file)` copied in with its sha256 (or `sha` instead).
fn forge_backup(host: &TestHost, name: &str, spec: Value, disks: &[(&str, &str, &str, &Path, Option<&str>)]) {
    let dir = host.state().join("backups").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut entries = Vec::new();
    for (role, disk, format, source, sha) in disks {
        let file = if *role == "root" { "root.qcow2".to_string() } else { format!("{disk}.{format}") };
        std::fs::copy(source, dir.join(&file)).unwrap();
        let len = std::fs::metadata(source).unwrap().len();
        let sha = sha.map(str::to_string).unwrap_or_else(|| sha256(source));
        entries.push(json!({"role": role, "name": disk, "file": file, "format": format,
                            "virtual_size": 1u64 << 30, "bytes": len, "sha256": sha}));
    }
    let manifest = json!({"format": "vmhost-backup", "version": 1, "created_at": "2026-12-05T00:00:00Z",
        "vmhost_version": "0.1.0", "vm": spec["name"], "spec": spec, "live": false, "consistency": "stopped",
        "frozen": [], "disks": entries});
    std::fs::write(dir.join("manifest.json"), serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
}

#[test]
fn a_backup_is_untrusted_input_and_a_refused_one_changes_nothing() {
    let host = host();
    let (_secret_dir, secret) = host_secret();
    let work = tempfile::tempdir().unwrap();
    let import = host.state().join("import");
    std::fs::create_dir_all(&import).unwrap();
    let logs = json!([{"name": "logs", "size_gib": 1, "format": "qcow2"}]);

    // A data disk whose header names a host file as its backing file: 2003, nothing made.
    let backed = work.path().join("backed.qcow2");
    qcow2(&backed, "1G", Some(&secret));
    forge_backup(
        &host,
        "backed-1",
        disk_spec(&host, "bk", logs.clone(), ""),
        &[("data", "logs", "qcow2", &backed, None)],
    );
    let (code, e) = host.call_err("vm.import", json!({ "backup": "backed-1" }));
    assert_eq!(
        (code, e.field.as_deref(), e.details["file"].as_str()),
        (2003, Some("backup"), Some("logs.qcow2")),
        "{e:?}"
    );
    assert!(e.message.contains(&format!("backing file {:?}", secret.display().to_string())), "{}", e.message);
    assert_eq!(host.call_err("vm.get", json!({ "name": "bk" })).0, 4040);
    assert!(!host.state().join("kept-disks").join("bk").exists(), "its kept-disks directory goes too");
    assert!(import.is_dir() && entries(&import).is_empty(), "{:?}", entries(&import));

    // Larger than the spec says: 2003 (a qcow2's virtual size, a raw disk's length).
    let big = work.path().join("big.qcow2");
    qcow2(&big, "2G", None);
    forge_backup(&host, "big-1", disk_spec(&host, "big", logs.clone(), ""), &[("data", "logs", "qcow2", &big, None)]);
    let (code, e) = host.call_err("vm.import", json!({ "backup": "big-1" }));
    assert_eq!((code, e.field.as_deref()), (2003, Some("backup")), "{e:?}");
    assert!(e.message.contains("larger than the spec's 1 GiB"), "{}", e.message);
    let raw = work.path().join("big.raw");
    std::fs::File::create(&raw).unwrap().set_len(2 << 30).unwrap();
    let nsm = json!([{"name": "nsm", "size_gib": 1, "format": "raw"}]);
    forge_backup(&host, "bigraw-1", disk_spec(&host, "bigraw", nsm, ""), &[("data", "nsm", "raw", &raw, None)]);
    assert_eq!(host.call_err("vm.import", json!({ "backup": "bigraw-1" })).0, 2003);
    // Declared qcow2, a raw file: 2003.
    let plain = work.path().join("plain.raw");
    std::fs::write(&plain, vec![0u8; 1 << 20]).unwrap();
    forge_backup(
        &host,
        "fake-1",
        disk_spec(&host, "fake", logs.clone(), ""),
        &[("data", "logs", "qcow2", &plain, None)],
    );
    assert_eq!(host.call_err("vm.import", json!({ "backup": "fake-1" })).0, 2003);

    // A failed import with a root disk, the import directory empty before: its copy goes, the
    // directory stays (it once went with the last copy in it).
    let root = work.path().join("root.qcow2");
    qcow2(&root, "1M", None);
    let clean = work.path().join("clean.qcow2");
    qcow2(&clean, "1G", None);
    let spec = json!({"name": "rooted", "cpu": 1, "memory_mib": 64, "state": "stopped",
                      "boot": {"image": "gone.raw", "disk_gib": 1}, "disks": logs});
    let wrong = "0".repeat(64);
    forge_backup(
        &host,
        "rooted-1",
        spec,
        &[("root", "root", "qcow2", &root, None), ("data", "logs", "qcow2", &clean, Some(&wrong))],
    );
    let (code, e) = host.call_err("vm.import", json!({ "backup": "rooted-1" }));
    assert_eq!((code, e.details["file"].as_str()), (2003, Some("logs.qcow2")), "{e:?}");
    assert!(import.is_dir(), "paths.import stays");
    assert!(entries(&import).is_empty() && !host.state().join("kept-disks").join("rooted").exists());

    // Without a root disk, a spec naming a disk staged for another VM: 2003, the disk stays.
    let staged = import.join("staged.qcow2");
    qcow2(&staged, "1M", None);
    let thief =
        json!({"name": "thief", "cpu": 1, "memory_mib": 64, "state": "stopped", "boot": {"disk": "staged.qcow2"}});
    forge_backup(&host, "thief-1", thief, &[]);
    let (code, e) = host.call_err("vm.import", json!({ "backup": "thief-1" }));
    assert_eq!((code, e.field.as_deref()), (2003, Some("backup")), "{e:?}");
    assert!(e.message.contains("no root disk"), "{}", e.message);
    assert_eq!(entries(&import), ["staged.qcow2"]);
    assert_eq!(host.call_err("vm.get", json!({ "name": "thief" })).0, 4040);

    // A manifest that is a FIFO: 2003 at once (a plain open would wait for a writer forever).
    let fifo = host.state().join("backups").join("fifo-1");
    std::fs::create_dir_all(&fifo).unwrap();
    run_ok(Command::new("mkfifo").arg(fifo.join("manifest.json")));
    let (code, e) = host.call_err("vm.import", json!({ "backup": "fifo-1" }));
    assert_eq!((code, e.field.as_deref()), (2003, Some("backup")), "{e:?}");

    // A good one: imported, its data disk taken into the VM, no empty kept-disks/VM left.
    let mut good = disk_spec(&host, "good", logs.clone(), "");
    good["state"] = json!("stopped");
    forge_backup(&host, "good-1", good, &[("data", "logs", "qcow2", &clean, None)]);
    let v = host.call("vm.import", json!({ "backup": "good-1" }));
    assert_eq!(v["vm"]["status"], "stopped", "{v}");
    assert!(host.state().join("disks").join("good").join("logs.qcow2").is_file());
    assert!(!host.state().join("kept-disks").join("good").exists(), "no empty kept-disks/good");
    assert_eq!(entries(&import), ["staged.qcow2"], "what was there before stays");
}

#[test]
fn a_data_disk_whose_header_names_a_host_file_never_makes_qemu_open_it() {
    let host = host();
    let (_secret_dir, secret) = host_secret();
    // The operator's way in: a disk put in kept-disks by hand, taken back by a create (started
    // with the VM) and by an apply (hot-plugged).
    let kept = host.state().join("kept-disks").join("held");
    std::fs::create_dir_all(&kept).unwrap();
    qcow2(&kept.join("logs.qcow2"), "1G", Some(&secret));
    qcow2(&kept.join("extra.qcow2"), "1G", Some(&secret));
    let one = json!([{"name": "logs", "size_gib": 1, "format": "qcow2"}]);
    let v = host.call("vm.create", json!({ "spec": disk_spec(&host, "held", one, "") }));
    assert_eq!(v["vm"]["status"], "running", "{v}");
    // The guest watches for new disks only after its report (VMHOST-DISKS-DONE): a hot-plug
    // before that would be part of what it compares against, never reported as added.
    disk_report(&host, "held", 1, BOOT);
    let pid = v["vm"]["pid"].clone();
    let two = json!([{"name": "logs", "size_gib": 1, "format": "qcow2"}, {"name": "extra", "size_gib": 1, "format": "qcow2"}]);
    let v = host.call("vm.apply", json!({ "spec": disk_spec(&host, "held", two, ""), "restart": false }));
    assert_eq!((&v["vm"]["pid"], &v["vm"]["pending_restart"]), (&pid, &json!(false)), "hot-plugged: {v}");
    assert!(host.wait_serial("held", "VMHOST-DISK-ADDED", BOOT), "{}", host.serial("held"));
    // QEMU keeps a backing file it opened open as long as the disk's node: it has none.
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    assert!(fds.iter().any(|f| f.ends_with("extra.qcow2")), "the hot-plugged disk is open: {fds:?}");
    assert!(!fds.iter().any(|f| f.contains("vmhostd.toml")), "QEMU opened {}: {fds:?}", secret.display());
    assert_eq!(host.call("vm.get", json!({ "name": "held" }))["status"], "running");
}
