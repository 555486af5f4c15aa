//! The undo stack of a create or a start, written once so the two cannot drift apart.
//!
//! Every step that makes something on the host pushes how to take it back ([`Step`]) onto the
//! operation's [`Undo`]; when a later step fails, [`Manager::unwind`] takes them back in
//! reverse and records the VM `failed`. Order of use:
//!
//! 1. [`Undo::new`] when the operation starts (saying whether a failure releases the VM's
//!    reservation);
//! 2. [`Undo::push`] around each step: before a step that records what it makes as it goes
//!    (disks: its undo reads the record), after a step that makes one thing at once;
//! 3. on failure, [`Manager::unwind`] with the error; on success, drop the stack.
//!
//! [`Manager::unwind`] stays a [`Manager`] method taking the VM's name: [`super::op::VmOp::fail`]
//! is its one caller, handing it the stack it takes out of the operation.
//!
//! The QEMU process is taken back first (it was started last): if it cannot be killed, the
//! unwind stops there and the record keeps the process, so nothing a live QEMU holds (its
//! disks, devices, taps) is taken from under it.

use super::processes::Search;
use super::teardown::Devices;
use super::Manager;
use crate::api::{ApiError, VmStatus};
use crate::process::ProcessIdentity;
use std::sync::Arc;

/// One thing a create or start made, and so must take back on failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// The overlay (and the seed) made for this VM: removed, the record stops naming it.
    Overlay,
    /// A root disk being imported (`boot.disk`): given back to the import directory.
    RootDisk,
    /// Data disks the record lists as made or taken back by this operation: deleted, or moved
    /// back to the kept disks.
    DataDisks,
    /// The run dir, then the taps and the agent session ([`super::teardown`]).
    HostSide,
    /// Passthrough devices bound to vfio-pci: given back, once no QEMU of the VM runs.
    Devices,
    /// The QEMU process: killed.
    Process(ProcessIdentity),
}

/// The steps of one operation, oldest first.
#[derive(Debug)]
pub(super) struct Undo {
    steps: Vec<Step>,
    /// Whether a failure releases the VM's reservation (a create, or a start that took it).
    release: bool,
}

impl Undo {
    /// An empty stack; `release`: whether a failure releases the VM's reservation.
    pub fn new(release: bool) -> Undo {
        Undo { steps: Vec::new(), release }
    }

    /// Records that `step` must be taken back if the operation fails.
    pub fn push(&mut self, step: Step) {
        self.steps.push(step);
    }

    /// Whether a failure releases the VM's reservation.
    pub fn releases(&self) -> bool {
        self.release
    }

    /// From now on a failure releases the VM's reservation too.
    pub fn release_on_failure(&mut self) {
        self.release = true;
    }
}

impl Manager {
    /// Takes back what `undo` lists, newest first, then records VM `name` `failed` with `error`
    /// (releasing its reservation if the stack says so). Returns the error to report: `error`,
    /// or the kill's when QEMU could not be ended (the unwind stops there and the record keeps
    /// the process).
    pub(super) async fn unwind(self: &Arc<Self>, name: &str, undo: Undo, error: ApiError) -> ApiError {
        for step in undo.steps.into_iter().rev() {
            match step {
                Step::Process(id) => {
                    if let Err(kill) = self.processes.kill(name, &id).await {
                        self.mark_failed_keeping_process(name, &kill);
                        return kill;
                    }
                    if let Err(e) = self.update(name, "launch undone", |r| r.process = None) {
                        tracing::error!(vm = name, error = %e, "rollback: cannot record that QEMU is gone");
                    }
                }
                Step::Devices => {
                    // Only when no QEMU of this VM can still hold them.
                    let recorded = self.record(name).ok().and_then(|r| r.process);
                    if matches!(self.processes.find(&self.paths(name), recorded.as_ref(), Search::Proc), Ok(None)) {
                        if let Err(e) = self.release_passthrough(name).await {
                            tracing::error!(vm = name, error = %e, "rollback: passthrough devices not restored");
                        }
                    }
                }
                Step::HostSide => {
                    let _ = self.release_host_side(name, Devices::Keep).await;
                }
                Step::DataDisks => self.undo_data_disks(name),
                Step::RootDisk => self.undo_root_disk(name),
                Step::Overlay => self.undo_overlay(name),
            }
        }
        self.mark_failed(name, &error, undo.release);
        error
    }

    /// Records a failed operation on `name`.
    pub(super) fn mark_failed(&self, name: &str, e: &ApiError, release: bool) {
        let le = super::last_error(e);
        if let Err(save) = self.update_status(name, "failed", VmStatus::Failed, |r| {
            r.process = None;
            r.last_error = Some(le);
            if release {
                r.reserved = false;
            }
        }) {
            tracing::error!(vm = name, error = %save, "cannot record the failure");
        }
    }

    /// Records VM `name` `failed` with `e` while its QEMU may still run: the process stays
    /// recorded, so nothing treats the VM as stopped.
    fn mark_failed_keeping_process(&self, name: &str, e: &ApiError) {
        let le = super::last_error(e);
        if let Err(save) = self.update_status(name, "failed", VmStatus::Failed, |r| {
            r.last_error = Some(le);
        }) {
            tracing::error!(vm = name, error = %save, "cannot record the failure");
        }
    }
}
