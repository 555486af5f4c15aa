//! A VM's placement through its life: which host CPUs and NUMA nodes its QEMU uses
//! (docs/lifecycle.md, "Placement"; the decision itself is [`crate::placement::allocate`]).
//!
//! Order of use:
//!
//! 1. [`HeldVm::mark_start`]: the write that marks a start (`creating` or `starting`) also
//!    decides and records the placement, under the table lock every such decision takes, so two
//!    starts never take the same CPU or hugepages. Intent before the host: a crash after it and
//!    before QEMU runs leaves a placement that recovery releases (no QEMU holds it). A dedicated
//!    placement shrinks the shared pool: [`repin_shared`] follows.
//! 2. The launch spawns QEMU on [`spawn_affinity`] (the spawner sets it before the exec), so
//!    every thread starts on the VM's emulator (dedicated) or shared CPUs.
//! 3. [`HeldVm::pin_vcpus`] once QMP greets: each vCPU thread of a dedicated VM on its CPU.
//! 4. [`HeldVm::release_placement`] beside the release of taps and devices once no QEMU runs
//!    (teardown); a released dedicated placement grows the shared pool: [`repin_shared`].
//! 5. Recovery: [`HeldVm::check_pins`] compares every thread of a re-adopted QEMU with the
//!    record and re-pins what differs; a VM whose QEMU is gone releases its placement.

use super::held::HeldVm;
use super::registry::Change;
use super::Manager;
use crate::api::{ApiError, CpuPolicy, NumaPolicy, VmSpec, VmStatus};
use crate::placement::{allocate, pin, CpuSet, Held, Placement, Request};
use crate::qemu::qmp::Qmp;
use crate::state::VmRecord;
use std::time::Duration;

/// How long QMP may take to name the vCPU threads.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether a start of `spec` needs a placement decision at all: with no `vm_cpus`, a shared
/// VM without NUMA or hugepage wishes runs as before (no placement, no topology read).
fn wants_placement(mgr: &Manager, spec: &VmSpec) -> bool {
    mgr.config.hardware.vm_cpus.is_some()
        || spec.cpu_policy == CpuPolicy::Dedicated
        || spec.hugepages.is_some()
        || spec.numa_policy() != NumaPolicy::None
}

/// What every VM but `except` holds, from the table ([`super::topology::held`]).
fn holdings<'t>(vms: impl Iterator<Item = &'t VmRecord>, except: &str) -> Vec<Held<'t>> {
    super::topology::held(vms.filter(|r| r.spec.name != except))
}

/// Whether `spec` can be placed now, against what the other VMs hold, without recording
/// anything: a create or start refuses with the allocator's 3001/3002 before it changes
/// anything (the start's write decides again under the lock, [`HeldVm::mark_start`]).
///
/// # Errors
/// 3001/3002 from [`allocate::place`].
pub(super) fn check(mgr: &Manager, spec: &VmSpec) -> Result<(), ApiError> {
    if !wants_placement(mgr, spec) {
        return Ok(());
    }
    let topo = mgr.topology.now();
    let req = Request::of(spec, mgr.topology.device_nodes(spec, &mgr.config));
    let t = mgr.lock();
    let held = holdings(t.vms.values(), &spec.name);
    allocate::place(&topo, mgr.config.hardware.vm_cpus.as_ref(), &held, &req).map(drop)
}

/// The CPUs QEMU is spawned on: a dedicated VM's emulator CPUs (its vCPU threads move to
/// their own next), a shared VM's pool; empty (inherit the spawner's) without either.
pub(super) fn spawn_affinity(placement: Option<&Placement>) -> CpuSet {
    let Some(p) = placement else { return CpuSet::default() };
    match p.policy {
        CpuPolicy::Dedicated if !p.emulator.is_empty() => p.emulator.clone(),
        _ => p.cpus.clone(),
    }
}

/// The CPUs each thread should be on: vCPU `i` of a dedicated VM on `vcpus[i]` (a thread
/// serving several vCPUs, single-threaded TCG, on their union), every other thread on the
/// emulator CPUs (a shared VM's: its pool). `None` for a thread left alone (no set to use).
/// Pure.
pub fn wanted(placement: &Placement, vcpu: Option<u32>) -> Option<CpuSet> {
    if placement.policy == CpuPolicy::Dedicated {
        if let Some(cpu) = vcpu.and_then(|i| placement.vcpus.get(i as usize)) {
            return Some(CpuSet::from_cpus([*cpu]));
        }
        if !placement.emulator.is_empty() {
            return Some(placement.emulator.clone());
        }
    }
    (!placement.cpus.is_empty()).then(|| placement.cpus.clone())
}

/// Every thread of `pid` with the set it should be on (by its name, `CPU N/...` for vCPU N),
/// merged per thread id.
fn plan_threads(
    pid: i32,
    placement: &Placement,
    vcpu_threads: &[(u32, i32)],
) -> Result<Vec<(i32, CpuSet)>, pin::PinError> {
    let mut plan: std::collections::BTreeMap<i32, CpuSet> = std::collections::BTreeMap::new();
    for (index, tid) in vcpu_threads {
        if let Some(set) = wanted(placement, Some(*index)) {
            let merged = plan.get(tid).map_or_else(|| set.clone(), |s| s.union(&set));
            plan.insert(*tid, merged);
        }
    }
    for tid in pin::tasks(pid)? {
        if plan.contains_key(&tid) {
            continue;
        }
        let vcpu = pin::task_name(pid, tid).ok().as_deref().and_then(pin::vcpu_of_name);
        if let Some(set) = wanted(placement, vcpu) {
            plan.insert(tid, set);
        }
    }
    Ok(plan.into_iter().collect())
}

impl HeldVm {
    /// Moves the VM to status `to` with `change` and, in the same write, decides and records
    /// its placement ([`allocate::place`] against every other VM's, under the table lock).
    /// Replaces the start's plain status write.
    ///
    /// # Errors
    /// 3001/3002 from the allocator (nothing written); as [`HeldVm::update_status`].
    pub(super) fn mark_start(
        &self,
        reason: &str,
        to: VmStatus,
        spec: &VmSpec,
        change: impl FnOnce(&mut VmRecord),
    ) -> Result<VmRecord, ApiError> {
        let (mgr, name) = (self.mgr(), self.name());
        // Sysfs is read before the lock: the pools as they are now, the devices' nodes.
        let topo = wants_placement(mgr, spec).then(|| mgr.topology.now());
        let req = Request::of(spec, mgr.topology.device_nodes(spec, &mgr.config));
        let (_, new) = mgr.registry.write(name, reason, |t| {
            let Some(old) = t.vms.get(name) else { return Ok((Change::Keep, ())) };
            let mut rec = old.clone();
            rec.set_status(to)?;
            change(&mut rec);
            rec.placement = match &topo {
                Some(topo) => {
                    let held = holdings(t.vms.values(), name);
                    allocate::place(topo, mgr.config.hardware.vm_cpus.as_ref(), &held, &req)?
                }
                None => None,
            };
            Ok((Change::Put(Box::new(rec)), ()))
        })?;
        let new = new.ok_or_else(|| ApiError::not_found(name))?;
        if new.placement.as_ref().is_some_and(|p| p.policy == CpuPolicy::Dedicated) {
            repin_shared(mgr);
        }
        Ok(new)
    }

    /// Pins each vCPU thread of a dedicated VM's fresh QEMU `pid` to its CPU, as `query-cpus-fast`
    /// names them (every other thread is on the emulator CPUs since the spawn).
    ///
    /// # Errors
    /// 4001 step `placement` when QMP does not answer or a thread cannot be pinned.
    pub(super) async fn pin_vcpus(&self, pid: i32, qmp: &mut Qmp) -> Result<(), ApiError> {
        let Some(placement) = self.record()?.placement else { return Ok(()) };
        if placement.policy != CpuPolicy::Dedicated {
            return Ok(());
        }
        let timeout = qmp.timeout();
        qmp.set_timeout(QMP_TIMEOUT);
        let threads = qmp.vcpu_threads().await;
        qmp.set_timeout(timeout);
        let threads = threads.map_err(|e| super::provisioning("placement", format!("query-cpus-fast: {e}")))?;
        let vcpus: Vec<(u32, i32)> = threads.iter().map(|t| (t.index, t.thread_id)).collect();
        let plan = crate::blocking::run(|| plan_threads(pid, &placement, &vcpus))?;
        crate::blocking::run(|| pin::pin_threads(&plan))?;
        tracing::info!(vm = self.name(), vcpus = %placement.cpus, emulator = %placement.emulator, "vCPU threads pinned");
        Ok(())
    }

    /// Recovery of a re-adopted QEMU `pid`: each thread's CPUs compared with the record (vCPU
    /// threads by their names); a difference is logged and re-pinned, then read again.
    pub(super) fn check_pins(&self, pid: i32) {
        let name = self.name();
        let Some(placement) = self.record().ok().and_then(|r| r.placement) else { return };
        let plan = match crate::blocking::run(|| plan_threads(pid, &placement, &[])) {
            Ok(plan) => plan,
            Err(e) => {
                tracing::warn!(vm = name, error = %e, "cannot read the threads of a re-adopted QEMU");
                return;
            }
        };
        for (tid, want) in plan {
            let Ok(found) = pin::allowed(pid, tid) else { continue };
            if found == want {
                continue;
            }
            tracing::warn!(vm = name, tid, found = %found, recorded = %want, "a QEMU thread is not where the placement says; re-pinning");
            let again = pin::pin_threads(&[(tid, want.clone())]).and_then(|()| pin::allowed(pid, tid));
            match again {
                Ok(now) if now == want => {}
                Ok(now) => {
                    tracing::error!(vm = name, tid, now = %now, recorded = %want, "re-pinned thread reads back otherwise")
                }
                Err(e) => tracing::error!(vm = name, tid, error = %e, "cannot re-pin a QEMU thread"),
            }
        }
    }

    /// Forgets the VM's placement once no QEMU of it runs; a dedicated one's CPUs go back to
    /// the shared pool ([`repin_shared`]). Errors are logged: the record write is retried at
    /// the next release.
    pub(super) fn release_placement(&self) {
        let Ok(rec) = self.record() else { return };
        let Some(placement) = rec.placement else { return };
        if let Err(e) = self.update("placement released", |r| r.placement = None) {
            tracing::error!(vm = self.name(), error = %e, "cannot record the placement released");
            return;
        }
        if placement.policy == CpuPolicy::Dedicated {
            repin_shared(self.mgr());
        }
    }
}

/// Moves every running shared VM with a placement onto the shared pool as it is now (after a
/// dedicated placement was made or released): all its QEMU's tasks, and its record's CPUs.
/// Failures are logged: the VM runs on, on its old CPUs.
pub(super) fn repin_shared(mgr: &Manager) {
    let Some(vm_cpus) = mgr.config.hardware.vm_cpus.as_ref() else { return };
    let moves: Vec<(String, i32, CpuSet, CpuSet)> = {
        let t = mgr.lock();
        let held = holdings(t.vms.values(), "");
        let Some(pool) = allocate::shared_pool(Some(vm_cpus), &held) else { return };
        t.vms
            .values()
            .filter(|r| matches!(r.status, VmStatus::Running | VmStatus::Stopping))
            .filter_map(|r| {
                let p = r.placement.as_ref()?;
                let pid = r.process.as_ref()?.pid;
                if p.policy != CpuPolicy::Shared || p.cpus.is_empty() {
                    return None;
                }
                Some((r.spec.name.clone(), pid, p.cpus.clone(), pool.clone()))
            })
            .collect()
    };
    let topo = (!moves.is_empty()).then(|| mgr.topology.now());
    for (name, pid, old, pool) in moves {
        let nodes = mgr.record(&name).ok().and_then(|r| r.placement).map(|p| p.nodes).unwrap_or_default();
        let target = match (&topo, nodes.is_empty()) {
            (Some(topo), false) => {
                let on_nodes = topo
                    .nodes
                    .iter()
                    .filter(|n| nodes.contains(&n.id))
                    .fold(CpuSet::from_cpus([]), |acc, n| acc.union(&n.cpus));
                pool.intersection(&on_nodes)
            }
            _ => pool,
        };
        if target == old || target.is_empty() {
            continue;
        }
        match crate::blocking::run(|| pin::pin_process(pid, &target)) {
            Ok(()) => {
                tracing::info!(vm = %name, from = %old, to = %target, "shared VM moved to the new shared pool");
                let _ = mgr.update(&name, "shared pool changed", |r| {
                    if let Some(p) = r.placement.as_mut() {
                        if p.emulator == p.cpus {
                            p.emulator = target.clone();
                        }
                        p.cpus = target.clone();
                    }
                });
            }
            Err(e) => tracing::warn!(vm = %name, error = %e, "cannot move a shared VM to the new shared pool"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(policy: CpuPolicy, vcpus: Vec<u32>, cpus: &[u32], emulator: &[u32]) -> Placement {
        Placement {
            policy,
            vcpus,
            cpus: CpuSet::from_cpus(cpus.iter().copied()),
            emulator: CpuSet::from_cpus(emulator.iter().copied()),
            nodes: vec![],
            hugepages: None,
            hugepages_per_node: Default::default(),
            memory_mib: 256,
        }
    }

    #[test]
    fn each_thread_gets_the_set_of_its_kind() {
        let d = placement(CpuPolicy::Dedicated, vec![2, 3], &[2, 3, 4], &[4]);
        assert_eq!(wanted(&d, Some(0)), Some(CpuSet::from_cpus([2])));
        assert_eq!(wanted(&d, Some(1)), Some(CpuSet::from_cpus([3])));
        assert_eq!(wanted(&d, None), Some(CpuSet::from_cpus([4])));
        // A vCPU index beyond the placement (hot-added?) floats with the emulator threads.
        assert_eq!(wanted(&d, Some(7)), Some(CpuSet::from_cpus([4])));
        assert_eq!(spawn_affinity(Some(&d)), CpuSet::from_cpus([4]));
        // No emulator set (no housekeeping CPUs): the other threads on the VM's own CPUs.
        let bare = placement(CpuPolicy::Dedicated, vec![1], &[1], &[]);
        assert_eq!(wanted(&bare, None), Some(CpuSet::from_cpus([1])));
        assert_eq!(spawn_affinity(Some(&bare)), CpuSet::from_cpus([1]));
        let s = placement(CpuPolicy::Shared, vec![], &[1, 2], &[1, 2]);
        assert_eq!(wanted(&s, Some(0)), Some(CpuSet::from_cpus([1, 2])));
        assert_eq!(wanted(&s, None), Some(CpuSet::from_cpus([1, 2])));
        assert_eq!(spawn_affinity(Some(&s)), CpuSet::from_cpus([1, 2]));
        // Memory-only (no vm_cpus): nothing pinned.
        let m = placement(CpuPolicy::Shared, vec![], &[], &[]);
        assert_eq!(wanted(&m, None), None);
        assert!(spawn_affinity(Some(&m)).is_empty() && spawn_affinity(None).is_empty());
    }

    /// Under single-threaded TCG one thread serves every vCPU: it gets their union.
    #[test]
    fn a_thread_serving_several_vcpus_gets_their_union() {
        let d = placement(CpuPolicy::Dedicated, vec![2, 3], &[2, 3], &[0]);
        let pid = i32::try_from(std::process::id()).unwrap();
        let tid = nix::unistd::gettid().as_raw();
        let plan = plan_threads(pid, &d, &[(0, tid), (1, tid)]).unwrap();
        let mine = plan.iter().find(|(t, _)| *t == tid).map(|(_, s)| s.clone());
        assert_eq!(mine, Some(CpuSet::from_cpus([2, 3])));
        // Every other thread of this process is an "emulator" thread.
        assert!(plan.iter().filter(|(t, _)| *t != tid).all(|(_, s)| *s == CpuSet::from_cpus([0])));
    }
}
