//! `vm.stats` and `host.stats`: a snapshot of the records under the table lock, released before
//! anything is read ([`crate::stats::collect`] does the reading), so a stats call never holds
//! what a VM operation needs.

use super::Manager;
use crate::api::stats::{HostStats, StatsParams, VmStatsReport, VmTotals};
use crate::api::ApiError;
use crate::stats::collect::{self, Target};
use std::collections::BTreeMap;

/// `vm.stats`: the figures of one VM, or of every VM by name.
///
/// # Errors
/// 4040 when `name` names no VM. A part that cannot be read is reported in the VM's
/// `missing`, never as an error.
pub(crate) async fn vm_stats(mgr: &Manager, p: StatsParams) -> Result<VmStatsReport, ApiError> {
    let targets = stats_targets(mgr, p.name.as_deref())?;
    let (timestamp_ms, time) = crate::stats::now();
    let vms = collect::vms(targets, mgr.net.netlink(), &mgr.stats_monitors, p.name.is_none()).await;
    Ok(VmStatsReport { timestamp_ms, time, vms })
}

/// `host.stats`: the host's CPU and memory and the sum over the running VMs.
pub(crate) async fn host_stats(mgr: &Manager) -> HostStats {
    let report = match vm_stats(mgr, StatsParams::default()).await {
        Ok(r) => r,
        // Without a name there is nothing to be missing.
        Err(_) => VmStatsReport { timestamp_ms: 0, time: String::new(), vms: Vec::new() },
    };
    let (cpu, memory) = crate::stats::procfs::host(crate::stats::procfs::Ticks::system());
    let mut missing = BTreeMap::new();
    if let Err(e) = &cpu {
        missing.insert("cpu".to_string(), e.clone());
    }
    if let Err(e) = &memory {
        missing.insert("memory".to_string(), e.clone());
    }
    let (timestamp_ms, time) = crate::stats::now();
    HostStats { timestamp_ms, time, cpu: cpu.ok(), memory: memory.ok(), vms: VmTotals::of(&report.vms), missing }
}

/// What the collector needs, copied out under the lock (nothing else happens under it).
fn stats_targets(mgr: &Manager, name: Option<&str>) -> Result<Vec<Target>, ApiError> {
    let t = mgr.lock();
    let records: Vec<_> = match name {
        Some(n) => vec![t.vms.get(n).ok_or_else(|| ApiError::not_found(n))?],
        None => t.vms.values().collect(),
    };
    Ok(records
        .into_iter()
        .map(|r| {
            // The live QEMU's memory: a change waiting for a restart is not in it yet.
            let live = r.running_spec.as_ref().unwrap_or(&r.spec);
            Target {
                name: r.spec.name.clone(),
                status: r.status,
                process: r.process.clone(),
                qmp_stats: mgr.paths(r.name()).qmp_stats,
                nics: r.nics.iter().map(|n| (n.mac.clone(), n.tap.clone())).collect(),
                restarts: r.restarts,
                memory_mib: live.memory_mib,
            }
        })
        .collect())
}
