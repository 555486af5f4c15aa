//! Convergence planning: what must happen to turn the current VMs into the desired ones.
//!
//! [`spec_drift`] compares two specs field by field (`vm.apply`'s 2002); [`plan_reconcile`] turns
//! a desired set into one [`PlanEntry`] per VM and validates the set as a whole by admitting it
//! into a simulated host in a fixed order: VMs that stay as they are first, then the ones to
//! create or replace, in request order. Both are pure; the lifecycle executes the plan.

use crate::api::{ApiError, PlanAction, PlanEntry, VmSpec, VmStatus};
use crate::capacity::{admit, Holding};
use crate::config::Config;
use crate::nic::{NicAlloc, NicHolding};
use crate::validate::validate_spec;
use serde_json::Value;
use std::collections::{BTreeMap, HashSet};

/// A VM as the planner sees it.
#[derive(Debug, Clone)]
pub struct CurrentVm {
    /// Its recorded spec.
    pub spec: VmSpec,
    /// Its observed status.
    pub status: VmStatus,
}

/// Dotted paths of the fields that differ between two specs, ignoring `state` (a state change is
/// a start or stop, not drift) and `guest_interfaces` (applied live by the guest agent).
pub fn spec_drift(current: &VmSpec, desired: &VmSpec) -> Vec<String> {
    let mut a = serde_json::to_value(current).unwrap_or(Value::Null);
    let mut b = serde_json::to_value(desired).unwrap_or(Value::Null);
    for v in [&mut a, &mut b] {
        if let Some(o) = v.as_object_mut() {
            o.remove("state");
            o.remove("guest_interfaces");
        }
    }
    let mut out = Vec::new();
    diff_values("", &a, &b, &mut out);
    out
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

/// The MACs a spec fixes, as allocations (tap names do not matter for a simulation).
fn declared_macs(spec: &VmSpec) -> Vec<NicAlloc> {
    spec.nics.iter().filter_map(|n| n.mac.clone()).map(|mac| NicAlloc { mac, tap: String::new() }).collect()
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
) -> Vec<PlanEntry> {
    let mut entries: Vec<PlanEntry> = Vec::new();
    let mut seen = HashSet::new();
    for spec in desired {
        let (action, reason) = match current.get(&spec.name) {
            None => (PlanAction::Create, "not defined on this host".to_string()),
            Some(cur) => {
                let drift = spec_drift(&cur.spec, spec);
                if !drift.is_empty() {
                    (PlanAction::Replace, format!("spec differs: {}", drift.join(", ")))
                } else {
                    match (spec.state, is_up(cur.status)) {
                        (crate::api::DesiredState::Running, false) => {
                            (PlanAction::Start, format!("desired running, is {}", cur.status))
                        }
                        (crate::api::DesiredState::Stopped, _) if stop_changes(cur) => {
                            (PlanAction::Stop, format!("desired stopped, is {}", cur.status))
                        }
                        _ if cur.spec.guest_interfaces != spec.guest_interfaces => {
                            (PlanAction::None, "guest interfaces differ (applied live by the agent)".to_string())
                        }
                        _ => (PlanAction::None, format!("up to date ({})", cur.status)),
                    }
                }
            }
        };
        let error = if !seen.insert(spec.name.clone()) {
            Some(ApiError::invalid("vms", format!("VM {:?} is listed twice", spec.name)).to_json())
        } else {
            validate_spec(spec, config).err().map(|e| e.to_json())
        };
        entries.push(PlanEntry { vm: spec.name.clone(), action, reason, error });
    }
    for name in current.keys().filter(|n| !seen.contains(*n)) {
        let (action, reason) = if prune {
            (PlanAction::Destroy, "not in the desired set (prune)".to_string())
        } else {
            (PlanAction::None, "not in the desired set; kept (prune is off)".to_string())
        };
        entries.push(PlanEntry { vm: name.clone(), action, reason, error: None });
    }

    // Admit the final set into a simulated host: the kept VMs, then the desired VMs that keep
    // their spec, then creates and replaces in request order. NIC conflicts are checked on the
    // addresses and fixed MACs the specs declare.
    let kept: Vec<&VmSpec> =
        current.iter().filter(|(n, _)| !seen.contains(*n) && !prune).map(|(_, c)| &c.spec).collect();
    let desired_by_name: BTreeMap<&str, &VmSpec> = desired.iter().map(|s| (s.name.as_str(), s)).collect();
    let mut admitted: Vec<&VmSpec> = kept;
    for pass_changes in [false, true] {
        for entry in entries.iter_mut() {
            let changes = matches!(entry.action, PlanAction::Create | PlanAction::Replace);
            if changes != pass_changes || entry.error.is_some() || entry.action == PlanAction::Destroy {
                continue;
            }
            let Some(spec) = desired_by_name.get(entry.vm.as_str()) else { continue };
            let holdings: Vec<Holding<'_>> = admitted.iter().map(|s| Holding { name: &s.name, spec: s }).collect();
            let fixed: Vec<Vec<NicAlloc>> = admitted.iter().map(|s| declared_macs(s)).collect();
            let nic_holdings: Vec<NicHolding<'_>> =
                admitted.iter().zip(&fixed).map(|(s, a)| NicHolding { vm: &s.name, spec: s, allocs: a }).collect();
            let verdict = admit(&config.hardware, &holdings, spec)
                .and_then(|()| crate::nic::allocate(spec, config, &nic_holdings, &[]).map(|_| ()));
            match verdict {
                Ok(()) => admitted.push(spec),
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
        specs.iter().map(|(s, st)| (s.name.clone(), CurrentVm { spec: s.clone(), status: *st })).collect()
    }

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
        let p = plan_reconcile(&c, &desired, &current, false);
        assert_eq!(
            actions(&p),
            vec![
                ("new".into(), PlanAction::Create, None),
                ("same".into(), PlanAction::None, None),
                ("stopped".into(), PlanAction::Start, None),
                ("tostop".into(), PlanAction::Stop, None),
                ("dead".into(), PlanAction::Start, None),
                // Seven 1-CPU VMs on 6 allocatable CPUs: the replace is admitted last and refused.
                ("changed".into(), PlanAction::Replace, Some(3002)),
                ("extra".into(), PlanAction::None, None),
            ]
        );
        assert!(p[5].reason.contains("memory_mib"), "{}", p[5].reason);
        let p = plan_reconcile(&c, &desired, &current, true);
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
        let p = plan_reconcile(&c, &desired, &current, false);
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
        let p = plan_reconcile(&c, &[a, b, d, e, bad], &BTreeMap::new(), false);
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
        let p = plan_reconcile(&c, &[new.clone(), old.clone()], &current, false);
        assert_eq!(actions(&p)[0], ("new".into(), PlanAction::Create, Some(3002)));
        assert_eq!(actions(&p)[1], ("old".into(), PlanAction::None, None));
        // With prune, "kept" is destroyed and its CPU frees room for "new" (1 + 4 + 1 = 6).
        new.cpu = 1;
        let p = plan_reconcile(&c, &[new, old], &current, true);
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
        let p = plan_reconcile(&c, &[spec("a"), spec("a"), spec("B")], &BTreeMap::new(), false);
        assert_eq!(p[0].error, None);
        assert_eq!(p[1].error.as_ref().unwrap()["code"], 2001);
        assert_eq!(p[2].error.as_ref().unwrap()["data"]["field"], "spec.name");
    }

    #[test]
    fn address_conflicts_across_the_set_are_found() {
        let c = crate::config::Config::parse(
            "[hardware]\ncpu = 8\nmemory_gib = 16\n[networks.lan]\nbridge = \"br0\"\nsubnet = \"10.0.0.0/24\"\n",
            std::path::Path::new("t.toml"),
        )
        .unwrap();
        let nic = crate::validate::tests::static_nic("lan", "10.0.0.5/24");
        let mut a = spec("a");
        a.nics = vec![nic.clone()];
        let mut b = spec("b");
        b.nics = vec![nic];
        let p = plan_reconcile(&c, &[a, b], &BTreeMap::new(), false);
        assert_eq!(actions(&p)[1], ("b".into(), PlanAction::Create, Some(3003)));
        assert_eq!(p[0].error, None);
    }

    #[test]
    fn replace_may_reuse_its_own_hardware() {
        let c = config();
        let mut a = spec("a");
        a.hardware.sfp = vec![5];
        let current = cur(&[(a.clone(), VmStatus::Running)]);
        let mut a2 = a.clone();
        a2.cpu = 2;
        let p = plan_reconcile(&c, &[a2], &current, false);
        assert_eq!(actions(&p), vec![("a".into(), PlanAction::Replace, None)]);
    }
}
