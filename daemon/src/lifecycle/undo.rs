//! The undo stack of a create or a start, written once so the two cannot drift apart.
//!
//! Every step that makes something on the host pushes how to take it back ([`Step`]) onto the
//! operation's [`Undo`]; when a later step fails, [`super::op::VmOp::fail`] takes them back in
//! reverse and records the VM `failed` ([`super::op::VmOp::mark_failed`]). Order of use:
//!
//! 1. [`Undo::new`] when the operation starts (saying whether a failure releases the VM's
//!    reservation);
//! 2. [`Undo::push`] around each step: before a step that records what it makes as it goes
//!    (disks: its undo reads the record), after a step that makes one thing at once;
//! 3. on failure, [`super::op::VmOp::fail`] with the error; on success, drop the stack.
//!
//! The unwind itself is in `op.rs`, not here: this file holds only the stack's data, which
//! `op.rs` uses, so a `VmOp` method here would close an import cycle.
//!
//! The QEMU process is taken back first (it was started last): if it cannot be killed, the
//! unwind stops there and the record keeps the process, so nothing a live QEMU holds (its
//! disks, devices, taps) is taken from under it.

use crate::process::ProcessIdentity;

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
    /// Mirrors into this VM's monitor taps: a capture sync without the VM removes them.
    Capture,
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

    /// The steps to take back, newest first.
    pub fn newest_first(&mut self) -> impl Iterator<Item = Step> + '_ {
        self.steps.drain(..).rev()
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
