//! The per-VM busy flags, and the exits that arrive while a flag is held.
//!
//! One operation at a time holds a VM ([`super::OpGuard`]); a second one gets 4090. The exit
//! watcher ([`super::exits`]) must not act on a VM an operation holds (the operation may be the
//! one ending QEMU, or starting a new one), so an exit that finds the flag taken is queued
//! beside it, under the same table lock. Releasing the flag hands the queued exits back, and the
//! guard has them handled at once: nothing waits on a timer. Order of use:
//!
//! 1. [`BusyFlags::take`] when an operation begins (false: another one holds the VM);
//! 2. [`BusyFlags::queue_exit`] from the exit watcher when [`BusyFlags::contains`] says held;
//! 3. [`BusyFlags::release`] when the operation ends, returning what was queued meanwhile.

use crate::process::ProcessIdentity;
use std::collections::HashMap;

/// Why QEMU ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitCause {
    /// The guest powered itself off (`SHUTDOWN` with `guest: true`).
    GuestPowerOff,
    /// Anything else: a crash, a kill, a host-side quit; the text says what is known.
    Failure(String),
}

/// An exit that arrived while an operation held the VM, handled when the operation ends
/// ([`super::busy`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PendingExit {
    /// The QEMU that ended.
    pub id: ProcessIdentity,
    /// Why, as the event monitor said.
    pub cause: ExitCause,
}

/// The VMs an operation holds, each with the exits queued behind its operation.
#[derive(Debug, Default)]
pub(super) struct BusyFlags {
    held: HashMap<String, Vec<PendingExit>>,
}

impl BusyFlags {
    /// Takes VM `name`'s flag; false when an operation already holds it.
    pub fn take(&mut self, name: &str) -> bool {
        if self.held.contains_key(name) {
            return false;
        }
        self.held.insert(name.to_string(), Vec::new());
        true
    }

    /// Whether an operation holds VM `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.held.contains_key(name)
    }

    /// Queues `exit` for the end of the operation holding VM `name`. Returns it when no
    /// operation holds the VM (the caller handles it itself).
    pub fn queue_exit(&mut self, name: &str, exit: PendingExit) -> Option<PendingExit> {
        match self.held.get_mut(name) {
            Some(queued) => {
                queued.push(exit);
                None
            }
            None => Some(exit),
        }
    }

    /// Gives VM `name`'s flag back; returns the exits queued while it was held, oldest first.
    pub fn release(&mut self, name: &str) -> Vec<PendingExit> {
        self.held.remove(name).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(pid: i32) -> PendingExit {
        let id = ProcessIdentity { pid, start_ticks: 1 };
        PendingExit { id, cause: ExitCause::Failure("killed".into()) }
    }

    #[test]
    fn one_holder_at_a_time() {
        let mut b = BusyFlags::default();
        assert!(b.take("a"));
        assert!(!b.take("a"), "a second operation is refused");
        assert!(b.take("b"), "other VMs are independent");
        assert!(b.release("a").is_empty());
        assert!(!b.contains("a"));
        assert!(b.take("a"), "free again once released");
    }

    #[test]
    fn an_exit_while_held_is_handed_over_at_release() {
        let mut b = BusyFlags::default();
        assert!(b.take("a"));
        assert!(b.queue_exit("a", exit(7)).is_none(), "queued, not handled, while an operation holds the VM");
        assert!(b.queue_exit("a", exit(8)).is_none());
        let handed: Vec<i32> = b.release("a").into_iter().map(|e| e.id.pid).collect();
        assert_eq!(handed, [7, 8], "every queued exit, oldest first, the moment the flag goes");
        assert!(b.release("a").is_empty(), "handed over once");
        assert_eq!(b.queue_exit("a", exit(9)).map(|e| e.id.pid), Some(9), "a free VM's exit is the caller's");
    }
}
