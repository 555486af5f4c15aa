//! `boot.firmware: uefi` (docs/images.md#uefi): QEMU runs OVMF from the host's `[firmware]`
//! files, handed over as descriptors like every other file, with a variables store of the VM's
//! own in its disk directory (0600, from the first start to the destroy).
//!
//! A direct-kernel VM boots through OVMF (the kernel's EFI stub prints on OVMF's console, and
//! the guest finds `/sys/firmware/efi`) while a default VM beside it boots with SeaBIOS; an
//! OS-less image reaches OVMF's boot manager (`BdsDxe:` lines) and the UEFI Shell. Firmware
//! files that are gone refuse a start with 2001 on `spec.boot.firmware` and nothing made, and a
//! file renamed into their place (as a package upgrade does) is used without a daemon restart.
//! Under TCG, OVMF adds about ten seconds to a boot, hence the generous timeouts.

use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vmhost_tests::{argv_of, plain_log, value_after, HostOptions, TestHost, GUEST_READY};

/// Debian's OVMF, the `[firmware]` defaults (installed by tests/setup.sh).
const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";

/// How long OVMF plus a guest may take under TCG on a busy 2-core machine.
const BOOT: Duration = Duration::from_secs(120);

/// The serial log of `name` without ANSI sequences (OVMF's console clears and positions the
/// screen) and carriage returns.
fn console(host: &TestHost, name: &str) -> String {
    plain_log(&host.serial(name)).replace('\r', "")
}

/// QEMU's pid of `name`.
fn pid_of(host: &TestHost, name: &str) -> i64 {
    host.call("vm.get", json!({ "name": name }))["pid"].as_i64().expect("a running QEMU")
}

/// Where the descriptors of process `pid` lead.
fn fd_targets(pid: i64) -> Vec<PathBuf> {
    fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten().filter_map(|e| fs::read_link(e.path()).ok()).collect()
}

/// The `host.check` item `uefi_firmware`.
fn uefi_item(host: &TestHost) -> Value {
    let report = host.call("host.check", json!({}));
    report["items"].as_array().unwrap().iter().find(|i| i["name"] == "uefi_firmware").cloned().expect("the item")
}

/// Checks that QEMU `pid` runs OVMF from `code` and the VM's own store `vars` as flash
/// devices, holding both as descriptors: neither path is an argument QEMU opens (the code's is
/// only an fd set's description).
fn assert_uefi_argv(pid: i64, code: &Path, vars: &Path) {
    let argv = argv_of(pid);
    assert!(value_after(&argv, "-machine").ends_with(",pflash0=uefi-code,pflash1=uefi-vars"), "{argv:?}");
    for needle in [code.to_string_lossy(), vars.to_string_lossy(), "OVMF".into()] {
        for a in argv.iter().filter(|a| a.contains(needle.as_ref())) {
            assert!(a.starts_with("fd=") && a.contains(",opaque="), "{needle} outside an fd set's description: {a}");
        }
    }
    let blockdevs: Vec<&String> = argv.windows(2).filter(|w| w[0] == "-blockdev").map(|w| &w[1]).collect();
    assert_eq!(blockdevs.len(), 4, "{argv:?}");
    assert!(blockdevs.iter().all(|b| !b.contains("\"filename\"") || b.contains("\"/dev/fdset/")), "{blockdevs:?}");
    let held = fd_targets(pid);
    assert!(held.iter().any(|t| t == code), "QEMU holds the firmware code: {held:?}");
    assert!(held.iter().any(|t| t == vars), "QEMU holds the VM's variables store: {held:?}");
}

/// Every file under the host's state directory but the logs (what a refused start must not
/// change).
fn state_files(host: &TestHost) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&host.state(), &mut out);
    out.retain(|p| !p.starts_with(host.state().join("logs")));
    out.sort();
    out
}

/// `vars` is a root-owned 0600 file of the template's size in a 0700 directory.
fn assert_private_store(vars: &Path, template: &Path) {
    let m = fs::metadata(vars).unwrap_or_else(|e| panic!("{}: {e}", vars.display()));
    assert_eq!((m.mode() & 0o7777, m.uid()), (0o600, 0), "{}", vars.display());
    assert_eq!(m.len(), fs::metadata(template).unwrap().len(), "a whole copy of the template");
    let dir = fs::metadata(vars.parent().unwrap()).unwrap();
    assert_eq!(dir.mode() & 0o7777, 0o700);
}

#[test]
fn a_kernel_boots_through_ovmf_beside_a_bios_vm_with_a_store_of_its_own() {
    let host = TestHost::start(HostOptions::default());
    let vars = host.state().join("disks/efi/uefi-vars.fd");
    // A store left by an earlier VM of the name (as after a lost destroy) is a stranger's:
    // the create clears it with the other orphans, and the first start copies the template.
    fs::create_dir_all(vars.parent().unwrap()).unwrap();
    fs::write(&vars, b"a stranger's boot entries").unwrap();
    let item = uefi_item(&host);
    assert_eq!(item["status"], "ok", "{item}");
    assert!(item["detail"].as_str().unwrap().contains("OVMF_CODE_4M.fd (3653632 bytes)"), "{item}");

    // Without `quiet`, the EFI stub reports on OVMF's console and the kernel names the firmware.
    let mut efi = host.kernel_spec("efi");
    efi["boot"]["cmdline"] = "console=ttyS0 panic=-1".into();
    efi["boot"]["firmware"] = "uefi".into();
    let mut legacy = host.kernel_spec("legacy");
    legacy["boot"]["cmdline"] = "console=ttyS0 panic=-1".into();
    let started = Instant::now();
    let vm = host.call("vm.create", json!({ "spec": efi }));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    assert_eq!(vm["vm"]["spec"]["boot"]["firmware"], "uefi");
    host.call("vm.create", json!({ "spec": legacy }));
    assert!(host.wait_serial("efi", GUEST_READY, BOOT), "no userspace through OVMF:\n{}", console(&host, "efi"));
    eprintln!("uefi kernel VM: userspace {:.1} s after vm.create", started.elapsed().as_secs_f64());
    assert!(host.wait_serial("legacy", GUEST_READY, BOOT), "the BIOS VM did not boot");

    let log = console(&host, "efi");
    assert!(log.contains("VMHOST-FIRMWARE efi"), "{log}");
    assert!(log.contains("EFI stub: Loaded initrd from LINUX_EFI_INITRD_MEDIA_GUID device path"), "{log}");
    assert!(log.contains("efi: EFI v2.70 by EDK II"), "{log}");
    let bios = console(&host, "legacy");
    assert!(bios.contains("VMHOST-FIRMWARE bios"), "{bios}");
    assert!(!bios.contains("EFI stub") && !bios.contains("EDK II"), "{bios}");
    // The default is left out of the spec as recorded and served.
    assert!(host.call("vm.get", json!({"name": "legacy"}))["spec"]["boot"].get("firmware").is_none());

    let pid = pid_of(&host, "efi");
    assert_uefi_argv(pid, Path::new(OVMF_CODE), &vars);
    assert_private_store(&vars, Path::new(OVMF_VARS));
    assert_ne!(fs::read(&vars).unwrap(), b"a stranger's boot entries");
    let legacy_argv = argv_of(pid_of(&host, "legacy"));
    assert!(!legacy_argv.iter().any(|a| a.contains("pflash") || a.contains("OVMF")), "{legacy_argv:?}");
    assert!(!host.state().join("disks/legacy").exists(), "a BIOS VM has no store");

    // The store is the guest's: kept across a restart (same file), gone with the VM.
    let ino = fs::metadata(&vars).unwrap().ino();
    host.call("vm.restart", json!({"name": "efi", "timeout_s": 1, "force": true}));
    assert_ne!(pid_of(&host, "efi"), pid);
    assert_eq!(fs::metadata(&vars).unwrap().ino(), ino, "the restart kept the store");
    let item = uefi_item(&host);
    assert_eq!(item["status"], "ok", "{item}");
    host.call("vm.destroy", json!({"name": "efi"}));
    assert!(!vars.exists(), "the destroy removed the store");
    assert!(!host.state().join("disks/efi").exists(), "and the VM's disk directory");
    host.call("vm.destroy", json!({"name": "legacy"}));
}

#[test]
fn an_os_less_image_reaches_the_uefi_shell_and_missing_firmware_refuses_a_start() {
    // The firmware from a directory of the test's own, so that it can go and come back.
    let fw = tempfile::Builder::new().prefix("vmhfw").tempdir_in("/tmp").unwrap();
    fs::set_permissions(fw.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let (code, template) = (fw.path().join("CODE.fd"), fw.path().join("VARS.fd"));
    fs::copy(OVMF_CODE, &code).unwrap();
    fs::copy(OVMF_VARS, &template).unwrap();
    let host = TestHost::start(HostOptions {
        extra: format!("[firmware]\nuefi_code = {:?}\nuefi_vars = {:?}\n", code.display(), template.display()),
        ..HostOptions::default()
    });
    vmhost_tests::boot_sector::write_image(&host.images().join("halt.img"), vmhost_tests::boot_sector::HALT);
    let spec = json!({"name": "shell", "cpu": 1, "memory_mib": 256, "state": "stopped",
        "boot": {"image": "halt.img", "disk_gib": 1, "firmware": "uefi"}});
    let vm = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(vm["vm"]["status"], "stopped", "{vm}");
    let vars = host.state().join("disks/shell/uefi-vars.fd");
    assert!(!vars.exists(), "the store is copied at the first start");
    let made = state_files(&host);

    // The code file gone: host.check names the VM that needs it, a start is refused with
    // nothing made.
    fs::remove_file(&code).unwrap();
    let item = uefi_item(&host);
    assert_eq!(item["status"], "missing", "{item}");
    let detail = item["detail"].as_str().unwrap();
    assert!(detail.contains("CODE.fd does not exist") && detail.contains("used by shell"), "{item}");
    let (c, e) = host.call_err("vm.start", json!({"name": "shell"}));
    assert_eq!((c, e.field.as_deref()), (2001, Some("spec.boot.firmware")), "{e:?}");
    assert!(e.message.contains("does not exist") && e.message.contains("ovmf"), "{e:?}");
    assert_eq!(e.details["path"], code.to_string_lossy().as_ref(), "{e:?}");
    assert_eq!(e.details["config"], "firmware.uefi_code", "{e:?}");
    assert_eq!(host.call("vm.get", json!({"name": "shell"}))["status"], "stopped");
    assert!(host.qemu_pids().is_empty(), "no QEMU");
    assert_eq!(state_files(&host), made, "nothing made");

    // Back as an upgrade puts it: a new file renamed into place. Landlock grants the directory,
    // so the new inode is readable without restarting vmhostd.
    let new = fw.path().join(".CODE.fd.new");
    fs::copy(OVMF_CODE, &new).unwrap();
    fs::rename(&new, &code).unwrap();
    assert_eq!(uefi_item(&host)["status"], "ok");
    let started = Instant::now();
    let vm = host.call("vm.start", json!({"name": "shell"}));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    // OVMF's boot manager tries the disks (no EFI system partition on them) and falls back to
    // its built-in shell.
    assert!(host.wait_serial("shell", "Shell> ", BOOT), "no UEFI shell:\n{}", console(&host, "shell"));
    eprintln!("uefi image VM: UEFI shell {:.1} s after vm.start", started.elapsed().as_secs_f64());
    let log = console(&host, "shell");
    for line in [
        "BdsDxe: failed to load Boot0001 \"UEFI Misc Device\"",
        "BdsDxe: loading Boot0003 \"EFI Internal Shell\"",
        "BdsDxe: starting Boot0003 \"EFI Internal Shell\"",
        "UEFI Interactive Shell v2.2",
    ] {
        assert!(log.contains(line), "{line:?} not in:\n{log}");
    }
    assert_uefi_argv(pid_of(&host, "shell"), &code, &vars);
    assert_private_store(&vars, &template);
    assert_ne!(fs::read(&vars).unwrap(), fs::read(&template).unwrap(), "OVMF wrote its boot entries to the copy");
    host.call("vm.destroy", json!({"name": "shell"}));
    assert!(!vars.exists());
}
