//! Passthrough steps of the lifecycle: check, bind before QEMU, release after it.
//!
//! Order: [`check_passthrough`] before anything is recorded or touched (3006 when a device is
//! not the one its model entry pins, [`check_identity`]; then 2001, 3003, 3004, 3005 refuse the
//! request cleanly); [`VmOp::bind_passthrough`] right before QEMU, which
//! records every affected function's original driver in the VM record *before* the first sysfs
//! write; [`VmOp::hand_vfio_groups_to_qemu`] after it, which records each IOMMU group node's
//! group and mode *before* the spawner gives the node to QEMU's group;
//! [`HeldVm::release_passthrough`] after QEMU is gone (stop, destroy, death, failed launch, and
//! at daemon start for VMs whose QEMU vanished), which first puts each node's group and mode
//! back, then the drivers. The record's bindings are cleared only once release succeeded, so a
//! failed release is retried at the next opportunity.
//!
//! Sysfs writes and the bounded waits for the kernel block, so they run on the blocking pool.

use super::held::HeldVm;
use super::op::VmOp;
use super::Manager;
use crate::api::{ApiError, VmSpec};
use crate::hardware::PciAddress;
use crate::pci::bind::{self, Binding, BIND_TIMEOUT};
use crate::pci::check::{self, Assignment, Requested};
use crate::pci::identity::{self, IdentityError, Judged, PinnedDevice};
use crate::pci::{PassthroughError, PassthroughStep};
use crate::sandbox::spawn::{self, NodeAccess, VFIO_NODE_MODES};
use crate::validate::requested_devices;
use std::collections::BTreeMap;

/// Checks that every passthrough device of `spec` can go to it now. Changes nothing.
///
/// # Errors
/// 3006 (not the device the model pins), 2001 (absent, a bridge), 3003 (bound for another VM),
/// 3005 (used by the host), 3004 (IOMMU group not viable, listing the blocking devices), 4001
/// when sysfs or netlink fail.
pub(super) async fn check_passthrough(mgr: &Manager, spec: &VmSpec) -> Result<Option<Assignment>, ApiError> {
    let wanted: Vec<Requested> = crate::validate::requested_devices_with_fields(spec, &mgr.config.hardware)
        .into_iter()
        .map(|(addr, field)| Requested::new(addr, field))
        .collect();
    if wanted.is_empty() {
        return Ok(None);
    }
    // First: whatever else is true of a device, it does not matter if it is the wrong one.
    check_identity(mgr, &wanted).await?;
    let usage = crate::host_usage::gather(mgr.net.netlink()).await.map_err(PassthroughError::HostUsage)?;
    // Devices bound for other VMs (what their records say), never this VM's own.
    let held: BTreeMap<_, _> = mgr
        .lock()
        .vms
        .values()
        .filter(|r| r.spec.name != spec.name)
        .flat_map(|r| r.vfio.iter().map(move |b| (b.address, r.spec.name.clone())))
        .collect();
    let pci = mgr.pci.clone();
    let addresses: Vec<_> = wanted.iter().map(|r| r.address).collect();
    let devices = tokio::task::spawn_blocking(move || pci.devices_with_groups(&addresses))
        .await
        .map_err(PassthroughError::task(PassthroughStep::Read))?
        .map_err(PassthroughError::pci(PassthroughStep::Read))?;
    Ok(Some(check::check(&wanted, &devices, &usage, &held)?))
}

/// Checks that every requested device whose model entry pins an identity is that device. Runs
/// first in [`check_passthrough`], so on every start before any bind (nothing is bound when it
/// refuses). A device a VM's record has on vfio-pci (this VM's, in a reconfigure of it while
/// it runs; another VM's, which the 3003 check refuses next) is judged without its MAC, which
/// it has no interface to show: it was judged before it was bound. An absent device is left to
/// the 2001 check.
///
/// # Errors
/// 3006 listing every mismatch; 4001 (step `vfio.identity`) when sysfs cannot be read.
async fn check_identity(mgr: &Manager, wanted: &[Requested]) -> Result<(), ApiError> {
    let model = &mgr.config.hardware.model;
    if model.pinned().next().is_none() {
        return Ok(());
    }
    let holders = vfio_holders(mgr);
    let pinned: Vec<PinnedDevice> = wanted
        .iter()
        .filter_map(|r| {
            let (class, index, _, identity) = model.pinned().find(|(_, _, a, _)| *a == r.address)?;
            Some(PinnedDevice {
                class,
                index,
                address: r.address,
                identity,
                field: r.field.clone(),
                held_by: holders.get(&r.address).cloned(),
            })
        })
        .collect();
    let mismatches: Vec<_> = judge_devices(mgr, &pinned)
        .await?
        .into_iter()
        .filter_map(|j| match j {
            Judged::Mismatch(m) => Some(m),
            Judged::Matches | Judged::Absent => None,
        })
        .collect();
    if mismatches.is_empty() {
        Ok(())
    } else {
        Err(IdentityError::Mismatch(mismatches).into())
    }
}

/// Every pinned model entry judged against the device at its address, for `host.check`: a
/// device a VM's record has on vfio-pci is judged without its MAC ([`PinnedDevice::held_by`]).
///
/// # Errors
/// When sysfs cannot be read.
pub(crate) async fn judge_model(mgr: &Manager) -> Result<Vec<(PinnedDevice, Judged)>, PassthroughError> {
    let holders = vfio_holders(mgr);
    let pinned: Vec<PinnedDevice> = mgr
        .config
        .hardware
        .model
        .pinned()
        .map(|(class, index, address, identity)| PinnedDevice {
            class,
            index,
            address,
            identity,
            field: format!("hardware.{class}.{index}"),
            held_by: holders.get(&address).cloned(),
        })
        .collect();
    let judged = judge_devices(mgr, &pinned).await?;
    Ok(pinned.into_iter().zip(judged).collect())
}

/// The VM whose record has each device on vfio-pci.
fn vfio_holders(mgr: &Manager) -> BTreeMap<PciAddress, String> {
    mgr.lock().vms.values().flat_map(|r| r.vfio.iter().map(move |b| (b.address, r.spec.name.clone()))).collect()
}

/// Reads `pinned`'s devices (sysfs, on the blocking pool) and judges each: the MAC is each
/// network interface's permanent address as the net owner's netlink reports it
/// (`IFLA_PERM_ADDRESS`), else sysfs's address when sysfs says it is the permanent one.
async fn judge_devices(mgr: &Manager, pinned: &[PinnedDevice]) -> Result<Vec<Judged>, PassthroughError> {
    let pci = mgr.pci.clone();
    let addresses: Vec<PciAddress> = pinned.iter().map(|p| p.address).collect();
    let readings = tokio::task::spawn_blocking(move || {
        addresses.iter().map(|&a| identity::read(&pci, a)).collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(PassthroughError::task(PassthroughStep::Identity))?
    .map_err(PassthroughError::pci(PassthroughStep::Identity))?;
    let mut out = Vec::with_capacity(pinned.len());
    for (p, reading) in pinned.iter().zip(&readings) {
        let mut permanent = BTreeMap::new();
        if let (Some(reading), true) = (reading, p.expected().mac.is_some()) {
            for n in &reading.netdevs {
                match mgr.net.netlink().permanent_address(&n.name).await {
                    Ok(Some(mac)) => {
                        permanent.insert(n.name.clone(), mac);
                    }
                    Ok(None) => {}
                    // Not fatal: sysfs's permanent address still counts, and without one the
                    // MAC is unknown, which refuses the device.
                    Err(e) => tracing::warn!(device = %p.address, interface = %n.name, error = %e,
                        "cannot read the permanent address over netlink"),
                }
            }
        }
        out.push(identity::judge_pinned(p, reading.as_ref(), &permanent));
    }
    Ok(out)
}

/// RLIMIT_MEMLOCK QEMU needs: VFIO pins all guest RAM (plus room for QEMU's own buffers).
pub(super) fn memlock_for(mgr: &Manager, spec: &VmSpec) -> Option<u64> {
    (!requested_devices(spec, &mgr.config.hardware).is_empty())
        .then(|| (spec.memory_mib + 1024).saturating_mul(1024 * 1024))
}

impl HeldVm {
    /// Gives the VM's devices back to their original drivers. Clears the record's bindings on
    /// success; keeps them (for a later retry) on failure. The host side's last step
    /// ([`super::teardown`]: an operation, the exit cleanup, recovery finishing a destroy);
    /// recovery, and a failed launch's unwind, also call it alone once no QEMU holds them.
    ///
    /// # Errors
    /// 4001 listing every device that could not be restored.
    pub(super) async fn release_passthrough(&self) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr(), self.name());
        let bindings: Vec<Binding> = match self.record() {
            Ok(r) => r.vfio,
            Err(_) => return Ok(()),
        };
        if bindings.is_empty() {
            return Ok(());
        }
        // The nodes first: once the drivers are back the kernel may remove them (nothing left to
        // put back then), or keep them for another device of the group still on vfio-pci.
        for node in nodes_to_revert(&bindings) {
            match spawn::vfio_node(node.group, node.gid, node.mode & VFIO_NODE_MODES).await {
                Ok(_) => tracing::debug!(vm = name, group = node.group, "VFIO group node put back"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                // Not a reason to keep the devices from their drivers: the node is left as it
                // is, and said so.
                Err(e) => {
                    tracing::error!(vm = name, group = node.group, error = %e, "cannot put a VFIO group node back; left as it is");
                }
            }
        }
        let pci = mgr.pci.clone();
        let count = bindings.len();
        let started = std::time::Instant::now();
        let after_each = numbered_crashpoint("vfio:released", mgr.config.paths.run.clone());
        let released = tokio::task::spawn_blocking(move || bind::release(&pci, &bindings, BIND_TIMEOUT, after_each))
            .await
            .map_err(PassthroughError::task(PassthroughStep::Release))?;
        match released {
            Ok(()) => {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                tracing::info!(vm = %name, devices = count, elapsed_ms = ms, "vfio released");
                self.update("vfio released", |r| r.vfio.clear())?;
                Ok(())
            }
            Err(e) => {
                tracing::error!(vm = name, error = %e, "cannot give passthrough devices back");
                Err(ApiError::from(&e))
            }
        }
    }
}

impl VmOp {
    /// Re-checks and binds the VM's devices to vfio-pci, recording the original drivers first.
    ///
    /// # Errors
    /// As [`check_passthrough`], and 4001 when binding fails (every device already
    /// changed is restored; if a restore fails too, the record keeps the bindings for a retry).
    pub(super) async fn bind_passthrough(&self, spec: &VmSpec) -> Result<(), ApiError> {
        let mgr = self.mgr();
        let Some(assignment) = check_passthrough(mgr, spec).await? else { return Ok(()) };
        if !mgr.pci.vfio_pci_present() {
            let loaded = tokio::task::spawn_blocking(crate::pci::load_vfio_pci)
                .await
                .map_err(PassthroughError::task(PassthroughStep::Modprobe))?;
            loaded.map_err(PassthroughError::pci(PassthroughStep::Modprobe))?;
        }
        let pci = mgr.pci.clone();
        let planned = tokio::task::spawn_blocking(move || bind::plan_bindings(&pci, &assignment))
            .await
            .map_err(PassthroughError::task(PassthroughStep::Plan))?
            .map_err(PassthroughError::pci(PassthroughStep::Plan))?;
        // Intent first: after a crash from here on, recovery knows what to give back.
        let record = planned.clone();
        self.update("vfio intent", |r| r.vfio = record)?;
        let pci = mgr.pci.clone();
        let to_bind = planned.clone();
        let started = std::time::Instant::now();
        let after_each = numbered_crashpoint("vfio:bound", mgr.config.paths.run.clone());
        let bound = tokio::task::spawn_blocking(move || bind::bind_vfio(&pci, &to_bind, BIND_TIMEOUT, after_each))
            .await
            .map_err(PassthroughError::task(PassthroughStep::Bind))?;
        match bound {
            Ok(()) => {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                tracing::info!(vm = %spec.name, devices = planned.len(), elapsed_ms = ms, "vfio bound");
                Ok(())
            }
            Err(e) => {
                let err = ApiError::from(&e);
                let restored_all = match &e {
                    bind::BindError::Bind { restore_failures, .. } => restore_failures.is_empty(),
                    _ => false,
                };
                if restored_all {
                    let _ = self.update("vfio restored", |r| r.vfio.clear());
                }
                Err(err)
            }
        }
    }

    /// Lets QEMU's user open the VFIO group nodes of the VM's bound devices: group
    /// `qemu.user`'s, mode 0660, changed by the spawner (the daemon's seccomp table has no
    /// path-based chmod or chown). Each node's group and mode before are recorded in the VM's
    /// bindings first, so release (even after a crash) puts them back. A node that does not
    /// exist is left to QEMU to report.
    ///
    /// # Errors
    /// 4001 with step `vfio_access` when a node's group or mode cannot be changed or recorded.
    pub(super) async fn hand_vfio_groups_to_qemu(&self) -> Result<(), ApiError> {
        use std::os::unix::fs::MetadataExt;
        let (mgr, name) = (self.mgr(), self.name());
        let Some(user) = mgr.config.qemu_user.filter(|u| u.uid != 0) else { return Ok(()) };
        let bindings = self.record()?.vfio;
        let groups: Vec<(PciAddress, u32)> =
            bindings.iter().filter_map(|b| Some((b.address, mgr.pci.iommu_group(b.address).ok()??))).collect();
        let unique: std::collections::BTreeSet<u32> = groups.iter().map(|(_, g)| *g).collect();
        for g in unique {
            let node = bind::vfio_group_dev(g);
            // Intent first; a node already recorded (a launch that crashed after handing it
            // over) keeps its first record, not the handed-over state.
            if !bindings.iter().any(|b| b.node_before.is_some_and(|n| n.group == g)) {
                let before = match std::fs::symlink_metadata(&node) {
                    Ok(meta) => NodeAccess { group: g, gid: meta.gid(), mode: meta.mode() & 0o7777 },
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        tracing::warn!(vm = name, node = %node.display(), "no VFIO group device node");
                        continue;
                    }
                    Err(e) => return Err(access_error(&node, e)),
                };
                let groups = groups.clone();
                self.update("vfio node intent", move |r| record_node_before(&mut r.vfio, &groups, before))?;
            }
            match spawn::vfio_node(g, user.gid, VFIO_NODE_MODES).await {
                Ok(_) => tracing::debug!(vm = name, node = %node.display(), "VFIO group handed to QEMU's group"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    tracing::warn!(vm = name, node = %node.display(), "no VFIO group device node");
                }
                Err(e) => return Err(access_error(&node, e)),
            }
        }
        Ok(())
    }
}

fn access_error(node: &std::path::Path, source: std::io::Error) -> ApiError {
    PassthroughError::Access { node: node.to_path_buf(), source }.into()
}

/// Records `before` on every binding in its group (`groups` maps devices to groups) that has
/// no record of its node yet.
fn record_node_before(bindings: &mut [Binding], groups: &[(PciAddress, u32)], before: NodeAccess) {
    for b in bindings.iter_mut().filter(|b| b.node_before.is_none()) {
        if groups.iter().any(|(a, g)| *a == b.address && *g == before.group) {
            b.node_before = Some(before);
        }
    }
}

/// The nodes to put back on release: one per group, as first recorded.
fn nodes_to_revert(bindings: &[Binding]) -> Vec<NodeAccess> {
    let mut out: Vec<NodeAccess> = Vec::new();
    for n in bindings.iter().filter_map(|b| b.node_before) {
        if !out.iter().any(|o| o.group == n.group) {
            out.push(n);
        }
    }
    out
}

/// The hook for [`bind::bind_vfio`] and [`bind::release`]: the crash point `STEP:N` after the
/// Nth device. A crash between two devices leaves some changed and some not: the fault tests
/// need that state, which no step boundary of the lifecycle shows.
fn numbered_crashpoint(step: &'static str, run: std::path::PathBuf) -> impl FnMut(&Binding) {
    let mut n = 0;
    move |_| {
        n += 1;
        crate::crashpoint::hit(&run, &format!("{step}:{n}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(addr: &str) -> Binding {
        Binding { address: PciAddress::parse(addr).unwrap(), original_driver: Some("e1000e".into()), node_before: None }
    }

    #[test]
    fn node_records_are_kept_once_per_group_and_reverted_once() {
        let mut b = vec![binding("0000:00:05.0"), binding("0000:00:05.1"), binding("0000:00:06.0")];
        let groups: Vec<(PciAddress, u32)> = vec![(b[0].address, 3), (b[1].address, 3), (b[2].address, 4)];
        let first = NodeAccess { group: 3, gid: 0, mode: 0o600 };
        record_node_before(&mut b, &groups, first);
        assert_eq!(b[0].node_before, Some(first));
        assert_eq!(b[1].node_before, Some(first));
        assert_eq!(b[2].node_before, None);
        // A second record (after a crash, the node already handed over) does not overwrite.
        record_node_before(&mut b, &groups, NodeAccess { group: 3, gid: 999, mode: 0o660 });
        assert_eq!(b[0].node_before, Some(first));
        let other = NodeAccess { group: 4, gid: 10, mode: 0o640 };
        record_node_before(&mut b, &groups, other);
        assert_eq!(nodes_to_revert(&b), vec![first, other]);
        // Records written before this field existed read as nothing to put back.
        let old: Binding = serde_json::from_str(r#"{"address":"0000:00:05.0","original_driver":null}"#).unwrap();
        assert_eq!(nodes_to_revert(&[old]), vec![]);
    }
}
