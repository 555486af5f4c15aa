//! `vm.snapshot_delete`: any snapshot, in any order (internal snapshots share blocks by
//! refcount, not by a chain; the others are untouched).
//!
//! Order: `NAME` renamed to `.NAME.deleting` and the directory synced (`snapshot-delete:renamed`:
//! from here the snapshot is no longer listed, and a crash leaves a directory [`super::recover`]
//! finishes); the tags deleted from the disks (by the VM's QEMU when it runs, else in an offline
//! session; `snapshot-delete:tags`); the directory removed.

use super::super::errors::FileError;
use super::super::Manager;
use super::{check_name, snapshots_dir, STEP};
use crate::api::snapshots::{SnapshotDeleted, SnapshotParams};
use crate::api::{ApiError, Code};
use std::sync::Arc;

/// `vm.snapshot_delete` (module doc).
///
/// # Errors
/// 2001 on `snapshot` or `timeout_s` (outside 1-86400: the bound of deleting the tags of a
/// stopped VM's disks), 4040, 4090, 4001.
pub(crate) async fn snapshot_delete(mgr: &Arc<Manager>, p: SnapshotParams) -> Result<SnapshotDeleted, ApiError> {
    check_name(&p.snapshot)?;
    let within = super::super::copies::copy_timeout(p.timeout_s)?;
    let (_op, rec) = mgr.begin_op(&p.name).await?;
    // Its snapshots may be the ones a move sent: they settle with it.
    rec.check_not_moving()?;
    if rec.reverting() == Some(p.snapshot.as_str()) {
        return Err(ApiError::new(
            Code::Busy,
            format!(
                "a revert of VM {:?} to snapshot {:?} was interrupted: run it again before deleting it",
                p.name, p.snapshot
            ),
        )
        .field("snapshot"));
    }
    super::recover::recover_vm(mgr, &rec, within).await;
    let dir = snapshots_dir(mgr, &p.name);
    let done = dir.join(&p.snapshot);
    let deleting = dir.join(format!(".{}.deleting", p.snapshot));
    let renamed = crate::blocking::run(|| match std::fs::rename(&done, &deleting) {
        Ok(()) => std::fs::File::open(&dir)?.sync_all().map(|()| true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    })
    .map_err(FileError::file(STEP, "delete", &done))?;
    if !renamed {
        return Ok(SnapshotDeleted { changed: false, snapshot: p.snapshot });
    }
    mgr.crashpoint("snapshot-delete:renamed");
    super::recover::finish_delete(mgr, &rec, &deleting, within).await?;
    Ok(SnapshotDeleted { changed: true, snapshot: p.snapshot })
}
