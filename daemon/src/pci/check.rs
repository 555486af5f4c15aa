//! May these PCI devices go to this VM? A pure function of what sysfs showed, what the host uses
//! and what other VMs hold, run before anything is touched.
//!
//! QEMU can only be given whole IOMMU groups: the kernel (VFIO) refuses a group while any member
//! is held by a host driver that does DMA, and QEMU then says no more than "group N is not
//! viable". [`check`] explains that before binding anything, and also refuses devices the host
//! itself is using, which binding would yank away (a NIC with an address or default route, a
//! bridge or bond port, a disk under a mounted file system).
//!
//! The caller gathers the inputs: [`super::Pci::devices_with_groups`] for the devices (the
//! requested ones and every member of their groups), [`HostUsage`] from netlink and
//! `/proc/self/mountinfo`, and what other VMs hold from their records. Checks, in this order (the
//! first failing kind is reported, with every offender of that kind):
//!
//! 1. each requested device exists, is requested once, and is an endpoint, not a bridge: 2001;
//! 2. it is not held by another VM: 3003 with `details.conflicts: [{address, holder}]`;
//! 3. the host does not use it: 3005 with `details.in_use: [{address, interface | block_device,
//!    reason}]`;
//! 4. it has an IOMMU group, and every other member of the group is itself requested, driverless,
//!    a PCI bridge, or on vfio-pci or pci-stub, and not held by another VM: else 3004 with
//!    `details.blocking: [{address, driver, group, holder}]`.
//!
//! # Which devices go to vfio-pci
//! Only the requested devices ([`Assignment::to_bind`]). Group members that pass step 4 are left
//! exactly as they are: a driverless member stays driverless (VFIO accepts it, and since Linux
//! 5.19 the kernel refuses to bind a DMA-capable host driver to it while the group is in use), a
//! bridge stays on pcieport (unbinding it would cost the host hotplug and error reporting for
//! everything below it), a member already on vfio-pci or pci-stub stays there. So release has
//! nothing to restore for them, and no device the VM did not ask for changes hands.

use std::collections::{BTreeMap, BTreeSet};

use super::{PciDevice, PCI_STUB, VFIO_PCI};
use crate::hardware::PciAddress;

/// What the host itself uses, by kernel name: filled by the caller from netlink and
/// `/proc/self/mountinfo`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostUsage {
    /// Interfaces with a configured IP address: IPv4, or IPv6 other than link-local (`fe80::/10`,
    /// which every interface that is up gets by itself and which says nothing about use).
    pub ifaces_with_address: BTreeSet<String>,
    /// Interfaces a default route (v4 or v6) goes out of.
    pub default_route_ifaces: BTreeSet<String>,
    /// Interfaces enslaved to a bridge or bond.
    pub enslaved_ifaces: BTreeSet<String>,
    /// Block devices with a mounted file system, as kernel names (`nvme0n1p2`, `sda1`, `dm-0`;
    /// resolve `/dev/mapper/...` and `major:minor` through `/sys/dev/block`).
    pub mounted_block_devs: BTreeSet<String>,
}

/// One device a VM asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requested {
    /// Its address.
    pub address: PciAddress,
    /// The spec field that asked for it (`spec.hardware.sfp[0]`, `spec.pci[1]`), for errors.
    pub field: String,
}

impl Requested {
    /// A request for `address` from `field`.
    pub fn new(address: PciAddress, field: impl Into<String>) -> Requested {
        Requested { address, field: field.into() }
    }
}

/// What a VM may have: the outcome of a successful [`check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The requested devices, in request order: each becomes `-device vfio-pci,host=BDF`.
    pub devices: Vec<PciAddress>,
    /// The devices that must be on vfio-pci while the VM runs (see the module documentation:
    /// the requested devices; no sibling needs to move).
    pub to_bind: Vec<PciAddress>,
    /// The IOMMU groups involved, ascending: `/dev/vfio/N` must be accessible to QEMU.
    pub groups: Vec<u32>,
}

/// Why the requested devices may not go to the VM: the first failing kind of [`check`], with
/// every offender of that kind. The API codes and fields are given at the boundary
/// (`crate::owner_errors`); the texts here are the messages users read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    /// Step 1: a device is absent, requested twice, or a bridge.
    #[error("{}", join(&.0.iter().map(|p| p.problem.clone()).collect::<Vec<_>>()))]
    Shape(Vec<ShapeProblem>),
    /// Step 2: devices held by other VMs.
    #[error("{}", join(&.0.iter().map(|c| format!("{} ({}) in use by {}", c.address, c.field, c.holder)).collect::<Vec<_>>()))]
    Held(Vec<HeldConflict>),
    /// Step 3: devices the host itself uses, one entry per use, in request order.
    #[error(
        "{}. Passing it through would take it away from the host; release it on the host first \
         (remove addresses, routes and bridge/bond membership, unmount)",
        host_use_text(.0)
    )]
    InUseByHost(Vec<HostUse>),
    /// Step 4, before groups are looked at: requested devices without an IOMMU group (the IOMMU
    /// is off or absent).
    #[error("{}", no_group_text(.0))]
    NoIommuGroup(Vec<Requested>),
    /// Step 4: groups with members that are neither requested nor harmless, in group order.
    #[error(
        "{}. A VM can only be given whole IOMMU groups (QEMU would refuse with \"group is not \
         viable\"): pass those devices through to this VM as well, or unbind them from their host \
         drivers, or choose a device in a group of its own",
        join(&.0.iter().map(BlockedGroup::text).collect::<Vec<_>>())
    )]
    GroupNotViable(Vec<BlockedGroup>),
}

impl CheckError {
    /// The spec field of the first offending request.
    pub fn field(&self) -> Option<&str> {
        match self {
            CheckError::Shape(v) => v.first().map(|p| p.field.as_str()),
            CheckError::Held(v) => v.first().map(|c| c.field.as_str()),
            CheckError::InUseByHost(v) => v.first().map(|u| u.field.as_str()),
            CheckError::NoIommuGroup(v) => v.first().map(|r| r.field.as_str()),
            CheckError::GroupNotViable(v) => v.first().map(|g| g.field.as_str()),
        }
    }
}

/// One request that fails step 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeProblem {
    /// The requested address.
    pub address: PciAddress,
    /// The spec field that asked for it.
    pub field: String,
    /// What is wrong, as a sentence naming both.
    pub problem: String,
}

/// One request held by another VM (step 2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldConflict {
    /// The requested address.
    pub address: PciAddress,
    /// The spec field that asked for it.
    pub field: String,
    /// The VM holding it.
    pub holder: String,
}

/// What of the host uses a requested device (step 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostUseKind {
    /// One of its network interfaces has an IP address.
    Address(String),
    /// One of its network interfaces carries a default route.
    DefaultRoute(String),
    /// One of its network interfaces is a bridge or bond port.
    Enslaved(String),
    /// A block device below it is mounted.
    Mounted(String),
}

impl HostUseKind {
    /// The reason as the API names it (`details.in_use[].reason`).
    pub fn reason(&self) -> &'static str {
        match self {
            HostUseKind::Address(_) => "address",
            HostUseKind::DefaultRoute(_) => "default_route",
            HostUseKind::Enslaved(_) => "enslaved",
            HostUseKind::Mounted(_) => "mounted",
        }
    }

    fn text(&self) -> String {
        match self {
            HostUseKind::Address(i) => format!("interface {i} has an IP address"),
            HostUseKind::DefaultRoute(i) => format!("interface {i} carries a default route"),
            HostUseKind::Enslaved(i) => format!("interface {i} is a bridge or bond port"),
            HostUseKind::Mounted(d) => format!("block device {d} is mounted"),
        }
    }
}

/// One use by the host of one requested device (step 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostUse {
    /// The requested address.
    pub address: PciAddress,
    /// The spec field that asked for it.
    pub field: String,
    /// The use.
    pub kind: HostUseKind,
}

/// One IOMMU group that cannot go to the VM whole (step 4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockedGroup {
    /// The group number.
    pub group: u32,
    /// The first requested device in it.
    pub address: PciAddress,
    /// The spec field that asked for it.
    pub field: String,
    /// The members that block it, in address order.
    pub blocking: Vec<Blocker>,
}

impl BlockedGroup {
    fn text(&self) -> String {
        let names: Vec<String> = self
            .blocking
            .iter()
            .map(|m| match (&m.holder, &m.driver) {
                (Some(h), _) => format!("{} (held by VM {h})", m.address),
                (None, Some(d)) => format!("{} (driver {d})", m.address),
                (None, None) => m.address.to_string(),
            })
            .collect();
        format!("IOMMU group {} of {} ({}) also contains {}", self.group, self.address, self.field, names.join(", "))
    }
}

/// A group member that is neither requested nor harmless.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocker {
    /// Its address.
    pub address: PciAddress,
    /// Its host driver, if any.
    pub driver: Option<String>,
    /// The VM holding it, if any.
    pub holder: Option<String>,
}

/// The uses of step 3 grouped by device, in request order.
fn host_use_text(uses: &[HostUse]) -> String {
    let mut texts: Vec<String> = Vec::new();
    let mut i = 0;
    while let Some(first) = uses.get(i) {
        let same: Vec<&HostUse> =
            uses[i..].iter().take_while(|u| u.address == first.address && u.field == first.field).collect();
        i += same.len();
        let reasons: Vec<String> = same.iter().map(|u| u.kind.text()).collect();
        texts.push(format!("{} ({}) is in use by the host: {}", first.address, first.field, reasons.join(", ")));
    }
    join(&texts)
}

fn no_group_text(no_group: &[Requested]) -> String {
    let names: Vec<String> = no_group.iter().map(|r| format!("{} ({})", r.address, r.field)).collect();
    format!(
        "{} {} no IOMMU group: the IOMMU is off or absent, so VFIO cannot isolate {}. Enable \
         VT-d/AMD-Vi in the firmware and boot the host with intel_iommu=on (or amd_iommu=on)",
        names.join(", "),
        if no_group.len() == 1 { "has" } else { "have" },
        if no_group.len() == 1 { "it" } else { "them" },
    )
}

/// Checks that the `requested` devices may go to one VM.
///
/// `devices` must hold every requested device that exists and every member of their IOMMU
/// groups ([`super::Pci::devices_with_groups`]). `held` maps addresses held by *other* VMs (their
/// recorded bindings) to the holding VM's name; it must not contain this VM's own holdings.
///
/// # Errors
/// The first failing kind, listing every offender of that kind (see the module documentation):
/// [`CheckError::Shape`] (absent, requested twice, a bridge; 2001), [`CheckError::Held`] (3003),
/// [`CheckError::InUseByHost`] (3005), [`CheckError::NoIommuGroup`] when the IOMMU is off or
/// [`CheckError::GroupNotViable`] (3004). [`CheckError::field`] is the first offending
/// request's field.
pub fn check(
    requested: &[Requested],
    devices: &BTreeMap<PciAddress, PciDevice>,
    usage: &HostUsage,
    held: &BTreeMap<PciAddress, String>,
) -> Result<Assignment, CheckError> {
    check_shape(requested, devices)?;
    check_held(requested, held)?;
    check_host_use(requested, devices, usage)?;
    let groups = check_groups(requested, devices, held)?;
    let addresses: Vec<PciAddress> = requested.iter().map(|r| r.address).collect();
    Ok(Assignment { devices: addresses.clone(), to_bind: addresses, groups })
}

/// Joins the messages of several offenders.
fn join(parts: &[String]) -> String {
    parts.join("; ")
}

/// Step 1: present, once, an endpoint (2001).
fn check_shape(requested: &[Requested], devices: &BTreeMap<PciAddress, PciDevice>) -> Result<(), CheckError> {
    let mut problems = Vec::new();
    let mut seen: BTreeMap<PciAddress, &str> = BTreeMap::new();
    for r in requested {
        let problem = if let Some(earlier) = seen.insert(r.address, &r.field) {
            Some(format!("{} is requested twice ({earlier} and {})", r.address, r.field))
        } else {
            match devices.get(&r.address) {
                None => Some(format!("{} ({}): no such PCI device on this host", r.address, r.field)),
                Some(d) if d.is_bridge => Some(format!(
                    "{} ({}) is a PCI bridge (class {:#08x}); only endpoint devices can be passed through",
                    r.address, r.field, d.class
                )),
                Some(_) => None,
            }
        };
        if let Some(problem) = problem {
            problems.push(ShapeProblem { address: r.address, field: r.field.clone(), problem });
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(CheckError::Shape(problems))
    }
}

/// Step 2: not held by another VM (3003).
fn check_held(requested: &[Requested], held: &BTreeMap<PciAddress, String>) -> Result<(), CheckError> {
    let conflicts: Vec<HeldConflict> = requested
        .iter()
        .filter_map(|r| {
            held.get(&r.address).map(|h| HeldConflict { address: r.address, field: r.field.clone(), holder: h.clone() })
        })
        .collect();
    if conflicts.is_empty() {
        Ok(())
    } else {
        Err(CheckError::Held(conflicts))
    }
}

/// Step 3: the host does not use the device (3005).
fn check_host_use(
    requested: &[Requested],
    devices: &BTreeMap<PciAddress, PciDevice>,
    usage: &HostUsage,
) -> Result<(), CheckError> {
    let mut uses: Vec<HostUse> = Vec::new();
    for r in requested {
        let Some(d) = devices.get(&r.address) else { continue };
        let mut add = |kind| uses.push(HostUse { address: r.address, field: r.field.clone(), kind });
        for iface in &d.net_ifaces {
            if usage.ifaces_with_address.contains(iface) {
                add(HostUseKind::Address(iface.clone()));
            }
            if usage.default_route_ifaces.contains(iface) {
                add(HostUseKind::DefaultRoute(iface.clone()));
            }
            if usage.enslaved_ifaces.contains(iface) {
                add(HostUseKind::Enslaved(iface.clone()));
            }
        }
        for dev in &d.block_devs {
            if usage.mounted_block_devs.contains(dev) {
                add(HostUseKind::Mounted(dev.clone()));
            }
        }
    }
    if uses.is_empty() {
        Ok(())
    } else {
        Err(CheckError::InUseByHost(uses))
    }
}

/// Step 4: whole IOMMU groups (3004). Returns the groups, ascending.
fn check_groups(
    requested: &[Requested],
    devices: &BTreeMap<PciAddress, PciDevice>,
    held: &BTreeMap<PciAddress, String>,
) -> Result<Vec<u32>, CheckError> {
    let wanted: BTreeSet<PciAddress> = requested.iter().map(|r| r.address).collect();

    let no_group: Vec<Requested> = requested
        .iter()
        .filter(|r| devices.get(&r.address).is_some_and(|d| d.iommu_group.is_none()))
        .cloned()
        .collect();
    if !no_group.is_empty() {
        return Err(CheckError::NoIommuGroup(no_group));
    }

    // Group -> the first request in it (for the field and the message).
    let mut groups: BTreeMap<u32, &Requested> = BTreeMap::new();
    for r in requested {
        if let Some(g) = devices.get(&r.address).and_then(|d| d.iommu_group) {
            groups.entry(g).or_insert(r);
        }
    }
    let mut blocked: Vec<BlockedGroup> = Vec::new();
    for (&group, r) in &groups {
        let mut blocking = Vec::new();
        for m in devices.values().filter(|m| m.iommu_group == Some(group) && !wanted.contains(&m.address)) {
            let holder = held.get(&m.address);
            let harmless =
                m.driver.is_none() || m.is_bridge || matches!(m.driver.as_deref(), Some(VFIO_PCI | PCI_STUB));
            if harmless && holder.is_none() {
                continue;
            }
            blocking.push(Blocker { address: m.address, driver: m.driver.clone(), holder: holder.cloned() });
        }
        if !blocking.is_empty() {
            blocked.push(BlockedGroup { group, address: r.address, field: r.field.clone(), blocking });
        }
    }
    if blocked.is_empty() {
        Ok(groups.into_keys().collect())
    } else {
        Err(CheckError::GroupNotViable(blocked))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ApiError, Code};
    use serde_json::json;

    /// The check as a client sees it: through the boundary's mapping, so these tests hold the
    /// codes, fields, details and messages of the API.
    fn check(
        requested: &[Requested],
        devices: &BTreeMap<PciAddress, PciDevice>,
        usage: &HostUsage,
        held: &BTreeMap<PciAddress, String>,
    ) -> Result<Assignment, ApiError> {
        super::check(requested, devices, usage, held).map_err(ApiError::from)
    }

    fn a(text: &str) -> PciAddress {
        PciAddress::parse(text).unwrap()
    }

    fn dev(address: &str, group: Option<u32>, driver: Option<&str>) -> PciDevice {
        PciDevice {
            address: a(address),
            vendor: 0x8086,
            device: 0x10d3,
            class: 0x020000,
            driver: driver.map(str::to_string),
            iommu_group: group,
            is_bridge: false,
            net_ifaces: vec![],
            block_devs: vec![],
        }
    }

    fn bridge(address: &str, group: u32) -> PciDevice {
        PciDevice { class: 0x060400, is_bridge: true, ..dev(address, Some(group), Some("pcieport")) }
    }

    fn nic(address: &str, group: u32, iface: &str) -> PciDevice {
        PciDevice { net_ifaces: vec![iface.to_string()], ..dev(address, Some(group), Some("e1000e")) }
    }

    fn map(devs: Vec<PciDevice>) -> BTreeMap<PciAddress, PciDevice> {
        devs.into_iter().map(|d| (d.address, d)).collect()
    }

    fn req(list: &[&str]) -> Vec<Requested> {
        list.iter().enumerate().map(|(i, s)| Requested::new(a(s), format!("spec.pci[{i}]"))).collect()
    }

    fn none_held() -> BTreeMap<PciAddress, String> {
        BTreeMap::new()
    }

    fn run(list: &[&str], devs: Vec<PciDevice>) -> Result<Assignment, ApiError> {
        check(&req(list), &map(devs), &HostUsage::default(), &none_held())
    }

    #[test]
    fn a_device_alone_in_its_group_is_fine() {
        let got = run(&["0000:00:05.0"], vec![dev("0000:00:05.0", Some(5), Some("e1000e"))]).unwrap();
        assert_eq!(
            got,
            Assignment { devices: vec![a("0000:00:05.0")], to_bind: vec![a("0000:00:05.0")], groups: vec![5] }
        );
    }

    #[test]
    fn two_endpoints_of_one_group_both_assigned() {
        let devs = vec![dev("0000:03:00.0", Some(8), Some("igb")), dev("0000:03:00.1", Some(8), Some("igb"))];
        let got = run(&["0000:03:00.1", "0000:03:00.0"], devs).unwrap();
        assert_eq!(got.devices, [a("0000:03:00.1"), a("0000:03:00.0")]);
        assert_eq!(got.to_bind, got.devices);
        assert_eq!(got.groups, [8]);
    }

    #[test]
    fn sibling_on_a_host_driver_is_group_not_viable() {
        let devs = vec![
            dev("0000:00:1f.0", Some(9), Some("lpc_ich")),
            dev("0000:00:1f.2", Some(9), Some("ahci")),
            dev("0000:00:1f.3", Some(9), Some("i801_smbus")),
        ];
        let e = run(&["0000:00:1f.2"], devs).unwrap_err();
        assert_eq!(e.code, Code::GroupNotViable);
        assert_eq!(e.field.as_deref(), Some("spec.pci[0]"));
        assert_eq!(
            e.details["blocking"],
            json!([
                {"address": "0000:00:1f.0", "driver": "lpc_ich", "group": 9, "holder": null},
                {"address": "0000:00:1f.3", "driver": "i801_smbus", "group": 9, "holder": null},
            ])
        );
        assert!(e.message.contains("IOMMU group 9 of 0000:00:1f.2"), "{}", e.message);
        assert!(e.message.contains("0000:00:1f.0 (driver lpc_ich)"), "{}", e.message);
        assert!(e.message.contains("group is not viable"), "{}", e.message);
    }

    #[test]
    fn harmless_siblings_do_not_block() {
        let devs = vec![
            dev("0000:00:1c.0", Some(4), Some("e1000e")),
            bridge("0000:00:1b.0", 4),
            dev("0000:00:1c.1", Some(4), None),
            dev("0000:00:1c.2", Some(4), Some("vfio-pci")),
            dev("0000:00:1c.3", Some(4), Some("pci-stub")),
            // Another group entirely: irrelevant even with a host driver.
            dev("0000:00:1d.0", Some(5), Some("xhci_hcd")),
        ];
        let got = run(&["0000:00:1c.0"], devs).unwrap();
        // Only the requested device moves; the siblings stay as they are.
        assert_eq!(got.to_bind, [a("0000:00:1c.0")]);
        assert_eq!(got.groups, [4]);
    }

    #[test]
    fn a_bridge_without_a_driver_or_with_any_driver_is_fine() {
        let odd = PciDevice { driver: Some("shpchp".to_string()), ..bridge("0000:00:01.0", 1) };
        let devs = vec![odd, bridge("0000:00:01.1", 1), dev("0000:01:00.0", Some(1), Some("nvme"))];
        assert!(run(&["0000:01:00.0"], devs).is_ok());
    }

    #[test]
    fn sibling_held_by_another_vm_blocks_even_on_vfio_pci() {
        let devs = vec![dev("0000:03:00.0", Some(8), Some("igb")), dev("0000:03:00.1", Some(8), Some("vfio-pci"))];
        let held: BTreeMap<PciAddress, String> = [(a("0000:03:00.1"), "sensor1".to_string())].into();
        let e = check(&req(&["0000:03:00.0"]), &map(devs), &HostUsage::default(), &held).unwrap_err();
        assert_eq!(e.code, Code::GroupNotViable);
        assert_eq!(e.details["blocking"][0]["holder"], "sensor1");
        assert_eq!(e.details["blocking"][0]["driver"], "vfio-pci");
        assert!(e.message.contains("0000:03:00.1 (held by VM sensor1)"), "{}", e.message);
    }

    #[test]
    fn every_blocked_group_is_reported_and_field_is_the_first() {
        let devs = vec![
            dev("0000:00:05.0", Some(2), Some("e1000e")),
            dev("0000:00:06.0", Some(3), Some("e1000e")),
            dev("0000:00:06.1", Some(3), Some("snd_hda_intel")),
            dev("0000:00:07.0", Some(4), Some("e1000e")),
            dev("0000:00:07.1", Some(4), Some("xhci_hcd")),
        ];
        let e = run(&["0000:00:05.0", "0000:00:07.0", "0000:00:06.0"], devs).unwrap_err();
        assert_eq!(e.code, Code::GroupNotViable);
        let blocking: Vec<&str> =
            e.details["blocking"].as_array().unwrap().iter().map(|b| b["address"].as_str().unwrap()).collect();
        assert_eq!(blocking, ["0000:00:06.1", "0000:00:07.1"]);
        // Groups are reported in group order; the field is the first blocked group's request.
        assert_eq!(e.field.as_deref(), Some("spec.pci[2]"));
    }

    #[test]
    fn no_iommu_group_is_explained() {
        let e = run(&["0000:00:05.0"], vec![dev("0000:00:05.0", None, Some("e1000e"))]).unwrap_err();
        assert_eq!(e.code, Code::GroupNotViable);
        assert_eq!(e.details["no_iommu_group"], json!(["0000:00:05.0"]));
        assert!(e.message.contains("intel_iommu=on"), "{}", e.message);
    }

    #[test]
    fn missing_device_bridge_and_duplicate_are_invalid_spec() {
        let e = run(&["0000:09:00.0"], vec![]).unwrap_err();
        assert_eq!(e.code, Code::InvalidSpec);
        assert_eq!(e.field.as_deref(), Some("spec.pci[0]"));
        assert!(e.message.contains("0000:09:00.0") && e.message.contains("no such PCI device"), "{}", e.message);

        let e =
            run(&["0000:00:05.0", "0000:00:1c.0"], vec![dev("0000:00:05.0", Some(1), None), bridge("0000:00:1c.0", 2)])
                .unwrap_err();
        assert_eq!(e.code, Code::InvalidSpec);
        assert_eq!(e.field.as_deref(), Some("spec.pci[1]"));
        assert!(e.message.contains("PCI bridge") && e.message.contains("0x060400"), "{}", e.message);

        let e = run(&["0000:00:05.0", "0000:00:05.0"], vec![dev("0000:00:05.0", Some(1), None)]).unwrap_err();
        assert_eq!(e.code, Code::InvalidSpec);
        assert_eq!(e.field.as_deref(), Some("spec.pci[1]"));
        assert!(e.message.contains("requested twice (spec.pci[0] and spec.pci[1])"), "{}", e.message);
        assert_eq!(e.details["problems"][0]["address"], "0000:00:05.0");
    }

    #[test]
    fn held_by_another_vm_is_hardware_in_use() {
        let devs = vec![dev("0000:00:05.0", Some(1), Some("vfio-pci")), dev("0000:00:06.0", Some(2), Some("e1000e"))];
        let held: BTreeMap<PciAddress, String> = [(a("0000:00:05.0"), "sensor1".to_string())].into();
        let e = check(&req(&["0000:00:06.0", "0000:00:05.0"]), &map(devs), &HostUsage::default(), &held).unwrap_err();
        assert_eq!(e.code, Code::HardwareInUse);
        assert_eq!(e.field.as_deref(), Some("spec.pci[1]"));
        assert_eq!(e.details["conflicts"], json!([{"address": "0000:00:05.0", "holder": "sensor1"}]));
        assert!(e.message.contains("in use by sensor1"), "{}", e.message);
    }

    #[test]
    fn an_unheld_device_already_on_vfio_pci_is_fine() {
        assert!(run(&["0000:00:05.0"], vec![dev("0000:00:05.0", Some(1), Some("vfio-pci"))]).is_ok());
    }

    #[test]
    fn host_network_use_is_refused_for_each_reason() {
        for (reason, text) in
            [("address", "has an IP address"), ("default_route", "default route"), ("enslaved", "bridge or bond port")]
        {
            let mut usage = HostUsage::default();
            let set = match reason {
                "address" => &mut usage.ifaces_with_address,
                "default_route" => &mut usage.default_route_ifaces,
                _ => &mut usage.enslaved_ifaces,
            };
            set.insert("enp0s5".to_string());
            let devs = map(vec![nic("0000:00:05.0", 1, "enp0s5")]);
            let e = check(&req(&["0000:00:05.0"]), &devs, &usage, &none_held()).unwrap_err();
            assert_eq!(e.code, Code::InUseByHost, "{reason}");
            assert_eq!(
                e.details["in_use"],
                json!([{"address": "0000:00:05.0", "interface": "enp0s5", "reason": reason}])
            );
            assert!(e.message.contains("interface enp0s5") && e.message.contains(text), "{}", e.message);
            assert_eq!(e.field.as_deref(), Some("spec.pci[0]"));
        }
        // An interface that is merely up, with no address, route or master, is free to go.
        let usage = HostUsage { ifaces_with_address: ["eth9".to_string()].into(), ..HostUsage::default() };
        let devs = map(vec![nic("0000:00:05.0", 1, "enp0s5")]);
        assert!(check(&req(&["0000:00:05.0"]), &devs, &usage, &none_held()).is_ok());
    }

    #[test]
    fn a_storage_function_under_a_mounted_file_system_is_refused() {
        let nvme = PciDevice {
            block_devs: vec!["dm-0".to_string(), "nvme0n1".to_string(), "nvme0n1p1".to_string()],
            ..dev("0000:01:00.0", Some(3), Some("nvme"))
        };
        let usage = HostUsage { mounted_block_devs: ["dm-0".to_string()].into(), ..HostUsage::default() };
        let e = check(&req(&["0000:01:00.0"]), &map(vec![nvme]), &usage, &none_held()).unwrap_err();
        assert_eq!(e.code, Code::InUseByHost);
        assert_eq!(
            e.details["in_use"],
            json!([{"address": "0000:01:00.0", "block_device": "dm-0", "reason": "mounted"}])
        );
        assert!(e.message.contains("block device dm-0 is mounted"), "{}", e.message);
    }

    #[test]
    fn checks_run_in_order_shape_held_host_group() {
        // One request that fails everything after shape: 3003 wins over 3005 and 3004.
        let devs = vec![nic("0000:00:05.0", 1, "eth0"), dev("0000:00:05.1", Some(1), Some("e1000e"))];
        let usage = HostUsage { ifaces_with_address: ["eth0".to_string()].into(), ..HostUsage::default() };
        let held: BTreeMap<PciAddress, String> = [(a("0000:00:05.0"), "other".to_string())].into();
        let r = req(&["0000:00:05.0"]);
        assert_eq!(check(&r, &map(devs.clone()), &usage, &held).unwrap_err().code, Code::HardwareInUse);
        assert_eq!(check(&r, &map(devs.clone()), &usage, &none_held()).unwrap_err().code, Code::InUseByHost);
        assert_eq!(
            check(&r, &map(devs.clone()), &HostUsage::default(), &none_held()).unwrap_err().code,
            Code::GroupNotViable
        );
        // And a missing second device (2001) wins over all of them.
        let r2 = req(&["0000:00:05.0", "0000:0a:00.0"]);
        assert_eq!(check(&r2, &map(devs), &usage, &held).unwrap_err().code, Code::InvalidSpec);
    }

    #[test]
    fn sibling_that_is_also_requested_must_itself_be_free_of_host_use() {
        // Both functions requested: the group is whole, but the sibling's interface is in use.
        let devs = vec![nic("0000:03:00.0", 8, "eth0"), nic("0000:03:00.1", 8, "eth1")];
        let usage = HostUsage { default_route_ifaces: ["eth1".to_string()].into(), ..HostUsage::default() };
        let e = check(&req(&["0000:03:00.0", "0000:03:00.1"]), &map(devs), &usage, &none_held()).unwrap_err();
        assert_eq!(e.code, Code::InUseByHost);
        assert_eq!(e.field.as_deref(), Some("spec.pci[1]"));
    }
}
