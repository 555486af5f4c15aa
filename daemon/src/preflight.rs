//! `host.check`: can this host run VMs as configured? One item per prerequisite.
//!
//! Everything is probed, nothing is changed: binaries are run with `--version` (QEMU only when it
//! is the binary `qemu.sha256` pins, [`crate::qemu::integrity`]), directories are
//! tested with a probe file that is removed again, the accelerator is opened. The order of
//! [`check`]'s items is stable so operators and plugins can diff reports.

use crate::api::{CheckItem, CheckStatus, HostCheck};
use crate::config::{Accel, Config};
use crate::net::host::NetworkState;
use crate::qemu::kvm::Access;
use crate::state::BrokenRecord;
use std::path::Path;
use std::time::Duration;

fn item(name: &str, status: CheckStatus, detail: impl Into<String>) -> CheckItem {
    CheckItem { name: name.to_string(), status, detail: detail.into() }
}

/// How long `--version` may take. Generous: a cold page cache on a slow disk must not turn a
/// working binary into a failed item.
const VERSION_TIMEOUT: Duration = Duration::from_secs(30);

/// `binary --version`, unless `pinned` (the binary's pin check) refused it: a binary that is not
/// the pinned one is not run, not even for its version.
async fn binary_version(name: &str, binary: &Path, pinned: Result<(), crate::qemu::integrity::PinError>) -> CheckItem {
    if !binary.exists() {
        return item(name, CheckStatus::Missing, format!("{} not found (Debian: qemu-system-x86)", binary.display()));
    }
    if let Err(refused) = pinned {
        return item(name, CheckStatus::Error, format!("--version not run: {refused}"));
    }
    let run = crate::sandbox::spawn::Command::version_probe(binary).output();
    match tokio::time::timeout(VERSION_TIMEOUT, run).await {
        Ok(Ok(out)) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            item(name, CheckStatus::Ok, format!("{}: {}", binary.display(), text.lines().next().unwrap_or("").trim()))
        }
        Ok(Ok(out)) => {
            item(name, CheckStatus::Error, format!("{} --version exited with {}", binary.display(), out.status))
        }
        Ok(Err(e)) => item(name, CheckStatus::Error, format!("cannot run {}: {e}", binary.display())),
        Err(_) => item(
            name,
            CheckStatus::Error,
            format!("{} --version did not finish within {VERSION_TIMEOUT:?}", binary.display()),
        ),
    }
}

/// KVM usable by QEMU: `/dev/kvm` opened read-write as `qemu.user` with exactly the groups
/// QEMU gets (by the spawner, which starts QEMU; [`crate::qemu::kvm`]), not as the daemon.
async fn accelerator(config: &Config) -> CheckItem {
    if config.qemu.accel == Accel::Tcg {
        return item("accelerator", CheckStatus::Ok, "tcg (software emulation), set explicitly in the config");
    }
    let who = qemu_user_name(config);
    match crate::sandbox::spawn::kvm_access(config.qemu_user).await {
        Ok(Access::Usable) => {
            item("accelerator", CheckStatus::Ok, format!("kvm: /dev/kvm opened read-write as {who}, as QEMU runs"))
        }
        Ok(Access::Missing) => item(
            "accelerator",
            CheckStatus::Missing,
            "kvm: /dev/kvm does not exist (load kvm_intel or kvm_amd, enable virtualisation in the firmware; \
             no fallback to tcg)",
        ),
        Ok(Access::Denied(errno)) => {
            let owner = std::fs::metadata(crate::qemu::kvm::KVM_DEV)
                .map(|m| {
                    use std::os::unix::fs::{MetadataExt, PermissionsExt};
                    format!("{:04o} uid {} gid {}", m.permissions().mode() & 0o7777, m.uid(), m.gid())
                })
                .unwrap_or_default();
            item(
                "accelerator",
                CheckStatus::Denied,
                format!(
                    "kvm: {who} cannot open /dev/kvm ({owner}): {}; QEMU keeps only the group that owns \
                     /dev/kvm, so make that group kvm with mode 0660 (udev does) and add {who} to it \
                     (adduser {who} kvm)",
                    std::io::Error::from_raw_os_error(errno)
                ),
            )
        }
        Err(e) => item("accelerator", CheckStatus::Error, format!("kvm: cannot test /dev/kvm as {who}: {e}")),
    }
}

/// `qemu.user` as configured, or "root" when QEMU runs as the daemon's user.
fn qemu_user_name(config: &Config) -> String {
    match config.qemu_user {
        Some(u) if u.uid != 0 => config.qemu.user.clone(),
        _ => "root".to_string(),
    }
}

fn writable_dir(name: &str, dir: &Path) -> CheckItem {
    if !dir.is_dir() {
        return item(name, CheckStatus::Missing, format!("{} is not a directory", dir.display()));
    }
    let probe = dir.join(format!(".vmhost-probe-{}", std::process::id()));
    match std::fs::write(&probe, b"") {
        Ok(()) => {
            let _ = std::fs::remove_file(&probe);
            item(name, CheckStatus::Ok, format!("{} is writable", dir.display()))
        }
        Err(e) => item(name, CheckStatus::Error, format!("{} is not writable: {e}", dir.display())),
    }
}

fn readable_dir(name: &str, dir: &Path) -> CheckItem {
    match std::fs::read_dir(dir) {
        Ok(_) => item(name, CheckStatus::Ok, format!("{} is readable", dir.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            item(name, CheckStatus::Missing, format!("{} does not exist", dir.display()))
        }
        Err(e) => item(name, CheckStatus::Error, format!("{}: {e}", dir.display())),
    }
}

fn hardware(config: &Config) -> CheckItem {
    let model = &config.hardware.model;
    if model.is_empty() {
        return item("hardware_model", CheckStatus::Ok, "no passthrough devices configured");
    }
    let missing: Vec<String> = model
        .iter()
        .filter(|(_, _, addr)| !Path::new("/sys/bus/pci/devices").join(addr.to_string()).exists())
        .map(|(class, index, addr)| format!("{class} {index} ({addr})"))
        .collect();
    if missing.is_empty() {
        item("hardware_model", CheckStatus::Ok, format!("all {} devices present", model.len()))
    } else {
        item("hardware_model", CheckStatus::Missing, format!("not present on this host: {}", missing.join(", ")))
    }
}

/// `hardware_identity`: every model entry that pins an identity is the device at its address
/// (`judged` by `lifecycle::vfio::judge_model`). `ok` when each matches (or nothing is pinned),
/// `error` listing each mismatch, `missing` when the only trouble is an absent device.
pub fn hardware_identity(
    judged: Result<Vec<(crate::pci::identity::PinnedDevice, crate::pci::identity::Judged)>, String>,
) -> CheckItem {
    use crate::pci::identity::Judged;
    const NAME: &str = "hardware_identity";
    let judged = match judged {
        Ok(j) => j,
        Err(e) => return item(NAME, CheckStatus::Error, format!("cannot read the pinned devices: {e}")),
    };
    if judged.is_empty() {
        return item(NAME, CheckStatus::Ok, "no device identity pinned (skipped)");
    }
    let mut mismatches = Vec::new();
    let mut absent = Vec::new();
    let mut held = Vec::new();
    for (p, j) in &judged {
        match j {
            Judged::Matches => {
                if let (Some(vm), Some(_)) = (&p.held_by, p.identity.mac) {
                    held.push(format!("{} {} (MAC not readable while on vfio-pci for {vm})", p.class, p.index));
                }
            }
            Judged::Absent => absent.push(format!("{} {} ({})", p.class, p.index, p.address)),
            Judged::Mismatch(m) => mismatches.push(m.to_string()),
        }
    }
    if !mismatches.is_empty() {
        let mut detail = mismatches.join("; ");
        if !absent.is_empty() {
            detail.push_str(&format!("; not present: {}", absent.join(", ")));
        }
        return item(NAME, CheckStatus::Error, detail);
    }
    if !absent.is_empty() {
        return item(NAME, CheckStatus::Missing, format!("not present: {}", absent.join(", ")));
    }
    let mut detail = format!("all {} pinned devices match", judged.len());
    if !held.is_empty() {
        detail.push_str(&format!("; ids only for {}", held.join(", ")));
    }
    item(NAME, CheckStatus::Ok, detail)
}

/// IOMMU, vfio-pci (loaded if needed) and /dev/vfio/vfio: only required when passthrough is
/// configured (a model with devices, or raw PCI allowed).
async fn vfio(config: &Config) -> Vec<CheckItem> {
    let wanted = !config.hardware.model.is_empty() || config.hardware.allow_raw_pci;
    let pci = crate::pci::Pci::real();
    let not_needed = |what: &str| item(what, CheckStatus::Ok, "no passthrough devices configured");
    let iommu = if pci.iommu_enabled() {
        item("iommu", CheckStatus::Ok, "/sys/kernel/iommu_groups is populated")
    } else if wanted {
        item(
            "iommu",
            CheckStatus::Missing,
            "no IOMMU groups: enable VT-d/AMD-Vi and boot with intel_iommu=on or amd_iommu=on",
        )
    } else {
        not_needed("iommu")
    };
    let mut vfio_pci = pci.vfio_pci_present();
    if wanted && !vfio_pci {
        vfio_pci = tokio::task::spawn_blocking(crate::pci::load_vfio_pci).await.map(|r| r.is_ok()).unwrap_or(false);
    }
    let driver = match (vfio_pci, wanted) {
        (true, _) => item("vfio_pci", CheckStatus::Ok, "vfio-pci driver available"),
        (false, true) => {
            item("vfio_pci", CheckStatus::Missing, "vfio-pci driver not available (modprobe vfio-pci failed)")
        }
        (false, false) => not_needed("vfio_pci"),
    };
    let container = match (crate::pci::vfio_container_present(), wanted) {
        (true, _) => item("vfio_container", CheckStatus::Ok, "/dev/vfio/vfio present"),
        (false, true) => item("vfio_container", CheckStatus::Missing, "/dev/vfio/vfio missing"),
        (false, false) => not_needed("vfio_container"),
    };
    vec![iommu, driver, container]
}

/// The `[firmware]` files a UEFI VM needs, opened as a launch opens them. Without them only
/// UEFI VMs cannot start: the item fails only when a VM (`uefi_vms`, by name) uses UEFI, and is
/// otherwise `ok` with what is wrong and how to fix it.
fn uefi_firmware(config: &Config, uefi_vms: &[String]) -> CheckItem {
    const NAME: &str = "uefi_firmware";
    let f = &config.firmware;
    let e = match crate::qemu::firmware::check(f) {
        Ok(p) => {
            return item(
                NAME,
                CheckStatus::Ok,
                format!(
                    "{} ({} bytes) and {} ({} bytes) readable",
                    f.uefi_code.display(),
                    p.code_bytes,
                    f.uefi_vars.display(),
                    p.vars_bytes
                ),
            )
        }
        Err(e) => e,
    };
    if uefi_vms.is_empty() {
        return item(NAME, CheckStatus::Ok, format!("needed only for boot.firmware uefi, which no VM uses: {e}"));
    }
    let status = firmware_status(&e);
    item(NAME, status, format!("{e}; boot.firmware uefi is used by {}", uefi_vms.join(", ")))
}

/// How a firmware file that cannot be used fails a check item: not installed, installed after
/// vmhostd started (its sandbox cannot read it), or anything else.
fn firmware_status(e: &crate::qemu::firmware::FirmwareError) -> CheckStatus {
    match e {
        crate::qemu::firmware::FirmwareError::Missing { .. } => CheckStatus::Missing,
        crate::qemu::firmware::FirmwareError::Unreadable { source, .. }
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            CheckStatus::Denied
        }
        _ => CheckStatus::Error,
    }
}

/// The `[firmware]` secure pair a `boot.secure_boot` VM needs ([`crate::qemu::firmware::check_pair`]:
/// both files, and a template with a Platform Key enrolled) and a q35 `qemu.machine`, judged
/// like [`uefi_firmware`]: failing only when a VM (`secure_vms`) asks for Secure Boot.
fn secure_boot_firmware(config: &Config, secure_vms: &[String]) -> CheckItem {
    const NAME: &str = "secure_boot_firmware";
    let pair = crate::qemu::firmware::Pair::of(&config.firmware, true);
    let e = match crate::qemu::firmware::check_pair(pair) {
        Ok(p) => {
            let readable = format!(
                "{} ({} bytes) and {} ({} bytes, keys enrolled) readable",
                pair.code.display(),
                p.code_bytes,
                pair.vars.display(),
                p.vars_bytes
            );
            if crate::validate::is_q35(&config.qemu.machine) {
                return item(NAME, CheckStatus::Ok, readable);
            }
            let machine = format!("qemu.machine {:?} is not q35, which Secure Boot needs", config.qemu.machine);
            // A VM asking for Secure Boot would not start on this machine type: that is a
            // failure of the host, not a note, once some VM depends on it.
            if secure_vms.is_empty() {
                return item(NAME, CheckStatus::Ok, format!("{readable}; but {machine}"));
            }
            return item(
                NAME,
                CheckStatus::Error,
                format!("{readable}; but {machine}; boot.secure_boot is used by {}", secure_vms.join(", ")),
            );
        }
        Err(e) => e,
    };
    if secure_vms.is_empty() {
        return item(NAME, CheckStatus::Ok, format!("needed only for boot.secure_boot, which no VM uses: {e}"));
    }
    let status = firmware_status(&e);
    item(NAME, status, format!("{e}; boot.secure_boot is used by {}", secure_vms.join(", ")))
}

/// Adds the [`secure_boot_firmware`] item to `report` (from [`check`]) right after
/// `uefi_firmware`, `secure_vms` being the VMs whose spec asks for Secure Boot.
pub fn add_secure_boot_firmware(report: &mut HostCheck, config: &Config, secure_vms: &[String]) {
    let it = secure_boot_firmware(config, secure_vms);
    report.ok &= it.status == CheckStatus::Ok;
    let at = report.items.iter().position(|i| i.name == "uefi_firmware").map_or(report.items.len(), |i| i + 1);
    report.items.insert(at, it);
}

/// vhost-net ([`crate::net::vhost`]): `ok` either way, since VMs start without it (their
/// virtio-net then runs in QEMU's userspace, slower); the detail says which and why.
fn vhost_net(status: &crate::net::vhost::VhostStatus) -> CheckItem {
    let detail = if status.usable {
        format!("{}: VM NICs get vhost-net (the host kernel moves their packets)", status.reason)
    } else {
        format!("not usable, VMs run virtio-net in QEMU's userspace (slower): {}", status.reason)
    };
    item("vhost_net", CheckStatus::Ok, detail)
}

fn records(broken: &[BrokenRecord]) -> CheckItem {
    if broken.is_empty() {
        return item("vm_records", CheckStatus::Ok, "all VM records readable");
    }
    let list: Vec<String> = broken.iter().map(|b| format!("{}: {}", b.path.display(), b.error)).collect();
    item("vm_records", CheckStatus::Error, format!("unreadable records: {}", list.join("; ")))
}

fn networks(states: &[NetworkState]) -> Vec<CheckItem> {
    states
        .iter()
        .map(|s| {
            let status = if s.ready { CheckStatus::Ok } else { CheckStatus::Error };
            item(&format!("network.{}", s.name), status, s.detail.clone())
        })
        .collect()
}

/// Runs every preflight check; `networks` is what the network owner found at its last check,
/// `uefi_vms` the VMs whose spec asks for UEFI firmware, `identity` the [`hardware_identity`]
/// item.
pub async fn check(
    config: &Config,
    broken: &[BrokenRecord],
    network_states: &[NetworkState],
    integrity: &crate::qemu::integrity::Integrity,
    images: CheckItem,
    uefi_vms: &[String],
    identity: CheckItem,
) -> HostCheck {
    let mut items = vec![
        binary_version("qemu", &config.qemu.binary, integrity.verify_qemu()).await,
        accelerator(config).await,
        writable_dir("state_dir", &config.paths.state),
        writable_dir("run_dir", &config.paths.run),
        readable_dir("image_dir", &config.paths.images),
        hardware(config),
        identity,
        records(broken),
    ];
    items.extend(integrity.items(config));
    items.push(images);
    items.push(uefi_firmware(config, uefi_vms));
    items.extend(networks(network_states));
    items.push(vhost_net(&crate::net::vhost::for_accel(config.qemu.accel, crate::net::vhost::probe())));
    items.extend(vfio(config).await);
    items.extend(crate::sandbox::report::items(config, &crate::sandbox::state()));
    let ok = items.iter().all(|i| i.status == CheckStatus::Ok);
    HostCheck { ok, items }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::tests::config;

    fn images_item() -> CheckItem {
        item("images", CheckStatus::Ok, "0 recorded images match their sha256")
    }

    fn identity_item() -> CheckItem {
        hardware_identity(Ok(Vec::new()))
    }

    #[test]
    fn hardware_identity_lists_each_mismatch() {
        use crate::api::HardwareClass;
        use crate::hardware::{DeviceIdentity, PciAddress};
        use crate::pci::identity::{Found, FoundMac, Judged, Mismatch, PinnedDevice, PinnedMismatch};
        let id = DeviceIdentity { vendor: 0x15ad, device: 0x07b0, subsystem: None, mac: Some([2, 0, 0, 0, 0, 1]) };
        let dev = |index: u32, addr: &str, held_by: Option<&str>| PinnedDevice {
            class: HardwareClass::Copper,
            index,
            address: PciAddress::parse(addr).unwrap(),
            identity: id,
            field: format!("hardware.copper.{index}"),
            held_by: held_by.map(str::to_string),
        };
        let it = identity_item();
        assert_eq!((it.name.as_str(), it.status), ("hardware_identity", CheckStatus::Ok));
        assert!(it.detail.contains("skipped"), "{}", it.detail);

        let ok = vec![
            (dev(1, "0000:00:05.0", None), Judged::Matches),
            (dev(2, "0000:00:06.0", Some("p1")), Judged::Matches),
        ];
        let it = hardware_identity(Ok(ok.clone()));
        assert_eq!(it.status, CheckStatus::Ok);
        assert!(
            it.detail.contains("all 2 pinned devices match") && it.detail.contains("on vfio-pci for p1"),
            "{}",
            it.detail
        );

        let mismatch = |index: u32, addr: &str| {
            let p = dev(index, addr, None);
            let found =
                Found { vendor: 0x8086, device: 0x10d3, subsystem: None, mac: FoundMac::Address([2, 0, 0, 0, 0, 9]) };
            let m = PinnedMismatch {
                class: p.class,
                index,
                address: p.address,
                field: p.field.clone(),
                mismatch: Mismatch { expected: id, found },
            };
            (p, Judged::Mismatch(m))
        };
        let mut bad = ok;
        bad.push(mismatch(3, "0000:00:07.0"));
        bad.push(mismatch(4, "0000:00:08.0"));
        bad.push((dev(5, "0000:00:09.0", None), Judged::Absent));
        let it = hardware_identity(Ok(bad));
        assert_eq!(it.status, CheckStatus::Error);
        assert!(it.detail.contains("hardware copper 3 (0000:00:07.0) is 8086:10d3 (MAC 02:00:00:00:00:09), the model pins 15ad:07b0 (MAC 02:00:00:00:00:01)"), "{}", it.detail);
        assert!(it.detail.contains("hardware copper 4 (0000:00:08.0)"), "{}", it.detail);
        assert!(it.detail.ends_with("not present: copper 5 (0000:00:09.0)"), "{}", it.detail);

        let it = hardware_identity(Ok(vec![(dev(5, "0000:00:09.0", None), Judged::Absent)]));
        assert_eq!(it.status, CheckStatus::Missing);
        assert_eq!(hardware_identity(Err("x".into())).status, CheckStatus::Error);
    }

    #[tokio::test]
    async fn reports_missing_binaries_and_dirs() {
        let d = tempfile::tempdir().unwrap();
        let mut c = config();
        c.qemu.binary = d.path().join("no-qemu");
        c.paths.state = d.path().to_path_buf();
        c.paths.run = d.path().join("absent");
        c.paths.images = d.path().join("absent-images");
        let r =
            check(&c, &[], &[], &crate::qemu::integrity::Integrity::of(&c), images_item(), &[], identity_item()).await;
        assert!(!r.ok);
        let status = |n: &str| r.items.iter().find(|i| i.name == n).unwrap().status;
        assert_eq!(status("qemu"), CheckStatus::Missing);
        assert!(!r.items.iter().any(|i| i.name == "qemu_img"), "qemu-img is not needed");
        assert_eq!(status("accelerator"), CheckStatus::Ok); // tcg in the test config
        assert_eq!(status("state_dir"), CheckStatus::Ok);
        assert_eq!(status("run_dir"), CheckStatus::Missing);
        assert_eq!(status("image_dir"), CheckStatus::Missing);
        assert_eq!(status("hardware_model"), CheckStatus::Missing); // 0000:c7:00.0 is not on this host
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0, "the probe file is removed");
        let broken = [BrokenRecord { path: "/x/a.json".into(), name: "a".into(), error: "bad".into() }];
        let nets = [NetworkState { name: "lan".into(), ready: false, detail: "bridge br0 does not exist".into() }];
        let r =
            check(&c, &broken, &nets, &crate::qemu::integrity::Integrity::of(&c), images_item(), &[], identity_item())
                .await;
        assert_eq!(r.items.iter().find(|i| i.name == "network.lan").unwrap().status, CheckStatus::Error);
        assert_eq!(r.items.iter().find(|i| i.name == "vm_records").unwrap().status, CheckStatus::Error);
    }

    #[test]
    fn vhost_net_says_why_without_failing_the_check() {
        use crate::net::vhost::{probe_at, VhostStatus};
        let d = tempfile::tempdir().unwrap();
        let it = vhost_net(&probe_at(&d.path().join("vhost-net")));
        assert_eq!(it.status, CheckStatus::Ok);
        assert!(
            it.detail.starts_with("not usable, VMs run virtio-net in QEMU's userspace")
                && it.detail.contains("modprobe vhost_net"),
            "{}",
            it.detail
        );
        let it = vhost_net(&VhostStatus { usable: true, reason: "/dev/vhost-net opens read-write".into() });
        assert_eq!((it.status, it.detail.contains("get vhost-net")), (CheckStatus::Ok, true), "{}", it.detail);
    }

    #[test]
    fn secure_boot_firmware_needs_enrolled_keys_and_fails_only_when_a_vm_uses_it() {
        let d = tempfile::tempdir().unwrap();
        let mut c = config();
        c.firmware.uefi_secure_code = d.path().join("CODE.secboot.fd");
        c.firmware.uefi_secure_vars = d.path().join("VARS.ms.fd");
        let it = secure_boot_firmware(&c, &[]);
        assert_eq!(it.status, CheckStatus::Ok);
        assert!(it.detail.starts_with("needed only for boot.secure_boot"), "{}", it.detail);
        let it = secure_boot_firmware(&c, &["sb".into()]);
        assert_eq!(it.status, CheckStatus::Missing);
        assert!(
            it.detail.contains("CODE.secboot.fd does not exist") && it.detail.ends_with("used by sb"),
            "{}",
            it.detail
        );
        std::fs::write(&c.firmware.uefi_secure_code, [0u8; 16]).unwrap();
        // Debian's plain template: no keys, Secure Boot would be off.
        let Ok(plain) = std::fs::read("/usr/share/OVMF/OVMF_VARS_4M.fd") else { return };
        std::fs::write(&c.firmware.uefi_secure_vars, plain).unwrap();
        let it = secure_boot_firmware(&c, &["sb".into()]);
        assert_eq!(it.status, CheckStatus::Error);
        assert!(it.detail.contains("no Platform Key"), "{}", it.detail);
        let Ok(ms) = std::fs::read("/usr/share/OVMF/OVMF_VARS_4M.ms.fd") else { return };
        std::fs::write(&c.firmware.uefi_secure_vars, ms).unwrap();
        let it = secure_boot_firmware(&c, &["sb".into()]);
        assert_eq!(it.status, CheckStatus::Ok, "{}", it.detail);
        assert!(it.detail.contains("keys enrolled) readable"), "{}", it.detail);
        c.qemu.machine = "pc".into();
        let it = secure_boot_firmware(&c, &[]);
        assert_eq!((it.status, it.detail.contains("not q35")), (CheckStatus::Ok, true), "{}", it.detail);
        // A Secure Boot VM on a machine type that is not q35 would not start: an error naming it.
        let it = secure_boot_firmware(&c, &["sb".into()]);
        assert_eq!(it.status, CheckStatus::Error, "{}", it.detail);
        assert!(it.detail.contains("not q35") && it.detail.ends_with("used by sb"), "{}", it.detail);
    }

    #[test]
    fn uefi_firmware_fails_only_when_a_vm_uses_it() {
        let d = tempfile::tempdir().unwrap();
        let mut c = config();
        c.firmware.uefi_code = d.path().join("CODE.fd");
        c.firmware.uefi_vars = d.path().join("VARS.fd");
        let it = uefi_firmware(&c, &[]);
        assert_eq!(it.status, CheckStatus::Ok);
        assert!(
            it.detail.contains("needed only for boot.firmware uefi") && it.detail.contains("ovmf"),
            "{}",
            it.detail
        );
        let it = uefi_firmware(&c, &["efi1".into(), "efi2".into()]);
        assert_eq!(it.status, CheckStatus::Missing);
        assert!(
            it.detail.contains("CODE.fd does not exist") && it.detail.ends_with("used by efi1, efi2"),
            "{}",
            it.detail
        );
        std::fs::write(&c.firmware.uefi_code, [0u8; 16]).unwrap();
        std::fs::create_dir(&c.firmware.uefi_vars).unwrap();
        assert_eq!(uefi_firmware(&c, &["efi1".into()]).status, CheckStatus::Error, "a directory is no firmware");
        std::fs::remove_dir(&c.firmware.uefi_vars).unwrap();
        std::fs::write(&c.firmware.uefi_vars, [0u8; 8]).unwrap();
        for vms in [vec![], vec!["efi1".to_string()]] {
            let it = uefi_firmware(&c, &vms);
            assert_eq!(it.status, CheckStatus::Ok);
            assert!(it.detail.contains("(16 bytes)") && it.detail.contains("(8 bytes) readable"), "{}", it.detail);
        }
    }
}
