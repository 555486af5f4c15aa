//! The VM event bus: every status change becomes an [`Event`] for `events.subscribe` clients.
//!
//! A broadcast channel: publishing never blocks the lifecycle, and a subscriber that falls more
//! than [`CAPACITY`] events behind loses the oldest ones (it is told how many via a log line)
//! rather than slowing the daemon down.

use crate::api::exec::GuestAction;
use crate::api::migration::MigrationProgress;
use crate::api::{now_rfc3339, CaptureChange, Event, VmStatus};
use tokio::sync::broadcast;

/// Events buffered per subscriber.
pub const CAPACITY: usize = 1024;

/// Publishes VM state changes.
#[derive(Debug, Clone)]
pub struct EventBus {
    tx: broadcast::Sender<Event>,
}

impl Default for EventBus {
    fn default() -> Self {
        EventBus { tx: broadcast::channel(CAPACITY).0 }
    }
}

impl EventBus {
    /// Publishes a change of `vm` from `from` to `to`. No subscriber is fine.
    pub fn emit(&self, vm: &str, from: Option<VmStatus>, to: Option<VmStatus>, reason: impl Into<String>) {
        let event = Self::event(vm, from, to, reason.into());
        tracing::info!(vm, from = ?from, to = ?to, reason = %event.reason, "vm event");
        let _ = self.tx.send(event);
    }

    /// Publishes a guest action on `vm` (a command, a transfer, a clock set, a shutdown asked
    /// of the guest): `from` and `to` are both its current status.
    pub fn emit_guest(&self, vm: &str, status: Option<VmStatus>, reason: impl Into<String>, guest: GuestAction) {
        let event = Event { guest: Some(guest), ..Self::event(vm, status, status, reason.into()) };
        let _ = self.tx.send(event);
    }

    /// Publishes a monitor NIC's capture changing state on `vm` (a source lost or back): `from`
    /// and `to` are both its current status.
    pub fn emit_capture(&self, vm: &str, status: Option<VmStatus>, reason: impl Into<String>, change: CaptureChange) {
        let event = Event { capture: Some(change), ..Self::event(vm, status, status, reason.into()) };
        tracing::info!(vm, reason = %event.reason, "capture event");
        let _ = self.tx.send(event);
    }

    /// Publishes how far a migration of `vm` got (a phase change, or progress within one):
    /// `from` and `to` are both its current status.
    pub fn emit_migration(
        &self,
        vm: &str,
        status: Option<VmStatus>,
        reason: impl Into<String>,
        progress: MigrationProgress,
    ) {
        let event = Event { migration: Some(progress), ..Self::event(vm, status, status, reason.into()) };
        tracing::debug!(vm, reason = %event.reason, "migration event");
        let _ = self.tx.send(event);
    }

    /// An event stamped now, about nothing but a status change.
    fn event(vm: &str, from: Option<VmStatus>, to: Option<VmStatus>, reason: String) -> Event {
        Event { vm: vm.to_string(), from, to, reason, time: now_rfc3339(), guest: None, capture: None, migration: None }
    }

    /// A receiver of every event published from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn subscribers_see_events_after_subscribing() {
        let bus = EventBus::default();
        bus.emit("early", None, Some(VmStatus::Creating), "nobody listens");
        let mut rx = bus.subscribe();
        bus.emit("a", Some(VmStatus::Running), Some(VmStatus::Dead), "process exited");
        let e = rx.recv().await.unwrap();
        assert_eq!((e.vm.as_str(), e.from, e.to), ("a", Some(VmStatus::Running), Some(VmStatus::Dead)));
        assert!(rx.try_recv().is_err());
    }
}
