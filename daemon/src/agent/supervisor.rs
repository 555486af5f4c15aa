//! One agent session per running VM, kept alive in the background and shared by RPC calls.
//!
//! Order: [`AgentHub::start`] when a VM runs (a task connects, pings and reconnects until
//! [`AgentHub::stop`]); [`AgentHub::call`] from RPC methods; [`AgentHub::status`] for `vm.get`.
//! A stalled or flooding guest only ever holds its own VM's session, and every wait is bounded,
//! so it cannot block the daemon or other VMs.

use super::conn::AgentConn;
use super::error::AgentError;
use crate::api::{AgentStatus, ApiError, Code};
use crate::guest_text::GuestText;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Mutex as AsyncMutex;
use vmhost_agent_protocol::AgentInfo;

/// Bound on connecting and resynchronising.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on one call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a connected agent is pinged (`agent.info`).
const PING_EVERY: Duration = Duration::from_secs(5);
/// How long to wait between connection attempts.
const RETRY_EVERY: Duration = Duration::from_secs(1);

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
    stop: tokio::sync::watch::Sender<bool>,
}

/// All agent sessions.
#[derive(Default)]
pub struct AgentHub {
    vms: Mutex<HashMap<String, Arc<VmAgent>>>,
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
    /// (re)connection. Does nothing if one is already kept.
    pub fn start<F, Fut>(self: &Arc<Self>, vm: &str, socket: PathBuf, on_event: F)
    where
        F: Fn(SessionEvent) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let mut vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        if vms.contains_key(vm) {
            return;
        }
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let agent = Arc::new(VmAgent { socket, conn: AsyncMutex::new(None), status: Mutex::default(), stop });
        vms.insert(vm.to_string(), agent.clone());
        let name = vm.to_string();
        tokio::spawn(async move {
            let mut last_boot = None;
            loop {
                let event = keep(&agent, &name, &mut last_boot).await;
                if let Some(event) = event {
                    on_event(event).await;
                }
                let pause =
                    if agent.status.lock().map(|s| s.connected).unwrap_or(false) { PING_EVERY } else { RETRY_EVERY };
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
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
        let agent = self.get(vm).ok_or_else(|| not_connected(vm, "the VM is not running"))?;
        let mut guard = tokio::time::timeout(CALL_TIMEOUT, agent.conn.lock()).await.map_err(|_| {
            ApiError::new(Code::AgentTimeout, "the guest agent is busy with another call").field("name")
        })?;
        let Some(conn) = guard.as_mut() else { return Err(not_connected(vm, "no session yet")) };
        match conn.call(method, params, CALL_TIMEOUT).await {
            Ok(v) => {
                if let Ok(mut s) = agent.status.lock() {
                    s.last_seen = Some(crate::api::now_rfc3339());
                }
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
                if let Ok(mut s) = agent.status.lock() {
                    s.connected = false;
                }
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
                if let Ok(mut s) = agent.status.lock() {
                    *s = AgentStatus {
                        connected: true,
                        version: Some(conn.hello.agent_version.clone()),
                        last_seen: Some(crate::api::now_rfc3339()),
                    };
                }
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
            if let Ok(mut s) = agent.status.lock() {
                s.last_seen = Some(crate::api::now_rfc3339());
            }
            let rebooted = last_boot.as_ref().is_some_and(|b| b.rebooted(&info));
            tracing::debug!(vm, uptime = info.uptime_s, rebooted, "agent ping");
            *last_boot = Some(Baseline::of(&info));
            rebooted.then_some(SessionEvent::GuestRebooted)
        }
        Err(e) => {
            tracing::info!(vm, error = %e, "guest agent session lost; reconnecting");
            *guard = None;
            if let Ok(mut s) = agent.status.lock() {
                s.connected = false;
            }
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
}
