//! The per-VM busy flags, and the exits that arrive while a flag is held.
//!
//! One operation at a time holds a VM ([`super::OpGuard`]); a second one gets 4090. The exit
//! watcher ([`super::exits`]) must not act on a VM an operation holds (the operation may be the
//! one ending QEMU, or starting a new one), so an exit that finds the flag taken is queued
//! beside it, under the same table lock. Releasing the flag hands the queued exits back, and the
//! guard has them handled at once: nothing waits on a timer.
//!
//! The exit watcher holds the flag itself while it cleans up after a QEMU that ended (taps, run
//! dir, devices), after the record already says `dead` or `stopped`. A client that saw that
//! status and acts on it at once must not get 4090 for a cleanup it never asked for: an
//! operation that finds the flag held by a cleanup waits for it ([`BusyFlags::take`] answers
//! [`Take::AfterCleanup`], [`wait_for_release`]), up to [`CLEANUP_WAIT`]. Order of use:
//!
//! 1. [`BusyFlags::take`] when an operation begins (held by another operation: 4090; by a
//!    cleanup: wait for the release and take again);
//! 2. [`BusyFlags::queue_exit`] from the exit watcher, which handles the exit itself when the
//!    VM is free;
//! 3. [`BusyFlags::release`] when the operation ends, returning what was queued meanwhile.

use crate::process::ProcessIdentity;
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::watch;

/// The longest an operation waits for the cleanup after an exit before it answers 4090: the
/// cleanup deletes taps and files and gives passthrough devices back to their drivers (a
/// device reset can take seconds).
pub const CLEANUP_WAIT: Duration = Duration::from_secs(30);

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

/// Who holds a VM's flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holder {
    /// An operation a client (or autostart, or the restart policy) asked for.
    Operation,
    /// The exit watcher, cleaning up after a QEMU that ended on its own.
    ExitCleanup,
}

/// What [`BusyFlags::take`] found.
#[derive(Debug)]
pub(super) enum Take {
    /// The flag is now the caller's.
    Taken,
    /// Another operation holds the VM: 4090.
    Busy,
    /// A cleanup after an exit holds the VM: wait on this for its release, then take again.
    AfterCleanup(watch::Receiver<u64>),
}

/// One held flag.
#[derive(Debug)]
struct Held {
    holder: Holder,
    /// Exits queued behind the holder, oldest first.
    exits: Vec<PendingExit>,
}

/// The VMs an operation holds, each with the exits queued behind its operation.
#[derive(Debug)]
pub(super) struct BusyFlags {
    held: HashMap<String, Held>,
    /// Counts releases; a waiter subscribed under the table lock cannot miss one.
    released: watch::Sender<u64>,
}

impl Default for BusyFlags {
    fn default() -> Self {
        BusyFlags { held: HashMap::new(), released: watch::Sender::new(0) }
    }
}

impl BusyFlags {
    /// Takes VM `name`'s flag for `holder`, or says who has it.
    pub fn take(&mut self, name: &str, holder: Holder) -> Take {
        match self.held.get(name) {
            Some(Held { holder: Holder::ExitCleanup, .. }) => Take::AfterCleanup(self.released.subscribe()),
            Some(Held { holder: Holder::Operation, .. }) => Take::Busy,
            None => {
                self.held.insert(name.to_string(), Held { holder, exits: Vec::new() });
                Take::Taken
            }
        }
    }

    /// Whether an operation holds VM `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.held.contains_key(name)
    }

    /// Queues `exit` for the end of the operation holding VM `name`. Returns it when no
    /// operation holds the VM (the caller handles it itself).
    pub fn queue_exit(&mut self, name: &str, exit: PendingExit) -> Option<PendingExit> {
        match self.held.get_mut(name) {
            Some(held) => {
                held.exits.push(exit);
                None
            }
            None => Some(exit),
        }
    }

    /// Gives VM `name`'s flag back; returns the exits queued while it was held, oldest first.
    pub fn release(&mut self, name: &str) -> Vec<PendingExit> {
        let Some(held) = self.held.remove(name) else { return Vec::new() };
        self.released.send_modify(|n| *n = n.wrapping_add(1));
        held.exits
    }
}

/// Waits until a flag is released after `released` was subscribed, up to `deadline`; false
/// when the deadline passed first.
pub(super) async fn wait_for_release(mut released: watch::Receiver<u64>, deadline: tokio::time::Instant) -> bool {
    matches!(tokio::time::timeout_at(deadline, released.changed()).await, Ok(Ok(())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(pid: i32) -> PendingExit {
        let id = ProcessIdentity { pid, start_ticks: 1 };
        PendingExit { id, cause: ExitCause::Failure("killed".into()) }
    }

    fn taken(t: Take) -> bool {
        matches!(t, Take::Taken)
    }

    #[test]
    fn one_holder_at_a_time() {
        let mut b = BusyFlags::default();
        assert!(taken(b.take("a", Holder::Operation)));
        assert!(matches!(b.take("a", Holder::Operation), Take::Busy), "a second operation is refused");
        assert!(matches!(b.take("a", Holder::ExitCleanup), Take::Busy), "so is a cleanup (it queues instead)");
        assert!(taken(b.take("b", Holder::Operation)), "other VMs are independent");
        assert!(b.release("a").is_empty());
        assert!(!b.contains("a"));
        assert!(taken(b.take("a", Holder::Operation)), "free again once released");
    }

    #[tokio::test(start_paused = true)]
    async fn an_operation_waits_for_a_cleanup_not_for_another_operation() {
        let mut b = BusyFlags::default();
        assert!(taken(b.take("a", Holder::ExitCleanup)));
        let Take::AfterCleanup(rx) = b.take("a", Holder::Operation) else { panic!("a cleanup is waited for") };
        let Take::AfterCleanup(late) = b.take("a", Holder::Operation) else { panic!("a cleanup is waited for") };
        let deadline = tokio::time::Instant::now() + CLEANUP_WAIT;
        let waiter = tokio::spawn(wait_for_release(rx, deadline));
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "still held");
        assert!(b.release("a").is_empty());
        assert!(waiter.await.unwrap(), "woken by the release");
        assert!(wait_for_release(late, deadline).await, "a release before the wait began is not missed");
        assert!(taken(b.take("a", Holder::Operation)), "then the operation takes the flag");
    }

    #[tokio::test(start_paused = true)]
    async fn a_cleanup_that_never_ends_is_waited_for_until_the_deadline() {
        let mut b = BusyFlags::default();
        assert!(taken(b.take("a", Holder::ExitCleanup)));
        let Take::AfterCleanup(rx) = b.take("a", Holder::Operation) else { panic!("a cleanup is waited for") };
        let deadline = tokio::time::Instant::now() + CLEANUP_WAIT;
        assert!(!wait_for_release(rx, deadline).await, "the deadline ends the wait");
        assert!(tokio::time::Instant::now() >= deadline);
        assert!(b.contains("a"));
    }

    #[test]
    fn an_exit_while_held_is_handed_over_at_release() {
        let mut b = BusyFlags::default();
        assert!(taken(b.take("a", Holder::Operation)));
        assert!(b.queue_exit("a", exit(7)).is_none(), "queued, not handled, while an operation holds the VM");
        assert!(b.queue_exit("a", exit(8)).is_none());
        let handed: Vec<i32> = b.release("a").into_iter().map(|e| e.id.pid).collect();
        assert_eq!(handed, [7, 8], "every queued exit, oldest first, the moment the flag goes");
        assert!(b.release("a").is_empty(), "handed over once");
        assert_eq!(b.queue_exit("a", exit(9)).map(|e| e.id.pid), Some(9), "a free VM's exit is the caller's");
    }
}
