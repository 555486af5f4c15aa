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
//!
//! In every build a step boundary is also a debug event (target [`STEP_TARGET`], field `step`):
//! with `VMHOST_LOG=debug` the log's timestamps then say how long each step of an operation
//! took (`vmhost-bench --only create` prints the table from them). A disabled debug event
//! costs a load and a compare.

use std::path::Path;

/// Name of the file in the run dir that arms a crash point.
pub const FILE: &str = "crashpoint";

/// The tracing target of the step events: `vmhost::step`.
pub const STEP_TARGET: &str = "vmhost::step";

/// Logs that an operation reached `step` (debug level, target [`STEP_TARGET`]).
#[inline]
pub fn reached(step: &str) {
    tracing::debug!(target: STEP_TARGET, step, "step");
}

/// Kills the daemon with SIGKILL when `RUN/crashpoint` names `step` (debug builds only).
#[cfg(debug_assertions)]
pub fn hit(run: &Path, step: &str) {
    reached(step);
    let armed = std::fs::read_to_string(run.join(FILE)).is_ok_and(|s| s.trim() == step);
    if armed {
        tracing::warn!(step, "crash point reached: killing vmhostd");
        // SAFETY: kill(2) on our own pid; no memory is involved.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Release builds: no crash points, only the step event.
#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn hit(_run: &Path, step: &str) {
    reached(step);
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    /// The step names the code passes to a crash point: the string literal after
    /// `crashpoint("` or after `hit(&...run, "` in every source file; the numbered ones
    /// (`vfio:bound:N`) by their prefix.
    fn steps_in(dir: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                steps_in(&path, out);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for marker in ["crashpoint(\"", "paths.run, \""] {
                for piece in text.split(marker).skip(1) {
                    let step = &piece[..piece.find('"').unwrap()];
                    let name = |c: char| c.is_ascii_lowercase() || "_:-".contains(c);
                    if step.contains(':') && step.chars().all(name) {
                        out.insert(step.to_string());
                    }
                }
            }
        }
    }

    /// docs/lifecycle.md's crash point table, the one list operators and test writers read,
    /// names every crash point the code has and no other.
    #[test]
    fn lifecycle_md_lists_every_crash_point() {
        let mut code = BTreeSet::new();
        steps_in(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut code);
        let code: BTreeSet<String> =
            code.into_iter().map(|s| if s.starts_with("vfio:") { format!("{s}:N") } else { s }).collect();
        let doc = include_str!("../../docs/lifecycle.md");
        let start = doc.find("## Crash points (tests only)").unwrap();
        let section = &doc[start..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
        let listed: BTreeSet<String> = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .map(str::to_string)
            .collect();
        assert_eq!(listed, code, "docs/lifecycle.md's crash point table differs from the code's crash points");
    }
}
