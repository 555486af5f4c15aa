//! Test-only crash points: the fault tests kill vmhostd at a chosen step of an operation to prove
//! that a restart leaves no orphan and no VM started twice.
//!
//! The lifecycle calls [`hit`] with a step name (e.g. `launch:taps`, listed in
//! `docs/lifecycle.md`) at every step boundary, and between passthrough devices
//! (`vfio:bound:N`, `vfio:released:N`, from the blocking pool). In builds with debug assertions
//! (the builds the tests run) it reads `RUN/crashpoint`; when the file names that step, the
//! daemon sends itself SIGKILL there, exactly as an OOM kill or power cut would stop it. Release
//! builds compile it to nothing: production never reads the file and cannot be made to crash by
//! it.

use std::path::Path;

/// Name of the file in the run dir that arms a crash point.
pub const FILE: &str = "crashpoint";

/// Kills the daemon with SIGKILL when `RUN/crashpoint` names `step` (debug builds only).
#[cfg(debug_assertions)]
pub fn hit(run: &Path, step: &str) {
    let armed = std::fs::read_to_string(run.join(FILE)).is_ok_and(|s| s.trim() == step);
    if armed {
        tracing::warn!(step, "crash point reached: killing vmhostd");
        // SAFETY: kill(2) on our own pid; no memory is involved.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Release builds: no crash points.
#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn hit(_run: &Path, _step: &str) {}
