//! Spec validation: a pure function of (spec, host config), run before anything else.
//!
//! [`validate_spec`] checks the spec on its own (2001) and against the host model (3001). What other
//! VMs hold is [`crate::capacity`]'s concern; whether files exist on disk is checked by the
//! lifecycle right after, because that is not a pure question. A spec that passes here becomes a
//! [`ValidSpec`] whose boot source is a closed enum, so later code cannot see an invalid mix.

use crate::api::{ApiError, Code, VmSpec};
use crate::config::Config;
use crate::hardware::PciAddress;
pub use crate::nic::hostname_of;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Lowest memory a VM may ask for, MiB: below this no x86 guest kernel boots.
pub const MIN_MEMORY_MIB: u64 = 32;
/// Largest overlay disk, GiB.
pub const MAX_DISK_GIB: u64 = 65536;
/// Longest kernel command line accepted (x86 COMMAND_LINE_SIZE is 2048).
pub const MAX_CMDLINE: usize = 2048;
/// Largest `user_data`, bytes: far above any cloud-config a VM needs, small enough that a
/// record, a request and the 1 MiB seed volume ([`crate::seed`]) always hold it.
pub const MAX_USER_DATA: usize = 64 * 1024;

/// How a validated VM boots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootSource {
    /// A qcow2 overlay over a base image from the image dir.
    Image {
        /// The base image's file name.
        image: String,
        /// Overlay size.
        disk_gib: u64,
    },
    /// Direct kernel boot.
    Kernel {
        /// Kernel path.
        kernel: PathBuf,
        /// Optional initrd path.
        initrd: Option<PathBuf>,
        /// Kernel command line ("" when absent).
        cmdline: String,
    },
    /// An existing disk file from the import directory, moved in as the VM's own root disk
    /// (no base, no overlay: [`crate::lifecycle`]'s `root_disk`).
    Disk {
        /// Its file name in `paths.import`.
        file: String,
        /// The size it is grown to, if larger than it is.
        disk_gib: Option<u64>,
    },
}

/// The file name (before `.FORMAT`) of an imported root disk in `STATE/disks/NAME/`, which a
/// data disk of the same VM therefore cannot have.
pub const ROOT_DISK_NAME: &str = "root";

/// A spec that passed [`validate_spec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidSpec {
    /// The spec as sent.
    pub spec: VmSpec,
    /// Its boot source.
    pub boot: BootSource,
}

/// The VM name rule, as shown in errors.
pub const NAME_RULE: &str = "^[a-z0-9][a-z0-9_-]{0,62}$";

/// True when `name` matches [`NAME_RULE`]. `_` is allowed because Security Onion names its
/// VMs `<hostname>_<role>`; a name is never a hostname as it is (see [`hostname_of`]).
pub fn is_valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'_')
}

/// True when `name` is a data disk name: 1-20 of `[a-z0-9-]`.
pub fn is_valid_disk_name(name: &str) -> bool {
    (1..=20).contains(&name.len()) && name.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

/// The rules on `spec.disks`: at most [`crate::api::disks::MAX_DATA_DISKS`], names valid and
/// unique, sizes within 1..=[`MAX_DISK_GIB`], native AIO only without the host cache.
fn validate_disks(spec: &VmSpec) -> Result<(), ApiError> {
    use crate::api::{DiskAio, DiskCache};
    let max = crate::api::disks::MAX_DATA_DISKS;
    if spec.disks.len() > max {
        return Err(ApiError::invalid("spec.disks", format!("at most {max} data disks")));
    }
    let mut seen = HashSet::new();
    for (i, disk) in spec.disks.iter().enumerate() {
        if !is_valid_disk_name(&disk.name) {
            return Err(ApiError::invalid(
                format!("spec.disks[{i}].name"),
                format!("disk name {:?} must be 1-20 characters of [a-z0-9-]", disk.name),
            ));
        }
        if !seen.insert(disk.name.as_str()) {
            return Err(ApiError::invalid(
                format!("spec.disks[{i}].name"),
                format!("disk name {:?} is listed twice", disk.name),
            ));
        }
        if disk.size_gib == 0 || disk.size_gib > MAX_DISK_GIB {
            return Err(ApiError::invalid(
                format!("spec.disks[{i}].size_gib"),
                format!("size_gib must be 1-{MAX_DISK_GIB}"),
            ));
        }
        if disk.aio == Some(DiskAio::Native) && disk.cache != DiskCache::None {
            return Err(ApiError::invalid(
                format!("spec.disks[{i}].aio"),
                "aio native needs cache none (it opens the disk with O_DIRECT)",
            ));
        }
    }
    Ok(())
}

/// Checks a spec against the rules and the host model.
///
/// # Errors
/// 2001 for a malformed spec, 3001 for sizes or hardware the host model does not have; the error
/// names the field (`spec.hardware.sfp[1]`).
pub fn validate_spec(spec: &VmSpec, config: &Config) -> Result<ValidSpec, ApiError> {
    if !is_valid_name(&spec.name) {
        return Err(ApiError::invalid("spec.name", format!("name {:?} must match {NAME_RULE}", spec.name)));
    }
    validate_user_data(spec)?;
    if let Some(role) = &spec.role {
        let ok = !role.is_empty()
            && role.len() <= 64
            && role.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !ok {
            return Err(ApiError::invalid("spec.role", "role must be 1-64 characters of [A-Za-z0-9_-]"));
        }
    }
    let hw = &config.hardware;
    if spec.cpu == 0 {
        return Err(ApiError::invalid("spec.cpu", "cpu must be at least 1"));
    }
    if spec.cpu > hw.cpu {
        return Err(ApiError::new(Code::NotInModel, format!("cpu {} is above the host's {} CPUs", spec.cpu, hw.cpu))
            .field("spec.cpu"));
    }
    if spec.memory_mib < MIN_MEMORY_MIB {
        return Err(ApiError::invalid("spec.memory_mib", format!("memory_mib must be at least {MIN_MEMORY_MIB}")));
    }
    if spec.memory_mib > hw.memory_mib {
        return Err(ApiError::new(
            Code::NotInModel,
            format!("memory_mib {} is above the host's {} MiB", spec.memory_mib, hw.memory_mib),
        )
        .field("spec.memory_mib"));
    }
    validate_placement(spec, config)?;
    for (class, indices) in spec.hardware.by_class() {
        let mut seen = HashSet::new();
        for (pos, &index) in indices.iter().enumerate() {
            let field = format!("spec.hardware.{class}[{pos}]");
            if !seen.insert(index) {
                return Err(ApiError::invalid(field, format!("{class} index {index} is listed twice")));
            }
            if hw.model.get(class, index).is_none() {
                return Err(ApiError::new(
                    Code::NotInModel,
                    format!("{class} index {index} is not in the host's hardware model"),
                )
                .field(field)
                .details(serde_json::json!({"class": class, "index": index})));
            }
        }
    }
    validate_raw_pci(spec, config)?;
    let boot = validate_boot(spec)?;
    validate_firmware(spec, config)?;
    if let BootSource::Kernel { kernel, initrd, .. } = &boot {
        check_boot_dir("spec.boot.kernel", kernel, config)?;
        if let Some(initrd) = initrd {
            check_boot_dir("spec.boot.initrd", initrd, config)?;
        }
    }
    validate_disks(spec)?;
    if matches!(boot, BootSource::Disk { .. }) {
        if let Some(i) = spec.disks.iter().position(|d| d.name == ROOT_DISK_NAME) {
            return Err(ApiError::invalid(
                format!("spec.disks[{i}].name"),
                format!("{ROOT_DISK_NAME:?} is the imported root disk's file name (boot.disk); name the data disk otherwise"),
            ));
        }
    }
    crate::nic::validate_nics(spec, config)?;
    validate_guest_interfaces(spec)?;
    validate_ssh(spec)?;
    Ok(ValidSpec { spec: spec.clone(), boot })
}

/// `cpu_policy`, `numa`, `hugepages`, `emulator_cpu` as far as the spec and config tell
/// (whether a NUMA node exists and what the nodes have left is [`crate::placement::place`]'s):
/// an emulator CPU is a dedicated VM's, hugepages must hold the memory exactly, and a dedicated
/// VM needs `[hardware] vm_cpus` with enough CPUs in it.
///
/// # Errors
/// 2001 on `spec.emulator_cpu` or `spec.memory_mib`; 3001 on `spec.cpu_policy` (no `vm_cpus`)
/// or `spec.cpu` (more CPUs than `vm_cpus` has).
fn validate_placement(spec: &VmSpec, config: &Config) -> Result<(), ApiError> {
    let dedicated = spec.cpu_policy == crate::api::CpuPolicy::Dedicated;
    if spec.emulator_cpu && !dedicated {
        return Err(ApiError::invalid(
            "spec.emulator_cpu",
            "emulator_cpu is a dedicated CPU for QEMU's own threads: only with cpu_policy dedicated",
        ));
    }
    if let Some(size) = spec.hugepages {
        let unit = size.kib() / 1024;
        if !spec.memory_mib.is_multiple_of(unit) {
            return Err(ApiError::invalid(
                "spec.memory_mib",
                format!(
                    "memory_mib {} is not a whole number of {size} hugepages (a multiple of {unit})",
                    spec.memory_mib
                ),
            ));
        }
    }
    if dedicated {
        let Some(vm_cpus) = &config.hardware.vm_cpus else {
            return Err(crate::placement::allocate::no_vm_cpus(None));
        };
        let wanted = u64::from(spec.cpu) + u64::from(spec.emulator_cpu);
        if wanted > vm_cpus.len() as u64 {
            return Err(ApiError::new(
                Code::NotInModel,
                format!(
                    "a dedicated VM of {wanted} CPUs does not fit in the host's {} vm_cpus ({vm_cpus})",
                    vm_cpus.len()
                ),
            )
            .field("spec.cpu")
            .details(serde_json::json!({ "requested": wanted, "vm_cpus": vm_cpus })));
        }
    }
    Ok(())
}

/// `user_data`: at most [`MAX_USER_DATA`] bytes, no NUL (it is a text file on the seed, and a
/// NUL would end it early for many readers).
fn validate_user_data(spec: &VmSpec) -> Result<(), ApiError> {
    let Some(text) = &spec.user_data else { return Ok(()) };
    if text.len() > MAX_USER_DATA {
        return Err(ApiError::invalid(
            "spec.user_data",
            format!("user_data is {} bytes; at most {MAX_USER_DATA} are allowed", text.len()),
        ));
    }
    if text.contains('\0') {
        return Err(ApiError::invalid("spec.user_data", "user_data contains a NUL byte"));
    }
    Ok(())
}

fn validate_raw_pci(spec: &VmSpec, config: &Config) -> Result<(), ApiError> {
    if spec.pci.is_empty() {
        return Ok(());
    }
    if !config.hardware.allow_raw_pci {
        return Err(ApiError::invalid(
            "spec.pci",
            "devices by PCI address need allow_raw_pci = true in the host config; use hardware indices",
        ));
    }
    let mut seen = HashSet::new();
    let requested: HashSet<PciAddress> = spec
        .hardware
        .by_class()
        .iter()
        .flat_map(|(c, idx)| idx.iter().filter_map(|i| config.hardware.model.get(*c, *i)))
        .collect();
    for (pos, text) in spec.pci.iter().enumerate() {
        let field = format!("spec.pci[{pos}]");
        let addr = PciAddress::parse(text).map_err(|m| ApiError::invalid(&field, m))?;
        if !seen.insert(addr) || requested.contains(&addr) {
            return Err(ApiError::invalid(field, format!("{addr} is requested twice")));
        }
    }
    Ok(())
}

/// Every PCI device a spec asks for (model indices resolved, then raw addresses), in order,
/// with the request field each came from. Unknown indices and malformed addresses are skipped:
/// validation reports them.
pub fn requested_devices_with_fields(spec: &VmSpec, hw: &crate::config::Hardware) -> Vec<(PciAddress, String)> {
    let mut out = Vec::new();
    for (class, indices) in spec.hardware.by_class() {
        for (pos, index) in indices.iter().enumerate() {
            if let Some(addr) = hw.model.get(class, *index) {
                out.push((addr, format!("spec.hardware.{class}[{pos}]")));
            }
        }
    }
    for (pos, text) in spec.pci.iter().enumerate() {
        if let Ok(addr) = PciAddress::parse(text) {
            out.push((addr, format!("spec.pci[{pos}]")));
        }
    }
    out
}

/// [`requested_devices_with_fields`] without the fields.
pub fn requested_devices(spec: &VmSpec, hw: &crate::config::Hardware) -> Vec<PciAddress> {
    requested_devices_with_fields(spec, hw).into_iter().map(|(addr, _)| addr).collect()
}

/// Most `guest_interfaces` one spec may declare: the guest agent's own limit
/// (`guest-agent/src/apply.rs`, `MAX_INTERFACES`), so a spec the daemon records is one the agent
/// can apply, and a record cannot grow without bound.
pub const MAX_GUEST_INTERFACES: usize = 64;

/// Longest interface name the kernel accepts, in bytes (IFNAMSIZ - 1).
pub const MAX_IFNAME: usize = 15;

/// Why `link` cannot name the guest interface a VLAN sits on, if it cannot: the guest agent's
/// rules for an interface name (`name_problem` in guest-agent/src/apply.rs, which are the
/// kernel's: 1-15 bytes, not `.` or `..`, no `/`, `:`, `%`, NUL or whitespace), plus no control
/// character (guest text is shown in logs and tables) and not `lo`, which the agent refuses as a
/// VLAN's link.
fn link_problem(link: &str) -> Option<&'static str> {
    if link.is_empty() {
        Some("is empty")
    } else if link.len() > MAX_IFNAME {
        Some("is longer than 15 bytes")
    } else if link == "." || link == ".." || link == "lo" {
        Some("is reserved")
    } else if link.contains(['/', ':', '%']) || link.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("contains '/', ':', '%', whitespace or a control character")
    } else {
        None
    }
}

/// Guest interfaces: at most [`MAX_GUEST_INTERFACES`]; names 1-15 of `[A-Za-z0-9._-]`, unique;
/// a VLAN has a link (see [`link_problem`]) and an id 1-4094; addresses `a.b.c.d/p`. The agent
/// checks again (it never trusts the host either).
fn validate_guest_interfaces(spec: &VmSpec) -> Result<(), ApiError> {
    if spec.guest_interfaces.len() > MAX_GUEST_INTERFACES {
        return Err(ApiError::invalid(
            "spec.guest_interfaces",
            format!("{} interfaces; at most {MAX_GUEST_INTERFACES} are allowed", spec.guest_interfaces.len()),
        ));
    }
    let mut names = HashSet::new();
    let mut vlans = HashSet::new();
    for (i, g) in spec.guest_interfaces.iter().enumerate() {
        let f = |k: &str| format!("spec.guest_interfaces[{i}].{k}");
        let name_ok = !g.name.is_empty()
            && g.name.len() <= MAX_IFNAME
            && g.name != "lo"
            && g.name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
        if !name_ok || !names.insert(g.name.clone()) {
            return Err(ApiError::invalid(f("name"), format!("{:?} is not a usable, unique interface name", g.name)));
        }
        match (&g.link, g.vlan_id) {
            (Some(link), Some(v)) => {
                if let Some(problem) = link_problem(link) {
                    // Debug formatting: the refused text may hold control characters.
                    return Err(ApiError::invalid(f("link"), format!("interface name {link:?} {problem}")));
                }
                if !(1..=4094).contains(&v) {
                    return Err(ApiError::invalid(f("vlan_id"), format!("VLAN {v} is outside 1-4094")));
                }
                if !vlans.insert((link.clone(), v)) {
                    return Err(ApiError::invalid(f("vlan_id"), format!("VLAN {v} on {link} is declared twice")));
                }
            }
            (None, None) => {}
            (Some(_), None) => return Err(ApiError::invalid(f("vlan_id"), "a link needs a vlan_id")),
            (None, Some(_)) => return Err(ApiError::invalid(f("link"), "a vlan_id needs a link")),
        }
        crate::ipv4::Ipv4Cidr::parse(&g.address).map_err(|m| ApiError::invalid(f("address"), m))?;
    }
    Ok(())
}

pub use vmhost_agent_protocol::exec::{ssh_user_problem, MAX_SSH_KEYS, MAX_SSH_KEY_LINE, SSH_KEY_TYPES};

/// Why `line` cannot be a line of `ssh.keys`, if it cannot: one line of at most
/// [`MAX_SSH_KEY_LINE`] bytes, printable (no control character: it is written into
/// `authorized_keys` and shown in logs), `TYPE BASE64 [COMMENT]` with TYPE one of
/// [`SSH_KEY_TYPES`]. Starting with the type leaves no room for `authorized_keys` options
/// (`command=`, `from=`, ...).
fn ssh_key_problem(line: &str) -> Option<String> {
    if line.len() > MAX_SSH_KEY_LINE {
        return Some(format!("is {} bytes; at most {MAX_SSH_KEY_LINE} are allowed", line.len()));
    }
    if line.chars().any(char::is_control) {
        return Some("contains a line break or another control character".into());
    }
    let mut words = line.split(' ');
    let kind = words.next().unwrap_or_default();
    if !SSH_KEY_TYPES.contains(&kind) {
        return Some(format!("does not start with a key type ({})", SSH_KEY_TYPES.join(", ")));
    }
    let blob = words.next().unwrap_or_default();
    let base64 = |c: char| c.is_ascii_alphanumeric() || "+/=".contains(c);
    if blob.len() < 16 || !blob.chars().all(base64) {
        return Some(format!("has no base64 key after {kind:?}"));
    }
    None
}

/// `ssh`: `user` per [`ssh_user_problem`], 1 to [`MAX_SSH_KEYS`] keys, each per
/// [`ssh_key_problem`]. The guest's exec server checks again.
fn validate_ssh(spec: &VmSpec) -> Result<(), ApiError> {
    let Some(ssh) = &spec.ssh else { return Ok(()) };
    if let Some(problem) = ssh_user_problem(&ssh.user) {
        return Err(ApiError::invalid("spec.ssh.user", format!("user name {:?} {problem}", ssh.user)));
    }
    if ssh.keys.is_empty() || ssh.keys.len() > MAX_SSH_KEYS {
        return Err(ApiError::invalid(
            "spec.ssh.keys",
            format!("{} keys; 1 to {MAX_SSH_KEYS} are allowed", ssh.keys.len()),
        ));
    }
    for (i, key) in ssh.keys.iter().enumerate() {
        if let Some(problem) = ssh_key_problem(key) {
            // The key itself is not repeated: it may be long, and the field names it.
            return Err(ApiError::invalid(format!("spec.ssh.keys[{i}]"), format!("the key {problem}")));
        }
    }
    Ok(())
}

fn validate_boot(spec: &VmSpec) -> Result<BootSource, ApiError> {
    let b = &spec.boot;
    if let Some(disk) = &b.disk {
        return validate_boot_disk(b, disk);
    }
    match (&b.image, &b.kernel) {
        (Some(_), Some(_)) => Err(ApiError::invalid("spec.boot", "give either boot.image or boot.kernel, not both")),
        (None, None) => Err(ApiError::invalid("spec.boot", "boot needs image (with disk_gib), kernel or disk")),
        (Some(image), None) => {
            for (field, set) in [("spec.boot.initrd", b.initrd.is_some()), ("spec.boot.cmdline", b.cmdline.is_some())] {
                if set {
                    return Err(ApiError::invalid(field, "only valid with boot.kernel"));
                }
            }
            if !is_plain_file_name(image) {
                return Err(ApiError::invalid(
                    "spec.boot.image",
                    format!("{image:?} must be a file name in the image directory (no path, no leading dot)"),
                ));
            }
            let disk_gib =
                b.disk_gib.ok_or_else(|| ApiError::invalid("spec.boot.disk_gib", "required with boot.image"))?;
            if disk_gib == 0 || disk_gib > MAX_DISK_GIB {
                return Err(ApiError::invalid("spec.boot.disk_gib", format!("must be 1..={MAX_DISK_GIB}")));
            }
            Ok(BootSource::Image { image: image.clone(), disk_gib })
        }
        (None, Some(kernel)) => {
            if b.disk_gib.is_some() {
                return Err(ApiError::invalid("spec.boot.disk_gib", "only valid with boot.image"));
            }
            check_abs_path("spec.boot.kernel", kernel)?;
            if let Some(initrd) = &b.initrd {
                check_abs_path("spec.boot.initrd", initrd)?;
            }
            let cmdline = b.cmdline.clone().unwrap_or_default();
            if cmdline.len() > MAX_CMDLINE {
                return Err(ApiError::invalid("spec.boot.cmdline", format!("longer than {MAX_CMDLINE} bytes")));
            }
            if cmdline.chars().any(|c| c.is_control()) {
                return Err(ApiError::invalid("spec.boot.cmdline", "contains control characters"));
            }
            Ok(BootSource::Kernel { kernel: kernel.clone(), initrd: b.initrd.clone(), cmdline })
        }
    }
}

/// `boot.firmware`: any firmware goes with any boot source (OVMF starts a direct kernel
/// through its EFI stub, and an image or imported disk through its boot loader). UEFI needs a
/// machine type with flash devices for OVMF's code and variables (`pflash0`, `pflash1`): `pc`
/// and `q35` and their versioned names, not `microvm` or `isapc`.
fn validate_firmware(spec: &VmSpec, config: &Config) -> Result<(), ApiError> {
    validate_secure_boot(spec, config)?;
    if spec.boot.firmware != crate::api::Firmware::Uefi || has_pflash(&config.qemu.machine) {
        return Ok(());
    }
    Err(ApiError::invalid(
        "spec.boot.firmware",
        format!(
            "uefi needs a pc or q35 machine type (flash devices for OVMF); this host's qemu.machine is {:?}",
            config.qemu.machine
        ),
    ))
}

/// `boot.secure_boot`: OVMF's Secure Boot build needs UEFI and SMM, which OVMF supports only on
/// q35 (`q35` or a versioned `pc-q35-*`): on i440fx (`pc`) its SMM build stops at start.
fn validate_secure_boot(spec: &VmSpec, config: &Config) -> Result<(), ApiError> {
    if !spec.boot.secure_boot {
        return Ok(());
    }
    if spec.boot.firmware != crate::api::Firmware::Uefi {
        return Err(ApiError::invalid("spec.boot.secure_boot", "needs boot.firmware uefi (Secure Boot is OVMF's)"));
    }
    if !is_q35(&config.qemu.machine) {
        return Err(ApiError::invalid(
            "spec.boot.secure_boot",
            format!(
                "needs a q35 machine type (SMM for OVMF's Secure Boot build); this host's qemu.machine is {:?}",
                config.qemu.machine
            ),
        ));
    }
    Ok(())
}

/// True for the q35 machine types: `q35` and the versioned `pc-q35-*`.
pub fn is_q35(machine: &str) -> bool {
    machine == "q35" || machine.starts_with("pc-q35-")
}

/// True for the machine types that have the `pflash0`/`pflash1` properties: `pc`, `q35` and
/// the versioned `pc-i440fx-*` and `pc-q35-*`.
pub fn has_pflash(machine: &str) -> bool {
    machine == "pc" || machine == "q35" || machine.starts_with("pc-")
}

/// `boot.disk`: a plain file name (as `boot.image`), alone (no image, kernel, initrd or
/// command line), with an optional `disk_gib` in 1..=[`MAX_DISK_GIB`]. Whether the file exists,
/// its format and its size are the lifecycle's checks (not pure).
fn validate_boot_disk(b: &crate::api::BootSpec, disk: &str) -> Result<BootSource, ApiError> {
    if b.image.is_some() || b.kernel.is_some() {
        return Err(ApiError::invalid(
            "spec.boot.disk",
            "give one of boot.image, boot.kernel and boot.disk: boot.disk is the VM's whole root disk",
        ));
    }
    for (field, set) in [("spec.boot.initrd", b.initrd.is_some()), ("spec.boot.cmdline", b.cmdline.is_some())] {
        if set {
            return Err(ApiError::invalid(field, "only valid with boot.kernel"));
        }
    }
    if !is_plain_file_name(disk) {
        return Err(ApiError::invalid(
            "spec.boot.disk",
            format!("{disk:?} must be a file name in the import directory (no path, no leading dot)"),
        ));
    }
    if let Some(gib) = b.disk_gib {
        if gib == 0 || gib > MAX_DISK_GIB {
            return Err(ApiError::invalid("spec.boot.disk_gib", format!("must be 1..={MAX_DISK_GIB}")));
        }
    }
    Ok(BootSource::Disk { file: disk.to_string(), disk_gib: b.disk_gib })
}

/// A single path component that cannot escape its directory or hide.
pub(crate) fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-+".contains(c))
}

/// A kernel or initrd must be in one of the boot directories (`paths.boot`): a lexical check,
/// before any file is touched, so that vmhostd does not tell a client whether a file elsewhere
/// exists. The open beneath that directory ([`crate::qemu::boot_files::open_under`]) refuses a
/// symlink that leads out of it.
fn check_boot_dir(field: &str, p: &Path, config: &Config) -> Result<(), ApiError> {
    let dirs = config.paths.boot_dirs();
    if crate::qemu::boot_files::boot_dir_of(&dirs, p).is_some() {
        return Ok(());
    }
    let listed: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    Err(ApiError::invalid(
        field,
        format!("{:?} is not in a boot directory (paths.boot: {})", p.display().to_string(), listed.join(", ")),
    ))
}

fn check_abs_path(field: &str, p: &Path) -> Result<(), ApiError> {
    let text = p.to_string_lossy();
    if !p.is_absolute() {
        return Err(ApiError::invalid(field, format!("{text:?} is not an absolute path")));
    }
    // Path::components() silently drops interior "." components, so look at the text itself.
    if text.split('/').any(|c| c == "." || c == "..") {
        return Err(ApiError::invalid(field, format!("{text:?} must not contain . or .. components")));
    }
    // QEMU takes these as plain arguments, but a comma or control character in a path is never
    // intended and would break any later option-list use.
    if text.chars().any(|c| c.is_control() || c == ',') {
        return Err(ApiError::invalid(field, format!("{text:?} contains a comma or control character")));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::api::{BootSpec, DesiredState, HardwareRequest};
    use std::path::Path;

    pub(crate) fn config() -> Config {
        Config::parse(
            r#"
[paths]
boot = ["/boot", "/var/lib/vmhost/images"]
[qemu]
accel = "tcg"
[hardware]
cpu = 8
memory_gib = 16
reserved_cpu = 2
reserved_memory_gib = 4
[hardware.disk]
1 = "0000:c7:00.0"
2 = "0000:c7:00.1"
[hardware.copper]
1 = "0000:c8:00.0"
2 = "0000:c8:00.1"
[hardware.sfp]
5 = "0000:ca:00.0"
6 = "0000:ca:00.1"
"#,
            Path::new("test.toml"),
        )
        .unwrap()
    }

    /// A data disk of the unit tests: no preallocation, no cache, not kept.
    pub(crate) fn data_disk(name: &str, size_gib: u64, format: crate::api::DiskFormat) -> crate::api::DataDiskSpec {
        crate::api::DataDiskSpec {
            name: name.into(),
            size_gib,
            format,
            preallocate: false,
            cache: crate::api::DiskCache::None,
            aio: None,
            keep_on_destroy: false,
            snapshot: true,
        }
    }

    pub(crate) fn spec(name: &str) -> VmSpec {
        VmSpec {
            name: name.into(),
            role: None,
            cpu: 1,
            memory_mib: 256,
            state: DesiredState::Running,
            hardware: HardwareRequest::default(),
            pci: Vec::new(),
            disks: Vec::new(),
            nics: Vec::new(),
            guest_interfaces: Vec::new(),
            restart_policy: Default::default(),
            user_data: None,
            ssh: None,
            guest_exec: true,
            cpu_policy: Default::default(),
            numa: None,
            hugepages: None,
            emulator_cpu: false,
            tpm: false,
            boot: BootSpec {
                kernel: Some("/boot/vmlinuz".into()),
                cmdline: Some("console=ttyS0".into()),
                ..BootSpec::default()
            },
        }
    }

    /// A NIC on `network` with a static address and nothing else.
    pub(crate) fn static_nic(network: &str, address: &str) -> crate::api::NicSpec {
        crate::api::NicSpec {
            network: network.into(),
            vlan: None,
            mac: None,
            ipv4: Some(crate::api::Ipv4Spec::Static {
                address: address.into(),
                gateway: None,
                dns: vec![],
                search: vec![],
            }),
            queues: 1,
            ..Default::default()
        }
    }

    fn err(s: &VmSpec) -> (i32, String) {
        let e = validate_spec(s, &config()).unwrap_err();
        (e.code.as_i32(), e.field.unwrap_or_default())
    }

    #[test]
    fn good_kernel_and_image_specs_pass() {
        let v = validate_spec(&spec("vm-1"), &config()).unwrap();
        assert!(matches!(v.boot, BootSource::Kernel { ref cmdline, .. } if cmdline == "console=ttyS0"));
        let mut s = spec("vm-2");
        s.boot = BootSpec { image: Some("debian-12.qcow2".into()), disk_gib: Some(20), ..BootSpec::default() };
        s.hardware = HardwareRequest { disk: vec![1, 2], copper: vec![1], sfp: vec![5] };
        let v = validate_spec(&s, &config()).unwrap();
        assert_eq!(v.boot, BootSource::Image { image: "debian-12.qcow2".into(), disk_gib: 20 });
    }

    #[test]
    fn names() {
        // Security Onion's `<hostname>_<role>` names are valid.
        for good in
            ["a", "0", "vm-1", "sensor1_sensor", "a_", "0_b-c", &"a".repeat(63), &format!("a{}", "_".repeat(62))]
        {
            assert!(is_valid_name(good), "{good}");
            assert!(validate_spec(&spec(good), &config()).is_ok(), "{good}");
        }
        for bad in
            ["", "-a", "_x", "_", "A", "Sensor", "sensor1_Sensor", "a.b", "é", &"a".repeat(64), "a b", "a/b", "a\0"]
        {
            assert!(!is_valid_name(bad), "{bad:?}");
            let e = validate_spec(&spec(bad), &config()).unwrap_err();
            assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("spec.name")), "{bad:?}");
            assert!(e.message.contains("[a-z0-9_-]"), "{}", e.message);
        }
    }

    #[test]
    fn hostnames_have_no_underscore() {
        assert_eq!(hostname_of("sensor1_sensor"), "sensor1-sensor");
        assert_eq!(hostname_of("a_b_c"), "a-b-c");
        assert_eq!(hostname_of("web-1"), "web-1");
    }

    #[test]
    fn user_data_is_at_most_64_kib_without_nul() {
        let mut s = spec("a");
        s.user_data = Some("#cloud-config\n".into());
        assert!(validate_spec(&s, &config()).is_ok());
        s.user_data = Some(String::new());
        assert!(validate_spec(&s, &config()).is_ok(), "empty is allowed (an empty user-data file)");
        s.user_data = Some("x".repeat(MAX_USER_DATA));
        assert_eq!(MAX_USER_DATA, 65536);
        assert!(validate_spec(&s, &config()).is_ok());
        s.user_data = Some("x".repeat(MAX_USER_DATA + 1));
        assert_eq!(err(&s), (2001, "spec.user_data".into()));
        // Bytes, not characters: 32768 two-byte characters are 65536 bytes.
        s.user_data = Some("é".repeat(MAX_USER_DATA / 2));
        assert!(validate_spec(&s, &config()).is_ok());
        s.user_data = Some(format!("{}x", "é".repeat(MAX_USER_DATA / 2)));
        assert_eq!(err(&s), (2001, "spec.user_data".into()));
        s.user_data = Some("#cloud-config\n\0runcmd: []\n".into());
        assert_eq!(err(&s), (2001, "spec.user_data".into()));
        // Also with an image boot, and not serialized when absent.
        s.user_data = None;
        assert!(!serde_json::to_string(&s).unwrap().contains("user_data"));
        let parsed: VmSpec = serde_json::from_value(serde_json::json!({
            "name": "a", "cpu": 1, "memory_mib": 256, "boot": {"kernel": "/boot/vmlinuz"}, "user_data": "x"
        }))
        .unwrap();
        assert_eq!(parsed.user_data.as_deref(), Some("x"));
    }

    #[test]
    fn sizes() {
        let mut s = spec("a");
        s.cpu = 0;
        assert_eq!(err(&s), (2001, "spec.cpu".into()));
        s.cpu = 9;
        assert_eq!(err(&s), (3001, "spec.cpu".into()));
        s.cpu = 8; // the whole host is in the model even if reserved: capacity refuses it later
        assert!(validate_spec(&s, &config()).is_ok());
        s.memory_mib = 31;
        assert_eq!(err(&s), (2001, "spec.memory_mib".into()));
        s.memory_mib = 16 * 1024 + 1;
        assert_eq!(err(&s), (3001, "spec.memory_mib".into()));
    }

    #[test]
    fn placement_fields() {
        use crate::api::{CpuPolicy, HugePageSize};
        let pinned = {
            let mut c = config();
            c.hardware.vm_cpus = Some(crate::placement::CpuSet::parse("2-5").unwrap());
            c
        };
        let mut s = spec("a");
        s.emulator_cpu = true;
        assert_eq!(err_with(&s, &pinned), (2001, "spec.emulator_cpu".into()));
        s.cpu_policy = CpuPolicy::Dedicated;
        assert!(validate_spec(&s, &pinned).is_ok());
        assert_eq!(err(&s), (3001, "spec.cpu_policy".into()), "no vm_cpus");
        s.cpu = 4;
        assert_eq!(err_with(&s, &pinned), (3001, "spec.cpu".into()), "4 + the emulator CPU > 4 vm_cpus");
        s.emulator_cpu = false;
        assert!(validate_spec(&s, &pinned).is_ok());
        let mut s = spec("a");
        for (size, good, bad) in [(HugePageSize::M2, 258, 257), (HugePageSize::G1, 2048, 1536)] {
            s.hugepages = Some(size);
            s.memory_mib = good;
            assert!(validate_spec(&s, &config()).is_ok(), "{size} {good}");
            s.memory_mib = bad;
            assert_eq!(err(&s), (2001, "spec.memory_mib".into()), "{size} {bad}");
        }
    }

    #[test]
    fn hardware_indices() {
        let mut s = spec("a");
        s.hardware.sfp = vec![5, 7];
        assert_eq!(err(&s), (3001, "spec.hardware.sfp[1]".into()));
        s.hardware.sfp = vec![5, 5];
        assert_eq!(err(&s), (2001, "spec.hardware.sfp[1]".into()));
        s.hardware.sfp = vec![];
        s.hardware.copper = vec![5]; // index 5 exists, but in class sfp
        assert_eq!(err(&s), (3001, "spec.hardware.copper[0]".into()));
        s.hardware.copper = vec![];
        s.hardware.disk = vec![0];
        assert_eq!(err(&s), (3001, "spec.hardware.disk[0]".into()));
    }

    #[test]
    fn boot_mixes() {
        let mut s = spec("a");
        s.boot.image = Some("x.qcow2".into());
        assert_eq!(err(&s), (2001, "spec.boot".into()));
        s.boot = BootSpec::default();
        assert_eq!(err(&s), (2001, "spec.boot".into()));
        s.boot = BootSpec { image: Some("x.qcow2".into()), ..BootSpec::default() };
        assert_eq!(err(&s), (2001, "spec.boot.disk_gib".into()));
        s.boot.disk_gib = Some(0);
        assert_eq!(err(&s), (2001, "spec.boot.disk_gib".into()));
        s.boot.disk_gib = Some(MAX_DISK_GIB + 1);
        assert_eq!(err(&s), (2001, "spec.boot.disk_gib".into()));
        s.boot.disk_gib = Some(1);
        s.boot.cmdline = Some("x".into());
        assert_eq!(err(&s), (2001, "spec.boot.cmdline".into()));
        s.boot.cmdline = None;
        s.boot.initrd = Some("/i".into());
        assert_eq!(err(&s), (2001, "spec.boot.initrd".into()));
        for bad in ["../x", "/etc/passwd", ".hidden", "a/b", "", "a b", "a,b"] {
            let mut s = spec("a");
            s.boot = BootSpec { image: Some(bad.into()), disk_gib: Some(1), ..BootSpec::default() };
            assert_eq!(err(&s), (2001, "spec.boot.image".into()), "{bad}");
        }
    }

    #[test]
    fn boot_disks_are_plain_names_alone_with_an_optional_size() {
        let disk = |name: &str| BootSpec { disk: Some(name.into()), ..BootSpec::default() };
        let mut s = spec("a");
        s.boot = disk("vm.qcow2");
        assert_eq!(
            validate_spec(&s, &config()).unwrap().boot,
            BootSource::Disk { file: "vm.qcow2".into(), disk_gib: None }
        );
        s.boot.disk_gib = Some(40);
        assert_eq!(
            validate_spec(&s, &config()).unwrap().boot,
            BootSource::Disk { file: "vm.qcow2".into(), disk_gib: Some(40) }
        );
        // Exclusive with the other boot sources, named on boot.disk.
        let cases: [(BootSpec, &str); 6] = [
            (BootSpec { image: Some("b.qcow2".into()), disk_gib: Some(1), ..disk("vm.qcow2") }, "spec.boot.disk"),
            (BootSpec { kernel: Some("/boot/vmlinuz".into()), ..disk("vm.qcow2") }, "spec.boot.disk"),
            (BootSpec { initrd: Some("/boot/initrd".into()), ..disk("vm.qcow2") }, "spec.boot.initrd"),
            (BootSpec { cmdline: Some("quiet".into()), ..disk("vm.qcow2") }, "spec.boot.cmdline"),
            (BootSpec { disk_gib: Some(0), ..disk("vm.qcow2") }, "spec.boot.disk_gib"),
            (BootSpec { disk_gib: Some(MAX_DISK_GIB + 1), ..disk("vm.qcow2") }, "spec.boot.disk_gib"),
        ];
        for (boot, field) in cases {
            s.boot = boot.clone();
            assert_eq!(err(&s), (2001, field.into()), "{boot:?}");
        }
        // The same name rules as boot.image: one component inside the import directory.
        for bad in ["../x", "/var/lib/libvirt/images/vm.qcow2", ".hidden", "a/b", "", "a b", "a,b", ".."] {
            s.boot = disk(bad);
            assert_eq!(err(&s), (2001, "spec.boot.disk".into()), "{bad}");
        }
        // A data disk cannot take the root disk's file name.
        s.boot = disk("vm.qcow2");
        s.disks = vec![crate::api::DataDiskSpec {
            name: ROOT_DISK_NAME.into(),
            size_gib: 1,
            format: Default::default(),
            preallocate: false,
            cache: Default::default(),
            aio: None,
            keep_on_destroy: false,
            snapshot: true,
        }];
        assert_eq!(err(&s), (2001, "spec.disks[0].name".into()));
        s.boot = BootSpec { image: Some("b.qcow2".into()), disk_gib: Some(1), ..BootSpec::default() };
        assert!(validate_spec(&s, &config()).is_ok(), "\"root\" is a fine data disk name otherwise");
    }

    #[test]
    fn uefi_goes_with_every_boot_source_on_pc_and_q35_only() {
        use crate::api::Firmware;
        let image = BootSpec { image: Some("base.qcow2".into()), disk_gib: Some(4), ..BootSpec::default() };
        let disk = BootSpec { disk: Some("old.qcow2".into()), ..BootSpec::default() };
        let mut c = config();
        for boot in [spec("a").boot, image, disk] {
            let mut s = spec("a");
            s.boot = BootSpec { firmware: Firmware::Uefi, ..boot };
            for machine in ["q35", "pc", "pc-q35-7.2", "pc-i440fx-7.2"] {
                c.qemu.machine = machine.into();
                let v = validate_spec(&s, &c).unwrap();
                assert_eq!(v.spec.boot.firmware, Firmware::Uefi, "{machine}");
            }
            for machine in ["microvm", "isapc", "none"] {
                c.qemu.machine = machine.into();
                let e = validate_spec(&s, &c).unwrap_err();
                assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("spec.boot.firmware")), "{machine}");
                assert!(e.message.contains(machine), "{}", e.message);
                // BIOS runs on any machine type.
                s.boot.firmware = Firmware::Bios;
                assert!(validate_spec(&s, &c).is_ok(), "{machine}");
                s.boot.firmware = Firmware::Uefi;
            }
        }
    }

    #[test]
    fn secure_boot_needs_uefi_on_a_q35_machine() {
        use crate::api::Firmware;
        let mut c = config();
        let mut s = spec("a");
        s.boot.secure_boot = true;
        for firmware in [Firmware::Bios, Firmware::Uefi] {
            s.boot.firmware = firmware;
            for machine in ["q35", "pc-q35-7.2", "pc", "pc-i440fx-7.2", "microvm"] {
                c.qemu.machine = machine.into();
                let got = validate_spec(&s, &c);
                if firmware == Firmware::Uefi && machine.contains("q35") {
                    assert!(got.unwrap().spec.boot.secure_boot, "{machine}");
                    continue;
                }
                let e = got.unwrap_err();
                assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("spec.boot.secure_boot")), "{machine}");
                let why = if firmware == Firmware::Bios { "boot.firmware uefi" } else { machine };
                assert!(e.message.contains(why), "{machine}: {}", e.message);
            }
        }
        // Off, it asks nothing (and is left out of the spec as served).
        s.boot.secure_boot = false;
        s.boot.firmware = Firmware::Bios;
        c.qemu.machine = "pc".into();
        assert!(validate_spec(&s, &c).is_ok());
        assert!(serde_json::to_value(&s.boot).unwrap().get("secure_boot").is_none());
        let on: crate::api::BootSpec = serde_json::from_value(serde_json::json!({"secure_boot": true})).unwrap();
        assert!(on.secure_boot);
    }

    #[test]
    fn kernel_paths() {
        let cases: &[(&str, Option<&str>, &str)] = &[
            ("vmlinuz", None, "spec.boot.kernel"),
            ("/boot/../etc/shadow", None, "spec.boot.kernel"),
            ("/boot/./vmlinuz", None, "spec.boot.kernel"),
            ("/boot/a,b", None, "spec.boot.kernel"),
            ("/boot/vmlinuz", Some("initrd.img"), "spec.boot.initrd"),
        ];
        for (kernel, initrd, field) in cases {
            let mut s = spec("a");
            s.boot.kernel = Some(kernel.into());
            s.boot.initrd = initrd.map(Into::into);
            assert_eq!(err(&s), (2001, field.to_string()), "{kernel}");
        }
        let mut s = spec("a");
        s.boot.disk_gib = Some(3);
        assert_eq!(err(&s), (2001, "spec.boot.disk_gib".into()));
        s.boot.disk_gib = None;
        s.boot.cmdline = Some("a\nb".into());
        assert_eq!(err(&s), (2001, "spec.boot.cmdline".into()));
        s.boot.cmdline = Some("x".repeat(MAX_CMDLINE + 1));
        assert_eq!(err(&s), (2001, "spec.boot.cmdline".into()));
    }

    #[test]
    fn kernels_and_initrds_must_be_in_a_boot_directory() {
        for (kernel, initrd, field) in [
            ("/etc/shadow", None, "spec.boot.kernel"),
            ("/bootx/vmlinuz", None, "spec.boot.kernel"),
            ("/boot", None, "spec.boot.kernel"),
            ("/boot/vmlinuz", Some("/root/initrd.img"), "spec.boot.initrd"),
            ("/boot/vmlinuz", Some("/var/lib/vmhost/imagesx/i"), "spec.boot.initrd"),
        ] {
            let mut s = spec("a");
            s.boot.kernel = Some(kernel.into());
            s.boot.initrd = initrd.map(Into::into);
            let e = validate_spec(&s, &config()).unwrap_err();
            assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some(field)), "{kernel} {initrd:?}");
            assert!(e.message.contains("paths.boot"), "{}", e.message);
        }
        let mut s = spec("a");
        s.boot.kernel = Some("/boot/sub/vmlinuz".into());
        s.boot.initrd = Some("/var/lib/vmhost/images/initrd.img".into());
        assert!(validate_spec(&s, &config()).is_ok());
        // Without paths.boot: the images directory and /var/lib/vmhost/boot.
        let mut c = config();
        c.paths.boot = None;
        assert_eq!(err_with(&s, &c), (2001, "spec.boot.kernel".into()));
        s.boot.kernel = Some("/var/lib/vmhost/boot/vmlinuz".into());
        assert!(validate_spec(&s, &c).is_ok());
    }

    fn err_with(s: &VmSpec, c: &Config) -> (i32, String) {
        let e = validate_spec(s, c).unwrap_err();
        (e.code.as_i32(), e.field.unwrap_or_default())
    }

    #[test]
    fn raw_pci_needs_the_host_switch_and_valid_addresses() {
        let mut s = spec("a");
        s.pci = vec!["0000:d0:00.0".into()];
        assert_eq!(err(&s), (2001, "spec.pci".into()));
        let mut c = config();
        c.hardware.allow_raw_pci = true;
        assert!(validate_spec(&s, &c).is_ok());
        s.pci = vec!["pci_0000_d0_00_0".into(), "d0:00.0".into()];
        let e = validate_spec(&s, &c).unwrap_err();
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("spec.pci[1]")));
        s.pci = vec!["zz".into()];
        assert_eq!(validate_spec(&s, &c).unwrap_err().field.as_deref(), Some("spec.pci[0]"));
        // The same device by index and by address.
        s.pci = vec!["0000:ca:00.0".into()];
        s.hardware.sfp = vec![5];
        assert_eq!(validate_spec(&s, &c).unwrap_err().field.as_deref(), Some("spec.pci[0]"));
        s.hardware.sfp = vec![];
        assert_eq!(requested_devices(&s, &c.hardware), vec![PciAddress::parse("0000:ca:00.0").unwrap()]);
    }

    fn vlan(name: &str, link: &str, vlan_id: u16) -> vmhost_agent_protocol::DesiredInterface<u16> {
        vmhost_agent_protocol::DesiredInterface {
            name: name.into(),
            link: Some(link.into()),
            vlan_id: Some(vlan_id),
            address: format!("10.0.{vlan_id}.2/24"),
        }
    }

    #[test]
    fn guest_interface_links_follow_the_agents_name_rules() {
        let mut s = spec("a");
        s.guest_interfaces = vec![vlan("v1", "eth0", 1), vlan("v2", "enp0s3.x-y_1", 2), vlan("v3", &"e".repeat(15), 3)];
        assert!(validate_spec(&s, &config()).is_ok());
        let long = "e".repeat(16);
        let bad = ["", &long, "lo", ".", "..", "eth/0", "eth:0", "eth%d", "eth 0", "eth\n0", "e\u{1b}[2J", "eth0\0"];
        for link in bad {
            s.guest_interfaces = vec![vlan("v1", "eth0", 1), vlan("v2", "eth0", 2), vlan("v3", link, 3)];
            let e = validate_spec(&s, &config()).unwrap_err();
            assert_eq!(
                (e.code.as_i32(), e.field.as_deref()),
                (2001, Some("spec.guest_interfaces[2].link")),
                "{link:?}"
            );
            assert!(!e.message.contains('\u{1b}') && !e.message.contains('\n'), "{}", e.message);
        }
    }

    #[test]
    fn guest_interfaces_are_at_most_64() {
        let mut s = spec("a");
        s.guest_interfaces = (1..=MAX_GUEST_INTERFACES as u16).map(|v| vlan(&format!("v{v}"), "eth0", v)).collect();
        assert!(validate_spec(&s, &config()).is_ok());
        s.guest_interfaces.push(vlan("v65", "eth0", 65));
        let e = validate_spec(&s, &config()).unwrap_err();
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("spec.guest_interfaces")));
    }

    const ED25519: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA ops@example";

    fn with_ssh(user: &str, keys: &[&str]) -> VmSpec {
        let mut s = spec("a");
        s.ssh = Some(crate::api::SshSpec { user: user.into(), keys: keys.iter().map(|k| k.to_string()).collect() });
        s
    }

    #[test]
    fn ssh_users_follow_the_useradd_rule() {
        for good in ["vmhost", "_svc", "a", "ops-1_x", &"u".repeat(32)] {
            assert!(validate_spec(&with_ssh(good, &[ED25519]), &config()).is_ok(), "{good}");
        }
        for bad in ["", "Root", "1ops", "-x", "a b", "a.b", "a$", "ü", "a/b", &"u".repeat(33), "a\n"] {
            assert_eq!(err(&with_ssh(bad, &[ED25519])), (2001, "spec.ssh.user".into()), "{bad:?}");
        }
    }

    #[test]
    fn ssh_keys_are_one_to_sixteen_public_key_lines() {
        assert_eq!(err(&with_ssh("vmhost", &[])), (2001, "spec.ssh.keys".into()));
        let many = vec![ED25519; MAX_SSH_KEYS];
        assert!(validate_spec(&with_ssh("vmhost", &many), &config()).is_ok());
        let too_many = vec![ED25519; MAX_SSH_KEYS + 1];
        assert_eq!(err(&with_ssh("vmhost", &too_many)), (2001, "spec.ssh.keys".into()));
        let blob = "AAAAB3NzaC1yc2EAAAADAQABAAABAQ";
        for kind in SSH_KEY_TYPES {
            let key = format!("{kind} {blob}");
            assert!(validate_spec(&with_ssh("vmhost", &[&key]), &config()).is_ok(), "{kind}");
        }
        // At most 8 KiB, comment included.
        let long = format!("ssh-rsa {blob} {}", "c".repeat(MAX_SSH_KEY_LINE - 9 - blob.len()));
        assert_eq!(long.len(), MAX_SSH_KEY_LINE);
        assert!(validate_spec(&with_ssh("vmhost", &[&long]), &config()).is_ok());
        let bad = [
            format!("{long}c"),
            format!("ssh-dss {blob}"),
            format!("ssh-ed25519-cert-v01@openssh.com {blob}"),
            format!("command=\"/bin/sh\" ssh-ed25519 {blob}"),
            format!(" ssh-ed25519 {blob}"),
            "ssh-ed25519".to_string(),
            "ssh-ed25519 ".to_string(),
            "ssh-ed25519 short".to_string(),
            format!("ssh-ed25519 {blob}!"),
            format!("ssh-ed25519 {blob} a\nssh-rsa {blob}"),
            format!("ssh-ed25519 {blob} a\r"),
            format!("ssh-ed25519 {blob} \u{1b}[2J"),
            format!("ssh-ed25519 {blob}\0"),
            String::new(),
        ];
        for key in &bad {
            assert_eq!(err(&with_ssh("vmhost", &[ED25519, key])), (2001, "spec.ssh.keys[1]".into()), "{key:?}");
        }
    }

    #[test]
    fn ssh_errors_name_the_problem_not_the_key() {
        let e =
            validate_spec(&with_ssh("vmhost", &["ssh-dss AAAAB3NzaC1yc2EAAAADAQABAAABAQ secret-comment"]), &config())
                .unwrap_err();
        assert!(e.message.contains("does not start with a key type (ssh-ed25519, ssh-rsa"), "{}", e.message);
        assert!(!e.message.contains("secret-comment"), "{}", e.message);
        let e = validate_spec(&with_ssh("Root", &[ED25519]), &config()).unwrap_err();
        assert_eq!(e.message, "user name \"Root\" must start with a-z or _");
    }

    #[test]
    fn roles() {
        let mut s = spec("a");
        s.role = Some("sensor".into());
        assert!(validate_spec(&s, &config()).is_ok());
        s.role = Some("bad role".into());
        assert_eq!(err(&s), (2001, "spec.role".into()));
        s.role = Some(String::new());
        assert_eq!(err(&s), (2001, "spec.role".into()));
    }
}
