//! Passthrough steps of the lifecycle: check, bind before QEMU, release after it.
//!
//! Order: [`Manager::check_passthrough`] before anything is recorded or touched (2001, 3003,
//! 3004, 3005 refuse the request cleanly); [`Manager::bind_passthrough`] right before QEMU, which
//! records every affected function's original driver in the VM record *before* the first sysfs
//! write; [`Manager::release_passthrough`] after QEMU is gone (stop, destroy, death, failed
//! launch, and at daemon start for VMs whose QEMU vanished). The record's bindings are cleared
//! only once release succeeded, so a failed release is retried at the next opportunity.
//!
//! Sysfs writes and the bounded waits for the kernel block, so they run on the blocking pool.

use super::Manager;
use crate::api::{ApiError, Code, VmSpec};
use crate::pci::bind::{self, Binding, BIND_TIMEOUT};
use crate::pci::check::{self, Assignment, Requested};
use crate::validate::requested_devices;
use serde_json::json;
use std::collections::BTreeMap;

fn pci_error(step: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(Code::ProvisioningFailed, format!("PCI passthrough failed at {step}: {e}"))
        .details(json!({ "step": format!("vfio.{step}") }))
}

impl Manager {
    /// Checks that every passthrough device of `spec` can go to it now. Changes nothing.
    ///
    /// # Errors
    /// 2001 (absent, a bridge), 3003 (bound for another VM), 3005 (used by the host), 3004
    /// (IOMMU group not viable, listing the blocking devices), 4001 when sysfs or netlink fail.
    pub(super) async fn check_passthrough(&self, spec: &VmSpec) -> Result<Option<Assignment>, ApiError> {
        let wanted: Vec<Requested> = crate::validate::requested_devices_with_fields(spec, &self.config.hardware)
            .into_iter()
            .map(|(addr, field)| Requested::new(addr, field))
            .collect();
        if wanted.is_empty() {
            return Ok(None);
        }
        let usage = crate::host_usage::gather(self.net.netlink()).await.map_err(|e| pci_error("host_usage", e))?;
        // Devices bound for other VMs (what their records say), never this VM's own.
        let held: BTreeMap<_, _> = self
            .lock()
            .vms
            .values()
            .filter(|r| r.spec.name != spec.name)
            .flat_map(|r| r.vfio.iter().map(move |b| (b.address, r.spec.name.clone())))
            .collect();
        let pci = self.pci.clone();
        let addresses: Vec<_> = wanted.iter().map(|r| r.address).collect();
        let devices = tokio::task::spawn_blocking(move || pci.devices_with_groups(&addresses))
            .await
            .map_err(|e| pci_error("read", e))?
            .map_err(|e| pci_error("read", e))?;
        check::check(&wanted, &devices, &usage, &held).map(Some)
    }

    /// Re-checks and binds the VM's devices to vfio-pci, recording the original drivers first.
    ///
    /// # Errors
    /// As [`Manager::check_passthrough`], and 4001 when binding fails (every device already
    /// changed is restored; if a restore fails too, the record keeps the bindings for a retry).
    pub(super) async fn bind_passthrough(&self, spec: &VmSpec) -> Result<(), ApiError> {
        let Some(assignment) = self.check_passthrough(spec).await? else { return Ok(()) };
        if !self.pci.vfio_pci_present() {
            let loaded =
                tokio::task::spawn_blocking(crate::pci::load_vfio_pci).await.map_err(|e| pci_error("modprobe", e))?;
            loaded.map_err(|e| pci_error("modprobe", e))?;
        }
        let pci = self.pci.clone();
        let planned = tokio::task::spawn_blocking(move || bind::plan_bindings(&pci, &assignment))
            .await
            .map_err(|e| pci_error("plan", e))?
            .map_err(|e| pci_error("plan", e))?;
        // Intent first: after a crash from here on, recovery knows what to give back.
        let record = planned.clone();
        self.update(&spec.name, "vfio intent", |r| r.vfio = record)?;
        let pci = self.pci.clone();
        let to_bind = planned.clone();
        let started = std::time::Instant::now();
        let after_each = numbered_crashpoint(self.config.paths.run.clone(), "vfio:bound");
        let bound = tokio::task::spawn_blocking(move || bind::bind_vfio(&pci, &to_bind, BIND_TIMEOUT, after_each))
            .await
            .map_err(|e| pci_error("bind", e))?;
        match bound {
            Ok(()) => {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                tracing::info!(vm = %spec.name, devices = planned.len(), elapsed_ms = ms, "vfio bound");
                Ok(())
            }
            Err(e) => {
                let err = e.to_api_error();
                let restored_all = match &e {
                    bind::BindError::Bind { restore_failures, .. } => restore_failures.is_empty(),
                    _ => false,
                };
                if restored_all {
                    let _ = self.update(&spec.name, "vfio restored", |r| r.vfio.clear());
                }
                Err(err)
            }
        }
    }

    /// Gives the VM's devices back to their original drivers. Clears the record's bindings on
    /// success; keeps them (for a later retry) on failure.
    ///
    /// # Errors
    /// 4001 listing every device that could not be restored.
    pub(super) async fn release_passthrough(&self, name: &str) -> Result<(), ApiError> {
        let bindings: Vec<Binding> = match self.record(name) {
            Ok(r) => r.vfio,
            Err(_) => return Ok(()),
        };
        if bindings.is_empty() {
            return Ok(());
        }
        let pci = self.pci.clone();
        let count = bindings.len();
        let started = std::time::Instant::now();
        let after_each = numbered_crashpoint(self.config.paths.run.clone(), "vfio:released");
        let released = tokio::task::spawn_blocking(move || bind::release(&pci, &bindings, BIND_TIMEOUT, after_each))
            .await
            .map_err(|e| pci_error("release", e))?;
        match released {
            Ok(()) => {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                tracing::info!(vm = %name, devices = count, elapsed_ms = ms, "vfio released");
                self.update(name, "vfio released", |r| r.vfio.clear())?;
                Ok(())
            }
            Err(e) => {
                tracing::error!(vm = name, error = %e, "cannot give passthrough devices back");
                Err(e.to_api_error())
            }
        }
    }

    /// RLIMIT_MEMLOCK QEMU needs: VFIO pins all guest RAM (plus room for QEMU's own buffers).
    pub(super) fn memlock_for(&self, spec: &VmSpec) -> Option<u64> {
        (!requested_devices(spec, &self.config.hardware).is_empty())
            .then(|| (spec.memory_mib + 1024).saturating_mul(1024 * 1024))
    }
}

/// The hook for [`bind::bind_vfio`] and [`bind::release`]: the crash point `STEP:N` after the
/// Nth device. A crash between two devices leaves some changed and some not: the fault tests
/// need that state, which no step boundary of the lifecycle shows.
fn numbered_crashpoint(run: std::path::PathBuf, step: &'static str) -> impl FnMut(&Binding) {
    let mut n = 0;
    move |_| {
        n += 1;
        crate::crashpoint::hit(&run, &format!("{step}:{n}"));
    }
}
