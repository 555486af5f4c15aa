//! The packaged units under a real systemd. PID 1 on these machines is not systemd, so the test
//! boots one in a container: `systemd-nspawn -b` over an overlay of this machine's root (the
//! lower layer read-only, every write going to a temp dir, so the machine itself is not
//! changed). Inside, a oneshot service runs `tests/systemd/proof.sh`: install the .debs with
//! dpkg (postinst starts `vmhostd.socket` and the service), with the service stopped a first
//! `vmhostctl` call activates it again through the socket,
//! a VM with a NIC boots with QEMU as `vmhost-qemu` inside the service's cgroup and a tap on a
//! bridge vmhostd made (the container has its own network namespace), QEMU cannot open a UDP
//! or TCP socket though the unit allows IP for curl (QMP `chardev-add`; a Unix one still
//! connects), `systemctl restart
//! vmhostd` keeps it running (KillMode=process) and the new daemon adopts it, then destroy,
//! stop, purge. The script's CHECK lines are read back from the overlay's upper layer.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Instant;
use vmhost_tests::{build_debs, guest, run_ok, workspace};

/// Every check proof.sh makes, in order.
const CHECKS: [&str; 36] = [
    "dpkg-install",
    "socket-listening",
    "postinst-started-the-service",
    "service-waits-for-a-client",
    "socket-still-listening",
    "first-call-activates",
    "service-active",
    "sandbox-in-force",
    "check-config",
    "restart",
    "create",
    "qemu-runs-as-vmhost-qemu",
    "qemu-in-the-service-cgroup",
    "guest-boots",
    "tap-on-the-bridge",
    "qemu-holds-the-tap",
    "qemu-no-udp-socket",
    "qemu-no-tcp-socket",
    "qemu-unix-socket-works",
    "restart-keeps-the-vm",
    "qemu-survived",
    "vm-adopted",
    "same-qemu",
    "guests-unit-active",
    "guests-stop-powers-off",
    "qemu-powered-off",
    "vm-stopped-desired-running",
    "guests-start",
    "restart-autostarts",
    "vm-autostarted",
    "destroy",
    "tap-removed",
    "qemu-gone",
    "service-stop",
    "purge",
    "nothing-left",
];

/// Unmounts the overlay (lazily: the container may still hold it for a moment) on drop.
struct Overlay<'a> {
    root: &'a Path,
}

impl Drop for Overlay<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.root).status();
    }
}

#[test]
fn packaged_units_run_a_vm_under_systemd() {
    assert!(
        Path::new("/usr/bin/systemd-nspawn").exists(),
        "systemd-nspawn is missing (tests/setup.sh installs systemd-container)"
    );
    let debs = build_debs();

    let dir = tempfile::Builder::new().prefix("vmhsd").tempdir_in("/tmp").unwrap();
    let (upper, work, root) = (dir.path().join("upper"), dir.path().join("work"), dir.path().join("root"));
    for d in [&upper, &work, &root] {
        fs::create_dir(d).unwrap();
    }
    let opts = format!("lowerdir=/,upperdir={},workdir={}", upper.display(), work.display());
    run_ok(Command::new("mount").args(["-t", "overlay", "overlay", "-o", &opts]).arg(&root));
    let _overlay = Overlay { root: &root };

    // Container images carry a policy-rc.d that forbids starting services from maintainer
    // scripts (exit 101); a real host has none, and the postinst's start is part of the proof.
    let policy = root.join("usr/sbin/policy-rc.d");
    if policy.exists() {
        fs::remove_file(&policy).unwrap();
    }
    // What the container needs: the packages, the test guest, the script and its units.
    let proof = root.join("proof");
    fs::create_dir_all(&proof).unwrap();
    fs::set_permissions(&proof, fs::Permissions::from_mode(0o755)).unwrap();
    for deb in &debs {
        let name = Path::new(deb).file_name().unwrap();
        fs::copy(deb, proof.join(name)).unwrap();
    }
    let g = guest();
    fs::copy(&g.kernel, proof.join("vmlinuz")).unwrap();
    fs::copy(&g.initrd, proof.join("initrd")).unwrap();
    for f in ["vmlinuz", "initrd"] {
        // Readable by anyone (vmhostd hands QEMU sealed copies); /proof is paths.boot (proof.sh).
        fs::set_permissions(proof.join(f), fs::Permissions::from_mode(0o644)).unwrap();
    }
    fs::copy(workspace().join("tests/systemd/proof.sh"), proof.join("proof.sh")).unwrap();
    let units = root.join("etc/systemd/system");
    fs::write(
        units.join("vmhost-proof.service"),
        "[Unit]\nDescription=vmhost packaging proof\nAfter=basic.target\n\
         [Service]\nType=oneshot\nTimeoutStartSec=infinity\nExecStart=/bin/sh /proof/proof.sh\n",
    )
    .unwrap();
    fs::write(
        units.join("vmhost-proof.target"),
        "[Unit]\nDescription=vmhost packaging proof\nRequires=basic.target vmhost-proof.service\n\
         After=basic.target vmhost-proof.service\n",
    )
    .unwrap();

    let started = Instant::now();
    let machine = format!("vmhsd{}", std::process::id());
    let out = Command::new("timeout")
        .args(["900", "systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--private-network"])
        .arg(format!("--machine={machine}"))
        .arg("-D")
        .arg(&root)
        .args(["-b", "--", "systemd.unit=vmhost-proof.target"])
        .output()
        .expect("run systemd-nspawn");
    let console = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let result = fs::read_to_string(upper.join("proof/result")).unwrap_or_default();
    eprintln!("container ran for {:.1?}:\n{result}", started.elapsed());
    let dpkg_log = fs::read_to_string(upper.join("var/log/dpkg.log")).unwrap_or_default();
    let failed = || format!("----- result -----\n{result}\n----- console (tail) -----\n{}", tail(&console, 60));
    // timeout(1) answers 124 when its bound (a failure bound) ended the container.
    assert_ne!(out.status.code(), Some(124), "the container was still running after 900 s\n{}", failed());
    assert!(result.contains("DONE"), "the proof did not finish\n{}\n{dpkg_log}", failed());
    for name in CHECKS {
        assert!(result.lines().any(|l| l == format!("CHECK PASS {name}")), "no PASS for {name}\n{}", failed());
    }
    assert!(!result.contains("CHECK FAIL"), "{}", failed());
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
