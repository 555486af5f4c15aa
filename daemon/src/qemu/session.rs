//! One kept QMP session per running VM: its event monitor (`RUN/NAME/qmpev`), read for QEMU's
//! events for as long as QEMU runs, and lent to operations for their commands, so that an
//! operation does not open a connection of its own and the VM's other monitor (`RUN/NAME/qmp`)
//! stays free for an operator.
//!
//! Order: [`Session::new`] on the event monitor's connection once QEMU runs, registered in
//! [`Sessions`]; one task calls [`Session::next_event`] until QEMU closes the monitor, then
//! removes it. Meanwhile [`Session::lease`] lends the connection to one operation at a time:
//! the listener lets go as soon as an operation asks, events read during the operation's
//! commands are kept by the connection ([`Qmp::take_events`]) and the listener gets them after,
//! and dropping the [`Lease`] hands the connection back.

use super::qmp::{Qmp, QmpError};
use serde_json::Value;
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, OwnedMutexGuard};

/// A VM's kept QMP connection, shared by its event listener and its operations.
#[derive(Debug)]
pub struct Session {
    conn: Arc<tokio::sync::Mutex<Qmp>>,
    /// Operations waiting for or holding the connection.
    wanted: AtomicUsize,
    /// Tells the listener an operation wants the connection.
    wake: Notify,
    /// Tells the listener an operation gave it back.
    idle: Notify,
}

impl Session {
    /// A session over `qmp`, a connection past negotiation.
    pub fn new(qmp: Qmp) -> Arc<Session> {
        Arc::new(Session {
            conn: Arc::new(tokio::sync::Mutex::new(qmp)),
            wanted: AtomicUsize::new(0),
            wake: Notify::new(),
            idle: Notify::new(),
        })
    }

    /// The next event, waiting without a time limit, letting operations use the connection
    /// meanwhile. For the session's one listener.
    ///
    /// # Errors
    /// [`QmpError::Closed`] once QEMU is gone, or another error of [`Qmp::next_event`].
    pub async fn next_event(&self) -> Result<Value, QmpError> {
        loop {
            if self.wanted.load(Ordering::SeqCst) > 0 {
                // A release between the check and this wait left a permit: no wake-up is lost.
                self.idle.notified().await;
                continue;
            }
            let mut conn = Arc::clone(&self.conn).lock_owned().await;
            tokio::select! {
                biased;
                // The read is resumable (the connection keeps a partial line): dropping it here
                // loses nothing.
                () = self.wake.notified() => continue,
                event = conn.next_event() => return event,
            }
        }
    }

    /// The connection, for one operation's commands, until the lease is dropped.
    pub async fn lease(self: &Arc<Self>) -> Lease {
        self.wanted.fetch_add(1, Ordering::SeqCst);
        self.wake.notify_one();
        let conn = Arc::clone(&self.conn).lock_owned().await;
        let timeout = conn.timeout();
        Lease { conn, session: Arc::clone(self), timeout }
    }
}

/// A session's connection lent to one operation; dropping it gives the connection back (with
/// its per-call timeout as it was).
#[derive(Debug)]
pub struct Lease {
    conn: OwnedMutexGuard<Qmp>,
    session: Arc<Session>,
    timeout: Duration,
}

impl Deref for Lease {
    type Target = Qmp;
    fn deref(&self) -> &Qmp {
        &self.conn
    }
}

impl DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut Qmp {
        &mut self.conn
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.conn.set_timeout(self.timeout);
        // The guard itself goes right after this body: a listener woken here waits that long.
        self.session.wanted.fetch_sub(1, Ordering::SeqCst);
        self.session.idle.notify_one();
    }
}

/// The kept sessions of the running VMs, by name.
#[derive(Debug, Default)]
pub struct Sessions {
    by_vm: Mutex<HashMap<String, Arc<Session>>>,
}

impl Sessions {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.by_vm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `session` as VM `name`'s (a new QEMU's replaces an old one's).
    pub fn insert(&self, name: &str, session: &Arc<Session>) {
        self.map().insert(name.to_string(), Arc::clone(session));
    }

    /// Forgets `session` if it still is VM `name`'s.
    pub fn remove(&self, name: &str, session: &Arc<Session>) {
        let mut map = self.map();
        if map.get(name).is_some_and(|s| Arc::ptr_eq(s, session)) {
            map.remove(name);
        }
    }

    /// A connection to VM `name`'s QEMU for one operation: its kept session when it has a
    /// working one, else a new connection to `fallback` (a VM started before sessions existed,
    /// or whose session broke) made within `timeout`.
    ///
    /// # Errors
    /// As [`Qmp::connect`], for the fallback.
    pub async fn connect(&self, name: &str, fallback: &Path, timeout: Duration) -> Result<Monitor, QmpError> {
        let session = self.map().get(name).cloned();
        if let Some(session) = session {
            let lease = session.lease().await;
            if !lease.is_broken() {
                return Ok(Monitor::Kept(lease));
            }
        }
        Ok(Monitor::Own(Qmp::connect(fallback, timeout).await?))
    }
}

/// A connection for one operation: the VM's kept session, or one of its own.
#[derive(Debug)]
pub enum Monitor {
    /// The kept session, lent.
    Kept(Lease),
    /// A connection made for this operation, closed when dropped.
    Own(Qmp),
}

impl Deref for Monitor {
    type Target = Qmp;
    fn deref(&self) -> &Qmp {
        match self {
            Monitor::Kept(lease) => lease,
            Monitor::Own(qmp) => qmp,
        }
    }
}

impl DerefMut for Monitor {
    fn deref_mut(&mut self) -> &mut Qmp {
        match self {
            Monitor::Kept(lease) => lease,
            Monitor::Own(qmp) => qmp,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    use tokio::net::UnixStream;

    /// One step of QEMU's side of the monitor.
    enum Step {
        /// Send this event.
        Event(&'static str),
        /// Read a command and answer it (`query-status`: running).
        Answer,
        /// Wait for the test to say go.
        Wait(tokio::sync::oneshot::Receiver<()>),
    }

    /// QEMU's side: greets, answers `qmp_capabilities`, follows `script`, then closes (exits).
    async fn qemu(stream: UnixStream, script: Vec<Step>) {
        let (r, mut w) = stream.into_split();
        let mut lines = BufReader::new(r).lines();
        let greeting = json!({"QMP": {"version": {}, "capabilities": []}});
        w.write_all(format!("{greeting}\n").as_bytes()).await.unwrap();
        for step in std::iter::once(Step::Answer).chain(script) {
            let line = match step {
                Step::Event(name) => json!({"event": name, "timestamp": {"seconds": 1, "microseconds": 0}}),
                Step::Answer => {
                    let cmd: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
                    match cmd["execute"].as_str() {
                        Some("query-status") => json!({"return": {"status": "running"}, "id": cmd["id"]}),
                        _ => json!({"return": {}, "id": cmd["id"]}),
                    }
                }
                Step::Wait(go) => {
                    go.await.unwrap();
                    continue;
                }
            };
            w.write_all(format!("{line}\n").as_bytes()).await.unwrap();
        }
    }

    async fn session(script: Vec<Step>) -> (Arc<Session>, tokio::task::JoinHandle<()>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let peer = tokio::spawn(qemu(theirs, script));
        (Session::new(Qmp::over(ours, Duration::from_secs(5)).await.unwrap()), peer)
    }

    #[tokio::test]
    async fn a_lease_takes_the_connection_from_the_listener_and_its_events_reach_the_listener_after() {
        let (go, wait) = tokio::sync::oneshot::channel();
        // SHUTDOWN arrives while the lease's command waits for its reply; STOP after it.
        let script =
            vec![Step::Event("RESET"), Step::Wait(wait), Step::Event("SHUTDOWN"), Step::Answer, Step::Event("STOP")];
        let (session, peer) = session(script).await;
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        let listener = {
            let session = Arc::clone(&session);
            tokio::spawn(async move {
                while let Ok(e) = session.next_event().await {
                    seen_tx.send(e["event"].as_str().unwrap_or_default().to_string()).unwrap();
                }
            })
        };
        assert_eq!(seen.recv().await.unwrap(), "RESET");
        // The listener now waits inside a read: a lease still gets the connection.
        let mut lease = session.lease().await;
        lease.set_timeout(Duration::from_secs(7));
        go.send(()).unwrap();
        assert_eq!(lease.query_status().await.unwrap(), "running");
        assert!(seen.try_recv().is_err(), "the listener read while the connection was lent");
        drop(lease);
        // The event read during the command, then the one after, then the end.
        assert_eq!(seen.recv().await.unwrap(), "SHUTDOWN");
        assert_eq!(seen.recv().await.unwrap(), "STOP");
        listener.await.unwrap();
        peer.await.unwrap();
        // The lease's timeout did not stay on the session.
        assert_eq!(session.conn.lock().await.timeout(), crate::qemu::qmp::DEFAULT_TIMEOUT);
    }

    #[tokio::test]
    async fn sessions_lend_the_kept_one_and_otherwise_connect() {
        let sessions = Sessions::default();
        let dir = tempfile::tempdir().unwrap();
        let absent = dir.path().join("qmp");
        // No session: a connection of its own (nothing listens there: an error).
        assert!(sessions.connect("vm", &absent, Duration::from_millis(50)).await.is_err());

        let (kept, peer) = session(vec![Step::Answer]).await;
        sessions.insert("vm", &kept);
        let mut monitor = sessions.connect("vm", &absent, Duration::from_millis(50)).await.unwrap();
        assert!(matches!(monitor, Monitor::Kept(_)));
        assert_eq!(monitor.query_status().await.unwrap(), "running");
        drop(monitor);
        peer.await.unwrap();

        // An older QEMU's listener ending does not remove its successor's session.
        let (older, _peer) = session(Vec::new()).await;
        sessions.remove("vm", &older);
        assert!(sessions.map().contains_key("vm"));
        sessions.remove("vm", &kept);
        assert!(!sessions.map().contains_key("vm"));
    }
}
