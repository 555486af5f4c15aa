//! Convergence planning: what must happen to turn the current VMs into the desired ones.
//!
//! [`spec_drift`] compares two specs field by field; [`classify`] says what a change takes
//! (nothing, a change in place that keeps the disk, with or without a restart, or a replace with
//! a new disk, which only a `boot.image` change needs); [`plan_reconcile`] turns a desired set
//! into one [`PlanEntry`] per VM and validates the set as a whole by admitting it into a
//! simulated host in a fixed order: VMs that stay as they are first, then the ones to create,
//! reconfigure or replace, in request order. All are pure; the lifecycle executes the plan.

use crate::api::{ApiError, DataDiskSpec, PlanAction, PlanEntry, VmSpec, VmStatus};
use crate::capacity::{check_devices, check_room, Holding, Used};
use crate::config::Config;
use crate::nic::{NicAlloc, NicHolding};
use crate::validate::validate_spec;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};

/// The 2002 of a `boot.image` change without `replace: true`: the VM is left as it is.
pub fn replace_needed(name: &str, fields: &[String]) -> ApiError {
    ApiError::new(
        crate::api::Code::SpecDrift,
        format!(
            "VM {name:?}: boot.image changes, which needs a new disk and destroys the old one ({}); \
             pass replace: true to do that",
            fields.join(", ")
        ),
    )
    .field("spec.boot.image")
    .details(serde_json::json!({ "fields": fields }))
}

/// A VM as the planner sees it.
#[derive(Debug, Clone)]
pub struct CurrentVm {
    /// Its recorded spec.
    pub spec: VmSpec,
    /// Its observed status.
    pub status: VmStatus,
    /// It runs an older spec than `spec` (a change recorded with `restart: false`).
    pub pending_restart: bool,
    /// Where its QEMU runs, while one does ([`crate::placement`]).
    pub placement: Option<crate::placement::Placement>,
}

/// Dotted paths of the fields that differ between two specs, ignoring `state` (a state change is
/// a start or stop, not drift), `guest_interfaces` (applied live by the guest agent) and `ssh`
/// (written live by the guest's exec server).
pub fn spec_drift(current: &VmSpec, desired: &VmSpec) -> Vec<String> {
    // Most specs of a reconcile are unchanged: say so without building two JSON trees.
    if same_but_convergent(current, desired) {
        return Vec::new();
    }
    let mut a = serde_json::to_value(current).unwrap_or(Value::Null);
    let mut b = serde_json::to_value(desired).unwrap_or(Value::Null);
    for v in [&mut a, &mut b] {
        if let Some(o) = v.as_object_mut() {
            o.remove("state");
            o.remove("guest_interfaces");
            o.remove("ssh");
        }
    }
    let mut out = Vec::new();
    diff_values("", &a, &b, &mut out);
    out
}

/// True when `a` and `b` differ at most in what converges without a change (`state`,
/// `guest_interfaces`, `ssh`). Every field is named, so a new one cannot be forgotten here; the
/// placement fields (`cpu_policy`, `numa`, `hugepages`, `emulator_cpu`) are drift that needs a
/// restart ([`restart_needed`]: they are not in [`LIVE_FIELDS`]).
fn same_but_convergent(a: &VmSpec, b: &VmSpec) -> bool {
    let VmSpec {
        name,
        role,
        cpu,
        memory_mib,
        state: _,
        hardware,
        pci,
        boot,
        disks,
        nics,
        guest_interfaces: _,
        restart_policy,
        user_data,
        ssh: _,
        guest_exec,
        cpu_policy,
        numa,
        hugepages,
        emulator_cpu,
        tpm,
    } = a;
    *name == b.name
        && *role == b.role
        && *cpu == b.cpu
        && *memory_mib == b.memory_mib
        && *hardware == b.hardware
        && *pci == b.pci
        && *boot == b.boot
        && *disks == b.disks
        && *nics == b.nics
        && *restart_policy == b.restart_policy
        && *user_data == b.user_data
        && *guest_exec == b.guest_exec
        && *cpu_policy == b.cpu_policy
        && *numa == b.numa
        && *hugepages == b.hugepages
        && *emulator_cpu == b.emulator_cpu
        && *tpm == b.tpm
}

/// What turning a VM's `current` spec into `desired` takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Nothing (state and guest interfaces aside, which converge separately).
    None,
    /// Changed in place, every disk kept. `restart`: QEMU must restart for it (anything but a
    /// larger `boot.disk_gib`, which grows live).
    Reconfigure {
        /// The differing fields.
        fields: Vec<String>,
        /// Whether a running VM restarts for it.
        restart: bool,
    },
    /// `boot.image` changes: only a new disk can do that (`replace: true`).
    Replace {
        /// The differing fields.
        fields: Vec<String>,
    },
}

/// The fields whose change needs no restart: a disk grows live, the restart policy is the
/// daemon's own business, and cloud-init reads user-data at a first boot only, so a running
/// guest has nothing to take from a new one (the seed is written from the recorded spec at the
/// next start, like the rest of it). `guest_exec` is only checked by the daemon when a call
/// comes.
const LIVE_FIELDS: [&str; 4] = ["boot.disk_gib", "restart_policy", "user_data", "guest_exec"];

/// Whether a running VM must restart for a change of `fields`.
pub fn needs_restart(fields: &[String]) -> bool {
    fields.iter().any(|f| !LIVE_FIELDS.contains(&f.as_str()))
}

/// Whether a running VM must restart to go from `current` to `desired`: as [`needs_restart`],
/// except that `disks` is live when [`live_disk_changes`] can reach the new list (grow, hot-plug,
/// unplug).
pub fn restart_needed(current: &VmSpec, desired: &VmSpec) -> bool {
    let fields: Vec<String> = spec_drift(current, desired)
        .into_iter()
        .filter(|f| !(f == "disks" && live_disk_changes(current, desired).is_some()))
        .collect();
    needs_restart(&fields)
}

/// What turns a running QEMU's data disks (`current`'s) into `desired`'s without a restart.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DiskChanges<'a> {
    /// Disks both list, larger in `desired`, with their old sizes in GiB (`block_resize`).
    pub grow: Vec<(&'a DataDiskSpec, u64)>,
    /// Disks only `current` lists, in its order (unplugged, then deleted or kept).
    pub remove: Vec<&'a DataDiskSpec>,
    /// Disks only `desired` lists, in its order (made and hot-plugged).
    pub add: Vec<&'a DataDiskSpec>,
}

impl DiskChanges<'_> {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.grow.is_empty() && self.remove.is_empty() && self.add.is_empty()
    }
}

/// The live steps from `current`'s data disks to `desired`'s, or `None` when only a restart
/// gets there: a disk both list (by name) must keep its format and options and not shrink, and
/// the disks both list must stay in the same order (the guest's order is fixed at start). A
/// disk added anywhere is hot-plugged (the guest names it after those it has until the next
/// start; `/dev/disk/by-id/virtio-NAME` is stable).
pub fn live_disk_changes<'a>(current: &'a VmSpec, desired: &'a VmSpec) -> Option<DiskChanges<'a>> {
    let kept_in = |list: &'a [DataDiskSpec], other: &'a [DataDiskSpec]| -> Vec<&'a DataDiskSpec> {
        list.iter().filter(|d| other.iter().any(|o| o.name == d.name)).collect()
    };
    let old_kept = kept_in(&current.disks, &desired.disks);
    let new_kept = kept_in(&desired.disks, &current.disks);
    let mut changes = DiskChanges::default();
    for (a, b) in old_kept.iter().zip(&new_kept) {
        let mut resized = (*a).clone();
        resized.size_gib = b.size_gib;
        // Only vm.snapshot and vm.revert read it: QEMU has nothing to change.
        resized.snapshot = b.snapshot;
        if resized != **b || b.size_gib < a.size_gib {
            return None;
        }
        if b.size_gib > a.size_gib {
            changes.grow.push((*b, a.size_gib));
        }
    }
    changes.remove = current.disks.iter().filter(|d| !desired.disks.iter().any(|o| o.name == d.name)).collect();
    changes.add = desired.disks.iter().filter(|d| !current.disks.iter().any(|o| o.name == d.name)).collect();
    Some(changes)
}

/// Classifies the change from `current` to `desired` (both valid specs of the same VM).
///
/// # Errors
/// 2001 on `spec.boot.disk_gib` when the disk would shrink (a disk is never shrunk; only a
/// replace, which makes a new one, may give a smaller size).
pub fn classify(current: &VmSpec, desired: &VmSpec) -> Result<Change, ApiError> {
    let fields = spec_drift(current, desired);
    if fields.is_empty() {
        return Ok(Change::None);
    }
    check_boot_disk_change(current, desired, &fields)?;
    if fields.iter().any(|f| f == "boot.image") {
        return Ok(Change::Replace { fields });
    }
    if let (Some(old), Some(new)) = (current.boot.disk_gib, desired.boot.disk_gib) {
        if new < old {
            return Err(ApiError::invalid(
                "spec.boot.disk_gib",
                format!("the disk is {old} GiB and is never shrunk; {new} GiB is smaller (a new disk needs a new boot.image and replace)"),
            ));
        }
    }
    check_disk_changes(current, desired)?;
    let restart = restart_needed(current, desired);
    Ok(Change::Reconfigure { fields, restart })
}

/// An imported root disk (`boot.disk`) is the VM's only copy of its disk: it cannot be swapped
/// for another file, an image or a kernel, nor the other way round, and a `disk_gib` it was
/// grown to cannot be dropped (the next one could be smaller than the disk is).
///
/// # Errors
/// 2002 on `spec.boot.disk` when `boot.disk` is added, removed or renamed (even with
/// `replace`); 2001 on `spec.boot.disk_gib` when its `disk_gib` is removed.
fn check_boot_disk_change(current: &VmSpec, desired: &VmSpec, fields: &[String]) -> Result<(), ApiError> {
    if fields.iter().any(|f| f == "boot.disk") {
        return Err(ApiError::new(
            crate::api::Code::SpecDrift,
            format!(
                "VM {:?}: boot.disk changes ({:?} to {:?}); an imported root disk is the VM's own and \
                 is never swapped, even with replace: destroy the VM (which deletes its disk) and create it again",
                desired.name,
                current.boot.disk.as_deref().unwrap_or("none"),
                desired.boot.disk.as_deref().unwrap_or("none"),
            ),
        )
        .field("spec.boot.disk")
        .details(serde_json::json!({ "fields": fields })));
    }
    if let (Some(_), Some(old), None) = (&desired.boot.disk, current.boot.disk_gib, desired.boot.disk_gib) {
        return Err(ApiError::invalid(
            "spec.boot.disk_gib",
            format!("the disk was grown to {old} GiB; keep disk_gib (at least {old}): a disk is never shrunk"),
        ));
    }
    Ok(())
}

/// A data disk kept by name is never shrunk and never changes format in place (only a new name
/// makes a new disk).
///
/// # Errors
/// 2001 naming `spec.disks[i].size_gib` or `spec.disks[i].format`.
fn check_disk_changes(current: &VmSpec, desired: &VmSpec) -> Result<(), ApiError> {
    for (i, new) in desired.disks.iter().enumerate() {
        let Some(old) = current.disks.iter().find(|d| d.name == new.name) else { continue };
        if old.format != new.format {
            return Err(ApiError::invalid(
                format!("spec.disks[{i}].format"),
                format!(
                    "data disk {:?} is {}; a format cannot change in place (add a disk under another name)",
                    new.name,
                    old.format.as_str()
                ),
            ));
        }
        if new.size_gib < old.size_gib {
            return Err(ApiError::invalid(
                format!("spec.disks[{i}].size_gib"),
                format!(
                    "data disk {:?} is {} GiB and is never shrunk; {} GiB is smaller",
                    new.name, old.size_gib, new.size_gib
                ),
            ));
        }
    }
    Ok(())
}

fn diff_values(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let sub = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                diff_values(&sub, x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null), out);
            }
        }
        _ if a != b => out.push(path.to_string()),
        _ => {}
    }
}

/// The order a reconcile runs its entries in: resources are freed before they are taken
/// (destroy, stop, reconfigure, replace, create, start), request order within each.
pub fn run_order(action: PlanAction) -> u8 {
    match action {
        PlanAction::Destroy => 0,
        PlanAction::Stop => 1,
        PlanAction::Reconfigure => 2,
        PlanAction::Replace => 3,
        PlanAction::Create => 4,
        PlanAction::Start => 5,
        PlanAction::None => 6,
    }
}

/// Fills `placement` of the planned entries that would start a VM (a create or replace of a
/// VM desired running, a start, a reconfigure that restarts or starts it) with what
/// [`crate::placement::place`] answers, in the run's order ([`run_order`]), each next to what
/// the VMs before it would hold: the running VMs' placements, less those the run stops,
/// destroys, replaces or restarts first, plus those placed before it. A refusal becomes the
/// entry's `error`. Entries that already fail are left as they are and hold nothing new.
/// `device_nodes` gives the NUMA nodes of a spec's passthrough devices.
pub fn place_entries(
    entries: &mut [PlanEntry],
    desired: &[VmSpec],
    current: &BTreeMap<String, CurrentVm>,
    topo: &crate::placement::topology::Topology,
    vm_cpus: Option<&crate::placement::CpuSet>,
    device_nodes: &dyn Fn(&VmSpec) -> Vec<u32>,
) {
    use crate::api::DesiredState::Running;
    use crate::placement::{place, Held, Placement, Request};
    let spec_of = |name: &str| desired.iter().find(|s| s.name == name);
    let starts = |e: &PlanEntry| {
        let running = spec_of(&e.vm).is_some_and(|s| s.state == Running);
        let up = current.get(&e.vm).is_some_and(|c| is_up(c.status));
        e.error.is_none()
            && match e.action {
                PlanAction::Create | PlanAction::Replace => running,
                PlanAction::Start => true,
                PlanAction::Reconfigure => running && (e.restart == Some(true) || !up),
                _ => false,
            }
    };
    let releases = |e: &PlanEntry| {
        e.error.is_none()
            && match e.action {
                PlanAction::Stop | PlanAction::Destroy | PlanAction::Replace => true,
                PlanAction::Reconfigure => e.restart == Some(true),
                _ => false,
            }
    };
    let released: HashSet<&str> = entries.iter().filter(|e| releases(e)).map(|e| e.vm.as_str()).collect();
    // (name, placement, its QEMU runs)
    let mut holdings: Vec<(String, Placement, bool)> = current
        .iter()
        .filter(|(name, _)| !released.contains(name.as_str()))
        .filter_map(|(name, c)| Some((name.clone(), c.placement.clone()?, c.status == VmStatus::Running)))
        .collect();
    let mut order: Vec<usize> = (0..entries.len()).filter(|&i| starts(&entries[i])).collect();
    order.sort_by_key(|&i| (run_order(entries[i].action), i));
    for i in order {
        let Some(spec) = spec_of(&entries[i].vm) else { continue };
        let held: Vec<Held<'_>> =
            holdings.iter().map(|(vm, placement, settled)| Held { vm, placement, settled: *settled }).collect();
        match place(topo, vm_cpus, &held, &Request::of(spec, device_nodes(spec))) {
            Ok(Some(p)) => {
                entries[i].placement = Some((&p).into());
                holdings.retain(|(vm, _, _)| *vm != spec.name);
                holdings.push((spec.name.clone(), p, false));
            }
            Ok(None) => {}
            Err(e) => entries[i].error = Some(e.to_json()),
        }
    }
}

/// The MACs a spec fixes, as allocations (tap names do not matter for a simulation).
fn declared_macs(spec: &VmSpec) -> Vec<NicAlloc> {
    spec.nics
        .iter()
        .filter_map(|n| n.mac.clone())
        .map(|mac| NicAlloc { mac, tap: String::new(), vhost: false })
        .collect()
}

/// True when a VM in `status` counts as running for planning.
fn is_up(status: VmStatus) -> bool {
    matches!(status, VmStatus::Running | VmStatus::Starting | VmStatus::Creating)
}

/// True when a VM desired stopped would be changed by a stop: it is up, its record still says
/// desired running, or its status (stopping, dead, failed) is settled to `stopped` by the stop.
/// Mirrors what `vm.apply` and `vm.stop` do, so that a dry run predicts the real run.
fn stop_changes(cur: &CurrentVm) -> bool {
    is_up(cur.status)
        || cur.spec.state != crate::api::DesiredState::Stopped
        || matches!(cur.status, VmStatus::Stopping | VmStatus::Dead | VmStatus::Failed)
}

/// Plans a reconcile of `current` towards `desired`.
///
/// Entries come in request order, then (for VMs not in the desired set) in name order. An entry
/// that would fail carries the error a real run would return.
pub fn plan_reconcile(
    config: &Config,
    desired: &[VmSpec],
    current: &BTreeMap<String, CurrentVm>,
    prune: bool,
    replace: bool,
) -> Vec<PlanEntry> {
    let mut entries: Vec<PlanEntry> = Vec::new();
    let mut seen = HashSet::new();
    for spec in desired {
        let mut fields = Vec::new();
        let mut restart = None;
        let mut refused = None;
        let (action, reason) = match current.get(&spec.name) {
            None => (PlanAction::Create, "not defined on this host".to_string()),
            Some(cur) => {
                let change = classify(&cur.spec, spec);
                match change {
                    Err(e) => {
                        refused = Some(e.to_json());
                        (PlanAction::Reconfigure, "the change cannot be made".to_string())
                    }
                    Ok(Change::Replace { fields: f }) => {
                        if !replace {
                            refused = Some(replace_needed(&spec.name, &f).to_json());
                        }
                        let reason = format!("boot.image changes (a new disk): {}", f.join(", "));
                        fields = f;
                        (PlanAction::Replace, reason)
                    }
                    Ok(Change::Reconfigure { fields: f, restart: r }) => {
                        let r = r && is_up(cur.status);
                        restart = Some(r);
                        let how = if r { "restarts" } else { "no restart" };
                        let reason = format!("changed in place, disk kept ({how}): {}", f.join(", "));
                        fields = f;
                        (PlanAction::Reconfigure, reason)
                    }
                    Ok(Change::None) if cur.pending_restart && spec.state == crate::api::DesiredState::Running => {
                        restart = Some(true);
                        (PlanAction::Reconfigure, "runs an older spec: restarted to apply it".to_string())
                    }
                    Ok(Change::None) => match (spec.state, is_up(cur.status)) {
                        (crate::api::DesiredState::Running, false) => {
                            (PlanAction::Start, format!("desired running, is {}", cur.status))
                        }
                        (crate::api::DesiredState::Stopped, _) if stop_changes(cur) => {
                            (PlanAction::Stop, format!("desired stopped, is {}", cur.status))
                        }
                        _ if cur.spec.guest_interfaces != spec.guest_interfaces => {
                            (PlanAction::None, "guest interfaces differ (applied live by the agent)".to_string())
                        }
                        _ if cur.spec.ssh != spec.ssh => {
                            (PlanAction::None, "ssh access differs (written live by the exec server)".to_string())
                        }
                        _ => (PlanAction::None, format!("up to date ({})", cur.status)),
                    },
                }
            }
        };
        let error = if !seen.insert(spec.name.clone()) {
            Some(ApiError::invalid("vms", format!("VM {:?} is listed twice", spec.name)).to_json())
        } else {
            validate_spec(spec, config).err().map(|e| e.to_json()).or(refused)
        };
        entries.push(PlanEntry { vm: spec.name.clone(), action, reason, error, fields, restart, placement: None });
    }
    for name in current.keys().filter(|n| !seen.contains(*n)) {
        let (action, reason) = if prune {
            (PlanAction::Destroy, "not in the desired set (prune)".to_string())
        } else {
            (PlanAction::None, "not in the desired set; kept (prune is off)".to_string())
        };
        entries.push(PlanEntry {
            vm: name.clone(),
            action,
            reason,
            error: None,
            fields: Vec::new(),
            restart: None,
            placement: None,
        });
    }

    // Admit the final set into a simulated host: the kept VMs, then the desired VMs that keep
    // their spec, then creates and replaces in request order. NIC conflicts are checked on the
    // addresses and fixed MACs the specs declare.
    let kept: Vec<&VmSpec> =
        current.iter().filter(|(n, _)| !seen.contains(*n) && !prune).map(|(_, c)| &c.spec).collect();
    let desired_by_name: BTreeMap<&str, &VmSpec> = desired.iter().map(|s| (s.name.as_str(), s)).collect();
    // The MACs each spec declares, made once (not once per entry admitted after it); by the
    // spec's address, as a name may be listed twice.
    let key = |s: &VmSpec| std::ptr::from_ref(s) as usize;
    let fixed: HashMap<usize, Vec<NicAlloc>> =
        kept.iter().copied().chain(desired.iter()).map(|s| (key(s), declared_macs(s))).collect();
    let no_macs = Vec::new();
    let macs = |s: &VmSpec| fixed.get(&key(s)).unwrap_or(&no_macs);
    // What the simulated host holds, grown as entries are admitted.
    let mut holdings: Vec<Holding<'_>> = kept.iter().map(|s| Holding { name: &s.name, spec: s }).collect();
    let mut used = Used::of(&holdings);
    let mut nic_holdings: Vec<NicHolding<'_>> =
        kept.iter().map(|s| NicHolding { vm: &s.name, spec: s, allocs: macs(s) }).collect();
    for pass_changes in [false, true] {
        for entry in entries.iter_mut() {
            let changes = matches!(entry.action, PlanAction::Create | PlanAction::Replace | PlanAction::Reconfigure);
            if changes != pass_changes || entry.error.is_some() || entry.action == PlanAction::Destroy {
                continue;
            }
            let Some(spec) = desired_by_name.get(entry.vm.as_str()).copied() else { continue };
            // Names are unique in the simulated host (a name listed twice is refused above), so
            // nothing held is the entry's own.
            let verdict = check_devices(&config.hardware, &holdings, spec)
                .and_then(|()| check_room(&config.hardware, used, spec))
                .and_then(|()| crate::nic::check_conflicts(spec, config, &nic_holdings));
            match verdict {
                Ok(()) => {
                    used.add(spec);
                    holdings.push(Holding { name: &spec.name, spec });
                    nic_holdings.push(NicHolding { vm: &spec.name, spec, allocs: macs(spec) });
                }
                Err(e) => entry.error = Some(e.to_json()),
            }
        }
    }
    entries
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::DesiredState;
    use crate::validate::tests::{config, spec};

    fn cur(specs: &[(VmSpec, VmStatus)]) -> BTreeMap<String, CurrentVm> {
        specs
            .iter()
            .map(|(s, st)| {
                (s.name.clone(), CurrentVm { spec: s.clone(), status: *st, pending_restart: false, placement: None })
            })
            .collect()
    }

    use crate::validate::tests::data_disk as disk;

    fn actions(p: &[PlanEntry]) -> Vec<(String, PlanAction, Option<i64>)> {
        p.iter().map(|e| (e.vm.clone(), e.action, e.error.as_ref().and_then(|v| v["code"].as_i64()))).collect()
    }

    #[test]
    fn drift_lists_dotted_fields_and_ignores_state() {
        let a = spec("a");
        let mut b = a.clone();
        assert!(spec_drift(&a, &b).is_empty());
        b.state = DesiredState::Stopped;
        assert!(spec_drift(&a, &b).is_empty());
        b.cpu = 2;
        b.boot.cmdline = Some("quiet".into());
        b.hardware.sfp = vec![5];
        assert_eq!(spec_drift(&a, &b), vec!["boot.cmdline", "cpu", "hardware"]);
        b = a.clone();
        b.role = Some("sensor".into());
        assert_eq!(spec_drift(&a, &b), vec!["role"]);
    }

    #[test]
    fn the_equal_spec_shortcut_agrees_with_the_field_diff_for_every_field() {
        let a = spec("a");
        type Edit = fn(&mut VmSpec);
        let change: Vec<(&str, Edit)> = vec![
            ("name", |s| s.name = "b".into()),
            ("role", |s| s.role = Some("sensor".into())),
            ("cpu", |s| s.cpu += 1),
            ("memory_mib", |s| s.memory_mib += 1),
            ("hardware", |s| s.hardware.sfp = vec![5]),
            ("pci", |s| s.pci = vec!["0000:00:05.0".into()]),
            ("boot.cmdline", |s| s.boot.cmdline = Some("quiet".into())),
            ("boot.firmware", |s| s.boot.firmware = crate::api::Firmware::Uefi),
            ("disks", |s| s.disks = vec![disk("d", 1, crate::api::DiskFormat::Raw)]),
            ("nics", |s| s.nics = vec![crate::api::NicSpec { network: "lan".into(), ..Default::default() }]),
            ("restart_policy", |s| s.restart_policy = crate::api::RestartPolicy::Never),
            ("user_data", |s| s.user_data = Some("#cloud-config\n".into())),
            ("cpu_policy", |s| s.cpu_policy = crate::api::CpuPolicy::Dedicated),
            ("numa", |s| s.numa = Some(crate::api::NumaPolicy::Node(0))),
            ("hugepages", |s| s.hugepages = Some(crate::api::HugePageSize::M2)),
            ("emulator_cpu", |s| s.emulator_cpu = true),
            ("tpm", |s| s.tpm = true),
        ];
        for (field, make) in change {
            let mut b = a.clone();
            make(&mut b);
            assert!(!same_but_convergent(&a, &b), "{field} changed but the shortcut saw none");
            assert!(spec_drift(&a, &b).iter().any(|f| f.starts_with(field)), "{field}: {:?}", spec_drift(&a, &b));
        }
        let mut b = a.clone();
        b.state = DesiredState::Stopped;
        b.guest_interfaces = vec![vmhost_agent_protocol::DesiredInterface {
            name: "eth0".into(),
            link: None,
            vlan_id: None,
            address: "10.0.0.2/24".into(),
        }];
        b.ssh = Some(crate::api::SshSpec {
            user: "ops".into(),
            keys: vec!["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA".into()],
        });
        assert!(same_but_convergent(&a, &b));
        assert!(spec_drift(&a, &b).is_empty());
    }

    #[test]
    fn a_change_of_nic_queues_needs_a_restart() {
        let mut a = spec("mq");
        a.nics = vec![crate::api::NicSpec { network: "lan".into(), ..Default::default() }];
        let mut b = a.clone();
        b.nics[0].queues = 4;
        let fields = spec_drift(&a, &b);
        assert_eq!(fields, ["nics"]);
        assert!(needs_restart(&fields));
    }

    #[test]
    fn an_ssh_change_is_no_drift_and_a_reconcile_says_so() {
        let a = spec("sensor1_sensor");
        let mut b = a.clone();
        b.ssh = Some(crate::api::SshSpec {
            user: "ops".into(),
            keys: vec!["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA".into()],
        });
        assert_eq!(classify(&a, &b).unwrap(), Change::None);
        assert_eq!(classify(&b, &a).unwrap(), Change::None, "removing it neither");
        let p = plan_reconcile(&config(), &[b.clone()], &cur(&[(a.clone(), VmStatus::Running)]), false, false);
        assert_eq!(
            (p[0].action, p[0].reason.as_str()),
            (PlanAction::None, "ssh access differs (written live by the exec server)")
        );
        // With another change it is a reconfigure of that field only.
        b.memory_mib += 1;
        assert_eq!(classify(&a, &b).unwrap(), Change::Reconfigure { fields: vec!["memory_mib".into()], restart: true });
    }

    #[test]
    fn a_user_data_change_alone_needs_no_restart() {
        let a = spec("sensor1_sensor");
        let mut b = a.clone();
        b.user_data = Some("#cloud-config\n".into());
        assert_eq!(classify(&a, &b).unwrap(), Change::Reconfigure { fields: vec!["user_data".into()], restart: false });
        let mut c = b.clone();
        c.user_data = Some("#cloud-config\nruncmd: []\n".into());
        assert_eq!(classify(&b, &c).unwrap(), Change::Reconfigure { fields: vec!["user_data".into()], restart: false });
        assert_eq!(classify(&c, &a).unwrap(), Change::Reconfigure { fields: vec!["user_data".into()], restart: false });
        assert!(!restart_needed(&a, &b));
        // With another field that needs one, it restarts.
        c.memory_mib += 1;
        assert_eq!(
            classify(&a, &c).unwrap(),
            Change::Reconfigure { fields: vec!["memory_mib".into(), "user_data".into()], restart: true }
        );
        // A reconcile plans it without a restart for a running VM.
        let p = plan_reconcile(&config(), &[b], &cur(&[(a, VmStatus::Running)]), false, false);
        assert_eq!((p[0].action, p[0].restart, p[0].error.clone()), (PlanAction::Reconfigure, Some(false), None));
    }

    #[test]
    fn one_action_per_situation() {
        let c = config();
        let same = spec("same");
        let stopped = spec("stopped");
        let mut to_stop = spec("tostop");
        let dead = spec("dead");
        let changed = spec("changed");
        let mut changed_new = changed.clone();
        changed_new.memory_mib = 512;
        let extra = spec("extra");
        let current = cur(&[
            (same.clone(), VmStatus::Running),
            (stopped.clone(), VmStatus::Stopped),
            (to_stop.clone(), VmStatus::Running),
            (dead.clone(), VmStatus::Dead),
            (changed.clone(), VmStatus::Running),
            (extra.clone(), VmStatus::Running),
        ]);
        to_stop.state = DesiredState::Stopped;
        let desired = vec![spec("new"), same, stopped, to_stop, dead, changed_new];
        let p = plan_reconcile(&c, &desired, &current, false, false);
        assert_eq!(
            actions(&p),
            vec![
                ("new".into(), PlanAction::Create, None),
                ("same".into(), PlanAction::None, None),
                ("stopped".into(), PlanAction::Start, None),
                ("tostop".into(), PlanAction::Stop, None),
                ("dead".into(), PlanAction::Start, None),
                // Seven 1-CPU VMs on 6 allocatable CPUs: the change is admitted last and refused.
                ("changed".into(), PlanAction::Reconfigure, Some(3002)),
                ("extra".into(), PlanAction::None, None),
            ]
        );
        assert!(p[5].reason.contains("memory_mib"), "{}", p[5].reason);
        assert_eq!((p[5].fields.clone(), p[5].restart), (vec!["memory_mib".to_string()], Some(true)));
        let p = plan_reconcile(&c, &desired, &current, true, false);
        assert_eq!(p[6].action, PlanAction::Destroy);
        assert_eq!(p[5].error, None, "pruning extra frees the CPU the replace needs");
    }

    /// A dry run predicts what `vm.apply` does for a VM desired stopped: a stop whenever the stop
    /// would change the record, not only when QEMU is up.
    #[test]
    fn desired_stopped_plans_a_stop_whenever_the_stop_would_change_something() {
        let c = config();
        let stopped_spec = |name: &str| {
            let mut s = spec(name);
            s.state = DesiredState::Stopped;
            s
        };
        let recorded_stopped = |name: &str, status| (stopped_spec(name), status);
        let current = cur(&[
            (spec("dead"), VmStatus::Dead),
            recorded_stopped("deadstopped", VmStatus::Dead),
            recorded_stopped("failed", VmStatus::Failed),
            recorded_stopped("stopping", VmStatus::Stopping),
            (spec("was_running"), VmStatus::Stopped),
            recorded_stopped("settled", VmStatus::Stopped),
        ]);
        let desired: Vec<VmSpec> =
            ["dead", "deadstopped", "failed", "stopping", "was_running", "settled"].map(stopped_spec).to_vec();
        let p = plan_reconcile(&c, &desired, &current, false, false);
        let got: Vec<(String, PlanAction)> = p.iter().map(|e| (e.vm.clone(), e.action)).collect();
        let want: Vec<(String, PlanAction)> = [
            ("dead", PlanAction::Stop),
            ("deadstopped", PlanAction::Stop),
            ("failed", PlanAction::Stop),
            ("stopping", PlanAction::Stop),
            ("was_running", PlanAction::Stop),
            ("settled", PlanAction::None),
        ]
        .map(|(n, a)| (n.to_string(), a))
        .to_vec();
        assert_eq!(got, want);
    }

    #[test]
    fn the_set_is_validated_as_a_whole() {
        // 6 CPUs allocatable; sfp 5 exists once.
        let c = config();
        let mut a = spec("a");
        a.cpu = 3;
        a.hardware.sfp = vec![5];
        let mut b = spec("b");
        b.cpu = 3;
        let mut d = spec("d");
        d.cpu = 1;
        let mut e = spec("e");
        e.hardware.sfp = vec![5];
        let mut bad = spec("bad");
        bad.hardware.sfp = vec![9];
        let p = plan_reconcile(&c, &[a, b, d, e, bad], &BTreeMap::new(), false, false);
        assert_eq!(
            actions(&p),
            vec![
                ("a".into(), PlanAction::Create, None),
                ("b".into(), PlanAction::Create, None),
                ("d".into(), PlanAction::Create, Some(3002)),
                ("e".into(), PlanAction::Create, Some(3003)),
                ("bad".into(), PlanAction::Create, Some(3001)),
            ]
        );
    }

    #[test]
    fn kept_and_unchanged_vms_are_admitted_first() {
        let c = config();
        let mut old = spec("old");
        old.cpu = 4;
        let mut kept = spec("kept");
        kept.cpu = 1;
        let current = cur(&[(old.clone(), VmStatus::Running), (kept.clone(), VmStatus::Running)]);
        let mut new = spec("new");
        new.cpu = 2;
        // "new" comes first in the request but the unchanged "old" keeps its CPUs.
        let p = plan_reconcile(&c, &[new.clone(), old.clone()], &current, false, false);
        assert_eq!(actions(&p)[0], ("new".into(), PlanAction::Create, Some(3002)));
        assert_eq!(actions(&p)[1], ("old".into(), PlanAction::None, None));
        // With prune, "kept" is destroyed and its CPU frees room for "new" (1 + 4 + 1 = 6).
        new.cpu = 1;
        let p = plan_reconcile(&c, &[new, old], &current, true, false);
        assert_eq!(
            actions(&p),
            vec![
                ("new".into(), PlanAction::Create, None),
                ("old".into(), PlanAction::None, None),
                ("kept".into(), PlanAction::Destroy, None),
            ]
        );
    }

    #[test]
    fn duplicates_and_invalid_specs_are_flagged() {
        let c = config();
        let p = plan_reconcile(&c, &[spec("a"), spec("a"), spec("B")], &BTreeMap::new(), false, false);
        assert_eq!(p[0].error, None);
        assert_eq!(p[1].error.as_ref().unwrap()["code"], 2001);
        assert_eq!(p[2].error.as_ref().unwrap()["data"]["field"], "spec.name");
    }

    #[test]
    fn address_conflicts_across_the_set_are_found() {
        let c = crate::config::Config::parse(
            "[paths]\nboot = [\"/boot\"]\n[hardware]\ncpu = 8\nmemory_gib = 16\n[networks.lan]\nbridge = \"br0\"\nsubnet = \"10.0.0.0/24\"\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let nic = crate::validate::tests::static_nic("lan", "10.0.0.5/24");
        let mut a = spec("a");
        a.nics = vec![nic.clone()];
        let mut b = spec("b");
        b.nics = vec![nic];
        let p = plan_reconcile(&c, &[a, b], &BTreeMap::new(), false, false);
        assert_eq!(actions(&p)[1], ("b".into(), PlanAction::Create, Some(3003)));
        assert_eq!(p[0].error, None);
    }

    #[test]
    fn a_changed_vm_may_reuse_its_own_hardware() {
        let c = config();
        let mut a = spec("a");
        a.hardware.sfp = vec![5];
        let current = cur(&[(a.clone(), VmStatus::Running)]);
        let mut a2 = a.clone();
        a2.cpu = 2;
        let p = plan_reconcile(&c, &[a2], &current, false, false);
        assert_eq!(actions(&p), vec![("a".into(), PlanAction::Reconfigure, None)]);
    }

    #[test]
    fn data_disks_grow_and_come_and_go_but_never_shrink_or_change_format() {
        use crate::api::{DataDiskSpec, DiskCache, DiskFormat};
        let with = |disks: Vec<DataDiskSpec>| {
            let mut s = spec("v");
            s.disks = disks;
            s
        };
        let one = with(vec![disk("nsm", 2, DiskFormat::Raw)]);
        let grown = with(vec![disk("nsm", 3, DiskFormat::Raw)]);
        let restarts = |c: Change| match c {
            Change::Reconfigure { restart, .. } => restart,
            other => panic!("expected a change in place, got {other:?}"),
        };
        assert!(!restarts(classify(&one, &grown).unwrap()), "a larger disk grows live");
        let mut left_out = one.clone();
        left_out.disks[0].snapshot = false;
        assert!(!restarts(classify(&one, &left_out).unwrap()), "snapshot: false changes in place, live");
        assert!(live_disk_changes(&one, &left_out).unwrap().is_empty());
        assert_eq!(
            live_disk_changes(&one, &grown)
                .unwrap()
                .grow
                .iter()
                .map(|(d, old)| (d.name.as_str(), *old))
                .collect::<Vec<_>>(),
            [("nsm", 2)]
        );
        let added = with(vec![disk("nsm", 2, DiskFormat::Raw), disk("logs", 1, DiskFormat::Qcow2)]);
        assert!(!restarts(classify(&one, &added).unwrap()), "a new disk is hot-plugged");
        assert!(!restarts(classify(&added, &one).unwrap()), "a dropped disk is unplugged");
        let names = |v: &[&DataDiskSpec]| v.iter().map(|d| d.name.clone()).collect::<Vec<_>>();
        let live = live_disk_changes(&one, &added).unwrap();
        assert_eq!((names(&live.add), names(&live.remove), live.grow.len()), (vec!["logs".to_string()], vec![], 0));
        let live = live_disk_changes(&added, &one).unwrap();
        assert_eq!((names(&live.add), names(&live.remove)), (vec![], vec!["logs".to_string()]));
        // Grown, one dropped and one added at once, in the middle: all live.
        let three =
            with(vec![disk("a", 1, DiskFormat::Raw), disk("b", 1, DiskFormat::Raw), disk("c", 1, DiskFormat::Raw)]);
        let mixed =
            with(vec![disk("a", 2, DiskFormat::Raw), disk("n", 1, DiskFormat::Qcow2), disk("c", 1, DiskFormat::Raw)]);
        let live = live_disk_changes(&three, &mixed).unwrap();
        assert_eq!(
            (
                names(&live.add),
                names(&live.remove),
                live.grow.iter().map(|(d, o)| (d.name.clone(), *o)).collect::<Vec<_>>()
            ),
            (vec!["n".to_string()], vec!["b".to_string()], vec![("a".to_string(), 1)])
        );
        assert!(!restarts(classify(&three, &mixed).unwrap()));
        assert!(live_disk_changes(&one, &one).unwrap().is_empty());
        // The kept disks in another order: the guest's order is fixed at start.
        let swapped =
            with(vec![disk("c", 1, DiskFormat::Raw), disk("a", 1, DiskFormat::Raw), disk("b", 1, DiskFormat::Raw)]);
        assert_eq!(live_disk_changes(&three, &swapped), None);
        assert!(restarts(classify(&three, &swapped).unwrap()), "a new order needs a restart");
        let mut cached = grown.clone();
        cached.disks[0].cache = DiskCache::Writeback;
        assert!(restarts(classify(&one, &cached).unwrap()), "another cache mode needs a restart");
        let mut other = added.clone();
        other.cpu += 1;
        assert!(restarts(classify(&one, &other).unwrap()), "a disk with another change still restarts");
        assert_eq!(classify(&grown, &one).unwrap_err().field.as_deref(), Some("spec.disks[0].size_gib"));
        let qcow = with(vec![disk("nsm", 2, DiskFormat::Qcow2)]);
        assert_eq!(classify(&one, &qcow).unwrap_err().field.as_deref(), Some("spec.disks[0].format"));
        assert_eq!(classify(&one, &one).unwrap(), Change::None);
    }

    fn image_spec(name: &str, image: &str, gib: u64) -> VmSpec {
        let mut s = spec(name);
        s.boot = crate::api::BootSpec { image: Some(image.into()), disk_gib: Some(gib), ..Default::default() };
        s
    }

    #[test]
    fn only_an_image_change_needs_a_replace() {
        let a = image_spec("a", "base.qcow2", 10);
        assert_eq!(classify(&a, &a).unwrap(), Change::None);
        let mut b = a.clone();
        b.state = DesiredState::Stopped;
        b.guest_interfaces = vec![];
        assert_eq!(classify(&a, &b).unwrap(), Change::None, "state and guest interfaces converge separately");
        for (what, change) in [
            ("cpu", Box::new(|s: &mut VmSpec| s.cpu = 2) as Box<dyn Fn(&mut VmSpec)>),
            ("memory_mib", Box::new(|s: &mut VmSpec| s.memory_mib = 1024)),
            ("role", Box::new(|s: &mut VmSpec| s.role = Some("sensor".into()))),
            ("hardware", Box::new(|s: &mut VmSpec| s.hardware.sfp = vec![5])),
            ("pci", Box::new(|s: &mut VmSpec| s.pci = vec!["pci_0000_d0_00_1".into()])),
        ] {
            let mut b = a.clone();
            change(&mut b);
            match classify(&a, &b).unwrap() {
                Change::Reconfigure { fields, restart } => {
                    assert_eq!(fields, vec![what.to_string()]);
                    assert!(restart, "{what} needs a restart");
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        let grown = image_spec("a", "base.qcow2", 20);
        assert_eq!(
            classify(&a, &grown).unwrap(),
            Change::Reconfigure { fields: vec!["boot.disk_gib".into()], restart: false },
            "a larger disk grows live"
        );
        let mut grown_and_cpu = grown.clone();
        grown_and_cpu.cpu = 3;
        assert!(matches!(classify(&a, &grown_and_cpu).unwrap(), Change::Reconfigure { restart: true, .. }));
        let e = classify(&a, &image_spec("a", "base.qcow2", 5)).unwrap_err();
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("spec.boot.disk_gib")));
        // A new image (even a smaller disk with it) is a replace.
        assert_eq!(
            classify(&a, &image_spec("a", "other.qcow2", 5)).unwrap(),
            Change::Replace { fields: vec!["boot.disk_gib".into(), "boot.image".into()] }
        );
        // Kernel boot to image boot and back change boot.image too.
        assert!(matches!(classify(&spec("a"), &a).unwrap(), Change::Replace { .. }));
        assert!(matches!(classify(&a, &spec("a")).unwrap(), Change::Replace { .. }));
        // Kernel, initrd and cmdline change in place.
        let mut k = spec("a");
        k.boot.cmdline = Some("console=ttyS0 quiet".into());
        assert!(matches!(classify(&spec("a"), &k).unwrap(), Change::Reconfigure { restart: true, .. }));
    }

    #[test]
    fn a_firmware_change_restarts_the_vm_and_keeps_its_disk() {
        use crate::api::Firmware;
        for bios in [spec("a"), image_spec("a", "base.qcow2", 10)] {
            let mut uefi = bios.clone();
            uefi.boot.firmware = Firmware::Uefi;
            let want = Change::Reconfigure { fields: vec!["boot.firmware".into()], restart: true };
            assert_eq!(classify(&bios, &uefi).unwrap(), want);
            assert_eq!(classify(&uefi, &bios).unwrap(), want, "and back");
            assert!(restart_needed(&bios, &uefi));
            // With a live change (a larger disk) it still restarts.
            let mut grown = uefi.clone();
            grown.boot.disk_gib = grown.boot.disk_gib.map(|g| g + 1);
            assert!(matches!(classify(&bios, &grown).unwrap(), Change::Reconfigure { restart: true, .. }));
            // A reconcile plans it as a restarting reconfigure of a running VM.
            let p = plan_reconcile(&config(), &[uefi.clone()], &cur(&[(bios, VmStatus::Running)]), false, false);
            assert_eq!((p[0].action, p[0].restart, p[0].error.clone()), (PlanAction::Reconfigure, Some(true), None));
        }
    }

    /// Where QEMU's threads and memory go is fixed when it starts (memory backend, affinity):
    /// each placement field restarts a running VM, and only a running one.
    #[test]
    fn a_placement_change_restarts_the_vm() {
        use crate::api::{CpuPolicy, HugePageSize, NumaPolicy};
        type Edit = fn(&mut VmSpec);
        let edits: [(&str, Edit); 5] = [
            ("cpu_policy", |s| s.cpu_policy = CpuPolicy::Dedicated),
            ("numa", |s| s.numa = Some(NumaPolicy::Auto)),
            ("numa", |s| s.numa = Some(NumaPolicy::Node(0))),
            ("hugepages", |s| s.hugepages = Some(HugePageSize::M2)),
            ("emulator_cpu", |s| {
                s.cpu_policy = CpuPolicy::Dedicated;
                s.emulator_cpu = true;
            }),
        ];
        for (field, edit) in edits {
            let a = spec("a");
            let mut b = a.clone();
            edit(&mut b);
            assert!(restart_needed(&a, &b), "{field}");
            assert!(restart_needed(&b, &a), "{field} back");
            let Change::Reconfigure { fields, restart: true } = classify(&a, &b).unwrap() else {
                panic!("{field}: {:?}", classify(&a, &b))
            };
            assert!(fields.iter().any(|f| f == field), "{field}: {fields:?}");
        }
        let mut b = spec("a");
        b.numa = Some(NumaPolicy::Auto);
        b.hugepages = Some(HugePageSize::M2);
        let p = plan_reconcile(&config(), &[b.clone()], &cur(&[(spec("a"), VmStatus::Running)]), false, false);
        assert_eq!((p[0].action, p[0].restart, p[0].error.clone()), (PlanAction::Reconfigure, Some(true), None));
        assert_eq!(p[0].fields, vec!["hugepages".to_string(), "numa".into()]);
        let p = plan_reconcile(&config(), &[b], &cur(&[(spec("a"), VmStatus::Stopped)]), false, false);
        assert_eq!(p[0].restart, Some(false), "a stopped VM takes it at its next start");
    }

    /// A dry run's placements: in the run's order, next to what stays and what was placed
    /// before, after what the run stops or restarts first.
    #[test]
    fn a_dry_run_places_what_it_would_start_in_the_runs_order() {
        use crate::api::{CpuPolicy, DesiredState};
        use crate::placement::topology::{Node, Topology};
        use crate::placement::{CpuSet, Placement};
        let cpus = |t: &str| CpuSet::parse(t).unwrap();
        let topo = Topology {
            nodes: vec![
                Node { id: 0, cpus: cpus("0-3"), memory_mib: 4096, hugepages: Default::default() },
                Node { id: 1, cpus: cpus("4-7"), memory_mib: 4096, hugepages: Default::default() },
            ],
            online: cpus("0-7"),
        };
        let mut config = config();
        config.hardware.vm_cpus = Some(cpus("1-7"));
        // Room enough in the CPU count that only placement refuses.
        (config.hardware.cpu, config.hardware.reserved_cpu) = (32, 0);
        let dedicated = |name: &str, cpu: u32| {
            let mut s = spec(name);
            s.cpu_policy = CpuPolicy::Dedicated;
            s.cpu = cpu;
            s
        };
        let old = dedicated("old", 4);
        let mut current = cur(&[(old.clone(), VmStatus::Running), (spec("idle"), VmStatus::Stopped)]);
        current.get_mut("old").unwrap().placement = Some(Placement {
            policy: CpuPolicy::Dedicated,
            vcpus: vec![4, 5, 6, 7],
            cpus: cpus("4-7"),
            emulator: cpus("0"),
            nodes: vec![1],
            hugepages: None,
            hugepages_per_node: Default::default(),
            memory_mib: 256,
        });
        let run = |desired: &[VmSpec]| {
            let mut p = plan_reconcile(&config, desired, &current, false, false);
            place_entries(&mut p, desired, &current, &topo, config.hardware.vm_cpus.as_ref(), &|_| Vec::new());
            p.iter()
                .map(|e| {
                    let code = e.error.as_ref().and_then(|v| v["code"].as_i64());
                    (e.vm.clone(), e.placement.as_ref().map(|p| p.cpus.to_string()), code)
                })
                .collect::<Vec<_>>()
        };
        let row = |vm: &str, cpus: Option<&str>, code: Option<i64>| (vm.to_string(), cpus.map(str::to_string), code);
        // "old" keeps 4-7: the first create gets node 0's three CPUs, the second has none left;
        // the start of "idle" (shared) floats over what is left (nothing: refused).
        assert_eq!(
            run(&[old.clone(), dedicated("a", 3), dedicated("b", 1), spec("idle")]),
            vec![
                row("old", None, None),
                row("a", Some("1-3"), None),
                row("b", None, Some(3002)),
                row("idle", None, Some(3002)),
            ]
        );
        // Stopped first, "old"'s CPUs are free for the creates (stops run before creates,
        // whatever the request order).
        let mut stop = old.clone();
        stop.state = DesiredState::Stopped;
        assert_eq!(
            run(&[dedicated("a", 4), stop, dedicated("b", 3)]),
            vec![
                row("a", Some("4-7"), None),
                row("old", None, None),
                row("b", Some("1-3"), None),
                row("idle", None, None)
            ]
        );
        // A restart for a change gives it a new placement, made before the creates': node 1
        // again (4 free there), then node 0 for the create (3 free there, 2 on node 1).
        let smaller = dedicated("old", 2);
        assert_eq!(
            run(&[dedicated("a", 3), smaller]),
            vec![row("a", Some("1-3"), None), row("old", Some("4-5"), None), row("idle", None, None)]
        );
        // A VM that keeps running keeps its placement (no new one); one desired stopped gets none.
        let mut idle = spec("idle");
        idle.state = DesiredState::Stopped;
        assert_eq!(run(&[old, idle]), vec![row("old", None, None), row("idle", None, None)]);
    }

    #[test]
    fn an_imported_root_disk_grows_in_place_and_is_never_swapped() {
        let mut a = spec("a");
        a.boot = crate::api::BootSpec { disk: Some("old.qcow2".into()), ..Default::default() };
        let mut grown = a.clone();
        grown.boot.disk_gib = Some(40);
        assert_eq!(
            classify(&a, &grown).unwrap(),
            Change::Reconfigure { fields: vec!["boot.disk_gib".into()], restart: false },
            "a first disk_gib grows it live"
        );
        let mut more = grown.clone();
        more.boot.disk_gib = Some(50);
        assert_eq!(
            classify(&grown, &more).unwrap(),
            Change::Reconfigure { fields: vec!["boot.disk_gib".into()], restart: false }
        );
        let e = classify(&more, &grown).unwrap_err();
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("spec.boot.disk_gib")), "shrunk");
        let e = classify(&grown, &a).unwrap_err();
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("spec.boot.disk_gib")), "disk_gib dropped");
        // Another file, an image or a kernel instead, or an import on a VM that had none: 2002.
        let mut other = a.clone();
        other.boot.disk = Some("other.qcow2".into());
        let image = image_spec("a", "base.qcow2", 10);
        for (from, to) in [(&a, &other), (&a, &image), (&image, &a), (&spec("a"), &a), (&a, &spec("a"))] {
            let e = classify(from, to).unwrap_err();
            assert_eq!(
                (e.code.as_i32(), e.field.as_deref()),
                (2002, Some("spec.boot.disk")),
                "{:?} -> {:?}",
                from.boot,
                to.boot
            );
            assert!(e.message.contains("destroy"), "{}", e.message);
        }
        // Other fields change in place as for any VM.
        let mut cpu = a.clone();
        cpu.cpu = 2;
        assert_eq!(classify(&a, &cpu).unwrap(), Change::Reconfigure { fields: vec!["cpu".into()], restart: true });
        // A reconcile reports the refusal instead of planning a replace.
        let p = plan_reconcile(&config(), &[other], &cur(&[(a, VmStatus::Running)]), false, true);
        assert_eq!(p[0].error.as_ref().unwrap()["data"]["field"], "spec.boot.disk");
    }

    #[test]
    fn reconcile_plans_reconfigure_and_replaces_only_when_asked() {
        let c = config();
        let a = image_spec("a", "base.qcow2", 10);
        let b = image_spec("b", "base.qcow2", 10);
        let s = image_spec("s", "base.qcow2", 10);
        let current =
            cur(&[(a.clone(), VmStatus::Running), (b.clone(), VmStatus::Running), (s.clone(), VmStatus::Stopped)]);
        let mut a2 = a.clone();
        a2.memory_mib = 512;
        let b2 = image_spec("b", "other.qcow2", 10);
        let mut s2 = s.clone();
        s2.cpu = 2;
        s2.state = DesiredState::Stopped;
        let desired = vec![a2, b2, s2];
        let p = plan_reconcile(&c, &desired, &current, false, false);
        assert_eq!(
            actions(&p),
            vec![
                ("a".into(), PlanAction::Reconfigure, None),
                ("b".into(), PlanAction::Replace, Some(2002)),
                ("s".into(), PlanAction::Reconfigure, None),
            ]
        );
        assert_eq!(p[0].restart, Some(true));
        assert_eq!(p[1].error.as_ref().unwrap()["data"]["field"], "spec.boot.image");
        assert_eq!(p[2].restart, Some(false), "a stopped VM is only re-recorded");
        let p = plan_reconcile(&c, &desired, &current, false, true);
        assert_eq!(actions(&p)[1], ("b".into(), PlanAction::Replace, None));
        // A VM that runs an older spec (restart: false) is restarted by a reconcile that wants it running.
        let mut pending = cur(&[(a.clone(), VmStatus::Running)]);
        if let Some(v) = pending.get_mut("a") {
            v.pending_restart = true;
        }
        let p = plan_reconcile(&c, std::slice::from_ref(&a), &pending, false, false);
        assert_eq!((p[0].action, p[0].restart), (PlanAction::Reconfigure, Some(true)));
        let p = plan_reconcile(&c, std::slice::from_ref(&a), &current, false, false);
        assert_eq!(p[0].action, PlanAction::None);
        let mut shrunk = a.clone();
        shrunk.boot.disk_gib = Some(1);
        let p = plan_reconcile(&c, &[shrunk], &current, false, true);
        assert_eq!(actions(&p)[0], ("a".into(), PlanAction::Reconfigure, Some(2001)));
    }

    /// A NIC's mode, source, direction, tagged VLANs or trunk is fixed when QEMU starts (the
    /// tap is made for it, attached or mirrored): every change needs a restart.
    #[test]
    fn a_change_of_capture_or_tagged_vlans_needs_a_restart() {
        use crate::api::{CaptureDirection, NicMode, NicSpec};
        let bridge = NicSpec { network: "lan".into(), ..Default::default() };
        let monitor = NicSpec { mode: NicMode::Monitor, source: Some("eth1".into()), ..Default::default() };
        type Edit = fn(&mut NicSpec);
        let cases: [(&str, &NicSpec, Edit); 7] = [
            ("mode", &bridge, |n| {
                n.mode = NicMode::Monitor;
                n.network.clear();
                n.source = Some("eth1".into());
            }),
            ("source", &monitor, |n| n.source = Some("eth2".into())),
            ("direction", &monitor, |n| n.direction = Some(CaptureDirection::Ingress)),
            ("direction both", &monitor, |n| n.direction = Some(CaptureDirection::Both)),
            ("vlans", &bridge, |n| n.vlans = vec![10]),
            ("vlans order", &bridge, |n| n.vlans = vec![]),
            ("trunk", &bridge, |n| n.trunk = true),
        ];
        for (what, start, edit) in cases {
            let mut a = spec("cap");
            a.nics = vec![start.clone()];
            if what == "vlans order" {
                a.nics[0].vlans = vec![10, 20];
            }
            let mut b = a.clone();
            edit(&mut b.nics[0]);
            assert!(!same_but_convergent(&a, &b), "{what}");
            assert!(restart_needed(&a, &b), "{what}: {:?}", spec_drift(&a, &b));
            assert!(restart_needed(&b, &a), "{what} back");
            match classify(&a, &b).unwrap() {
                Change::Reconfigure { restart, .. } => assert!(restart, "{what}"),
                other => panic!("{what}: {other:?}"),
            }
        }
    }
}
