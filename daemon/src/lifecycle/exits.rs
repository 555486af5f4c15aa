//! Exits vmhostd did not ask for, and the restart policy (`spec.restart_policy`).
//!
//! Every running VM is watched twice: its process by a pidfd ([`Manager::watch`]), and its
//! event monitor (a second QMP monitor, `RUN/NAME/qmpev`) by a listener that remembers whether
//! a `SHUTDOWN` event said the guest asked for it. When the process ends while no operation
//! holds the VM ([`Manager::on_exit`]; while one does, the exit is queued behind it and
//! handled the moment it ends, [`super::busy`]):
//!
//! 1. the cause is the listener's answer (waited for briefly: the event is written before QEMU
//!    exits): a guest power-off, or anything else (crash, kill, a host-side `quit`);
//! 2. [`verdict`] (pure) decides from the policy, the cause and the failures of the last
//!    10 minutes ([`failures_after`]): `stopped` (a guest power-off under `on-failure` or
//!    `never`; the desired state becomes `stopped`), `dead` (`never`), a restart after a backoff
//!    of 1 s doubling to 60 s, or `failed` at the 5th failure within 10 minutes;
//! 3. the verdict is recorded (status, `last_exit`, the failure times) before anything else,
//!    taking the VM's busy flag in the same step; then the VM's run dir, taps, agent session and
//!    devices go ([`super::teardown`]) and the flag is released (an operation asked for
//!    meanwhile, by a client that saw the new status, waits for that: [`super::busy`]);
//! 4. a restart sleeps the backoff and starts the VM through the ordinary start steps (reason
//!    `restart policy`), only if it is still `dead` and desired running and nobody else is working
//!    on it. A daemon killed meanwhile leaves a `dead` VM desired running, which autostart starts.
//!
//! 10 minutes of uptime reset the count. A restart that fails to start leaves the VM `failed`
//! (no retry loop).
//!
//! These stay [`Manager`] methods that take the VM's name, not steps of an operation
//! ([`super::op::VmOp`]): the watcher runs beside every operation, and the cleanup holds the
//! VM's flag through a guard from [`Manager::write_and_hold`] (`busy::Holder::ExitCleanup`), not
//! as an operation, so that its record and its flag are one step. Holding the flag, the
//! cleanup makes a [`HeldVm`] for the steps it shares with operations and recovery.

pub use super::busy::ExitCause;
pub(super) use super::busy::PendingExit;
use super::held::HeldVm;
use super::registry::Change;
use super::teardown::Devices;
use super::Manager;
use crate::api::{Code, RestartPolicy, VmStatus};
use crate::process::{self, ProcessIdentity};
use std::sync::Arc;
use std::time::Duration;

/// The window failures are counted in, and the uptime that forgives them.
pub const FAILURE_WINDOW_S: u64 = 600;
/// The failure that makes a VM `failed` instead of restarted.
pub const MAX_FAILURES: usize = 5;
/// The longest backoff.
pub const MAX_BACKOFF_S: u64 = 60;

/// How long `on_exit` waits for the event listener to have read the `SHUTDOWN` event.
const EVENT_WAIT: Duration = Duration::from_secs(2);

/// The VM's [`crate::state::VmRecord::unclean_end`] after its QEMU ended by `cause`: none after
/// the guest's own power-off, the cause otherwise.
pub(super) fn unclean_end_after(cause: &ExitCause) -> Option<String> {
    match cause {
        ExitCause::GuestPowerOff => None,
        ExitCause::Failure(why) => Some(format!("the VM's QEMU ended without a clean power-off ({why})")),
    }
}

/// What happens to a VM whose QEMU ended without vmhostd asking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// `stopped`, desired state `stopped`: the guest chose to power off.
    Stopped,
    /// `dead`, left so (`never`).
    Dead,
    /// `dead` now, started again after this delay.
    Restart(Duration),
    /// `failed`: too many failures within the window.
    GiveUp,
}

/// The failure times that count after an exit at `now`: the earlier ones within
/// [`FAILURE_WINDOW_S`], none at all if the VM had run that long (`started_at`), then `now`.
pub fn failures_after(earlier: &[u64], started_at: Option<u64>, now: u64) -> Vec<u64> {
    let ran_long = started_at.is_some_and(|s| now.saturating_sub(s) >= FAILURE_WINDOW_S);
    let mut kept: Vec<u64> = if ran_long {
        Vec::new()
    } else {
        earlier.iter().copied().filter(|t| now - t.min(&now) < FAILURE_WINDOW_S).collect()
    };
    kept.push(now);
    kept
}

/// The backoff before restart number `n` (1-based) of the current window: 1 s doubling, at most
/// [`MAX_BACKOFF_S`].
pub fn backoff(n: usize) -> Duration {
    let exp = u32::try_from(n.saturating_sub(1)).unwrap_or(u32::MAX).min(16);
    Duration::from_secs((1u64 << exp).min(MAX_BACKOFF_S))
}

/// The verdict for an exit with `cause` under `policy`, `failures` being [`failures_after`]'s
/// result (this exit included) when the cause is a failure.
pub fn verdict(policy: RestartPolicy, cause: &ExitCause, failures: usize) -> Verdict {
    match (cause, policy) {
        (ExitCause::GuestPowerOff, RestartPolicy::Always) => Verdict::Restart(backoff(1)),
        (ExitCause::GuestPowerOff, _) => Verdict::Stopped,
        (ExitCause::Failure(_), RestartPolicy::Never) => Verdict::Dead,
        (ExitCause::Failure(_), _) if failures >= MAX_FAILURES => Verdict::GiveUp,
        (ExitCause::Failure(_), _) => Verdict::Restart(backoff(failures)),
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn unix_time_of(rfc3339: Option<&str>) -> Option<u64> {
    let t = humantime::parse_rfc3339(rfc3339?).ok()?;
    t.duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_secs())
}

impl Manager {
    /// Watches a running VM: its process (pidfd) and its event monitor. See the module doc.
    pub(super) fn watch(self: &Arc<Self>, name: &str, id: ProcessIdentity) {
        let listener = self.listen_for_shutdown(name);
        let mgr = Arc::downgrade(self);
        let name = name.to_string();
        tokio::spawn(async move {
            if let Err(e) = process::wait_exit_of(&id).await {
                tracing::warn!(vm = %name, pid = id.pid, error = %e, "cannot watch QEMU; relying on reads");
                if let Some(mgr) = mgr.upgrade() {
                    mgr.registry.mark_unwatched(&name);
                }
                return;
            }
            // Readers see the VM dead from now on, while the cause is still being learnt.
            if let Some(mgr) = mgr.upgrade() {
                mgr.registry.mark_exited(&name, &id);
            }
            let cause = match tokio::time::timeout(EVENT_WAIT, listener).await {
                Ok(Ok(Some(true))) => ExitCause::GuestPowerOff,
                Ok(Ok(Some(false))) => ExitCause::Failure("QEMU shut down at the host's request".into()),
                _ => ExitCause::Failure("QEMU exited unexpectedly (crashed or killed)".into()),
            };
            if let Some(mgr) = mgr.upgrade() {
                mgr.on_exit(&name, &id, cause).await;
            }
        });
    }

    /// Listens on the VM's event monitor until QEMU closes it, telling the agent hub of every
    /// guest reset, syncing the guest's clock when a paused guest runs again
    /// ([`super::housekeeping::sync_time_after`]: `RESUME` after `STOP`), and keeps it as the
    /// VM's QMP session ([`crate::qemu::session`]) meanwhile. The task's result: whether the
    /// last `SHUTDOWN` event said the guest asked (`None`: no such event, or no monitor, as for
    /// a VM started before it existed).
    fn listen_for_shutdown(self: &Arc<Self>, name: &str) -> tokio::task::JoinHandle<Option<bool>> {
        let socket = self.paths(name).qmp_events;
        let name = name.to_string();
        let agents = Arc::clone(&self.agents);
        let sessions = Arc::clone(&self.qmp_sessions);
        let mgr = Arc::downgrade(self);
        tokio::spawn(async move {
            let qmp = match crate::qemu::qmp::Qmp::connect(&socket, Duration::from_secs(10)).await {
                Ok(q) => q,
                Err(e) => {
                    tracing::debug!(vm = %name, error = %e, "no event monitor; exits count as failures");
                    return None;
                }
            };
            // The VM's one kept session: operations borrow it for their commands meanwhile.
            let session = crate::qemu::session::Session::new(qmp);
            sessions.insert(&name, &session);
            let mut guest = None;
            // The guest's vCPUs were stopped (an operator's `stop`, an I/O error): its clock
            // stood still meanwhile.
            let mut paused = false;
            while let Ok(event) = session.next_event().await {
                if event["event"] == "SHUTDOWN" {
                    // guest: true also comes with a guest panic ("guest-panic"): only a power-off
                    // the guest asked for counts.
                    guest = Some(event["data"]["guest"] == true && event["data"]["reason"] == "guest-shutdown");
                    tracing::info!(vm = %name, data = %event["data"], "QEMU reports a shutdown");
                } else if event["event"] == "RESET" {
                    // The guest boots again: its agent is worth trying at once, not after the
                    // backoff the absent agent had reached.
                    agents.guest_booted(&name);
                } else if event["event"] == "STOP" {
                    paused = true;
                } else if event["event"] == "RESUME" && std::mem::take(&mut paused) {
                    if let Some(mgr) = mgr.upgrade() {
                        tokio::spawn(super::housekeeping::sync_time_after(mgr, name.clone(), "the guest resumed"));
                    }
                }
            }
            sessions.remove(&name, &session);
            guest
        })
    }

    /// Records the end of a VM's process and applies its restart policy. While an operation
    /// holds the VM, the exit is queued behind it ([`super::busy`]) and this runs again the
    /// moment the operation ends, on the record the operation left.
    pub(super) async fn on_exit(self: &Arc<Self>, name: &str, id: &ProcessIdentity, cause: ExitCause) {
        let mut decided = Verdict::Dead;
        let mut queued = false;
        let now = unix_now();
        // The record and the VM's busy flag in one step: the cleanup below must not take the
        // run dir, taps or devices of a start that begins meanwhile, and an operation that
        // ends meanwhile must find the exit queued.
        let result = self.write_and_hold(name, "QEMU exited", super::busy::Holder::ExitCleanup, |t| {
            let exit = PendingExit { id: id.clone(), cause: cause.clone() };
            if t.busy.queue_exit(name, exit).is_none() {
                queued = true;
                return Ok((Change::Keep, ()));
            }
            let Some(rec) = t.vms.get(name) else { return Ok((Change::Keep, ())) };
            if rec.status != VmStatus::Running || rec.process.as_ref() != Some(id) {
                return Ok((Change::Keep, ()));
            }
            let mut r = rec.clone();
            let failures = match cause {
                ExitCause::GuestPowerOff => r.failures.clone(),
                ExitCause::Failure(_) => failures_after(&r.failures, unix_time_of(r.started_at.as_deref()), now),
            };
            decided = verdict(r.spec.restart_policy, &cause, failures.len());
            r.failures = failures;
            r.process = None;
            r.last_exit = Some(match &cause {
                ExitCause::GuestPowerOff => "guest powered off".to_string(),
                ExitCause::Failure(why) => why.clone(),
            });
            r.unclean_end = unclean_end_after(&cause);
            match decided {
                Verdict::Stopped => {
                    r.set_status(VmStatus::Stopped)?;
                    r.spec.state = crate::api::DesiredState::Stopped;
                }
                Verdict::Dead | Verdict::Restart(_) => r.set_status(VmStatus::Dead)?,
                Verdict::GiveUp => r.set_status(VmStatus::Failed)?,
            }
            if let ExitCause::Failure(why) = &cause {
                let message = match decided {
                    Verdict::GiveUp => format!(
                        "{why}; {MAX_FAILURES} failures within {} minutes: not restarted again",
                        FAILURE_WINDOW_S / 60
                    ),
                    _ => why.clone(),
                };
                r.last_error = Some(crate::api::LastError { code: Code::ProvisioningFailed.as_i32(), message });
            }
            Ok((Change::Put(Box::new(r)), ()))
        });
        match result {
            Ok((Some(guard), ())) => {
                tracing::info!(vm = name, cause = ?cause, verdict = ?decided, "QEMU ended without vmhostd asking");
                if let Err(e) = HeldVm::new(self, name).release_host_side(Devices::Release).await {
                    tracing::error!(vm = name, error = %e, "passthrough devices of an ended VM not restored");
                }
                drop(guard);
                if let Verdict::Restart(after) = decided {
                    self.restart_later(name, after);
                }
            }
            Ok((None, ())) if queued => {
                tracing::debug!(
                    vm = name,
                    pid = id.pid,
                    "QEMU ended while an operation holds the VM; handled when it ends"
                );
            }
            Ok((None, ())) => {} // stopped, restarted or destroyed by an operation
            Err(e) => tracing::error!(vm = name, error = %e, "cannot record the VM's exit"),
        }
    }

    /// Starts VM `name` again after `after`, if by then it is still `dead`, desired running and
    /// free (an operator's stop, destroy or start meanwhile wins).
    fn restart_later(self: &Arc<Self>, name: &str, after: Duration) {
        let mgr = Arc::downgrade(self);
        let name = name.to_string();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let Some(mgr) = mgr.upgrade() else { return };
            match super::ops::start_if_wanted(&mgr, "restart policy", &name, &[VmStatus::Dead]).await {
                Ok(Some(_)) => {
                    let _ = mgr.update(&name, "restart policy", |r| r.restarts = r.restarts.saturating_add(1));
                    tracing::info!(vm = %name, "restarted by its restart policy");
                }
                Ok(None) => tracing::info!(vm = %name, "restart policy: changed meanwhile; not restarted"),
                Err(e) => {
                    tracing::warn!(vm = %name, error = %e, "restart policy: the start failed");
                    // A start refused before launch leaves the VM dead: it is failed, with why.
                    let le = super::last_error(&e);
                    let _ = mgr.update_if(
                        &name,
                        "restart policy: start failed",
                        |r, busy| !busy && r.status == VmStatus::Dead,
                        |r| {
                            // The condition holds it dead, and dead -> failed is in the table.
                            if r.set_status(VmStatus::Failed).is_ok() {
                                r.last_error = Some(le);
                            }
                        },
                    );
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RestartPolicy::{Always, Never, OnFailure};

    fn crash() -> ExitCause {
        ExitCause::Failure("killed".into())
    }

    #[test]
    fn each_policy_and_cause() {
        assert_eq!(verdict(OnFailure, &ExitCause::GuestPowerOff, 0), Verdict::Stopped);
        assert_eq!(verdict(Never, &ExitCause::GuestPowerOff, 0), Verdict::Stopped);
        assert_eq!(verdict(Always, &ExitCause::GuestPowerOff, 0), Verdict::Restart(Duration::from_secs(1)));
        assert_eq!(verdict(Never, &crash(), 1), Verdict::Dead);
        assert_eq!(verdict(OnFailure, &crash(), 1), Verdict::Restart(Duration::from_secs(1)));
        assert_eq!(verdict(Always, &crash(), 2), Verdict::Restart(Duration::from_secs(2)));
        assert_eq!(verdict(OnFailure, &crash(), 4), Verdict::Restart(Duration::from_secs(8)));
        assert_eq!(verdict(OnFailure, &crash(), 5), Verdict::GiveUp);
        assert_eq!(verdict(Always, &crash(), 6), Verdict::GiveUp);
        assert_eq!(verdict(Never, &crash(), 9), Verdict::Dead, "never: no counting");
    }

    #[test]
    fn backoff_doubles_from_one_second_to_a_minute() {
        let secs: Vec<u64> = (1..=9).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff(usize::MAX).as_secs(), 60);
    }

    #[test]
    fn failures_count_within_ten_minutes_and_uptime_forgives_them() {
        let now = 10_000;
        assert_eq!(failures_after(&[], Some(now - 5), now), [now]);
        assert_eq!(failures_after(&[now - 700, now - 300, now - 10], Some(now - 5), now), [now - 300, now - 10, now]);
        assert_eq!(failures_after(&[now - 300, now - 10], Some(now - 600), now), [now], "10 minutes up: forgiven");
        assert_eq!(failures_after(&[now - 300], None, now), [now - 300, now]);
        // A clock that went backwards does not panic.
        assert_eq!(failures_after(&[now + 50], Some(now - 1), now), [now + 50, now]);
    }
}
