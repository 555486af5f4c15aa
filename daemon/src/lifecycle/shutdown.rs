//! Powering a VM's QEMU off ([`VmOp::shut_down`], the one power-off of `vm.stop`, a reconfigure
//! that stops or restarts the VM, and host shutdown), and `host.shutdown_vms`.
//!
//! `host.shutdown_vms` powers every running VM off before the host goes down, keeping their
//! desired state `running` so that autostart ([`super::autostart`]) brings them back at the next
//! boot. The packaged `vmhost-guests.service` calls it at host shutdown (like libvirt-guests);
//! stopping or restarting vmhostd itself never touches a VM.
//!
//! Every running VM at once: each begins an operation ([`Manager::begin_op`]: its busy flag),
//! then [`VmOp::shut_down`]: recorded `stopping`, the ACPI power button, killed if it is still
//! up after `timeout_s`, what it held on the host given back, recorded `stopped`. A VM another
//! operation holds is reported (4090) and left alone.

use super::op::VmOp;
use super::teardown::Devices;
use super::Manager;
use crate::api::{ApiError, DesiredState, ShutdownReport, ShutdownResult, VmStatus};
use crate::process::{self, ProcessIdentity};
use std::sync::Arc;
use std::time::Duration;

/// Powers off every running VM in parallel (ACPI, then SIGKILL after `timeout_s`), leaving
/// each one's desired state as it is.
///
/// # Errors
/// None as a whole: each VM's outcome is in the report.
pub(crate) async fn shutdown_vms(mgr: &Arc<Manager>, timeout_s: u64) -> Result<ShutdownReport, ApiError> {
    super::ops::check_stop_timeout_s(timeout_s)?;
    let running: Vec<String> = mgr
        .list()
        .into_iter()
        .filter(|v| matches!(v.status, VmStatus::Running | VmStatus::Starting))
        .map(|v| v.name)
        .collect();
    tracing::info!(vms = running.len(), timeout_s, "host.shutdown_vms: powering off every running VM");
    let mut tasks = tokio::task::JoinSet::new();
    for name in running {
        let mgr = mgr.clone();
        tasks.spawn(async move {
            let outcome = power_off(&mgr, &name, timeout_s).await;
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

/// One VM of [`shutdown_vms`], as an operation of its own.
async fn power_off(mgr: &Arc<Manager>, name: &str, timeout_s: u64) -> Result<(), ApiError> {
    let (op, rec) = mgr.begin_op(name).await?;
    let Some(id) = op.find_live(rec.process.as_ref())? else { return Ok(()) };
    op.shut_down(&id, "host shutdown", None, timeout_s, super::housekeeping::PowerOff::Acpi).await
}

impl VmOp {
    /// Ends the VM's live QEMU `id`: records it `stopping` (for `reason`, with desired state
    /// `desired` when given: `vm.stop` sets it, a reconfigure or host shutdown keeps it), then
    /// asks the guest to power off as `how` says (the exec server's `guest.shutdown`, falling
    /// back to ACPI powerdown at once, or ACPI powerdown) and waits up to `timeout_s` for it
    /// (nothing of this with [`super::housekeeping::PowerOff::Kill`]), else SIGKILL; then its taps, agent session, run dir and passthrough devices go, and the VM is
    /// `stopped`.
    ///
    /// # Errors
    /// 4001 when QEMU could not be ended (the record keeps the process) or devices not given
    /// back.
    pub(super) async fn shut_down(
        &self,
        id: &ProcessIdentity,
        reason: &str,
        desired: Option<DesiredState>,
        timeout_s: u64,
        how: super::housekeeping::PowerOff,
    ) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr(), self.name());
        self.update_status(reason, VmStatus::Stopping, |r| {
            if let Some(state) = desired {
                r.spec.state = state;
            }
        })?;
        let mut exited = false;
        // Why QEMU is killed, when it is.
        let mut killed = "asked to force it".to_string();
        if how != super::housekeeping::PowerOff::Kill {
            let agent_asked = match how {
                super::housekeeping::PowerOff::Agent { peer_uid } => {
                    match super::housekeeping::ask_shutdown(mgr, name, peer_uid).await {
                        Ok(_) => true,
                        Err(e) => {
                            tracing::warn!(vm = name, error = %e, "guest.shutdown could not be asked; falling back to ACPI");
                            false
                        }
                    }
                }
                super::housekeeping::PowerOff::Kill | super::housekeeping::PowerOff::Acpi => false,
            };
            let asked = async {
                if agent_asked {
                    return Ok(());
                }
                let mut qmp = mgr.qmp(name, Duration::from_secs(5)).await?;
                qmp.system_powerdown().await
            }
            .await;
            match asked {
                Ok(()) => {
                    let wait = Duration::from_secs(timeout_s);
                    // Only an observed exit counts; a failed watch falls through to the kill.
                    exited = matches!(tokio::time::timeout(wait, process::wait_exit_of(id)).await, Ok(Ok(())));
                    if !exited {
                        tracing::warn!(vm = name, "guest did not power off within {wait:?}; killing QEMU");
                        killed = format!("the guest did not power off within {timeout_s} s");
                    }
                }
                Err(e) => {
                    tracing::warn!(vm = name, error = %e, "ACPI powerdown failed; killing QEMU");
                    killed = "the ACPI power-down request failed".to_string();
                }
            }
        }
        if !exited {
            mgr.processes.kill(name, id).await?;
        }
        let by = reason.strip_suffix(": stopping").unwrap_or(reason);
        let unclean = (!exited).then(|| super::ops::killed_by(by, &killed));
        let reason = if exited { "guest powered off" } else { "QEMU killed" };
        self.update_status(reason, VmStatus::Stopped, |r| {
            r.process = None;
            // A clean power-off leaves clean disks; a kill leaves them as a power cut would.
            r.unclean_end = unclean;
        })?;
        self.held().release_host_side(Devices::Release).await
    }
}
