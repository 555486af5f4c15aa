//! Monitor NICs through a VM's life: which mirrors every live VM should have, and when the
//! capture owner ([`crate::net::capture::Capture`], one per manager) makes the host match.
//!
//! Order of use:
//!
//! 1. [`check_sources`] at create, start and replace, next to the passthrough checks, before
//!    anything is recorded: every monitor NIC's source exists now (3001 naming
//!    `spec.nics[i].source`) and no VM passes through a device a monitored source depends on
//!    (3003, [`crate::capacity::check_capture_devices`] with what [`crate::net::backing`] read).
//! 2. The launch syncs after the taps (`VmOp::attach_capture` in `launch.rs`, with its undo
//!    entry and the crash point `launch:capture`); [`start_failure`] turns this VM's monitor
//!    states into the start's error.
//! 3. [`sync_without`] once a VM's QEMU is gone (the release every stop, exit, destroy and failed
//!    launch takes, [`super::teardown`]), so its mirrors go.
//! 4. [`sync`] at daemon start after recovery (stale filters of any boot are removed) and from
//!    [`spawn_watcher`], whenever links change while something is monitored.
//!
//! [`desired`] is computed from the registry each time: the records are the truth, so no list
//! of monitors can drift from them. Each sync compares every monitor's state with the previous
//! sync's and publishes an event for a change ([`publish_changes`]): a source lost, back, failing.

use super::Manager;
use crate::api::{
    ApiError, CaptureChange, CaptureInfo, CaptureMonitorInfo, CheckItem, CheckStatus, Code, VmSpec, VmStatus,
};
use crate::capacity::{Holding, SourceDevices};
use crate::net::capture::{Monitor, MonitorState, SyncReport};
use crate::state::VmRecord;
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How long the watcher waits for more link changes before one sync: a bond or a VLAN
/// coming up is a burst of messages.
const DEBOUNCE: Duration = Duration::from_millis(200);

/// Each monitor's state after the last sync, by (VM, NIC index): what events are diffed against.
pub(super) type States = BTreeMap<(String, usize), MonitorState>;

/// Whether a VM in `status` may have a QEMU whose taps want mirrors.
fn is_live(status: VmStatus) -> bool {
    matches!(status, VmStatus::Creating | VmStatus::Starting | VmStatus::Running | VmStatus::Stopping)
}

/// Whether the record's spec, or the spec its QEMU runs, has a monitor NIC.
pub(super) fn has_monitors(rec: &VmRecord) -> bool {
    rec.spec.monitor_nics().next().is_some()
        || rec.running_spec.as_ref().is_some_and(|s| s.monitor_nics().next().is_some())
}

/// The monitors of one record: the spec its QEMU runs (a change waiting for a restart does
/// not move a mirror, even one that re-allocated the record's NICs for a shorter list), each
/// NIC's tap named from the VM's tap stem ([`crate::nic::tap_for`]).
fn monitors_of(rec: &VmRecord) -> Vec<Monitor> {
    let spec = rec.running_spec.as_ref().unwrap_or(&rec.spec);
    spec.monitor_nics()
        .filter_map(|(i, source, direction)| {
            let tap = crate::nic::tap_for(&rec.nics, i)?;
            Some(Monitor { vm: rec.spec.name.clone(), nic: i, source: source.to_string(), tap, direction })
        })
        .collect()
}

/// The 3001 of a monitor NIC whose source the host does not have now.
fn source_absent(nic: usize, source: &str) -> ApiError {
    ApiError::new(Code::NotInModel, format!("no interface {source:?} on the host"))
        .field(format!("spec.nics[{nic}].source"))
}

/// Every monitor every live VM (but `except`) should have now, from the registry.
pub(super) fn desired(mgr: &Manager, except: Option<&str>) -> Vec<Monitor> {
    let t = mgr.lock();
    t.vms.values().filter(|r| is_live(r.status) && Some(r.spec.name.as_str()) != except).flat_map(monitors_of).collect()
}

/// Makes the host's mirrors match [`desired`] and publishes the state changes.
pub(super) async fn sync(mgr: &Manager) -> SyncReport {
    sync_except(mgr, None).await
}

/// [`sync`] without VM `name`'s monitors: its QEMU is gone (or its launch failed).
pub(super) async fn sync_without(mgr: &Manager, name: &str) -> SyncReport {
    sync_except(mgr, Some(name)).await
}

async fn sync_except(mgr: &Manager, except: Option<&str>) -> SyncReport {
    // One diff at a time, in the order the syncs ran: events never go backwards.
    let mut states = mgr.capture_states.lock().await;
    let wanted = desired(mgr, except);
    let report = mgr.capture.sync(mgr.net.netlink(), &wanted).await;
    let new: States = report.monitors.iter().map(|(m, s)| ((m.vm.clone(), m.nic), s.clone())).collect();
    for (vm, change, reason) in publish_changes(&states, &report) {
        let status = mgr.lock().vms.get(&vm).map(|r| r.status);
        mgr.events.emit_capture(&vm, status, reason, change);
    }
    let mut by_vm: BTreeMap<String, BTreeMap<usize, String>> = BTreeMap::new();
    for ((vm, nic), state) in &new {
        by_vm.entry(vm.clone()).or_default().insert(*nic, state.name().to_string());
    }
    mgr.registry.set_capture(by_vm);
    *states = new;
    report
}

/// The events a sync's `report` makes after `before`: one per monitor whose state changed
/// between `attached`, `source_missing` and `failed` (a monitor seen for the first time or
/// whose tap is missing, its VM starting, makes none; nor does one that is gone, its VM
/// stopped). Pure, for its tests.
pub(super) fn publish_changes(before: &States, report: &SyncReport) -> Vec<(String, CaptureChange, String)> {
    let mut out = Vec::new();
    for (m, state) in &report.monitors {
        let Some(old) = before.get(&(m.vm.clone(), m.nic)) else { continue };
        // A tap appears while its VM starts and goes when its QEMU ends: the VM's own status
        // events say so.
        let tap_only = matches!(old, MonitorState::TapMissing) || matches!(state, MonitorState::TapMissing);
        if old.name() == state.name() || tap_only {
            continue;
        }
        let reason = match state {
            MonitorState::SourceMissing => format!("capture source {} lost", m.source),
            MonitorState::Attached => format!("capture source {} is back", m.source),
            MonitorState::TapMissing => continue,
            MonitorState::Failed(why) => format!("capture of source {} failed: {why}", m.source),
        };
        let change = CaptureChange { nic: m.nic, source: m.source.clone(), state: state.name().to_string() };
        out.push((m.vm.clone(), change, reason));
    }
    out
}

/// The error a start gets when, after its sync, one of its monitors is not attached.
///
/// # Errors
/// 3001 naming `spec.nics[i].source` when the source is gone; 4001 (step `capture`) otherwise.
pub(super) fn start_failure(name: &str, report: &SyncReport) -> Result<(), ApiError> {
    for (m, state) in report.monitors.iter().filter(|(m, _)| m.vm == name) {
        match state {
            MonitorState::Attached => {}
            MonitorState::SourceMissing => return Err(source_absent(m.nic, &m.source)),
            MonitorState::TapMissing | MonitorState::Failed(_) => {
                let why = match state {
                    MonitorState::Failed(why) => why.clone(),
                    _ => format!("the tap {} is gone", m.tap),
                };
                return Err(ApiError::new(
                    Code::ProvisioningFailed,
                    format!("cannot mirror {} into NIC {}: {why}", m.source, m.nic),
                )
                .field(format!("spec.nics[{}].source", m.nic))
                .details(serde_json::json!({ "step": "capture" })));
            }
        }
    }
    Ok(())
}

/// Checks `spec`'s monitor NICs against the host now: each source exists (netlink), and no VM
/// passes through a device a monitored source depends on (sysfs). Changes nothing.
///
/// # Errors
/// 3001 naming `spec.nics[i].source` for an absent source; 3003 for a device conflict; 4001
/// when netlink cannot be asked.
pub(super) async fn check_sources(mgr: &Manager, spec: &VmSpec) -> Result<(), ApiError> {
    for (i, source, _) in spec.monitor_nics() {
        let found = mgr.net.netlink().link_by_name(source).await.map_err(|e| {
            ApiError::new(Code::ProvisioningFailed, format!("cannot look up interface {source:?}: {e}"))
                .details(serde_json::json!({ "step": "capture" }))
        })?;
        if found.is_none() {
            return Err(source_absent(i, source));
        }
    }
    let has_devices = !spec.hardware.is_empty() || !spec.pci.is_empty();
    let (specs, sources): (Vec<(String, VmSpec)>, Vec<String>) = {
        let t = mgr.lock();
        let specs: Vec<(String, VmSpec)> = t
            .vms
            .values()
            .filter(|r| r.reserved && r.spec.name != spec.name)
            .flat_map(|r| Manager::holding_specs(r).into_iter().map(|s| (r.spec.name.clone(), s.clone())))
            .collect();
        let mut sources: Vec<String> = spec.monitor_nics().map(|(_, s, _)| s.to_string()).collect();
        if has_devices {
            sources.extend(specs.iter().flat_map(|(_, s)| s.monitor_nics().map(|(_, x, _)| x.to_string())));
        }
        (specs, sources)
    };
    if sources.is_empty() {
        return Ok(());
    }
    let devices: SourceDevices = crate::blocking::run(|| {
        sources.iter().map(|s| (s.clone(), crate::net::backing::pci_devices(s))).collect::<SourceDevices>()
    });
    let held: Vec<Holding<'_>> = specs.iter().map(|(name, s)| Holding { name, spec: s }).collect();
    crate::capacity::check_capture_devices(&mgr.config.hardware, &held, spec, &devices)
}

/// Every `[capture] interfaces` entry as netlink shows it now, with the monitors of live VMs
/// whose source it is and their states after the last sync (`tap_missing` before the first).
pub(super) async fn info(mgr: &Manager) -> Vec<CaptureInfo> {
    let wanted = desired(mgr, None);
    let states: BTreeMap<(String, usize), String> =
        mgr.capture_states.lock().await.iter().map(|(k, s)| (k.clone(), s.name().to_string())).collect();
    let mut out = Vec::new();
    for interface in &mgr.config.capture.interfaces {
        let link = mgr.net.netlink().link_by_name(interface).await.ok().flatten();
        let monitors = wanted
            .iter()
            .filter(|m| &m.source == interface)
            .map(|m| CaptureMonitorInfo {
                vm: m.vm.clone(),
                nic: m.nic,
                direction: m.direction,
                state: states.get(&(m.vm.clone(), m.nic)).cloned().unwrap_or_else(|| "tap_missing".into()),
            })
            .collect();
        out.push(CaptureInfo {
            interface: interface.clone(),
            present: link.is_some(),
            promisc: link.is_some_and(|l| l.promisc),
            monitors,
        });
    }
    out
}

/// The `host.check` item `capture` of `info`: ok when every configured interface exists (and
/// when none is configured), an error naming the absent ones.
pub(super) fn check_item(info: &[CaptureInfo]) -> CheckItem {
    let absent: Vec<&str> = info.iter().filter(|i| !i.present).map(|i| i.interface.as_str()).collect();
    let (status, detail) = if info.is_empty() {
        (CheckStatus::Ok, "no capture interface configured".to_string())
    } else if absent.is_empty() {
        let names: Vec<&str> = info.iter().map(|i| i.interface.as_str()).collect();
        (CheckStatus::Ok, format!("capture interfaces present: {}", names.join(", ")))
    } else {
        (
            CheckStatus::Error,
            format!("capture interfaces absent: {} (monitor NICs on them cannot start)", absent.join(", ")),
        )
    };
    CheckItem { name: "capture".into(), status, detail }
}

/// Whether anything of capture is (or may be) on the host: a live VM's monitor or a ledger.
fn anything_monitored(mgr: &Manager) -> bool {
    if !desired(mgr, None).is_empty() {
        return true;
    }
    let dir = mgr.config.paths.state.join(crate::net::capture::ledger::DIR);
    std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some())
}

/// Subscribes to the kernel's link notifications. Open it before the first sync: a link that
/// changes between that sync's reading and the watcher's start is then still seen.
pub(super) fn open_watch() -> Option<crate::net::watch::LinkWatch> {
    crate::net::watch::LinkWatch::open()
        .map_err(|e| {
            tracing::warn!(error = %e, "cannot watch links: capture sources are re-checked only at VM starts and stops");
        })
        .ok()
}

/// Starts the task that syncs whenever host links change (a source unplugged, renamed, back;
/// a tap gone), debounced by [`DEBOUNCE`], and only while something is monitored. It holds the
/// manager weakly and ends with it.
pub(super) fn spawn_watcher(mgr: &Arc<Manager>, watch: Option<crate::net::watch::LinkWatch>) {
    let Some(mut watch) = watch else { return };
    let weak: Weak<Manager> = Arc::downgrade(mgr);
    tokio::spawn(async move {
        while let Some(first) = watch.next().await {
            let mut names = vec![first.name];
            // The rest of a burst.
            while let Ok(Some(more)) = tokio::time::timeout(DEBOUNCE, watch.next()).await {
                names.push(more.name);
            }
            let Some(mgr) = weak.upgrade() else { return };
            if !anything_monitored(&mgr) {
                continue;
            }
            tracing::debug!(links = ?names, "links changed: capture sync");
            sync(&mgr).await;
        }
        tracing::warn!("the link watch ended: capture sources are re-checked only at VM starts and stops");
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::CaptureDirection;

    fn m(vm: &str, nic: usize) -> Monitor {
        Monitor {
            vm: vm.into(),
            nic,
            source: "eth1".into(),
            tap: format!("vmh00000000n{nic}"),
            direction: CaptureDirection::Both,
        }
    }

    fn report(list: &[(Monitor, MonitorState)]) -> SyncReport {
        SyncReport { monitors: list.to_vec(), sources: Vec::new() }
    }

    #[test]
    fn a_running_monitor_keeps_its_tap_while_a_shorter_nic_list_waits_for_a_restart() {
        use crate::api::{NicMode, NicSpec};
        let monitor = NicSpec { mode: NicMode::Monitor, source: Some("eth1".into()), ..NicSpec::default() };
        let bridge = NicSpec { network: "lan".into(), ..NicSpec::default() };
        let mut spec = crate::validate::tests::spec("s");
        spec.nics = vec![bridge, monitor.clone()];
        let mut rec = VmRecord::new(spec.clone());
        // Applied without a restart: the record's NICs were allocated for the new list.
        rec.running_spec = Some(spec);
        rec.spec.nics = vec![monitor];
        rec.nics =
            vec![crate::nic::NicAlloc { mac: "02:00:00:00:00:01".into(), tap: "vmh0a0b0c0dn0".into(), vhost: false }];
        let got = monitors_of(&rec);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!((got[0].nic, got[0].tap.as_str()), (1, "vmh0a0b0c0dn1"), "the running QEMU's NIC 1 and its tap");
    }

    #[test]
    fn events_only_for_changes_of_monitors_seen_before() {
        let before: States =
            [(("a".to_string(), 0), MonitorState::Attached), (("b".to_string(), 1), MonitorState::SourceMissing)]
                .into();
        let r = report(&[
            (m("a", 0), MonitorState::SourceMissing),
            (m("b", 1), MonitorState::Attached),
            (m("new", 0), MonitorState::Attached),
        ]);
        let ev = publish_changes(&before, &r);
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert_eq!(ev[0].0, "a");
        assert_eq!(ev[0].1, CaptureChange { nic: 0, source: "eth1".into(), state: "source_missing".into() });
        assert_eq!(ev[0].2, "capture source eth1 lost");
        assert_eq!((ev[1].1.state.as_str(), ev[1].2.as_str()), ("attached", "capture source eth1 is back"));
        // Unchanged: nothing. A failure's text changing is no new state either.
        let same: States = [(("a".to_string(), 0), MonitorState::Failed("x".into()))].into();
        assert!(publish_changes(&same, &report(&[(m("a", 0), MonitorState::Failed("y".into()))])).is_empty());
        assert!(publish_changes(&States::new(), &r).is_empty());
        // A starting VM's tap appearing is no news, nor is a tap going.
        let starting: States = [(("a".to_string(), 0), MonitorState::TapMissing)].into();
        assert!(publish_changes(&starting, &report(&[(m("a", 0), MonitorState::Attached)])).is_empty());
        let running: States = [(("a".to_string(), 0), MonitorState::Attached)].into();
        assert!(publish_changes(&running, &report(&[(m("a", 0), MonitorState::TapMissing)])).is_empty());
        let failing = publish_changes(&running, &report(&[(m("a", 0), MonitorState::Failed("EBUSY".into()))]));
        assert_eq!(failing[0].2, "capture of source eth1 failed: EBUSY");
    }

    #[test]
    fn a_start_fails_with_3001_for_a_missing_source_and_4001_else() {
        let ok = report(&[(m("a", 0), MonitorState::Attached), (m("b", 0), MonitorState::SourceMissing)]);
        assert!(start_failure("a", &ok).is_ok(), "another VM's state is not this start's");
        let e = start_failure("b", &ok).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::NotInModel, Some("spec.nics[0].source")));
        let r = report(&[(m("a", 0), MonitorState::Attached), (m("a", 2), MonitorState::Failed("EPERM".into()))]);
        let e = start_failure("a", &r).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::ProvisioningFailed, Some("spec.nics[2].source")));
        assert_eq!(e.details["step"], "capture");
        assert!(e.message.contains("EPERM"), "{}", e.message);
    }

    #[test]
    fn the_check_item_names_absent_interfaces() {
        let i = |name: &str, present| CaptureInfo { interface: name.into(), present, promisc: false, monitors: vec![] };
        assert_eq!(check_item(&[]).status, CheckStatus::Ok);
        let ok = check_item(&[i("eth1", true)]);
        assert_eq!((ok.name.as_str(), ok.status), ("capture", CheckStatus::Ok));
        let bad = check_item(&[i("eth1", true), i("eth2", false)]);
        assert_eq!(bad.status, CheckStatus::Error);
        assert!(bad.detail.contains("eth2") && !bad.detail.contains("eth1"), "{}", bad.detail);
    }
}
