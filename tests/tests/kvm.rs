//! QEMU as the unprivileged `qemu.user` can use `/dev/kvm` when the host lets that user's group
//! have it, and `host.check` says when it cannot, testing as that user with the groups QEMU
//! gets (docs/sandbox.md).
//!
//! This machine's `/dev/kvm` is `0600 root:root` without udev; the test makes it
//! `0660 root:kvm` (as udev does on most hosts) for its duration and restores it after. Guests
//! hang under this machine's nested KVM and `-cpu host` aborts (../shared/ENVIRONMENT.md), so the
//! VM uses `cpu_model = "qemu64"` and the test checks QEMU itself: running, answering QMP, KVM
//! enabled, holding exactly the kvm group.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;
use vmhost_tests::{HostOptions, TestHost, QEMU_USER};

const KVM: &str = "/dev/kvm";

/// `/dev/kvm`'s owner, group and mode when the test started; put back when dropped.
struct SavedNode {
    uid: u32,
    gid: u32,
    mode: u32,
}

impl SavedNode {
    fn save() -> SavedNode {
        let m = std::fs::metadata(KVM).expect("this machine has /dev/kvm");
        SavedNode { uid: m.uid(), gid: m.gid(), mode: m.mode() & 0o7777 }
    }

    fn set(uid: u32, gid: u32, mode: u32) {
        std::os::unix::fs::chown(KVM, Some(uid), Some(gid)).expect("chown /dev/kvm");
        std::fs::set_permissions(KVM, std::fs::Permissions::from_mode(mode)).expect("chmod /dev/kvm");
    }
}

impl Drop for SavedNode {
    fn drop(&mut self) {
        SavedNode::set(self.uid, self.gid, self.mode);
    }
}

fn kvm_gid() -> u32 {
    let group = nix::unistd::Group::from_name("kvm").ok().flatten().expect("group kvm (tests/setup.sh makes it)");
    assert!(
        group.mem.iter().any(|m| m == QEMU_USER),
        "{QEMU_USER} is a member of kvm (tests/setup.sh, like the package for vmhost-qemu)"
    );
    group.gid.as_raw()
}

fn accelerator(host: &TestHost) -> Value {
    let check = host.call("host.check", json!({}));
    let items = check["items"].as_array().cloned().unwrap_or_default();
    items.into_iter().find(|i| i["name"] == "accelerator").expect("an accelerator item")
}

/// Sends QMP commands on the VM's socket and returns the answer to the last.
fn qmp(sock: &Path, command: &str) -> Value {
    let s = UnixStream::connect(sock).expect("connect QMP");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut lines = BufReader::new(s).lines();
    let mut next = || -> Value { serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap() };
    assert!(next().get("QMP").is_some(), "QMP greeting");
    writeln!(w, r#"{{"execute": "qmp_capabilities"}}"#).unwrap();
    assert!(next().get("return").is_some());
    writeln!(w, r#"{{"execute": "{command}"}}"#).unwrap();
    loop {
        let v = next();
        if v.get("event").is_none() {
            return v;
        }
    }
}

fn status_field(pid: i32, name: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string()).unwrap_or_default()
}

#[test]
fn qemu_uses_kvm_through_the_kvm_group_and_host_check_tests_as_qemus_user() {
    let gid = kvm_gid();
    let _restore = SavedNode::save();
    SavedNode::set(0, gid, 0o660);
    let host =
        TestHost::start(HostOptions { accel: "kvm".into(), cpu_model: "qemu64".into(), ..HostOptions::default() });

    let item = accelerator(&host);
    assert_eq!(item["status"], "ok", "{item}");
    assert!(item["detail"].as_str().unwrap_or("").contains(QEMU_USER), "{item}");

    let vm = host.call("vm.create", json!({ "spec": host.kernel_spec("onkvm") }));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    let qemu = *host.qemu_pids().first().expect("a QEMU");
    assert_eq!(status_field(qemu, "Groups:"), gid.to_string(), "QEMU keeps the kvm group and only it");
    let sock = host.run().join("onkvm/qmp");
    assert_eq!(qmp(&sock, "query-kvm")["return"], json!({"enabled": true, "present": true}));
    assert_eq!(qmp(&sock, "query-status")["return"]["status"], "running");
    host.call("vm.destroy", json!({"name": "onkvm"}));

    // Root's alone: the daemon (root) could open it, QEMU's user cannot, and the check says so.
    SavedNode::set(0, 0, 0o600);
    let item = accelerator(&host);
    assert_eq!(item["status"], "denied", "{item}");
    let detail = item["detail"].as_str().unwrap_or("");
    assert!(detail.contains(QEMU_USER) && detail.contains("adduser"), "names the user and the fix: {detail}");
    assert_eq!(host.call("host.check", json!({}))["ok"], false);
    // And a create fails cleanly rather than leaving anything behind.
    let (code, e) = host.call_err("vm.create", json!({ "spec": host.kernel_spec("denied") }));
    assert_eq!(code, 4001, "{e:?}");
    assert!(e.message.contains("KVM"), "QEMU's reason: {}", e.message);
    assert!(host.qemu_pids().is_empty());
}
