//! The VM operations of API v1: create, start, stop, restart, destroy, apply.
//!
//! Each public operation takes the VM's busy flag first and then calls an `*_held` step that
//! assumes the flag is held, so compound operations (restart, apply with replace) run their
//! steps without letting another operation in between.

use super::teardown::partial_overlay;
use super::teardown::Devices;
use super::undo::{Step, Undo};
use super::{Manager, OpGuard};
use crate::api::{ApiError, ApplyParams, Code, DesiredState, Mutation, StopParams, VmSpec, VmStatus};
use crate::plan::Change;
use crate::process;
use crate::validate::{validate_spec, BootSource, ValidSpec};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// Longest graceful-stop wait accepted; the busy flag is held that long.
pub const MAX_STOP_TIMEOUT_S: u64 = 3600;

impl Manager {
    /// `vm.create`: defines the VM and, unless `spec.state` is `stopped`, starts it.
    ///
    /// # Errors
    /// 2001/3001 invalid spec, 3002/3003 refused by capacity or conflicts, 4002 when the QEMU
    /// binary is not the pinned one (nothing changed for any of these), 4001 when a host step
    /// fails (everything undone, the record says `failed`).
    pub async fn create(self: &Arc<Self>, spec: VmSpec) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.create", vm = %spec.name);
        async move {
            let vm = validate_spec(&spec, &self.config)?;
            self.check_launch_files(&vm).await?;
            // A boot.disk file is checked (and its growth admitted) before anything is recorded.
            let import = self.inspect_import(&vm).await?;
            match &import {
                Some(import) => self.admit_import(&vm.spec, import)?,
                None => self.admit_disk_space(None, &vm.spec)?,
            }
            if vm.spec.state == DesiredState::Running && (!vm.spec.hardware.is_empty() || !vm.spec.pci.is_empty()) {
                // Capacity and conflicts first (what the records say), then what the kernel says
                // about the devices; both before anything is recorded. reserve_new admits again
                // under the lock, so nothing can slip in between.
                self.precheck_admission(&vm.spec)?;
                self.check_passthrough(&vm.spec).await?;
            }
            let guard = self.reserve_new(&vm.spec)?;
            if let Err(e) = self.clear_orphan_disks(&vm.spec.name) {
                self.mark_failed(&vm.spec.name, &e, true);
                return Err(e);
            }
            if let Some(import) = import {
                if let Err(e) = self.import_root_disk(&vm.spec, import).await {
                    self.undo_root_disk(&vm.spec.name);
                    self.mark_failed(&vm.spec.name, &e, true);
                    return Err(e);
                }
            }
            self.create_held(&guard, &vm).await?;
            Ok(Mutation::new(true, Some(self.get(&spec.name)?)))
        }
        .instrument(span)
        .await
    }

    /// The host steps of a create (and of a replace, after the teardown, which kept the data
    /// disks); the record (status `creating`, resources reserved) exists. Undoing it removes
    /// only what it made and returns the data disks it took back.
    async fn create_held(self: &Arc<Self>, _g: &OpGuard, vm: &ValidSpec) -> Result<(), ApiError> {
        let name = vm.spec.name.as_str();
        self.crashpoint("create:recorded");
        // An overlay without a record is an orphan of an earlier crash: a new VM never inherits it.
        let paths = self.paths(name);
        for stale in [paths.overlay.clone(), partial_overlay(&paths)] {
            if stale.exists() {
                tracing::warn!(vm = name, path = %stale.display(), "removing an orphaned overlay");
                if let Err(e) = crate::disk::remove_overlay(&stale) {
                    let err = ApiError::new(Code::ProvisioningFailed, format!("cannot remove orphaned overlay: {e}"));
                    self.mark_failed(name, &err, true);
                    return Err(err);
                }
            }
        }
        let made_overlay = match self.ensure_overlay(vm).await {
            Ok(made) => made,
            Err(e) => {
                // The partial overlay is gone; the record must stop naming it.
                let _ = self.update(name, "rollback", |r| r.overlay = None);
                self.mark_failed(name, &e, true);
                return Err(e);
            }
        };
        let mut undo = Undo::new(true);
        if made_overlay || matches!(vm.boot, BootSource::Image { .. }) {
            undo.push(Step::Overlay);
        }
        // Both record what they take as they go: on the stack before they run.
        undo.push(Step::RootDisk);
        undo.push(Step::DataDisks);
        self.crashpoint("create:overlay");
        if let Err(e) = self.ensure_data_disks(&vm.spec, true).await {
            return Err(self.unwind(name, undo, e).await);
        }
        self.crashpoint("create:disks");
        if vm.spec.state == DesiredState::Stopped {
            self.update(name, "created stopped", |r| r.status = VmStatus::Stopped)?;
            self.end_root_disk_import(name)?;
            return self.end_disk_tracking(name);
        }
        match self.launch_qemu(vm, VmStatus::Creating, &mut undo).await {
            Ok(id) => {
                self.mark_running(name, id, "vm.create")?;
                self.crashpoint("create:running");
                self.end_root_disk_import(name)?;
                self.end_disk_tracking(name)
            }
            Err(e) => Err(self.unwind(name, undo, e).await),
        }
    }

    /// Removes the VM's overlay (and seed) as part of a rollback ([`Step::Overlay`]).
    pub(super) fn undo_overlay(&self, name: &str) {
        let _ = crate::blocking::run(|| std::fs::remove_file(self.paths(name).seed));
        let overlay = self.paths(name).overlay;
        if let Err(e) = crate::disk::remove_overlay(&overlay) {
            tracing::error!(vm = name, error = %e, "rollback: cannot remove the overlay");
        }
        let _ = self.update(name, "rollback", |r| r.overlay = None);
    }

    /// `vm.start`.
    ///
    /// # Errors
    /// 4040, 4090, 3002/3003 when a VM whose reservation was released no longer fits, 4002
    /// when the QEMU binary is not the pinned one, 4001.
    pub async fn start(self: &Arc<Self>, name: &str) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.start", vm = %name);
        async move {
            let (guard, _) = self.begin(name)?;
            let changed = self.start_held(&guard, name, "vm.start").await?;
            // An operator's start begins the restart policy's count afresh.
            self.update(name, "vm.start", |r| r.failures.clear())?;
            Ok(Mutation::new(changed, Some(self.get(name)?)))
        }
        .instrument(span)
        .await
    }

    /// A start vmhostd makes on its own (`why`: autostart, the restart policy): only if, under
    /// the VM's busy flag, it is still desired running and in one of `statuses`, so that an
    /// operator's stop, start or destroy meanwhile always wins. `None` when not started.
    ///
    /// # Errors
    /// As `vm.start`; 4090 when an operation holds the VM.
    pub(super) async fn start_if_wanted(
        self: &Arc<Self>,
        why: &str,
        name: &str,
        statuses: &[VmStatus],
    ) -> Result<Option<Mutation>, ApiError> {
        let span = tracing::info_span!("vm.start", vm = %name, why);
        async move {
            let (guard, rec) = self.begin(name)?;
            if rec.spec.state != DesiredState::Running || !statuses.contains(&rec.status) {
                return Ok(None);
            }
            let changed = self.start_held(&guard, name, why).await?;
            Ok(Some(Mutation::new(changed, Some(self.get(name)?))))
        }
        .instrument(span)
        .await
    }

    /// The steps of a start with the busy flag held; `reason` is the events' reason.
    pub(super) async fn start_held(self: &Arc<Self>, _g: &OpGuard, name: &str, reason: &str) -> Result<bool, ApiError> {
        let rec = self.record(name)?;
        Self::check_not_reverting(&rec)?;
        let state_changed = rec.spec.state != DesiredState::Running;
        if let Some(id) = self.find_live(name, rec.process.as_ref())? {
            if state_changed || rec.status != VmStatus::Running {
                self.update(name, reason, |r| r.spec.state = DesiredState::Running)?;
                self.mark_running(name, id, "already running")?;
                return Ok(true);
            }
            return Ok(false);
        }
        let mut spec = rec.spec.clone();
        spec.state = DesiredState::Running;
        let vm = validate_spec(&spec, &self.config)?;
        self.check_launch_files(&vm).await?;
        self.check_passthrough(&vm.spec).await?;
        let reserved_here = !rec.reserved;
        if reserved_here {
            self.reserve_existing(name)?;
        } else {
            self.update(name, reason, |r| r.spec.state = DesiredState::Running)?;
        }
        let made_overlay = match self.ensure_overlay(&vm).await {
            Ok(m) => m,
            Err(e) => {
                self.mark_failed(name, &e, reserved_here);
                return Err(e);
            }
        };
        let mut undo = Undo::new(reserved_here);
        if reserved_here && made_overlay {
            undo.push(Step::Overlay);
        }
        // A boot.disk VM whose failed create gave its disk back imports it again.
        undo.push(Step::RootDisk);
        if let Err(e) = self.ensure_root_disk(&vm).await {
            return Err(self.unwind(name, undo, e).await);
        }
        // A disk added while the VM was stopped is made now; one a change dropped goes only
        // once the new spec runs (a failed restart rolls back to the spec that still has it).
        if let Err(e) = self.ensure_data_disks(&vm.spec, false).await {
            return Err(self.unwind(name, undo, e).await);
        }
        let pending_from = rec.running_spec.clone();
        match self.launch_qemu(&vm, VmStatus::Starting, &mut undo).await {
            Ok(id) => {
                self.mark_running(name, id, reason)?;
                self.end_root_disk_import(name)?;
                if let Some(previous) = pending_from {
                    if let Err(e) = self.retire_data_disks(&previous, &vm.spec) {
                        tracing::error!(vm = name, error = %e.message, "a dropped data disk stays in place");
                    }
                }
                Ok(true)
            }
            Err(e) => Err(self.unwind(name, undo, e).await),
        }
    }

    /// `vm.stop`: ACPI powerdown over QMP, SIGKILL after `timeout_s` (at once with `force`).
    ///
    /// # Errors
    /// 2001 for a timeout above [`MAX_STOP_TIMEOUT_S`], 4040, 4090, 4001 when QEMU could not be
    /// ended (the record then keeps the process).
    pub async fn stop(self: &Arc<Self>, p: StopParams) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.stop", vm = %p.name);
        async move {
            check_stop_timeout(&p)?;
            let (guard, _) = self.begin(&p.name)?;
            let changed = self.stop_held(&guard, &p).await?;
            Ok(Mutation::new(changed, Some(self.get(&p.name)?)))
        }
        .instrument(span)
        .await
    }

    async fn stop_held(self: &Arc<Self>, _g: &OpGuard, p: &StopParams) -> Result<bool, ApiError> {
        let name = p.name.as_str();
        let rec = self.record(name)?;
        let state_changed = rec.spec.state != DesiredState::Stopped;
        let Some(id) = self.find_live(name, rec.process.as_ref())? else {
            self.release_host_side(name, Devices::Release).await?;
            let status_changed = matches!(
                rec.status,
                VmStatus::Running | VmStatus::Starting | VmStatus::Stopping | VmStatus::Dead | VmStatus::Failed
            );
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
        self.shut_down(name, &id, "vm.stop", Some(DesiredState::Stopped), p.timeout_s, p.force).await?;
        Ok(true)
    }

    /// Ends the live QEMU `id` of VM `name`: records it `stopping` (for `reason`, with desired
    /// state `desired` when given: `vm.stop` sets it, a reconfigure or host shutdown keeps it),
    /// then ACPI powerdown and up to `timeout_s` for the guest to power off (unless `force`),
    /// else SIGKILL; then its taps, agent session, run dir and passthrough devices go, and the
    /// VM is `stopped`.
    ///
    /// # Errors
    /// 4001 when QEMU could not be ended (the record keeps the process) or devices not given
    /// back.
    pub(super) async fn shut_down(
        &self,
        name: &str,
        id: &crate::process::ProcessIdentity,
        reason: &str,
        desired: Option<DesiredState>,
        timeout_s: u64,
        force: bool,
    ) -> Result<(), ApiError> {
        self.update(name, reason, |r| {
            r.status = VmStatus::Stopping;
            if let Some(state) = desired {
                r.spec.state = state;
            }
        })?;
        let mut exited = false;
        // Why QEMU is killed, when it is.
        let mut killed = "asked to force it".to_string();
        if !force {
            let asked = async {
                let mut qmp = self.qmp(name, Duration::from_secs(5)).await?;
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
            self.processes.kill(name, id).await?;
        }
        let by = reason.strip_suffix(": stopping").unwrap_or(reason);
        let unclean = (!exited).then(|| killed_by(by, &killed));
        let reason = if exited { "guest powered off" } else { "QEMU killed" };
        self.update(name, reason, |r| {
            r.status = VmStatus::Stopped;
            r.process = None;
            // A clean power-off leaves clean disks; a kill leaves them as a power cut would.
            r.unclean_end = unclean;
        })?;
        self.release_host_side(name, Devices::Release).await
    }

    /// `vm.restart`: a stop (same params as `vm.stop`) followed by a start, as one operation.
    ///
    /// # Errors
    /// As `vm.stop` and `vm.start`.
    pub async fn restart(self: &Arc<Self>, p: StopParams) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.restart", vm = %p.name);
        async move {
            check_stop_timeout(&p)?;
            let (guard, _) = self.begin(&p.name)?;
            self.stop_held(&guard, &p).await?;
            self.start_held(&guard, &p.name, "vm.restart").await?;
            Ok(Mutation::new(true, Some(self.get(&p.name)?)))
        }
        .instrument(span)
        .await
    }

    /// `vm.destroy`: kills QEMU, removes overlay, sockets, console log and record.
    ///
    /// # Errors
    /// 4040, 4090, 4001 when QEMU cannot be ended or a file cannot be removed (the record then
    /// says `failed` and keeps what still exists).
    pub async fn destroy(self: &Arc<Self>, name: &str) -> Result<Mutation, ApiError> {
        let span = tracing::info_span!("vm.destroy", vm = %name);
        async move {
            let (guard, _) = self.begin(name)?;
            let kept_disks = self.destroy_held(&guard, name).await?;
            Ok(Mutation { changed: true, vm: None, kept_disks })
        }
        .instrument(span)
        .await
    }

    async fn destroy_held(self: &Arc<Self>, _g: &OpGuard, name: &str) -> Result<Vec<std::path::PathBuf>, ApiError> {
        // Desired stopped too: if the teardown fails, nothing vmhostd does on its own (autostart,
        // the restart policy) starts a VM the operator asked to destroy.
        self.update(name, "vm.destroy", |r| {
            r.status = VmStatus::Destroying;
            r.spec.state = DesiredState::Stopped;
        })?;
        self.crashpoint("destroy:recorded");
        self.teardown(name).await?;
        self.crashpoint("destroy:torn-down");
        let spec = self.record(name)?.spec;
        // The operator asked to destroy the VM: its imported root disk goes with it
        // (keep_on_destroy is a data disk's option only).
        if let Err(e) = self.dispose_root_disk(name) {
            self.mark_failed(name, &e, false);
            return Err(e);
        }
        let kept = match self.dispose_data_disks(&spec) {
            Ok(kept) => kept,
            Err(e) => {
                self.mark_failed(name, &e, false);
                return Err(e);
            }
        };
        self.crashpoint("destroy:disks");
        self.forget(name, "destroyed")?;
        Ok(kept)
    }

    /// Ends the VM's QEMU and removes its run dir, overlay and console log. The record and the
    /// data disks stay (a destroy disposes of them next, a replace keeps them).
    async fn teardown(self: &Arc<Self>, name: &str) -> Result<(), ApiError> {
        let rec = self.record(name)?;
        let live = self.find_live(name, rec.process.as_ref())?;
        if let Some(id) = &live {
            if let Err(e) = self.processes.kill(name, id).await {
                self.mark_failed(name, &e, false);
                return Err(e);
            }
        }
        self.crashpoint("teardown:killed");
        if let Err(e) = self.release_host_side(name, Devices::Release).await {
            self.mark_failed(name, &e, false);
            return Err(e);
        }
        if let Err(err) = self.remove_run_files(name) {
            self.mark_failed(name, &err, false);
            return Err(err);
        }
        self.update(name, "torn down", |r| {
            if live.is_some() {
                // A replace keeps the data disks it wrote.
                r.unclean_end = Some(killed_by("a replace", "it tears the VM down without a power-off"));
            }
            r.process = None;
            r.overlay = None;
        })?;
        Ok(())
    }

    /// `vm.apply`: create when absent; converge the run state (and guest interfaces) when the
    /// spec is equal; change the VM in place, keeping its disk, when anything but `boot.image`
    /// differs ([`Manager::reconfigure`]); replace it (a new disk) only for a `boot.image`
    /// change with `replace`.
    ///
    /// # Errors
    /// As create; 2002 naming `spec.boot.image` (with `details.fields`) for an image change
    /// without `replace`; 2001 for a smaller disk; as [`Manager::reconfigure`]. A refused
    /// change (2001/2002/3002/3003/3004/3005) leaves the VM exactly as it was.
    pub async fn apply(self: &Arc<Self>, p: ApplyParams) -> Result<Mutation, ApiError> {
        let ApplyParams { spec, replace, restart, timeout_s } = p;
        check_stop_timeout(&StopParams { name: spec.name.clone(), timeout_s, force: false })?;
        let vm = validate_spec(&spec, &self.config)?;
        let Ok(current) = self.record(&spec.name) else { return self.create(spec).await };
        super::root_disk::check_root_disk_size(&current, &spec)?;
        let fields = match crate::plan::classify(&current.spec, &spec)? {
            Change::None => {
                // A change recorded with `restart: false` (or just before a crash) is applied now.
                // Disk steps alone (a hot-plug cut short) are done live whatever `restart` says.
                let pending = current.running_spec.as_ref().filter(|running| {
                    current.status == VmStatus::Running && (restart || !crate::plan::restart_needed(running, &spec))
                });
                return match pending {
                    Some(running) => {
                        let fields = crate::plan::spec_drift(running, &spec);
                        let needed = restart && crate::plan::restart_needed(running, &spec);
                        self.reconfigure(vm, fields, needed, restart, timeout_s).await
                    }
                    None => self.converge_unchanged(&current, spec, timeout_s).await,
                };
            }
            Change::Reconfigure { fields, restart: needs_restart } => {
                return self.reconfigure(vm, fields, needs_restart && restart, restart, timeout_s).await;
            }
            Change::Replace { fields } => fields,
        };
        if !replace {
            return Err(crate::plan::replace_needed(&spec.name, &fields));
        }
        self.check_launch_files(&vm).await?;
        let span = tracing::info_span!("vm.replace", vm = %spec.name);
        async move {
            let (guard, current) = self.begin(&spec.name)?;
            self.admit_disk_space(Some(&current.spec), &vm.spec)?;
            if vm.spec.state == DesiredState::Running && (!vm.spec.hardware.is_empty() || !vm.spec.pci.is_empty()) {
                // Capacity and conflicts in place of the old spec first, then the kernel's view
                // of the devices; swap_spec admits again under the lock.
                {
                    let t = self.lock();
                    self.admit_locked(&t, &vm.spec, &[])?;
                }
                self.check_passthrough(&vm.spec).await?;
            }
            // Admission of the new spec in place of the old and the record swap are one step:
            // a refusal leaves the old VM as it was.
            self.swap_spec(&spec.name, &vm.spec)?;
            if let Err(e) = self.teardown(&spec.name).await {
                self.mark_failed(&spec.name, &e, true);
                return Err(e);
            }
            self.create_held(&guard, &vm).await?;
            Ok(Mutation::new(true, Some(self.get(&spec.name)?)))
        }
        .instrument(span)
        .await
    }

    /// `vm.apply` with an unchanged spec: guest interfaces change live, under the VM's busy
    /// flag (recorded, then applied by the agent); then the run state is converged, in the same
    /// call.
    async fn converge_unchanged(
        self: &Arc<Self>,
        current: &crate::state::VmRecord,
        spec: VmSpec,
        timeout_s: u64,
    ) -> Result<Mutation, ApiError> {
        // Guest interfaces change live, under the VM's busy flag: record them, then have the
        // agent apply them. The run state is converged after that, in the same call.
        let interfaces_changed = current.spec.guest_interfaces != spec.guest_interfaces;
        if interfaces_changed {
            let (_guard, _) = self.begin(&spec.name)?;
            let wanted = spec.guest_interfaces.clone();
            self.update(&spec.name, "guest_interfaces", |r| r.spec.guest_interfaces = wanted)?;
            if self.find_live(&spec.name, current.process.as_ref())?.is_some() {
                self.apply_guest_interfaces(&spec.name).await?;
            }
        }
        let up = self.find_live(&spec.name, current.process.as_ref())?.is_some();
        let converge = match spec.state {
            DesiredState::Running => !up,
            DesiredState::Stopped => up || current.spec.state != DesiredState::Stopped,
        };
        match (converge, spec.state) {
            (false, _) => Ok(Mutation::new(interfaces_changed, Some(self.get(&spec.name)?))),
            (true, DesiredState::Running) => self.start(&spec.name).await,
            (true, DesiredState::Stopped) => {
                self.stop(StopParams { name: spec.name.clone(), timeout_s, force: false }).await
            }
        }
    }
}

/// [`crate::state::VmRecord::unclean_end`] after `operation` (`vm.stop`, `host shutdown`, ...)
/// had to kill the VM's QEMU, `why`.
pub(super) fn killed_by(operation: &str, why: &str) -> String {
    format!("{operation} had to kill the VM's QEMU ({why}): its disks are as a power cut leaves them")
}

fn check_stop_timeout(p: &StopParams) -> Result<(), ApiError> {
    check_stop_timeout_s(p.timeout_s)
}

/// `-32602` (invalid params) on `timeout_s` above [`MAX_STOP_TIMEOUT_S`].
pub(super) fn check_stop_timeout_s(timeout_s: u64) -> Result<(), ApiError> {
    if timeout_s > MAX_STOP_TIMEOUT_S {
        return Err(ApiError::new(Code::InvalidParams, format!("timeout_s: at most {MAX_STOP_TIMEOUT_S} seconds"))
            .field("timeout_s"));
    }
    Ok(())
}
