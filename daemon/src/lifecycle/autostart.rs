//! Autostart: after a host reboot (or QEMU ending while vmhostd was down) the VMs that are
//! desired `running` come back without any client asking.
//!
//! [`autostart`] runs once, after [`Manager::open`] has re-adopted and settled every
//! record ([`super::recover`]) and before nothing else: it spawns a task and returns at once, so
//! the socket is served meanwhile. The task picks the candidates ([`candidates`], pure), then
//! starts them through the ordinary start path (`vm.start`'s steps, busy flag, events with the
//! reason `autostart`), at most `lifecycle.start_concurrency` at a time. A VM some client is
//! already working on (4090) is left to that client.

use super::Manager;
use crate::api::{DesiredState, VmStatus};
use crate::state::VmRecord;
use std::sync::Arc;

/// The records autostart starts: desired `running`, and settled as not running (`dead`,
/// `stopped`, `failed`) by the recovery that ran before. Whether their QEMU is really gone is
/// checked again by the start itself (a live one is adopted, never started twice).
pub(crate) fn candidates<'a>(records: impl IntoIterator<Item = &'a VmRecord>) -> Vec<String> {
    records
        .into_iter()
        .filter(|r| r.spec.state == DesiredState::Running)
        .filter(|r| matches!(r.status, VmStatus::Dead | VmStatus::Stopped | VmStatus::Failed))
        .map(|r| r.spec.name.clone())
        .collect()
}

/// Starts the [`candidates`] in the background, `lifecycle.start_concurrency` at a time,
/// unless `lifecycle.autostart` is off. Returns the task (tests and shutdown may await it).
pub fn autostart(mgr: &Arc<Manager>) -> Option<tokio::task::JoinHandle<()>> {
    if !mgr.config.lifecycle.autostart {
        tracing::info!("lifecycle.autostart is off: VMs desired running stay as they are");
        return None;
    }
    let names = candidates(mgr.lock().vms.values());
    if names.is_empty() {
        return None;
    }
    let limit = mgr.config.lifecycle.concurrency();
    tracing::info!(vms = names.len(), concurrency = limit, "autostart: starting VMs desired running");
    let mgr = mgr.clone();
    Some(tokio::spawn(async move {
        let slots = Arc::new(tokio::sync::Semaphore::new(limit));
        let mut tasks = tokio::task::JoinSet::new();
        for name in names {
            let (mgr, slots) = (mgr.clone(), slots.clone());
            tasks.spawn(async move {
                let Ok(_slot) = slots.acquire_owned().await else { return };
                let settled = [VmStatus::Dead, VmStatus::Stopped, VmStatus::Failed];
                match super::ops::start_if_wanted(&mgr, "autostart", &name, &settled).await {
                    Ok(Some(_)) => tracing::info!(vm = %name, "autostart: started"),
                    Ok(None) => tracing::info!(vm = %name, "autostart: changed meanwhile; left as it is"),
                    Err(e) => tracing::warn!(vm = %name, error = %e, "autostart: start failed"),
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::tests::spec;

    fn rec(name: &str, desired: DesiredState, status: VmStatus) -> VmRecord {
        let mut s = spec(name);
        s.state = desired;
        let mut r = VmRecord::new(s);
        r.status = status;
        r
    }

    #[test]
    fn only_vms_desired_running_and_not_running_are_started() {
        use DesiredState::{Running as R, Stopped as S};
        let all = [
            rec("dead", R, VmStatus::Dead),
            rec("stopped-by-shutdown", R, VmStatus::Stopped),
            rec("failed", R, VmStatus::Failed),
            rec("running", R, VmStatus::Running),
            rec("starting", R, VmStatus::Starting),
            rec("stopping", R, VmStatus::Stopping),
            rec("creating", R, VmStatus::Creating),
            rec("destroying", R, VmStatus::Destroying),
            rec("off", S, VmStatus::Stopped),
            rec("off-dead", S, VmStatus::Dead),
        ];
        assert_eq!(candidates(&all), ["dead", "stopped-by-shutdown", "failed"]);
    }
}
