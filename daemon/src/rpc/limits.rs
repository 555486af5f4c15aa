//! What one peer, one uid and all peers together may hold of the daemon: connection slots,
//! requests in flight, bytes queued for writing, subscriptions, and how often a refusal is logged.
//!
//! Every limit here exists so that a read-only (or unauthorized) local user cannot grow the
//! daemon's memory or starve other clients (docs/api.md, "Limits"). Used in this order:
//!
//! 1. at accept, [`Registry::admit`] (the pure [`admit`] rule) takes a connection slot for the
//!    peer's uid, or says why not; the slot is given back when the [`Slot`] drops;
//! 2. after the peer's role is known, [`Registry::admit_role`] takes a read-only slot for a
//!    read-only peer (so read-only peers can never hold the slots reserved for admins);
//! 3. [`Registry::budget`] hands the connection its [`Budget`]: the semaphores its requests in
//!    flight, queued bytes and subscriptions draw from (per connection, and shared by all
//!    connections of a non-root uid);
//! 4. [`LogThrottle`] keeps a peer hammering refused connects from flooding the log.

use crate::rpc::auth::Role;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Most connections open at once; further ones are closed at accept. Together with
/// [`MAX_CONNECTIONS_PER_UID`] this keeps any one local user from exhausting the daemon's file
/// descriptors (which would also blind it to its own VM processes in /proc).
pub const MAX_CONNECTIONS: usize = 512;

/// Most connections one non-root uid may hold.
pub const MAX_CONNECTIONS_PER_UID: usize = 64;

/// Slots only root may take: a non-root peer is closed at accept once
/// `MAX_CONNECTIONS - ROOT_RESERVED` connections are open.
pub const ROOT_RESERVED: usize = 16;

/// Most connections read-only peers may hold together: the rest (64 slots) stays for root and
/// the admin group.
pub const MAX_READONLY_CONNECTIONS: usize = MAX_CONNECTIONS - 64;

/// Requests of one connection dispatched at once. Further requests wait: the connection is not
/// read until one finishes, which pushes back on the client through the socket buffer. A
/// request holds its slot until its answer is queued.
pub const MAX_IN_FLIGHT: usize = 64;

/// Requests in flight over all connections of one non-root uid.
pub const MAX_IN_FLIGHT_PER_UID: usize = 64;

/// Most elements of one batch; a longer batch is refused as a whole (1003). At most
/// [`MAX_IN_FLIGHT`], because a batch holds the slots of its elements until its answer is queued.
pub const MAX_BATCH: usize = 64;

/// Bytes of answers and notifications queued for one connection (root) or for all connections
/// of one non-root uid together. A full queue stops the connection's requests and notifications
/// until the peer reads (back-pressure); one line larger than this waits for an empty queue.
pub const MAX_QUEUED_BYTES: usize = 4 * 1024 * 1024;

/// What a queued line costs beyond its bytes (the allocation and queue entry), so that many tiny
/// lines cannot outgrow the byte bound.
pub const LINE_OVERHEAD: usize = 64;

/// Open `events.subscribe` subscriptions per connection.
pub const MAX_SUBSCRIPTIONS_PER_CONNECTION: usize = 8;

/// Open subscriptions over all connections of one non-root uid.
pub const MAX_SUBSCRIPTIONS_PER_UID: usize = 32;

/// Read-only peers' clients attached to one VM's serial console at once (`vm.console`, 1003
/// beyond); admins' are not counted, so read-only peers cannot keep them out. Each holds its
/// connection slot as well; what the daemon holds per client is bounded (docs/console.md).
pub const MAX_CONSOLE_CLIENTS_PER_VM: usize = 16;

/// Default of `access.idle_timeout_s`.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// At most one refusal log line per kind in this interval; the next one says how many were left
/// out.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Why a connection gets no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SlotRefusal {
    /// [`MAX_CONNECTIONS`] (or, for non-root, [`MAX_CONNECTIONS`] − [`ROOT_RESERVED`]) are open.
    #[error("connection limit reached ({open} open)")]
    Full {
        /// Connections open at accept.
        open: usize,
    },
    /// The uid holds [`MAX_CONNECTIONS_PER_UID`].
    #[error("uid {uid} holds {held} connections, the most one uid may")]
    PerUid {
        /// The peer's uid.
        uid: u32,
        /// Connections it holds.
        held: usize,
    },
    /// Read-only peers hold [`MAX_READONLY_CONNECTIONS`].
    #[error("read-only peers hold {MAX_READONLY_CONNECTIONS} connections; the rest are for admins")]
    ReadOnlyFull,
}

/// The accept rule: may a peer of `uid`, holding `held` connections already, open one more
/// while `open` connections are open in all?
///
/// # Errors
/// The [`SlotRefusal`] saying which limit is hit.
pub fn admit(open: usize, held: usize, uid: u32) -> Result<(), SlotRefusal> {
    if uid == 0 {
        return if open < MAX_CONNECTIONS { Ok(()) } else { Err(SlotRefusal::Full { open }) };
    }
    if open >= MAX_CONNECTIONS - ROOT_RESERVED {
        return Err(SlotRefusal::Full { open });
    }
    if held >= MAX_CONNECTIONS_PER_UID {
        return Err(SlotRefusal::PerUid { uid, held });
    }
    Ok(())
}

/// What one non-root uid shares over its connections.
struct UidShare {
    /// Connections it holds.
    connections: usize,
    /// Requests in flight, [`MAX_IN_FLIGHT_PER_UID`].
    in_flight: Arc<Semaphore>,
    /// Bytes queued, [`MAX_QUEUED_BYTES`].
    queued: Arc<Semaphore>,
    /// Subscriptions, [`MAX_SUBSCRIPTIONS_PER_UID`].
    subscriptions: Arc<Semaphore>,
}

impl UidShare {
    /// True when no connection or request holds any of its semaphores.
    fn unused(&self) -> bool {
        Arc::strong_count(&self.in_flight) == 1
            && Arc::strong_count(&self.queued) == 1
            && Arc::strong_count(&self.subscriptions) == 1
    }

    fn new() -> UidShare {
        UidShare {
            connections: 0,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT_PER_UID)),
            queued: Arc::new(Semaphore::new(MAX_QUEUED_BYTES)),
            subscriptions: Arc::new(Semaphore::new(MAX_SUBSCRIPTIONS_PER_UID)),
        }
    }
}

/// The server's book of slots and shared budgets.
#[derive(Default)]
pub struct Registry {
    inner: Mutex<Book>,
    readonly: Option<Arc<Semaphore>>,
}

#[derive(Default)]
struct Book {
    open: usize,
    uids: HashMap<u32, UidShare>,
}

/// A connection slot; dropping it gives the slot back.
pub struct Slot {
    registry: Arc<Registry>,
    uid: u32,
    /// The read-only slot, once [`Registry::admit_role`] took one.
    readonly: Option<OwnedSemaphorePermit>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut book = self.registry.book();
        book.open = book.open.saturating_sub(1);
        if self.uid != 0 {
            if let Some(share) = book.uids.get_mut(&self.uid) {
                share.connections = share.connections.saturating_sub(1);
                // Requests of a closed connection may still run and hold the uid's slots: the
                // share is forgotten only once nothing holds it, so reconnecting does not
                // reset the uid's limits.
                if share.connections == 0 && share.unused() {
                    book.uids.remove(&self.uid);
                }
            }
        }
    }
}

/// The semaphores one connection draws from.
pub struct Budget {
    /// Its own requests in flight ([`MAX_IN_FLIGHT`]).
    pub in_flight: Arc<Semaphore>,
    /// Its uid's requests in flight; `None` for root.
    pub uid_in_flight: Option<Arc<Semaphore>>,
    /// Bytes queued for writing: its own (root) or its uid's.
    pub queued: Arc<Semaphore>,
    /// Its own subscriptions.
    pub subscriptions: Arc<Semaphore>,
    /// Its uid's subscriptions; `None` for root.
    pub uid_subscriptions: Option<Arc<Semaphore>>,
}

impl Registry {
    /// A registry enforcing [`MAX_READONLY_CONNECTIONS`].
    pub fn new() -> Arc<Registry> {
        Arc::new(Registry {
            inner: Mutex::default(),
            readonly: Some(Arc::new(Semaphore::new(MAX_READONLY_CONNECTIONS))),
        })
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes a slot for a new connection of `uid` ([`admit`]).
    ///
    /// # Errors
    /// The limit that is hit; nothing is taken then.
    pub fn admit(self: &Arc<Self>, uid: u32) -> Result<Slot, SlotRefusal> {
        let mut book = self.book();
        // Shares kept for requests that outlived their connections, now unused.
        book.uids.retain(|_, share| share.connections > 0 || !share.unused());
        let held = if uid == 0 { 0 } else { book.uids.get(&uid).map_or(0, |s| s.connections) };
        admit(book.open, held, uid)?;
        book.open += 1;
        if uid != 0 {
            book.uids.entry(uid).or_insert_with(UidShare::new).connections += 1;
        }
        Ok(Slot { registry: Arc::clone(self), uid, readonly: None })
    }

    /// Takes a read-only slot when `role` is read-only.
    ///
    /// # Errors
    /// [`SlotRefusal::ReadOnlyFull`].
    pub fn admit_role(&self, slot: &mut Slot, role: Role) -> Result<(), SlotRefusal> {
        if role != Role::ReadOnly {
            return Ok(());
        }
        let Some(readonly) = &self.readonly else { return Ok(()) };
        let permit = Arc::clone(readonly).try_acquire_owned().map_err(|_| SlotRefusal::ReadOnlyFull)?;
        slot.readonly = Some(permit);
        Ok(())
    }

    /// The budget of a connection holding `slot`.
    pub fn budget(&self, slot: &Slot) -> Budget {
        let own = |n| Arc::new(Semaphore::new(n));
        let book = self.book();
        let share = (slot.uid != 0).then(|| book.uids.get(&slot.uid)).flatten();
        Budget {
            in_flight: own(MAX_IN_FLIGHT),
            uid_in_flight: share.map(|s| Arc::clone(&s.in_flight)),
            queued: share.map_or_else(|| own(MAX_QUEUED_BYTES), |s| Arc::clone(&s.queued)),
            subscriptions: own(MAX_SUBSCRIPTIONS_PER_CONNECTION),
            uid_subscriptions: share.map(|s| Arc::clone(&s.subscriptions)),
        }
    }
}

/// Logs one line per [`REFUSAL_LOG_INTERVAL`] at most; counts the ones it holds back.
#[derive(Debug, Default)]
pub struct LogThrottle {
    last: Option<Instant>,
    suppressed: u64,
}

impl LogThrottle {
    /// Whether to log an event happening at `now`: `Some(n)` with the number of events left out
    /// since the last line, or `None` to stay quiet.
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < REFUSAL_LOG_INTERVAL => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// A [`LogThrottle`] several tasks share.
#[derive(Debug, Default)]
pub struct SharedThrottle(Mutex<LogThrottle>);

impl SharedThrottle {
    /// [`LogThrottle::allow`] now.
    pub fn allow(&self) -> Option<u64> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).allow(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_may_use_the_reserved_slots() {
        let edge = MAX_CONNECTIONS - ROOT_RESERVED;
        assert_eq!(admit(edge - 1, 0, 1000), Ok(()));
        assert_eq!(admit(edge, 0, 1000), Err(SlotRefusal::Full { open: edge }));
        assert_eq!(admit(edge, 0, 0), Ok(()));
        assert_eq!(admit(MAX_CONNECTIONS - 1, 500, 0), Ok(()), "root has no per-uid limit");
        assert_eq!(admit(MAX_CONNECTIONS, 0, 0), Err(SlotRefusal::Full { open: MAX_CONNECTIONS }));
    }

    #[test]
    fn a_uid_holds_at_most_its_share() {
        assert_eq!(admit(10, MAX_CONNECTIONS_PER_UID - 1, 1000), Ok(()));
        assert_eq!(
            admit(10, MAX_CONNECTIONS_PER_UID, 1000),
            Err(SlotRefusal::PerUid { uid: 1000, held: MAX_CONNECTIONS_PER_UID })
        );
    }

    #[test]
    fn slots_are_given_back_and_readonly_peers_keep_the_admin_reserve_free() {
        let registry = Registry::new();
        let mut slots = Vec::new();
        for i in 0..MAX_READONLY_CONNECTIONS {
            let uid = 1000 + u32::try_from(i / MAX_CONNECTIONS_PER_UID).unwrap();
            let mut slot = registry.admit(uid).unwrap();
            registry.admit_role(&mut slot, Role::ReadOnly).unwrap();
            slots.push(slot);
        }
        let mut extra = registry.admit(2000).unwrap();
        assert_eq!(registry.admit_role(&mut extra, Role::ReadOnly), Err(SlotRefusal::ReadOnlyFull));
        assert_eq!(registry.admit_role(&mut extra, Role::Admin), Ok(()), "admins use the reserve");
        drop(extra);
        slots.pop();
        let mut again = registry.admit(2000).unwrap();
        assert_eq!(registry.admit_role(&mut again, Role::ReadOnly), Ok(()));
        drop(again);
        drop(slots);
        assert_eq!(registry.book().open, 0);
        assert!(registry.book().uids.is_empty());
    }

    #[test]
    fn connections_of_one_uid_share_its_budget() {
        let registry = Registry::new();
        let a = registry.admit(1000).unwrap();
        let b = registry.admit(1000).unwrap();
        let (ba, bb) = (registry.budget(&a), registry.budget(&b));
        assert!(Arc::ptr_eq(&ba.queued, &bb.queued));
        assert!(Arc::ptr_eq(ba.uid_subscriptions.as_ref().unwrap(), bb.uid_subscriptions.as_ref().unwrap()));
        assert!(!Arc::ptr_eq(&ba.subscriptions, &bb.subscriptions));
        let r1 = registry.admit(0).unwrap();
        let r2 = registry.admit(0).unwrap();
        let (b1, b2) = (registry.budget(&r1), registry.budget(&r2));
        assert!(!Arc::ptr_eq(&b1.queued, &b2.queued), "root connections are budgeted one by one");
        assert!(b1.uid_in_flight.is_none() && b1.uid_subscriptions.is_none());
    }

    #[test]
    fn reconnecting_does_not_reset_a_uids_limits_while_its_requests_run() {
        let registry = Registry::new();
        let slot = registry.admit(1000).unwrap();
        let budget = registry.budget(&slot);
        let running = Arc::clone(budget.uid_in_flight.as_ref().unwrap()).try_acquire_owned().unwrap();
        drop(budget);
        drop(slot);
        let again = registry.admit(1000).unwrap();
        let available = registry.budget(&again).uid_in_flight.unwrap().available_permits();
        assert_eq!(available, MAX_IN_FLIGHT_PER_UID - 1, "the request still running counts");
        drop(again);
        drop(running);
        let fresh = registry.admit(1000).unwrap();
        assert_eq!(registry.budget(&fresh).uid_in_flight.unwrap().available_permits(), MAX_IN_FLIGHT_PER_UID);
    }

    #[test]
    fn the_log_throttle_counts_what_it_leaves_out() {
        let mut t = LogThrottle::default();
        let start = Instant::now();
        assert_eq!(t.allow(start), Some(0));
        for i in 1..=5 {
            assert_eq!(t.allow(start + Duration::from_millis(i)), None);
        }
        assert_eq!(t.allow(start + REFUSAL_LOG_INTERVAL), Some(5));
        assert_eq!(t.allow(start + REFUSAL_LOG_INTERVAL), None);
    }
}
