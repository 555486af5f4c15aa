//! The VM operations of API v1: create, start, stop, restart, destroy, apply.
//!
//! Each public operation takes the VM's busy flag first and then calls an `*_held` step that
//! assumes the flag is held, so compound operations (restart, apply with replace) run their
//! steps without letting another operation in between.

use super::op::{step, VmOp};
use super::registry::Change as RecordChange;
use super::root_disk::Import;
use super::teardown::Devices;
use super::Manager;
use crate::api::{ApiError, ApplyParams, Code, DesiredState, Mutation, StopParams, VmSpec, VmStatus};
use crate::plan::Change;
use crate::validate::{validate_spec, ValidSpec};
use std::sync::Arc;
use tracing::Instrument;

/// Longest graceful-stop wait accepted; the busy flag is held that long.
pub const MAX_STOP_TIMEOUT_S: u64 = 3600;

/// `vm.create`: defines the VM and, unless `spec.state` is `stopped`, starts it.
///
/// # Errors
/// 2001/3001 invalid spec, 3002/3003 refused by capacity or conflicts, 4002 when the QEMU
/// binary is not the pinned one (nothing changed for any of these), 4001 when a host step
/// fails (everything undone, the record says `failed`).
pub(crate) async fn create(mgr: &Arc<Manager>, spec: VmSpec) -> Result<Mutation, ApiError> {
    let name = spec.name.clone();
    let op = create_held(mgr, spec).await?;
    drop(op);
    Ok(Mutation::new(true, Some(mgr.get(&name)?)))
}

/// [`create`]'s steps, returning the new VM's operation still held: `vm.import` puts the VM's
/// TPM state and UEFI variables store in place before anything can start it.
///
/// # Errors
/// As [`create`].
pub(super) async fn create_held(mgr: &Arc<Manager>, spec: VmSpec) -> Result<VmOp, ApiError> {
    let span = tracing::info_span!("vm.create", vm = %spec.name);
    async move {
        let vm = validate_spec(&spec, &mgr.config)?;
        super::launch::check_launch_files(mgr, &vm).await?;
        // A boot.disk file is checked (and its growth admitted) before anything is recorded.
        let import = super::root_disk::inspect_import(mgr, &vm).await?;
        match &import {
            Some(import) => super::root_disk::admit_import(mgr, &vm.spec, import)?,
            None => super::data_disks::admit_disk_space(mgr, None, &vm.spec)?,
        }
        if vm.spec.state == DesiredState::Running && (!vm.spec.hardware.is_empty() || !vm.spec.pci.is_empty()) {
            // Capacity and conflicts first (what the records say), then what the kernel says
            // about the devices; both before anything is recorded. reserve_new admits again
            // under the lock, so nothing can slip in between.
            mgr.precheck_admission(&vm.spec)?;
            super::vfio::check_passthrough(mgr, &vm.spec).await?;
        }
        if vm.spec.state == DesiredState::Running {
            // Capture sources present and free of passthrough (3001/3003), where it would run
            // (3001/3002), before anything is recorded.
            super::capture::check_sources(mgr, &vm.spec).await?;
            super::placement::check(mgr, &vm.spec)?;
        }
        let mut op = mgr.reserve_op(&vm.spec)?;
        op.create_steps(&vm, import).await?;
        Ok(op)
    }
    .instrument(span)
    .await
}

/// `vm.start`.
///
/// # Errors
/// 4040, 4090, 3002/3003 when a VM whose reservation was released no longer fits, 4002
/// when the QEMU binary is not the pinned one, 4001.
pub(crate) async fn start(mgr: &Arc<Manager>, name: &str) -> Result<Mutation, ApiError> {
    let span = tracing::info_span!("vm.start", vm = %name);
    async move {
        let (mut op, _) = mgr.begin_op(name).await?;
        let changed = op.start_steps("vm.start").await?;
        // An operator's start begins the restart policy's count afresh.
        mgr.update(name, "vm.start", |r| r.failures.clear())?;
        Ok(Mutation::new(changed, Some(mgr.get(name)?)))
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
    mgr: &Arc<Manager>,
    why: &str,
    name: &str,
    statuses: &[VmStatus],
) -> Result<Option<Mutation>, ApiError> {
    let span = tracing::info_span!("vm.start", vm = %name, why);
    async move {
        let (mut op, rec) = mgr.begin_op(name).await?;
        if rec.spec.state != DesiredState::Running || !statuses.contains(&rec.status) {
            return Ok(None);
        }
        let changed = op.start_steps(why).await?;
        Ok(Some(Mutation::new(changed, Some(mgr.get(name)?))))
    }
    .instrument(span)
    .await
}

/// `vm.stop`: ACPI powerdown over QMP (or the exec server's `guest.shutdown` with `method:
/// "agent"`, for the API peer `peer_uid`), SIGKILL after `timeout_s` (at once with `force`).
///
/// # Errors
/// 2001 for a timeout above [`MAX_STOP_TIMEOUT_S`], 4040, 4090, 4001 when QEMU could not be
/// ended (the record then keeps the process).
pub(crate) async fn stop(mgr: &Arc<Manager>, p: StopParams, peer_uid: u32) -> Result<Mutation, ApiError> {
    let span = tracing::info_span!("vm.stop", vm = %p.name);
    async move {
        check_stop_timeout(&p)?;
        let (mut op, _) = mgr.begin_op(&p.name).await?;
        let changed = op.stop_steps(&p, peer_uid).await?;
        Ok(Mutation::new(changed, Some(mgr.get(&p.name)?)))
    }
    .instrument(span)
    .await
}

/// `vm.restart`: a stop (same params as `vm.stop`) followed by a start, as one operation.
///
/// # Errors
/// As `vm.stop` and `vm.start`.
pub(crate) async fn restart(mgr: &Arc<Manager>, p: StopParams, peer_uid: u32) -> Result<Mutation, ApiError> {
    let span = tracing::info_span!("vm.restart", vm = %p.name);
    async move {
        check_stop_timeout(&p)?;
        let (mut op, _) = mgr.begin_op(&p.name).await?;
        op.stop_steps(&p, peer_uid).await?;
        op.start_steps("vm.restart").await?;
        Ok(Mutation::new(true, Some(mgr.get(&p.name)?)))
    }
    .instrument(span)
    .await
}

/// `vm.destroy`: kills QEMU, removes overlay, sockets, console log and record.
///
/// # Errors
/// 4040, 4090, 4001 when QEMU cannot be ended or a file cannot be removed (the record then
/// says `failed` and keeps what still exists).
pub(crate) async fn destroy(mgr: &Arc<Manager>, name: &str) -> Result<Mutation, ApiError> {
    let span = tracing::info_span!("vm.destroy", vm = %name);
    async move {
        let (mut op, _) = mgr.begin_op(name).await?;
        let kept_disks = op.destroy_steps("vm.destroy", "destroyed").await?;
        Ok(Mutation { changed: true, vm: None, kept_disks })
    }
    .instrument(span)
    .await
}

/// `vm.apply`: create when absent; converge the run state (and guest interfaces) when the
/// spec is equal; change the VM in place, keeping its disk, when anything but `boot.image`
/// differs ([`super::reconfigure::reconfigure`]); replace it (a new disk) only for a `boot.image`
/// change with `replace`.
///
/// # Errors
/// As create; 2002 naming `spec.boot.image` (with `details.fields`) for an image change
/// without `replace`; 2001 for a smaller disk; as [`super::reconfigure::reconfigure`]. A refused
/// change (2001/2002/3002/3003/3004/3005) leaves the VM exactly as it was.
pub(crate) async fn apply(mgr: &Arc<Manager>, p: ApplyParams) -> Result<Mutation, ApiError> {
    let ApplyParams { spec, replace, restart, timeout_s } = p;
    check_stop_timeout(&StopParams { name: spec.name.clone(), timeout_s, force: false, method: Default::default() })?;
    let vm = validate_spec(&spec, &mgr.config)?;
    let Ok(current) = mgr.record(&spec.name) else { return create(mgr, spec).await };
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
                    super::reconfigure::reconfigure(mgr, vm, fields, needed, restart, timeout_s).await
                }
                None => converge_unchanged(mgr, &current, spec, timeout_s).await,
            };
        }
        Change::Reconfigure { fields, restart: needs_restart } => {
            return super::reconfigure::reconfigure(mgr, vm, fields, needs_restart && restart, restart, timeout_s)
                .await;
        }
        Change::Replace { fields } => fields,
    };
    if !replace {
        return Err(crate::plan::replace_needed(&spec.name, &fields));
    }
    super::launch::check_launch_files(mgr, &vm).await?;
    let span = tracing::info_span!("vm.replace", vm = %spec.name);
    async move {
        let (mut op, current) = mgr.begin_op(&spec.name).await?;
        current.check_not_moving()?;
        super::data_disks::admit_disk_space(mgr, Some(&current.spec), &vm.spec)?;
        if vm.spec.state == DesiredState::Running && (!vm.spec.hardware.is_empty() || !vm.spec.pci.is_empty()) {
            // Capacity and conflicts in place of the old spec first, then the kernel's view
            // of the devices; swap_spec admits again under the lock.
            {
                let t = mgr.lock();
                mgr.admit_locked(&t, &vm.spec, &[])?;
            }
            super::vfio::check_passthrough(mgr, &vm.spec).await?;
        }
        if vm.spec.state == DesiredState::Running {
            super::capture::check_sources(mgr, &vm.spec).await?;
        }
        // Admission of the new spec in place of the old and the record swap are one step:
        // a refusal leaves the old VM as it was.
        op.swap_spec(&vm.spec)?;
        op.replace_steps(&vm).await?;
        Ok(Mutation::new(true, Some(mgr.get(&spec.name)?)))
    }
    .instrument(span)
    .await
}

/// `vm.apply` with an unchanged spec: guest interfaces and SSH access change live, under the
/// VM's busy flag (recorded, then applied by the agent or written by the exec server); then
/// the run state is converged, in the same call.
async fn converge_unchanged(
    mgr: &Arc<Manager>,
    current: &crate::state::VmRecord,
    spec: VmSpec,
    timeout_s: u64,
) -> Result<Mutation, ApiError> {
    // Guest interfaces change live, under the VM's busy flag: record them, then have the
    // agent apply them. The run state is converged after that, in the same call.
    let interfaces_changed = current.spec.guest_interfaces != spec.guest_interfaces;
    if interfaces_changed {
        let (op, _) = mgr.begin_op(&spec.name).await?;
        let wanted = spec.guest_interfaces.clone();
        op.update("guest_interfaces", |r| r.spec.guest_interfaces = wanted)?;
        if op.find_live(current.process.as_ref())?.is_some() {
            super::agent::apply_guest_interfaces(mgr, &spec.name).await?;
        }
    }
    // SSH access changes live the same way, through the exec server.
    let ssh_changed = current.spec.ssh != spec.ssh;
    if ssh_changed {
        let (op, _) = mgr.begin_op(&spec.name).await?;
        let wanted = spec.ssh.clone();
        op.update("ssh", |r| r.spec.ssh = wanted)?;
        if op.find_live(current.process.as_ref())?.is_some() {
            super::housekeeping::authorize_ssh(mgr, &spec.name).await?;
        }
    }
    let up = super::launch::find_live(mgr, &spec.name, current.process.as_ref())?.is_some();
    let converge = match spec.state {
        DesiredState::Running => !up,
        DesiredState::Stopped => up || current.spec.state != DesiredState::Stopped,
    };
    match (converge, spec.state) {
        (false, _) => Ok(Mutation::new(interfaces_changed || ssh_changed, Some(mgr.get(&spec.name)?))),
        (true, DesiredState::Running) => start(mgr, &spec.name).await,
        (true, DesiredState::Stopped) => {
            let p = StopParams { name: spec.name.clone(), timeout_s, force: false, method: Default::default() };
            stop(mgr, p, super::housekeeping::own_uid()).await
        }
    }
}

impl VmOp {
    /// `vm.create` after its record is written ([`Manager::reserve_op`]), step by step. The
    /// first failure before QEMU runs unwinds every step before it and records the VM `failed`
    /// with its reservation released; `import` is the `boot.disk` file inspected before.
    ///
    /// # Errors
    /// 4001 naming the step that failed (everything undone); a record write error after QEMU
    /// runs (the VM is left as recorded).
    async fn create_steps(&mut self, vm: &ValidSpec, import: Option<Import>) -> Result<(), ApiError> {
        // A new VM never inherits a stranger's files of its name.
        step!(self, self.clear_orphan_disks());
        if let Some(import) = import {
            step!(self, self.import_root_disk(&vm.spec, import).await);
        }
        self.build(vm).await
    }

    /// A replace (`vm.apply` of a new `boot.image` with `replace`), the new spec swapped in:
    /// the old QEMU and overlay go ([`VmOp::teardown`]; the data disks stay), then the
    /// create's steps build the new VM. A failure releases the reservation.
    ///
    /// # Errors
    /// As [`VmOp::create_steps`].
    async fn replace_steps(&mut self, vm: &ValidSpec) -> Result<(), ApiError> {
        self.release_on_failure();
        step!(self, self.teardown().await);
        self.build(vm).await
    }

    /// The host steps a create and a replace share: overlay, data disks, then QEMU (or the
    /// record `stopped` for a VM created stopped). Undoing them removes only what they made and
    /// returns the data disks they took back.
    async fn build(&mut self, vm: &ValidSpec) -> Result<(), ApiError> {
        self.crashpoint("create:recorded");
        step!(self, self.remove_stale_overlays());
        step!(self, self.make_overlay(vm).await);
        self.crashpoint("create:overlay");
        step!(self, self.make_data_disks(&vm.spec, true).await);
        self.crashpoint("create:disks");
        if vm.spec.state == DesiredState::Stopped {
            self.mgr().update_status(self.name(), "created stopped", VmStatus::Stopped, |_| {})?;
        } else {
            let id = step!(self, self.launch(vm, VmStatus::Creating).await);
            self.held().mark_running(id, "vm.create")?;
            self.crashpoint("create:running");
        }
        // Done: what the steps made is the VM's now.
        self.held().end_root_disk_import()?;
        self.held().end_disk_tracking()
    }

    /// The steps of a start (`reason` is the events' reason): an already live QEMU is adopted;
    /// else boot files and devices checked, the reservation taken again if a failed create
    /// released it, overlay, root disk, data disks, QEMU. A failure unwinds what this start
    /// made and records the VM `failed` (releasing the reservation if this start took it).
    ///
    /// # Errors
    /// As `vm.start`.
    pub(super) async fn start_steps(&mut self, reason: &str) -> Result<bool, ApiError> {
        let mgr = Arc::clone(self.mgr());
        let name = self.name().to_string();
        let name = name.as_str();
        let rec = self.record()?;
        super::snapshots::check_not_reverting(&rec)?;
        rec.check_not_moving()?;
        let state_changed = rec.spec.state != DesiredState::Running;
        if let Some(id) = self.find_live(rec.process.as_ref())? {
            if state_changed || rec.status != VmStatus::Running {
                self.update(reason, |r| r.spec.state = DesiredState::Running)?;
                self.held().mark_running(id, "already running")?;
                return Ok(true);
            }
            return Ok(false);
        }
        let mut spec = rec.spec.clone();
        spec.state = DesiredState::Running;
        let vm = validate_spec(&spec, &mgr.config)?;
        super::launch::check_launch_files(&mgr, &vm).await?;
        super::vfio::check_passthrough(&mgr, &vm.spec).await?;
        super::capture::check_sources(&mgr, &vm.spec).await?;
        super::placement::check(&mgr, &vm.spec)?;
        if rec.reserved {
            self.update(reason, |r| r.spec.state = DesiredState::Running)?;
        } else {
            self.reserve_existing()?;
            self.release_on_failure();
        }
        step!(self, self.make_overlay(&vm).await);
        // A boot.disk VM whose failed create gave its disk back imports it again.
        step!(self, self.ensure_root_disk(&vm).await);
        // A disk added while the VM was stopped is made now; one a change dropped goes only
        // once the new spec runs (a failed restart rolls back to the spec that still has it).
        step!(self, self.make_data_disks(&vm.spec, false).await);
        let pending_from = rec.running_spec.clone();
        let id = step!(self, self.launch(&vm, VmStatus::Starting).await);
        self.held().mark_running(id, reason)?;
        self.held().end_root_disk_import()?;
        if let Some(previous) = pending_from {
            if let Err(e) = self.retire_data_disks(&previous, &vm.spec) {
                tracing::error!(vm = name, error = %e.message, "a dropped data disk stays in place");
            }
        }
        Ok(true)
    }

    /// The steps of a stop: a live QEMU is shut down ([`VmOp::shut_down`]); else what the
    /// VM still holds on the host is given back and the record says `stopped`.
    ///
    /// # Errors
    /// As `vm.stop`.
    pub(super) async fn stop_steps(&mut self, p: &StopParams, peer_uid: u32) -> Result<bool, ApiError> {
        let rec = self.record()?;
        rec.check_not_moving()?;
        let state_changed = rec.spec.state != DesiredState::Stopped;
        let Some(id) = self.find_live(rec.process.as_ref())? else {
            self.held().release_host_side(Devices::Release).await?;
            let status_changed = matches!(
                rec.status,
                VmStatus::Running | VmStatus::Starting | VmStatus::Stopping | VmStatus::Dead | VmStatus::Failed
            );
            if state_changed || status_changed {
                let to = if status_changed { VmStatus::Stopped } else { rec.status };
                self.update_status("vm.stop", to, |r| {
                    r.spec.state = DesiredState::Stopped;
                    r.process = None;
                })?;
                return Ok(true);
            }
            return Ok(false);
        };
        let how = super::housekeeping::PowerOff::of(p.force, p.method, peer_uid);
        self.shut_down(&id, "vm.stop", Some(DesiredState::Stopped), p.timeout_s, how).await?;
        Ok(true)
    }

    /// The steps of a destroy: recorded `destroying` (`why`), QEMU and run files gone, the root
    /// disk and data disks disposed of, the record deleted (`gone`: the event's reason). Returns
    /// the data disks kept. Also how a migration's source ends the VM once the destination
    /// committed ([`super::migrate::outgoing`]).
    ///
    /// # Errors
    /// As `vm.destroy` (the record then says `failed` and keeps what still exists).
    pub(super) async fn destroy_steps(&mut self, why: &str, gone: &str) -> Result<Vec<std::path::PathBuf>, ApiError> {
        let mgr = Arc::clone(self.mgr());
        let name = self.name().to_string();
        let name = name.as_str();
        // Desired stopped too: if the teardown fails, nothing vmhostd does on its own (autostart,
        // the restart policy) starts a VM the operator asked to destroy.
        self.update_status(why, VmStatus::Destroying, |r| {
            r.spec.state = DesiredState::Stopped;
        })?;
        mgr.crashpoint("destroy:recorded");
        self.teardown().await?;
        mgr.crashpoint("destroy:torn-down");
        let spec = self.record()?.spec;
        // The operator asked to destroy the VM: its imported root disk goes with it
        // (keep_on_destroy is a data disk's option only).
        step!(self, self.held().dispose_root_disk());
        let kept = step!(self, self.held().dispose_data_disks(&spec));
        mgr.crashpoint("destroy:disks");
        mgr.forget(name, gone)?;
        Ok(kept)
    }

    /// Ends the VM's QEMU and removes its run dir, overlay and console log. The record and the
    /// data disks stay (a destroy disposes of them next, a replace keeps them).
    ///
    /// # Errors
    /// 4001 when QEMU cannot be ended or a file cannot be removed: the record then says
    /// `failed` (reservation kept) and keeps what still exists.
    pub(super) async fn teardown(&self) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr(), self.name());
        let rec = self.record()?;
        let live = self.find_live(rec.process.as_ref())?;
        if let Some(id) = &live {
            if let Err(e) = mgr.processes.kill(name, id).await {
                self.mark_failed(&e, false);
                return Err(e);
            }
        }
        self.crashpoint("teardown:killed");
        // Its swtpm ends with QEMU; it must be gone before the state may be removed.
        crate::tpm::stop(name, rec.tpm_process.as_ref()).await;
        if let Err(e) = self.held().release_host_side(Devices::Release).await {
            self.mark_failed(&e, false);
            return Err(e);
        }
        if let Err(err) = self.held().remove_run_files() {
            self.mark_failed(&err, false);
            return Err(err);
        }
        self.update("torn down", |r| {
            if live.is_some() {
                // A replace keeps the data disks it wrote.
                r.unclean_end = Some(killed_by("a replace", "it tears the VM down without a power-off"));
            }
            r.process = None;
            r.overlay = None;
            r.tpm_process = None;
        })?;
        Ok(())
    }

    /// Re-reserves the resources of the VM, whose reservation was released (a failed create):
    /// admission and the record write happen under one lock, like a create.
    ///
    /// # Errors
    /// 3002/3003 from admission (nothing written), or the record cannot be written.
    fn reserve_existing(&self) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr(), self.name());
        mgr.registry.write(name, "reserved again", |t| {
            let old = t.vms.get(name).cloned().ok_or_else(|| ApiError::not_found(name))?;
            let mut rec = old.clone();
            rec.spec.state = DesiredState::Running;
            rec.nics = mgr.admit_locked(t, &rec.spec, &old.nics)?;
            rec.reserved = true;
            Ok((RecordChange::Put(Box::new(rec)), ()))
        })?;
        Ok(())
    }

    /// Replaces the VM's spec by `spec` in one step under the allocation lock: the new spec is
    /// admitted in place of the old, and the record (status `creating`) keeps the old process
    /// and overlay so [`VmOp::teardown`] can end them. After a crash, recovery undoes the
    /// interrupted create; the new spec stays recorded as `failed`. The new root disk is a new
    /// cloud-init instance: the record gets a new instance id.
    ///
    /// # Errors
    /// 4090 when the VM's disks are part reverted, 3002/3003 from admission (nothing written),
    /// or the record cannot be written.
    fn swap_spec(&self, spec: &VmSpec) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr(), self.name());
        let instance_id = super::new_instance_id(name)?;
        mgr.registry.write(name, "vm.apply replace", |t| {
            let old = t.vms.get(name).cloned().ok_or_else(|| ApiError::not_found(name))?;
            // A replace keeps the data disks, which may be part reverted.
            super::snapshots::check_not_reverting(&old)?;
            let mut rec = crate::state::VmRecord::new(spec.clone());
            rec.nics = mgr.admit_locked(t, spec, &[])?;
            rec.process = old.process.clone();
            rec.overlay = old.overlay.clone();
            rec.vfio = old.vfio.clone();
            rec.instance_id = Some(instance_id);
            // The data disks stay, as the old QEMU left them.
            rec.unclean_end = old.unclean_end.clone();
            Ok((RecordChange::Put(Box::new(rec)), ()))
        })?;
        Ok(())
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
