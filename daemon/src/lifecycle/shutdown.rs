//! `host.shutdown_vms`: power every running VM off before the host goes down, keeping their
//! desired state `running` so that autostart ([`super::autostart`]) brings them back at the next
//! boot. The packaged `vmhost-guests.service` calls it at host shutdown (like libvirt-guests);
//! stopping or restarting vmhostd itself never touches a VM.
//!
//! Every running VM at once: each takes its busy flag, is recorded `stopping`, gets the ACPI
//! power button, and is killed if it is still up after `timeout_s`
//! ([`Manager::shut_down`], the same steps as `vm.stop`). A VM another operation holds is
//! reported (4090) and left alone.

use super::Manager;
use crate::api::{ApiError, ShutdownReport, ShutdownResult, VmStatus};
use std::sync::Arc;

impl Manager {
    /// Powers off every running VM in parallel (ACPI, then SIGKILL after `timeout_s`), leaving
    /// each one's desired state as it is.
    ///
    /// # Errors
    /// None as a whole: each VM's outcome is in the report.
    pub async fn shutdown_vms(self: &Arc<Self>, timeout_s: u64) -> Result<ShutdownReport, ApiError> {
        super::ops::check_stop_timeout_s(timeout_s)?;
        let running: Vec<String> = self
            .list()
            .into_iter()
            .filter(|v| matches!(v.status, VmStatus::Running | VmStatus::Starting))
            .map(|v| v.name)
            .collect();
        tracing::info!(vms = running.len(), timeout_s, "host.shutdown_vms: powering off every running VM");
        let mut tasks = tokio::task::JoinSet::new();
        for name in running {
            let mgr = self.clone();
            tasks.spawn(async move {
                let outcome = mgr.power_off(&name, timeout_s).await;
                ShutdownResult { ok: outcome.is_ok(), error: outcome.err().map(|e| e.to_json()), vm: name }
            });
        }
        let mut vms = Vec::new();
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok(result) => vms.push(result),
                Err(e) => tracing::error!(error = %e, "host.shutdown_vms: a task failed"),
            }
        }
        vms.sort_by(|a, b| a.vm.cmp(&b.vm));
        let ok = vms.iter().all(|r| r.ok);
        Ok(ShutdownReport { vms, ok })
    }

    /// One VM of [`Manager::shutdown_vms`].
    async fn power_off(self: &Arc<Self>, name: &str, timeout_s: u64) -> Result<(), ApiError> {
        let (_guard, rec) = self.begin(name).await?;
        let Some(id) = self.find_live(name, rec.process.as_ref())? else { return Ok(()) };
        self.shut_down(name, &id, "host shutdown", None, timeout_s, false).await
    }
}
