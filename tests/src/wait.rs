//! How the end-to-end tests wait: on a fact, never for a time.
//!
//! A test that needs "the VM is running" or "the guest printed READY" waits until the daemon or
//! the guest made that true, and goes on the moment it is. The bound each wait takes is only
//! the point where the test gives up and fails; it says nothing about how fast the machine is,
//! so it is generous, and the failure names what was waited for and the last state seen.
//!
//! Two kinds of fact:
//! - a VM's state in the daemon ([`crate::TestHost::wait_vm`], [`crate::TestHost::wait_status`]):
//!   the wait subscribes to `events.subscribe` first, then reads `vm.get`, and reads it again
//!   each time an event for that VM arrives, so no change between the first look and the
//!   subscription is missed and nothing is polled on a timer. A status reached without any
//!   event is looked for once a second as well, and reported (a missing event is a daemon bug);
//! - anything else the code or the guest leaves behind (a serial log line, a file, a process
//!   gone, an answer of the guest agent): [`until`] looks again, with short pauses that grow
//!   from 10 ms to 200 ms, until its probe says done.
//!
//! Order of use: a test calls [`until`] (or [`poll`] when not reaching the state is an answer
//! rather than a failure), or the `TestHost` methods built on them.

use serde_json::{json, Value};
use std::path::Path;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};
use vmhost::client::Client;

/// How long a daemon start may take before the test fails (a failure bound: the wait returns
/// as soon as the socket answers).
pub const DAEMON_START: Duration = Duration::from_secs(60);

/// The shortest pause between two looks of [`until`]: most facts come soon after the call
/// that makes them.
const FIRST_PAUSE: Duration = Duration::from_millis(10);

/// The longest pause between two looks: a slow fact is noticed within this.
const LONGEST_PAUSE: Duration = Duration::from_millis(200);

/// How often a wait on a VM's events also looks at `vm.get` without an event (to notice, and
/// report, a change the daemon made without one).
pub const RECHECK: Duration = Duration::from_secs(1);

/// Looks with `probe` until it returns `Ok`, and returns that value. `probe` returns `Err`
/// with a description of what it saw while the fact does not hold yet.
///
/// # Panics
/// When `bound` passes first: "gave up waiting for WHAT after BOUND; last seen: ...".
pub fn until<T>(what: &str, bound: Duration, mut probe: impl FnMut() -> Result<T, String>) -> T {
    match poll(bound, &mut probe) {
        Ok(v) => v,
        Err(last) => panic!("gave up waiting for {what} after {bound:?}; last seen: {last}"),
    }
}

/// Looks with `probe` until it returns `Ok` or `bound` passes; `Err` carries the last thing
/// `probe` saw. For callers that turn "never" into their own message or answer.
///
/// # Errors
/// The probe's last `Err` when `bound` passed first.
pub fn poll<T>(bound: Duration, mut probe: impl FnMut() -> Result<T, String>) -> Result<T, String> {
    let deadline = Instant::now() + bound;
    let mut pause = FIRST_PAUSE;
    loop {
        let last = match probe() {
            Ok(v) => return Ok(v),
            Err(last) => last,
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(last);
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

/// [`until`] for a plain condition: `what` is the whole failure message's subject and
/// `state` describes what was seen when it did not hold.
///
/// # Panics
/// As [`until`].
pub fn until_true(what: &str, bound: Duration, mut ok: impl FnMut() -> bool, state: impl Fn() -> String) {
    until(what, bound, || if ok() { Ok(()) } else { Err(state()) })
}

/// Waits until a daemon answers `host.info` on `socket` and returns the answer.
///
/// # Panics
/// When `daemon` exits first, or [`DAEMON_START`] passes; both with `log()` (its log).
pub fn daemon_answers(socket: &Path, daemon: &mut Child, log: impl Fn() -> String) -> Value {
    let up = poll(DAEMON_START, || {
        if let Ok(Some(status)) = daemon.try_wait() {
            panic!("vmhostd exited with {status}; log:\n{}", log());
        }
        match Client::connect(socket).map(|mut c| c.call::<Value>("host.info", json!({}))) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) | Err(e) => Err(e.to_string()),
        }
    });
    up.unwrap_or_else(|last| {
        panic!(
            "vmhostd did not answer host.info on {} within {DAEMON_START:?} ({last}); log:\n{}",
            socket.display(),
            log()
        )
    })
}

/// Waits until `child` exits and returns its status.
///
/// # Panics
/// When `bound` passes first (the child is killed then), naming `what`.
pub fn exited(child: &mut Child, what: &str, bound: Duration) -> ExitStatus {
    let status = poll(bound, || match child.try_wait() {
        Ok(Some(status)) => Ok(status),
        Ok(None) => Err("still running".into()),
        Err(e) => Err(e.to_string()),
    });
    status.unwrap_or_else(|last| {
        let _ = child.kill();
        panic!("gave up waiting for {what} to exit after {bound:?} ({last})")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fact_that_holds_returns_at_once_and_one_that_never_does_says_what_was_seen() {
        let start = Instant::now();
        assert_eq!(until("nothing", Duration::from_secs(60), || Ok::<_, String>(7)), 7);
        assert!(start.elapsed() < Duration::from_secs(30), "no pause before a fact that holds");
        let mut n = 0;
        let got = poll(Duration::from_secs(60), || {
            n += 1;
            if n == 3 {
                Ok(n)
            } else {
                Err(format!("n={n}"))
            }
        });
        assert_eq!(got, Ok(3));
        assert_eq!(poll(Duration::ZERO, || Err::<(), _>("still 1".to_string())), Err("still 1".to_string()));
        let message = std::panic::catch_unwind(|| until("the sky", Duration::ZERO, || Err::<(), _>("blue".into())))
            .err()
            .and_then(|p| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        assert!(message.contains("waiting for the sky") && message.contains("last seen: blue"), "{message}");
    }
}
