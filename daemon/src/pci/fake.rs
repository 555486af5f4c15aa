//! A fake sysfs that reacts to writes the way the kernel's PCI core does (tests only).
//!
//! This machine has no IOMMU and no VFIO, and binding real host devices in a unit test would be
//! reckless anyway, so the PCI layer's logic is tested here against a model, and proven on a real
//! kernel in the lab host. The model keeps, per device, its ids, class, header type (bridge or
//! endpoint), IOMMU group, current driver and `driver_override`; per driver, its id table (in
//! registration order). It serves the paths the PCI layer uses and implements the kernel's rules:
//!
//! - `bus/pci/devices/BDF/driver/unbind` and `bus/pci/drivers/NAME/unbind` detach the device
//!   (`ENODEV` when that driver does not hold it);
//! - `driver_override` takes a driver name; a lone `"\n"` clears it; reads give `(null)` when unset;
//! - `bus/pci/drivers_probe` binds an unbound device to its `driver_override` driver if set (and to
//!   no other), else to the first registered driver whose id table has the device's
//!   `vendor:device`; it succeeds even when no driver takes the device, as the kernel's does;
//! - `bus/pci/drivers/NAME/bind` binds to that driver when the device is unbound and the driver
//!   matches (`driver_override`, if set, must name it);
//! - vfio-pci refuses bridges and devices without an IOMMU group; `iommu_group` reads `../../../kernel/iommu_groups/N`;
//!   `kernel/iommu_groups/N/devices` lists the members.
//!
//! Other paths (network interfaces, block devices) come from a plain tree of directories, files
//! and links the test adds. Failures are injected with [`FakeSysfs::fail_nth_write`],
//! [`FakeSysfs::fail_writes_to`], [`FakeSysfs::refuse_probe`] (a driver's probe fails, so the
//! device silently stays unbound) and [`FakeSysfs::probe_lag`] (the `driver` link shows up only
//! after some polls, like an asynchronous probe).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use super::sysfs::SysfsIo;
use crate::hardware::PciAddress;

/// The driver name vfio-pci registers.
const VFIO_PCI: &str = "vfio-pci";

/// One modelled PCI function, as a test describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeDevice {
    /// Its address.
    pub address: PciAddress,
    /// `vendor`.
    pub vendor: u16,
    /// `device`.
    pub device: u16,
    /// `class` (24 bits: class, subclass, prog-if).
    pub class: u32,
    /// Header type 1 (a PCI-to-PCI bridge): has `secondary_bus_number`.
    pub bridge: bool,
    /// IOMMU group, `None` when the IOMMU is off.
    pub group: Option<u32>,
    /// Bound driver.
    pub driver: Option<String>,
    /// `driver_override`.
    pub driver_override: Option<String>,
}

impl FakeDevice {
    /// An endpoint at `address` (which must parse) in IOMMU group `group`, without a driver.
    pub fn endpoint(address: &str, vendor: u16, device: u16, class: u32, group: u32) -> FakeDevice {
        FakeDevice {
            address: addr(address),
            vendor,
            device,
            class,
            bridge: false,
            group: Some(group),
            driver: None,
            driver_override: None,
        }
    }

    /// A PCI-to-PCI bridge (class 0x060400, header type 1) in `group`, bound to pcieport.
    pub fn bridge(address: &str, group: u32) -> FakeDevice {
        FakeDevice {
            bridge: true,
            driver: Some("pcieport".to_string()),
            ..FakeDevice::endpoint(address, 0x8086, 0x7c00, 0x060400, group)
        }
    }

    /// The same device bound to `driver`.
    pub fn driver(mut self, driver: &str) -> FakeDevice {
        self.driver = Some(driver.to_string());
        self
    }

    /// The same device outside any IOMMU group.
    pub fn no_group(mut self) -> FakeDevice {
        self.group = None;
        self
    }
}

/// Parses a PCI address in test code.
///
/// # Panics
/// When `text` is not an address (a bug in the test).
pub fn addr(text: &str) -> PciAddress {
    match PciAddress::parse(text) {
        Ok(a) => a,
        Err(e) => panic!("{e}"),
    }
}

/// A node of the free-form part of the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    /// A directory (its children are the nodes below it).
    Dir,
    /// An attribute with this content.
    File(String),
    /// A symbolic link with this target.
    Link(PathBuf),
}

/// Everything the fake knows; behind one lock.
#[derive(Debug, Default)]
struct State {
    /// Modelled devices.
    devices: BTreeMap<PciAddress, FakeDevice>,
    /// Registered drivers and their id tables, in registration order.
    drivers: Vec<(String, Vec<(u16, u16)>)>,
    /// Free-form nodes by path.
    tree: BTreeMap<PathBuf, Node>,
    /// Every write that took effect, in order.
    writes: Vec<(String, String)>,
    /// Writes still to succeed before one fails with `EIO`.
    fail_after: Option<usize>,
    /// Paths whose writes fail with `EIO`.
    failing_paths: BTreeSet<PathBuf>,
    /// `(device, driver)` pairs whose probe fails.
    refused: BTreeSet<(PciAddress, String)>,
    /// Per device: how many `driver` lookups after a bind still see no driver.
    lag: BTreeMap<PciAddress, u32>,
    /// Lookups left to hide the current binding, per device.
    hidden: BTreeMap<PciAddress, u32>,
}

impl State {
    fn driver_ids(&self, name: &str) -> Option<&[(u16, u16)]> {
        self.drivers.iter().find(|(n, _)| n == name).map(|(_, ids)| ids.as_slice())
    }

    /// Would `driver`'s probe accept `dev`?
    fn probe_ok(&self, dev: &FakeDevice, driver: &str) -> bool {
        let vfio_refuses = driver == VFIO_PCI && (dev.bridge || dev.group.is_none());
        !(vfio_refuses || self.refused.contains(&(dev.address, driver.to_string())))
    }

    /// Binds `address` to `driver` and starts its lag.
    fn attach(&mut self, address: PciAddress, driver: &str) {
        if let Some(d) = self.devices.get_mut(&address) {
            d.driver = Some(driver.to_string());
        }
        if let Some(&n) = self.lag.get(&address) {
            self.hidden.insert(address, n);
        }
    }

    /// `drivers_probe`: the override alone if set, else the first matching driver.
    fn probe(&mut self, address: PciAddress) {
        let Some(dev) = self.devices.get(&address).cloned() else { return };
        if dev.driver.is_some() {
            return;
        }
        let candidates: Vec<String> = match &dev.driver_override {
            Some(o) => self.driver_ids(o).map(|_| vec![o.clone()]).unwrap_or_default(),
            None => self
                .drivers
                .iter()
                .filter(|(_, ids)| ids.contains(&(dev.vendor, dev.device)))
                .map(|(n, _)| n.clone())
                .collect(),
        };
        if let Some(d) = candidates.into_iter().find(|d| self.probe_ok(&dev, d)) {
            self.attach(address, &d);
        }
    }

    /// `drivers/NAME/bind`.
    fn bind(&mut self, address: PciAddress, driver: &str) -> io::Result<()> {
        let dev = self.devices.get(&address).cloned().ok_or_else(|| errno(libc::ENODEV))?;
        if dev.driver.is_some() {
            return Err(errno(libc::EBUSY));
        }
        let ids = self.driver_ids(driver).ok_or_else(|| errno(libc::ENOENT))?;
        let matches = match &dev.driver_override {
            Some(o) => o == driver,
            None => ids.contains(&(dev.vendor, dev.device)),
        };
        if !matches || !self.probe_ok(&dev, driver) {
            return Err(errno(libc::ENODEV));
        }
        self.attach(address, driver);
        Ok(())
    }

    /// `.../unbind`: detaches `address` if `driver` holds it.
    fn unbind(&mut self, address: PciAddress, driver: &str) -> io::Result<()> {
        match self.devices.get_mut(&address) {
            Some(d) if d.driver.as_deref() == Some(driver) => {
                d.driver = None;
                self.hidden.remove(&address);
                Ok(())
            }
            _ => Err(errno(libc::ENODEV)),
        }
    }

    /// The bound driver as a `driver` lookup sees it (consumes one lagging lookup).
    fn visible_driver(&mut self, address: PciAddress) -> Option<String> {
        let driver = self.devices.get(&address)?.driver.clone()?;
        match self.hidden.get_mut(&address) {
            Some(n) if *n > 0 => {
                *n -= 1;
                None
            }
            _ => Some(driver),
        }
    }
}

/// An `io::Error` from an errno value.
fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

fn not_found() -> io::Error {
    errno(libc::ENOENT)
}

/// The path components as strings.
fn parts(rel: &Path) -> Vec<String> {
    rel.iter().map(|c| c.to_string_lossy().into_owned()).collect()
}

/// The address a write names (`"0000:00:05.0\n"`).
fn written_address(data: &str) -> io::Result<PciAddress> {
    PciAddress::parse(data.trim()).map_err(|_| errno(libc::ENODEV))
}

/// A sysfs tree modelling the kernel's PCI core. See the module documentation.
#[derive(Debug, Default)]
pub struct FakeSysfs {
    state: Mutex<State>,
}

impl FakeSysfs {
    /// An empty tree: no devices, no drivers.
    pub fn new() -> FakeSysfs {
        FakeSysfs::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock has failed already; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a driver matching these `(vendor, device)` ids (vfio-pci has none).
    pub fn add_driver(&self, name: &str, ids: &[(u16, u16)]) -> &Self {
        let mut s = self.state();
        s.drivers.retain(|(n, _)| n != name);
        s.drivers.push((name.to_string(), ids.to_vec()));
        drop(s);
        self
    }

    /// Adds a device; a driver it names is registered (with no ids) if it is not yet.
    pub fn add_device(&self, dev: FakeDevice) -> &Self {
        let mut s = self.state();
        if let Some(d) = &dev.driver {
            if s.driver_ids(d).is_none() {
                s.drivers.push((d.clone(), Vec::new()));
            }
        }
        s.devices.insert(dev.address, dev);
        drop(s);
        self
    }

    /// Adds a directory (and its parents) to the free-form tree.
    pub fn add_dir(&self, rel: &str) -> &Self {
        let mut s = self.state();
        let mut p = PathBuf::new();
        for c in Path::new(rel) {
            p.push(c);
            s.tree.entry(p.clone()).or_insert(Node::Dir);
        }
        drop(s);
        self
    }

    /// Adds an attribute file (and its parent directories).
    pub fn add_file(&self, rel: &str, content: &str) -> &Self {
        if let Some(parent) = Path::new(rel).parent() {
            self.add_dir(&parent.to_string_lossy());
        }
        self.state().tree.insert(PathBuf::from(rel), Node::File(content.to_string()));
        self
    }

    /// Adds a symbolic link (and its parent directories).
    pub fn add_link(&self, rel: &str, target: &str) -> &Self {
        if let Some(parent) = Path::new(rel).parent() {
            self.add_dir(&parent.to_string_lossy());
        }
        self.state().tree.insert(PathBuf::from(rel), Node::Link(PathBuf::from(target)));
        self
    }

    /// Gives the device at `address` a network interface `bus/pci/devices/BDF/net/NAME`.
    pub fn add_net_iface(&self, address: &str, name: &str) -> &Self {
        self.add_dir(&format!("bus/pci/devices/{}/net/{name}", addr(address)))
    }

    /// Adds block device `name` at `under` (a path below the device's directory, e.g.
    /// `nvme/nvme0` or `host0/target0:0:0/0:0:0:0/block`) with these partitions, plus its
    /// `class/block` entries.
    pub fn add_block_dev(&self, address: &str, under: &str, name: &str, partitions: &[&str]) -> &Self {
        let dir = format!("bus/pci/devices/{}/{under}/{name}", addr(address));
        self.add_link(&format!("{dir}/subsystem"), "../../../../../../class/block");
        self.add_dir(&format!("class/block/{name}/holders"));
        for p in partitions {
            self.add_link(&format!("{dir}/{p}/subsystem"), "../../../../../../../class/block");
            self.add_file(&format!("{dir}/{p}/partition"), "1\n");
            self.add_file(&format!("class/block/{name}/{p}/partition"), "1\n");
            self.add_file(&format!("class/block/{p}/partition"), "1\n");
            self.add_dir(&format!("class/block/{p}/holders"));
        }
        self
    }

    /// Makes `holder` (a device-mapper or md device) a holder of block device `of`.
    pub fn add_holder(&self, of: &str, holder: &str) -> &Self {
        self.add_link(&format!("class/block/{of}/holders/{holder}"), &format!("../../{holder}"));
        self.add_dir(&format!("class/block/{holder}/holders"))
    }

    /// The `n`th write from now (1-based) fails with `EIO` and changes nothing.
    pub fn fail_nth_write(&self, n: usize) -> &Self {
        self.state().fail_after = n.checked_sub(1);
        self
    }

    /// Every write to `rel` fails with `EIO` until [`FakeSysfs::heal`].
    pub fn fail_writes_to(&self, rel: &str) -> &Self {
        self.state().failing_paths.insert(PathBuf::from(rel));
        self
    }

    /// `driver`'s probe of `address` fails: the device stays unbound, the write succeeds.
    pub fn refuse_probe(&self, address: &str, driver: &str) -> &Self {
        self.state().refused.insert((addr(address), driver.to_string()));
        self
    }

    /// After each bind of `address`, its next `polls` `driver` lookups still see no driver.
    pub fn probe_lag(&self, address: &str, polls: u32) -> &Self {
        self.state().lag.insert(addr(address), polls);
        self
    }

    /// Clears every injected failure.
    pub fn heal(&self) -> &Self {
        let mut s = self.state();
        s.fail_after = None;
        s.failing_paths.clear();
        s.refused.clear();
        s.lag.clear();
        s.hidden.clear();
        drop(s);
        self
    }

    /// The driver bound to `address` now (without lag).
    pub fn driver_of(&self, address: &str) -> Option<String> {
        self.state().devices.get(&addr(address)).and_then(|d| d.driver.clone())
    }

    /// The `driver_override` of `address` now.
    pub fn override_of(&self, address: &str) -> Option<String> {
        self.state().devices.get(&addr(address)).and_then(|d| d.driver_override.clone())
    }

    /// Every write that took effect, as `(path, data)`.
    pub fn writes(&self) -> Vec<(String, String)> {
        self.state().writes.clone()
    }

    /// Forgets the write log.
    pub fn clear_writes(&self) {
        self.state().writes.clear();
    }

    /// The device named by a path component, if modelled.
    fn device(s: &State, bdf: &str) -> Option<FakeDevice> {
        PciAddress::parse(bdf).ok().filter(|a| a.to_string() == bdf).and_then(|a| s.devices.get(&a).cloned())
    }

    /// Children of a free-form directory.
    fn tree_children(s: &State, rel: &Path) -> Vec<String> {
        s.tree
            .keys()
            .filter(|k| k.parent() == Some(rel))
            .filter_map(|k| k.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect()
    }

    /// Applies a write to a modelled path; `None` when the path is not modelled.
    fn modelled_write(s: &mut State, p: &[&str], data: &str) -> Option<io::Result<()>> {
        Some(match p {
            ["bus", "pci", "drivers_probe"] => written_address(data).and_then(|a| {
                if s.devices.contains_key(&a) {
                    s.probe(a);
                    Ok(())
                } else {
                    Err(errno(libc::ENODEV))
                }
            }),
            ["bus", "pci", "devices", bdf, rest @ ..] => {
                let dev = Self::device(s, bdf)?;
                match rest {
                    ["driver_override"] => {
                        let name = data.split('\n').next().unwrap_or("");
                        if let Some(d) = s.devices.get_mut(&dev.address) {
                            d.driver_override = (!name.is_empty()).then(|| name.to_string());
                        }
                        Ok(())
                    }
                    ["driver", "unbind"] => match &dev.driver {
                        Some(d) => written_address(data).and_then(|a| s.unbind(a, d)),
                        None => Err(not_found()),
                    },
                    ["vendor" | "device" | "class" | "iommu_group" | "secondary_bus_number"] => {
                        Err(errno(libc::EACCES))
                    }
                    _ => return None,
                }
            }
            ["bus", "pci", "drivers", name, op @ ("bind" | "unbind")] => {
                if s.driver_ids(name).is_none() {
                    return Some(Err(not_found()));
                }
                written_address(data).and_then(|a| if *op == "bind" { s.bind(a, name) } else { s.unbind(a, name) })
            }
            _ => return None,
        })
    }
}

impl SysfsIo for FakeSysfs {
    fn read(&self, rel: &Path) -> io::Result<String> {
        let s = self.state();
        let p = parts(rel);
        let p: Vec<&str> = p.iter().map(String::as_str).collect();
        if let ["bus", "pci", "devices", bdf, attr] = p.as_slice() {
            if let Some(d) = Self::device(&s, bdf) {
                match *attr {
                    "vendor" => return Ok(format!("0x{:04x}\n", d.vendor)),
                    "device" => return Ok(format!("0x{:04x}\n", d.device)),
                    "class" => return Ok(format!("0x{:06x}\n", d.class)),
                    "driver_override" => {
                        return Ok(format!("{}\n", d.driver_override.as_deref().unwrap_or("(null)")));
                    }
                    "secondary_bus_number" if d.bridge => return Ok("1\n".to_string()),
                    _ => {}
                }
            }
        }
        match s.tree.get(rel) {
            Some(Node::File(c)) => Ok(c.clone()),
            Some(Node::Dir) => Err(errno(libc::EISDIR)),
            Some(Node::Link(_)) | None => Err(not_found()),
        }
    }

    fn read_link(&self, rel: &Path) -> io::Result<PathBuf> {
        let mut s = self.state();
        let p = parts(rel);
        let p: Vec<&str> = p.iter().map(String::as_str).collect();
        if let ["bus", "pci", "devices", bdf, attr] = p.as_slice() {
            if let Some(d) = Self::device(&s, bdf) {
                match *attr {
                    "driver" => {
                        return s
                            .visible_driver(d.address)
                            .map(|n| PathBuf::from(format!("../../../bus/pci/drivers/{n}")))
                            .ok_or_else(not_found);
                    }
                    "iommu_group" => {
                        return d
                            .group
                            .map(|g| PathBuf::from(format!("../../../kernel/iommu_groups/{g}")))
                            .ok_or_else(not_found);
                    }
                    "subsystem" => return Ok(PathBuf::from("../../../bus/pci")),
                    _ => {}
                }
            }
        }
        match s.tree.get(rel) {
            Some(Node::Link(t)) => Ok(t.clone()),
            Some(_) => Err(errno(libc::EINVAL)),
            None => Err(not_found()),
        }
    }

    fn write(&self, rel: &Path, data: &str) -> io::Result<()> {
        let mut s = self.state();
        if s.failing_paths.contains(rel) {
            return Err(errno(libc::EIO));
        }
        match s.fail_after {
            Some(0) => {
                s.fail_after = None;
                return Err(errno(libc::EIO));
            }
            Some(n) => s.fail_after = Some(n - 1),
            None => {}
        }
        let p = parts(rel);
        let p: Vec<&str> = p.iter().map(String::as_str).collect();
        let result = match Self::modelled_write(&mut s, &p, data) {
            Some(r) => r,
            None => match s.tree.get_mut(rel) {
                Some(Node::File(c)) => {
                    *c = data.to_string();
                    Ok(())
                }
                Some(_) => Err(errno(libc::EISDIR)),
                None => Err(not_found()),
            },
        };
        if result.is_ok() {
            s.writes.push((rel.to_string_lossy().into_owned(), data.to_string()));
        }
        result
    }

    fn list(&self, rel: &Path) -> io::Result<Vec<String>> {
        let s = self.state();
        let p = parts(rel);
        let p: Vec<&str> = p.iter().map(String::as_str).collect();
        let mut names: Vec<String> = match p.as_slice() {
            ["bus", "pci", "devices"] => s.devices.keys().map(ToString::to_string).collect(),
            ["bus", "pci", "drivers"] => s.drivers.iter().map(|(n, _)| n.clone()).collect(),
            ["bus", "pci", "drivers", name] if s.driver_ids(name).is_some() => {
                let mut v = vec!["bind".to_string(), "unbind".to_string(), "new_id".to_string()];
                v.extend(
                    s.devices.values().filter(|d| d.driver.as_deref() == Some(*name)).map(|d| d.address.to_string()),
                );
                v
            }
            ["kernel", "iommu_groups"] => {
                let groups: BTreeSet<u32> = s.devices.values().filter_map(|d| d.group).collect();
                groups.iter().map(ToString::to_string).collect()
            }
            ["kernel", "iommu_groups", g] => {
                if !s.devices.values().any(|d| d.group.map(|x| x.to_string()).as_deref() == Some(*g)) {
                    return Err(not_found());
                }
                vec!["devices".to_string(), "type".to_string()]
            }
            ["kernel", "iommu_groups", g, "devices"] => {
                let members: Vec<String> = s
                    .devices
                    .values()
                    .filter(|d| d.group.map(|x| x.to_string()).as_deref() == Some(*g))
                    .map(|d| d.address.to_string())
                    .collect();
                if members.is_empty() {
                    return Err(not_found());
                }
                members
            }
            ["bus", "pci", "devices", bdf] => {
                let d = Self::device(&s, bdf).ok_or_else(not_found)?;
                let mut v: Vec<String> = ["class", "device", "driver_override", "subsystem", "vendor"]
                    .iter()
                    .map(ToString::to_string)
                    .collect();
                if d.driver.is_some() {
                    v.push("driver".to_string());
                }
                if d.group.is_some() {
                    v.push("iommu_group".to_string());
                }
                if d.bridge {
                    v.push("secondary_bus_number".to_string());
                }
                v.extend(Self::tree_children(&s, rel));
                v
            }
            _ => match s.tree.get(rel) {
                Some(Node::Dir) => Self::tree_children(&s, rel),
                Some(_) => return Err(errno(libc::ENOTDIR)),
                None => return Err(not_found()),
            },
        };
        names.sort();
        names.dedup();
        Ok(names)
    }

    fn exists(&self, rel: &Path) -> bool {
        let mut s = self.state();
        let p = parts(rel);
        let p: Vec<&str> = p.iter().map(String::as_str).collect();
        match p.as_slice() {
            ["bus", "pci", "drivers_probe"] | ["bus", "pci", "devices"] | ["bus", "pci", "drivers"] => true,
            ["kernel", "iommu_groups"] => true,
            ["bus", "pci", "drivers", name] => s.driver_ids(name).is_some(),
            ["bus", "pci", "drivers", name, "bind" | "unbind" | "new_id"] => s.driver_ids(name).is_some(),
            ["bus", "pci", "devices", bdf, rest @ ..] => match Self::device(&s, bdf) {
                None => false,
                Some(d) => match rest {
                    [] | ["vendor" | "device" | "class" | "driver_override" | "subsystem"] => true,
                    ["driver"] => s.visible_driver(d.address).is_some(),
                    ["driver", "unbind" | "bind"] => d.driver.is_some(),
                    ["iommu_group"] => d.group.is_some(),
                    ["secondary_bus_number"] => d.bridge,
                    _ => s.tree.contains_key(rel),
                },
            },
            _ => Self::other_exists(&s, rel),
        }
    }
}

impl FakeSysfs {
    /// `exists` for free-form paths and IOMMU group directories.
    fn other_exists(s: &State, rel: &Path) -> bool {
        let p = parts(rel);
        if let [k, g, rest @ ..] = p.as_slice() {
            if k == "kernel" && g == "iommu_groups" {
                if let Some(n) = rest.first() {
                    let known = s.devices.values().any(|d| d.group.map(|x| x.to_string()).as_deref() == Some(n));
                    return known && (rest.len() == 1 || rest.len() == 2 && rest[1] == "devices");
                }
            }
        }
        s.tree.contains_key(rel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NIC: &str = "0000:00:05.0";

    fn p(s: &str) -> &Path {
        Path::new(s)
    }

    fn fake() -> FakeSysfs {
        let f = FakeSysfs::new();
        f.add_driver("e1000e", &[(0x8086, 0x10d3)]).add_driver("vfio-pci", &[]);
        f.add_device(FakeDevice::endpoint(NIC, 0x8086, 0x10d3, 0x020000, 7).driver("e1000e"));
        f
    }

    #[test]
    fn reads_like_the_kernel() {
        let f = fake();
        let d = "bus/pci/devices/0000:00:05.0";
        assert_eq!(f.read(p(&format!("{d}/vendor"))).unwrap(), "0x8086\n");
        assert_eq!(f.read(p(&format!("{d}/class"))).unwrap(), "0x020000\n");
        assert_eq!(f.read(p(&format!("{d}/driver_override"))).unwrap(), "(null)\n");
        assert_eq!(f.read_link(p(&format!("{d}/driver"))).unwrap(), p("../../../bus/pci/drivers/e1000e"));
        assert_eq!(f.read_link(p(&format!("{d}/iommu_group"))).unwrap(), p("../../../kernel/iommu_groups/7"));
        assert_eq!(f.list(p("kernel/iommu_groups")).unwrap(), ["7"]);
        assert_eq!(f.list(p("kernel/iommu_groups/7/devices")).unwrap(), [NIC]);
        assert_eq!(f.list(p("bus/pci/drivers")).unwrap(), ["e1000e", "vfio-pci"]);
        assert!(f.exists(p("bus/pci/drivers/vfio-pci")));
        assert!(!f.exists(p("bus/pci/devices/0000:00:06.0")));
        assert!(!f.exists(p(&format!("{d}/secondary_bus_number"))));
    }

    #[test]
    fn override_and_probe_bind_only_the_override_driver() {
        let f = fake();
        let d = "bus/pci/devices/0000:00:05.0";
        f.write(p(&format!("{d}/driver_override")), "vfio-pci").unwrap();
        // Still bound: an override alone changes nothing.
        assert_eq!(f.driver_of(NIC).as_deref(), Some("e1000e"));
        f.write(p(&format!("{d}/driver/unbind")), NIC).unwrap();
        assert_eq!(f.driver_of(NIC), None);
        f.write(p("bus/pci/drivers_probe"), NIC).unwrap();
        assert_eq!(f.driver_of(NIC).as_deref(), Some("vfio-pci"));
        // e1000e cannot take it while the override names vfio-pci.
        f.write(p("bus/pci/drivers/vfio-pci/unbind"), NIC).unwrap();
        assert_eq!(f.write(p("bus/pci/drivers/e1000e/bind"), NIC).unwrap_err().raw_os_error(), Some(libc::ENODEV));
        // "\n" clears the override; reprobing finds e1000e by its id table.
        f.write(p(&format!("{d}/driver_override")), "\n").unwrap();
        assert_eq!(f.override_of(NIC), None);
        f.write(p("bus/pci/drivers_probe"), NIC).unwrap();
        assert_eq!(f.driver_of(NIC).as_deref(), Some("e1000e"));
    }

    #[test]
    fn unbinding_from_a_driver_that_does_not_hold_the_device_is_enodev() {
        let f = fake();
        let e = f.write(p("bus/pci/drivers/vfio-pci/unbind"), NIC).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENODEV));
        assert_eq!(f.driver_of(NIC).as_deref(), Some("e1000e"));
    }

    #[test]
    fn probe_without_a_matching_driver_succeeds_and_binds_nothing() {
        let f = fake();
        f.write(p("bus/pci/devices/0000:00:05.0/driver/unbind"), NIC).unwrap();
        f.write(p("bus/pci/devices/0000:00:05.0/driver_override"), "nosuch").unwrap();
        f.write(p("bus/pci/drivers_probe"), NIC).unwrap();
        assert_eq!(f.driver_of(NIC), None);
        assert!(!f.exists(p("bus/pci/devices/0000:00:05.0/driver")));
    }

    #[test]
    fn injected_failures() {
        let f = fake();
        f.fail_nth_write(2);
        f.write(p("bus/pci/devices/0000:00:05.0/driver_override"), "vfio-pci").unwrap();
        let e = f.write(p("bus/pci/devices/0000:00:05.0/driver/unbind"), NIC).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        assert_eq!(f.driver_of(NIC).as_deref(), Some("e1000e"));
        f.write(p("bus/pci/devices/0000:00:05.0/driver/unbind"), NIC).unwrap();

        f.refuse_probe(NIC, "vfio-pci");
        f.write(p("bus/pci/drivers_probe"), NIC).unwrap();
        assert_eq!(f.driver_of(NIC), None);

        f.heal().probe_lag(NIC, 2);
        f.write(p("bus/pci/drivers_probe"), NIC).unwrap();
        let link = p("bus/pci/devices/0000:00:05.0/driver");
        assert!(f.read_link(link).is_err());
        assert!(!f.exists(link));
        assert!(f.read_link(link).is_ok());
        assert_eq!(f.writes().len(), 4);
    }

    #[test]
    fn free_form_tree() {
        let f = fake();
        f.add_net_iface(NIC, "eth0");
        f.add_block_dev(NIC, "nvme/nvme0", "nvme0n1", &["nvme0n1p1"]);
        let d = "bus/pci/devices/0000:00:05.0";
        assert_eq!(f.list(p(&format!("{d}/net"))).unwrap(), ["eth0"]);
        assert!(f.list(p(d)).unwrap().contains(&"nvme".to_string()));
        assert_eq!(f.read_link(p(&format!("{d}/nvme/nvme0/nvme0n1/subsystem"))).unwrap().file_name().unwrap(), "block");
        assert_eq!(f.list(p("class/block/nvme0n1")).unwrap(), ["holders", "nvme0n1p1"]);
        assert!(f.list(p(&format!("{d}/vendor"))).is_err());
    }
}
