//! PCI passthrough: what a host PCI function is, whether it may go to a VM, and moving it between
//! its host driver and vfio-pci.
//!
//! A VM can be given host PCI devices (NICs, NVMe drives, ...) through VFIO. That is only safe
//! when the whole IOMMU group goes to the VM, when the host is not using the device (an addressed
//! NIC, a mounted disk), and when the device goes back to its host driver afterwards, even across
//! a daemon crash. This module owns that; it speaks to the kernel only through sysfs
//! ([`sysfs::SysfsIo`]), so the same code runs on `/sys` and on a model of it in tests. The one
//! exception is [`load_vfio_pci`], which runs `modprobe vfio-pci` when the driver is absent.
//!
//! The lifecycle uses it in this order:
//!
//! 1. at start-up and in `host.check`: [`Pci::iommu_enabled`], [`Pci::vfio_pci_present`] (else
//!    [`load_vfio_pci`]), [`vfio_container_present`], and [`Pci::device`] for every model entry;
//! 2. before anything is touched: [`identity::read`] and [`identity::judge`] for every requested
//!    device whose model entry pins an identity (a mismatch is API code 3006), then
//!    [`Pci::devices_with_groups`] reads the requested devices and all
//!    members of their IOMMU groups, and [`check::check`] (pure) turns them, the host's own use of
//!    interfaces and block devices ([`check::HostUsage`]) and what other VMs hold into an
//!    [`check::Assignment`] or the API error that explains the refusal (2001, 3003, 3004, 3005);
//! 3. [`bind::plan_bindings`] reads each device's current driver into [`bind::Binding`]s, which the
//!    caller persists in the VM record *before* binding;
//! 4. [`bind::bind_vfio`] moves the devices to vfio-pci (restoring everything on failure); QEMU
//!    gets `-device vfio-pci,host=BDF` and [`bind::vfio_group_dev`] per group;
//! 5. on stop, destroy, or at start-up for records whose VM is gone, [`bind::release`] gives each
//!    device back to its recorded original driver.
//!
//! Every function here blocks (sysfs I/O, bounded polling): call it from `spawn_blocking`.

pub mod bind;
pub mod check;
#[cfg(test)]
pub mod fake;
pub mod identity;
pub mod sysfs;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::hardware::PciAddress;
use sysfs::{RealSysfs, SysfsIo};

/// The name the vfio-pci driver registers under `bus/pci/drivers`.
pub const VFIO_PCI: &str = "vfio-pci";

/// pci-stub: a driver that only keeps other drivers off a device; the kernel lets its devices
/// share an IOMMU group with a VM's.
pub const PCI_STUB: &str = "pci-stub";

/// The VFIO container device QEMU opens.
pub const VFIO_CONTAINER: &str = "/dev/vfio/vfio";

/// Bound on one `modprobe vfio-pci` run.
pub const MODPROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// How deep below a device's directory [`Pci::device`] looks for its network and block devices
/// (a USB disk behind a passed-through xHCI controller sits about 8 levels down).
const MAX_WALK_DEPTH: usize = 12;

/// Bound on the number of directories one walk visits.
const MAX_WALK_DIRS: usize = 20_000;

/// What can go wrong reading PCI state or loading vfio-pci.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    /// A sysfs read failed (other than "absent", which the functions report as `None`).
    #[error("sysfs {}: {source}", .path.display())]
    Io {
        /// The path relative to the sysfs root.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A sysfs attribute had content the kernel never produces.
    #[error("sysfs {}: unexpected content {text:?}", .path.display())]
    Parse {
        /// The path relative to the sysfs root.
        path: PathBuf,
        /// What it held.
        text: String,
    },
    /// `modprobe vfio-pci` could not run, failed, or did not make the driver appear.
    #[error("cannot load vfio-pci: {0}")]
    Modprobe(String),
}

/// A step of passthrough around the check and the bind, by the name the API reports it under
/// (`details.step` `vfio.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassthroughStep {
    /// Reading how the host uses its interfaces and block devices (netlink, mounts).
    HostUsage,
    /// Reading the requested devices and their IOMMU groups from sysfs.
    Read,
    /// Reading what the requested devices are, for the model's identity pins.
    Identity,
    /// Loading vfio-pci.
    Modprobe,
    /// Reading each device's current driver before binding.
    Plan,
    /// Binding to vfio-pci (only the task itself: a refused bind is a [`bind::BindError`]).
    Bind,
    /// Giving the devices back (only the task itself: a refused release is a [`bind::BindError`]).
    Release,
}

impl PassthroughStep {
    /// The name in messages and in `details.step` (after `vfio.`).
    pub fn name(self) -> &'static str {
        match self {
            PassthroughStep::HostUsage => "host_usage",
            PassthroughStep::Read => "read",
            PassthroughStep::Identity => "identity",
            PassthroughStep::Modprobe => "modprobe",
            PassthroughStep::Plan => "plan",
            PassthroughStep::Bind => "bind",
            PassthroughStep::Release => "release",
        }
    }
}

impl fmt::Display for PassthroughStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A passthrough step that could not be carried out (as opposed to one that refused the
/// request: [`check::CheckError`], [`bind::BindError`]).
#[derive(Debug, thiserror::Error)]
pub enum PassthroughError {
    /// The host's use of its interfaces could not be read.
    #[error("PCI passthrough failed at host_usage: {0}")]
    HostUsage(#[source] crate::net::NetError),
    /// Reading sysfs or loading vfio-pci failed.
    #[error("PCI passthrough failed at {step}: {source}")]
    Pci {
        /// The step.
        step: PassthroughStep,
        /// Why.
        #[source]
        source: PciError,
    },
    /// The blocking task that ran the step panicked or was cancelled.
    #[error("PCI passthrough failed at {step}: {source}")]
    Task {
        /// The step.
        step: PassthroughStep,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
    /// An IOMMU group's node could not be read or given to QEMU's group (API step
    /// `vfio_access`, not `vfio.<step>`: it is QEMU's access, not the device's binding).
    #[error("cannot give {} to the group of qemu.user: {source}", .node.display())]
    Access {
        /// `/dev/vfio/N`.
        node: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

impl PassthroughError {
    /// The API's `details.step`: `vfio.<step>`, or `vfio_access`.
    pub fn step(&self) -> String {
        match self {
            PassthroughError::HostUsage(_) => format!("vfio.{}", PassthroughStep::HostUsage),
            PassthroughError::Pci { step, .. } | PassthroughError::Task { step, .. } => format!("vfio.{step}"),
            PassthroughError::Access { .. } => "vfio_access".to_string(),
        }
    }

    /// `step`'s [`PciError`], for `map_err`.
    pub fn pci(step: PassthroughStep) -> impl FnOnce(PciError) -> PassthroughError {
        move |source| PassthroughError::Pci { step, source }
    }

    /// `step`'s failed task, for `map_err`.
    pub fn task(step: PassthroughStep) -> impl FnOnce(tokio::task::JoinError) -> PassthroughError {
        move |source| PassthroughError::Task { step, source }
    }
}

/// One PCI function as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    /// Its address.
    pub address: PciAddress,
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
    /// Class code (24 bits: class, subclass, programming interface; `0x020000` is Ethernet).
    pub class: u32,
    /// The bound driver, `None` when the device is driverless.
    pub driver: Option<String>,
    /// The IOMMU group, `None` when the IOMMU is off (then VFIO cannot use the device).
    pub iommu_group: Option<u32>,
    /// A PCI-to-PCI (or CardBus) bridge: header type 1 or 2, or class 0x0604/0x0609. Bridges are
    /// never passed through, and never block a group.
    pub is_bridge: bool,
    /// Network interfaces of this function (`net/NAME` anywhere below the device, e.g.
    /// `BDF/net/eth0` or, for virtio, `BDF/virtio0/net/eth0`).
    pub net_ifaces: Vec<String>,
    /// Block devices below this function, with their partitions and the device-mapper/md devices
    /// stacked on them (holders), by kernel name (`nvme0n1`, `nvme0n1p2`, `sda`, `dm-0`).
    pub block_devs: Vec<String>,
}

/// The PCI layer's handle on sysfs.
pub struct Pci {
    /// Where sysfs reads and writes go.
    io: Box<dyn SysfsIo>,
}

impl fmt::Debug for Pci {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Pci")
    }
}

/// `bus/pci/devices/BDF`.
fn dev_dir(address: PciAddress) -> PathBuf {
    PathBuf::from(format!("bus/pci/devices/{address}"))
}

/// `bus/pci/devices/BDF/ATTR`.
fn dev_attr(address: PciAddress, attr: &str) -> PathBuf {
    dev_dir(address).join(attr)
}

/// True for errors meaning "not there" (absent attribute, not a directory).
fn is_absent(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR)
}

/// Parses `0x8086\n`-style hex attributes.
fn parse_hex(path: &Path, text: &str) -> Result<u32, PciError> {
    let t = text.trim();
    let digits = t.strip_prefix("0x").unwrap_or(t);
    u32::from_str_radix(digits, 16).map_err(|_| PciError::Parse { path: path.to_path_buf(), text: text.to_string() })
}

/// `nvmeAcBnC[...]` (a controller's path to a multipath namespace) to the namespace head
/// `nvmeAnC`, which is the block device the host mounts.
fn nvme_head(name: &str) -> Option<String> {
    let rest = name.strip_prefix("nvme")?;
    let (subsys, rest) = rest.split_once('c')?;
    let (ctrl, ns) = rest.split_once('n')?;
    let ns: String = ns.chars().take_while(char::is_ascii_digit).collect();
    let numeric = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
    (numeric(subsys) && numeric(ctrl) && numeric(&ns)).then(|| format!("nvme{subsys}n{ns}"))
}

impl Pci {
    /// A PCI layer on `io`.
    pub fn new(io: Box<dyn SysfsIo>) -> Pci {
        Pci { io }
    }

    /// The PCI layer on the real `/sys`.
    pub fn real() -> Pci {
        Pci::new(Box::new(RealSysfs::default()))
    }

    /// The PCI layer on a sysfs tree rooted at `root`.
    pub fn with_root(root: impl Into<PathBuf>) -> Pci {
        Pci::new(Box::new(RealSysfs::new(root)))
    }

    /// The sysfs operations, for [`bind`].
    pub fn io(&self) -> &dyn SysfsIo {
        self.io.as_ref()
    }

    fn read(&self, rel: &Path) -> Result<String, PciError> {
        self.io.read(rel).map_err(|source| PciError::Io { path: rel.to_path_buf(), source })
    }

    /// The last component of a link's target, `None` when the link is absent.
    fn link_name(&self, rel: &Path) -> Result<Option<String>, PciError> {
        match self.io.read_link(rel) {
            Ok(target) => match target.file_name() {
                Some(n) => Ok(Some(n.to_string_lossy().into_owned())),
                None => Err(PciError::Parse { path: rel.to_path_buf(), text: target.display().to_string() }),
            },
            Err(e) if is_absent(&e) => Ok(None),
            Err(source) => Err(PciError::Io { path: rel.to_path_buf(), source }),
        }
    }

    /// Whether a device exists at `address`.
    pub fn exists(&self, address: PciAddress) -> bool {
        self.io.exists(&dev_dir(address))
    }

    /// The driver bound to `address`, `None` when it has none (or does not exist).
    ///
    /// # Errors
    /// [`PciError::Io`] when the `driver` link cannot be read for another reason.
    pub fn driver(&self, address: PciAddress) -> Result<Option<String>, PciError> {
        self.link_name(&dev_attr(address, "driver"))
    }

    /// The device's `driver_override`, `None` when unset (sysfs shows `(null)`).
    ///
    /// # Errors
    /// [`PciError::Io`] when the attribute cannot be read (the device is gone, or the kernel is
    /// older than 3.16).
    pub fn driver_override(&self, address: PciAddress) -> Result<Option<String>, PciError> {
        let text = self.read(&dev_attr(address, "driver_override"))?;
        let t = text.trim();
        Ok((!t.is_empty() && t != "(null)").then(|| t.to_string()))
    }

    /// The IOMMU group of `address`, `None` when it has none.
    ///
    /// # Errors
    /// [`PciError::Io`] when the link cannot be read, [`PciError::Parse`] when its target does not
    /// end in a number.
    pub fn iommu_group(&self, address: PciAddress) -> Result<Option<u32>, PciError> {
        let rel = dev_attr(address, "iommu_group");
        match self.link_name(&rel)? {
            None => Ok(None),
            Some(n) => n.parse().map(Some).map_err(|_| PciError::Parse { path: rel, text: n }),
        }
    }

    /// Everything about the device at `address`, `None` when there is no such device.
    ///
    /// # Errors
    /// [`PciError::Io`] when an attribute of an existing device cannot be read (or the device
    /// vanished while being read), [`PciError::Parse`] for malformed ids.
    pub fn device(&self, address: PciAddress) -> Result<Option<PciDevice>, PciError> {
        if !self.exists(address) {
            return Ok(None);
        }
        let hex = |attr: &str| -> Result<u32, PciError> {
            let rel = dev_attr(address, attr);
            parse_hex(&rel, &self.read(&rel)?)
        };
        let id16 = |attr: &str| -> Result<u16, PciError> {
            let v = hex(attr)?;
            u16::try_from(v).map_err(|_| PciError::Parse { path: dev_attr(address, attr), text: format!("{v:#x}") })
        };
        let vendor = id16("vendor")?;
        let device = id16("device")?;
        let class = hex("class")?;
        let driver = self.driver(address)?;
        let iommu_group = self.iommu_group(address)?;
        // The kernel shows secondary_bus_number exactly for header types 1 and 2.
        let is_bridge =
            self.io.exists(&dev_attr(address, "secondary_bus_number")) || matches!(class >> 8, 0x0604 | 0x0609);
        // Nothing below a bridge is the bridge's own: its subtree holds other PCI devices.
        let (net_ifaces, block_devs) = if is_bridge { (Vec::new(), Vec::new()) } else { self.class_devices(address)? };
        Ok(Some(PciDevice { address, vendor, device, class, driver, iommu_group, is_bridge, net_ifaces, block_devs }))
    }

    /// The network interfaces and block devices below a device (see [`PciDevice`]).
    fn class_devices(&self, address: PciAddress) -> Result<(Vec<String>, Vec<String>), PciError> {
        let mut nets = BTreeSet::new();
        let mut blocks = BTreeSet::new();
        let root = dev_dir(address);
        // `BDF/net/*` directly, whether or not the entries carry a subsystem link.
        for n in self.list_or_empty(&root.join("net"))? {
            nets.insert(n);
        }
        let mut stack = vec![(root, 0usize)];
        let mut visited = 0usize;
        while let Some((dir, depth)) = stack.pop() {
            visited += 1;
            if visited > MAX_WALK_DIRS {
                break;
            }
            for name in self.list_or_empty(&dir)? {
                let child = dir.join(&name);
                // Links lead elsewhere (driver, subsystem, iommu_group, back up the tree), and a
                // directory named by a PCI address is another device: skip both.
                if self.io.read_link(&child).is_ok() || PciAddress::parse(&name).is_ok_and(|a| a.to_string() == name) {
                    continue;
                }
                let parent_name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
                match self.link_name(&child.join("subsystem"))?.as_deref() {
                    Some("block") => {
                        blocks.insert(name);
                        continue;
                    }
                    Some("net") => {
                        nets.insert(name);
                        continue;
                    }
                    _ => {}
                }
                // Glue directories hold class devices even where they lack a subsystem link.
                if parent_name.as_deref() == Some("block") && self.io.list(&child).is_ok() {
                    blocks.insert(name);
                    continue;
                }
                if depth < MAX_WALK_DEPTH {
                    stack.push((child, depth + 1));
                }
            }
        }
        Ok((nets.into_iter().collect(), self.expand_block_devs(blocks)?))
    }

    /// The block devices plus their partitions and holders, transitively, from `class/block`.
    fn expand_block_devs(&self, found: BTreeSet<String>) -> Result<Vec<String>, PciError> {
        let mut queue: Vec<String> = found.into_iter().collect();
        let heads: Vec<String> = queue
            .iter()
            .filter_map(|n| nvme_head(n))
            .filter(|h| self.io.exists(&Path::new("class/block").join(h)))
            .collect();
        queue.extend(heads);
        let mut out = BTreeSet::new();
        while let Some(name) = queue.pop() {
            if out.len() >= MAX_WALK_DIRS || !out.insert(name.clone()) {
                continue;
            }
            let dir = Path::new("class/block").join(&name);
            for child in self.list_or_empty(&dir)? {
                if self.io.exists(&dir.join(&child).join("partition")) {
                    queue.push(child);
                }
            }
            queue.extend(self.list_or_empty(&dir.join("holders"))?);
        }
        Ok(out.into_iter().collect())
    }

    /// A directory listing; empty when it is absent or not a directory.
    fn list_or_empty(&self, rel: &Path) -> Result<Vec<String>, PciError> {
        match self.io.list(rel) {
            Ok(v) => Ok(v),
            Err(e) if is_absent(&e) || e.raw_os_error() == Some(libc::EACCES) => Ok(Vec::new()),
            Err(source) => Err(PciError::Io { path: rel.to_path_buf(), source }),
        }
    }

    /// Every device in IOMMU group `group`, in address order; empty for an unknown group.
    ///
    /// # Errors
    /// As [`Pci::device`], or [`PciError::Io`] when the group cannot be listed.
    pub fn group_members(&self, group: u32) -> Result<Vec<PciDevice>, PciError> {
        let rel = PathBuf::from(format!("kernel/iommu_groups/{group}/devices"));
        let mut out = Vec::new();
        for name in self.list_or_empty(&rel)? {
            let address =
                PciAddress::parse(&name).map_err(|_| PciError::Parse { path: rel.clone(), text: name.clone() })?;
            // A member removed while we look is simply not there any more.
            if let Some(d) = self.device(address)? {
                out.push(d);
            }
        }
        out.sort_by_key(|d| d.address);
        Ok(out)
    }

    /// The devices at `addresses` and every member of their IOMMU groups, by address: the input of
    /// [`check::check`]. Absent addresses are simply not in the map.
    ///
    /// # Errors
    /// As [`Pci::device`] and [`Pci::group_members`].
    pub fn devices_with_groups(&self, addresses: &[PciAddress]) -> Result<BTreeMap<PciAddress, PciDevice>, PciError> {
        let mut out = BTreeMap::new();
        let mut groups = BTreeSet::new();
        for &a in addresses {
            if out.contains_key(&a) {
                continue;
            }
            if let Some(d) = self.device(a)? {
                if let Some(g) = d.iommu_group {
                    groups.insert(g);
                }
                out.insert(a, d);
            }
        }
        for g in groups {
            for d in self.group_members(g)? {
                out.entry(d.address).or_insert(d);
            }
        }
        Ok(out)
    }

    /// True when the kernel has IOMMU groups (`/sys/kernel/iommu_groups` is not empty): the
    /// IOMMU is on and VFIO can isolate devices.
    pub fn iommu_enabled(&self) -> bool {
        self.io.list(Path::new("kernel/iommu_groups")).is_ok_and(|g| !g.is_empty())
    }

    /// True when the vfio-pci driver is registered (`/sys/bus/pci/drivers/vfio-pci`).
    pub fn vfio_pci_present(&self) -> bool {
        self.io.exists(&Path::new("bus/pci/drivers").join(VFIO_PCI))
    }
}

/// True when the VFIO container device `/dev/vfio/vfio` exists.
pub fn vfio_container_present() -> bool {
    Path::new(VFIO_CONTAINER).exists()
}

/// Loads the vfio-pci module with `modprobe vfio-pci` (no shell), bounded by
/// [`MODPROBE_TIMEOUT`], and checks that the driver then shows in `/sys/bus/pci/drivers`.
///
/// Only for `host.check` and for binding, and only when [`Pci::vfio_pci_present`] is false: this
/// is the one place the PCI layer runs a program, because loading a module has no sysfs
/// interface.
///
/// # Errors
/// [`PciError::Modprobe`] with the reason: `modprobe` missing or not runnable, its exit status
/// and stderr, the timeout, or the driver still absent afterwards.
pub fn load_vfio_pci() -> Result<(), PciError> {
    let program = ["/usr/sbin/modprobe", "/sbin/modprobe"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
        .unwrap_or(Path::new("modprobe"));
    if crate::sandbox::spawn::has_spawner() {
        return load_vfio_pci_via_spawner(program);
    }
    let mut child = Command::new(program)
        .arg("vfio-pci")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| PciError::Modprobe(format!("cannot run {}: {e}", program.display())))?;
    let deadline = Instant::now() + MODPROBE_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                // Best effort: the error below is what matters.
                let _ = child.kill();
                let _ = child.wait();
                return Err(PciError::Modprobe(format!("modprobe did not finish within {MODPROBE_TIMEOUT:?}")));
            }
            Err(e) => return Err(PciError::Modprobe(format!("cannot wait for modprobe: {e}"))),
        }
    };
    let mut stderr = Vec::new();
    if let Some(mut pipe) = child.stderr.take() {
        // Best effort: the stderr text only decorates the error.
        let _ = pipe.read_to_end(&mut stderr);
    }
    if !status.success() {
        return Err(PciError::Modprobe(format!(
            "modprobe vfio-pci failed ({status}): {}",
            crate::process::lossy_tail(&stderr, 1024)
        )));
    }
    if !Pci::real().vfio_pci_present() {
        return Err(PciError::Modprobe("modprobe succeeded but /sys/bus/pci/drivers/vfio-pci is absent".to_string()));
    }
    Ok(())
}

/// [`load_vfio_pci`] through the sandbox's spawner (the daemon cannot run programs itself).
/// Called on the blocking pool of a tokio runtime.
fn load_vfio_pci_via_spawner(program: &Path) -> Result<(), PciError> {
    let handle = tokio::runtime::Handle::try_current()
        .map_err(|e| PciError::Modprobe(format!("cannot run {}: no runtime: {e}", program.display())))?;
    let command = crate::sandbox::spawn::Command::new(program).args(["vfio-pci"]);
    let out = handle
        .block_on(async { tokio::time::timeout(MODPROBE_TIMEOUT, command.output()).await })
        .map_err(|_| PciError::Modprobe(format!("modprobe did not finish within {MODPROBE_TIMEOUT:?}")))?
        .map_err(|e| PciError::Modprobe(format!("cannot run {}: {e}", program.display())))?;
    if !out.status.success() {
        return Err(PciError::Modprobe(format!(
            "modprobe vfio-pci failed ({}): {}",
            out.status,
            crate::process::lossy_tail(&out.stderr, 1024)
        )));
    }
    if !Pci::real().vfio_pci_present() {
        return Err(PciError::Modprobe("modprobe succeeded but /sys/bus/pci/drivers/vfio-pci is absent".to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::fake::{addr, FakeDevice, FakeSysfs};
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn fake_pci(f: FakeSysfs) -> Pci {
        Pci::new(Box::new(f))
    }

    #[test]
    fn reads_a_device_from_a_real_directory_tree() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let bdf = "0000:00:05.0";
        // As on a real system: the bus entry is a link into /sys/devices.
        let real = root.join("devices/pci0000:00").join(bdf);
        fs::create_dir_all(&real).unwrap();
        fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        fs::create_dir_all(root.join("bus/pci/drivers/e1000e")).unwrap();
        fs::create_dir_all(root.join("kernel/iommu_groups/7/devices")).unwrap();
        symlink(format!("../../../devices/pci0000:00/{bdf}"), root.join("bus/pci/devices").join(bdf)).unwrap();
        symlink(format!("../../../../devices/pci0000:00/{bdf}"), root.join("kernel/iommu_groups/7/devices").join(bdf))
            .unwrap();
        fs::write(real.join("vendor"), "0x8086\n").unwrap();
        fs::write(real.join("device"), "0x10d3\n").unwrap();
        fs::write(real.join("class"), "0x020000\n").unwrap();
        fs::write(real.join("driver_override"), "(null)\n").unwrap();
        symlink("../../../bus/pci/drivers/e1000e", real.join("driver")).unwrap();
        symlink("../../../kernel/iommu_groups/7", real.join("iommu_group")).unwrap();
        symlink("../../../bus/pci", real.join("subsystem")).unwrap();
        // net/eth0 with its class link; a loop back up the tree that the walk must not follow.
        fs::create_dir_all(real.join("net/eth0")).unwrap();
        symlink("../../../../../class/net", real.join("net/eth0/subsystem")).unwrap();
        symlink("../..", real.join("net/eth0/device")).unwrap();
        fs::create_dir_all(real.join("power")).unwrap();
        fs::write(real.join("power/control"), "on\n").unwrap();

        let pci = Pci::with_root(root);
        let a = addr(bdf);
        let d = pci.device(a).unwrap().unwrap();
        assert_eq!(
            d,
            PciDevice {
                address: a,
                vendor: 0x8086,
                device: 0x10d3,
                class: 0x020000,
                driver: Some("e1000e".to_string()),
                iommu_group: Some(7),
                is_bridge: false,
                net_ifaces: vec!["eth0".to_string()],
                block_devs: vec![],
            }
        );
        assert_eq!(pci.driver_override(a).unwrap(), None);
        assert_eq!(pci.group_members(7).unwrap(), vec![d]);
        assert!(pci.iommu_enabled());
        assert!(!pci.vfio_pci_present());
        assert_eq!(pci.device(addr("0000:00:06.0")).unwrap(), None);

        // A device without a driver and without an IOMMU group.
        fs::remove_file(real.join("driver")).unwrap();
        fs::remove_file(real.join("iommu_group")).unwrap();
        let d = pci.device(a).unwrap().unwrap();
        assert_eq!((d.driver, d.iommu_group), (None, None));
    }

    #[test]
    fn malformed_attributes_are_parse_errors() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("bus/pci/devices/0000:00:05.0");
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("vendor"), "0x18086\n").unwrap();
        fs::write(d.join("device"), "0x10d3\n").unwrap();
        fs::write(d.join("class"), "zz\n").unwrap();
        let pci = Pci::with_root(dir.path());
        assert!(matches!(pci.device(addr("0000:00:05.0")), Err(PciError::Parse { .. })));
        fs::write(d.join("vendor"), "0x8086\n").unwrap();
        let e = pci.device(addr("0000:00:05.0")).unwrap_err();
        assert!(e.to_string().contains("class"), "{e}");
        fs::write(d.join("class"), "0x020000\n").unwrap();
        symlink("../../../kernel/iommu_groups/x", d.join("iommu_group")).unwrap();
        assert!(matches!(pci.iommu_group(addr("0000:00:05.0")), Err(PciError::Parse { .. })));
    }

    #[test]
    fn no_iommu_groups_means_iommu_off() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!Pci::with_root(dir.path()).iommu_enabled());
        fs::create_dir_all(dir.path().join("kernel/iommu_groups")).unwrap();
        assert!(!Pci::with_root(dir.path()).iommu_enabled());
    }

    #[test]
    fn bridges_are_recognised_by_header_type_or_class() {
        let f = FakeSysfs::new();
        f.add_device(FakeDevice::bridge("0000:00:1c.0", 3));
        // Header type 1 but an unusual class: still a bridge.
        f.add_device(FakeDevice { bridge: true, class: 0x0b4000, ..FakeDevice::endpoint("0000:00:1d.0", 1, 2, 0, 3) });
        // Class 0x0604 alone is enough.
        f.add_device(FakeDevice::endpoint("0000:00:1e.0", 1, 2, 0x060401, 3));
        // A host bridge (class 0x0600, header type 0) is an endpoint.
        f.add_device(FakeDevice::endpoint("0000:00:00.0", 0x8086, 0x29c0, 0x060000, 3));
        let pci = fake_pci(f);
        let m = pci.group_members(3).unwrap();
        let bridges: Vec<(String, bool)> = m.iter().map(|d| (d.address.to_string(), d.is_bridge)).collect();
        assert_eq!(
            bridges,
            [
                ("0000:00:00.0".to_string(), false),
                ("0000:00:1c.0".to_string(), true),
                ("0000:00:1d.0".to_string(), true),
                ("0000:00:1e.0".to_string(), true)
            ]
        );
    }

    #[test]
    fn finds_block_devices_partitions_and_holders() {
        let f = FakeSysfs::new();
        f.add_device(FakeDevice::endpoint("0000:01:00.0", 0x1b36, 0x0010, 0x010802, 4).driver("nvme"));
        f.add_device(FakeDevice::endpoint("0000:02:00.0", 0x8086, 0x2922, 0x010601, 5).driver("ahci"));
        f.add_device(FakeDevice::endpoint("0000:03:00.0", 0x1af4, 0x1041, 0x020000, 6).driver("virtio-pci"));
        // Plain NVMe with two partitions, LVM on the second.
        f.add_block_dev("0000:01:00.0", "nvme/nvme0", "nvme0n1", &["nvme0n1p1", "nvme0n1p2"]);
        f.add_holder("nvme0n1p2", "dm-0");
        f.add_holder("dm-0", "dm-1");
        // SATA behind AHCI: the disk sits in a `block` glue directory deep below.
        f.add_block_dev("0000:02:00.0", "ata1/host0/target0:0:0/0:0:0:0/block", "sda", &["sda1"]);
        // virtio-net: the interface is below the virtio device, not directly under net/.
        f.add_dir("bus/pci/devices/0000:03:00.0/virtio0/net/eth1");
        f.add_link("bus/pci/devices/0000:03:00.0/virtio0/net/eth1/subsystem", "../../../../../../class/net");
        f.add_link("bus/pci/devices/0000:03:00.0/virtio0/driver", "../../../../bus/virtio/drivers/virtio_net");
        let pci = fake_pci(f);
        let nvme = pci.device(addr("0000:01:00.0")).unwrap().unwrap();
        assert_eq!(nvme.block_devs, ["dm-0", "dm-1", "nvme0n1", "nvme0n1p1", "nvme0n1p2"]);
        assert!(nvme.net_ifaces.is_empty());
        let ahci = pci.device(addr("0000:02:00.0")).unwrap().unwrap();
        assert_eq!(ahci.block_devs, ["sda", "sda1"]);
        let virtio = pci.device(addr("0000:03:00.0")).unwrap().unwrap();
        assert_eq!(virtio.net_ifaces, ["eth1"]);
        assert!(virtio.block_devs.is_empty());
    }

    #[test]
    fn other_pci_devices_below_a_device_are_not_its_own() {
        let f = FakeSysfs::new();
        f.add_device(FakeDevice::bridge("0000:00:1c.0", 3));
        f.add_device(FakeDevice::endpoint("0000:00:1f.0", 0x8086, 0x2918, 0x060100, 4));
        // In /sys/devices a bridge's directory holds the devices behind it.
        f.add_dir("bus/pci/devices/0000:00:1c.0/0000:01:00.0/net/eth0");
        f.add_link("bus/pci/devices/0000:00:1c.0/0000:01:00.0/net/eth0/subsystem", "../../../../../class/net");
        f.add_link("bus/pci/devices/0000:00:1f.0/0000:02:00.0/net/eth1/subsystem", "../../../../../class/net");
        f.add_block_dev("0000:00:1f.0", "0000:02:00.0/nvme/nvme0", "nvme0n1", &[]);
        let pci = fake_pci(f);
        for a in ["0000:00:1c.0", "0000:00:1f.0"] {
            let d = pci.device(addr(a)).unwrap().unwrap();
            assert!(d.net_ifaces.is_empty() && d.block_devs.is_empty(), "{d:?}");
        }
    }

    #[test]
    fn multipath_nvme_paths_lead_to_the_namespace_head() {
        let f = FakeSysfs::new();
        f.add_device(FakeDevice::endpoint("0000:01:00.0", 0x1b36, 0x0010, 0x010802, 4).driver("nvme"));
        // With native multipath the controller only has the hidden path device; the head that
        // gets mounted lives under the virtual nvme-subsystem.
        f.add_block_dev("0000:01:00.0", "nvme/nvme0", "nvme0c0n1", &[]);
        f.add_file("class/block/nvme0n1/nvme0n1p1/partition", "1\n");
        f.add_dir("class/block/nvme0n1p1/holders");
        let d = fake_pci(f).device(addr("0000:01:00.0")).unwrap().unwrap();
        assert_eq!(d.block_devs, ["nvme0c0n1", "nvme0n1", "nvme0n1p1"]);
        assert_eq!(nvme_head("nvme12c3n45p1"), Some("nvme12n45".to_string()));
        assert_eq!(nvme_head("nvme0n1"), None);
        assert_eq!(nvme_head("nvmecn1"), None);
    }

    #[test]
    fn devices_with_groups_adds_every_group_member_once() {
        let f = FakeSysfs::new();
        f.add_device(FakeDevice::endpoint("0000:00:1f.0", 0x8086, 0x2918, 0x060100, 9).driver("lpc_ich"));
        f.add_device(FakeDevice::endpoint("0000:00:1f.2", 0x8086, 0x2922, 0x010601, 9).driver("ahci"));
        f.add_device(FakeDevice::endpoint("0000:00:1f.3", 0x8086, 0x2930, 0x0c0500, 9).driver("i801_smbus"));
        f.add_device(FakeDevice::endpoint("0000:00:05.0", 0x8086, 0x10d3, 0x020000, 2).driver("e1000e"));
        f.add_device(FakeDevice::endpoint("0000:00:06.0", 0x8086, 0x10d3, 0x020000, 3).driver("e1000e"));
        let pci = fake_pci(f);
        let got = pci
            .devices_with_groups(&[
                addr("0000:00:1f.2"),
                addr("0000:00:05.0"),
                addr("0000:00:1f.2"),
                addr("0000:09:00.0"),
            ])
            .unwrap();
        let keys: Vec<String> = got.keys().map(ToString::to_string).collect();
        assert_eq!(keys, ["0000:00:05.0", "0000:00:1f.0", "0000:00:1f.2", "0000:00:1f.3"]);
    }
}
