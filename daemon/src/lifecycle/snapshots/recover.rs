//! What a crash left of snapshot operations, finished: at start ([`recover_at_start`]) and
//! before each snapshot operation on the VM ([`recover_vm`]).
//!
//! A `.NAME.partial` directory is a snapshot a crash interrupted: the tags its record names
//! (written before any was made) are deleted from the VM's disks, then the directory. A
//! `.NAME.deleting` directory is a delete a crash interrupted: finished the same way. A tag is
//! deleted only where present, so either may be run again. When the tags cannot be deleted
//! (the QEMU does not answer, a disk cannot be opened) the directory stays for the next try.
//! An interrupted revert is not here: its intent in the VM's record refuses a start until the
//! revert is run again ([`super::revert`]).

use super::super::Manager;
use super::{drop_tags, read_record, snapshots_dir, REVERT_AUX};
use crate::state::VmRecord;
use std::path::{Path, PathBuf};

/// What an entry of a VM's snapshots directory left by a crash is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leftover {
    /// `.NAME.partial`: a snapshot not finished.
    Partial,
    /// `.NAME.deleting`: a delete not finished.
    Deleting,
}

/// What directory entry `name` is (pure): `None` for a snapshot and anything else.
fn leftover(name: &str) -> Option<Leftover> {
    let inner = name.strip_prefix('.')?;
    if inner.strip_suffix(".partial").is_some_and(super::is_snapshot_name) {
        Some(Leftover::Partial)
    } else if inner.strip_suffix(".deleting").is_some_and(super::is_snapshot_name) {
        Some(Leftover::Deleting)
    } else {
        None
    }
}

/// The leftovers in `dir`, by path.
fn leftovers_in(dir: &Path) -> Vec<(PathBuf, Leftover)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries.flatten().filter_map(|e| e.file_name().to_str().and_then(leftover).map(|l| (e.path(), l))).collect()
}

/// How long recovery at vmhostd's start may take in all: the daemon serves nothing until it is
/// done, so a hung offline session must not hold it for the operations' hour. A leftover
/// not finished in time stays for the next try (before the VM's next snapshot operation, with
/// the operation's own bound). Deleting tags walks cluster tables: seconds even for terabytes.
const AT_START: std::time::Duration = std::time::Duration::from_secs(300);

/// Finishes what a crash left of VM `rec`'s snapshot operations (module doc), all within
/// `within`; failures are logged and left for the next try. Returns whether none is left.
pub(in crate::lifecycle) async fn recover_vm(mgr: &Manager, rec: &VmRecord, within: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + within;
    let dir = snapshots_dir(mgr, rec.name());
    let found = crate::blocking::run(|| {
        let _ = std::fs::remove_file(dir.join(REVERT_AUX));
        leftovers_in(&dir)
    });
    let mut all = true;
    for (path, kind) in found {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let done = if left.is_zero() {
            Err(super::failed(format!("no time left to finish {}", path.display())))
        } else {
            match kind {
                Leftover::Deleting => finish_delete(mgr, rec, &path, left).await,
                Leftover::Partial => remove_partial(mgr, rec, &path, left).await,
            }
        };
        match done {
            Ok(()) => {
                tracing::info!(vm = rec.name(), dir = %path.display(), ?kind, "finished an interrupted snapshot operation")
            }
            Err(e) => {
                all = false;
                tracing::warn!(vm = rec.name(), dir = %path.display(), error = %e.message,
                    "cannot finish an interrupted snapshot operation: left for the next try")
            }
        }
    }
    all
}

/// Deletes the tags of an interrupted snapshot, then its directory.
async fn remove_partial(
    mgr: &Manager,
    rec: &VmRecord,
    partial: &Path,
    within: std::time::Duration,
) -> Result<(), crate::api::ApiError> {
    if let Some(s) = crate::blocking::run(|| read_record(partial)) {
        let names: Vec<String> = s.internal.iter().map(|d| d.name.clone()).collect();
        let tags: Vec<String> = s.tags().into_iter().map(str::to_string).collect();
        drop_tags(mgr, rec, &names, &tags, within).await?;
    }
    crate::blocking::run(|| match std::fs::remove_dir_all(partial) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    })
    .map_err(|e| super::failed(format!("{}: {e}", partial.display())))
}

/// Finishes a delete ([`super::delete`]): deletes the tags `deleting/snapshot.json` names from
/// VM `rec`'s disks (an offline session bounded by `within`), then the directory.
///
/// # Errors
/// 4001 step `snapshot` (the directory stays for the next try).
pub(super) async fn finish_delete(
    mgr: &Manager,
    rec: &crate::state::VmRecord,
    deleting: &std::path::Path,
    within: std::time::Duration,
) -> Result<(), crate::api::ApiError> {
    if let Some(s) = crate::blocking::run(|| read_record(deleting)) {
        let names: Vec<String> = s.internal.iter().map(|d| d.name.clone()).collect();
        let tags: Vec<String> = s.tags().into_iter().map(str::to_string).collect();
        drop_tags(mgr, rec, &names, &tags, within).await?;
    }
    mgr.crashpoint("snapshot-delete:tags");
    crate::blocking::run(|| match std::fs::remove_dir_all(deleting) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    })
    .map_err(|e| super::super::errors::FileError::file(super::STEP, "delete", deleting)(e).into())
}

/// At start, after the VMs' records are recovered: [`recover_vm`] for every VM with a
/// snapshots directory; a directory of a VM that no longer exists loses only its leftovers
/// (its disks are gone with it).
pub(in crate::lifecycle) async fn recover_at_start(mgr: &Manager) {
    let root = mgr.config.paths.state.join("snapshots");
    let vms: Vec<String> = crate::blocking::run(|| {
        let Ok(entries) = std::fs::read_dir(&root) else { return Vec::new() };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| !n.starts_with('.'))
            .collect()
    });
    let deadline = std::time::Instant::now() + AT_START;
    for vm in vms {
        match mgr.record(&vm) {
            Ok(rec) => {
                recover_vm(mgr, &rec, deadline.saturating_duration_since(std::time::Instant::now())).await;
            }
            Err(_) => {
                for (path, _) in crate::blocking::run(|| leftovers_in(&root.join(&vm))) {
                    let _ = crate::blocking::run(|| std::fs::remove_dir_all(&path));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_dot_partial_and_dot_deleting_of_snapshot_names_are_leftovers() {
        assert_eq!(leftover(".s1.partial"), Some(Leftover::Partial));
        assert_eq!(leftover(".before-upgrade.deleting"), Some(Leftover::Deleting));
        for other in ["s1", ".revert-aux", ".incoming-x", "..partial", ".a/b.partial", "s1.partial"] {
            assert_eq!(leftover(other), None, "{other}");
        }
    }
}
