//! One agent session per running VM, kept alive in the background and shared by RPC calls.
//!
//! Order: [`AgentHub::start`] when a VM runs (a task connects, pings and reconnects until
//! [`AgentHub::stop`]); [`AgentHub::guest_booted`] when the guest resets; [`AgentHub::call`] from
//! RPC methods; [`AgentHub::status`] for `vm.get`.
//! A stalled or flooding guest only ever holds its own VM's session, and every wait is bounded,
//! so it cannot block the daemon or other VMs.
//!
//! Reconnecting backs off ([`retry_delay`]): a host full of guests without an agent would
//! otherwise make an attempt per VM every second, each holding a connection for up to
//! [`CONNECT_TIMEOUT`]. The delay starts again from the shortest when the guest boots (a new
//! QEMU, a reset) and after every session, because that is when an agent is about to answer.

use super::conn::AgentConn;
use super::error::AgentError;
use crate::api::{AgentStatus, ApiError, Code};
use crate::guest_text::GuestText;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Mutex as AsyncMutex;
use vmhost_agent_protocol::{AgentInfo, Hello};

/// Bound on connecting and resynchronising.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on one call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a connected agent is pinged (`agent.info`).
const PING_EVERY: Duration = Duration::from_secs(5);
/// The wait after the first failed connection attempt; it doubles with each further failure.
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between connection attempts: about how late an agent that starts long after
/// its guest booted (installed or restarted by hand) is noticed at worst.
const RETRY_MAX: Duration = Duration::from_secs(60);

/// The wait before the next connection attempt after `failures` attempts in a row failed since
/// the guest booted or the last session: [`RETRY_FIRST`] doubled per failure after the first,
/// at most [`RETRY_MAX`]. `0` (nothing failed yet) waits as long as `1`.
fn retry_delay(failures: u32) -> Duration {
    // The cap is reached long before 31 doublings; bounding them keeps the shift in range.
    let doublings = failures.saturating_sub(1).min(31);
    RETRY_FIRST.saturating_mul(1 << doublings).min(RETRY_MAX)
}

/// What a (re)connection means for the VM, for the lifecycle to act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEvent {
    /// A new session (first one, after a daemon restart, or after the guest came back).
    Connected,
    /// The guest rebooted under an open session (its boot id changed).
    GuestRebooted,
}

struct VmAgent {
    socket: PathBuf,
    conn: AsyncMutex<Option<AgentConn>>,
    status: Mutex<AgentStatus>,
    /// The hub's count of status changes ([`AgentHub::changes`]).
    changes: Arc<AtomicU64>,
    stop: tokio::sync::watch::Sender<bool>,
    /// Failed connection attempts in a row, for [`retry_delay`]; zeroed by a boot or a session.
    failures: Mutex<u32>,
    /// Ends the task's current wait (a boot: try at once). A permit given while the task is busy
    /// connecting ends its next wait, so a boot is never missed.
    wake: tokio::sync::Notify,
}

impl VmAgent {
    /// Changes the status readers see, then counts the change: a reader that read the count
    /// before this change reads a new count next time, and checks the status again.
    fn update_status(&self, change: impl FnOnce(&mut AgentStatus)) {
        change(&mut self.status.lock().unwrap_or_else(|p| p.into_inner()));
        self.changes.fetch_add(1, Ordering::Release);
    }

    /// Counts one more failed attempt and returns the wait before the next.
    fn failed(&self) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        *failures = failures.saturating_add(1);
        retry_delay(*failures)
    }

    /// The next failure waits [`RETRY_FIRST`] again.
    fn reset_backoff(&self) {
        *self.failures.lock().unwrap_or_else(|p| p.into_inner()) = 0;
    }

    /// The guest booted: reset the backoff and end the current wait.
    fn booted(&self) {
        self.reset_backoff();
        self.wake.notify_one();
    }
}

/// All agent sessions.
#[derive(Default)]
pub struct AgentHub {
    vms: Mutex<HashMap<String, Arc<VmAgent>>>,
    /// Status changes so far, of any VM's agent (sessions kept or stopped included).
    changes: Arc<AtomicU64>,
}

impl std::fmt::Debug for AgentHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentHub").finish_non_exhaustive()
    }
}

fn not_connected(vm: &str, why: &str) -> ApiError {
    ApiError::new(Code::AgentNotConnected, format!("the guest agent of VM {vm:?} is not connected: {why}"))
        .field("name")
}

impl AgentHub {
    fn get(&self, vm: &str) -> Option<Arc<VmAgent>> {
        self.vms.lock().unwrap_or_else(|p| p.into_inner()).get(vm).cloned()
    }

    /// Starts keeping a session with `vm`'s agent at `socket`; `on_event` runs after each
    /// (re)connection. If one is already kept, the VM was (re)started under it: as
    /// [`AgentHub::guest_booted`].
    pub fn start<F, Fut>(self: &Arc<Self>, vm: &str, socket: PathBuf, on_event: F)
    where
        F: Fn(SessionEvent) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let mut vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(kept) = vms.get(vm) {
            kept.booted();
            return;
        }
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let agent = Arc::new(VmAgent {
            socket,
            conn: AsyncMutex::new(None),
            status: Mutex::default(),
            changes: Arc::clone(&self.changes),
            stop,
            failures: Mutex::new(0),
            wake: tokio::sync::Notify::new(),
        });
        vms.insert(vm.to_string(), agent.clone());
        let name = vm.to_string();
        tokio::spawn(async move {
            let mut last_boot = None;
            loop {
                let event = keep(&agent, &name, &mut last_boot).await;
                if let Some(event) = event {
                    on_event(event).await;
                }
                let connected = agent.status.lock().map(|s| s.connected).unwrap_or(false);
                // A session that a call dropped right after it opened still counts as one.
                if connected || event == Some(SessionEvent::Connected) {
                    agent.reset_backoff();
                }
                let pause = if connected { PING_EVERY } else { agent.failed() };
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = agent.wake.notified() => {}
                    _ = stopped.changed() => break,
                }
                if *stopped.borrow() {
                    break;
                }
            }
        });
    }

    /// Stops keeping `vm`'s session (the VM stopped or is gone).
    pub fn stop(&self, vm: &str) {
        if let Some(a) = self.vms.lock().unwrap_or_else(|p| p.into_inner()).remove(vm) {
            let _ = a.stop.send(true);
            self.changes.fetch_add(1, Ordering::Release);
        }
    }

    /// How many times any VM's agent status changed: while it stays the same, so does every
    /// [`AgentHub::status`].
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// Tells the session of `vm` that its guest booted again (a reset or reboot QEMU reported):
    /// the agent is about to come up, so the task tries at once (a connected one pings at once,
    /// noticing a lost session sooner) and the backoff starts again from [`RETRY_FIRST`].
    /// Does nothing when no session is kept for `vm`.
    pub fn guest_booted(&self, vm: &str) {
        if let Some(agent) = self.get(vm) {
            agent.booted();
        }
    }

    /// `vm`'s agent state.
    pub fn status(&self, vm: &str) -> AgentStatus {
        self.get(vm).and_then(|a| a.status.lock().ok().map(|s| s.clone())).unwrap_or_default()
    }

    /// Calls `method` on `vm`'s agent.
    ///
    /// # Errors
    /// 5001 when no session is open (or it broke, or the guest sent an invalid reply: the
    /// session is then dropped), 5002 when the agent did not answer in time, 4001 when the agent
    /// refused (its error in `details.agent_error`).
    pub async fn call<T: DeserializeOwned>(&self, vm: &str, method: &str, params: Value) -> Result<T, ApiError> {
        self.call_with(vm, method, |_| params).await
    }

    /// Calls `method` on `vm`'s agent with the params `params` builds from the session's
    /// `hello`, under the session's lock: a request carries only what the agent that answers
    /// announced it understands (an older agent refuses an unknown member), even when the guest
    /// swaps its agent between two calls.
    ///
    /// # Errors
    /// As [`AgentHub::call`].
    pub async fn call_with<T: DeserializeOwned>(
        &self,
        vm: &str,
        method: &str,
        params: impl FnOnce(&Hello) -> Value,
    ) -> Result<T, ApiError> {
        let agent = self.get(vm).ok_or_else(|| not_connected(vm, "the VM is not running"))?;
        let mut guard = tokio::time::timeout(CALL_TIMEOUT, agent.conn.lock()).await.map_err(|_| {
            ApiError::new(Code::AgentTimeout, "the guest agent is busy with another call").field("name")
        })?;
        let Some(conn) = guard.as_mut() else { return Err(not_connected(vm, "no session yet")) };
        let params = params(&conn.hello);
        match conn.call(method, params, CALL_TIMEOUT).await {
            Ok(v) => {
                agent.update_status(|s| s.last_seen = Some(crate::api::now_rfc3339()));
                Ok(v)
            }
            Err(AgentError::Remote { code, message, data }) => {
                // The guest's message, escaped and capped: this message reaches logs and terminals
                // (the raw text stays in details, JSON-escaped).
                let shown = GuestText(&message);
                Err(ApiError::new(Code::ProvisioningFailed, format!("the guest agent refused {method}: {shown}"))
                    .details(json!({"agent_error": {"code": code, "message": message, "data": data}})))
            }
            Err(e) => {
                tracing::warn!(vm, error = %e, "dropping the agent session");
                *guard = None;
                agent.update_status(|s| s.connected = false);
                match e {
                    AgentError::Timeout(t) => Err(ApiError::new(
                        Code::AgentTimeout,
                        format!("the guest agent of VM {vm:?} did not answer {method} within {t:?}"),
                    )
                    .field("name")),
                    other => Err(not_connected(vm, &other.to_string())),
                }
            }
        }
    }
}

/// The guest's boot as last seen: a reboot shows as a new `boot_id`. (An uptime cannot tell a
/// reboot that is as fast as the time between two pings.)
#[derive(Debug, Clone, PartialEq, Eq)]
struct Baseline {
    boot_id: String,
}

impl Baseline {
    fn of(info: &AgentInfo) -> Baseline {
        Baseline { boot_id: info.boot_id.clone() }
    }

    /// True when `info` comes from another boot than the baseline.
    fn rebooted(&self, info: &AgentInfo) -> bool {
        self.boot_id != info.boot_id
    }
}

/// One round of keeping a session: connect if there is none, else ping. Returns what happened.
async fn keep(agent: &VmAgent, vm: &str, last_boot: &mut Option<Baseline>) -> Option<SessionEvent> {
    let mut guard = agent.conn.lock().await;
    if guard.is_none() {
        match AgentConn::connect(&agent.socket, CONNECT_TIMEOUT).await {
            Ok(mut conn) => {
                // The boot at connection is the baseline: a reboot right after connecting
                // must still be noticed at the next ping.
                *last_boot = match conn.call::<AgentInfo>("agent.info", json!({}), CONNECT_TIMEOUT).await {
                    Ok(info) => Some(Baseline::of(&info)),
                    Err(e) => {
                        tracing::debug!(vm, error = %e, "agent.info failed right after connecting");
                        return None;
                    }
                };
                tracing::info!(vm, version = %GuestText(&conn.hello.agent_version), "guest agent connected");
                agent.update_status(|s| {
                    *s = AgentStatus {
                        connected: true,
                        version: Some(conn.hello.agent_version.clone()),
                        last_seen: Some(crate::api::now_rfc3339()),
                    }
                });
                *guard = Some(conn);
                return Some(SessionEvent::Connected);
            }
            Err(e) => {
                tracing::debug!(vm, error = %e, "guest agent not reachable yet");
                return None;
            }
        }
    }
    let conn = guard.as_mut()?;
    match conn.call::<AgentInfo>("agent.info", json!({}), CONNECT_TIMEOUT).await {
        Ok(info) => {
            agent.update_status(|s| s.last_seen = Some(crate::api::now_rfc3339()));
            let rebooted = last_boot.as_ref().is_some_and(|b| b.rebooted(&info));
            tracing::debug!(vm, uptime = info.uptime_s, rebooted, "agent ping");
            *last_boot = Some(Baseline::of(&info));
            rebooted.then_some(SessionEvent::GuestRebooted)
        }
        Err(e) => {
            tracing::info!(vm, error = %e, "guest agent session lost; reconnecting");
            *guard = None;
            agent.update_status(|s| s.connected = false);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(boot_id: &str, uptime_s: u64) -> AgentInfo {
        AgentInfo {
            version: "t".into(),
            hostname: "g".into(),
            kernel: "k".into(),
            uptime_s,
            boot_id: boot_id.into(),
            rss_kib: 1,
            os: None,
        }
    }

    #[test]
    fn reboots_are_told_by_the_boot_id_whatever_the_uptime() {
        let b = Baseline::of(&info("a", 30));
        assert!(!b.rebooted(&info("a", 40)), "same boot");
        assert!(!b.rebooted(&info("a", 3)), "an uptime alone never means a reboot");
        assert!(b.rebooted(&info("b", 30)), "a new boot that reached the same uptime");
        assert!(b.rebooted(&info("b", 3)));
    }

    #[test]
    fn retries_start_at_one_second_and_double() {
        let secs: Vec<u64> = (1..=6).map(|n| retry_delay(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32]);
        assert_eq!(retry_delay(0), RETRY_FIRST, "nothing failed yet waits as long as one failure");
    }

    #[test]
    fn retries_are_capped_at_a_minute_however_many_failures() {
        assert_eq!(retry_delay(7), RETRY_MAX, "64 s would pass the cap");
        for n in [8, 31, 32, 33, 64, 1000, u32::MAX - 1, u32::MAX] {
            assert_eq!(retry_delay(n), RETRY_MAX, "{n} failures");
        }
        let mut prev = Duration::ZERO;
        for n in 0..=100 {
            let d = retry_delay(n);
            assert!(d >= prev && d <= RETRY_MAX, "{n} failures: {d:?} after {prev:?}");
            prev = d;
        }
    }

    fn vm_agent() -> VmAgent {
        VmAgent {
            socket: PathBuf::new(),
            conn: AsyncMutex::new(None),
            status: Mutex::default(),
            changes: Arc::default(),
            stop: tokio::sync::watch::channel(false).0,
            failures: Mutex::new(0),
            wake: tokio::sync::Notify::new(),
        }
    }

    #[test]
    fn every_status_change_is_counted_after_it_is_made() {
        let hub = AgentHub::default();
        let mut a = vm_agent();
        a.changes = Arc::clone(&hub.changes);
        let before = hub.changes();
        a.update_status(|s| s.connected = true);
        assert_eq!(hub.changes(), before + 1);
        assert!(a.status.lock().unwrap().connected);
        a.update_status(|s| s.last_seen = Some("now".into()));
        assert_eq!(hub.changes(), before + 2);
        // A session no longer kept reads as the default status: a change too.
        hub.vms.lock().unwrap().insert("vm".into(), Arc::new(a));
        assert!(hub.status("vm").connected);
        hub.stop("vm");
        assert_eq!((hub.changes(), hub.status("vm")), (before + 3, AgentStatus::default()));
    }

    #[test]
    fn a_reset_starts_the_schedule_again() {
        let a = vm_agent();
        let first: Vec<u64> = (0..8).map(|_| a.failed().as_secs()).collect();
        assert_eq!(first, [1, 2, 4, 8, 16, 32, 60, 60]);
        a.reset_backoff();
        assert_eq!(a.failed(), RETRY_FIRST);
        assert_eq!(a.failed(), 2 * RETRY_FIRST);
        a.booted();
        assert_eq!(a.failed(), RETRY_FIRST);
    }

    fn failures_of(hub: &AgentHub, vm: &str) -> u32 {
        *hub.get(vm).unwrap().failures.lock().unwrap()
    }

    /// Waits (in paused time) until `secs` after `t0`.
    async fn at(t0: tokio::time::Instant, secs: f64) {
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(secs)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn an_absent_agent_is_tried_ever_more_rarely_and_at_once_after_a_boot() {
        let d = tempfile::tempdir().unwrap();
        let hub = Arc::new(AgentHub::default());
        let t0 = tokio::time::Instant::now();
        // No socket: every attempt fails at once, so attempts are at 0, 1, 3, 7, 15, 31, 63, 123,
        // 183, 243 s (each failure's wait after it).
        hub.start("vm", d.path().join("absent"), |_| async {});
        for (t, attempts) in [(0.5, 1), (1.5, 2), (2.5, 2), (3.5, 3), (6.5, 3), (7.5, 4), (62.5, 6), (63.5, 7)] {
            at(t0, t).await;
            assert_eq!(failures_of(&hub, "vm"), attempts, "at {t} s");
        }
        at(t0, 200.0).await;
        assert_eq!(failures_of(&hub, "vm"), 9, "one attempt a minute at most, not 200");

        // The guest reset (the next attempt was due at 243 s): at once, then 1 s later.
        hub.guest_booted("vm");
        at(t0, 200.1).await;
        assert_eq!(failures_of(&hub, "vm"), 1);
        at(t0, 201.5).await;
        assert_eq!(failures_of(&hub, "vm"), 2);

        // A new QEMU under the kept session (start again) does the same.
        at(t0, 230.0).await;
        assert_eq!(failures_of(&hub, "vm"), 5, "attempts at 200, 201, 203, 207, 215 s");
        hub.start("vm", d.path().join("absent"), |_| async {});
        at(t0, 230.1).await;
        assert_eq!(failures_of(&hub, "vm"), 1);

        // Booting a VM without a session, or after stop, does nothing.
        hub.guest_booted("other");
        assert!(hub.get("other").is_none());
        hub.stop("vm");
        hub.guest_booted("vm");
        assert!(hub.get("vm").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_resets_the_backoff() {
        let d = tempfile::tempdir().unwrap();
        let socket = d.path().join("agent");
        let hub = Arc::new(AgentHub::default());
        let t0 = tokio::time::Instant::now();
        hub.start("vm", socket.clone(), |_| async {});
        at(t0, 7.5).await;
        assert_eq!(failures_of(&hub, "vm"), 4, "attempts at 0, 1, 3, 7 s");
        // The agent comes up before the attempt at 15 s; after the session the count is zero.
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        tokio::spawn(serve_agent(listener));
        at(t0, 16.0).await;
        assert!(hub.status("vm").connected);
        assert_eq!(failures_of(&hub, "vm"), 0);
        hub.stop("vm");
    }

    /// A minimal agent: answers sync, hello and agent.info for one session.
    async fn serve_agent(listener: tokio::net::UnixListener) {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let (s, _) = listener.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        let mut lines = BufReader::new(r).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let Ok(v) = serde_json::from_str::<Value>(&line) else { continue };
            let result = match v["method"].as_str() {
                Some("sync") => json!({"nonce": v["params"]["nonce"]}),
                Some("hello") => json!({"agent_version": "t", "protocol_version": 1, "capabilities": []}),
                Some("agent.info") => serde_json::to_value(info("b", 1)).unwrap(),
                _ => continue,
            };
            let reply = json!({"jsonrpc": "2.0", "id": v["id"], "result": result});
            w.write_all(format!("{reply}\n").as_bytes()).await.unwrap();
        }
    }
}
