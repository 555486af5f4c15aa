//! Binary integrity (docs/images.md, `qemu.sha256`): vmhostd launches only the QEMU binary whose
//! sha256 the config pins. The test runs a copy of the host's QEMU as `qemu.binary`, pinned to
//! its sha256: a VM boots; another binary (the copy with a byte appended) is then renamed into
//! its place, and the next create is refused with 4002 naming `qemu.sha256` before anything is made, while
//! `host.check` reports the mismatch. A pin that never matched refuses the first create too.

use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use vmhost_tests::{HostOptions, TestHost};

const QEMU: &str = "/usr/bin/qemu-system-x86_64";

fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().expect("sha256sum");
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or_default().to_string()
}

/// A directory QEMU's user can enter (the default temp dir mode is 0700).
fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("vmh-bin").tempdir_in("/tmp").expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

fn host_with(binary: &Path, pin: &str) -> TestHost {
    TestHost::start(HostOptions {
        qemu_extra: format!("binary = \"{}\"\nsha256 = \"{pin}\"\n", binary.display()),
        ..HostOptions::default()
    })
}

fn check_item(host: &TestHost) -> Value {
    let report = host.call("host.check", json!({}));
    let items = report["items"].as_array().cloned().unwrap_or_default();
    items.into_iter().find(|i| i["name"] == "qemu.sha256").unwrap_or(Value::Null)
}

/// A copy of the host's QEMU in `DIR/bin/`, 0755. QEMU finds its modules and firmware
/// relative to its executable (../lib, ../share): the copy gets the host's through links.
fn qemu_copy() -> (tempfile::TempDir, PathBuf) {
    let dir = open_dir();
    std::fs::create_dir(dir.path().join("bin")).expect("bin dir");
    std::os::unix::fs::symlink("/usr/lib", dir.path().join("lib")).expect("lib link");
    std::os::unix::fs::symlink("/usr/share", dir.path().join("share")).expect("share link");
    let copy = dir.path().join("bin/qemu-system-x86_64");
    std::fs::copy(QEMU, &copy).expect("copy QEMU");
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    (dir, copy)
}

#[test]
fn only_the_pinned_binary_is_launched_and_a_changed_one_is_refused() {
    let (dir, copy) = qemu_copy();
    let pin = sha256(&copy);
    let host = host_with(&copy, &pin);

    assert_eq!(check_item(&host)["status"], "ok", "{}", check_item(&host));
    host.call("vm.create", json!({"spec": host.kernel_spec("pinned")}));
    assert_eq!(host.call("vm.get", json!({"name": "pinned"}))["status"], "running");
    assert!(host.wait_serial("pinned", "VMHOST-GUEST-READY", Duration::from_secs(120)), "{}", host.serial("pinned"));

    // Another binary renamed into its place, as a package upgrade does (a running executable
    // cannot be written): hashed again, refused before anything is made.
    let changed = dir.path().join("bin/qemu.new");
    std::fs::copy(&copy, &changed).expect("copy");
    let mut file = std::fs::OpenOptions::new().append(true).open(&changed).expect("open the new binary");
    std::io::Write::write_all(&mut file, b"\0").expect("append");
    drop(file);
    std::fs::rename(&changed, &copy).expect("rename into place");
    let found = sha256(&copy);
    let (code, err) = host.call_err("vm.create", json!({"spec": host.kernel_spec("refused")}));
    assert_eq!(code, 4002, "{err:?}");
    assert_eq!(err.field.as_deref(), Some("qemu.sha256"));
    assert_eq!(err.details["expected"], pin.as_str());
    assert_eq!(err.details["found"], found.as_str());
    assert_eq!(err.details["path"], copy.display().to_string());
    assert_eq!(host.call_err("vm.get", json!({"name": "refused"})).0, 4040, "a record was made");
    assert!(!host.state().join("logs").join("refused.serial.log").exists());
    let item = check_item(&host);
    assert_eq!(item["status"], "error", "{item}");
    assert!(item["detail"].as_str().unwrap_or("").contains(&found), "{item}");
    // The running VM stops as usual; starting it again is refused as well.
    host.call("vm.stop", json!({"name": "pinned"}));
    assert_eq!(host.call_err("vm.start", json!({"name": "pinned"})).0, 4002);
    assert_eq!(host.call("vm.get", json!({"name": "pinned"}))["status"], "stopped");
}

#[test]
fn a_pin_that_never_matched_refuses_the_first_create() {
    let wrong = "0".repeat(64);
    let host = host_with(Path::new(QEMU), &wrong);
    let (code, err) = host.call_err("vm.create", json!({"spec": host.kernel_spec("never")}));
    assert_eq!(code, 4002, "{err:?}");
    assert_eq!(err.details["found"], sha256(Path::new(QEMU)).as_str());
    assert_eq!(host.call("vm.list", json!({})), json!([]));
    assert!(host.qemu_pids().is_empty(), "a QEMU runs");
    assert_eq!(check_item(&host)["status"], "error");
}

/// Runs of `qemu.binary` that `wrapper` (a script used as the binary) recorded.
fn runs(record: &Path) -> usize {
    std::fs::read_to_string(record).unwrap_or_default().lines().count()
}

/// The pin holds for QEMU without a guest too (docs/images.md, "Binary integrity"): with a
/// binary that is not the pinned one, `image.list` of a file it must inspect, `vm.snapshot` and
/// `vm.export` of a stopped image VM (whose base QEMU reads) are 4002 and QEMU never runs. The
/// binary swapped in is a script that records each run and then execs the host's QEMU; pinned to
/// its own sha256 after a restart it runs (the record proves it would have shown a run).
#[test]
fn offline_qemu_runs_are_refused_with_a_changed_binary_and_none_runs() {
    let (dir, copy) = qemu_copy();
    let pin = sha256(&copy);
    let mut host = host_with(&copy, &pin);

    // An image VM (QEMU reads its base for a snapshot or export of it), stopped.
    let base = host.images().join("base.qcow2");
    let made = Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(&base).arg("64M").status();
    assert!(made.expect("qemu-img").success());
    let spec = json!({"name": "img", "cpu": 1, "memory_mib": 128, "boot": {"image": "base.qcow2", "disk_gib": 1}});
    assert_eq!(host.call("vm.create", json!({ "spec": spec }))["vm"]["status"], "running");
    host.call("vm.stop", json!({"name": "img", "timeout_s": 1}));
    assert_eq!(host.call("vm.get", json!({"name": "img"}))["status"], "stopped");
    let listed = host.call("image.list", json!({}));
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");

    // The binary becomes a script that records its runs (in the run dir, where QEMU's user may
    // write under the spawner's Landlock rules) and runs the host's QEMU.
    let record = host.run().join("qemu-runs");
    std::fs::write(&record, "").expect("record");
    std::fs::set_permissions(&record, std::fs::Permissions::from_mode(0o666)).expect("chmod record");
    let script = format!("#!/bin/sh\necho \"$*\" >>{}\nexec {QEMU} \"$@\"\n", record.display());
    let new = dir.path().join("bin/qemu.new");
    std::fs::write(&new, script).expect("write the script");
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&new, &copy).expect("rename into place");
    let found = sha256(&copy);

    // A file the daemon has no record of: image.list must have QEMU read it.
    std::fs::write(host.images().join("dropped.raw"), vec![0u8; 1 << 20]).expect("drop an image");
    let refused = |method: &str, params: Value| {
        let (code, err) = host.call_err(method, params);
        assert_eq!(code, 4002, "{method}: {err:?}");
        assert_eq!(err.field.as_deref(), Some("qemu.sha256"), "{method}");
        assert_eq!(err.details["found"], found.as_str(), "{method}");
    };
    refused("image.list", json!({}));
    refused("vm.snapshot", json!({"name": "img", "snapshot": "s1"}));
    refused("vm.export", json!({"name": "img"}));
    assert_eq!(host.call("vm.snapshots", json!({"name": "img"})), json!([]), "a snapshot was made");
    let backups = std::fs::read_dir(host.state().join("backups")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(backups, 0, "an export was left");
    // host.check does not run it for its version either.
    let report = host.call("host.check", json!({}));
    let qemu = report["items"].as_array().and_then(|i| i.iter().find(|i| i["name"] == "qemu").cloned());
    let qemu = qemu.unwrap_or(Value::Null);
    assert_eq!(qemu["status"], "error", "{qemu}");
    assert!(qemu["detail"].as_str().unwrap_or("").contains("not run"), "{qemu}");
    assert_eq!(runs(&record), 0, "QEMU ran: {}", std::fs::read_to_string(&record).unwrap_or_default());

    // The control: pinned to the script's own sha256, the same image.list runs it.
    let config = std::fs::read_to_string(&host.config).expect("config");
    std::fs::write(&host.config, config.replace(&pin, &found)).expect("new pin");
    host.stop_daemon();
    host.spawn_daemon();
    let listed = host.call("image.list", json!({}));
    let dropped = listed.as_array().and_then(|l| l.iter().find(|i| i["name"] == "dropped.raw").cloned());
    assert_eq!(dropped.unwrap_or(Value::Null)["format"], "raw", "{listed}");
    assert!(runs(&record) > 0, "the script did not record its run: the test would prove nothing");
}
