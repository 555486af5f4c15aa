//! Capacity and hardware-conflict rules: may this VM be added to what the host already carries?
//!
//! Pure functions of (host config, current holdings, request). The lifecycle calls [`admit`]
//! under its allocation lock right before writing the record; reconcile's dry run admits entry
//! after entry into a simulated host with the same two checks, [`check_devices`] then
//! [`check_room`] (keeping a running [`Used`] total instead of summing every holder per entry),
//! so a plan sees exactly the refusals a real run would get. Conflicts (3003) are reported
//! before capacity (3002) because they name what to fix.
//!
//! [`check_capture_devices`] (3003 between passthrough and monitor NICs' sources) takes what
//! sysfs says each source depends on as an argument ([`crate::net::backing`], read by the
//! lifecycle before it runs), so it stays pure; reconcile's plan does not run it (no sysfs
//! read in a dry run).

use crate::api::{ApiError, Code, HardwareItem, ResourceUsage, VmSpec};
use crate::config::Hardware;
use crate::hardware::PciAddress;
use crate::validate::{requested_devices, requested_devices_with_fields};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};

/// What one VM holds on the host. A VM may hold by two specs at once (a change waiting for a
/// restart: the spec its QEMU runs and the recorded one), as two holdings of the same name.
#[derive(Debug, Clone, Copy)]
pub struct Holding<'a> {
    /// VM name.
    pub name: &'a str,
    /// Its spec (cpu, memory, hardware).
    pub spec: &'a VmSpec,
}

/// CPUs and memory that VMs hold, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Used {
    /// vCPUs.
    pub cpu: u64,
    /// MiB of memory.
    pub memory_mib: u64,
}

impl Used {
    /// What `holdings` hold together. Holdings of the same VM (its running spec and a pending
    /// change) count once, each resource at the larger of them: the running QEMU has one,
    /// the restart will need the other, never both at once.
    pub fn of<'a>(holdings: impl IntoIterator<Item = &'a Holding<'a>>) -> Used {
        let mut by_vm: BTreeMap<&str, Used> = BTreeMap::new();
        for h in holdings {
            let vm = by_vm.entry(h.name).or_default();
            vm.cpu = vm.cpu.max(u64::from(h.spec.cpu));
            vm.memory_mib = vm.memory_mib.max(h.spec.memory_mib);
        }
        by_vm.values().fold(Used::default(), |sum, vm| Used {
            cpu: sum.cpu.saturating_add(vm.cpu),
            memory_mib: sum.memory_mib.saturating_add(vm.memory_mib),
        })
    }

    /// Counts `spec` in.
    pub fn add(&mut self, spec: &VmSpec) {
        self.cpu += u64::from(spec.cpu);
        self.memory_mib += spec.memory_mib;
    }
}

/// Checks that `request` fits next to `held` (entries named like `request` are not counted:
/// they are the VM's own).
///
/// # Errors
/// 3003 listing every hardware conflict `{class, index, holder}`; else 3002 naming the exhausted
/// resource with the numbers.
pub fn admit(hw: &Hardware, held: &[Holding<'_>], request: &VmSpec) -> Result<(), ApiError> {
    check_devices(hw, held, request)?;
    check_room(hw, Used::of(held.iter().filter(|h| h.name != request.name)), request)
}

/// Checks that no device `request` names is held by another VM in `held`.
///
/// # Errors
/// 3003 listing every hardware conflict `{class, index, holder}`.
pub fn check_devices(hw: &Hardware, held: &[Holding<'_>], request: &VmSpec) -> Result<(), ApiError> {
    // A request for no device cannot conflict: skip reading every holder's devices (reconcile
    // admits 1000 VMs one after another against all the others).
    if request.hardware.is_empty() && request.pci.is_empty() {
        return Ok(());
    }
    // Devices are compared by PCI address, so a device named by index in one spec and by raw
    // address in another is still one device.
    let mut by_address: BTreeMap<PciAddress, &str> = BTreeMap::new();
    for h in held.iter().filter(|h| h.name != request.name) {
        for addr in requested_devices(h.spec, hw) {
            by_address.insert(addr, h.name);
        }
    }
    let mut conflicts = Vec::new();
    let mut first_field = None;
    for (class, indices) in request.hardware.by_class() {
        for (pos, index) in indices.iter().enumerate() {
            let Some(addr) = hw.model.get(class, *index) else { continue };
            if let Some(holder) = by_address.get(&addr) {
                first_field.get_or_insert_with(|| format!("spec.hardware.{class}[{pos}]"));
                conflicts.push((
                    format!("{} index {index}", class.as_str().to_uppercase()),
                    json!({"class": class, "index": index, "pci": addr.to_string(), "holder": holder}),
                ));
            }
        }
    }
    for (pos, text) in request.pci.iter().enumerate() {
        let Ok(addr) = PciAddress::parse(text) else { continue };
        if let Some(holder) = by_address.get(&addr) {
            first_field.get_or_insert_with(|| format!("spec.pci[{pos}]"));
            conflicts.push((format!("PCI device {addr}"), json!({"pci": addr.to_string(), "holder": holder})));
        }
    }
    if conflicts.is_empty() {
        return Ok(());
    }
    let described = conflicts
        .into_iter()
        .map(|(what, c)| (format!("{what} in use by {}", c["holder"].as_str().unwrap_or("?")), c))
        .collect();
    Err(ApiError::in_use(described, first_field))
}

/// The PCI devices each monitored source depends on ([`crate::net::backing::pci_devices`], read
/// before the check): source name -> addresses. A source absent from the map has none.
pub type SourceDevices = BTreeMap<String, BTreeSet<PciAddress>>;

/// Checks that no VM passes through a device a monitored source depends on: `request` monitoring
/// a source whose device it or another VM in `held` passes through, or `request` passing through
/// a device a source it or another VM monitors depends on. The capture would see nothing (the
/// host loses the interface) and the guest would get a device the host still uses.
///
/// # Errors
/// 3003 listing every conflict `{pci, source, holder}`, the field the first names
/// (`spec.nics[i].source`, `spec.hardware.CLASS[j]`, `spec.pci[j]`).
pub fn check_capture_devices(
    hw: &Hardware,
    held: &[Holding<'_>],
    request: &VmSpec,
    sources: &SourceDevices,
) -> Result<(), ApiError> {
    let monitored = |spec: &VmSpec| -> Vec<(usize, String)> {
        spec.monitor_nics().map(|(i, source, _)| (i, source.to_string())).collect()
    };
    let others: Vec<&Holding<'_>> = held.iter().filter(|h| h.name != request.name).collect();
    let mine = requested_devices_with_fields(request, hw);
    let mut conflicts = Vec::new();
    let mut first_field = None;
    // The request's sources against every VM's devices, its own included.
    for (i, source) in monitored(request) {
        let Some(devices) = sources.get(&source) else { continue };
        let passed = mine
            .iter()
            .map(|(a, _)| (*a, request.name.as_str()))
            .chain(others.iter().flat_map(|h| requested_devices(h.spec, hw).into_iter().map(move |a| (a, h.name))));
        for (addr, holder) in passed {
            if devices.contains(&addr) {
                first_field.get_or_insert_with(|| format!("spec.nics[{i}].source"));
                conflicts
                    .push(json!({"pci": addr.to_string(), "source": source, "holder": holder, "held": "passthrough"}));
            }
        }
    }
    // The request's devices against the other VMs' sources (its own were checked above).
    for (addr, field) in &mine {
        for h in &others {
            for (_, source) in monitored(h.spec) {
                if sources.get(&source).is_some_and(|d| d.contains(addr)) {
                    first_field.get_or_insert_with(|| field.clone());
                    conflicts
                        .push(json!({"pci": addr.to_string(), "source": source, "holder": h.name, "held": "capture"}));
                }
            }
        }
    }
    if conflicts.is_empty() {
        return Ok(());
    }
    conflicts.dedup();
    let described = conflicts
        .into_iter()
        .map(|c| {
            let t = |k: &str| c[k].as_str().unwrap_or("?").to_string();
            let sentence = if c["held"] == "passthrough" {
                format!(
                    "capture source {} depends on PCI device {} passed through to {}",
                    t("source"),
                    t("pci"),
                    t("holder")
                )
            } else {
                format!("PCI device {} carries capture source {} of {}", t("pci"), t("source"), t("holder"))
            };
            (sentence, c)
        })
        .collect();
    Err(ApiError::in_use(described, first_field))
}

/// Checks that `request`'s CPUs and memory fit next to what other VMs hold (`used`).
///
/// # Errors
/// 3002 naming the exhausted resource with the numbers.
pub fn check_room(hw: &Hardware, used: Used, request: &VmSpec) -> Result<(), ApiError> {
    let (cpu_used, mem_used) = (used.cpu, used.memory_mib);
    let cpu_free = u64::from(hw.cpu - hw.reserved_cpu).saturating_sub(cpu_used);
    let mem_free = (hw.memory_mib - hw.reserved_memory_mib).saturating_sub(mem_used);
    if u64::from(request.cpu) > cpu_free {
        return Err(ApiError::new(
            Code::CapacityExceeded,
            format!(
                "cpu {} exceeds the {cpu_free} CPUs available (total {}, reserved {}, allocated {cpu_used})",
                request.cpu, hw.cpu, hw.reserved_cpu
            ),
        )
        .field("spec.cpu")
        .details(json!({"resource": "cpu", "requested": request.cpu, "available": cpu_free})));
    }
    if request.memory_mib > mem_free {
        return Err(ApiError::new(
            Code::CapacityExceeded,
            format!(
                "memory_mib {} exceeds the {mem_free} MiB available (total {}, reserved {}, allocated {mem_used})",
                request.memory_mib, hw.memory_mib, hw.reserved_memory_mib
            ),
        )
        .field("spec.memory_mib")
        .details(json!({"resource": "memory_mib", "requested": request.memory_mib, "available": mem_free})));
    }
    Ok(())
}

/// CPU and memory usage, and every model index with its holder, for `host.info`.
pub fn usage(hw: &Hardware, held: &[Holding<'_>]) -> (ResourceUsage, ResourceUsage, Vec<HardwareItem>) {
    let Used { cpu: cpu_alloc, memory_mib: mem_alloc } = Used::of(held);
    let cpu = ResourceUsage {
        total: u64::from(hw.cpu),
        reserved: u64::from(hw.reserved_cpu),
        allocated: cpu_alloc,
        available: u64::from(hw.cpu - hw.reserved_cpu).saturating_sub(cpu_alloc),
    };
    let mem = ResourceUsage {
        total: hw.memory_mib,
        reserved: hw.reserved_memory_mib,
        allocated: mem_alloc,
        available: (hw.memory_mib - hw.reserved_memory_mib).saturating_sub(mem_alloc),
    };
    let by: BTreeMap<PciAddress, &str> =
        held.iter().flat_map(|h| requested_devices(h.spec, hw).into_iter().map(move |a| (a, h.name))).collect();
    let items = hw
        .model
        .iter()
        .map(|(class, index, pci)| HardwareItem {
            class,
            index,
            pci: pci.to_string(),
            holder: by.get(&pci).map(|s| s.to_string()),
            present: false,
            driver: None,
            iommu_group: None,
        })
        .collect();
    (cpu, mem, items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::tests::{config, spec};

    fn hold<'a>(specs: &'a [VmSpec]) -> Vec<Holding<'a>> {
        specs.iter().map(|s| Holding { name: &s.name, spec: s }).collect()
    }

    #[test]
    fn fits_until_capacity_is_reached() {
        // 8 CPUs - 2 reserved = 6; 16 GiB - 4 = 12288 MiB.
        let hw = config().hardware;
        let mut a = spec("a");
        a.cpu = 4;
        a.memory_mib = 8192;
        let held = [a];
        let mut b = spec("b");
        b.cpu = 2;
        b.memory_mib = 4096;
        assert!(admit(&hw, &hold(&held), &b).is_ok());
        b.cpu = 3;
        let e = admit(&hw, &hold(&held), &b).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::CapacityExceeded, Some("spec.cpu")));
        assert_eq!(e.details["available"], 2);
        b.cpu = 2;
        b.memory_mib = 4097;
        let e = admit(&hw, &hold(&held), &b).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::CapacityExceeded, Some("spec.memory_mib")));
    }

    #[test]
    fn reserved_share_is_never_handed_out() {
        let hw = config().hardware;
        let mut a = spec("a");
        a.cpu = 7; // in the model (8) but above 8 - 2 reserved
        assert_eq!(admit(&hw, &[], &a).unwrap_err().code, Code::CapacityExceeded);
    }

    #[test]
    fn the_vm_itself_is_not_counted_against_itself() {
        let hw = config().hardware;
        let mut a = spec("a");
        a.cpu = 6;
        a.hardware.sfp = vec![5];
        let held = [a.clone()];
        assert!(admit(&hw, &hold(&held), &a).is_ok());
    }

    #[test]
    fn every_conflict_is_listed_before_capacity() {
        let hw = config().hardware;
        let mut s1 = spec("sensor1");
        s1.hardware.sfp = vec![5];
        s1.hardware.copper = vec![1];
        let mut s2 = spec("search1");
        s2.hardware.disk = vec![2];
        let held = [s1, s2];
        let mut req = spec("new");
        req.cpu = 6; // would also exceed capacity
        req.hardware.disk = vec![1, 2];
        req.hardware.sfp = vec![6, 5];
        req.hardware.copper = vec![1];
        let e = admit(&hw, &hold(&held), &req).unwrap_err();
        assert_eq!(e.code, Code::HardwareInUse);
        assert_eq!(e.field.as_deref(), Some("spec.hardware.disk[1]"));
        let conflicts = e.details["conflicts"].as_array().unwrap();
        assert_eq!(conflicts.len(), 3);
        assert_eq!(conflicts[0], json!({"class": "disk", "index": 2, "pci": "0000:c7:00.1", "holder": "search1"}));
        assert_eq!(conflicts[2], json!({"class": "sfp", "index": 5, "pci": "0000:ca:00.0", "holder": "sensor1"}));
        assert!(e.message.contains("SFP index 5 in use by sensor1"), "{}", e.message);
    }

    #[test]
    fn a_device_by_address_conflicts_with_the_same_device_by_index() {
        let mut hw = config().hardware;
        hw.allow_raw_pci = true;
        let mut a = spec("a");
        a.hardware.sfp = vec![5];
        let held = [a];
        let mut b = spec("b");
        b.pci = vec!["pci_0000_ca_00_0".into()];
        let e = admit(&hw, &hold(&held), &b).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::HardwareInUse, Some("spec.pci[0]")));
        assert_eq!(e.details["conflicts"], json!([{"pci": "0000:ca:00.0", "holder": "a"}]));
        // And the other way round.
        let held = [b];
        let mut c = spec("c");
        c.hardware.sfp = vec![5];
        assert_eq!(admit(&hw, &hold(&held), &c).unwrap_err().details["conflicts"][0]["holder"], "b");
    }

    #[test]
    fn a_pending_change_holds_the_larger_of_the_two_specs_not_their_sum() {
        // 6 CPUs and 12288 MiB to hand out.
        let hw = config().hardware;
        let with = |name: &str, cpu: u32, memory_mib: u64| {
            let mut s = spec(name);
            s.cpu = cpu;
            s.memory_mib = memory_mib;
            s
        };
        let pair = |running: &VmSpec, pending: &VmSpec| -> Used {
            Used::of(&[Holding { name: "a", spec: running }, Holding { name: "a", spec: pending }])
        };
        let running = with("a", 2, 2048);
        assert_eq!(pair(&running, &running), Used { cpu: 2, memory_mib: 2048 }, "the same spec twice holds it once");
        assert_eq!(pair(&running, &with("a", 4, 1024)), Used { cpu: 4, memory_mib: 2048 });
        assert_eq!(pair(&running, &with("a", 1, 4096)), Used { cpu: 2, memory_mib: 4096 });
        assert_eq!(pair(&with("a", 4, 4096), &running), Used { cpu: 4, memory_mib: 4096 }, "either order");
        // Another VM counts in full next to it.
        let other = with("b", 1, 512);
        let held = [running.clone(), with("a", 3, 1024), other.clone()];
        let holdings: Vec<Holding<'_>> = held
            .iter()
            .map(|s| Holding { name: "a", spec: s })
            .take(2)
            .chain(std::iter::once(Holding { name: "b", spec: &other }))
            .collect();
        assert_eq!(Used::of(&holdings), Used { cpu: 4, memory_mib: 2560 });
        // Admission: a (2 running, 3 pending) and b (1) leave 2 CPUs, not 0.
        assert!(admit(&hw, &holdings, &with("c", 2, 1024)).is_ok());
        let e = admit(&hw, &holdings, &with("c", 3, 1024)).unwrap_err();
        assert_eq!((e.field.as_deref(), e.details["available"].as_u64()), (Some("spec.cpu"), Some(2)));
        let e = admit(&hw, &holdings, &with("c", 1, 12288 - 2560 + 1)).unwrap_err();
        assert_eq!(
            (e.field.as_deref(), e.details["available"].as_u64()),
            (Some("spec.memory_mib"), Some(12288 - 2560))
        );
        // The VM itself changed again: its own holdings are not counted against it.
        assert!(admit(&hw, &holdings, &with("a", 5, 1024)).is_ok());
    }

    #[test]
    fn usage_reports_holders_and_totals() {
        let hw = config().hardware;
        let mut a = spec("a");
        a.cpu = 2;
        a.hardware.sfp = vec![6];
        let held = [a, spec("b")];
        let (cpu, mem, items) = usage(&hw, &hold(&held));
        assert_eq!(cpu, ResourceUsage { total: 8, reserved: 2, allocated: 3, available: 3 });
        assert_eq!(mem.allocated, 512);
        assert_eq!(mem.available, 12288 - 512);
        assert_eq!(items.len(), 6);
        let sfp6 = items.iter().find(|i| i.class == crate::api::HardwareClass::Sfp && i.index == 6).unwrap();
        assert_eq!(sfp6.holder.as_deref(), Some("a"));
        assert_eq!(sfp6.pci, "0000:ca:00.1");
        assert!(items.iter().filter(|i| i.holder.is_none()).count() == 5);
    }

    fn monitor(source: &str) -> crate::api::NicSpec {
        crate::api::NicSpec { mode: crate::api::NicMode::Monitor, source: Some(source.into()), ..Default::default() }
    }

    #[test]
    fn passthrough_and_capture_of_the_same_device_conflict_both_ways() {
        let hw = config().hardware;
        let sfp5 = hw.model.get(crate::api::HardwareClass::Sfp, 5).unwrap();
        let sources: SourceDevices =
            [("eth5".to_string(), BTreeSet::from([sfp5])), ("veth0".to_string(), BTreeSet::new())].into();
        let mut passer = spec("passer");
        passer.hardware.sfp = vec![5];
        let mut watcher = spec("watcher");
        watcher.nics = vec![monitor("veth0"), monitor("eth5")];

        // A monitor of a source whose device another VM passes through.
        let e = check_capture_devices(&hw, &hold(std::slice::from_ref(&passer)), &watcher, &sources).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::HardwareInUse, Some("spec.nics[1].source")));
        assert_eq!(e.details["conflicts"][0]["holder"], "passer");
        assert!(e.message.contains("capture source eth5 depends on PCI device"), "{}", e.message);
        // The reverse: passing through the device another VM's source depends on.
        let e = check_capture_devices(&hw, &hold(std::slice::from_ref(&watcher)), &passer, &sources).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::HardwareInUse, Some("spec.hardware.sfp[0]")));
        assert_eq!(e.details["conflicts"][0]["holder"], "watcher");
        // The same VM doing both.
        let mut both = passer.clone();
        both.nics = vec![monitor("eth5")];
        let e = check_capture_devices(&hw, &[], &both, &sources).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::HardwareInUse, Some("spec.nics[0].source")));
        // Its own older holding does not count twice, and is not a conflict of its own.
        assert!(check_capture_devices(&hw, &hold(std::slice::from_ref(&watcher)), &watcher, &sources).is_ok());
        // A virtual source depends on no device; another device is no conflict.
        watcher.nics = vec![monitor("veth0")];
        assert!(check_capture_devices(&hw, &hold(std::slice::from_ref(&passer)), &watcher, &sources).is_ok());
        passer.hardware.sfp = vec![4];
        watcher.nics = vec![monitor("eth5")];
        assert!(check_capture_devices(&hw, &hold(std::slice::from_ref(&passer)), &watcher, &sources).is_ok());
        // A raw PCI address is the same device as its model index.
        let mut raw = spec("raw");
        raw.pci = vec![sfp5.to_string()];
        let e = check_capture_devices(&hw, &hold(std::slice::from_ref(&watcher)), &raw, &sources).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("spec.pci[0]"));
    }
}
