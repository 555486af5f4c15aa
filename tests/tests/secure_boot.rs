//! `boot.secure_boot: true` (docs/images.md#secure-boot): OVMF's Secure Boot build (SMM on, the
//! flash answering writes only from SMM) with a variables store made from an enrolled-keys
//! template.
//!
//! The test guest's kernel is signed by Debian, whose key is in no OVMF template's db (Debian's
//! shim carries it): the tests use Debian ovmf's snakeoil template (its PK, KEK and db hold the
//! snakeoil certificate, whose private key the package ships for testing) as
//! `firmware.uefi_secure_vars`, and sign the kernels they boot with `sbsign` into their own
//! directories. A direct-kernel guest reads its firmware's `SecureBoot` variable (1) and, once
//! Secure Boot is switched off, its store is set aside for a plain one (0) and comes back when it
//! is switched on again. Enforcement is shown on what the firmware loads from a disk: the same
//! kernel as `\EFI\BOOT\BOOTX64.EFI` on a FAT image starts when signed and is refused
//! ("Access Denied") when not. (OVMF 2022.11 starts a direct kernel that fails verification
//! through its legacy loader: docs/images.md says so; these tests do not rely on it either way.)

use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use vmhost_tests::{argv_of, plain_log, value_after, HostOptions, TestHost};

/// Debian ovmf's snakeoil template, the secure pair's vars in these tests.
const SNAKEOIL_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.snakeoil.fd";
/// The snakeoil private key (passphrase `snakeoil`) and certificate.
const SNAKEOIL_KEY: &str = "/usr/share/ovmf/PkKek-1-snakeoil.key";
const SNAKEOIL_CERT: &str = "/usr/share/ovmf/PkKek-1-snakeoil.pem";
/// The secure pair's code, the config's default.
const SECURE_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd";

/// OVMF with SMM under TCG on a busy 2-core machine: a failure bound, not a speed.
const BOOT: Duration = Duration::from_secs(180);

/// Runs `program args`, panicking with its output when it fails.
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The test guest's kernel without Debian's signature (`unsigned.efi`) and signed with the
/// snakeoil key (`signed.efi`), in `dir` (the test's own). The key is decrypted into `dir` too.
fn kernels(dir: &Path) -> (PathBuf, PathBuf) {
    let (unsigned, signed, key) = (dir.join("unsigned.efi"), dir.join("signed.efi"), dir.join("snakeoil.key"));
    let kernel = vmhost_tests::guest().kernel;
    fs::copy(&kernel, &unsigned).unwrap();
    // Debian's own signature would not verify under snakeoil either; gone, the kernel is
    // plainly unsigned.
    run("sbattach", &["--remove", unsigned.to_str().unwrap()]);
    let k = SNAKEOIL_KEY;
    run("openssl", &["pkey", "-in", k, "-passin", "pass:snakeoil", "-out", key.to_str().unwrap()]);
    let (key, cert) = (key.to_str().unwrap(), SNAKEOIL_CERT);
    run("sbsign", &["--key", key, "--cert", cert, "--output", signed.to_str().unwrap(), unsigned.to_str().unwrap()]);
    let out = Command::new("sbverify").args(["--list", unsigned.to_str().unwrap()]).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("No signature table"), "{out:?}");
    (unsigned, signed)
}

/// The test guest with the `efivarfs` module, so that its init reports the firmware's
/// `SecureBoot` variable (built once per process into `target/guest/initramfs-sb.cpio.gz`).
fn efivarfs_initrd() -> PathBuf {
    let root = vmhost_tests::workspace();
    let out = root.join("target/guest");
    vmhost_tests::guest();
    // build.sh's default list and efivarfs.
    let modules = "virtio_pci virtio_console virtio_net virtio_blk 8021q bridge tun dummy vfio_pci \
                   vfio_iommu_type1 button evdev vfat nls_cp437 nls_ascii nls_iso8859-1 nls_utf8 efivarfs";
    let st = Command::new(root.join("tests/guest/build.sh"))
        .env("INITRAMFS_NAME", "initramfs-sb.cpio.gz")
        .env("MODULES", modules)
        .arg(&out)
        .status()
        .expect("run tests/guest/build.sh");
    assert!(st.success(), "tests/guest/build.sh (Secure Boot guest): {st}");
    out.join("initramfs-sb.cpio.gz")
}

/// A host whose secure pair is the secboot code and the snakeoil template.
fn host() -> TestHost {
    TestHost::start(HostOptions {
        extra: format!("[firmware]\nuefi_secure_vars = {SNAKEOIL_VARS:?}\n"),
        ..HostOptions::default()
    })
}

/// The serial log of `name` without ANSI sequences and carriage returns.
fn console(host: &TestHost, name: &str) -> String {
    plain_log(&host.serial(name)).replace('\r', "")
}

/// The `host.check` item `name`.
fn check_item(host: &TestHost, name: &str) -> Value {
    let report = host.call("host.check", json!({}));
    report["items"].as_array().unwrap().iter().find(|i| i["name"] == name).cloned().expect("the item")
}

/// The Platform Key of the store at `path` (None: setup mode, nothing checked).
fn pk(path: &Path) -> Option<Vec<u8>> {
    vmhost::qemu::firmware::platform_key(&fs::read(path).unwrap()).unwrap()
}

/// What the last boot in `log` said of Secure Boot (`VMHOST-SECUREBOOT N`).
fn last_secure_boot(log: &str) -> &str {
    let line = log.lines().rfind(|l| l.starts_with("VMHOST-SECUREBOOT ")).unwrap_or_default();
    line.trim_start_matches("VMHOST-SECUREBOOT ").trim()
}

/// QEMU's command line of running VM `name`.
fn argv(host: &TestHost, name: &str) -> Vec<String> {
    argv_of(host.call("vm.get", json!({ "name": name }))["pid"].as_i64().expect("a running QEMU"))
}

#[test]
fn a_signed_kernel_boots_with_secure_boot_on_and_switching_it_swaps_the_store() {
    let dir = tempfile::Builder::new().prefix("vmhsb").tempdir_in("/tmp").unwrap();
    let (_, signed) = kernels(dir.path());
    let initrd = efivarfs_initrd();
    let host = host();
    // The kernel from the host's images directory, one of paths.boot.
    let kernel = host.images().join("vmlinuz-snakeoil");
    fs::copy(&signed, &kernel).unwrap();
    fs::set_permissions(&kernel, fs::Permissions::from_mode(0o644)).unwrap();

    let item = check_item(&host, "secure_boot_firmware");
    assert_eq!(item["status"], "ok", "{item}");
    let detail = item["detail"].as_str().unwrap();
    assert!(detail.contains("OVMF_CODE_4M.secboot.fd") && detail.contains("snakeoil.fd"), "{item}");

    let mut spec = json!({"name": "sb", "cpu": 1, "memory_mib": 512, "boot": {
        "kernel": kernel, "initrd": initrd, "cmdline": "console=ttyS0 panic=-1",
        "firmware": "bios", "secure_boot": true}});
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.boot.secure_boot")), "{e:?}");
    assert!(e.message.contains("uefi"), "{e:?}");

    spec["boot"]["firmware"] = "uefi".into();
    let started = Instant::now();
    let vm = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    assert_eq!(vm["vm"]["spec"]["boot"]["secure_boot"], true);
    assert!(host.wait_serial("sb", "VMHOST-SECUREBOOT ", BOOT), "no Secure Boot line:\n{}", console(&host, "sb"));
    eprintln!("secure boot kernel VM: userspace {:.1} s after vm.create", started.elapsed().as_secs_f64());
    let log = console(&host, "sb");
    for line in ["EFI stub: UEFI Secure Boot is enabled.", "secureboot: Secure boot enabled", "VMHOST-SECUREBOOT 1"] {
        assert!(log.contains(line), "{line:?} not in:\n{log}");
    }
    let a = argv(&host, "sb");
    assert!(value_after(&a, "-machine").ends_with(",pflash0=uefi-code,pflash1=uefi-vars,smm=on"), "{a:?}");
    assert_eq!(value_after(&a, "-global"), "driver=cfi.pflash01,property=secure,value=on");
    assert!(a.iter().any(|x| x.starts_with("fd=") && x.ends_with(&format!(",opaque={SECURE_CODE}"))), "{a:?}");
    let vars = host.state().join("disks/sb/uefi-vars.fd");
    let snakeoil_pk = pk(Path::new(SNAKEOIL_VARS)).expect("the snakeoil template enrolls a PK");
    assert_eq!(pk(&vars).as_ref(), Some(&snakeoil_pk), "the store is the snakeoil template's copy");

    // Off: the enrolled store is set aside, a plain one made; the firmware says 0.
    spec["boot"]["secure_boot"] = false.into();
    let r = host.call("vm.apply", json!({ "spec": spec, "timeout_s": 1 }));
    assert_eq!(r["vm"]["status"], "running", "{r}");
    assert!(r["vm"]["spec"]["boot"].get("secure_boot").is_none(), "false is left out: {r}");
    host.wait_serial_count("sb", "VMHOST-SECUREBOOT ", 2, BOOT);
    assert_eq!(last_secure_boot(&console(&host, "sb")), "0");
    let a = argv(&host, "sb");
    assert!(!a.iter().any(|x| x.contains("smm=on") || x.contains("secboot")), "{a:?}");
    let aside = host.state().join("disks/sb/uefi-vars.secure.fd");
    assert_eq!(pk(&vars), None, "a plain store");
    assert_eq!(pk(&aside).as_ref(), Some(&snakeoil_pk), "the enrolled one kept aside");

    // On again: the enrolled store comes back (the guest's settings with it).
    spec["boot"]["secure_boot"] = true.into();
    host.call("vm.apply", json!({ "spec": spec, "timeout_s": 1 }));
    host.wait_serial_count("sb", "VMHOST-SECUREBOOT ", 3, BOOT);
    assert_eq!(last_secure_boot(&console(&host, "sb")), "1");
    assert_eq!(pk(&vars).as_ref(), Some(&snakeoil_pk));
    assert!(!aside.exists(), "restored, not copied");
    assert!(host.state().join("disks/sb/uefi-vars.plain.fd").exists(), "the plain one aside in turn");

    host.call("vm.destroy", json!({ "name": "sb" }));
    assert!(!host.state().join("disks/sb").exists(), "the destroy removed both stores and the directory");
}

/// A raw FAT image (no partition table: OVMF reads a whole-disk file system) holding `efi` as
/// `\EFI\BOOT\BOOTX64.EFI`, the removable-media path OVMF's boot manager starts.
fn esp_image(path: &Path, efi: &Path) {
    let img = path.to_str().unwrap();
    run("mkfs.fat", &["-C", "-n", "ESP", img, "65536"]);
    run("mmd", &["-i", img, "::/EFI", "::/EFI/BOOT"]);
    run("mcopy", &["-i", img, efi.to_str().unwrap(), "::/EFI/BOOT/BOOTX64.EFI"]);
    fs::set_permissions(path, fs::Permissions::from_mode(0o644)).unwrap();
}

#[test]
fn secure_boot_refuses_an_unsigned_loader_and_starts_a_signed_one() {
    let dir = tempfile::Builder::new().prefix("vmhsb").tempdir_in("/tmp").unwrap();
    let (unsigned, signed) = kernels(dir.path());
    let host = host();
    esp_image(&host.images().join("esp-signed.img"), &signed);
    esp_image(&host.images().join("esp-unsigned.img"), &unsigned);
    for (name, image) in [("signed", "esp-signed.img"), ("unsigned", "esp-unsigned.img")] {
        let spec = json!({"name": name, "cpu": 1, "memory_mib": 512,
            "boot": {"image": image, "disk_gib": 1, "firmware": "uefi", "secure_boot": true}});
        let vm = host.call("vm.create", json!({ "spec": spec }));
        assert_eq!(vm["vm"]["status"], "running", "{vm}");
    }
    // The signed kernel's EFI stub runs (no command line: it prints only this much).
    assert!(
        host.wait_serial("signed", "EFI stub: UEFI Secure Boot is enabled.", BOOT),
        "the signed loader did not start:\n{}",
        console(&host, "signed")
    );
    // The unsigned one: OVMF refuses it, tries the rest (its built-in shell is refused too
    // under Secure Boot) and gives up.
    assert!(
        host.wait_serial("unsigned", "BdsDxe: No bootable option or device was found.", BOOT),
        "the boot manager did not finish:\n{}",
        console(&host, "unsigned")
    );
    let log = console(&host, "unsigned");
    assert!(
        log.lines().any(|l| l.starts_with("BdsDxe: failed to load Boot") && l.trim_end().ends_with(": Access Denied")),
        "{log}"
    );
    assert!(!log.contains("EFI stub"), "the unsigned kernel ran:\n{log}");
    let signed_log = console(&host, "signed");
    assert!(!signed_log.contains("Access Denied"), "{signed_log}");
    for name in ["signed", "unsigned"] {
        host.call("vm.destroy", json!({ "name": name }));
    }
}
