//! A direct-kernel VM boots from a kernel and initrd only root can read (mode 0600 files in a
//! root-owned 0700 directory), while QEMU runs as the unprivileged test user: QEMU gets sealed
//! in-memory copies, never a path (docs/sandbox.md). A file that cannot be used is a 2001
//! naming the field before anything starts.

use serde_json::{json, Value};
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use vmhost_tests::{guest, HostOptions, TestHost, GUEST_READY};

/// Mode bits and owner of `p`.
fn mode_owner(p: &Path) -> (u32, u32) {
    let m = fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.mode() & 0o7777, m.uid())
}

/// The descriptors of `pid` that are vmhost's boot-file copies: (fd, link target).
fn boot_copies(pid: i32) -> Vec<(PathBuf, String)> {
    let mut found = Vec::new();
    for e in fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let target = fs::read_link(e.path()).unwrap_or_default().to_string_lossy().into_owned();
        if target.starts_with("/memfd:vmhost:boot:") {
            found.push((e.path(), target));
        }
    }
    found.sort();
    found
}

#[test]
fn private_kernel_and_initrd_boot_as_sealed_copies() {
    let g = guest();
    let before = [mode_owner(&g.kernel), mode_owner(&g.initrd)];
    // Root's alone: a 0700 directory with 0600 copies of the test guest's files.
    let private = tempfile::Builder::new().prefix("vmhboot").tempdir_in("/tmp").unwrap();
    fs::set_permissions(private.path(), fs::Permissions::from_mode(0o700)).unwrap();
    let (kernel, initrd) = (private.path().join("vmlinuz"), private.path().join("initrd.gz"));
    fs::copy(&g.kernel, &kernel).unwrap();
    fs::copy(&g.initrd, &initrd).unwrap();
    for f in [&kernel, &initrd] {
        fs::set_permissions(f, fs::Permissions::from_mode(0o600)).unwrap();
    }
    let kernel_bytes = fs::read(&kernel).unwrap();
    let initrd_bytes = fs::read(&initrd).unwrap();

    let host = TestHost::start(HostOptions { boot_dirs: vec![private.path().to_path_buf()], ..HostOptions::default() });
    let spec = json!({"name": "private", "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": kernel, "initrd": initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}});
    let vm = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    assert!(host.wait_serial("private", GUEST_READY, Duration::from_secs(90)), "guest did not reach userspace");

    let qemu = host.call("vm.get", json!({"name": "private"}))["pid"].as_i64().expect("a QEMU") as i32;
    let uid = fs::metadata(format!("/proc/{qemu}")).unwrap().uid();
    assert_ne!(uid, 0, "QEMU runs as the unprivileged test user");
    let cmdline = fs::read(format!("/proc/{qemu}/cmdline")).unwrap();
    let private_dir = private.path().to_string_lossy().into_owned();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(&private_dir),
        "no boot file path reaches QEMU: {}",
        String::from_utf8_lossy(&cmdline).replace('\0', " ")
    );

    // A second VM booting the same, unchanged files shares the same sealed copies.
    let twin = json!({"name": "twin", "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": kernel, "initrd": initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}});
    host.call("vm.create", json!({ "spec": twin }));
    let twin_pid = host.call("vm.get", json!({"name": "twin"}))["pid"].as_i64().expect("a QEMU") as i32;
    let inodes = |pid: i32| -> Vec<u64> {
        let mut v: Vec<u64> = boot_copies(pid).iter().map(|(fd, _)| fs::metadata(fd).unwrap().ino()).collect();
        v.sort_unstable();
        v
    };
    assert_eq!(inodes(twin_pid), inodes(qemu), "one copy of each file, shared");

    // A file changed on disk while the VM runs does not change what QEMU holds.
    fs::write(&kernel, b"not a kernel any more").unwrap();
    let copies = boot_copies(qemu);
    assert_eq!(copies.len(), 2, "QEMU holds a copy of the kernel and of the initrd: {copies:?}");
    let mut contents = Vec::new();
    for (fd, target) in &copies {
        let file = fs::File::open(fd).unwrap();
        // SAFETY: fcntl(F_GET_SEALS) on a descriptor this test owns.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        for seal in [libc::F_SEAL_WRITE, libc::F_SEAL_GROW, libc::F_SEAL_SHRINK, libc::F_SEAL_SEAL] {
            assert_ne!(seals & seal, 0, "{target}: seal {seal:#x} missing ({seals:#x})");
        }
        if let Ok(mut w) = fs::OpenOptions::new().write(true).open(fd) {
            assert!(std::io::Write::write_all(&mut w, b"x").is_err(), "{target} cannot be written, even by root");
        }
        contents.push(fs::read(fd).unwrap());
    }
    assert!(contents.contains(&kernel_bytes), "one copy is the kernel as it was at launch");
    assert!(contents.contains(&initrd_bytes), "one copy is the initrd");

    // Nothing was made readable to get there.
    assert_eq!(mode_owner(private.path()), (0o700, 0));
    assert_eq!(mode_owner(&kernel), (0o600, 0));
    assert_eq!(mode_owner(&initrd), (0o600, 0));
    assert_eq!([mode_owner(&g.kernel), mode_owner(&g.initrd)], before, "the test guest's files are untouched");
    // The next launch sees the changed file: the garbage kernel now makes QEMU fail.
    let (code, e) = host.call_err("vm.restart", json!({"name": "twin", "timeout_s": 1}));
    assert_eq!(code, 4001, "{e:?}");
    host.call("vm.destroy", json!({"name": "private"}));
}

/// `vm.create` with `boot` set to these kernel/initrd paths must fail with 2001 naming
/// `field`, leaving no record and no QEMU.
fn refused(host: &TestHost, name: &str, boot: Value, field: &str, says: &str) {
    let spec = json!({"name": name, "cpu": 1, "memory_mib": 128, "boot": boot});
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!(code, 2001, "{e:?}");
    assert_eq!(e.field.as_deref(), Some(field), "{e:?}");
    assert!(e.message.contains(says), "{field}: {:?} should say {says:?}", e.message);
    let (code, _) = host.call_err("vm.get", json!({"name": name}));
    assert_eq!(code, 4040, "no record of {name}");
    assert!(host.qemu_pids().is_empty(), "nothing was started for {name}");
}

#[test]
fn unusable_boot_files_are_2001_before_anything_starts() {
    let g = guest();
    let d = tempfile::tempdir().unwrap();
    let host = TestHost::start(HostOptions { boot_dirs: vec![d.path().to_path_buf()], ..HostOptions::default() });
    let fifo = d.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let absent = d.path().join("absent");
    refused(&host, "nokernel", json!({"kernel": absent}), "spec.boot.kernel", "does not exist");
    fs::create_dir(d.path().join("sub")).unwrap();
    refused(&host, "dirkernel", json!({"kernel": d.path().join("sub")}), "spec.boot.kernel", "is a directory");
    // A FIFO is refused at once, never read (a read would wait for a writer).
    refused(&host, "fifoinitrd", json!({"kernel": g.kernel, "initrd": fifo}), "spec.boot.initrd", "is a FIFO");
    let zero = d.path().join("zero");
    let dev = nix::sys::stat::makedev(1, 5);
    nix::sys::stat::mknod(&zero, nix::sys::stat::SFlag::S_IFCHR, nix::sys::stat::Mode::S_IRUSR, dev).unwrap();
    refused(&host, "devkernel", json!({"kernel": zero}), "spec.boot.kernel", "is a device");
    assert!(!fs::read_dir(host.state().join("disks")).map(|mut r| r.next().is_some()).unwrap_or(false));
}

/// `boot.kernel` and `boot.initrd` name files in the boot directories (`paths.boot`) only: a
/// path elsewhere is a 2001 before any file is looked at (vmhostd is no existence oracle), in a
/// dry run too, and a symlink in a boot directory that leads out of it is refused when opened.
#[test]
fn boot_files_outside_the_boot_directories_are_refused() {
    let g = guest();
    let host = TestHost::start(HostOptions::default());
    // Root can read both, and the first is even a real kernel: the directory decides.
    let outside = tempfile::Builder::new().prefix("vmhout").tempdir_in("/tmp").unwrap();
    let kernel = outside.path().join("vmlinuz");
    fs::copy(&g.kernel, &kernel).unwrap();
    let says = "not in a boot directory";
    refused(&host, "outk", json!({"kernel": kernel}), "spec.boot.kernel", says);
    refused(&host, "shadow", json!({"kernel": "/etc/shadow"}), "spec.boot.kernel", says);
    refused(&host, "nofile", json!({"kernel": "/etc/no-such-file"}), "spec.boot.kernel", says);
    refused(&host, "outi", json!({"kernel": g.kernel, "initrd": "/etc/shadow"}), "spec.boot.initrd", says);
    // The same answer for a file that exists and one that does not: no oracle.
    let (_, a) = host.call_err(
        "vm.create",
        json!({"spec": {"name": "x", "cpu": 1, "memory_mib": 128,
        "boot": {"kernel": "/etc/passwd"}}}),
    );
    let (_, b) = host.call_err(
        "vm.create",
        json!({"spec": {"name": "x", "cpu": 1, "memory_mib": 128,
        "boot": {"kernel": "/etc/passwd-no-such"}}}),
    );
    assert_eq!(a.message, b.message.replace("passwd-no-such", "passwd"));

    // A dry run plans the same refusal.
    let spec = json!({"name": "dry", "cpu": 1, "memory_mib": 128, "boot": {"kernel": kernel}});
    let report = host.call("host.reconcile", json!({"vms": [spec], "dry_run": true}));
    let text = report.to_string();
    assert!(text.contains("2001") && text.contains("spec.boot.kernel"), "{report}");
    assert_eq!(host.call_err("vm.get", json!({"name": "dry"})).0, 4040);

    // A symlink in the images directory (a boot directory) pointing out of it.
    let link = host.images().join("escape");
    std::os::unix::fs::symlink(&kernel, &link).unwrap();
    refused(&host, "escape", json!({"kernel": link}), "spec.boot.kernel", "leads out of the boot directory");
    // One that stays inside boots.
    fs::copy(&g.kernel, host.images().join("vmlinuz-1")).unwrap();
    std::os::unix::fs::symlink("vmlinuz-1", host.images().join("vmlinuz")).unwrap();
    let spec = json!({"name": "inside", "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": host.images().join("vmlinuz"), "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}});
    assert_eq!(host.call("vm.create", json!({ "spec": spec }))["vm"]["status"], "running");
    assert!(host.wait_serial("inside", GUEST_READY, Duration::from_secs(90)), "guest did not reach userspace");
    host.call("vm.destroy", json!({"name": "inside"}));
    assert!(!fs::read_dir(host.state().join("disks")).map(|mut r| r.next().is_some()).unwrap_or(false));
}
