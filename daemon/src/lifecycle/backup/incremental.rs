//! What an export copies of each disk (docs/backup.md "Incremental backups"): the parent it
//! builds on ([`parent_of`]), then per disk, once its bitmaps are known, incremental or full
//! with why ([`change_of`]); the manifest's kind and parent follow ([`kind_of`]).
//!
//! Pure but for reading the backups directory: the export ([`super`]) asks QEMU which bitmaps
//! each disk holds ([`crate::disk::bitmaps`]).

use crate::api::backup::{BackupKind, DiskChange, ExportParams, ParentRef};
use crate::api::disks::DiskFormat;
use crate::api::ApiError;
use crate::backup::{Backups, ReadBackup};
use crate::disk::bitmaps::Tracking;

/// The backup an export with `p` builds on: none unless `incremental`; `since`, or the VM's
/// newest version 2 backup.
///
/// # Errors
/// 2001 on `since` given without `incremental`, naming another VM's backup or one of
/// version 1 (no change tracking); what reading it returns (4040, 2001, 2003).
pub(super) fn parent_of(backups: &Backups, p: &ExportParams) -> Result<Option<ReadBackup>, ApiError> {
    if !p.incremental {
        if p.since.is_some() {
            return Err(ApiError::invalid("since", "since names the parent of an incremental export: add incremental"));
        }
        return Ok(None);
    }
    let Some(since) = &p.since else { return Ok(backups.newest_of(&p.name)) };
    let b = backups.read_full(since)?;
    if b.manifest.vm != p.name {
        return Err(ApiError::invalid(
            "since",
            format!("backup {since:?} is of VM {:?}, not {:?}", b.manifest.vm, p.name),
        ));
    }
    if b.manifest.id.is_none() {
        return Err(ApiError::invalid(
            "since",
            format!("backup {since:?} is of version 1: it left no change tracking to build on"),
        ));
    }
    Ok(Some(b))
}

/// The bitmap a disk must hold for an increment over `parent`.
pub(super) fn parent_bitmap(parent: Option<&ReadBackup>) -> Option<String> {
    parent.and_then(|b| b.manifest.id.as_deref()).map(crate::backup::bitmap_of)
}

/// Whether disk `name` (`format`: its own file's) can hold a bitmap: a qcow2.
pub(super) fn trackable(format: DiskFormat) -> bool {
    format == DiskFormat::Qcow2
}

/// How disk `name` of an export is copied: incremental exactly when `incremental` was asked,
/// `parent` has the disk, and the disk holds a usable bitmap of it (`tracking`); otherwise
/// full, with why when an increment was asked.
pub(super) fn change_of(
    name: &str,
    format: DiskFormat,
    incremental: bool,
    parent: Option<&ReadBackup>,
    tracking: &Tracking,
) -> DiskChange {
    let full = |why: Option<String>| DiskChange { name: name.to_string(), kind: BackupKind::Full, full_reason: why };
    if !incremental {
        return full(None);
    }
    if !trackable(format) {
        return full(Some("raw disk: its changes are not tracked across a restart".into()));
    }
    let Some(parent) = parent else { return full(Some("no previous backup".into())) };
    let dir = &parent.name;
    let theirs = parent.manifest.disks.iter().find(|d| d.name == name);
    if theirs.is_none_or(|d| d.format != DiskFormat::Qcow2) {
        return full(Some(format!("backup {dir} has no qcow2 copy of this disk")));
    }
    match tracking {
        Tracking::Tracked => DiskChange { name: name.to_string(), kind: BackupKind::Incremental, full_reason: None },
        Tracking::Absent => {
            full(Some(format!("no change tracking since backup {dir} (a revert, replace, import or live move since)")))
        }
        Tracking::Inconsistent => full(Some(format!(
            "the change tracking since backup {dir} was lost: QEMU ended without storing it (killed or crashed)"
        ))),
    }
}

/// The manifest's kind and parent for `changes` over `parent`.
pub(super) fn kind_of(changes: &[DiskChange], parent: Option<&ReadBackup>) -> (BackupKind, Option<ParentRef>) {
    let incremental = changes.iter().any(|c| c.kind == BackupKind::Incremental);
    match parent {
        Some(p) if incremental => (
            BackupKind::Incremental,
            Some(ParentRef {
                dir: p.name.clone(),
                id: p.manifest.id.clone().unwrap_or_default(),
                manifest_sha256: p.manifest_sha256.clone(),
            }),
        ),
        _ => (BackupKind::Full, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent() -> ReadBackup {
        let mut m = crate::backup::tests::manifest();
        m.version = 2;
        m.id = Some("0123456789abcdef".into());
        ReadBackup { name: "v-1".into(), dir: "/b/v-1".into(), manifest: m, manifest_sha256: "e".repeat(64) }
    }

    #[test]
    fn a_disk_is_incremental_only_with_its_parents_bitmap_and_says_why_not() {
        let p = parent();
        let inc = change_of("root", DiskFormat::Qcow2, true, Some(&p), &Tracking::Tracked);
        assert_eq!((inc.kind, inc.full_reason), (BackupKind::Incremental, None));
        let not_asked = change_of("root", DiskFormat::Qcow2, false, Some(&p), &Tracking::Tracked);
        assert_eq!((not_asked.kind, not_asked.full_reason), (BackupKind::Full, None));
        let reason = |c: DiskChange| (c.kind, c.full_reason.unwrap_or_default());
        let (k, why) = reason(change_of("nsm", DiskFormat::Raw, true, Some(&p), &Tracking::Absent));
        assert!(k == BackupKind::Full && why.starts_with("raw disk"), "{why}");
        let (_, why) = reason(change_of("root", DiskFormat::Qcow2, true, None, &Tracking::Absent));
        assert_eq!(why, "no previous backup");
        let (_, why) = reason(change_of("root", DiskFormat::Qcow2, true, Some(&p), &Tracking::Absent));
        assert!(why.contains("since backup v-1 (a revert"), "{why}");
        let (_, why) = reason(change_of("root", DiskFormat::Qcow2, true, Some(&p), &Tracking::Inconsistent));
        assert!(why.contains("killed or crashed"), "{why}");
        let (_, why) = reason(change_of("nsm", DiskFormat::Qcow2, true, Some(&p), &Tracking::Tracked));
        assert!(why.contains("no qcow2 copy of this disk"), "the parent's nsm is raw: {why}");
        let (_, why) = reason(change_of("new", DiskFormat::Qcow2, true, Some(&p), &Tracking::Tracked));
        assert!(why.contains("no qcow2 copy"), "{why}");
    }

    #[test]
    fn a_backup_is_incremental_with_its_parent_when_one_disk_is() {
        let p = parent();
        let full = DiskChange { name: "nsm".into(), kind: BackupKind::Full, full_reason: Some("raw".into()) };
        let inc = DiskChange { name: "root".into(), kind: BackupKind::Incremental, full_reason: None };
        let (kind, parent) = kind_of(&[inc, full.clone()], Some(&p));
        assert_eq!(kind, BackupKind::Incremental);
        let parent = parent.unwrap();
        assert_eq!((parent.dir.as_str(), parent.id.as_str()), ("v-1", "0123456789abcdef"));
        assert_eq!(kind_of(&[full], Some(&p)), (BackupKind::Full, None), "every disk full: no parent needed");
    }
}
