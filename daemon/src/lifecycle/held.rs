//! One VM that its caller holds exclusively, as a value ([`HeldVm`]): the manager, the VM's name
//! and its paths, computed once.
//!
//! Three kinds of code hold a VM exclusively: an operation ([`super::op::VmOp`], through its
//! busy flag), the exit watcher's cleanup ([`super::exits`], through the flag it takes with the
//! exit's record, `busy::Holder::ExitCleanup`), and recovery ([`super::recover`], which runs
//! before the daemon serves, so nothing else can hold the VM yet). What they share, the steps
//! that give back or settle what a VM holds, is written once as methods of this type, each in
//! the file of the resource it touches: data disks ([`super::data_disks`]: the undo of a
//! create's disks, their end of tracking, their disposal), a hot-plug cut short
//! ([`super::hotplug`]), the running mark ([`super::launch`]), the root disk
//! ([`super::root_disk`]: end of import, undo, disposal), the snapshots ([`super::snapshots`]),
//! the run dir, taps and run files ([`super::teardown`]) and the passthrough devices
//! ([`super::vfio`]).
//!
//! Who makes one: [`HeldVm::new`], which trusts its caller to hold the VM: the exit cleanup
//! once it has the flag, recovery, and the making of an operation (`Manager::begin_op`,
//! `Manager::reserve_op`, with the flag just taken), whose steps reach it with `VmOp::held`.
//! Nothing else may: the methods change the VM's files and record without taking its flag.
//!
//! Order of use (each method's doc says who calls it):
//!
//! 1. made, or borrowed from the operation;
//! 2. a VM that runs: `mark_running` once its QEMU is up (recovery re-adopting one first
//!    settles a hot-plug cut short, `settle_hotplug`), then `end_root_disk_import` and
//!    `end_disk_tracking`: what the operation made is the VM's;
//! 3. once no QEMU of the VM runs: `release_host_side` (run dir, taps, agent, devices), then,
//!    for a VM whose disks go too, `remove_run_files`;
//! 4. the disks: `undo_data_disks` then `undo_root_disk` for a create or start taken back;
//!    `dispose_root_disk` then `dispose_data_disks` (with the snapshots) for a destroy;
//! 5. dropped: it takes no flag itself; the caller's flag (or recovery's turn) is what holds
//!    the VM.

use super::Manager;
use crate::api::{ApiError, VmStatus};
use crate::qemu::argv::VmPaths;
use crate::state::VmRecord;
use std::sync::Arc;

/// One VM its caller holds exclusively (see the module doc).
pub(super) struct HeldVm {
    mgr: Arc<Manager>,
    name: String,
    paths: VmPaths,
}

impl HeldVm {
    /// The VM `name`, which the caller holds: the exit cleanup with its busy flag taken,
    /// recovery before the daemon serves, an operation being made with its flag taken (its
    /// steps then use `VmOp::held`).
    pub(super) fn new(mgr: &Arc<Manager>, name: &str) -> HeldVm {
        HeldVm { mgr: Arc::clone(mgr), name: name.to_string(), paths: mgr.paths(name) }
    }

    /// The VM's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The VM's paths.
    pub fn paths(&self) -> &VmPaths {
        &self.paths
    }

    /// The manager (host-wide state).
    pub fn mgr(&self) -> &Arc<Manager> {
        &self.mgr
    }

    /// The VM's record as it is now ([`Manager::record`]).
    ///
    /// # Errors
    /// 4040 when the record is gone.
    pub fn record(&self) -> Result<VmRecord, ApiError> {
        self.mgr.record(&self.name)
    }

    /// Changes the VM's record ([`Manager::update`]); the status stays.
    ///
    /// # Errors
    /// 4040 when the record is gone; 4001 when it cannot be written.
    pub fn update(&self, reason: &str, change: impl FnOnce(&mut VmRecord)) -> Result<VmRecord, ApiError> {
        self.mgr.update(&self.name, reason, change)
    }

    /// Changes the VM's status to `to` and its record with `change`, checked against the
    /// transition table ([`Manager::update_status`]).
    ///
    /// # Errors
    /// As [`HeldVm::update`]; 5000 when the table refuses the change.
    pub fn update_status(
        &self,
        reason: &str,
        to: VmStatus,
        change: impl FnOnce(&mut VmRecord),
    ) -> Result<VmRecord, ApiError> {
        self.mgr.update_status(&self.name, reason, to, change)
    }
}
