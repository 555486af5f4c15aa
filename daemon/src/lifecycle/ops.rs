//! The VM operations of API v1: create, start, stop, restart, destroy, apply.
//!
//! Each public operation takes the VM's busy flag first and then calls an `*_held` step that
//! assumes the flag is held, so compound operations (restart, apply with replace) run their
//! steps without letting another operation in between.

use super::{Manager, OpGuard};
use crate::api::{ApiError, Code, DesiredState, Mutation, StopParams, VmSpec, VmStatus};
use crate::process;
use crate::validate::{validate_spec, BootSource};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

impl Manager {
    /// `vm.create`: defines the VM and, unless `spec.state` is `stopped`, starts it.
    ///
    /// # Errors
    /// 2001/3001 invalid spec, 3002/3003 refused by capacity or conflicts (nothing changed),
    /// 4001 when a host step fails (everything undone, the record says `failed`).
    pub async fn create(self: &Arc<Self>, spec: VmSpec) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.create", vm = %spec.name);
        async move {
            let vm = validate_spec(&spec, &self.config)?;
            self.check_boot_files(&vm)?;
            let guard = self.reserve_new(&vm.spec)?;
            self.create_held(&guard, &vm).await?;
            Ok(Mutation { changed: true, vm: Some(self.get(&spec.name)?) })
        }
        .instrument(span)
        .await
    }

    async fn create_held(self: &Arc<Self>, _g: &OpGuard, vm: &crate::validate::ValidSpec) -> Result<(), ApiError> {
        let name = vm.spec.name.as_str();
        // An overlay without a record is an orphan of an earlier crash: a new VM never inherits it.
        let stale = self.paths(name).overlay;
        if stale.exists() {
            tracing::warn!(vm = name, path = %stale.display(), "removing an orphaned overlay");
            if let Err(e) = crate::disk::remove_overlay(&stale) {
                let err = ApiError::new(Code::ProvisioningFailed, format!("cannot remove orphaned overlay: {e}"));
                self.mark_failed(name, &err, true);
                return Err(err);
            }
        }
        let made_overlay = match self.ensure_overlay(vm).await {
            Ok(made) => made,
            Err(e) => {
                // create_overlay removed its partial file; the record must stop naming it.
                let _ = self.update(name, "rollback", |r| r.overlay = None);
                self.mark_failed(name, &e, true);
                return Err(e);
            }
        };
        if vm.spec.state == DesiredState::Stopped {
            self.update(name, "created stopped", |r| r.status = VmStatus::Stopped)?;
            return Ok(());
        }
        match self.launch_qemu(vm).await {
            Ok(id) => self.mark_running(name, id, "vm.create"),
            Err(e) => {
                self.undo_create(name, made_overlay || matches!(vm.boot, BootSource::Image { .. }));
                self.mark_failed(name, &e, true);
                Err(e)
            }
        }
    }

    /// Undoes a create's disk step: the overlay is removed (QEMU and run dir are undone by
    /// `launch_qemu` itself).
    fn undo_create(&self, name: &str, remove_overlay: bool) {
        if !remove_overlay {
            return;
        }
        let overlay = self.paths(name).overlay;
        if let Err(e) = crate::disk::remove_overlay(&overlay) {
            tracing::error!(vm = name, error = %e, "rollback: cannot remove the overlay");
        }
        let _ = self.update(name, "rollback", |r| r.overlay = None);
    }

    /// `vm.start`.
    ///
    /// # Errors
    /// 4040, 4090, 3002/3003 when a VM whose reservation was released no longer fits, 4001.
    pub async fn start(self: &Arc<Self>, name: &str) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.start", vm = %name);
        async move {
            let (guard, _) = self.begin(name)?;
            let changed = self.start_held(&guard, name).await?;
            Ok(Mutation { changed, vm: Some(self.get(name)?) })
        }
        .instrument(span)
        .await
    }

    async fn start_held(self: &Arc<Self>, _g: &OpGuard, name: &str) -> Result<bool, ApiError> {
        let rec = self.record(name)?;
        let paths = self.paths(name);
        let state_changed = rec.spec.state != DesiredState::Running;
        if let Some(id) = self.find_live(&paths, rec.process.as_ref()) {
            if state_changed || rec.status != VmStatus::Running {
                self.update(name, "vm.start", |r| r.spec.state = DesiredState::Running)?;
                self.mark_running(name, id, "already running")?;
                return Ok(true);
            }
            return Ok(false);
        }
        let mut spec = rec.spec.clone();
        spec.state = DesiredState::Running;
        let vm = validate_spec(&spec, &self.config)?;
        self.check_boot_files(&vm)?;
        let reserved_here = !rec.reserved;
        let allocs = if reserved_here { self.reserve_existing(&spec, &rec.nics)? } else { rec.nics.clone() };
        self.update(name, "vm.start", |r| {
            r.spec.state = DesiredState::Running;
            r.reserved = true;
            r.nics = allocs;
        })?;
        let made_overlay = match self.ensure_overlay(&vm).await {
            Ok(m) => m,
            Err(e) => {
                self.mark_failed(name, &e, reserved_here);
                return Err(e);
            }
        };
        match self.launch_qemu(&vm).await {
            Ok(id) => {
                self.mark_running(name, id, "vm.start")?;
                Ok(true)
            }
            Err(e) => {
                if reserved_here {
                    self.undo_create(name, made_overlay);
                }
                self.mark_failed(name, &e, reserved_here);
                Err(e)
            }
        }
    }

    /// `vm.stop`: ACPI powerdown over QMP, SIGKILL after `timeout_s` (at once with `force`).
    ///
    /// # Errors
    /// 4040, 4090, 4001 when the record cannot be written.
    pub async fn stop(self: &Arc<Self>, p: StopParams) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.stop", vm = %p.name);
        async move {
            let (guard, _) = self.begin(&p.name)?;
            let changed = self.stop_held(&guard, &p).await?;
            Ok(Mutation { changed, vm: Some(self.get(&p.name)?) })
        }
        .instrument(span)
        .await
    }

    async fn stop_held(self: &Arc<Self>, _g: &OpGuard, p: &StopParams) -> Result<bool, ApiError> {
        let name = p.name.as_str();
        let rec = self.record(name)?;
        let paths = self.paths(name);
        let state_changed = rec.spec.state != DesiredState::Stopped;
        let Some(id) = self.find_live(&paths, rec.process.as_ref()) else {
            self.clean_run_dir(&paths);
            let status_changed = matches!(rec.status, VmStatus::Running | VmStatus::Starting | VmStatus::Stopping);
            if state_changed || status_changed {
                self.update(name, "vm.stop", |r| {
                    r.spec.state = DesiredState::Stopped;
                    r.process = None;
                    if status_changed {
                        r.status = VmStatus::Stopped;
                    }
                })?;
                return Ok(true);
            }
            return Ok(false);
        };
        self.update(name, "vm.stop", |r| {
            r.spec.state = DesiredState::Stopped;
            r.status = VmStatus::Stopping;
        })?;
        let mut exited = false;
        if !p.force {
            let asked = async {
                let mut qmp = crate::qemu::qmp::Qmp::connect(&paths.qmp, Duration::from_secs(5)).await?;
                qmp.system_powerdown().await
            }
            .await;
            match asked {
                Ok(_) => {
                    let wait = Duration::from_secs(p.timeout_s);
                    exited = tokio::time::timeout(wait, process::wait_exit_of(&id)).await.is_ok();
                    if !exited {
                        tracing::warn!(vm = name, "guest did not power off within {wait:?}; killing QEMU");
                    }
                }
                Err(e) => tracing::warn!(vm = name, error = %e, "ACPI powerdown failed; killing QEMU"),
            }
        }
        if !exited {
            self.kill_process(name, &id).await;
        }
        self.clean_run_dir(&paths);
        let reason = if exited { "guest powered off" } else { "QEMU killed" };
        self.update(name, reason, |r| {
            r.status = VmStatus::Stopped;
            r.process = None;
        })?;
        Ok(true)
    }

    /// `vm.restart`: a stop (same params as `vm.stop`) followed by a start, as one operation.
    ///
    /// # Errors
    /// As `vm.stop` and `vm.start`.
    pub async fn restart(self: &Arc<Self>, p: StopParams) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.restart", vm = %p.name);
        async move {
            let (guard, _) = self.begin(&p.name)?;
            self.stop_held(&guard, &p).await?;
            self.start_held(&guard, &p.name).await?;
            Ok(Mutation { changed: true, vm: Some(self.get(&p.name)?) })
        }
        .instrument(span)
        .await
    }

    /// `vm.destroy`: kills QEMU, removes overlay, sockets, console log and record.
    ///
    /// # Errors
    /// 4040, 4090, 4001 when a file cannot be removed (the record then says `failed`).
    pub async fn destroy(self: &Arc<Self>, name: &str) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.destroy", vm = %name);
        async move {
            let (guard, _) = self.begin(name)?;
            self.destroy_held(&guard, name).await?;
            Ok(Mutation { changed: true, vm: None })
        }
        .instrument(span)
        .await
    }

    pub(super) async fn destroy_held(self: &Arc<Self>, _g: &OpGuard, name: &str) -> Result<(), ApiError> {
        let rec = self.record(name)?;
        let paths = self.paths(name);
        self.update(name, "vm.destroy", |r| r.status = VmStatus::Destroying)?;
        if let Some(id) = self.find_live(&paths, rec.process.as_ref()) {
            self.kill_process(name, &id).await;
        }
        self.clean_run_dir(&paths);
        if rec.overlay.is_some() || paths.overlay.exists() {
            if let Err(e) = crate::disk::remove_overlay(&paths.overlay) {
                let err = ApiError::new(Code::ProvisioningFailed, format!("cannot remove the overlay: {e}"));
                self.mark_failed(name, &err, false);
                return Err(err);
            }
        }
        match std::fs::remove_file(&paths.serial_log) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(vm = name, error = %e, "cannot remove the console log"),
        }
        self.forget(name, "destroyed")
    }

    /// `vm.apply`: create when absent, converge the run state when the spec is equal, refuse a
    /// different spec with 2002 unless `replace`, which destroys and recreates.
    ///
    /// # Errors
    /// As create, plus 2002 listing the differing fields in `details.fields`.
    pub async fn apply(self: &Arc<Self>, spec: VmSpec, replace: bool) -> Result<Mutation, ApiError> {
        let vm = validate_spec(&spec, &self.config)?;
        let Ok(current) = self.record(&spec.name) else { return self.create(spec).await };
        let drift = crate::plan::spec_drift(&current.spec, &spec);
        if drift.is_empty() {
            let up = self.find_live(&self.paths(&spec.name), current.process.as_ref()).is_some();
            let converge = match spec.state {
                DesiredState::Running => !up,
                DesiredState::Stopped => up || current.spec.state != DesiredState::Stopped,
            };
            return match (converge, spec.state) {
                (false, _) => Ok(Mutation { changed: false, vm: Some(self.get(&spec.name)?) }),
                (true, DesiredState::Running) => self.start(&spec.name).await,
                (true, DesiredState::Stopped) => {
                    self.stop(StopParams { name: spec.name.clone(), timeout_s: 30, force: false }).await
                }
            };
        }
        if !replace {
            return Err(ApiError::new(
                Code::SpecDrift,
                format!(
                    "VM {:?} exists with a different spec ({}); pass replace: true to recreate it",
                    spec.name,
                    drift.join(", ")
                ),
            )
            .field("spec")
            .details(serde_json::json!({ "fields": drift })));
        }
        self.check_boot_files(&vm)?;
        let span = tracing::info_span!("vm.replace", vm = %spec.name);
        async move {
            let (guard, _) = self.begin(&spec.name)?;
            // Refuse before destroying anything if the new spec would not fit in place of the old.
            self.check_admission(&spec)?;
            self.destroy_held(&guard, &spec.name).await?;
            drop(guard);
            let guard = self.reserve_new(&vm.spec)?;
            self.create_held(&guard, &vm).await?;
            Ok(Mutation { changed: true, vm: Some(self.get(&spec.name)?) })
        }
        .instrument(span)
        .await
    }
}
