//! Landlock: which files the daemon and the spawner may reach.
//!
//! The rules are data ([`Rule`]: a path, an [`Access`] class and the reason), built from the
//! config by [`daemon_rules`] and [`spawner_rules`] and applied by [`apply`]. The ruleset
//! handles every filesystem right of ABI 5 (so device ioctls are covered where the kernel has
//! ABI 5 or later) and TCP bind/connect (ABI 4; no rule grants them, so neither process can use
//! TCP), except on a host with a migration port ([`daemon_tcp`]): there the daemon may bind that
//! one port and connect to any (a destination's port is only known per migration), and nothing
//! else changes. On an older kernel the landlock crate keeps what the kernel knows, and [`apply`]
//! reports the kernel's ABI and whether the ruleset was fully or partially enforced.
//!
//! A rule is added only for a path that exists when the daemon starts (Landlock needs an open
//! descriptor). Paths are resolved when opened, so a sysfs symlink such as
//! `/sys/bus/pci/devices/0000:05:00.0` grants access to its `/sys/devices/...` target, which is
//! where the kernel checks writes to `driver_override`.
//!
//! sysfs is granted read-only, plus write on exactly the attribute files passthrough writes
//! ([`pci_write_files`], computed at start from the hardware model): each modelled device's
//! (and IOMMU group peer's) `driver_override`, `bus/pci/drivers_probe`, vfio-pci's `bind` and
//! `unbind`, and `bind` and `unbind` of the drivers those devices have at start (binding to
//! vfio-pci unbinds the original driver; release binds it back). Nothing else: not `remove`,
//! `reset`, `config` or `rescan` of any device, not the bind files of any other driver (the root
//! disk's, say, unless it is also a modelled device's driver). A device on vfio-pci at start (a
//! restart while its VM runs) has its original driver from the VM's record. Limits, since a rule
//! needs a file that exists at start: a driver a device gets only after the start (or vfio-pci
//! when its module could not be loaded at start) has no rule; release then falls back to `drivers_probe`, which
//! probes the drivers whose id tables match, and unbinding from vfio-pci is refused until the
//! daemon restarts with vfio-pci loaded (load it at boot on passthrough hosts).

use crate::config::Config;
use landlock::Access as _;
use landlock::{
    AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, NetPort, PathBeneath, PathFd, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, ABI,
};
use std::path::{Path, PathBuf};

/// The ABI whose rights the ruleset handles (5: device ioctls).
pub const TARGET_ABI: ABI = ABI::V5;

/// What a rule grants beneath its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read files, list directories.
    Read,
    /// Read and execute (programs, shared libraries).
    ReadExec,
    /// Everything: create, remove, rename, write, truncate, sockets, device ioctls.
    ReadWrite,
    /// Open a device read-write and use its ioctls.
    Device,
    /// Read and write existing files (sysfs attributes), nothing else.
    WriteFiles,
    /// Create and remove a Unix socket (the API socket's directory).
    Socket,
}

impl Access {
    fn rights(self, abi: ABI) -> BitFlags<AccessFs> {
        match self {
            Access::Read => AccessFs::ReadFile | AccessFs::ReadDir,
            Access::ReadExec => AccessFs::ReadFile | AccessFs::ReadDir | AccessFs::Execute,
            Access::ReadWrite => AccessFs::from_all(abi),
            Access::Device => AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::IoctlDev,
            Access::WriteFiles => AccessFs::ReadFile | AccessFs::ReadDir | AccessFs::WriteFile,
            Access::Socket => AccessFs::MakeSock | AccessFs::RemoveFile,
        }
    }

    /// `read`, `read-exec`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::ReadExec => "read-exec",
            Access::ReadWrite => "read-write",
            Access::Device => "device",
            Access::WriteFiles => "write-files",
            Access::Socket => "socket",
        }
    }
}

/// One Landlock rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Granted beneath this path (or on this file).
    pub path: PathBuf,
    /// What is granted.
    pub access: Access,
    /// Why.
    pub why: &'static str,
}

fn rule(path: impl Into<PathBuf>, access: Access, why: &'static str) -> Rule {
    Rule { path: path.into(), access, why }
}

/// True when the config lets VMs have passthrough devices.
pub fn passthrough(config: &Config) -> bool {
    !config.hardware.model.is_empty() || config.hardware.allow_raw_pci
}

/// The daemon's rules. `pci_files` are the sysfs attribute files passthrough writes (see
/// [`pci_write_files`]).
pub fn daemon_rules(config: &Config, pci_files: &[PathBuf]) -> Vec<Rule> {
    let p = &config.paths;
    let mut v = vec![
        rule(&p.state, Access::ReadWrite, "VM records, overlays, seeds, serial logs, the lock file"),
        rule(&p.run, Access::ReadWrite, "per-VM QMP and agent sockets, pid files"),
        rule(
            &p.images,
            Access::ReadWrite,
            "base images: probed; image.import adds one whole, image.delete removes one",
        ),
        // Every right, as the state directory has: a rename between two directories is only
        // allowed when the file gains no access right by it (Landlock's REFER rule).
        rule(
            p.import_dir(),
            Access::ReadWrite,
            "disks imported by boot.disk, renamed into and back out of the state directory",
        ),
        rule(p.backups_dir(), Access::ReadWrite, "backups vm.export writes and vm.import reads"),
    ];
    if let Some(dir) = &config.agent.files_dir {
        v.push(rule(dir, Access::Read, "[agent] files_dir: the files vm.file_push sends (source)"));
    }
    if let Some(dir) = p.socket.parent() {
        v.push(rule(dir, Access::Socket, "the API socket (created at start, removed at exit)"));
    }
    // A pinned binary's directory, not the file: a rule holds the inode it was made for, and an
    // upgrade renames a new binary into place.
    let pinned = [
        (config.qemu.sha256.is_some(), &config.qemu.binary, "qemu.sha256: the binary is hashed before launches"),
        (
            config.qemu.img_sha256.is_some(),
            &config.qemu.img_binary,
            "qemu.img_sha256: the binary is hashed for host.check",
        ),
    ];
    // The UEFI firmware files, always (any VM may ask for UEFI): directories too, since a
    // package upgrade renames new files in. Skipped while OVMF is not installed; host.check
    // then says to restart vmhostd after installing it.
    let firmware = [
        (true, &config.firmware.uefi_code, "firmware.uefi_code: OVMF's code, handed to UEFI VMs' QEMU"),
        (
            true,
            &config.firmware.uefi_vars,
            "firmware.uefi_vars: the template each UEFI VM's variables store is copied from",
        ),
        (true, &config.firmware.uefi_secure_code, "firmware.uefi_secure_code: OVMF's code for Secure Boot VMs"),
        (
            true,
            &config.firmware.uefi_secure_vars,
            "firmware.uefi_secure_vars: the enrolled-keys template of Secure Boot VMs' stores",
        ),
    ];
    for (_, file, why) in pinned.into_iter().chain(firmware).filter(|(on, _, _)| *on) {
        for dir in dirs_of(file) {
            if !v.iter().any(|r| r.path == dir && r.access == Access::Read) {
                v.push(rule(dir, Access::Read, why));
            }
        }
    }
    v.extend([
        rule("/etc/vmhost", Access::Read, "configuration"),
        rule("/etc/group", Access::Read, "access groups (getgrnam, getgrgid)"),
        rule("/etc/passwd", Access::Read, "user names of peers (group member lists)"),
        rule("/etc/nsswitch.conf", Access::Read, "name service configuration for group and host lookups"),
        rule("/etc/hosts", Access::Read, "image.import resolves a URL's host itself (docs/images.md)"),
        rule("/etc/resolv.conf", Access::Read, "same: the DNS servers"),
        rule("/etc/host.conf", Access::Read, "same: resolver options"),
        rule("/etc/gai.conf", Access::Read, "same: address order"),
        rule("/etc/ld.so.cache", Access::Read, "locating name service modules"),
        rule("/usr/lib", Access::ReadExec, "name service modules (libnss_*) loaded by group lookups"),
        rule("/lib", Access::ReadExec, "same, where /lib is not a link to /usr/lib"),
        rule("/lib64", Access::ReadExec, "same"),
        rule("/proc", Access::Read, "QEMU process identity, peers' groups, mounts in use"),
        rule("/sys", Access::Read, "PCI devices, IOMMU groups, network devices"),
        rule("/dev/null", Access::Device, "null I/O"),
        rule("/dev/urandom", Access::Read, "randomness"),
        rule("/dev/net/tun", Access::Device, "creating tap devices (TUNSETIFF)"),
        // Skipped when absent at start (vhost_net not loaded): VMs then run without vhost-net
        // until vmhostd restarts.
        rule("/dev/vhost-net", Access::Device, "vhost-net: one descriptor per NIC queue, handed to QEMU"),
    ]);
    if passthrough(config) {
        v.push(rule("/dev/vfio", Access::Device, "VFIO groups of passed-through devices"));
        v.push(rule("/sys/bus/pci/drivers_probe", Access::WriteFiles, "binding a device to vfio-pci"));
        for file in pci_files {
            v.push(rule(
                file,
                Access::WriteFiles,
                "driver_override of a passthrough device; bind/unbind of vfio-pci and of its original driver",
            ));
        }
    }
    v
}

/// The directory of `file` and, when it is a link, the directory it leads to: opening the path
/// follows the link, and Landlock checks where it leads.
fn dirs_of(file: &Path) -> Vec<PathBuf> {
    let resolved = std::fs::canonicalize(file).ok();
    let mut dirs: Vec<PathBuf> = file.parent().into_iter().map(Path::to_path_buf).collect();
    if let Some(dir) = resolved.as_deref().and_then(Path::parent) {
        if !dirs.iter().any(|d| d == dir) {
            dirs.push(dir.to_path_buf());
        }
    }
    dirs
}

/// The spawner's rules (QEMU and modprobe inherit them): read and execute everywhere,
/// since a spec may name a kernel or initrd anywhere; write only the state and run directories
/// and the devices QEMU opens.
pub fn spawner_rules(config: &Config) -> Vec<Rule> {
    let p = &config.paths;
    let mut v = vec![
        rule("/", Access::ReadExec, "QEMU, its libraries, firmware and modules; kernels and images a spec names"),
        rule(
            &p.state,
            Access::ReadWrite,
            "overlays, serial logs, seeds (QEMU gets descriptors; kept for the spawner's own work)",
        ),
        rule(&p.run, Access::ReadWrite, "QMP and agent sockets, pid files"),
        rule("/dev/null", Access::Device, "QEMU's stdio"),
        rule("/dev/urandom", Access::Read, "randomness"),
        rule("/dev/kvm", Access::Device, "the accelerator"),
    ];
    if passthrough(config) {
        v.push(rule("/dev/vfio", Access::Device, "VFIO groups and container"));
    }
    v
}

/// The sysfs directories (resolved under /sys/devices) of the PCI functions the daemon may bind:
/// with `allow_raw_pci` every function present at start, else the model's devices and the
/// other members of their IOMMU groups.
pub fn pci_device_dirs(config: &Config) -> Vec<PathBuf> {
    let base = Path::new("/sys/bus/pci/devices");
    let mut names: Vec<String> = Vec::new();
    if config.hardware.allow_raw_pci {
        if let Ok(rd) = std::fs::read_dir(base) {
            names.extend(rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()));
        }
    } else {
        for (_, _, addr) in config.hardware.model.iter() {
            let a = addr.to_string();
            if let Ok(rd) = std::fs::read_dir(base.join(&a).join("iommu_group/devices")) {
                names.extend(rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()));
            }
            names.push(a);
        }
    }
    let mut dirs: Vec<PathBuf> = names.iter().filter_map(|n| std::fs::canonicalize(base.join(n)).ok()).collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// The sysfs attribute files the daemon may write for passthrough (module doc): for each of
/// `device_dirs` ([`pci_device_dirs`]) its `driver_override` and its current driver's `bind`
/// and `unbind`, the same files of `recorded_drivers` (the original drivers VM records name for
/// devices that are on vfio-pci now, see [`recorded_original_drivers`]), and vfio-pci's `bind`
/// and `unbind`.
pub fn pci_write_files(device_dirs: &[PathBuf], recorded_drivers: &[String]) -> Vec<PathBuf> {
    pci_write_files_in(Path::new("/sys"), device_dirs, recorded_drivers)
}

/// The original drivers VM records name for their passthrough devices: a daemon restarted while
/// a VM holds its devices sees vfio-pci as their driver, and must still be allowed to give them
/// back and bind them again. Unreadable records name nothing.
pub fn recorded_original_drivers(config: &Config) -> Vec<String> {
    let Ok(store) = crate::state::Store::open(&config.paths.state) else { return Vec::new() };
    let Ok((records, _)) = store.load_all() else { return Vec::new() };
    records.iter().flat_map(|r| r.vfio.iter().filter_map(|b| b.original_driver.clone())).collect()
}

/// [`pci_write_files`] with sysfs at `sys` (a test's tree).
fn pci_write_files_in(sys: &Path, device_dirs: &[PathBuf], recorded_drivers: &[String]) -> Vec<PathBuf> {
    let drivers = sys.join("bus/pci/drivers");
    let mut files = Vec::new();
    let mut driver_names = vec![crate::pci::VFIO_PCI.to_string()];
    // A driver name is one path component (a record is data the daemon wrote, but still).
    driver_names.extend(recorded_drivers.iter().filter(|d| !d.contains('/') && !d.starts_with('.')).cloned());
    for dir in device_dirs {
        files.push(dir.join("driver_override"));
        if let Ok(target) = std::fs::read_link(dir.join("driver")) {
            if let Some(name) = target.file_name() {
                driver_names.push(name.to_string_lossy().into_owned());
            }
        }
    }
    for name in driver_names {
        files.push(drivers.join(&name).join("bind"));
        files.push(drivers.join(&name).join("unbind"));
    }
    files.sort();
    files.dedup();
    files
}

/// What [`apply`] achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The kernel's Landlock ABI (0: none).
    pub kernel_abi: i32,
    /// `fully enforced`, `partially enforced` or `not enforced`.
    pub status: &'static str,
    /// Rules added.
    pub rules: usize,
    /// Rule paths that do not exist on this host (skipped).
    pub skipped: Vec<PathBuf>,
}

impl Outcome {
    /// True when the ruleset restricts this process at all.
    pub fn enforced(&self) -> bool {
        self.status != "not enforced"
    }
}

/// Landlock errors.
#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    /// The crate refused the ruleset or the kernel refused to apply it.
    #[error("landlock: {0}")]
    Ruleset(#[from] landlock::RulesetError),
}

/// The kernel's Landlock ABI version, 0 when Landlock is missing or disabled.
pub fn kernel_abi() -> i32 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: landlock_create_ruleset(NULL, 0, VERSION) only returns a number.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    i32::try_from(v).ok().filter(|v| *v > 0).unwrap_or(0)
}

/// The TCP a ruleset allows (Landlock ABI 4 network rights).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tcp {
    /// Ports the process may bind (none but the migration port).
    pub bind: Vec<u16>,
    /// Ports the process may connect to; `None`: connecting is not handled, so any port is
    /// allowed (a host with a migration port connects to other hosts' ports).
    pub connect: Option<Vec<u16>>,
}

/// The daemon's TCP: nothing (no bind, no connect) unless `[migration] listen` is set; then
/// bind that port and connect anywhere.
pub fn daemon_tcp(config: &Config) -> Tcp {
    match config.migration.listen {
        None => Tcp { bind: Vec::new(), connect: Some(Vec::new()) },
        Some(addr) => Tcp { bind: vec![addr.port()], connect: None },
    }
}

/// Restricts the calling thread (before other threads exist: the process) to `rules` and
/// `tcp`.
///
/// # Errors
/// [`LandlockError`] when the ruleset cannot be built or applied; a kernel without Landlock is
/// not an error but an [`Outcome`] with status `not enforced`.
///
/// `tcp.connect` for the spawner is the ports curl may connect to (see [`child_domain`]).
pub fn apply(rules: &[Rule], tcp: &Tcp) -> Result<Outcome, LandlockError> {
    let abi = TARGET_ABI;
    let net = match tcp.connect {
        Some(_) => AccessNet::from_all(abi),
        None => AccessNet::BindTcp.into(),
    };
    let mut created = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))?
        .handle_access(net)?
        .create()?;
    for port in tcp.connect.iter().flatten() {
        created = created.add_rule(NetPort::new(*port, AccessNet::ConnectTcp))?;
    }
    for port in &tcp.bind {
        created = created.add_rule(NetPort::new(*port, AccessNet::BindTcp))?;
    }
    let mut skipped = Vec::new();
    let mut added = 0;
    for r in rules {
        let Ok(fd) = PathFd::new(&r.path) else {
            skipped.push(r.path.clone());
            continue;
        };
        let mut rights = r.access.rights(abi);
        if !r.path.is_dir() {
            rights &= AccessFs::from_file(abi);
        }
        created = created.add_rule(PathBeneath::new(fd, rights))?;
        added += 1;
    }
    let status = created.restrict_self()?;
    let status = match status.ruleset {
        RulesetStatus::FullyEnforced => "fully enforced",
        RulesetStatus::PartiallyEnforced => "partially enforced",
        RulesetStatus::NotEnforced => "not enforced",
    };
    Ok(Outcome { kernel_abi: kernel_abi(), status, rules: added, skipped })
}

/// The Landlock layer every program the spawner runs but curl enters before exec: a ruleset
/// that handles TCP bind and connect and allows neither (where the kernel has network rights,
/// ABI 4), and making block device nodes, which no such program does. The spawner makes it at
/// start.
///
/// Two reasons for a layer of their own. QEMU cannot use the ports the spawner's own domain opens
/// for downloads. And a process in a nested domain cannot ptrace, or open the `/proc/PID/mem`
/// of, a process of the domain above it: curl runs as `qemu.user` too, in the spawner's domain,
/// so a QEMU taken over by its guest cannot write into a download's memory and use its sockets,
/// on any kernel with Landlock (the block-node right is there so that the layer exists where
/// TCP rights do not, as on Debian 12's 6.1). `None` without Landlock.
pub fn child_domain() -> Option<std::os::fd::OwnedFd> {
    child_ruleset(kernel_abi())
}

/// [`child_domain`]'s ruleset as a kernel of Landlock ABI `abi` gets it.
fn child_ruleset(abi: i32) -> Option<std::os::fd::OwnedFd> {
    if abi < 1 {
        return None;
    }
    let mut ruleset = Ruleset::default().handle_access(AccessFs::MakeBlock).ok()?;
    if abi >= 4 {
        ruleset = ruleset.handle_access(AccessNet::from_all(TARGET_ABI)).ok()?;
    }
    ruleset.create().ok()?.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cmd` entering Landlock layer `ruleset` between fork and exec, as the spawner does.
    fn in_layer(cmd: &mut std::process::Command, ruleset: Option<i32>) -> &mut std::process::Command {
        use std::os::unix::process::CommandExt;
        if let Some(ruleset) = ruleset {
            // SAFETY: prctl and landlock_restrict_self only, between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                        || libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd
    }

    /// A program in [`child_domain`] cannot open the `/proc/PID/mem` (ptrace's attach check) of a
    /// process outside it, as curl is, nor of another program in a layer of its own (each
    /// `landlock_restrict_self` makes a sibling domain: one QEMU and another), neither with the
    /// layer this kernel gets nor with the one a kernel without Landlock's network rights gets
    /// (ABI 1-3: the block-node right alone); the control, the same command without the layer,
    /// can (the test runs as root).
    #[test]
    fn a_program_in_the_child_domain_cannot_reach_into_a_process_above_it() {
        use std::os::fd::AsRawFd;
        if kernel_abi() < 1 {
            assert!(child_domain().is_none());
            return;
        }
        let (Some(this_kernel), Some(without_net)) = (child_domain(), child_ruleset(1)) else {
            panic!("a kernel with Landlock makes the layer");
        };
        let sleep =
            |layer: Option<i32>| in_layer(std::process::Command::new("/bin/sleep").arg("30"), layer).spawn().unwrap();
        let peek = |target: &std::process::Child, layer: Option<i32>| {
            let mut cmd = std::process::Command::new("/bin/sh");
            cmd.args(["-c", &format!("exec 3</proc/{}/mem", target.id())]);
            cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
            in_layer(&mut cmd, layer).status().unwrap().success()
        };
        let above = sleep(None);
        assert!(peek(&above, None), "without the layer the same command reads it");
        assert!(!peek(&above, Some(this_kernel.as_raw_fd())), "a program in the layer cannot reach a process above it");
        assert!(!peek(&above, Some(without_net.as_raw_fd())), "nor on a kernel without network rights");
        let sibling = sleep(Some(without_net.as_raw_fd()));
        assert!(peek(&sibling, None), "the unrestricted control reaches into a layer");
        assert!(!peek(&sibling, Some(without_net.as_raw_fd())), "one program's layer cannot reach another's");
        for mut child in [above, sibling] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
    use crate::config::Accel;
    use crate::validate::tests::config;

    #[test]
    fn daemon_rules_follow_the_config() {
        let mut c = config();
        c.hardware.model = crate::hardware::HardwareModel::new(Vec::new());
        c.hardware.allow_raw_pci = false;
        let r = daemon_rules(&c, &[]);
        let find = |p: &str| r.iter().find(|x| x.path == Path::new(p)).map(|x| x.access);
        assert_eq!(find(&c.paths.state.to_string_lossy()), Some(Access::ReadWrite));
        assert_eq!(find(&c.paths.run.to_string_lossy()), Some(Access::ReadWrite));
        assert_eq!(find(&c.paths.images.to_string_lossy()), Some(Access::ReadWrite));
        assert_eq!(find(&c.paths.import_dir().to_string_lossy()), Some(Access::ReadWrite));
        assert_eq!(find(&c.paths.backups_dir().to_string_lossy()), Some(Access::ReadWrite));
        assert_eq!(find("/dev/net/tun"), Some(Access::Device));
        assert_eq!(find("/dev/vhost-net"), Some(Access::Device));
        assert_eq!(find("/etc/vmhost"), Some(Access::Read));
        assert_eq!(find("/dev/kvm"), None, "the daemon never opens /dev/kvm");
        assert_eq!(find("/dev/vfio"), None, "no passthrough configured");
        // The UEFI firmware's directory, read-only, whether or not a VM uses it yet.
        assert_eq!(find("/usr/share/OVMF"), Some(Access::Read));
        assert!(!r.iter().any(|x| x.path == Path::new("/usr/share") || x.path == Path::new("/usr")), "nothing broad");
        assert!(!r.iter().any(|x| x.path.starts_with("/sys/bus/pci") && x.access == Access::WriteFiles));
        assert!(!r.iter().any(|x| x.path == Path::new("/") || x.path == Path::new("/etc")), "nothing broad");
        c.hardware.allow_raw_pci = true;
        c.qemu.accel = Accel::Kvm;
        let r = daemon_rules(&c, &[PathBuf::from("/sys/devices/pci0000:00/0000:00:05.0/driver_override")]);
        let find = |p: &str| r.iter().find(|x| x.path == Path::new(p)).map(|x| x.access);
        assert_eq!(find("/dev/kvm"), None, "kvm: the spawner probes /dev/kvm as QEMU's user, not the daemon");
        assert_eq!(find("/dev/vfio"), Some(Access::Device));
        assert_eq!(find("/sys/bus/pci/drivers_probe"), Some(Access::WriteFiles));
        assert_eq!(find("/sys/devices/pci0000:00/0000:00:05.0/driver_override"), Some(Access::WriteFiles));
        assert_eq!(find("/sys/devices/pci0000:00/0000:00:05.0"), None, "not the device's directory");
        assert_eq!(find("/sys/bus/pci/drivers"), None, "not every driver's bind and unbind");
    }

    #[test]
    fn the_configured_firmware_directories_are_readable_where_links_lead_too() {
        let d = tempfile::tempdir().unwrap();
        let (share, edk2) = (d.path().join("share"), d.path().join("edk2"));
        std::fs::create_dir_all(&share).unwrap();
        std::fs::create_dir_all(&edk2).unwrap();
        std::fs::write(edk2.join("CODE.fd"), b"").unwrap();
        std::os::unix::fs::symlink(edk2.join("CODE.fd"), share.join("CODE.fd")).unwrap();
        let mut c = config();
        c.firmware.uefi_code = share.join("CODE.fd");
        c.firmware.uefi_vars = share.join("VARS.fd");
        c.firmware.uefi_secure_code = share.join("CODE.secboot.fd");
        c.firmware.uefi_secure_vars = share.join("VARS.ms.fd");
        let r = daemon_rules(&c, &[]);
        let reads: Vec<&Path> = r
            .iter()
            .filter(|x| x.access == Access::Read && x.why.starts_with("firmware."))
            .map(|x| x.path.as_path())
            .collect();
        // Each directory once, the link's target's too; not the default /usr/share/OVMF.
        assert_eq!(reads, [share.as_path(), edk2.as_path()]);
    }

    /// A fake sysfs tree: a modelled NIC on e1000e, a disk on nvme, vfio-pci loaded.
    fn fake_sysfs(root: &Path) -> PathBuf {
        let nic = root.join("devices/pci0000:00/0000:00:05.0");
        std::fs::create_dir_all(&nic).unwrap();
        for f in ["driver_override", "remove", "reset", "config"] {
            std::fs::write(nic.join(f), b"").unwrap();
        }
        for d in ["e1000e", "nvme", "vfio-pci"] {
            let dir = root.join("bus/pci/drivers").join(d);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("bind"), b"").unwrap();
            std::fs::write(dir.join("unbind"), b"").unwrap();
        }
        std::fs::write(root.join("bus/pci/drivers_probe"), b"").unwrap();
        std::os::unix::fs::symlink("../../../bus/pci/drivers/e1000e", nic.join("driver")).unwrap();
        nic
    }

    #[test]
    fn pci_write_files_are_exactly_the_attributes_passthrough_writes() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let nic = fake_sysfs(root);
        let d = root.join("bus/pci/drivers");
        let mut want = vec![
            nic.join("driver_override"),
            d.join("e1000e/bind"),
            d.join("e1000e/unbind"),
            d.join("vfio-pci/bind"),
            d.join("vfio-pci/unbind"),
        ];
        want.sort();
        assert_eq!(pci_write_files_in(root, std::slice::from_ref(&nic), &[]), want);
        // A restart while the device is on vfio-pci: its record names the original driver.
        std::fs::remove_file(nic.join("driver")).unwrap();
        std::os::unix::fs::symlink("../../../bus/pci/drivers/vfio-pci", nic.join("driver")).unwrap();
        let recorded = ["e1000e".to_string(), "../x".into()];
        assert_eq!(pci_write_files_in(root, std::slice::from_ref(&nic), &recorded), want);
    }

    /// Makes [`landlock_probe`] run: the fake sysfs root it writes to.
    const PROBE_VAR: &str = "VMHOST_TEST_LANDLOCK_PROBE_DIR";

    /// The daemon's rules for a modelled device, applied to a fresh process (this test binary
    /// again, running [`landlock_probe`]) on a fake sysfs tree: `driver_override` and the
    /// original driver's bind file are writable; the device's `remove`, `reset` and `config`
    /// and another driver's (nvme's) bind are not.
    #[test]
    fn the_daemon_cannot_write_remove_of_a_modelled_device() {
        if kernel_abi() == 0 {
            eprintln!("skipped: no Landlock in this kernel");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        fake_sysfs(dir.path());
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "sandbox::landlock::tests::landlock_probe", "--ignored", "--nocapture"])
            .env(PROBE_VAR, dir.path())
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{text}");
        assert!(text.contains("landlock-probe: done"), "the probe did not run:\n{text}");
    }

    #[test]
    #[ignore = "run in a child process by the_daemon_cannot_write_remove_of_a_modelled_device"]
    fn landlock_probe() {
        let Some(root) = std::env::var_os(PROBE_VAR) else { return };
        let root = PathBuf::from(root);
        let nic = root.join("devices/pci0000:00/0000:00:05.0");
        let mut c = config();
        c.hardware.allow_raw_pci = true;
        let files = pci_write_files_in(&root, std::slice::from_ref(&nic), &[]);
        // The daemon's rules, with the fake tree readable as /sys is.
        let mut rules = daemon_rules(&c, &files);
        rules.push(rule(&root, Access::Read, "the fake sysfs"));
        assert!(apply(&rules, &daemon_tcp(&c)).unwrap().enforced());
        let write = |p: PathBuf| std::fs::OpenOptions::new().write(true).open(&p).map(|_| ()).map_err(|e| e.kind());
        assert_eq!(write(nic.join("driver_override")), Ok(()));
        assert_eq!(write(root.join("bus/pci/drivers/e1000e/bind")), Ok(()));
        assert_eq!(write(root.join("bus/pci/drivers/vfio-pci/unbind")), Ok(()));
        for denied in ["remove", "reset", "config"] {
            assert_eq!(write(nic.join(denied)), Err(std::io::ErrorKind::PermissionDenied), "{denied}");
        }
        assert_eq!(write(root.join("bus/pci/drivers/nvme/bind")), Err(std::io::ErrorKind::PermissionDenied));
        println!("landlock-probe: done");
    }

    #[test]
    fn the_daemon_gets_tcp_only_with_a_migration_port() {
        let mut c = config();
        assert_eq!(daemon_tcp(&c), Tcp { bind: vec![], connect: Some(vec![]) });
        c.migration.listen = Some("192.0.2.1:7070".parse().unwrap());
        assert_eq!(daemon_tcp(&c), Tcp { bind: vec![7070], connect: None });
    }

    const TCP_PROBE_VAR: &str = "VMHOST_TEST_LANDLOCK_TCP_PROBE";

    /// With a migration port the daemon's ruleset lets it bind that port (and no other) and
    /// connect anywhere; without one it can do neither. Each case in a child process, since a
    /// Landlock domain cannot be left.
    #[test]
    fn the_daemon_binds_only_its_migration_port() {
        if kernel_abi() < 4 {
            eprintln!("skipped: this kernel has no Landlock network rights (ABI {})", kernel_abi());
            return;
        }
        // A port that is free now, and a server to connect to outside any domain.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let target = server.local_addr().unwrap().port();
        for case in ["with", "without"] {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "sandbox::landlock::tests::landlock_tcp_probe", "--ignored", "--nocapture"])
                .env(TCP_PROBE_VAR, format!("{case}:{port}:{target}"))
                .output()
                .unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "{case}: {text}");
            assert!(text.contains("landlock-tcp-probe: done"), "{case}: the probe did not run:\n{text}");
        }
    }

    #[test]
    #[ignore = "run in a child process by the_daemon_binds_only_its_migration_port"]
    fn landlock_tcp_probe() {
        let Some(arg) = std::env::var_os(TCP_PROBE_VAR) else { return };
        let arg = arg.to_string_lossy().to_string();
        let parts: Vec<&str> = arg.split(':').collect();
        let (case, port, target): (&str, u16, u16) = (parts[0], parts[1].parse().unwrap(), parts[2].parse().unwrap());
        let mut c = config();
        if case == "with" {
            c.migration.listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
        }
        let dir = tempfile::tempdir().unwrap();
        assert!(apply(&[rule(dir.path(), Access::Read, "test")], &daemon_tcp(&c)).unwrap().enforced());
        let bind = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).map(|_| ()).map_err(|e| e.kind());
        let connect = || std::net::TcpStream::connect(("127.0.0.1", target)).map(|_| ()).map_err(|e| e.kind());
        let denied = Err(std::io::ErrorKind::PermissionDenied);
        if case == "with" {
            assert_eq!(bind(port), Ok(()));
            assert_eq!(connect(), Ok(()));
        } else {
            assert_eq!(bind(port), denied);
            assert_eq!(connect(), denied);
        }
        // Any other port, and the kernel's choice of one, stay refused either way.
        let other = if port == 65535 { port - 1 } else { port + 1 };
        assert_eq!(bind(other), denied);
        assert_eq!(bind(0), denied);
        println!("landlock-tcp-probe: done");
    }

    #[test]
    fn spawner_writes_only_state_run_and_devices() {
        let c = config();
        for r in spawner_rules(&c) {
            let writes = matches!(r.access, Access::ReadWrite | Access::WriteFiles | Access::Socket);
            if writes {
                assert!(r.path == c.paths.state || r.path == c.paths.run, "{r:?}");
            }
            if r.access == Access::Device {
                assert!(r.path.starts_with("/dev"), "{r:?}");
            }
        }
    }

    #[test]
    fn rights_are_sane() {
        assert!(!Access::Read.rights(ABI::V5).contains(AccessFs::WriteFile));
        assert!(Access::Device.rights(ABI::V5).contains(AccessFs::IoctlDev));
        assert!(!Access::WriteFiles.rights(ABI::V5).contains(AccessFs::MakeReg));
        assert!(Access::ReadWrite.rights(ABI::V5).contains(AccessFs::Refer));
    }
}
