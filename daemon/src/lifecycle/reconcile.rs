//! `host.reconcile`: converge the host to a whole desired set of VMs.
//!
//! The plan comes from [`crate::plan::plan_reconcile`] (pure). Execution frees resources before
//! taking new ones (destroy, stop, reconfigure, replace, create, start) and runs every entry on its own: one
//! failing VM is reported in its result and the others go on.

use super::Manager;
use crate::api::{
    ApiError, ApplyParams, Mutation, PlanAction, PlanEntry, ReconcileParams, ReconcileReport, ReconcileResult,
    StopParams, VmSpec,
};
use crate::plan::{plan_reconcile, CurrentVm};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Plans (and unless `dry_run`, executes) a reconcile.
pub(crate) async fn reconcile(mgr: &Arc<Manager>, p: ReconcileParams) -> Result<ReconcileReport, ApiError> {
    // Before anything runs: an invalid timeout would otherwise fail every stop and apply
    // after the destroys and creates were done.
    super::ops::check_stop_timeout_s(p.timeout_s)?;
    Ok(plan_and_run(mgr, p).await)
}

async fn plan_and_run(mgr: &Arc<Manager>, p: ReconcileParams) -> ReconcileReport {
    let current: BTreeMap<String, CurrentVm> = mgr.current_vms();
    let mut plan = plan_reconcile(&mgr.config, &p.vms, &current, p.prune, p.replace);
    let specs: BTreeMap<&str, &VmSpec> = p.vms.iter().map(|s| (s.name.as_str(), s)).collect();
    // The plan is pure; the files a spec names are checked here, so a dry run also shows a
    // missing image or kernel.
    for entry in plan.iter_mut().filter(|e| e.error.is_none()) {
        if !matches!(
            entry.action,
            PlanAction::Create | PlanAction::Replace | PlanAction::Reconfigure | PlanAction::Start
        ) {
            continue;
        }
        let Some(spec) = specs.get(entry.vm.as_str()) else { continue };
        if let Ok(vm) = crate::validate::validate_spec(spec, &mgr.config) {
            if let Err(e) = super::launch::check_launch_files(mgr, &vm).await {
                entry.error = Some(e.to_json());
            }
        }
    }
    if p.dry_run {
        // Where each VM the run would start goes, next to what the VMs before it hold.
        let topo = mgr.topology.now();
        let device_nodes = |spec: &VmSpec| mgr.topology.device_nodes(spec, &mgr.config);
        crate::plan::place_entries(
            &mut plan,
            &p.vms,
            &current,
            &topo,
            mgr.config.hardware.vm_cpus.as_ref(),
            &device_nodes,
        );
        let ok = plan.iter().all(|e| e.error.is_none());
        return ReconcileReport { dry_run: true, plan, results: Vec::new(), ok };
    }
    let mut indexed: Vec<(usize, &PlanEntry)> = plan.iter().enumerate().collect();
    indexed.sort_by_key(|(i, e)| (crate::plan::run_order(e.action), *i));
    let mut results: Vec<(usize, ReconcileResult)> = Vec::new();
    for (i, entry) in indexed {
        let outcome = match &entry.error {
            Some(err) => Err(ApiError::from_json(err)),
            None => run_entry(mgr, entry, specs.get(entry.vm.as_str()).copied(), p.timeout_s).await,
        };
        let result = match outcome {
            Ok(changed) => {
                ReconcileResult { vm: entry.vm.clone(), action: entry.action, ok: true, changed, error: None }
            }
            Err(e) => {
                tracing::warn!(vm = %entry.vm, action = ?entry.action, error = %e, "reconcile entry failed");
                ReconcileResult {
                    vm: entry.vm.clone(),
                    action: entry.action,
                    ok: false,
                    changed: false,
                    error: Some(e.to_json()),
                }
            }
        };
        results.push((i, result));
    }
    results.sort_by_key(|(i, _)| *i);
    let results: Vec<ReconcileResult> = results.into_iter().map(|(_, r)| r).collect();
    let ok = results.iter().all(|r| r.ok);
    ReconcileReport { dry_run: false, plan, results, ok }
}

async fn run_entry(
    mgr: &Arc<Manager>,
    entry: &PlanEntry,
    spec: Option<&VmSpec>,
    timeout_s: u64,
) -> Result<bool, ApiError> {
    let need_spec = || spec.cloned().ok_or_else(|| ApiError::internal("plan entry without a spec"));
    let m: Mutation = match (entry.action, spec) {
        // A desired VM that keeps its spec: vm.apply converges its run state and its guest
        // interfaces (which are applied live, not a replace).
        (PlanAction::None | PlanAction::Start | PlanAction::Stop, Some(spec)) => {
            super::ops::apply(mgr, apply_params(spec.clone(), false, timeout_s)).await?
        }
        (PlanAction::None, None) => return Ok(false),
        (PlanAction::Destroy, _) => super::ops::destroy(mgr, &entry.vm).await?,
        (PlanAction::Stop, None) => {
            let p = StopParams { name: entry.vm.clone(), timeout_s, force: false, method: Default::default() };
            super::ops::stop(mgr, p, super::housekeeping::own_uid()).await?
        }
        (PlanAction::Start, None) => super::ops::start(mgr, &entry.vm).await?,
        (PlanAction::Create, _) => super::ops::create(mgr, need_spec()?).await?,
        // In place, the disk kept; restarted when needed, like vm.apply's default.
        (PlanAction::Reconfigure, _) => super::ops::apply(mgr, apply_params(need_spec()?, false, timeout_s)).await?,
        // Planned only with `replace: true` (else the entry carries a 2002 and never runs).
        (PlanAction::Replace, _) => super::ops::apply(mgr, apply_params(need_spec()?, true, timeout_s)).await?,
    };
    Ok(m.changed)
}

/// `vm.apply`'s params for a reconcile entry: restart when needed, the request's stop timeout.
fn apply_params(spec: VmSpec, replace: bool, timeout_s: u64) -> ApplyParams {
    ApplyParams { spec, replace, restart: true, timeout_s }
}
