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

/// The sha256 of what the guest reads of qcow2 or raw disk `path` (converted to raw by
/// qemu-img, `-U`: a running VM may hold it).
fn guest_sha(path: &Path, format: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("disk.raw");
    run_ok(Command::new("qemu-img").args(["convert", "-U", "-f", format, "-O", "raw"]).arg(path).arg(&raw));
    vmhost_tests::sha256_file(&raw)
}

/// Writes `pattern` over `len` at `offset` into a stopped VM's qcow2 disk, as its guest would
/// (qemu-io opens it read-write, so its dirty bitmaps record the write).
fn write_into(path: &Path, pattern: u8, offset: &str, len: &str) {
    run_ok(
        Command::new("qemu-io").args(["-f", "qcow2", "-c", &format!("write -P {pattern} {offset} {len}")]).arg(path),
    );
}

/// `(name, kind, full_reason)` of each disk of an export's manifest.
fn changes(export: &Value) -> Vec<(String, String, String)> {
    export["manifest"]["changes"]
        .as_array()
        .unwrap_or(&Vec::new())
        .iter()
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
            (s("name"), s("kind"), s("full_reason"))
        })
        .collect()
}

fn backup_dirs(host: &TestHost) -> Vec<String> {
    entries(&host.state().join("backups"))
}

/// A running guest's disks backed up full, then twice incrementally (after a restart of the
/// VM and after one of the daemon: the change tracking survives both), with markers the guest
/// wrote between them; the chain is copied to a second vmhostd and imported there: every disk
/// equal (sha256 of what the guest reads) to the source's at the last increment's instant, and
/// the guest there reads the last marker. The raw disk is copied whole every time, with why.
#[test]
fn an_incremental_chain_comes_back_on_another_vmhostd_equal_to_the_source() {
    let mut a = host();
    let disks = json!([{"name": "nsm", "size_gib": 1, "format": "raw"}, {"name": "logs", "size_gib": 1}]);
    let spec = |a: &TestHost, mark: &str| disk_spec(a, "db", disks.clone(), &format!("vmhost.writemark=logs:{mark}"));
    a.call("vm.create", json!({ "spec": spec(&a, "one") }));
    assert_eq!(marks(&a, "db", 1), ["nsm=-", "logs=one"]);

    let full = a.call("vm.export", json!({ "name": "db", "incremental": true }));
    assert_eq!((&full["manifest"]["version"], &full["manifest"]["kind"]), (&json!(2), &json!("full")), "{full}");
    let c = changes(&full);
    assert_eq!((c[0].1.as_str(), c[1].1.as_str()), ("full", "full"));
    assert!(c[0].2.starts_with("raw disk") && c[1].2 == "no previous backup", "{c:?}");

    // A restart of the VM (a clean power-off: QEMU stores the bitmap) and a new marker.
    a.call("vm.apply", json!({ "spec": spec(&a, "two"), "timeout_s": 60 }));
    assert_eq!(marks(&a, "db", 2), ["nsm=-", "logs=two"]);
    let inc1 = a.call("vm.export", json!({ "name": "db", "incremental": true }));
    let m = &inc1["manifest"];
    assert_eq!((&m["kind"], &m["parent"]["dir"]), (&json!("incremental"), &full["backup"]), "{inc1}");
    let c = changes(&inc1);
    assert_eq!((c[0].1.as_str(), c[1].1.as_str(), c[1].2.as_str()), ("full", "incremental", ""), "{c:?}");
    let inc1_dir = a.state().join("backups").join(inc1["backup"].as_str().unwrap());
    let small = std::fs::metadata(inc1_dir.join("logs.qcow2")).unwrap().len();
    assert!(small < 8 << 20, "the increment holds what changed, not the disk: {small} bytes");

    // A restart of the daemon (QEMU runs on), then of the VM, and the last marker.
    a.stop_daemon();
    a.spawn_daemon();
    a.call("vm.apply", json!({ "spec": spec(&a, "three"), "timeout_s": 60 }));
    assert_eq!(marks(&a, "db", 3), ["nsm=-", "logs=three"]);
    let out = a.ctl(&["export", "db", "--incremental"]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success() && text.contains("incremental over "), "{out:?}");
    assert!(text.contains("nsm: copied whole: raw disk"), "{text}");
    let inc2 = backup_dirs(&a).into_iter().filter(|d| !d.starts_with('.')).max().unwrap();
    assert!(text.contains(&inc2), "{text} names {inc2}");

    // The source as it was at that instant: the guest wrote nothing since its marker.
    a.call("vm.stop", json!({ "name": "db" }));
    let disk_dir = a.state().join("disks/db");
    let source = (guest_sha(&disk_dir.join("nsm.raw"), "raw"), guest_sha(&disk_dir.join("logs.qcow2"), "qcow2"));

    let mut b = host();
    for name in [full["backup"].as_str().unwrap(), inc1["backup"].as_str().unwrap(), inc2.as_str()] {
        copy_backup(&a, &b, name);
    }
    // Without its middle link the chain is refused and nothing is made.
    let mid = b.state().join("backups").join(inc1["backup"].as_str().unwrap());
    let aside = b.state().join("aside");
    std::fs::rename(&mid, &aside).unwrap();
    let (code, e) = b.call_err("vm.import", json!({ "backup": inc2, "state": "stopped" }));
    assert_eq!((code, e.field.as_deref()), (4040, Some("backup")), "{e:?}");
    std::fs::rename(&aside, &mid).unwrap();
    // A changed byte in the full backup at the bottom: refused before anything is written.
    let bottom = b.state().join("backups").join(full["backup"].as_str().unwrap()).join("logs.qcow2");
    let saved = std::fs::read(&bottom).unwrap();
    let mut bad = saved.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    std::fs::write(&bottom, &bad).unwrap();
    let (code, e) = b.call_err("vm.import", json!({ "backup": inc2, "state": "stopped" }));
    assert_eq!((code, e.details["file"].as_str()), (2003, Some("logs.qcow2")), "{e:?}");
    assert!(entries(&b.state().join("disks")).is_empty() && entries(&b.state().join("kept-disks")).is_empty());
    std::fs::write(&bottom, &saved).unwrap();

    let v = b.call("vm.import", json!({ "backup": inc2, "state": "stopped" }));
    assert_eq!(v["vm"]["status"], "stopped", "{v}");
    let there = b.state().join("disks/db");
    assert_eq!((guest_sha(&there.join("nsm.raw"), "raw"), guest_sha(&there.join("logs.qcow2"), "qcow2")), source);
    b.call("vm.start", json!({ "name": "db" }));
    assert_eq!(marks(&b, "db", 1), ["nsm=-", "logs=three"]);
    b.stop_daemon();
}

/// kill -9 of vmhostd at each step of an incremental export and of a prune (a stopped VM,
/// written into between backups): afterwards no half backup is left, the next export is still
/// incremental, and every backup kept is importable with its disks as they were when it was made.
#[test]
fn a_crash_at_each_step_of_an_incremental_export_or_a_prune_loses_no_backup() {
    let mut a = host();
    let disks = json!([{"name": "nsm", "size_gib": 1, "format": "raw"}, {"name": "logs", "size_gib": 1}]);
    let mut spec = disk_spec(&a, "s", disks, "");
    spec["state"] = json!("stopped");
    a.call("vm.create", json!({ "spec": spec }));
    let logs = a.state().join("disks/s/logs.qcow2");
    let export = json!({ "name": "s", "incremental": true });
    let mut made: Vec<(String, String)> = Vec::new();
    let newest = |a: &TestHost| backup_dirs(a).into_iter().filter(|d| !d.starts_with('.')).max().unwrap();

    write_into(&logs, 0x11, "0", "1M");
    let v = a.call("vm.export", export.clone());
    made.push((v["backup"].as_str().unwrap().to_string(), guest_sha(&logs, "qcow2")));

    write_into(&logs, 0x22, "4M", "1M");
    a.crash_during("export:copied", "vm.export", export.clone());
    assert_eq!(backup_dirs(&a), [made[0].0.clone()], "the partial directory is gone");
    let v = a.call("vm.export", export.clone());
    assert_eq!(changes(&v)[1].1, "incremental", "the parent's bitmap survived the crash: {v}");
    made.push((v["backup"].as_str().unwrap().to_string(), guest_sha(&logs, "qcow2")));

    write_into(&logs, 0x33, "8M", "1M");
    a.crash_during("export:sealed", "vm.export", export.clone());
    let sealed = newest(&a);
    assert_eq!(backup_dirs(&a).len(), 3, "the sealed backup stays: {:?}", backup_dirs(&a));
    made.push((sealed, guest_sha(&logs, "qcow2")));
    write_into(&logs, 0x44, "0", "64k");
    let v = a.call("vm.export", export.clone());
    assert_eq!((&v["manifest"]["parent"]["dir"], changes(&v)[1].1.as_str()), (&json!(made[2].0), "incremental"));
    made.push((v["backup"].as_str().unwrap().to_string(), guest_sha(&logs, "qcow2")));
    run_ok(Command::new("qemu-img").args(["check", "-q"]).arg(&logs));

    let prune = json!({ "name": "s", "keep": 2 });
    for step in ["prune:merged", "prune:replaced"] {
        crash_prune(&mut a, step, &prune);
        let left = backup_dirs(&a);
        assert_eq!(
            left,
            made.iter().map(|m| m.0.clone()).collect::<Vec<_>>(),
            "{step}: every backup stays, no leftover"
        );
    }
    crash_prune(&mut a, "prune:deleting", &prune);
    let v = a.call("vm.backups_prune", prune);
    assert_eq!(v["kept"], json!([made[2].0, made[3].0]), "{v}");
    assert_eq!(backup_dirs(&a), [made[2].0.clone(), made[3].0.clone()]);
    // A crash while a disk is being restored from its chain leaves nothing behind.
    a.crash_during("import:restored", "vm.import", json!({ "backup": made[3].0, "name": "r9", "state": "stopped" }));
    assert!(entries(&a.state().join("kept-disks")).is_empty(), "{:?}", entries(&a.state().join("kept-disks")));
    assert_eq!(entries(&a.state().join("import")), Vec::<String>::new(), "the temp file went at the restart");
    // Each kept backup restores its disk as it was when made.
    for (i, (backup, sha)) in made[2..].iter().enumerate() {
        let name = format!("r{i}");
        a.call("vm.import", json!({ "backup": backup, "name": name, "state": "stopped" }));
        let restored = a.state().join(format!("disks/{name}/logs.qcow2"));
        assert_eq!(&guest_sha(&restored, "qcow2"), sha, "{backup}");
    }
    a.stop_daemon();
}

/// kill -9 of vmhostd during incremental exports of a *running* VM (its QEMU holds the bitmaps
/// and runs on): after the restart the same QEMU runs, no partial backup is left, the next
/// export is still incremental over the last sealed backup (also after a restart of the VM,
/// whose QEMU stores the bitmaps at its clean power-off), and the last backup imports with the
/// disk the guest wrote.
#[test]
fn a_crash_during_a_running_vms_incremental_export_loses_no_backup_and_no_tracking() {
    let mut a = host();
    let disks = json!([{"name": "logs", "size_gib": 1}]);
    let spec = |a: &TestHost, mark: &str| disk_spec(a, "lv", disks.clone(), &format!("vmhost.writemark=logs:{mark}"));
    a.call("vm.create", json!({ "spec": spec(&a, "one") }));
    assert_eq!(marks(&a, "lv", 1), ["logs=one"]);
    let export = json!({ "name": "lv", "incremental": true });
    let full = a.call("vm.export", export.clone());
    assert_eq!(full["manifest"]["kind"], "full", "{full}");
    let qemu = a.qemu_pids();
    assert_eq!(qemu.len(), 1, "{qemu:?}");

    a.crash_during("export:copied", "vm.export", export.clone());
    assert_eq!(a.qemu_pids(), qemu, "the guest ran on through the daemon's death");
    assert_eq!(a.call("vm.get", json!({"name": "lv"}))["status"], "running");
    assert_eq!(backup_dirs(&a), [full["backup"].as_str().unwrap().to_string()], "the partial directory is gone");
    let inc = a.call("vm.export", export.clone());
    assert_eq!((&inc["manifest"]["kind"], &inc["manifest"]["parent"]["dir"]), (&json!("incremental"), &full["backup"]));

    a.crash_during("export:sealed", "vm.export", export.clone());
    assert_eq!(a.qemu_pids(), qemu);
    let sealed = backup_dirs(&a).into_iter().filter(|d| !d.starts_with('.')).max().unwrap();
    assert_eq!(backup_dirs(&a).len(), 3, "the sealed backup stays: {:?}", backup_dirs(&a));

    // A clean restart of the VM with a new marker: still incremental, over the sealed one.
    a.call("vm.apply", json!({ "spec": spec(&a, "two"), "timeout_s": 60 }));
    assert_eq!(marks(&a, "lv", 2), ["logs=two"]);
    let last = a.call("vm.export", export);
    let m = &last["manifest"];
    assert_eq!((&m["kind"], &m["parent"]["dir"]), (&json!("incremental"), &json!(sealed)), "{last}");

    a.call("vm.stop", json!({ "name": "lv" }));
    let logs = a.state().join("disks/lv/logs.qcow2");
    run_ok(Command::new("qemu-img").args(["check", "-q"]).arg(&logs));
    let source = guest_sha(&logs, "qcow2");
    a.call("vm.import", json!({ "backup": last["backup"], "name": "lv2", "state": "stopped" }));
    assert_eq!(guest_sha(&a.state().join("disks/lv2/logs.qcow2"), "qcow2"), source);
    a.stop_daemon();
}

/// A revert puts the disks back as the snapshot had them and removes the backups' bitmaps
/// (QEMU refuses to load a snapshot under them): the next incremental export is a full one and
/// says why, never an increment over a parent whose blocks the revert changed; the one after it
/// is incremental again, and both import with the disk as it was.
#[test]
fn after_a_revert_the_next_backup_is_full_and_says_why() {
    let a = host();
    let mut spec = disk_spec(&a, "rv", json!([{"name": "logs", "size_gib": 1}]), "");
    spec["state"] = json!("stopped");
    a.call("vm.create", json!({ "spec": spec }));
    let logs = a.state().join("disks/rv/logs.qcow2");
    let export = json!({ "name": "rv", "incremental": true });
    write_into(&logs, 0x11, "0", "1M");
    a.call("vm.snapshot", json!({"name": "rv", "snapshot": "s"}));
    let at_snapshot = guest_sha(&logs, "qcow2");
    let first = a.call("vm.export", export.clone());
    assert_eq!(changes(&first)[0].1, "full");
    write_into(&logs, 0x22, "4M", "1M");
    let inc = a.call("vm.export", export.clone());
    assert_eq!(changes(&inc)[0].1, "incremental", "{inc}");

    a.call("vm.revert", json!({"name": "rv", "snapshot": "s"}));
    assert_eq!(guest_sha(&logs, "qcow2"), at_snapshot);
    let after = a.call("vm.export", export.clone());
    let c = changes(&after);
    assert_eq!(c[0].1, "full", "{after}");
    assert!(c[0].2.contains("(a revert"), "the reason names the revert: {c:?}");
    assert_eq!(after["manifest"]["kind"], "full");
    write_into(&logs, 0x33, "8M", "64k");
    let next = a.call("vm.export", export);
    assert_eq!(
        (&next["manifest"]["kind"], &next["manifest"]["parent"]["dir"]),
        (&json!("incremental"), &after["backup"])
    );
    let now = guest_sha(&logs, "qcow2");
    a.call("vm.import", json!({ "backup": after["backup"], "name": "rv1", "state": "stopped" }));
    assert_eq!(guest_sha(&a.state().join("disks/rv1/logs.qcow2"), "qcow2"), at_snapshot);
    a.call("vm.import", json!({ "backup": next["backup"], "name": "rv2", "state": "stopped" }));
    assert_eq!(guest_sha(&a.state().join("disks/rv2/logs.qcow2"), "qcow2"), now);
}

/// `vm.backups_prune` holds the VM's operation, as an export does: refused (4090, nothing
/// removed) while another operation of the VM runs (here a stop its boot-sector guest ignores,
/// held for its `timeout_s`), then it runs; the prune inside `vm.export`'s `keep` still works.
#[test]
fn a_prune_is_an_operation_on_the_vm_and_refused_beside_another() {
    let host = host();
    boot_sector::write_image(&host.images().join("base.raw"), &boot_sector::serial_print("VMHOST-PRUNE-ROOT"));
    let spec = json!({"name": "p", "cpu": 1, "memory_mib": 64, "boot": {"image": "base.raw", "disk_gib": 1}});
    host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial("p", "VMHOST-PRUNE-ROOT", BOOT), "{}", host.serial("p"));
    host.call("vm.stop", json!({ "name": "p", "force": true }));
    host.call("vm.export", json!({ "name": "p" }));
    host.call("vm.export", json!({ "name": "p" }));
    let before = backup_dirs(&host);
    assert_eq!(before.len(), 2, "{before:?}");
    host.call("vm.start", json!({ "name": "p" }));
    std::thread::scope(|s| {
        // No ACPI in a boot sector: the stop waits its whole timeout, holding the VM's operation.
        let stopper = s.spawn(|| host.call("vm.stop", json!({ "name": "p", "timeout_s": 20 })));
        host.wait_status("p", "stopping", Duration::from_secs(60));
        let (code, e) = host.call_err("vm.backups_prune", json!({ "name": "p", "keep": 1 }));
        assert_eq!(code, 4090, "{e:?}");
        assert_eq!(backup_dirs(&host), before, "nothing removed");
        assert_eq!(stopper.join().unwrap()["vm"]["status"], "stopped");
    });
    let v = host.call("vm.backups_prune", json!({ "name": "p", "keep": 1 }));
    assert_eq!(v["removed"], json!([before[0]]), "{v}");
    let e = host.call("vm.export", json!({ "name": "p", "keep": 1 }));
    assert_eq!(backup_dirs(&host), [e["backup"].as_str().unwrap().to_string()], "{e}");
}

/// [`TestHost::crash_during`] of `vm.backups_prune`, saying what the daemon answered when it
/// did not die.
fn crash_prune(a: &mut TestHost, step: &str, params: &Value) {
    a.arm_crash(step);
    let answer = a.client().call::<Value>("vm.backups_prune", params.clone());
    let pid = a.daemon_pid().unwrap() as i32;
    if vmhost_tests::alive(pid) {
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(!vmhost_tests::alive(pid) || format!("{answer:?}").contains("closed"), "{step}: {answer:?}");
    a.restart_after_crash(step);
}

/// A UEFI VM's variables store is in every backup (copied by its QEMU at the disks' instant
/// while it runs, as a file while it is stopped) and back at import, before the first start:
/// the imported VM boots through OVMF from the store the backup holds.
#[test]
fn a_uefi_vms_variables_store_travels_in_its_backups() {
    let a = host();
    let mut spec = disk_spec(&a, "efi", json!([{"name": "logs", "size_gib": 1}]), "");
    spec["boot"]["firmware"] = json!("uefi");
    a.call("vm.create", json!({ "spec": spec }));
    assert!(a.wait_serial("efi", "VMHOST-GUEST-READY", BOOT), "{}", a.serial("efi"));
    let store = a.state().join("disks/efi/uefi-vars.fd");

    let live = a.call("vm.export", json!({ "name": "efi" }));
    let vars = &live["manifest"]["uefi_vars"];
    assert_eq!(vars["file"], "uefi-vars.fd", "{live}");
    let dir = a.state().join("backups").join(live["backup"].as_str().unwrap());
    assert_eq!(entries(&dir), ["SHA256SUMS", "logs.qcow2", "manifest.json", "uefi-vars.fd"]);
    run_ok(Command::new("sha256sum").args(["--check", "--quiet", "SHA256SUMS"]).current_dir(&dir));
    assert_eq!(vars["sha256"].as_str().unwrap(), vmhost_tests::sha256_file(&store), "the store as the guest left it");

    a.call("vm.stop", json!({ "name": "efi" }));
    let stopped = a.call("vm.export", json!({ "name": "efi" }));
    assert_eq!(stopped["manifest"]["uefi_vars"]["sha256"].as_str().unwrap(), vmhost_tests::sha256_file(&store));

    let b = host();
    let backup = live["backup"].as_str().unwrap();
    copy_backup(&a, &b, backup);
    let v = b.call("vm.import", json!({ "backup": backup, "name": "efi2", "state": "stopped" }));
    assert_eq!(v["vm"]["status"], "stopped", "{v}");
    let there = b.state().join("disks/efi2/uefi-vars.fd");
    assert_eq!(vmhost_tests::sha256_file(&there).as_str(), vars["sha256"].as_str().unwrap_or_default());
    // Imported running: the store is in place before the first start, which boots from it.
    let v = b.call("vm.import", json!({ "backup": backup }));
    assert_eq!(v["vm"]["status"], "running", "{v}");
    assert!(b.wait_serial("efi", "VMHOST-GUEST-READY", BOOT), "{}", b.serial("efi"));
}
