//! One operation on one VM, as a value ([`VmOp`]), the way [`super::recover`]'s `Recovery` is
//! one for recovery.
//!
//! Only two steps make one: [`Manager::begin_op`] takes an existing VM's busy flag, and
//! [`Manager::reserve_op`] admits a new VM, writes its record and takes its flag in one step.
//! The operation then carries what each of its steps needs (the VM it holds, a
//! [`HeldVm`]: the manager, the VM's name and paths; the flag; the undo stack), so the steps
//! are its methods, each in the file of the resource it touches (overlay and launch in
//! [`super::launch`], root disk in [`super::root_disk`], data disks in [`super::data_disks`],
//! devices in [`super::vfio`], a running VM's disk changes in [`super::hotplug`]). What an
//! operation shares with the exit cleanup and recovery (giving back, undoing, disposing of
//! what a VM holds) is a method of the held VM instead ([`super::held`]), reached with
//! [`VmOp::held`]. Order of use:
//!
//! 1. begin or reserve;
//! 2. the steps, each pushing how to take back what it made ([`VmOp::push`]) as it succeeds
//!    (or before it runs, for a step that records what it takes as it goes);
//! 3. on the first failure, [`VmOp::fail`]: the stack is unwound newest first and the VM
//!    recorded `failed`, in one call ([`step!`] writes it at each step);
//! 4. the operation is dropped: the flag goes back, and an exit that arrived meanwhile is
//!    handled at once ([`super::busy`]).

use super::held::HeldVm;
use super::processes::Search;
use super::teardown::Devices;
use super::undo::{Step, Undo};
use super::{Manager, OpGuard};
use crate::api::{ApiError, VmSpec, VmStatus};
use crate::qemu::argv::VmPaths;
use crate::state::VmRecord;
use std::sync::Arc;

/// Runs one step of operation `$op`: the step's value, or else `$op` fails ([`VmOp::fail`])
/// and the enclosing function returns the error.
macro_rules! step {
    ($op:expr, $step:expr) => {{
        let result = $step;
        match result {
            Ok(value) => value,
            Err(e) => return Err($op.fail(e).await),
        }
    }};
}
pub(crate) use step;

/// One operation on one VM, holding its busy flag for as long as it lives.
pub(super) struct VmOp {
    /// The VM, held through the flag below.
    held: HeldVm,
    /// What to take back on failure, oldest first.
    undo: Undo,
    /// Dropped last: the flag goes back once everything above is done.
    _guard: OpGuard,
}

impl Manager {
    /// Begins an operation on the existing VM `name`: takes its busy flag. Returns the record as
    /// it was when the flag was taken. A failure of this operation keeps the VM's reservation
    /// unless [`VmOp::release_on_failure`] says otherwise.
    ///
    /// # Errors
    /// As [`Manager::begin`]: 4040 when there is no such VM, 4090 when another operation holds it.
    pub(super) async fn begin_op(self: &Arc<Self>, name: &str) -> Result<(VmOp, VmRecord), ApiError> {
        let (guard, rec) = self.begin(name).await?;
        Ok((self.op(name, guard, false), rec))
    }

    /// Admits `spec` as a new VM and begins its create: capacity and conflicts checked, the
    /// record written (status `creating`), the busy flag taken, all in one step
    /// ([`Manager::reserve_new`]). A failure of this operation releases the reservation.
    ///
    /// # Errors
    /// As [`Manager::reserve_new`]; nothing was recorded.
    pub(super) fn reserve_op(self: &Arc<Self>, spec: &VmSpec) -> Result<VmOp, ApiError> {
        let guard = self.reserve_new(spec, None)?;
        Ok(self.op(&spec.name, guard, true))
    }

    /// [`Manager::reserve_op`] for a migration's destination: the record is written
    /// `incoming` with `migration` in the same step.
    ///
    /// # Errors
    /// As [`Manager::reserve_new`]; nothing was recorded.
    pub(super) fn reserve_incoming_op(
        self: &Arc<Self>,
        spec: &VmSpec,
        migration: crate::state::migration::MigrationRecord,
    ) -> Result<VmOp, ApiError> {
        let guard = self.reserve_new(spec, Some(migration))?;
        Ok(self.op(&spec.name, guard, true))
    }

    fn op(self: &Arc<Self>, name: &str, guard: OpGuard, release: bool) -> VmOp {
        VmOp { held: HeldVm::new(self, name), undo: Undo::new(release), _guard: guard }
    }
}

impl VmOp {
    /// The VM this operation holds, for the steps it shares with what holds a VM without an
    /// operation ([`super::held`]).
    pub fn held(&self) -> &HeldVm {
        &self.held
    }

    /// The VM's name.
    pub fn name(&self) -> &str {
        self.held.name()
    }

    /// The VM's paths.
    pub fn paths(&self) -> &VmPaths {
        self.held.paths()
    }

    /// The manager (host-wide state).
    pub fn mgr(&self) -> &Arc<Manager> {
        self.held.mgr()
    }

    /// Records that `step` must be taken back if the operation fails.
    pub fn push(&mut self, step: Step) {
        self.undo.push(step);
    }

    /// Whether a failure releases the VM's reservation (a step undoes more then: the overlay).
    pub fn releases(&self) -> bool {
        self.undo.releases()
    }

    /// From now on a failure releases the VM's reservation too (a replace that swapped the
    /// spec in, a start that reserved the VM again).
    pub fn release_on_failure(&mut self) {
        self.undo.release_on_failure();
    }

    /// The VM's record as it is now ([`HeldVm::record`]).
    ///
    /// # Errors
    /// 4040 when the record is gone.
    pub fn record(&self) -> Result<VmRecord, ApiError> {
        self.held.record()
    }

    /// Changes the VM's record ([`HeldVm::update`]); the status stays.
    ///
    /// # Errors
    /// 4040 when the record is gone; 4001 when it cannot be written.
    pub fn update(&self, reason: &str, change: impl FnOnce(&mut VmRecord)) -> Result<VmRecord, ApiError> {
        self.held.update(reason, change)
    }

    /// Changes the VM's status to `to` and its record with `change` ([`HeldVm::update_status`]).
    ///
    /// # Errors
    /// As [`VmOp::update`]; 5000 when the table refuses the change.
    pub fn update_status(
        &self,
        reason: &str,
        to: VmStatus,
        change: impl FnOnce(&mut VmRecord),
    ) -> Result<VmRecord, ApiError> {
        self.held.update_status(reason, to, change)
    }

    /// A step boundary the fault tests may crash the daemon at ([`crate::crashpoint`]).
    pub fn crashpoint(&self, step: &str) {
        self.mgr().crashpoint(step);
    }

    /// The operation failed with `error`: takes back what its steps made, newest first, and
    /// records the VM `failed` (releasing its reservation if the stack says so). Returns the
    /// error to report: `error`, or the kill's when QEMU could not be ended (the unwind stops
    /// there and the record keeps the process, so nothing a live QEMU holds is taken from under
    /// it). The stack is empty afterwards.
    pub async fn fail(&mut self, error: ApiError) -> ApiError {
        let mut undo = std::mem::replace(&mut self.undo, Undo::new(false));
        let held = &self.held;
        let (mgr, name) = (held.mgr(), held.name());
        for step in undo.newest_first() {
            match step {
                Step::Process(id) => {
                    if let Err(kill) = mgr.processes.kill(name, &id).await {
                        self.mark_failed_keeping_process(&kill);
                        return kill;
                    }
                    if let Err(e) = held.update("launch undone", |r| r.process = None) {
                        tracing::error!(vm = name, error = %e, "rollback: cannot record that QEMU is gone");
                    }
                }
                Step::Devices => {
                    // Only when no QEMU of this VM can still hold them.
                    let recorded = held.record().ok().and_then(|r| r.process);
                    if matches!(mgr.processes.find(held.paths(), recorded.as_ref(), Search::Proc), Ok(None)) {
                        if let Err(e) = held.release_passthrough().await {
                            tracing::error!(vm = name, error = %e, "rollback: passthrough devices not restored");
                        }
                    }
                }
                Step::HostSide => {
                    let _ = held.release_host_side(Devices::Keep).await;
                }
                Step::Capture => {
                    super::capture::sync_without(held.mgr(), held.name()).await;
                }
                Step::DataDisks => held.undo_data_disks(),
                Step::RootDisk => held.undo_root_disk(),
                Step::Overlay => self.undo_overlay(),
            }
        }
        self.mark_failed(&error, undo.releases());
        error
    }

    /// Records the operation failed with `e` (the process gone, the reservation released with
    /// `release`). A record that cannot be written is logged: the error to report is `e`.
    pub(super) fn mark_failed(&self, e: &ApiError, release: bool) {
        let le = super::last_error(e);
        if let Err(save) = self.update_status("failed", VmStatus::Failed, |r| {
            r.process = None;
            r.last_error = Some(le);
            if release {
                r.reserved = false;
            }
        }) {
            tracing::error!(vm = self.name(), error = %save, "cannot record the failure");
        }
    }

    /// Records the VM `failed` with `e` while its QEMU may still run: the process stays
    /// recorded, so nothing treats the VM as stopped.
    fn mark_failed_keeping_process(&self, e: &ApiError) {
        let le = super::last_error(e);
        if let Err(save) = self.update_status("failed", VmStatus::Failed, |r| {
            r.last_error = Some(le);
        }) {
            tracing::error!(vm = self.name(), error = %save, "cannot record the failure");
        }
    }
}
