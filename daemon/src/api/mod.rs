//! API v1 wire types, shared by the daemon, `vmhostctl`, the benchmark and the tests.
//!
//! Everything a client sends is deserialized into these closed types (`deny_unknown_fields`), so
//! an unknown or misspelt field is an error rather than silently ignored. Field-level rules
//! (name syntax, sizes, hardware) live in [`crate::validate`], not here: these types only fix the
//! shape.

pub mod backup;
pub mod disks;
pub mod error;
pub mod exec;
pub mod housekeeping;
pub mod images;
pub mod migration;
pub mod snapshots;
pub mod stats;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::PathBuf;

pub use disks::{DataDiskSpec, DiskAio, DiskCache, DiskFormat, KeptDisk};
pub use error::{ApiError, Code};
pub use housekeeping::{SshSpec, StopMethod};

/// Protocol version reported by `host.info`.
pub const API_VERSION: u32 = 1;

// The methods themselves (names, access, params types) are listed once, in
// `crate::rpc::methods::METHODS`.

/// Name of the JSON-RPC notification carrying an [`Event`].
pub const EVENT_NOTIFICATION: &str = "events.event";

/// The state an operator wants a VM in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DesiredState {
    /// QEMU should be running (default).
    #[default]
    Running,
    /// Defined, resources held, no process.
    Stopped,
}

/// What vmhostd does when a VM's QEMU ends without vmhostd asking (docs/lifecycle.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestartPolicy {
    /// Restart after a crash or kill (with backoff); a guest that powers itself off is `stopped`.
    #[default]
    OnFailure,
    /// Restart after any exit, a guest power-off included.
    Always,
    /// Never restart: a crash leaves the VM `dead`, a guest power-off `stopped`.
    Never,
}

impl RestartPolicy {
    /// True for the default (`on-failure`), which specs and views leave out.
    pub fn is_default(&self) -> bool {
        *self == RestartPolicy::OnFailure
    }
}

/// A VM as the operator declares it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    /// `^[a-z0-9][a-z0-9_-]{0,62}$` (the guest's hostname is the name with `_` as `-`).
    pub name: String,
    /// Free-form role label (Security Onion: sensor, searchnode, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Virtual CPUs.
    pub cpu: u32,
    /// Guest memory in MiB.
    pub memory_mib: u64,
    /// Desired run state.
    #[serde(default)]
    pub state: DesiredState,
    /// Passthrough hardware by model index.
    #[serde(default, skip_serializing_if = "HardwareRequest::is_empty")]
    pub hardware: HardwareRequest,
    /// Passthrough devices by PCI address; only when the host sets `hardware.allow_raw_pci`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pci: Vec<String>,
    /// How the VM boots.
    pub boot: BootSpec,
    /// Data disks after the boot disk, in guest order (`vdb`, `vdc`, ... after an image's
    /// `vda`); at most [`disks::MAX_DATA_DISKS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DataDiskSpec>,
    /// Network interfaces, in guest PCI order (eth0, eth1, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<NicSpec>,
    /// Extra interfaces the guest agent creates and proves (VLANs over a NIC, dummies); changed
    /// live, without recreating the VM.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guest_interfaces: Vec<vmhost_agent_protocol::DesiredInterface<u16>>,
    /// What happens when QEMU ends without vmhostd asking; changed without a restart.
    #[serde(default, skip_serializing_if = "RestartPolicy::is_default")]
    pub restart_policy: RestartPolicy,
    /// cloud-init user-data, at most 64 KiB, no NUL: the seed's `user-data` file as it is, in
    /// place of the generated `#cloud-config`. A direct-kernel VM with it gets a seed too.
    /// Changed without a restart (read at the guest's first boot; the next start writes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    /// An account in the guest and the SSH public keys that may log in to it (the seed and the
    /// exec server write them); changed live. Left out when absent, so older specs and
    /// records compare and serialize as they did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh: Option<SshSpec>,
    /// Whether `vm.exec`, `vm.file_push` and `vm.file_pull` may run in this VM (default true;
    /// the host must also allow them with `[agent] allow_exec`). Changed without a restart.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub guest_exec: bool,
    /// `shared` (default: vCPUs float over the shared pool) or `dedicated` (each vCPU on a
    /// host CPU of its own, from `[hardware] vm_cpus`). Left out when shared. Needs a restart.
    #[serde(default, skip_serializing_if = "CpuPolicy::is_default")]
    pub cpu_policy: CpuPolicy,
    /// Which NUMA node(s) the VM's CPUs and memory come from; absent: `auto` for a dedicated
    /// VM, `none` for a shared one ([`VmSpec::numa_policy`]). Needs a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<NumaPolicy>,
    /// Back the guest's memory with preallocated hugepages of this size; absent: normal memory
    /// (transparent hugepages where the kernel gives them). Needs a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugepages: Option<HugePageSize>,
    /// One more dedicated CPU, on the VM's node, for QEMU's threads that are not vCPUs (I/O,
    /// the main loop); only with `cpu_policy: dedicated`. Needs a restart.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub emulator_cpu: bool,
    /// A TPM 2.0 for the guest: swtpm on the host, its state kept in the VM's disk directory
    /// until the destroy ([`crate::tpm`], docs/images.md "TPM"). Left out when false. Needs a
    /// restart.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tpm: bool,
}

impl VmSpec {
    /// The monitor NICs (`mode: "monitor"` with a `source`) as `(index, source, direction)`,
    /// `direction` defaulted: what capture, admission and the agent's checks all read.
    pub fn monitor_nics(&self) -> impl Iterator<Item = (usize, &str, CaptureDirection)> + '_ {
        self.nics
            .iter()
            .enumerate()
            .filter(|(_, n)| n.mode == NicMode::Monitor)
            .filter_map(|(i, n)| Some((i, n.source.as_deref()?, n.direction.unwrap_or_default())))
    }

    /// The NUMA policy the VM is placed by: `numa` when given, else `auto` for a dedicated VM
    /// and `none` for a shared one.
    pub fn numa_policy(&self) -> NumaPolicy {
        self.numa.unwrap_or(match self.cpu_policy {
            CpuPolicy::Dedicated => NumaPolicy::Auto,
            CpuPolicy::Shared => NumaPolicy::None,
        })
    }
}

/// `spec.cpu_policy`: whether a VM's vCPUs share host CPUs or each has one of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpuPolicy {
    /// The vCPUs float over the shared pool (every `vm_cpus` CPU no dedicated VM holds).
    #[default]
    Shared,
    /// Each vCPU is pinned to a host CPU no other VM uses.
    Dedicated,
}

impl CpuPolicy {
    /// True for the default (`shared`), which specs leave out.
    pub fn is_default(&self) -> bool {
        *self == CpuPolicy::Shared
    }

    /// `shared` or `dedicated`.
    pub fn as_str(self) -> &'static str {
        match self {
            CpuPolicy::Shared => "shared",
            CpuPolicy::Dedicated => "dedicated",
        }
    }
}

/// `spec.numa`: `"auto"`, `"spread"`, `"none"` or a node number. Closed: any other string or
/// value is refused when the spec is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NumaPolicy {
    /// One node: the node of the VM's passthrough devices, else the one with the most room.
    Auto,
    /// One node when one fits, else as many as it takes, memory bound over all of them.
    Spread,
    /// No node: memory unbound, CPUs from anywhere in `vm_cpus`.
    None,
    /// This node.
    Node(u32),
}

impl Serialize for NumaPolicy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            NumaPolicy::Auto => s.serialize_str("auto"),
            NumaPolicy::Spread => s.serialize_str("spread"),
            NumaPolicy::None => s.serialize_str("none"),
            NumaPolicy::Node(n) => s.serialize_u32(*n),
        }
    }
}

impl<'de> Deserialize<'de> for NumaPolicy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<NumaPolicy, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = NumaPolicy;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"auto\", \"spread\", \"none\" or a NUMA node number")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<NumaPolicy, E> {
                match v {
                    "auto" => Ok(NumaPolicy::Auto),
                    "spread" => Ok(NumaPolicy::Spread),
                    "none" => Ok(NumaPolicy::None),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<NumaPolicy, E> {
                u32::try_from(v)
                    .map(NumaPolicy::Node)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<NumaPolicy, E> {
                u64::try_from(v)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
                    .and_then(|v| self.visit_u64(v))
            }
        }
        d.deserialize_any(Visit)
    }
}

impl std::fmt::Display for NumaPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NumaPolicy::Auto => f.write_str("auto"),
            NumaPolicy::Spread => f.write_str("spread"),
            NumaPolicy::None => f.write_str("none"),
            NumaPolicy::Node(n) => write!(f, "{n}"),
        }
    }
}

/// `spec.hugepages`: the size of the hugepages backing a VM's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum HugePageSize {
    /// 2 MiB pages.
    #[serde(rename = "2M")]
    M2,
    /// 1 GiB pages.
    #[serde(rename = "1G")]
    G1,
}

impl HugePageSize {
    /// Every size, smallest first.
    pub const ALL: [HugePageSize; 2] = [HugePageSize::M2, HugePageSize::G1];

    /// The page size in KiB, as in sysfs's `hugepages-<N>kB` directories.
    pub fn kib(self) -> u64 {
        match self {
            HugePageSize::M2 => 2048,
            HugePageSize::G1 => 1_048_576,
        }
    }

    /// How many pages `memory_mib` takes, rounded up (validation makes it exact).
    pub fn pages_for(self, memory_mib: u64) -> u64 {
        memory_mib.saturating_mul(1024).div_ceil(self.kib())
    }

    /// `2M` or `1G`, as in specs.
    pub fn as_str(self) -> &'static str {
        match self {
            HugePageSize::M2 => "2M",
            HugePageSize::G1 => "1G",
        }
    }

    /// The size whose sysfs directory is `hugepages-<kib>kB`, if vmhost knows it.
    pub fn from_kib(kib: u64) -> Option<HugePageSize> {
        HugePageSize::ALL.into_iter().find(|s| s.kib() == kib)
    }
}

impl std::fmt::Display for HugePageSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn is_true(b: &bool) -> bool {
    *b
}

/// One NIC of a VM: a tap on a configured network (`mode: "bridge"`, the default), or a capture
/// NIC fed with copies of a host interface's frames (`mode: "monitor"`, docs/capture.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicSpec {
    /// What the NIC is attached to. Left out when `bridge`, so older specs and records compare
    /// and serialize as they did.
    #[serde(default, skip_serializing_if = "NicMode::is_bridge")]
    pub mode: NicMode,
    /// Name of a `[networks.NAME]` of the host config; required for a bridge NIC, refused for a
    /// monitor NIC (empty, and then left out).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub network: String,
    /// A monitor NIC's source: a host interface listed in `[capture] interfaces`; refused for a
    /// bridge NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// A monitor NIC's direction: frames the source receives and sends (`both`, the default) or
    /// only those it receives (`ingress`); refused for a bridge NIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direction: Option<CaptureDirection>,
    /// Tagged VLANs (1-4094) the tap port carries besides the access `vlan`, on a network with
    /// `vlan_filtering`; bridge NICs only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vlans: Vec<u16>,
    /// The tap port carries every VLAN 1-4094 tagged (a trunk), on a network with
    /// `vlan_filtering`; bridge NICs only, not with `vlans`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub trunk: bool,
    /// Access VLAN (1-4094) on a network with `vlan_filtering`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan: Option<u16>,
    /// Fixed MAC (`02:00:00:00:00:01`); allocated when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Guest IPv4 configuration; none means the guest is not configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<Ipv4Spec>,
    /// Queue pairs (1-16): above 1 the tap is multiqueue (one descriptor per queue) and the
    /// guest's virtio-net has as many rx/tx queue pairs. Left out when 1, so older specs and
    /// records compare and serialize as they did. A change needs a restart.
    #[serde(default = "one_queue", skip_serializing_if = "is_one_queue")]
    pub queues: u8,
}

/// A NIC's default number of queue pairs.
fn one_queue() -> u8 {
    1
}

impl Default for NicSpec {
    /// A bridge NIC on no network yet, one queue: what a literal starts from.
    fn default() -> Self {
        NicSpec {
            mode: NicMode::Bridge,
            network: String::new(),
            source: None,
            direction: None,
            vlans: Vec::new(),
            trunk: false,
            vlan: None,
            mac: None,
            ipv4: None,
            queues: 1,
        }
    }
}

/// What a NIC is attached to (`spec.nics[i].mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NicMode {
    /// A tap on a configured network's bridge.
    #[default]
    Bridge,
    /// A capture NIC: copies of a host interface's frames, nothing sent back (docs/capture.md).
    Monitor,
}

impl NicMode {
    /// True for the default mode (left out when serialized).
    pub fn is_bridge(&self) -> bool {
        *self == NicMode::Bridge
    }
}

/// Which frames of its source a monitor NIC gets (`spec.nics[i].direction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CaptureDirection {
    /// Frames the source receives and frames it sends.
    #[default]
    Both,
    /// Frames the source receives only.
    Ingress,
}

fn is_one_queue(q: &u8) -> bool {
    *q == 1
}

/// Guest IPv4 configuration of a NIC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase", deny_unknown_fields)]
pub enum Ipv4Spec {
    /// A fixed address.
    Static {
        /// `10.0.0.5/24`.
        address: String,
        /// Default gateway.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gateway: Option<String>,
        /// DNS servers.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        dns: Vec<String>,
        /// DNS search domains.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        search: Vec<String>,
    },
    /// DHCP on this NIC (a struct variant, so unknown members are rejected like elsewhere).
    Dhcp {},
}

/// Hardware indices per class, as in the host model.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareRequest {
    /// Disk controllers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk: Vec<u32>,
    /// Copper NICs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copper: Vec<u32>,
    /// SFP NICs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sfp: Vec<u32>,
}

impl HardwareRequest {
    /// True when no hardware is requested.
    pub fn is_empty(&self) -> bool {
        self.disk.is_empty() && self.copper.is_empty() && self.sfp.is_empty()
    }

    /// `(class, indices)` pairs in a fixed order.
    pub fn by_class(&self) -> [(HardwareClass, &[u32]); 3] {
        [(HardwareClass::Disk, &self.disk), (HardwareClass::Copper, &self.copper), (HardwareClass::Sfp, &self.sfp)]
    }
}

/// A class of passthrough hardware in the host model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HardwareClass {
    /// Storage controllers.
    Disk,
    /// Copper network ports.
    Copper,
    /// SFP network ports.
    Sfp,
}

impl HardwareClass {
    /// Lowercase name, as in config and specs.
    pub fn as_str(self) -> &'static str {
        match self {
            HardwareClass::Disk => "disk",
            HardwareClass::Copper => "copper",
            HardwareClass::Sfp => "sfp",
        }
    }
}

impl std::fmt::Display for HardwareClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Boot source as sent on the wire: `{image, disk_gib}`, `{kernel, initrd?, cmdline?}` or
/// `{disk, disk_gib?}`. Kept as one struct of options so a wrong mix gets a precise 2001 naming
/// the field, instead of serde's "did not match any variant".
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootSpec {
    /// A base image file name inside the image dir.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Size of the VM's overlay disk in GiB; with `disk`, the size the imported disk grows to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_gib: Option<u64>,
    /// An existing qcow2 or raw file in `paths.import` that becomes the VM's own root disk
    /// (moved into the state directory, docs/storage.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<String>,
    /// Absolute path of a kernel for direct boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// Absolute path of an initrd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    /// The firmware QEMU boots with, whatever the boot source: `bios` (SeaBIOS, the default)
    /// or `uefi` (OVMF, with a variables store of the VM's own, docs/images.md). Left out when
    /// `bios`, so specs and records from before it existed compare equal.
    #[serde(default, skip_serializing_if = "Firmware::is_default")]
    pub firmware: Firmware,
    /// OVMF with Secure Boot enforcing (`firmware: uefi` on a q35 machine, SMM on; the
    /// `[firmware]` secure pair, docs/images.md#secure-boot). Left out when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub secure_boot: bool,
}

/// `boot.firmware`: what QEMU runs before the guest's boot loader or kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Firmware {
    /// SeaBIOS, QEMU's built-in BIOS (the default).
    #[default]
    Bios,
    /// OVMF (EDK II for QEMU) from the host's `[firmware]` files; Secure Boot only with
    /// `boot.secure_boot`.
    Uefi,
}

impl Firmware {
    /// True for the default (`bios`), which specs and views leave out.
    pub fn is_default(&self) -> bool {
        *self == Firmware::Bios
    }

    /// `bios` or `uefi`.
    pub fn as_str(self) -> &'static str {
        match self {
            Firmware::Bios => "bios",
            Firmware::Uefi => "uefi",
        }
    }
}

/// What the daemon observes a VM to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmStatus {
    /// Record written, host resources being made.
    Creating,
    /// QEMU being launched.
    Starting,
    /// The recorded QEMU process is alive and is this VM's.
    Running,
    /// A stop is in progress.
    Stopping,
    /// Defined, no process.
    Stopped,
    /// The last operation failed; see `last_error`.
    Failed,
    /// The process vanished without the daemon stopping it.
    Dead,
    /// A destroy is in progress.
    Destroying,
    /// Being sent to another vmhostd (`vm.migrate`, `vm.move`): the guest still runs (or is
    /// kept) here until the destination confirms it runs there.
    Migrating,
    /// Being received from another vmhostd (`vm.migrate_in`): NICs and disks made, QEMU (for a
    /// live migration) waiting for the stream; the guest does not run here yet.
    Incoming,
}

impl VmStatus {
    /// Every status, in declaration order (for the transition table's exhaustive tests).
    pub const ALL: [VmStatus; 10] = [
        VmStatus::Creating,
        VmStatus::Starting,
        VmStatus::Running,
        VmStatus::Stopping,
        VmStatus::Stopped,
        VmStatus::Failed,
        VmStatus::Dead,
        VmStatus::Destroying,
        VmStatus::Migrating,
        VmStatus::Incoming,
    ];

    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            VmStatus::Creating => "creating",
            VmStatus::Starting => "starting",
            VmStatus::Running => "running",
            VmStatus::Stopping => "stopping",
            VmStatus::Stopped => "stopped",
            VmStatus::Failed => "failed",
            VmStatus::Dead => "dead",
            VmStatus::Destroying => "destroying",
            VmStatus::Migrating => "migrating",
            VmStatus::Incoming => "incoming",
        }
    }
}

impl std::fmt::Display for VmStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The last error recorded on a VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LastError {
    /// Stable code.
    pub code: i32,
    /// Message.
    pub message: String,
}

/// A VM as `vm.get` and `vm.list` report it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmView {
    /// VM name.
    pub name: String,
    /// The declared spec.
    pub spec: VmSpec,
    /// Desired state (from the spec).
    pub desired_state: DesiredState,
    /// Observed state.
    pub status: VmStatus,
    /// QEMU pid while running.
    pub pid: Option<i32>,
    /// RFC 3339 timestamps.
    pub created_at: String,
    /// Last record change.
    pub updated_at: String,
    /// Last start of QEMU, if any.
    pub started_at: Option<String>,
    /// Last error, if the last operation failed or the VM died.
    pub last_error: Option<LastError>,
    /// Where the guest's serial console is logged.
    pub serial_log: PathBuf,
    /// What each NIC was given, in spec order.
    #[serde(default)]
    pub nics: Vec<NicView>,
    /// The guest agent's session.
    #[serde(default)]
    pub agent: AgentStatus,
    /// The VM runs an older spec than `spec` (changed with `restart: false`); its next start
    /// applies `spec`.
    #[serde(default)]
    pub pending_restart: bool,
    /// How often the restart policy has restarted the VM.
    #[serde(default)]
    pub restarts: u32,
    /// Why its QEMU last ended without vmhostd asking (`guest powered off`, `killed by signal
    /// 9`, ...), if it did.
    #[serde(default)]
    pub last_exit: Option<String>,
    /// The cloud-init instance id of its seed (`meta-data`'s `instance-id`): made with each new
    /// root disk (a create, a replace), the same through every other change. Absent for a VM
    /// without a seed (a `boot.disk` VM, a direct-kernel VM without `user_data`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// Where its QEMU runs (CPUs, NUMA nodes, hugepages) while it runs with a placement
    /// (docs/lifecycle.md, "Placement"); absent for a stopped VM and for one no placement
    /// applies to (no `vm_cpus`, shared, no NUMA or hugepage wish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementView>,
    /// The migration the VM is part of while one runs (or its outcome is not yet known):
    /// which side this host is, the other vmhostd, the phase and the progress so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<migration::MigrationView>,
}

/// Where a running VM runs (`VmView.placement`, `PlanEntry.placement`): CPU sets in the
/// Linux cpulist form (`"2-5,8"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementView {
    /// `shared` or `dedicated`.
    pub policy: CpuPolicy,
    /// Every host CPU the VM's threads may use (a shared VM: the shared pool).
    pub cpus: crate::placement::CpuSet,
    /// The host CPU of each vCPU, in vCPU order (dedicated); empty for shared.
    pub vcpus: Vec<u32>,
    /// Where QEMU's other threads run (empty: the VM's own `cpus`).
    pub emulator: crate::placement::CpuSet,
    /// NUMA nodes its memory is bound to (empty: not bound).
    pub nodes: Vec<u32>,
    /// The hugepage size backing its memory, if any.
    pub hugepages: Option<HugePageSize>,
    /// Hugepages taken on each node (by node number).
    pub hugepages_per_node: std::collections::BTreeMap<u32, u64>,
}

/// A NIC's host-side identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicView {
    /// MAC address.
    pub mac: String,
    /// Host tap name.
    pub tap: String,
    /// The running QEMU's NIC is served by vhost-net in the host kernel (false while the VM
    /// does not run, or when `/dev/vhost-net` was not usable at its start: virtio-net then runs
    /// in QEMU's userspace).
    #[serde(default)]
    pub vhost: bool,
    /// The queue pairs of the spec the VM runs (`spec`'s while it is stopped).
    #[serde(default = "one_queue")]
    pub queues: u8,
    /// `monitor` for a capture NIC (left out for a bridge NIC), as in the spec the VM runs
    /// (`spec`'s while it is stopped); so are `source`, `direction`, `vlans` and `trunk`.
    #[serde(default, skip_serializing_if = "NicMode::is_bridge")]
    pub mode: NicMode,
    /// A monitor NIC's source interface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// A monitor NIC's direction (`both` when the spec leaves it out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direction: Option<CaptureDirection>,
    /// A bridge NIC's tagged VLANs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vlans: Vec<u16>,
    /// A bridge NIC carries every VLAN tagged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub trunk: bool,
    /// A monitor NIC's capture while its VM runs, after the last sync: `attached`,
    /// `source_missing`, `tap_missing` or `failed` (left out while the VM does not run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<String>,
}

/// The guest agent's session as `vm.get` shows it; the daemon's agent supervisor keeps it up to
/// date.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStatus {
    /// A synchronised session is open.
    pub connected: bool,
    /// The agent's version, from `hello`.
    pub version: Option<String>,
    /// RFC 3339 time of the last answer.
    pub last_seen: Option<String>,
}

/// Result of every mutating VM call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mutation {
    /// Whether anything changed on the host or in the records.
    pub changed: bool,
    /// The VM after the call; `null` after a destroy.
    pub vm: Option<VmView>,
    /// After a destroy: the data disks kept (`keep_on_destroy`), where they are now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept_disks: Vec<std::path::PathBuf>,
}

impl Mutation {
    /// A result that kept no disks.
    pub fn new(changed: bool, vm: Option<VmView>) -> Mutation {
        Mutation { changed, vm, kept_disks: Vec::new() }
    }
}

/// Params of `vm.get`, `vm.start`, `vm.restart`, `vm.destroy`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NameParams {
    /// VM name.
    pub name: String,
}

/// Params of `vm.console` (docs/console.md). A read-only peer may only watch: it must send
/// `read_only: true`, and a writer needs the admin role.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleParams {
    /// VM name.
    pub name: String,
    /// Only watch: nothing this client sends reaches the guest.
    #[serde(default)]
    pub read_only: bool,
    /// Take the console over from the current writer, which is told and detached.
    #[serde(default)]
    pub force: bool,
}

/// The result of `vm.console`, the last JSON line before the connection becomes the console's
/// byte stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleAttached {
    /// VM name.
    pub name: String,
    /// Whether this client only watches.
    pub read_only: bool,
    /// Bytes of earlier output replayed first (at most 16 KiB).
    pub replay_bytes: u64,
}

/// Params of `vm.create`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateParams {
    /// The VM to create.
    pub spec: VmSpec,
}

/// Params of `vm.apply`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyParams {
    /// The desired VM.
    pub spec: VmSpec,
    /// Destroy and recreate (a new disk) when `boot.image` changes (default false: 2002). Any
    /// other change is made in place, keeping the disk, and never needs it.
    #[serde(default)]
    pub replace: bool,
    /// For an in-place change of a running VM that needs a restart: stop (ACPI, `timeout_s`,
    /// then kill) and start it with the new spec (default true), or only record the new spec
    /// for the next start (false; the view shows `pending_restart`).
    #[serde(default = "default_true")]
    pub restart: bool,
    /// Seconds the guest has to power off before QEMU is killed, for a restart or a stop this
    /// call makes (default 30).
    #[serde(default = "default_stop_timeout")]
    pub timeout_s: u64,
}

fn default_true() -> bool {
    true
}

/// Params of `vm.stop`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopParams {
    /// VM name.
    pub name: String,
    /// Seconds to wait for an ACPI shutdown before killing (default 30).
    #[serde(default = "default_stop_timeout")]
    pub timeout_s: u64,
    /// Kill at once, no ACPI powerdown.
    #[serde(default)]
    pub force: bool,
    /// How the guest is asked to power off: `acpi` (default) or `agent` (the exec server's
    /// `guest.shutdown`, ACPI at once when that cannot be asked).
    #[serde(default)]
    pub method: StopMethod,
}

fn default_stop_timeout() -> u64 {
    30
}

/// Params of `host.shutdown_vms`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownVmsParams {
    /// Seconds every guest has to power off after the ACPI button before its QEMU is killed.
    #[serde(default = "default_stop_timeout")]
    pub timeout_s: u64,
}

/// What `host.shutdown_vms` did to one VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShutdownResult {
    /// VM name.
    pub vm: String,
    /// It is no longer running.
    pub ok: bool,
    /// The error when not (e.g. 4090: another operation held it).
    pub error: Option<Value>,
}

/// Result of `host.shutdown_vms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShutdownReport {
    /// One entry per VM that was running, by name.
    pub vms: Vec<ShutdownResult>,
    /// Every one of them is down.
    pub ok: bool,
}

/// Params of `host.reconcile`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileParams {
    /// The whole desired set of VMs for this host.
    pub vms: Vec<VmSpec>,
    /// Destroy VMs that are not in `vms`.
    #[serde(default)]
    pub prune: bool,
    /// Plan and validate only.
    #[serde(default)]
    pub dry_run: bool,
    /// Allow `replace` entries (a `boot.image` change destroys the old disk); without it such an
    /// entry fails with 2002 and the VM is left alone.
    #[serde(default)]
    pub replace: bool,
    /// Seconds a guest has to power off (a stop, or a restart for a change) before QEMU is
    /// killed (default 30, at most 3600).
    #[serde(default = "default_stop_timeout")]
    pub timeout_s: u64,
}

/// One planned action of a reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlanAction {
    /// Define and (per spec.state) start a new VM.
    Create,
    /// Start an existing, stopped VM.
    Start,
    /// Stop a running VM.
    Stop,
    /// Change the VM in place, keeping its disk (`fields`; `restart` when QEMU restarts).
    Reconfigure,
    /// Destroy and recreate with a new disk: `boot.image` changed (only with `replace: true`).
    Replace,
    /// Remove a VM not in the desired set (prune).
    Destroy,
    /// Already as desired.
    None,
}

/// A plan entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanEntry {
    /// VM name.
    pub vm: String,
    /// What would be done.
    pub action: PlanAction,
    /// Why.
    pub reason: String,
    /// Validation error that would make this entry fail (the plan still lists it).
    pub error: Option<Value>,
    /// For `reconfigure` and `replace`: the spec fields that differ (dotted paths).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<String>,
    /// For `reconfigure`: whether the VM restarts for it (false: only a live disk grow, or the VM
    /// is not running).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<bool>,
    /// On a dry run, for an entry that would start a VM with a placement (pinned CPUs, NUMA
    /// binding or hugepages): where it would run, next to what the VMs before it in the run's
    /// order hold (a refusal is the entry's `error`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementView>,
}

/// The outcome of one reconcile entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReconcileResult {
    /// VM name.
    pub vm: String,
    /// What was attempted.
    pub action: PlanAction,
    /// Success.
    pub ok: bool,
    /// Whether anything changed.
    pub changed: bool,
    /// The JSON-RPC error object, when it failed.
    pub error: Option<Value>,
}

/// Result of `host.reconcile`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReconcileReport {
    /// Echo of the request flag.
    pub dry_run: bool,
    /// One entry per VM concerned.
    pub plan: Vec<PlanEntry>,
    /// One result per plan entry; empty on a dry run.
    pub results: Vec<ReconcileResult>,
    /// True when every entry succeeded (or, on a dry run, validated).
    pub ok: bool,
}

/// Total, reserved, allocated and free amounts of one resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceUsage {
    /// What the host has.
    pub total: u64,
    /// Kept for the host itself.
    pub reserved: u64,
    /// Held by defined VMs.
    pub allocated: u64,
    /// total - reserved - allocated.
    pub available: u64,
}

/// One hardware index of the host model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HardwareItem {
    /// Class.
    pub class: HardwareClass,
    /// Index within the model.
    pub index: u32,
    /// PCI address, `DDDD:BB:SS.F`.
    pub pci: String,
    /// VM holding it, or null.
    pub holder: Option<String>,
    /// Whether the device exists on this host (sysfs), read at call time.
    #[serde(default)]
    pub present: bool,
    /// Its current driver (`vfio-pci` while passed through), if any.
    #[serde(default)]
    pub driver: Option<String>,
    /// Its IOMMU group, if the IOMMU is on.
    #[serde(default)]
    pub iommu_group: Option<u32>,
}

/// Result of `host.info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    /// Daemon version.
    pub version: String,
    /// API version.
    pub api_version: u32,
    /// `kvm` or `tcg`.
    pub accel: String,
    /// CPUs.
    pub cpu: ResourceUsage,
    /// Memory in MiB.
    pub memory_mib: ResourceUsage,
    /// Every index of the model.
    pub hardware: Vec<HardwareItem>,
    /// Number of VM records.
    pub vm_count: usize,
    /// Configured networks and the NICs on them.
    #[serde(default)]
    pub networks: Vec<NetworkInfo>,
    /// Data disks kept after their VM was destroyed.
    #[serde(default)]
    pub kept_disks: Vec<KeptDisk>,
    /// The state file system, where every VM disk lives.
    #[serde(default)]
    pub storage: StorageInfo,
    /// The host's NUMA nodes as the kernel shows them now, with what VMs hold on each.
    #[serde(default)]
    pub numa: Vec<NodeInfo>,
    /// The host's CPUs by use: `vm_cpus`, housekeeping, the shared pool and dedicated CPUs.
    #[serde(default)]
    pub cpus: CpuInfo,
    /// Every `[capture] interfaces` entry: whether it exists, its promiscuous flag, and the
    /// monitor NICs of running VMs on it.
    #[serde(default)]
    pub capture: Vec<CaptureInfo>,
}

/// One capture interface as `host.info` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureInfo {
    /// The interface (`[capture] interfaces`).
    pub interface: String,
    /// It exists now.
    pub present: bool,
    /// Its user-set promiscuous flag (vmhostd sets it while a monitor is attached).
    pub promisc: bool,
    /// The monitor NICs of live VMs whose source it is.
    pub monitors: Vec<CaptureMonitorInfo>,
}

/// One monitor NIC in `host.info` `capture[].monitors`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureMonitorInfo {
    /// VM name.
    pub vm: String,
    /// The NIC's index in its spec.
    pub nic: usize,
    /// `both` or `ingress`.
    pub direction: CaptureDirection,
    /// `attached`, `source_missing`, `tap_missing` or `failed`.
    pub state: String,
}

/// One NUMA node as `host.info` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Its number.
    pub node: u32,
    /// Its online CPUs (cpulist).
    pub cpus: crate::placement::CpuSet,
    /// Those of them in `[hardware] vm_cpus` (empty when it is not set).
    pub vm_cpus: crate::placement::CpuSet,
    /// Its memory, MiB.
    pub memory_mib: u64,
    /// The hugepage pools the kernel offers on it, by size (`"2M"`, `"1G"`), in pages.
    pub hugepages: std::collections::BTreeMap<HugePageSize, HugePagesInfo>,
    /// PCI addresses of the model's devices attached to it.
    pub devices: Vec<String>,
    /// VMs whose memory is bound to it or that have dedicated CPUs on it.
    pub holders: Vec<NodeHolder>,
}

/// One hugepage pool, in pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HugePagesInfo {
    /// Pages reserved (`nr_hugepages`).
    pub total: u64,
    /// Pages no one uses (`free_hugepages`).
    pub free: u64,
}

/// A VM on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeHolder {
    /// VM name.
    pub vm: String,
    /// Its CPUs on this node (a shared VM: the shared pool's there).
    pub cpus: crate::placement::CpuSet,
    /// They are the VM's own (`cpu_policy` `dedicated`).
    pub dedicated: bool,
}

/// The host's CPUs by use (`host.info`'s `cpus`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuInfo {
    /// `[hardware] vm_cpus`; null when not set (nothing is pinned).
    pub vm_cpus: Option<crate::placement::CpuSet>,
    /// Online CPUs not in `vm_cpus` (QEMU's non-vCPU threads run there); empty without
    /// `vm_cpus`.
    pub housekeeping: crate::placement::CpuSet,
    /// `vm_cpus` no dedicated VM holds: where shared VMs' vCPUs float; null without `vm_cpus`.
    pub shared_pool: Option<crate::placement::CpuSet>,
    /// Every dedicated CPU and the VM holding it, by CPU.
    pub dedicated: Vec<DedicatedCpu>,
}

/// A CPU a dedicated VM holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedicatedCpu {
    /// Host CPU number.
    pub cpu: u32,
    /// VM name.
    pub vm: String,
}

/// The state file system as `host.info` shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StorageInfo {
    /// Its size in bytes (0 when it cannot be read).
    pub total_bytes: u64,
    /// Bytes still free for vmhostd.
    pub free_bytes: u64,
    /// What every VM's disks (overlays and data disks) take at their full size.
    pub provisioned_bytes: u64,
    /// `storage.overcommit`.
    pub overcommit: f64,
}

/// A configured network as `host.info` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkInfo {
    /// Network name.
    pub name: String,
    /// Its bridge.
    pub bridge: String,
    /// Whether vmhostd creates and owns the bridge.
    pub created: bool,
    /// Bridge VLAN filtering.
    pub vlan_filtering: bool,
    /// VLANs tagged on the uplink.
    #[serde(default)]
    pub trunk: Vec<u16>,
    /// Uplink enslaved to an owned bridge.
    #[serde(default)]
    pub uplink: Option<String>,
    /// Declared subnet.
    pub subnet: Option<String>,
    /// Usable right now.
    pub ready: bool,
    /// What vmhostd found or did.
    pub detail: String,
    /// NICs of VMs on this network.
    pub nics: Vec<NetworkNic>,
}

/// A VM NIC on a network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkNic {
    /// VM name.
    pub vm: String,
    /// NIC index in the VM's spec.
    pub nic: usize,
    /// MAC.
    pub mac: String,
    /// Host tap.
    pub tap: String,
    /// Access VLAN.
    pub vlan: Option<u16>,
    /// Static guest address, if any.
    pub address: Option<String>,
}

/// Status of one preflight item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckStatus {
    /// Present and working.
    Ok,
    /// Not installed / not present.
    Missing,
    /// Present, but the user that needs it may not use it (e.g. `/dev/kvm` for QEMU's user).
    Denied,
    /// Present but failing.
    Error,
}

/// One preflight item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckItem {
    /// What was checked.
    pub name: String,
    /// Outcome.
    pub status: CheckStatus,
    /// Human detail (version, path, error).
    pub detail: String,
}

/// Result of `host.check`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostCheck {
    /// True when every item is ok.
    pub ok: bool,
    /// The items.
    pub items: Vec<CheckItem>,
}

/// A VM state change, sent as an `events.event` notification.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// VM name.
    pub vm: String,
    /// Previous status (null for a new VM).
    pub from: Option<VmStatus>,
    /// New status (null once destroyed).
    pub to: Option<VmStatus>,
    /// Why.
    pub reason: String,
    /// RFC 3339 time.
    pub time: String,
    /// The command, transfer or housekeeping call made in the guest, for events about one
    /// (`from` and `to` are then the VM's current status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<exec::GuestAction>,
    /// The monitor NIC whose capture changed state, for events about one (`from` and `to` are
    /// then the VM's current status): its source lost, back, failing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<CaptureChange>,
    /// How far a migration of the VM got, for events about one (`from` and `to` are then the
    /// VM's current status): each phase change, and at most every second while disks or
    /// memory are being sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<migration::MigrationProgress>,
}

/// A monitor NIC's capture changing state (`Event.capture`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureChange {
    /// The NIC's index in `spec.nics`.
    pub nic: usize,
    /// Its source.
    pub source: String,
    /// The new state: `attached`, `source_missing`, `tap_missing` or `failed`.
    pub state: String,
}

/// RFC 3339 UTC timestamp with seconds, for records and events.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_rejects_unknown_fields() {
        let j = serde_json::json!({"name": "a", "cpu": 1, "memory_mib": 64, "boot": {}, "colour": 1});
        let err = serde_json::from_value::<VmSpec>(j).unwrap_err().to_string();
        assert!(err.contains("colour"), "{err}");
    }

    #[test]
    fn spec_defaults_and_round_trip() {
        let j = serde_json::json!({"name": "a", "cpu": 1, "memory_mib": 64,
            "boot": {"kernel": "/k"}});
        let s: VmSpec = serde_json::from_value(j).unwrap();
        assert_eq!(s.state, DesiredState::Running);
        assert!(s.hardware.is_empty());
        let back: VmSpec = serde_json::from_value(serde_json::to_value(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn placement_fields_default_and_are_left_out_then() {
        let j = serde_json::json!({"name": "a", "cpu": 1, "memory_mib": 64, "state": "running",
            "boot": {"kernel": "/k"}});
        let s: VmSpec = serde_json::from_value(j.clone()).unwrap();
        assert_eq!((s.cpu_policy, s.numa, s.hugepages, s.emulator_cpu), (CpuPolicy::Shared, None, None, false));
        assert_eq!(s.numa_policy(), NumaPolicy::None);
        // A spec (or record) from before the fields existed serializes exactly as it did.
        assert_eq!(serde_json::to_value(&s).unwrap(), j);
        let mut explicit = j.clone();
        explicit["cpu_policy"] = "shared".into();
        explicit["emulator_cpu"] = false.into();
        let s: VmSpec = serde_json::from_value(explicit).unwrap();
        assert_eq!(serde_json::to_value(&s).unwrap(), j, "defaults are left out");
        for (numa, policy) in [
            (serde_json::json!("auto"), NumaPolicy::Auto),
            (serde_json::json!("spread"), NumaPolicy::Spread),
            (serde_json::json!("none"), NumaPolicy::None),
            (serde_json::json!(1), NumaPolicy::Node(1)),
        ] {
            let mut d = j.clone();
            d["cpu_policy"] = "dedicated".into();
            d["numa"] = numa;
            d["hugepages"] = "1G".into();
            d["emulator_cpu"] = true.into();
            let s: VmSpec = serde_json::from_value(d.clone()).unwrap();
            assert_eq!(
                (s.cpu_policy, s.numa, s.hugepages, s.emulator_cpu),
                (CpuPolicy::Dedicated, Some(policy), Some(HugePageSize::G1), true)
            );
            assert_eq!(serde_json::to_value(&s).unwrap(), d);
        }
        let mut dedicated = j.clone();
        dedicated["cpu_policy"] = "dedicated".into();
        assert_eq!(serde_json::from_value::<VmSpec>(dedicated).unwrap().numa_policy(), NumaPolicy::Auto);
        // Closed: anything else is refused when the spec is read.
        for (key, bad) in [
            ("numa", serde_json::json!("local")),
            ("numa", serde_json::json!(-1)),
            ("numa", serde_json::json!(1.5)),
            ("numa", serde_json::json!(5_000_000_000u64)),
            ("numa", serde_json::json!(null)),
            ("cpu_policy", serde_json::json!("isolated")),
            ("hugepages", serde_json::json!("4K")),
            ("hugepages", serde_json::json!(2)),
            ("emulator_cpu", serde_json::json!("yes")),
        ] {
            let mut d = j.clone();
            d[key] = bad.clone();
            // `null` for an Option reads as absent, like every optional field of a spec.
            let r = serde_json::from_value::<VmSpec>(d);
            if bad.is_null() {
                assert_eq!(r.unwrap().numa, None);
            } else {
                assert!(r.is_err(), "{key}: {bad}");
            }
        }
    }

    #[test]
    fn hugepage_sizes() {
        assert_eq!((HugePageSize::M2.kib(), HugePageSize::G1.kib()), (2048, 1_048_576));
        assert_eq!(HugePageSize::M2.pages_for(1024), 512);
        assert_eq!(HugePageSize::G1.pages_for(4096), 4);
        assert_eq!(HugePageSize::G1.pages_for(1536), 2, "rounded up");
        assert_eq!(HugePageSize::from_kib(2048), Some(HugePageSize::M2));
        assert_eq!(HugePageSize::from_kib(64), None);
        assert_eq!(serde_json::to_value(HugePageSize::M2).unwrap(), serde_json::json!("2M"));
        let map: std::collections::BTreeMap<HugePageSize, u64> = [(HugePageSize::G1, 1)].into();
        assert_eq!(serde_json::to_value(map).unwrap(), serde_json::json!({"1G": 1}));
    }

    #[test]
    fn firmware_defaults_to_bios_and_is_left_out_then() {
        let j = serde_json::json!({"name": "a", "cpu": 1, "memory_mib": 64, "boot": {"kernel": "/k"}});
        let s: VmSpec = serde_json::from_value(j.clone()).unwrap();
        assert_eq!(s.boot.firmware, Firmware::Bios);
        // A spec (or record) from before the field existed serializes exactly as it did.
        assert_eq!(serde_json::to_value(&s).unwrap()["boot"], j["boot"]);
        let mut uefi = j.clone();
        uefi["boot"]["firmware"] = "uefi".into();
        let s: VmSpec = serde_json::from_value(uefi.clone()).unwrap();
        assert_eq!(s.boot.firmware, Firmware::Uefi);
        assert_eq!(serde_json::to_value(&s).unwrap()["boot"], uefi["boot"]);
        // An explicit bios is the default, left out on the way back.
        let mut bios = j.clone();
        bios["boot"]["firmware"] = "bios".into();
        let s: VmSpec = serde_json::from_value(bios).unwrap();
        assert_eq!(serde_json::to_value(&s).unwrap()["boot"], j["boot"]);
        let mut bad = j;
        bad["boot"]["firmware"] = "efi".into();
        let e = serde_json::from_value::<VmSpec>(bad).unwrap_err().to_string();
        assert!(e.contains("bios") && e.contains("uefi"), "{e}");
    }
}
