//! The host configuration (`/etc/vmhost/vmhostd.toml`, documented in docs/config.md).
//!
//! Parsed once at start by [`Config::load`] (or [`Config::parse`] for text): TOML syntax first,
//! then the typed shape (unknown keys are errors), then the cross-field rules. Any failure names
//! the file, the key and the problem, and vmhostd refuses to start: a half-understood host model
//! would let the daemon hand out hardware it does not have.

use crate::api::HardwareClass;
use crate::hardware::{DeviceIdentity, HardwareModel, PciAddress};
use crate::ipv4::Ipv4Cidr;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Default config file location.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/vmhost/vmhostd.toml";

/// A config that could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read: {source}")]
    Read {
        /// Config file.
        file: String,
        /// OS error.
        source: std::io::Error,
    },
    /// TOML syntax error.
    #[error("{file}: invalid TOML: {message}")]
    Syntax {
        /// Config file.
        file: String,
        /// Parser message with line and column.
        message: String,
    },
    /// A key has the wrong type, is unknown, or breaks a rule.
    #[error("{file}: key `{key}`: {problem}")]
    Key {
        /// Config file.
        file: String,
        /// Dotted key path.
        key: String,
        /// What is wrong.
        problem: String,
    },
}

/// Which accelerator QEMU uses. KVM unless `tcg` is set explicitly: never a silent fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualisation (the product default).
    #[default]
    Kvm,
    /// Software emulation, for tests and hosts without KVM.
    Tcg,
}

impl Accel {
    /// `kvm` or `tcg`.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// Top-level `sandbox`: how the daemon confines itself at start (docs/sandbox.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxMode {
    /// Every layer (capabilities, no_new_privs, Landlock, seccomp) must be in force, or the
    /// daemon refuses to start.
    Require,
    /// Each layer the host supports is put in force; what is missing is logged and reported by
    /// `host.check` (the default, so a kernel without Landlock still runs VMs).
    #[default]
    BestEffort,
    /// No sandbox: the daemon runs with the privileges it was started with.
    Off,
}

impl SandboxMode {
    /// `require`, `best-effort` or `off`.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxMode::Require => "require",
            SandboxMode::BestEffort => "best-effort",
            SandboxMode::Off => "off",
        }
    }
}

/// Top-level `seccomp`: what the daemon's seccomp filter does with a syscall not in its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SeccompMode {
    /// The syscall fails with EPERM.
    #[default]
    Enforce,
    /// The syscall runs and the kernel logs it (SECCOMP_RET_LOG), for finding what is missing.
    Log,
}

impl SeccompMode {
    /// `enforce` or `log`.
    pub fn as_str(self) -> &'static str {
        match self {
            SeccompMode::Enforce => "enforce",
            SeccompMode::Log => "log",
        }
    }
}

/// Longest `paths.run` for which every VM socket path fits in `sun_path` (107 bytes + NUL):
/// `RUN/` + 63-byte name + `/agent`, the longest socket of the layout in
/// [`crate::qemu::argv::VmPaths`]. A limit on a config value, so it is checked (and kept) here; the
/// layout's test `socket_paths_fit_sun_path` holds the two together.
pub const MAX_RUN_DIR_LEN: usize = 107 - 1 - 63 - 6;

/// `[paths]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Paths {
    /// VM records, overlays and console logs.
    pub state: PathBuf,
    /// Sockets and pid files.
    pub run: PathBuf,
    /// Base images and kernels.
    pub images: PathBuf,
    /// The API socket.
    pub socket: PathBuf,
    /// Directories a direct-kernel VM's `boot.kernel` and `boot.initrd` may be in; unset: the
    /// images directory and [`DEFAULT_BOOT_DIR`] (see [`Paths::boot_dirs`]).
    pub boot: Option<Vec<PathBuf>>,
    /// The directory a spec's `boot.disk` names a file in (an existing disk moved in as a VM's
    /// root disk); unset: `STATE/import` (see [`Paths::import_dir`]). Must be on the state
    /// directory's file system: the disk is renamed, never copied.
    pub import: Option<PathBuf>,
    /// Where `vm.export` writes backups and `vm.import` reads them; unset: `STATE/backups`
    /// (see [`Paths::backups_dir`]).
    pub backups: Option<PathBuf>,
}

/// The boot directory besides the images directory when `paths.boot` is not set.
pub const DEFAULT_BOOT_DIR: &str = "/var/lib/vmhost/boot";

impl Paths {
    /// The directories kernels and initrds may be in: `paths.boot`, or by default the images
    /// directory and [`DEFAULT_BOOT_DIR`].
    pub fn boot_dirs(&self) -> Vec<PathBuf> {
        self.boot.clone().unwrap_or_else(|| vec![self.images.clone(), DEFAULT_BOOT_DIR.into()])
    }

    /// The directory `boot.disk` files are imported from: `paths.import`, or `STATE/import`
    /// (on the state file system by default, so the move is a rename).
    pub fn import_dir(&self) -> PathBuf {
        self.import.clone().unwrap_or_else(|| self.state.join("import"))
    }

    /// The directory of VM backups: `paths.backups`, or `STATE/backups`.
    pub fn backups_dir(&self) -> PathBuf {
        self.backups.clone().unwrap_or_else(|| self.state.join("backups"))
    }
}

impl Default for Paths {
    fn default() -> Self {
        Paths {
            state: "/var/lib/vmhost".into(),
            run: "/run/vmhost".into(),
            images: "/var/lib/vmhost/images".into(),
            socket: "/run/vmhost/vmhostd.sock".into(),
            boot: None,
            import: None,
            backups: None,
        }
    }
}

/// `[qemu]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QemuConfig {
    /// qemu-system binary.
    pub binary: PathBuf,
    /// No longer used: image files are worked on by `binary` as `qemu.user`
    /// ([`crate::disk`]). Still accepted (and checked to be absolute) so existing configs load.
    pub img_binary: PathBuf,
    /// Accelerator.
    pub accel: Accel,
    /// Machine type.
    pub machine: String,
    /// The guest CPU model (`-cpu`): empty means `host` under KVM and QEMU's default under TCG.
    pub cpu_model: String,
    /// Seconds QEMU may take to initialise before the start counts as failed.
    pub launch_timeout_s: u64,
    /// Spare PCIe root ports a q35 VM starts with, each able to take one hot-plugged data
    /// disk ([`crate::qemu::hotplug`]); each costs a TCG guest boot time (docs/performance.md).
    pub hotplug_ports: usize,
    /// The unprivileged user QEMU runs as (docs/sandbox.md).
    pub user: String,
    /// QEMU's own seccomp filter: `-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,
    /// resourcecontrol=deny`.
    pub sandbox: bool,
    /// The sha256 `binary` must have (64 hex digits, lower case once loaded): checked at start
    /// and before every launch ([`crate::qemu::integrity`]); `None` runs it unverified.
    pub sha256: Option<String>,
    /// The sha256 `img_binary` must have: checked at start and by `host.check` only, since
    /// qemu-img is never run.
    pub img_sha256: Option<String>,
    /// swtpm, the TPM emulator a VM with `tpm: true` gets ([`crate::tpm`]); run as `user`.
    pub swtpm: PathBuf,
}

/// A user and group to run a program as: `qemu.user`, resolved when the config is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct UserIds {
    /// User id.
    pub uid: u32,
    /// Its primary group id; the program gets no supplementary groups.
    pub gid: u32,
}

/// The default `qemu.hotplug_ports` (docs/performance.md, "Spare hot-plug root ports").
pub const DEFAULT_HOTPLUG_PORTS: usize = 4;

/// The most `qemu.hotplug_ports`: the root ports of the data disks and the spare ones share
/// three PCI slots of eight functions ([`crate::qemu::hotplug::root_port_args`]), and 16 data
/// disks take two of them.
pub const MAX_HOTPLUG_PORTS: usize = 8;

/// The default `qemu.user`, which the Debian package creates.
pub const DEFAULT_QEMU_USER: &str = "vmhost-qemu";

impl Default for QemuConfig {
    fn default() -> Self {
        QemuConfig {
            binary: "/usr/bin/qemu-system-x86_64".into(),
            img_binary: "/usr/bin/qemu-img".into(),
            accel: Accel::Kvm,
            machine: "q35".into(),
            cpu_model: String::new(),
            launch_timeout_s: 30,
            hotplug_ports: DEFAULT_HOTPLUG_PORTS,
            user: DEFAULT_QEMU_USER.into(),
            sandbox: true,
            sha256: None,
            img_sha256: None,
            swtpm: "/usr/bin/swtpm".into(),
        }
    }
}

/// `[firmware]`: the OVMF files a VM with `boot.firmware = "uefi"` runs (docs/images.md).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FirmwareConfig {
    /// OVMF's code, handed to QEMU read-only as the first flash device (`pflash0`).
    pub uefi_code: PathBuf,
    /// The variables store template: each UEFI VM gets a copy of its own at its first start
    /// ([`crate::qemu::argv::VmPaths::uefi_vars`]), the second flash device. Its size must
    /// match `uefi_code`'s build (the 4M pair by default).
    pub uefi_vars: PathBuf,
    /// OVMF's code for `boot.secure_boot` VMs: a build that requires SMM, so that only the
    /// firmware (not the guest's kernel) can write the variables holding the keys.
    pub uefi_secure_code: PathBuf,
    /// The variables template of `boot.secure_boot` VMs, with the keys enrolled (PK, KEK, db)
    /// and Secure Boot on: a VM's store starts as a copy (docs/images.md#secure-boot).
    pub uefi_secure_vars: PathBuf,
}

/// Debian's (package `ovmf`) OVMF build without Secure Boot, 4 MiB flash layout.
pub const DEFAULT_UEFI_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
/// The variables template that pairs with [`DEFAULT_UEFI_CODE`].
pub const DEFAULT_UEFI_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";
/// Debian's OVMF build for Secure Boot (SMM required), 4 MiB flash layout.
pub const DEFAULT_UEFI_SECURE_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd";
/// Debian's enrolled-keys template for it: Debian's PK, Microsoft's KEK and db (the UEFI CA
/// that signs shim, which boots Debian's signed GRUB and kernels), Secure Boot on.
pub const DEFAULT_UEFI_SECURE_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.ms.fd";

impl Default for FirmwareConfig {
    fn default() -> Self {
        FirmwareConfig {
            uefi_code: DEFAULT_UEFI_CODE.into(),
            uefi_vars: DEFAULT_UEFI_VARS.into(),
            uefi_secure_code: DEFAULT_UEFI_SECURE_CODE.into(),
            uefi_secure_vars: DEFAULT_UEFI_SECURE_VARS.into(),
        }
    }
}

/// `[lifecycle]`: what vmhostd does with VMs on its own.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LifecycleConfig {
    /// At start, start the VMs whose desired state is `running` but whose QEMU is gone (a host
    /// reboot, or QEMU ended while vmhostd was down).
    pub autostart: bool,
    /// How many VMs autostart starts at once; 0 (the default) means the host's CPU count.
    pub start_concurrency: u32,
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        LifecycleConfig { autostart: true, start_concurrency: 0 }
    }
}

impl LifecycleConfig {
    /// `start_concurrency`, with 0 resolved to the CPUs this process may run on (at least 1).
    pub fn concurrency(&self) -> usize {
        match self.start_concurrency {
            0 => std::thread::available_parallelism().map(usize::from).unwrap_or(1),
            n => n as usize,
        }
    }
}

/// `[logs]`: the per-VM serial and QEMU logs a guest can fill.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogsConfig {
    /// Most bytes of each VM log (serial console, QEMU's stderr); a log past it loses its oldest
    /// half ([`crate::logcap`]).
    pub max_bytes: u64,
}

/// `logs.max_bytes` by default: 16 MiB per VM per log.
pub const DEFAULT_LOG_MAX_BYTES: u64 = 16 * 1024 * 1024;
/// The smallest `logs.max_bytes`: half of it must still span whole file-system blocks.
pub const MIN_LOG_MAX_BYTES: u64 = 64 * 1024;

impl Default for LogsConfig {
    fn default() -> Self {
        LogsConfig { max_bytes: DEFAULT_LOG_MAX_BYTES }
    }
}

/// `[capture]`: the host interfaces monitor NICs may copy frames from (docs/capture.md), as
/// the hardware model lists the devices VMs may pass through.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CaptureConfig {
    /// Interface names (valid Linux names, no repeats): a monitor NIC's `source` must be one.
    pub interfaces: Vec<String>,
}

/// `[migration]` as written: checked into [`MigrationConfig`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawMigration {
    listen: Option<String>,
    advertise: Option<String>,
    prepare_timeout_s: u64,
}

impl Default for RawMigration {
    fn default() -> Self {
        RawMigration { listen: None, advertise: None, prepare_timeout_s: DEFAULT_PREPARE_TIMEOUT_S }
    }
}

/// How long a destination waits for the source's first stream unless `[migration]` says.
pub const DEFAULT_PREPARE_TIMEOUT_S: u64 = 300;

/// `[migration]`: the migration port other vmhostds send VMs to (docs/moving.md). Without
/// `listen` the host has no port, opens no inet socket and cannot receive a VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationConfig {
    /// The address the port listens on.
    pub listen: Option<std::net::SocketAddr>,
    /// `HOST:PORT` a source connects to (what `vm.migrate_in` answers): `advertise`, else
    /// `listen`. `Some` exactly when `listen` is.
    pub advertise: Option<String>,
    /// How long a destination waits for the source's first stream.
    pub prepare_timeout_s: u64,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig { listen: None, advertise: None, prepare_timeout_s: DEFAULT_PREPARE_TIMEOUT_S }
    }
}

impl MigrationConfig {
    /// Checks `raw`: `listen` a socket address, `advertise` a `HOST:PORT` (required when
    /// `listen`'s address is unspecified, since no source could connect to that).
    fn check(raw: RawMigration) -> Result<MigrationConfig, (&'static str, String)> {
        if raw.prepare_timeout_s == 0 {
            return Err(("migration.prepare_timeout_s", "must be at least 1".to_string()));
        }
        let listen = match &raw.listen {
            None => None,
            Some(text) => {
                let addr: std::net::SocketAddr = text.parse().map_err(|_| {
                    (
                        "migration.listen",
                        format!("{text:?} is not ADDRESS:PORT (e.g. \"192.0.2.10:7070\" or \"[::]:7070\")"),
                    )
                })?;
                if addr.port() == 0 {
                    return Err(("migration.listen", "0 is not a port".to_string()));
                }
                Some(addr)
            }
        };
        let advertise = match (&raw.advertise, listen) {
            (Some(_), None) => {
                return Err(("migration.advertise", "needs migration.listen (this host has no migration port)".into()))
            }
            (Some(text), Some(_)) => {
                let ok = text.rsplit_once(':').is_some_and(|(host, port)| {
                    !host.is_empty()
                        && !host.chars().any(char::is_whitespace)
                        && port.parse::<u16>().is_ok_and(|p| p > 0)
                });
                if !ok {
                    return Err(("migration.advertise", format!("{text:?} is not HOST:PORT")));
                }
                Some(text.clone())
            }
            (None, Some(addr)) if addr.ip().is_unspecified() => {
                return Err((
                    "migration.advertise",
                    format!("required: migration.listen {addr} is unspecified, so say where sources connect"),
                ))
            }
            (None, Some(addr)) => Some(addr.to_string()),
            (None, None) => None,
        };
        Ok(MigrationConfig { listen, advertise, prepare_timeout_s: raw.prepare_timeout_s })
    }
}

/// `[images]`: how `image.import` fetches a URL (docs/images.md).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImagesConfig {
    /// The curl binary that downloads an image, run by the spawner as `qemu.user` into a pipe.
    pub curl: PathBuf,
    /// The TCP ports a download may connect to (Landlock allows the spawner only these, and
    /// only curl; QEMU connects to none).
    pub download_ports: Vec<u16>,
    /// Which non-public addresses (loopback, private, link-local, ...) a URL import may reach:
    /// none by default, all with `true`, or a list of networks
    /// ([`crate::images::address::AllowPrivate`]).
    pub allow_private: crate::images::address::AllowPrivate,
}

impl Default for ImagesConfig {
    fn default() -> Self {
        ImagesConfig {
            curl: PathBuf::from("/usr/bin/curl"),
            download_ports: vec![80, 443],
            allow_private: crate::images::address::AllowPrivate::No,
        }
    }
}

/// `[agent]`: what the guest's exec server may be asked (docs/guest-exec.md).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// Whether `vm.exec`, `vm.file_push` and `vm.file_pull` may run at all (default false:
    /// 4095 with `details.reason: "host"`). A VM's spec can still refuse them
    /// (`guest_exec: false`).
    pub allow_exec: bool,
    /// The directory `vm.file_push`'s `source` names files beneath (absolute); without it a
    /// `source` is refused.
    pub files_dir: Option<PathBuf>,
    /// Largest `source` file, in MiB (1 to 4096).
    pub max_file_mib: u64,
}

/// Default `[agent] max_file_mib`.
pub const DEFAULT_MAX_FILE_MIB: u64 = 64;

/// Largest `[agent] max_file_mib`.
pub const MAX_FILE_MIB: u64 = 4096;

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig { allow_exec: false, files_dir: None, max_file_mib: DEFAULT_MAX_FILE_MIB }
    }
}

/// `[storage]` as written: `overcommit` is a ratio.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawStorage {
    overcommit: f64,
}

impl Default for RawStorage {
    fn default() -> Self {
        RawStorage { overcommit: 1.0 }
    }
}

/// `[storage]`: disk-space admission ([`crate::lifecycle::data_disks::admit_disk_space`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageConfig {
    /// `overcommit` in percent: new disks may provision up to this share of the state file
    /// system's free space (100: no more than is free).
    pub overcommit_percent: u64,
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig { overcommit_percent: 100 }
    }
}

/// `[access]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Access {
    /// Group whose members may call every method.
    pub admin_group: String,
    /// Group whose members may call read methods.
    pub readonly_group: String,
    /// Socket file mode, octal text (`"0666"`).
    pub socket_mode: String,
    /// Seconds after which a connection with nothing in flight, no subscription and no new
    /// request line is closed (1 to 86400).
    pub idle_timeout_s: u64,
}

impl Default for Access {
    fn default() -> Self {
        Access {
            admin_group: "vmhost".into(),
            readonly_group: "vmhost-ro".into(),
            socket_mode: "0666".into(),
            idle_timeout_s: 600,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHardware {
    cpu: u32,
    memory_gib: u64,
    #[serde(default)]
    reserved_cpu: u32,
    #[serde(default)]
    reserved_memory_gib: u64,
    // An address string or a table pinning the device's identity: read by `model_entry`, which
    // names the inner key of a bad table (serde's untagged enums only say "no variant matched").
    #[serde(default)]
    disk: BTreeMap<String, toml::Value>,
    #[serde(default)]
    copper: BTreeMap<String, toml::Value>,
    #[serde(default)]
    sfp: BTreeMap<String, toml::Value>,
    #[serde(default)]
    allow_raw_pci: bool,
    vm_cpus: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetwork {
    bridge: String,
    #[serde(default)]
    create: bool,
    uplink: Option<String>,
    address: Option<String>,
    #[serde(default)]
    vlan_filtering: bool,
    #[serde(default)]
    trunk: Vec<u16>,
    subnet: Option<String>,
    mtu: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    sandbox: SandboxMode,
    #[serde(default)]
    seccomp: SeccompMode,
    #[serde(default)]
    paths: Paths,
    #[serde(default)]
    qemu: QemuConfig,
    #[serde(default)]
    firmware: FirmwareConfig,
    #[serde(default)]
    access: Access,
    #[serde(default)]
    lifecycle: LifecycleConfig,
    #[serde(default)]
    logs: LogsConfig,
    #[serde(default)]
    storage: RawStorage,
    #[serde(default)]
    images: ImagesConfig,
    #[serde(default)]
    agent: AgentConfig,
    #[serde(default)]
    capture: CaptureConfig,
    #[serde(default)]
    migration: RawMigration,
    hardware: RawHardware,
    #[serde(default)]
    networks: BTreeMap<String, RawNetwork>,
}

/// A host network VM NICs attach to (`[networks.NAME]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Network {
    /// The config key.
    pub name: String,
    /// Bridge name.
    pub bridge: String,
    /// vmhostd creates and owns the bridge (else it must exist).
    pub create: bool,
    /// A host link vmhostd enslaves to the bridge it creates.
    pub uplink: Option<String>,
    /// Host address vmhostd puts on the bridge it creates.
    pub address: Option<Ipv4Cidr>,
    /// Bridge VLAN filtering: a NIC's `vlan` becomes its tap port's untagged PVID.
    pub vlan_filtering: bool,
    /// Tagged VLANs on the uplink.
    pub trunk: Vec<u16>,
    /// Guest addresses must be inside it.
    pub subnet: Option<Ipv4Cidr>,
    /// MTU of a created bridge.
    pub mtu: Option<u32>,
}

/// True for a valid Linux interface name: 1-15 bytes, no '/', ':' or whitespace, not . or ..
pub fn is_valid_ifname(name: &str) -> bool {
    ifname_problem(name).is_none()
}

/// Why `name` is not an interface name vmhostd accepts, or `None`. The kernel's rules
/// (`dev_valid_name`: 1-15 bytes, not `.` or `..`, no `/`, `:` or whitespace), and also:
/// printable ASCII only, no `%` (`%d` makes the kernel pick the name, and vmhostd's names are
/// deterministic), no leading `.` (vmhostd keeps files named after capture interfaces, and a
/// dot file is a temporary one there). The one rule for config keys, spec fields and the links
/// vmhostd makes (`net::validate_link_name` gives this reason).
pub fn ifname_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("empty")
    } else if name.len() > 15 {
        Some("longer than 15 bytes")
    } else if name.starts_with('.') {
        Some("starts with '.'")
    } else if name.contains('/') {
        Some("contains '/'")
    } else if name.contains(':') {
        Some("contains ':'")
    } else if name.contains('%') {
        Some("contains '%'")
    } else if !name.bytes().all(|b| b.is_ascii_graphic()) {
        Some("contains whitespace, a control character or a non-ASCII one")
    } else {
        None
    }
}

/// The host's capacity and passthrough devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hardware {
    /// CPUs on the host.
    pub cpu: u32,
    /// Memory on the host, MiB.
    pub memory_mib: u64,
    /// CPUs kept for the host.
    pub reserved_cpu: u32,
    /// Memory kept for the host, MiB.
    pub reserved_memory_mib: u64,
    /// Passthrough devices by class and index.
    pub model: HardwareModel,
    /// Specs may also name devices by PCI address (`pci: [...]`).
    pub allow_raw_pci: bool,
    /// The host CPUs VMs may run on (`vm_cpus`, a cpulist): shared VMs float over the ones no
    /// dedicated VM holds, dedicated VMs take theirs from it, the rest is the host's
    /// housekeeping set. `None`: no pinning at all, and dedicated VMs are refused.
    pub vm_cpus: Option<crate::placement::CpuSet>,
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Where the config came from (for messages).
    pub file: PathBuf,
    /// Top-level `sandbox`.
    pub sandbox: SandboxMode,
    /// Top-level `seccomp`.
    pub seccomp: SeccompMode,
    /// `[paths]`.
    pub paths: Paths,
    /// `[qemu]`.
    pub qemu: QemuConfig,
    /// `[firmware]`.
    pub firmware: FirmwareConfig,
    /// `qemu.user` resolved to ids by [`Config::load`]; `None` from [`Config::parse`] alone,
    /// and then QEMU runs as the daemon's user (unit tests).
    pub qemu_user: Option<UserIds>,
    /// `[access]`.
    pub access: Access,
    /// `[lifecycle]`.
    pub lifecycle: LifecycleConfig,
    /// `[logs]`.
    pub logs: LogsConfig,
    /// `[storage]`.
    pub storage: StorageConfig,
    /// `[images]`.
    pub images: ImagesConfig,
    /// `[agent]`.
    pub agent: AgentConfig,
    /// `[capture]`.
    pub capture: CaptureConfig,
    /// `[migration]`.
    pub migration: MigrationConfig,
    /// Socket mode parsed from `access.socket_mode`.
    pub socket_mode: u32,
    /// `[hardware]`.
    pub hardware: Hardware,
    /// `[networks.NAME]`, by name.
    pub networks: BTreeMap<String, Network>,
}

impl Config {
    /// Reads and validates a config file.
    ///
    /// # Errors
    /// [`ConfigError`] naming the file, key and problem.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { file: path.display().to_string(), source })?;
        let mut config = Config::parse(&text, path)?;
        let user = nix::unistd::User::from_name(&config.qemu.user).map_err(|e| ConfigError::Key {
            file: path.display().to_string(),
            key: "qemu.user".into(),
            problem: format!("cannot look up {:?}: {e}", config.qemu.user),
        })?;
        let user = user.ok_or_else(|| ConfigError::Key {
            file: path.display().to_string(),
            key: "qemu.user".into(),
            problem: format!(
                "no user {:?}: create it (adduser --system --group {0}) or name another",
                config.qemu.user
            ),
        })?;
        config.qemu_user = Some(UserIds { uid: user.uid.as_raw(), gid: user.gid.as_raw() });
        Ok(config)
    }

    /// Validates config text; `file` is only used in messages.
    ///
    /// # Errors
    /// [`ConfigError`] naming the file, key and problem.
    pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
        let fname = file.display().to_string();
        let value: toml::Value = toml::from_str(text)
            .map_err(|e| ConfigError::Syntax { file: fname.clone(), message: e.to_string().trim().to_string() })?;
        let mut raw: RawConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            ConfigError::Key { file: fname.clone(), key, problem: e.into_inner().to_string() }
        })?;
        let key_err = |key: &str, problem: String| ConfigError::Key { file: fname.clone(), key: key.into(), problem };

        for (key, p) in [
            ("paths.state", &raw.paths.state),
            ("paths.run", &raw.paths.run),
            ("paths.images", &raw.paths.images),
            ("paths.socket", &raw.paths.socket),
            ("qemu.binary", &raw.qemu.binary),
            ("qemu.img_binary", &raw.qemu.img_binary),
            ("qemu.swtpm", &raw.qemu.swtpm),
        ] {
            if !p.is_absolute() {
                return Err(key_err(key, format!("{} is not an absolute path", p.display())));
            }
        }
        for (key, p) in [
            ("firmware.uefi_code", &raw.firmware.uefi_code),
            ("firmware.uefi_vars", &raw.firmware.uefi_vars),
            ("firmware.uefi_secure_code", &raw.firmware.uefi_secure_code),
            ("firmware.uefi_secure_vars", &raw.firmware.uefi_secure_vars),
        ] {
            // Lexical, like paths.boot: Landlock grants the directory the path names
            // (docs/sandbox.md), which a `..` would make another one than it looks.
            let text = p.to_string_lossy();
            if !p.is_absolute() || text.split('/').any(|c| c == "." || c == "..") || p.file_name().is_none() {
                return Err(key_err(key, format!("{text:?} is not an absolute file path without . or .. components")));
            }
        }
        if !raw.images.curl.is_absolute() {
            return Err(key_err("images.curl", format!("{} is not an absolute path", raw.images.curl.display())));
        }
        if let Some(dir) = &raw.agent.files_dir {
            // Lexical, like paths.boot: a request names a path beneath it.
            let text = dir.to_string_lossy();
            if !dir.is_absolute() || text.split('/').any(|c| c == "." || c == "..") {
                return Err(key_err(
                    "agent.files_dir",
                    format!("{text:?} is not an absolute path without . or .. components"),
                ));
            }
        }
        if !(1..=MAX_FILE_MIB).contains(&raw.agent.max_file_mib) {
            return Err(key_err("agent.max_file_mib", format!("must be between 1 and {MAX_FILE_MIB}")));
        }
        let migration = MigrationConfig::check(std::mem::take(&mut raw.migration))
            .map_err(|(key, problem)| key_err(key, problem))?;
        if raw.images.download_ports.contains(&0) {
            return Err(key_err("images.download_ports", "0 is not a port".to_string()));
        }
        for (key, dir) in [("paths.import", &raw.paths.import), ("paths.backups", &raw.paths.backups)] {
            let Some(dir) = dir else { continue };
            // Lexical, like paths.boot: a request names one component below it.
            let text = dir.to_string_lossy();
            if !dir.is_absolute() || text.split('/').any(|c| c == "." || c == "..") {
                return Err(key_err(key, format!("{text:?} is not an absolute path without . or .. components")));
            }
        }
        for (i, dir) in raw.paths.boot.iter().flatten().enumerate() {
            // The same rule as a spec's boot paths: the directory check is lexical.
            let text = dir.to_string_lossy();
            if !dir.is_absolute() || text.split('/').any(|c| c == "." || c == "..") {
                return Err(key_err(
                    &format!("paths.boot[{i}]"),
                    format!("{text:?} is not an absolute path without . or .. components"),
                ));
            }
        }
        let socket_len = raw.paths.socket.as_os_str().len();
        if socket_len > 107 {
            return Err(key_err("paths.socket", format!("is {socket_len} bytes; a Unix socket path has at most 107")));
        }
        let run_len = raw.paths.run.as_os_str().len();
        if run_len > MAX_RUN_DIR_LEN {
            return Err(key_err(
                "paths.run",
                format!(
                    "is {run_len} bytes; at most {} so every VM socket path fits a Unix socket address",
                    MAX_RUN_DIR_LEN
                ),
            ));
        }
        if raw.qemu.machine.is_empty()
            || !raw.qemu.machine.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(key_err("qemu.machine", format!("{:?} is not a machine type name", raw.qemu.machine)));
        }
        if !raw.qemu.cpu_model.chars().all(|c| c.is_ascii_alphanumeric() || "-_.,=+".contains(c)) {
            return Err(key_err("qemu.cpu_model", format!("{:?} is not a CPU model", raw.qemu.cpu_model)));
        }
        if raw.qemu.launch_timeout_s == 0 {
            return Err(key_err("qemu.launch_timeout_s", "must be at least 1".into()));
        }
        if raw.qemu.hotplug_ports > MAX_HOTPLUG_PORTS {
            return Err(key_err(
                "qemu.hotplug_ports",
                format!(
                    "{} is more than {MAX_HOTPLUG_PORTS} (with 16 data disks the ports fill three PCI slots)",
                    raw.qemu.hotplug_ports
                ),
            ));
        }
        let user_ok = raw.qemu.user.len() <= 32
            && raw.qemu.user.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
            && raw.qemu.user.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_".contains(c));
        if !user_ok {
            return Err(key_err("qemu.user", format!("{:?} is not a user name", raw.qemu.user)));
        }
        for (key, value) in [("qemu.sha256", &mut raw.qemu.sha256), ("qemu.img_sha256", &mut raw.qemu.img_sha256)] {
            if let Some(text) = value {
                if text.len() != 64 || !text.chars().all(|c| c.is_ascii_hexdigit()) {
                    return Err(key_err(key, format!("{text:?} is not a sha256 (64 hex digits)")));
                }
                *text = text.to_ascii_lowercase();
            }
        }
        let overcommit = raw.storage.overcommit;
        if !(0.1..=100.0).contains(&overcommit) {
            return Err(key_err("storage.overcommit", format!("{overcommit} is not between 0.1 and 100")));
        }
        let storage = StorageConfig { overcommit_percent: (overcommit * 100.0).round() as u64 };
        if raw.logs.max_bytes < MIN_LOG_MAX_BYTES {
            return Err(key_err("logs.max_bytes", format!("must be at least {MIN_LOG_MAX_BYTES} (64 KiB)")));
        }
        let socket_mode = parse_mode(&raw.access.socket_mode).map_err(|p| key_err("access.socket_mode", p))?;
        if !(1..=86_400).contains(&raw.access.idle_timeout_s) {
            return Err(key_err("access.idle_timeout_s", "must be between 1 and 86400".into()));
        }

        let h = &raw.hardware;
        if h.cpu == 0 {
            return Err(key_err("hardware.cpu", "must be at least 1".into()));
        }
        if h.memory_gib == 0 {
            return Err(key_err("hardware.memory_gib", "must be at least 1".into()));
        }
        if h.reserved_cpu >= h.cpu {
            return Err(key_err(
                "hardware.reserved_cpu",
                format!("{} leaves no CPU for VMs (cpu = {})", h.reserved_cpu, h.cpu),
            ));
        }
        if h.reserved_memory_gib >= h.memory_gib {
            return Err(key_err(
                "hardware.reserved_memory_gib",
                format!("{} leaves no memory for VMs (memory_gib = {})", h.reserved_memory_gib, h.memory_gib),
            ));
        }
        let memory_mib =
            h.memory_gib.checked_mul(1024).ok_or_else(|| key_err("hardware.memory_gib", "too large".into()))?;
        let vm_cpus = match &h.vm_cpus {
            None => None,
            Some(text) => {
                let set = crate::placement::CpuSet::parse(text).map_err(|p| key_err("hardware.vm_cpus", p))?;
                if let Some(last) = set.last().filter(|&c| c >= h.cpu) {
                    return Err(key_err(
                        "hardware.vm_cpus",
                        format!("CPU {last} is not on this host (cpu = {}: CPUs 0-{})", h.cpu, h.cpu - 1),
                    ));
                }
                Some(set)
            }
        };

        let mut items = Vec::new();
        let mut seen: HashMap<PciAddress, String> = HashMap::new();
        for (class, table) in
            [(HardwareClass::Disk, &h.disk), (HardwareClass::Copper, &h.copper), (HardwareClass::Sfp, &h.sfp)]
        {
            for (index_text, value) in table {
                let key = format!("hardware.{class}.{index_text}");
                let index: u32 =
                    index_text.parse().ok().filter(|i: &u32| i.to_string() == *index_text).ok_or_else(|| {
                        key_err(&key, format!("index {index_text:?} is not a plain non-negative integer"))
                    })?;
                let (addr, identity) = model_entry(value).map_err(|(sub, p)| key_err(&format!("{key}{sub}"), p))?;
                if let Some(other) = seen.insert(addr, key.clone()) {
                    return Err(key_err(&key, format!("PCI address {addr} is already used by {other}")));
                }
                items.push((class, index, addr, identity));
            }
        }

        let mut networks = BTreeMap::new();
        let mut bridges: HashMap<&str, &str> = HashMap::new();
        for (name, n) in &raw.networks {
            let k = |key: &str| format!("networks.{name}.{key}");
            let name_ok = !name.is_empty()
                && name.len() <= 32
                && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
            if !name_ok {
                return Err(key_err(&format!("networks.{name}"), "network names are 1-32 of [a-z0-9_-]".into()));
            }
            if !is_valid_ifname(&n.bridge) {
                return Err(key_err(&k("bridge"), format!("{:?} is not an interface name (1-15 bytes)", n.bridge)));
            }
            if let Some(other) = bridges.insert(&n.bridge, name) {
                return Err(key_err(&k("bridge"), format!("bridge {} is already used by network {other}", n.bridge)));
            }
            if !n.create {
                for (key, set) in
                    [("uplink", n.uplink.is_some()), ("address", n.address.is_some()), ("mtu", n.mtu.is_some())]
                {
                    if set {
                        return Err(key_err(&k(key), "only valid with create = true".into()));
                    }
                }
            }
            if let Some(u) = &n.uplink {
                if !is_valid_ifname(u) || u == &n.bridge {
                    return Err(key_err(&k("uplink"), format!("{u:?} is not a usable interface name")));
                }
            }
            let address =
                n.address.as_deref().map(Ipv4Cidr::parse).transpose().map_err(|p| key_err(&k("address"), p))?;
            let subnet = n.subnet.as_deref().map(Ipv4Cidr::parse).transpose().map_err(|p| key_err(&k("subnet"), p))?;
            if let Some(s) = subnet {
                if s.addr != s.network() {
                    return Err(key_err(
                        &k("subnet"),
                        format!("{s} has host bits set (network is {}/{})", s.network(), s.prefix),
                    ));
                }
            }
            if let Some(a) = address {
                if a.is_network_or_broadcast() {
                    return Err(key_err(&k("address"), format!("{a} is a network or broadcast address")));
                }
            }
            if let (Some(a), Some(s)) = (address, subnet) {
                if !s.contains(a.addr) || a.prefix != s.prefix || a.is_network_or_broadcast() {
                    return Err(key_err(&k("address"), format!("{a} is not a host address of subnet {s}")));
                }
            }
            if !n.trunk.is_empty() && !n.vlan_filtering {
                return Err(key_err(&k("trunk"), "needs vlan_filtering = true".into()));
            }
            if !n.trunk.is_empty() && n.uplink.is_none() {
                return Err(key_err(&k("trunk"), "needs an uplink (the port the VLANs are tagged on)".into()));
            }
            if let Some(v) = n.trunk.iter().find(|v| !(1..=4094).contains(*v)) {
                return Err(key_err(&k("trunk"), format!("VLAN {v} is outside 1-4094")));
            }
            if let Some(m) = n.mtu {
                if !(68..=65535).contains(&m) {
                    return Err(key_err(&k("mtu"), format!("{m} is outside 68-65535")));
                }
            }
            networks.insert(
                name.clone(),
                Network {
                    name: name.clone(),
                    bridge: n.bridge.clone(),
                    create: n.create,
                    uplink: n.uplink.clone(),
                    address,
                    vlan_filtering: n.vlan_filtering,
                    trunk: n.trunk.clone(),
                    subnet,
                    mtu: n.mtu,
                },
            );
        }

        let mut seen = std::collections::HashSet::new();
        for (i, name) in raw.capture.interfaces.iter().enumerate() {
            if !is_valid_ifname(name) {
                return Err(key_err(&format!("capture.interfaces[{i}]"), format!("{name:?} is not an interface name")));
            }
            if !seen.insert(name) {
                return Err(key_err(&format!("capture.interfaces[{i}]"), format!("{name:?} is listed twice")));
            }
        }

        Ok(Config {
            networks,
            file: file.to_path_buf(),
            sandbox: raw.sandbox,
            seccomp: raw.seccomp,
            paths: raw.paths,
            qemu: raw.qemu,
            firmware: raw.firmware,
            qemu_user: None,
            access: raw.access,
            lifecycle: raw.lifecycle,
            logs: raw.logs,
            storage,
            images: raw.images,
            agent: raw.agent,
            capture: raw.capture,
            migration,
            socket_mode,
            hardware: Hardware {
                cpu: h.cpu,
                memory_mib,
                reserved_cpu: h.reserved_cpu,
                reserved_memory_mib: h.reserved_memory_gib * 1024,
                model: HardwareModel::with_identities(items),
                allow_raw_pci: h.allow_raw_pci,
                vm_cpus,
            },
        })
    }
}

/// One `[hardware.CLASS]` value: an address string, or a table `{ pci, id, subsystem, mac }`
/// pinning what the device at the address must be. An error is the key below the entry it is
/// about (`.id`, or empty for the entry itself) and the problem.
fn model_entry(value: &toml::Value) -> Result<(PciAddress, Option<DeviceIdentity>), (String, String)> {
    let table = match value {
        toml::Value::String(text) => return Ok((PciAddress::parse(text).map_err(|p| (String::new(), p))?, None)),
        toml::Value::Table(table) => table,
        other => {
            return Err((
                String::new(),
                format!(
                    "invalid type: {}, expected a PCI address string or a table {{ pci, id, subsystem, mac }}",
                    other.type_str()
                ),
            ))
        }
    };
    if let Some(unknown) = table.keys().find(|k| !["pci", "id", "subsystem", "mac"].contains(&k.as_str())) {
        return Err((format!(".{unknown}"), format!("unknown key {unknown:?}, expected pci, id, subsystem or mac")));
    }
    let text = |name: &str| -> Result<Option<&str>, (String, String)> {
        match table.get(name) {
            None => Ok(None),
            Some(toml::Value::String(t)) => Ok(Some(t.as_str())),
            Some(other) => Err((format!(".{name}"), format!("invalid type: {}, expected a string", other.type_str()))),
        }
    };
    let field = |name: &'static str| move |p: String| (format!(".{name}"), p);
    let addr_text =
        text("pci")?.ok_or_else(|| (String::new(), "the table form needs pci (the address)".to_string()))?;
    let addr = PciAddress::parse(addr_text).map_err(field("pci"))?;
    let id_text = text("id")?.ok_or_else(|| (String::new(), "the table form needs id (\"vvvv:dddd\")".to_string()))?;
    let (vendor, device) = DeviceIdentity::parse_ids(id_text).map_err(field("id"))?;
    let subsystem = text("subsystem")?.map(DeviceIdentity::parse_ids).transpose().map_err(field("subsystem"))?;
    let mac = text("mac")?.map(DeviceIdentity::parse_mac).transpose().map_err(field("mac"))?;
    Ok((addr, Some(DeviceIdentity { vendor, device, subsystem, mac })))
}

fn parse_mode(text: &str) -> Result<u32, String> {
    let digits = text.strip_prefix("0o").unwrap_or(text);
    match u32::from_str_radix(digits, 8) {
        Ok(m) if m <= 0o777 && !digits.is_empty() => Ok(m),
        _ => Err(format!("{text:?} is not an octal file mode like \"0660\"")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
[paths]
state = "/var/lib/vmhost"
run = "/run/vmhost"
images = "/var/lib/vmhost/images"
socket = "/run/vmhost/vmhostd.sock"
[qemu]
binary = "/usr/bin/qemu-system-x86_64"
accel = "tcg"
[access]
admin_group = "vmhost"
readonly_group = "vmhost-ro"
[hardware]
cpu = 32
memory_gib = 256
reserved_cpu = 2
reserved_memory_gib = 8
[hardware.disk]
1 = "0000:c7:00.0"
[hardware.copper]
1 = "pci_0000_c8_00_0"
[hardware.sfp]
5 = "0000:ca:00.0"
"#;

    fn parse(t: &str) -> Result<Config, ConfigError> {
        Config::parse(t, Path::new("/etc/vmhost/vmhostd.toml"))
    }

    /// docs/config.md's table of example errors shows what the daemon prints: each of these
    /// configs' error, after `FILE: `, is in the table verbatim (the "unknown section" row once
    /// listed seven of the twelve sections).
    #[test]
    fn config_md_example_errors_are_the_real_ones() {
        let doc = include_str!("../../docs/config.md");
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let cases = [
            "[hardwre]\n".to_string(),
            format!("{hw}colour = 1\n"),
            format!("sandbox = \"on\"\n{hw}"),
            format!("seccomp = \"kill\"\n{hw}"),
            format!("[qemu]\naccel = \"hvf\"\n{hw}"),
            "[hardware]\ncpu = \"four\"\nmemory_gib = 8\n".to_string(),
            "[hardware]\ncpu = -1\nmemory_gib = 8\n".to_string(),
            "[hardware]\ncpu = 0\nmemory_gib = 8\n".to_string(),
            "[hardware]\ncpu = 4\n".to_string(),
            "[hardware]\ncpu = 4\nmemory_gib = 8\nreserved_memory_gib = 8\n".to_string(),
            format!("[paths]\nstate = \"var/lib/vmhost\"\n{hw}"),
            format!("[access]\nsocket_mode = \"0999\"\n{hw}"),
            format!("[access]\nsocket_mode = 660\n{hw}"),
            format!("[qemu]\nlaunch_timeout_s = 0\n{hw}"),
            format!("[qemu]\nhotplug_ports = 9\n{hw}"),
            format!("[qemu]\nhotplug_ports = -1\n{hw}"),
            format!("[agent]\nfiles_dir = \"files\"\n{hw}"),
            format!("[agent]\nmax_file_mib = 0\n{hw}"),
            format!("{hw}vm_cpus = \"8-2\"\n"),
            format!("{hw}vm_cpus = \"0-4\"\n"),
            format!("{hw}[hardware.sfp]\nfive = \"0000:ca:00.0\"\n"),
            format!("{hw}[hardware.sfp]\n5 = \"ca:00\"\n"),
            format!("{hw}[hardware.sfp]\n5 = {{ pci = \"ca:00.0\" }}\n"),
            format!("{hw}[hardware.sfp]\n5 = {{ pci = \"ca:00.0\", id = \"8086\" }}\n"),
            format!("{hw}[hardware.sfp]\n5 = {{ pci = \"ca:00.0\", id = \"8086:1572\", mac = \"3c:fd:fe:aa:bb\" }}\n"),
            format!("{hw}[hardware.sfp]\n5 = {{ pci = \"ca:00.0\", id = \"8086:1572\", serial = \"x\" }}\n"),
            format!("{hw}[hardware.sfp]\n5 = 7\n"),
            format!("{hw}[networks.lan]\nsubnet = \"10.0.0.0/24\"\n"),
            format!("{hw}[networks.LAN]\nbridge = \"br0\"\n"),
            format!("[capture]\ninterfaces = [\"eth/1\"]\n{hw}"),
            format!("[capture]\ninterfaces = [\"eth0\", \"eth0\"]\n{hw}"),
            format!("[migration]\nlisten = \"host1:7070\"\n{hw}"),
            format!("[migration]\nlisten = \"0.0.0.0:7070\"\n{hw}"),
            format!("[migration]\nadvertise = \"host1:7070\"\n{hw}"),
        ];
        for config in cases {
            let error = parse(&config).expect_err(&config).to_string();
            let shown = error.lines().next().unwrap_or_default();
            let shown = shown.strip_prefix("/etc/vmhost/vmhostd.toml: ").unwrap_or(shown);
            // Markdown needs a space between a code span's last backtick and the closing ``.
            let pad = if shown.ends_with('`') { " " } else { "" };
            let cell = format!("``{shown}{pad}``");
            assert!(doc.contains(&cell), "docs/config.md lacks the error of {config:?}: {cell}");
        }
    }

    fn key_error(t: &str) -> (String, String) {
        match parse(t) {
            Err(ConfigError::Key { key, problem, .. }) => (key, problem),
            other => panic!("expected a key error, got {other:?}"),
        }
    }

    #[test]
    fn migration_section_is_checked() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let c = parse(hw).unwrap();
        assert_eq!(c.migration, MigrationConfig::default());
        assert_eq!(c.migration.listen, None);
        assert_eq!(c.migration.prepare_timeout_s, 300);
        let c = parse(&format!("[migration]\nlisten = \"192.0.2.1:7070\"\n{hw}")).unwrap();
        assert_eq!(c.migration.listen, Some("192.0.2.1:7070".parse().unwrap()));
        assert_eq!(c.migration.advertise.as_deref(), Some("192.0.2.1:7070"));
        let c = parse(&format!(
            "[migration]\nlisten = \"[::]:7070\"\nadvertise = \"h.example:7\"\nprepare_timeout_s = 9\n{hw}"
        ))
        .unwrap();
        assert_eq!(c.migration.advertise.as_deref(), Some("h.example:7"));
        assert_eq!(c.migration.prepare_timeout_s, 9);
        for (section, key) in [
            ("listen = \"192.0.2.1\"", "migration.listen"),
            ("listen = \"192.0.2.1:0\"", "migration.listen"),
            ("listen = \"[::]:7070\"", "migration.advertise"),
            ("listen = \"192.0.2.1:7070\"\nadvertise = \"h\"", "migration.advertise"),
            ("listen = \"192.0.2.1:7070\"\nadvertise = \":7070\"", "migration.advertise"),
            ("listen = \"192.0.2.1:7070\"\nadvertise = \"h:0\"", "migration.advertise"),
            ("prepare_timeout_s = 0", "migration.prepare_timeout_s"),
            ("port = 7070", "migration.port"),
        ] {
            let (k, problem) = key_error(&format!("[migration]\n{section}\n{hw}"));
            assert_eq!(k, key, "{section}: {problem}");
        }
    }

    #[test]
    fn full_example_parses() {
        let c = parse(FULL).unwrap();
        assert_eq!(c.qemu.accel, Accel::Tcg);
        assert_eq!(c.hardware.memory_mib, 256 * 1024);
        assert_eq!(c.hardware.reserved_memory_mib, 8 * 1024);
        assert_eq!(c.socket_mode, 0o666);
        assert_eq!(c.hardware.model.len(), 3);
        assert_eq!(c.hardware.model.get(HardwareClass::Copper, 1).unwrap().to_string(), "0000:c8:00.0");
        assert_eq!(c.hardware.model.get(HardwareClass::Sfp, 5).unwrap().to_string(), "0000:ca:00.0");
        assert!(c.hardware.model.get(HardwareClass::Sfp, 1).is_none());
    }

    #[test]
    fn vm_cpus_is_a_cpulist_of_the_hosts_cpus() {
        let hw = "[hardware]\ncpu = 8\nmemory_gib = 8\n";
        assert_eq!(parse(hw).unwrap().hardware.vm_cpus, None);
        let c = parse(&format!("{hw}vm_cpus = \"2-5,7\"\n")).unwrap();
        assert_eq!(c.hardware.vm_cpus.map(|s| s.to_string()).as_deref(), Some("2-5,7"));
        for (text, why) in
            [("\"\"", "empty"), ("\"2-8\"", "CPU 8 is not on this host"), ("\"x\"", "not a CPU"), ("5", "invalid type")]
        {
            let (key, problem) = key_error(&format!("{hw}vm_cpus = {text}\n"));
            assert_eq!(key, "hardware.vm_cpus", "{text}");
            assert!(problem.contains(why), "{text}: {problem}");
        }
    }

    #[test]
    fn minimal_config_defaults_to_kvm() {
        let c = parse("[hardware]\ncpu = 4\nmemory_gib = 8\n").unwrap();
        assert_eq!(c.qemu.accel, Accel::Kvm);
        assert_eq!(c.paths.socket, PathBuf::from("/run/vmhost/vmhostd.sock"));
        assert!(c.hardware.model.is_empty());
        assert_eq!(c.logs.max_bytes, 16 * 1024 * 1024);
    }

    #[test]
    fn log_cap_is_configurable_within_a_floor() {
        let c = parse("[logs]\nmax_bytes = 262144\n[hardware]\ncpu = 4\nmemory_gib = 8\n").unwrap();
        assert_eq!(c.logs.max_bytes, 256 * 1024);
        let (key, problem) = key_error("[logs]\nmax_bytes = 4096\n[hardware]\ncpu = 4\nmemory_gib = 8\n");
        assert_eq!((key.as_str(), problem.contains("64 KiB")), ("logs.max_bytes", true), "{problem}");
        let (key, _) = key_error("[logs]\nmax_files = 2\n[hardware]\ncpu = 4\nmemory_gib = 8\n");
        assert_eq!(key, "logs.max_files");
    }

    #[test]
    fn storage_overcommit_is_a_ratio_within_bounds() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        assert_eq!(parse(hw).unwrap().storage.overcommit_percent, 100);
        assert_eq!(parse(&format!("[storage]\novercommit = 2.5\n{hw}")).unwrap().storage.overcommit_percent, 250);
        for bad in ["0.0", "0.05", "101.0", "-1.0"] {
            let (key, _) = key_error(&format!("[storage]\novercommit = {bad}\n{hw}"));
            assert_eq!(key, "storage.overcommit", "{bad}");
        }
        let (key, _) = key_error(&format!("[storage]\nreserve = 1\n{hw}"));
        assert_eq!(key, "storage.reserve");
    }

    #[test]
    fn sandbox_modes_parse() {
        let c = parse("[hardware]\ncpu = 4\nmemory_gib = 8\n").unwrap();
        assert_eq!((c.sandbox, c.seccomp), (SandboxMode::BestEffort, SeccompMode::Enforce));
        for (text, mode) in
            [("require", SandboxMode::Require), ("best-effort", SandboxMode::BestEffort), ("off", SandboxMode::Off)]
        {
            let c = parse(&format!("sandbox = \"{text}\"\nseccomp = \"log\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n"))
                .unwrap();
            assert_eq!(c.sandbox, mode);
            assert_eq!(c.sandbox.as_str(), text);
            assert_eq!(c.seccomp, SeccompMode::Log);
        }
        let (key, problem) = key_error("sandbox = \"on\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n");
        assert_eq!(key, "sandbox");
        assert!(problem.contains("require"), "{problem}");
        let (key, _) = key_error("seccomp = \"kill\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n");
        assert_eq!(key, "seccomp");
    }

    #[test]
    fn syntax_error_names_file() {
        let e = parse("[hardware\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/vmhost/vmhostd.toml: invalid TOML"), "{e}");
    }

    #[test]
    fn errors_name_the_key() {
        let cases: &[(&str, &str, &str)] = &[
            ("[hardware]\ncpu = 4\n", "hardware", "memory_gib"),
            ("[hardware]\ncpu = 4\nmemory_gib = 8\ncolour = 1\n", "hardware.colour", "colour"),
            ("[hardware]\ncpu = \"x\"\nmemory_gib = 8\n", "hardware.cpu", "string"),
            ("[qemu]\naccel = \"hvf\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n", "qemu.accel", "hvf"),
            ("[hardware]\ncpu = 4\nmemory_gib = 8\nreserved_cpu = 4\n", "hardware.reserved_cpu", "no CPU"),
            ("[hardware]\ncpu = 4\nmemory_gib = 8\nreserved_memory_gib = 9\n", "hardware.reserved_memory_gib", "no memory"),
            ("[hardware]\ncpu = 0\nmemory_gib = 8\n", "hardware.cpu", "at least 1"),
            ("[paths]\nrun = \"/run/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n", "paths.run", "Unix socket"),
            ("[paths]\nstate = \"rel\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n", "paths.state", "absolute"),
            ("[access]\nsocket_mode = \"999\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n", "access.socket_mode", "octal"),
            ("[access]\nidle_timeout_s = 0\n[hardware]\ncpu = 4\nmemory_gib = 8\n", "access.idle_timeout_s", "between"),
            ("[hardware]\ncpu = 4\nmemory_gib = 8\n[hardware.sfp]\nx = \"0000:ca:00.0\"\n", "hardware.sfp.x", "index"),
            ("[hardware]\ncpu = 4\nmemory_gib = 8\n[hardware.sfp]\n05 = \"0000:ca:00.0\"\n", "hardware.sfp.05", "plain"),
            ("[paths]\nsocket = \"/{long}\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n", "paths.socket", "107"),
            ("[hardware]\ncpu = 4\nmemory_gib = 8\n[hardware.sfp]\n5 = \"ca:00\"\n", "hardware.sfp.5", "PCI"),
            (
                "[hardware]\ncpu = 4\nmemory_gib = 8\n[hardware.sfp]\n5 = \"ca:00.0\"\n[hardware.copper]\n1 = \"pci_0000_ca_00_0\"\n",
                "hardware.sfp.5",
                "already used by hardware.copper.1",
            ),
            ("[qemu]\nmachine = \"q35,accel=kvm\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n", "qemu.machine", "machine"),
            ("[qemu]\ncpu_model = \"host -x\"\n[hardware]\ncpu = 4\nmemory_gib = 8\n", "qemu.cpu_model", "CPU model"),
        ];
        for (text, want_key, want_problem) in cases {
            let text = text.replace("{long}", &"s".repeat(110));
            let (key, problem) = key_error(&text);
            assert_eq!(&key, want_key, "{text}");
            assert!(problem.contains(want_problem), "{text}: {problem}");
        }
    }

    #[test]
    fn model_entries_may_pin_the_device_identity() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let c = parse(&format!(
            "{hw}[hardware.sfp]\n5 = {{ pci = \"0000:07:00.0\", id = \"8086:1572\", subsystem = \"8086:0007\", \
             mac = \"3C:FD:FE:aa:bb:cc\" }}\n6 = {{ pci = \"08:00.0\", id = \"15AD:07b0\" }}\n7 = \"0000:09:00.0\"\n"
        ))
        .unwrap();
        let m = &c.hardware.model;
        assert_eq!(m.get(HardwareClass::Sfp, 5).unwrap().to_string(), "0000:07:00.0");
        assert_eq!(
            m.identity(HardwareClass::Sfp, 5),
            Some(DeviceIdentity {
                vendor: 0x8086,
                device: 0x1572,
                subsystem: Some((0x8086, 7)),
                mac: Some([0x3c, 0xfd, 0xfe, 0xaa, 0xbb, 0xcc]),
            })
        );
        assert_eq!(
            m.identity(HardwareClass::Sfp, 6),
            Some(DeviceIdentity { vendor: 0x15ad, device: 0x07b0, subsystem: None, mac: None })
        );
        assert_eq!(m.get(HardwareClass::Sfp, 6).unwrap().to_string(), "0000:08:00.0");
        assert_eq!(m.identity(HardwareClass::Sfp, 7), None);
        assert_eq!(m.len(), 3);

        let sfp = |entry: &str| format!("{hw}[hardware.sfp]\n5 = {entry}\n");
        let cases = [
            (sfp("{ pci = \"0000:07:00.0\", id = \"8086\" }"), "hardware.sfp.5.id", "vvvv:dddd"),
            (sfp("{ pci = \"0000:07:00.0\", id = \"8086:zzzz\" }"), "hardware.sfp.5.id", "PCI id pair"),
            (sfp("{ pci = \"0000:07:00.0\" }"), "hardware.sfp.5", "needs id"),
            (sfp("{ id = \"8086:1572\" }"), "hardware.sfp.5", "needs pci"),
            (sfp("{ pci = \"07:00\", id = \"8086:1572\" }"), "hardware.sfp.5.pci", "PCI address"),
            (sfp("{ pci = \"0000:07:00.0\", id = \"8086:1572\", subsystem = \"8086\" }"), "hardware.sfp.5.subsystem", "vvvv:dddd"),
            (sfp("{ pci = \"0000:07:00.0\", id = \"8086:1572\", mac = \"3c:fd:fe:aa:bb\" }"), "hardware.sfp.5.mac", "MAC"),
            (sfp("{ pci = \"0000:07:00.0\", id = \"8086:1572\", serial = \"x\" }"), "hardware.sfp.5.serial", "unknown key"),
            (sfp("{ pci = \"0000:07:00.0\", id = 8086 }"), "hardware.sfp.5.id", "integer"),
            (sfp("7"), "hardware.sfp.5", "PCI address string or a table"),
            (
                format!("{hw}[hardware.sfp]\n5 = {{ pci = \"07:00.0\", id = \"8086:1572\" }}\n[hardware.copper]\n1 = \"0000:07:00.0\"\n"),
                "hardware.sfp.5",
                "already used by hardware.copper.1",
            ),
        ];
        for (text, want_key, want_problem) in cases {
            let (key, problem) = key_error(&text);
            assert_eq!(key, want_key, "{text}");
            assert!(problem.contains(want_problem), "{text}: {problem}");
        }
    }

    const NETS: &str = "[hardware]\ncpu = 4\nmemory_gib = 8\n";

    #[test]
    fn networks_parse() {
        let c = parse(&format!(
            "{NETS}[networks.lan]\nbridge = \"br-lan\"\ncreate = true\naddress = \"10.0.0.1/24\"\nsubnet = \"10.0.0.0/24\"\nmtu = 9000\n\
             [networks.trunk]\nbridge = \"br0\"\ncreate = true\nuplink = \"eth1\"\nvlan_filtering = true\ntrunk = [10, 20]\n"
        ))
        .unwrap();
        let lan = &c.networks["lan"];
        assert!(lan.create);
        assert_eq!(lan.address.unwrap().to_string(), "10.0.0.1/24");
        assert_eq!(lan.mtu, Some(9000));
        assert_eq!(c.networks["trunk"].trunk, vec![10, 20]);
    }

    #[test]
    fn network_errors_name_the_key() {
        let cases: &[(&str, &str, &str)] = &[
            ("[networks.lan]\n", "networks.lan", "bridge"),
            ("[networks.lan]\nbridge = \"a-name-far-too-long\"\n", "networks.lan.bridge", "interface name"),
            ("[networks.Lan]\nbridge = \"br0\"\n", "networks.Lan", "network names"),
            ("[networks.a]\nbridge = \"br0\"\n[networks.b]\nbridge = \"br0\"\n", "networks.b.bridge", "already used"),
            ("[networks.a]\nbridge = \"br0\"\naddress = \"10.0.0.1/24\"\n", "networks.a.address", "create = true"),
            ("[networks.a]\nbridge = \"br0\"\ncreate = true\nuplink = \"br0\"\n", "networks.a.uplink", "usable"),
            ("[networks.a]\nbridge = \"br0\"\nsubnet = \"10.0.0.1/24\"\n", "networks.a.subnet", "host bits"),
            (
                "[networks.a]\nbridge = \"br0\"\ncreate = true\nsubnet = \"10.0.0.0/24\"\naddress = \"10.0.1.1/24\"\n",
                "networks.a.address",
                "not a host address",
            ),
            ("[networks.a]\nbridge = \"br0\"\ntrunk = [10]\n", "networks.a.trunk", "vlan_filtering"),
            ("[networks.a]\nbridge = \"br0\"\nvlan_filtering = true\ntrunk = [10]\n", "networks.a.trunk", "uplink"),
            ("[networks.a]\nbridge = \"br0\"\ncreate = true\naddress = \"10.0.0.0/24\"\n", "networks.a.address", "network or broadcast"),
            ("[networks.a]\nbridge = \"br0\"\ncreate = true\nuplink = \"e1\"\nvlan_filtering = true\ntrunk = [4095]\n", "networks.a.trunk", "1-4094"),
            ("[networks.a]\nbridge = \"br0\"\ncreate = true\nmtu = 20\n", "networks.a.mtu", "68-65535"),
            ("[networks.a]\nbridge = \"br0\"\nsubnet = \"10.0.0.0\"\n", "networks.a.subnet", "prefix"),
        ];
        for (text, want_key, want_problem) in cases {
            let (key, problem) = key_error(&format!("{NETS}{text}"));
            assert_eq!(&key, want_key, "{text}");
            assert!(problem.contains(want_problem), "{text}: {problem}");
        }
    }

    #[test]
    fn qemu_user_is_a_name_resolved_on_load() {
        let base = "[hardware]\ncpu = 2\nmemory_gib = 2\n";
        let parsed = Config::parse(base, Path::new("t.toml")).unwrap();
        assert_eq!((parsed.qemu.user.as_str(), parsed.qemu.sandbox, parsed.qemu_user), (DEFAULT_QEMU_USER, true, None));
        for bad in ["", "Root", "a b", "x,y", "-x", &"a".repeat(33)] {
            let (key, problem) = key_error(&format!("[qemu]\nuser = {bad:?}\n{base}"));
            assert_eq!(key, "qemu.user", "{bad:?}");
            assert!(problem.contains("not a user name"), "{problem}");
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("vmhostd.toml");
        std::fs::write(&file, format!("[qemu]\nuser = \"root\"\nsandbox = false\n{base}")).unwrap();
        let loaded = Config::load(&file).unwrap();
        assert_eq!(loaded.qemu_user, Some(UserIds { uid: 0, gid: 0 }));
        assert!(!loaded.qemu.sandbox);
        std::fs::write(&file, format!("[qemu]\nuser = \"no-such-user-here\"\n{base}")).unwrap();
        match Config::load(&file) {
            Err(ConfigError::Key { key, problem, .. }) => {
                assert_eq!(key, "qemu.user");
                assert!(problem.contains("no user \"no-such-user-here\""), "{problem}");
            }
            other => panic!("expected a qemu.user error, got {other:?}"),
        }
    }

    #[test]
    fn images_fetch_with_curl_on_the_web_ports_unless_configured() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let c = parse(hw).unwrap();
        assert_eq!(
            (c.images.curl.as_path(), c.images.download_ports.as_slice()),
            (Path::new("/usr/bin/curl"), &[80u16, 443][..])
        );
        let c = parse(&format!("[images]\ncurl = \"/opt/curl\"\ndownload_ports = [8080]\n{hw}")).unwrap();
        assert_eq!(
            (c.images.curl.as_path(), c.images.download_ports.as_slice()),
            (Path::new("/opt/curl"), &[8080u16][..])
        );
        assert_eq!(key_error(&format!("[images]\ncurl = \"curl\"\n{hw}")).0, "images.curl");
        assert_eq!(key_error(&format!("[images]\ndownload_ports = [0]\n{hw}")).0, "images.download_ports");
        use crate::images::address::{AllowPrivate, Network};
        assert_eq!(c.images.allow_private, AllowPrivate::No, "public addresses only by default");
        let c = parse(&format!("[images]\nallow_private = true\n{hw}")).unwrap();
        assert_eq!(c.images.allow_private, AllowPrivate::All);
        let c = parse(&format!("[images]\nallow_private = [\"10.1.0.0/16\", \"fd00::/8\"]\n{hw}")).unwrap();
        let nets = vec![Network::parse("10.1.0.0/16").unwrap(), Network::parse("fd00::/8").unwrap()];
        assert_eq!(c.images.allow_private, AllowPrivate::Networks(nets));
        assert!(parse(&format!("[images]\nallow_private = [\"10.1.0.1/16\"]\n{hw}")).is_err());
        assert!(parse(&format!("[images]\nallow_private = \"yes\"\n{hw}")).is_err());
    }

    #[test]
    fn the_backups_dir_defaults_to_the_state_dir_and_must_be_absolute() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let c = parse(&format!("[paths]\nstate = \"/srv/vmhost\"\n{hw}")).unwrap();
        assert_eq!(c.paths.backups_dir(), PathBuf::from("/srv/vmhost/backups"));
        let c = parse(&format!("[paths]\nbackups = \"/backup/vmhost\"\n{hw}")).unwrap();
        assert_eq!(c.paths.backups_dir(), PathBuf::from("/backup/vmhost"));
        for bad in ["backups", "/a/../b", "/a/./b"] {
            assert_eq!(key_error(&format!("[paths]\nbackups = \"{bad}\"\n{hw}")).0, "paths.backups", "{bad}");
        }
    }

    #[test]
    fn the_import_dir_defaults_to_the_state_dir_and_must_be_absolute() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let c = parse(&format!("[paths]\nstate = \"/srv/vmhost\"\n{hw}")).unwrap();
        assert_eq!(c.paths.import_dir(), PathBuf::from("/srv/vmhost/import"));
        let c = parse(&format!("[paths]\nimport = \"/srv/vmhost/incoming\"\n{hw}")).unwrap();
        assert_eq!(c.paths.import_dir(), PathBuf::from("/srv/vmhost/incoming"));
        for bad in ["incoming", "/srv/../etc"] {
            match parse(&format!("[paths]\nimport = \"{bad}\"\n{hw}")) {
                Err(ConfigError::Key { key, .. }) => assert_eq!(key, "paths.import", "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn boot_dirs_default_to_the_images_dir_and_can_be_set() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let c = parse(&format!("[paths]\nimages = \"/srv/images\"\n{hw}")).unwrap();
        assert_eq!(c.paths.boot_dirs(), vec![PathBuf::from("/srv/images"), PathBuf::from(DEFAULT_BOOT_DIR)]);
        let c = parse(&format!("[paths]\nboot = [\"/srv/kernels\", \"/boot\"]\n{hw}")).unwrap();
        assert_eq!(c.paths.boot_dirs(), vec![PathBuf::from("/srv/kernels"), PathBuf::from("/boot")]);
        let c = parse(&format!("[paths]\nboot = []\n{hw}")).unwrap();
        assert!(c.paths.boot_dirs().is_empty(), "an empty list allows no direct-kernel boot");
        for bad in ["kernels", "/srv/../etc", "/srv/./k"] {
            let (key, _) = key_error(&format!("[paths]\nboot = [\"/ok\", \"{bad}\"]\n{hw}"));
            assert_eq!(key, "paths.boot[1]", "{bad}");
        }
    }

    #[test]
    fn uefi_firmware_files_default_to_debians_ovmf_and_must_be_absolute() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let c = parse(hw).unwrap();
        assert_eq!(c.firmware.uefi_code, PathBuf::from("/usr/share/OVMF/OVMF_CODE_4M.fd"));
        assert_eq!(c.firmware.uefi_vars, PathBuf::from("/usr/share/OVMF/OVMF_VARS_4M.fd"));
        let c =
            parse(&format!("[firmware]\nuefi_code = \"/opt/edk2/code.fd\"\nuefi_vars = \"/opt/edk2/vars.fd\"\n{hw}"))
                .unwrap();
        assert_eq!(
            (c.firmware.uefi_code.as_path(), c.firmware.uefi_vars.as_path()),
            (Path::new("/opt/edk2/code.fd"), Path::new("/opt/edk2/vars.fd"))
        );
        for (key, bad) in [
            ("uefi_code", "OVMF_CODE_4M.fd"),
            ("uefi_vars", "/usr/share/OVMF/../x.fd"),
            ("uefi_code", "/"),
            ("uefi_vars", "/usr/./share/vars.fd"),
        ] {
            let (got, problem) = key_error(&format!("[firmware]\n{key} = \"{bad}\"\n{hw}"));
            assert_eq!(got, format!("firmware.{key}"), "{bad}");
            assert!(problem.contains("absolute"), "{problem}");
        }
        let (key, _) = key_error(&format!("[firmware]\nsecure_boot = true\n{hw}"));
        assert_eq!(key, "firmware.secure_boot");
        assert_eq!(
            (c.firmware.uefi_secure_code.as_path(), c.firmware.uefi_secure_vars.as_path()),
            (Path::new("/usr/share/OVMF/OVMF_CODE_4M.secboot.fd"), Path::new("/usr/share/OVMF/OVMF_VARS_4M.ms.fd")),
            "the secure pair defaults to Debian's, beside a plain pair set in the file"
        );
        let c = parse(&format!("[firmware]\nuefi_secure_vars = \"/srv/fw/VARS.snakeoil.fd\"\n{hw}")).unwrap();
        assert_eq!(c.firmware.uefi_secure_vars, PathBuf::from("/srv/fw/VARS.snakeoil.fd"));
        for key in ["uefi_secure_code", "uefi_secure_vars"] {
            let (got, problem) = key_error(&format!("[firmware]\n{key} = \"fw/x.fd\"\n{hw}"));
            assert_eq!(got, format!("firmware.{key}"));
            assert!(problem.contains("absolute"), "{problem}");
        }
    }

    #[test]
    fn agent_exec_is_off_by_default_and_files_dir_must_be_absolute() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let c = parse(hw).unwrap();
        assert_eq!(c.agent, AgentConfig { allow_exec: false, files_dir: None, max_file_mib: 64 });
        let c = parse(&format!("[agent]\nallow_exec = true\nfiles_dir = \"/srv/f\"\nmax_file_mib = 8\n{hw}")).unwrap();
        assert_eq!(c.agent, AgentConfig { allow_exec: true, files_dir: Some("/srv/f".into()), max_file_mib: 8 });
        for bad in ["files_dir = \"/srv/../etc\"", "max_file_mib = 4097", "allow = true"] {
            assert!(parse(&format!("[agent]\n{bad}\n{hw}")).is_err(), "{bad}");
        }
    }

    #[test]
    fn missing_file_is_a_read_error() {
        let e = Config::load(Path::new("/nonexistent/vmhostd.toml")).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }));
        assert!(e.to_string().contains("/nonexistent/vmhostd.toml"));
    }

    #[test]
    fn capture_interfaces_are_names_without_repeats() {
        let hw = "[hardware]\ncpu = 4\nmemory_gib = 8\n";
        let c = parse(&format!("[capture]\ninterfaces = [\"eth1\", \"bond0.100\"]\n{hw}")).unwrap();
        assert_eq!(c.capture.interfaces, ["eth1", "bond0.100"]);
        assert!(parse(hw).unwrap().capture.interfaces.is_empty(), "none by default");
        for (list, key, problem) in [
            (r#"["eth1", "eth/1"]"#, "capture.interfaces[1]", "not an interface name"),
            (r#"[""]"#, "capture.interfaces[0]", "not an interface name"),
            (r#"["a-name-far-too-long"]"#, "capture.interfaces[0]", "not an interface name"),
            (r#"["eth1", "eth2", "eth1"]"#, "capture.interfaces[2]", "listed twice"),
        ] {
            let (k, p) = key_error(&format!("[capture]\ninterfaces = {list}\n{hw}"));
            assert_eq!(k, key, "{list}");
            assert!(p.contains(problem), "{list}: {p}");
        }
        let (k, _) = key_error(&format!("[capture]\nnics = []\n{hw}"));
        assert_eq!(k, "capture.nics");
    }
}
