//! Guest housekeeping through the exec ports: the clock (`vm.sync_time`, and after a paused
//! guest runs again), a power-off the guest cannot ignore (`vm.stop {method: "agent"}`), and
//! the spec's SSH access (`ssh.authorize`).
//!
//! None of this needs `[agent] allow_exec`: each request is a fixed one the spec or the
//! operator asked for, never a command of the caller's choosing. Each runs as one session on a
//! free exec slot, so it never waits behind the network agent's session or a long `vm.exec`.
//!
//! Order of use: [`sync_time`] from the RPC method; [`sync_time_after`] from the exit
//! watcher's event listener when QEMU reports `RESUME` after a `STOP`; [`ask_shutdown`] from
//! [`super::op::VmOp::shut_down`] before it falls back to ACPI; [`authorize_ssh`] from the
//! agent session callback (every new session, a guest reboot) and from `vm.apply` when only
//! `ssh` changed.

use super::Manager;
use crate::agent::exec::session;
use crate::api::exec::{GuestAction, GuestActionKind};
use crate::api::housekeeping::SyncTimeReply;
use crate::api::{ApiError, Code, VmStatus};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use vmhost_agent_protocol::exec::{ShutdownReply, SshAuthorizeParams, SshAuthorizeReply, TimeSetParams, TimeSetReply};

/// How long a housekeeping request's reply may take once its session is open: each is one
/// quick system call or account change in the guest.
pub const REPLY_BOUND: Duration = Duration::from_secs(10);

/// The uid housekeeping vmhostd starts on its own is audited under (its own).
pub(super) fn own_uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

/// One housekeeping request on a free exec slot of VM `name`, whose QEMU must be running.
/// Returns the reply and the slot.
///
/// # Errors
/// 4040; 5001 when the VM is not running, has no exec ports or no exec server answers; 4096,
/// 5002, 4001 with `details.agent_error` (the mapping of `ExecError` in `owner_errors.rs`).
async fn request<P: Serialize, R: DeserializeOwned>(
    mgr: &Manager,
    name: &str,
    method: &str,
    params: &P,
) -> Result<(R, usize), ApiError> {
    let rec = mgr.record(name)?;
    // Stopping too: a stop asks `guest.shutdown` after recording it.
    if !matches!(rec.status, VmStatus::Running | VmStatus::Stopping) {
        return Err(ApiError::new(
            Code::AgentNotConnected,
            format!("VM {name:?} is {}: its guest's exec server can be asked only while it runs", rec.status),
        )
        .field("name"));
    }
    let sockets = mgr.paths(name).exec;
    // Not `super::exec::exec_port_call`: that one wants the VM running, and a stop asks
    // `guest.shutdown` after recording `stopping`.
    Ok(session::call(&mgr.exec_slots, name, &sockets, method, params, REPLY_BOUND).await?)
}

/// Logs the audit line of a housekeeping action (asked of the guest on `slot`, or failed
/// before) and emits its event.
fn audit(mgr: &Manager, name: &str, peer_uid: u32, kind: GuestActionKind, slot: Option<usize>, what: &str) {
    tracing::info!(target: super::exec::AUDIT_TARGET, peer_uid, vm = name, action = ?kind, slot, "{what}");
    let status = mgr.record(name).ok().map(|r| r.status);
    let action = GuestAction::new(kind, peer_uid);
    mgr.events().emit_guest(name, status, what, action);
}

/// `vm.sync_time`: sets the guest's clock to the host's (`time.set`), for the API peer
/// `peer_uid`.
///
/// # Errors
/// As [`request`].
pub(crate) async fn sync_time(mgr: &Manager, name: &str, peer_uid: u32) -> Result<SyncTimeReply, ApiError> {
    let sent = host_now_ns();
    let kind = GuestActionKind::SyncTime;
    match request::<_, TimeSetReply>(mgr, name, "time.set", &TimeSetParams { unix_ns: sent }).await {
        Ok((reply, slot)) => {
            let synced = sync_reply(sent, &reply);
            let what = format!("guest sync_time: clock was {}, offset {} ms", synced.before, synced.offset_ms);
            audit(mgr, name, peer_uid, kind, Some(slot), &what);
            Ok(synced)
        }
        Err(e) => {
            audit(mgr, name, peer_uid, kind, None, &format!("guest sync_time failed: {}", e.message));
            Err(e)
        }
    }
}

/// [`sync_time`] that vmhostd starts on its own (`why`: a paused guest runs again); a
/// failure is logged, never reported.
pub(super) async fn sync_time_after(mgr: Arc<Manager>, name: String, why: &'static str) {
    match sync_time(&mgr, &name, own_uid()).await {
        Ok(r) => tracing::info!(vm = %name, why, offset_ms = r.offset_ms, "guest clock synced"),
        Err(e) => tracing::warn!(vm = %name, why, error = %e, "guest clock not synced"),
    }
}

/// How `VmOp::shut_down` asks the guest to power off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PowerOff {
    /// It does not: QEMU is killed at once (`force`).
    Kill,
    /// The ACPI power button.
    Acpi,
    /// `guest.shutdown` through the exec server, for the API peer `peer_uid`; the ACPI button
    /// at once when that cannot be asked.
    Agent {
        /// Who asked, for the audit line.
        peer_uid: u32,
    },
}

impl PowerOff {
    /// What `vm.stop`'s `force` and `method` ask for.
    pub(super) fn of(force: bool, method: crate::api::StopMethod, peer_uid: u32) -> PowerOff {
        match (force, method) {
            (true, _) => PowerOff::Kill,
            (false, crate::api::StopMethod::Acpi) => PowerOff::Acpi,
            (false, crate::api::StopMethod::Agent) => PowerOff::Agent { peer_uid },
        }
    }
}

/// Asks the guest's exec server to power the guest off (`guest.shutdown`), for
/// `vm.stop {method: "agent"}` of the API peer `peer_uid`. The caller falls back to ACPI on
/// any error.
///
/// # Errors
/// As [`request`].
pub(super) async fn ask_shutdown(mgr: &Manager, name: &str, peer_uid: u32) -> Result<ShutdownReply, ApiError> {
    let kind = GuestActionKind::Shutdown;
    match request::<_, ShutdownReply>(mgr, name, "guest.shutdown", &json!({})).await {
        Ok((reply, slot)) => {
            let how = crate::guest_text::GuestText(&reply.how).to_string();
            audit(mgr, name, peer_uid, kind, Some(slot), &format!("guest shutdown asked: {how}"));
            Ok(reply)
        }
        Err(e) => {
            audit(mgr, name, peer_uid, kind, None, &format!("guest shutdown failed: {}", e.message));
            Err(e)
        }
    }
}

/// Writes the recorded spec's `ssh` keys into the guest (`ssh.authorize`); `None` when the
/// spec has no `ssh` (nothing is removed in the guest).
///
/// # Errors
/// As [`request`].
pub(super) async fn authorize_ssh(mgr: &Manager, name: &str) -> Result<Option<SshAuthorizeReply>, ApiError> {
    let Some(ssh) = mgr.record(name)?.spec.ssh else { return Ok(None) };
    let params = SshAuthorizeParams { user: ssh.user.clone(), keys: ssh.keys.clone() };
    let (reply, slot): (SshAuthorizeReply, usize) = request(mgr, name, "ssh.authorize", &params).await?;
    if reply.changed || reply.created {
        let path = crate::guest_text::GuestText(&reply.path).to_string();
        tracing::info!(
            target: super::exec::AUDIT_TARGET,
            vm = name,
            user = %ssh.user,
            keys = ssh.keys.len(),
            created = reply.created,
            slot,
            "guest ssh keys written to {path}"
        );
    }
    Ok(Some(reply))
}

/// Pauses between the tries of [`authorize_ssh_soon`]: the exec server may start a little
/// after the network agent whose session triggers it.
const SSH_RETRIES: [Duration; 4] =
    [Duration::from_secs(2), Duration::from_secs(4), Duration::from_secs(8), Duration::from_secs(16)];

/// [`authorize_ssh`] at an agent session's start, in a task of its own (the session's
/// callback must not wait): tried again after [`SSH_RETRIES`] while no exec server answers;
/// every failure is logged, never reported.
pub(super) fn authorize_ssh_soon(mgr: &Arc<Manager>, name: &str) {
    let weak = Arc::downgrade(mgr);
    let name = name.to_string();
    tokio::spawn(async move {
        let mut pauses = SSH_RETRIES.iter();
        loop {
            let Some(mgr) = weak.upgrade() else { return };
            let e = match authorize_ssh(&mgr, &name).await {
                Ok(_) => return,
                Err(e) => e,
            };
            let again = matches!(e.code, Code::AgentNotConnected | Code::AgentTimeout | Code::SlotsBusy);
            match pauses.next() {
                Some(pause) if again => {
                    tracing::debug!(vm = %name, error = %e, "ssh keys not written yet; trying again");
                    drop(mgr);
                    tokio::time::sleep(*pause).await;
                }
                _ => {
                    tracing::warn!(vm = %name, error = %e, "guest ssh keys not written");
                    return;
                }
            }
        }
    });
}

/// A clock reading in nanoseconds since the epoch as RFC 3339, UTC, milliseconds. Values past
/// what `SystemTime` holds (a hostile guest's) are shown as the epoch rather than refused: the
/// reading is only reported.
fn rfc3339_ms(unix_ns: u64) -> String {
    let t = UNIX_EPOCH.checked_add(Duration::from_nanos(unix_ns)).unwrap_or(UNIX_EPOCH);
    humantime::format_rfc3339_millis(t).to_string()
}

/// The host's clock in nanoseconds since the epoch (0 before it, which no host is).
fn host_now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// What `vm.sync_time` answers for a `time.set` the host sent at `sent_ns` and the guest
/// answered with `reply`: the guest's readings, and host minus guest-before in milliseconds
/// (saturating: a guest may claim any reading).
fn sync_reply(sent_ns: u64, reply: &TimeSetReply) -> SyncTimeReply {
    let offset_ns = i128::from(sent_ns) - i128::from(reply.before_ns);
    let offset_ms = i64::try_from(offset_ns / 1_000_000).unwrap_or(if offset_ns < 0 { i64::MIN } else { i64::MAX });
    SyncTimeReply { before: rfc3339_ms(reply.before_ns), after: rfc3339_ms(reply.after_ns), offset_ms }
}

#[cfg(test)]
mod tests {
    use super::*;

    const Y2001: u64 = 978_307_200_000_000_000;

    #[test]
    fn a_guest_in_2001_is_decades_behind() {
        let sent = 1_796_000_000_123_000_000; // 2026-11-30
        let r = sync_reply(sent, &TimeSetReply { before_ns: Y2001 + 7_123_000_000, after_ns: sent + 2_000_000 });
        assert_eq!(r.before, "2001-01-01T00:00:07.123Z");
        assert_eq!(r.after, "2026-11-30T00:53:20.125Z");
        assert_eq!(r.offset_ms, (sent - Y2001 - 7_123_000_000) as i64 / 1_000_000);
        assert!(r.offset_ms > 0, "positive: the guest was behind");
    }

    #[test]
    fn a_guest_ahead_gives_a_negative_offset_and_lies_are_bounded() {
        let r = sync_reply(Y2001, &TimeSetReply { before_ns: Y2001 + 1_500_000_000, after_ns: Y2001 });
        assert_eq!(r.offset_ms, -1500);
        let r = sync_reply(0, &TimeSetReply { before_ns: u64::MAX, after_ns: u64::MAX });
        assert_eq!(r.offset_ms, -((u64::MAX / 1_000_000) as i64));
        assert!(r.before.starts_with("2554-"), "{}", r.before);
    }

    #[test]
    fn force_kills_whatever_the_method_and_agent_carries_the_peer() {
        use crate::api::StopMethod::{Acpi, Agent};
        assert_eq!(PowerOff::of(true, Agent, 7), PowerOff::Kill);
        assert_eq!(PowerOff::of(true, Acpi, 7), PowerOff::Kill);
        assert_eq!(PowerOff::of(false, Acpi, 7), PowerOff::Acpi);
        assert_eq!(PowerOff::of(false, Agent, 7), PowerOff::Agent { peer_uid: 7 });
    }

    #[test]
    fn exec_failures_become_the_documented_codes() {
        use crate::agent::exec::session::ExecError;
        use crate::agent::exec::slots::SlotsBusy;
        let e = ApiError::from(ExecError::Busy(SlotsBusy));
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (4096, Some("name")));
        assert_eq!(e.details, json!({"slots": 8}));
        let e = ApiError::from(ExecError::NoPorts);
        assert_eq!(e.code.as_i32(), 5001);
        assert!(e.message.contains("restart the VM to get exec ports"), "{}", e.message);
        let e = ApiError::from(ExecError::Timeout { method: "time.set".into(), after: REPLY_BOUND });
        assert_eq!(e.code.as_i32(), 5002);
        let refused = ExecError::Refused {
            method: "time.set".into(),
            code: 5100,
            message: "no\u{1b}[2J".into(),
            data: json!({"field": "unix_ns"}),
        };
        let e = ApiError::from(refused);
        assert_eq!(e.code.as_i32(), 4001);
        assert!(!e.message.contains('\u{1b}'), "the guest's text is escaped: {}", e.message);
        assert_eq!(e.details["agent_error"]["data"]["field"], "unix_ns");
    }

    #[test]
    fn the_host_clock_is_read_in_nanoseconds() {
        let now = host_now_ns();
        assert!(now > 1_700_000_000_000_000_000, "{now}");
    }
}
