//! `vm.revert` (stopped VM only): the VM's disks put back as a snapshot kept them.
//!
//! Order: the snapshot was of the same disks (names, formats, sizes, boot source; disks with
//! `snapshot: false` then or now not compared, and left as they are: 2001 otherwise); every copy
//! (raw disks, the variables store) taken out next to the file it replaces, its sha256 checked
//! (2003, nothing replaced); the intent recorded ([`crate::state::Intent::Revert`]: no start
//! until a revert completes; `revert:recorded`); the qcow2 disks loaded back to the snapshot's
//! tag in one offline session ([`crate::disk::internal_snapshots::revert`], which removes the
//! `vmhost-*` change-tracking bitmaps first; `revert:loaded`); the copies renamed over their
//! files; a `tpm: true` VM's TPM state put back (its copies checked with the others, written
//! as `qemu.user`'s files through the spawner, [`crate::tpm::put_back_state`]; a snapshot
//! without TPM state leaves the VM's as it is); the intent cleared in the same record update that puts back the cloud-init instance
//! id the snapshot recorded and whether the disks are clean. Running it again after a crash
//! anywhere does the same. Newer snapshots stay: internal snapshots are independent of each
//! other and of the disk's current state.

use super::super::copies::{copy_checked, copy_timeout, CheckedFrom, VmDisk};
use super::super::errors::FileError;
use super::super::Manager;
use super::{
    check_name, complete_revert, disks_of, excluded_of, failed, list_snapshots, open_rw, snapshot_entry, snapshots_dir,
    REVERT_AUX, STEP,
};
use crate::api::disks::DiskFormat;
use crate::api::snapshots::{Snapshot, SnapshotParams};
use crate::api::{ApiError, Code, Mutation, VmStatus};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// `vm.revert` (module doc).
///
/// # Errors
/// 2001 on `snapshot` (a bad name; the VM's disks are not the snapshot's) or `timeout_s`
/// (outside 1-86400: the bound of the offline session that loads the qcow2 disks), 4040 (no VM; no
/// such snapshot, on `snapshot`), 4090 (running: stop it first; another operation), 2003
/// on `snapshot` (a copy is not what the snapshot recorded; nothing replaced), 4001.
pub(crate) async fn revert(mgr: &Arc<Manager>, p: SnapshotParams) -> Result<Mutation, ApiError> {
    check_name(&p.snapshot)?;
    let within = copy_timeout(p.timeout_s)?;
    let (_op, rec) = mgr.begin_op(&p.name).await?;
    rec.check_not_moving()?;
    let all = list_snapshots(mgr, &p.name)?;
    let snapshot = all.iter().find(|s| s.name == p.snapshot).cloned().ok_or_else(|| {
        ApiError::new(Code::NotFound, format!("VM {:?} has no snapshot {:?}", p.name, p.snapshot)).field("snapshot")
    })?;
    if matches!(rec.status, VmStatus::Running | VmStatus::Starting | VmStatus::Stopping) {
        return Err(ApiError::new(
            Code::Busy,
            format!("VM {:?} is {}: stop it before a revert", p.name, rec.status.as_str()),
        )
        .field("name"));
    }
    super::recover::recover_vm(mgr, &rec, within).await;
    let mut ignored = excluded_of(&rec.spec);
    ignored.extend(snapshot.excluded.iter().cloned());
    if disks_of(&snapshot.spec, &ignored) != disks_of(&rec.spec, &ignored) {
        return Err(ApiError::invalid(
            "snapshot",
            format!(
                "VM {:?}'s boot disk or data disks (names, formats, sizes) changed since snapshot {:?}: a revert puts back \
                 disks as they were, so they must be the same",
                p.name, p.snapshot
            ),
        ));
    }
    let (_, _, disks) = super::super::copies::copy_sources(mgr, &rec, STEP).await?;
    let (internal, copied) = reverted_disks(&disks, &snapshot, &ignored).ok_or_else(|| {
        ApiError::invalid(
            "snapshot",
            format!("snapshot {:?} does not hold the files of VM {:?}'s disks", p.snapshot, p.name),
        )
    })?;
    check_no_dropped_tags(&copied, &snapshot, &all)?;
    check_tags(mgr, &internal, &snapshot, within).await?;
    let from = snapshots_dir(mgr, &p.name).join(&p.snapshot);
    let mut sources: Vec<PathBuf> = copied.iter().map(|(_, s)| from.join(&s.file)).collect();
    let vars_file = mgr.paths(&p.name).uefi_vars();
    if let Some(v) = &snapshot.uefi_vars {
        sources.push(from.join(&v.file));
    }
    let sources: Vec<&Path> = sources.iter().map(PathBuf::as_path).collect();
    let _room = crate::disk::space::reserve_copy_room(&mgr.reservations, &mgr.config.paths.state, &sources, STEP)?;
    // Copies an interrupted revert left beside the disks (named after the disk's file, so
    // another VM's revert in the same directory keeps its own).
    for (d, _) in &copied {
        crate::blocking::run(|| crate::images::remove_leftovers_of(&d.file));
    }
    if snapshot.uefi_vars.is_some() {
        crate::blocking::run(|| crate::images::remove_leftovers_of(&vars_file));
    }
    // Copied out first, next to each file (the same file system: the rename is atomic).
    let place = format!("of snapshot {:?}", p.snapshot);
    let until = std::time::Instant::now().checked_add(within);
    let checked = CheckedFrom { dir: &from, field: "snapshot", place: &place, undone: "reverted", step: STEP, until };
    let mut temps = Vec::new();
    for (disk, saved) in &copied {
        temps.push((put_next_to(&checked, saved, &disk.file)?, disk.file.clone()));
    }
    if let Some(v) = &snapshot.uefi_vars {
        let entry = crate::api::backup::BackupDisk {
            role: crate::api::backup::DiskRole::Data,
            name: "uefi-vars".into(),
            file: v.file.clone(),
            format: DiskFormat::Raw,
            virtual_size: 0,
            bytes: v.bytes,
            sha256: v.sha256.clone(),
        };
        temps.push((put_next_to(&checked, &entry, &vars_file)?, vars_file.clone()));
    }
    // The TPM state's copies checked before anything changes, put back after the disks.
    let tpm = match &snapshot.tpm {
        Some(copy) => {
            let opened = crate::blocking::run(|| crate::tpm::open_checked_copy(&from, copy)).map_err(|e| {
                ApiError::new(Code::ChecksumMismatch, format!("snapshot {:?}: {e}; nothing reverted", p.snapshot))
                    .field("snapshot")
            })?;
            Some(opened)
        }
        None => None,
    };
    mgr.update(&p.name, "vm.revert", |r| r.start_revert(&p.snapshot))?;
    mgr.crashpoint("revert:recorded");
    load_internal(mgr, &p.name, &internal, &snapshot, within).await?;
    mgr.crashpoint("revert:loaded");
    for (temp, file) in temps {
        temp.replace(&file).map_err(|source| FileError::PutBack { step: STEP.into(), path: file, source })?;
    }
    mgr.crashpoint("revert:placed");
    if let Some(files) = tpm {
        crate::tpm::put_back_state(&mgr.paths(&p.name), files, mgr.config.qemu_user)
            .await
            .map_err(|e| failed(format!("putting back the TPM state: {e}")))?;
    }
    // The disks and the instance id their guest booted with go back together.
    mgr.update(&p.name, "vm.revert", |r| complete_revert(r, &snapshot))?;
    tracing::info!(vm = %p.name, snapshot = %p.snapshot, internal = internal.len(), copies = copied.len(), "reverted");
    Ok(Mutation::new(true, Some(mgr.get(&p.name)?)))
}

/// What a revert puts back: the disks loaded from their tag, and the disks replaced by a copy
/// with the copy's entry.
type Reverted<'a> = (Vec<&'a VmDisk>, Vec<(&'a VmDisk, &'a crate::api::backup::BackupDisk)>);

/// The disks a revert to `snapshot` puts back (pure): (disks loaded from their tag, disks
/// replaced by a copy with the copy's entry); the disks `ignored` names stay as they are.
/// `None` when the snapshot does not hold a kept disk in the form it has now (a qcow2 disk
/// copied, a raw one tagged, a file named otherwise, a kept disk not in the snapshot).
fn reverted_disks<'a>(disks: &'a [VmDisk], snapshot: &'a Snapshot, ignored: &[String]) -> Option<Reverted<'a>> {
    let mut internal = Vec::new();
    let mut copied = Vec::new();
    for d in disks {
        if d.role == crate::api::backup::DiskRole::Data && ignored.contains(&d.name) {
            continue;
        }
        let tagged = snapshot.internal.iter().find(|i| i.name == d.name && i.role == d.role);
        let copy = snapshot.disks.iter().find(|c| c.name == d.name && c.role == d.role);
        match (tagged, copy) {
            (Some(_), None) if d.format == DiskFormat::Qcow2 => internal.push(d),
            (None, Some(c)) if snapshot_entry(d).file == c.file && c.format == d.format => copied.push((d, c)),
            _ => return None,
        }
    }
    Some((internal, copied))
}

/// The internal snapshots a revert to `snapshot` would destroy (pure): a qcow2 disk that
/// `snapshot` kept as a copy (taken before internal snapshots existed) is put back by replacing
/// its file, which drops every tag inside it while the other snapshots of `all` that name them
/// stay listed. Returns (snapshot, disk) pairs, in `all`'s order.
fn dropped_tags(
    copied: &[(&VmDisk, &crate::api::backup::BackupDisk)],
    snapshot: &Snapshot,
    all: &[Snapshot],
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for other in all.iter().filter(|s| s.name != snapshot.name) {
        for (d, _) in copied.iter().filter(|(d, _)| d.format == DiskFormat::Qcow2) {
            if other.internal.iter().any(|i| i.role == d.role && i.name == d.name) {
                out.push((other.name.clone(), d.name.clone()));
            }
        }
    }
    out
}

/// 2001 on `snapshot` when the revert would replace a qcow2 disk's file that holds other
/// snapshots' internal snapshots ([`dropped_tags`]), before anything is changed.
///
/// # Errors
/// 2001.
fn check_no_dropped_tags(
    copied: &[(&VmDisk, &crate::api::backup::BackupDisk)],
    snapshot: &Snapshot,
    all: &[Snapshot],
) -> Result<(), ApiError> {
    let dropped = dropped_tags(copied, snapshot, all);
    if dropped.is_empty() {
        return Ok(());
    }
    let mut held: Vec<&str> = dropped.iter().map(|(s, _)| s.as_str()).collect();
    held.dedup();
    let listed: Vec<String> = dropped.iter().map(|(s, d)| format!("{s} in disk {d}")).collect();
    Err(ApiError::invalid(
        "snapshot",
        format!(
            "snapshot {:?} keeps qcow2 disks as whole copies, and putting them back would drop the internal snapshots \
             kept inside them ({}); delete snapshot(s) {} first; nothing was reverted",
            snapshot.name,
            listed.join(", "),
            held.join(", ")
        ),
    ))
}

/// 2001 on `snapshot` when a disk of `internal` no longer holds the snapshot's tag (its file
/// is not the one the snapshot was taken of: a replace made a new root disk), checked before
/// anything is changed.
///
/// # Errors
/// 2001; 4001 step `snapshot`.
async fn check_tags(
    mgr: &Manager,
    internal: &[&VmDisk],
    snapshot: &Snapshot,
    within: Duration,
) -> Result<(), ApiError> {
    let Some(tag) = snapshot.internal.first().map(|i| i.tag.as_str()) else { return Ok(()) };
    let files: Vec<PathBuf> = internal.iter().map(|d| d.file.clone()).collect();
    let fds = open_rw(&files)?;
    let missing = crate::disk::internal_snapshots::missing(&mgr.disk_tool(), fds, tag, within)
        .await
        .map_err(|e| failed(format!("reading the qcow2 disks' snapshots: {e}")))?;
    if missing.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = missing.iter().filter_map(|i| internal.get(*i)).map(|d| d.name.as_str()).collect();
    Err(ApiError::invalid(
        "snapshot",
        format!(
            "snapshot {:?} is not in disk(s) {} any more (a replace made a new root disk since, or the file was \
             changed outside vmhostd); nothing was reverted",
            snapshot.name,
            names.join(", ")
        ),
    ))
}

/// Copies `saved` out of the snapshot next to `file`, named after it.
fn put_next_to(
    checked: &CheckedFrom<'_>,
    saved: &crate::api::backup::BackupDisk,
    file: &Path,
) -> Result<crate::images::Temp, ApiError> {
    let dir = file.parent().ok_or_else(|| failed("a disk without a directory".into()))?;
    let own = file.file_name().and_then(|n| n.to_str()).unwrap_or(&saved.file);
    copy_checked(checked, saved, dir, own)
}

/// Loads the snapshot's tag into each qcow2 disk of `internal` (an offline session bounded by
/// `within`, the revert's `timeout_s`; the scratch image in the VM's snapshots directory,
/// removed after).
///
/// # Errors
/// 4001 step `snapshot`.
async fn load_internal(
    mgr: &Manager,
    name: &str,
    internal: &[&VmDisk],
    snapshot: &Snapshot,
    within: Duration,
) -> Result<(), ApiError> {
    let Some(tag) = snapshot.internal.first().map(|i| i.tag.clone()) else { return Ok(()) };
    let files: Vec<PathBuf> = internal.iter().map(|d| d.file.clone()).collect();
    let fds = open_rw(&files)?;
    let aux_path = snapshots_dir(mgr, name).join(REVERT_AUX);
    let aux = crate::blocking::run(|| {
        let _ = std::fs::remove_file(&aux_path);
        std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&aux_path)
    })
    .map_err(FileError::file(STEP, "create", &aux_path))?;
    let done = crate::disk::internal_snapshots::revert(&mgr.disk_tool(), fds, aux.into(), &tag, within).await;
    let _ = crate::blocking::run(|| std::fs::remove_file(&aux_path));
    done.map_err(|e| failed(format!("loading snapshot {:?} into the qcow2 disks: {e}", snapshot.name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::backup::DiskRole;
    use crate::api::snapshots::{InternalDisk, SnapshotKind};

    fn disk(role: DiskRole, name: &str, format: DiskFormat) -> VmDisk {
        VmDisk {
            role,
            name: name.into(),
            format,
            file: PathBuf::from(format!("/s/{name}.{}", format.as_str())),
            base: None,
            device: name.into(),
        }
    }

    #[test]
    fn a_revert_loads_tags_copies_back_copies_and_leaves_excluded_disks() {
        let disks = vec![
            disk(DiskRole::Root, "root", DiskFormat::Qcow2),
            disk(DiskRole::Data, "nsm", DiskFormat::Raw),
            disk(DiskRole::Data, "pcap", DiskFormat::Qcow2),
        ];
        let mut s = super::super::tests::snapshot(None, None);
        s.internal = vec![InternalDisk {
            role: DiskRole::Root,
            name: "root".into(),
            kind: SnapshotKind::Internal,
            tag: "vmhost-s1-00000000".into(),
        }];
        s.disks = vec![snapshot_entry(&disks[1])];
        s.excluded = vec!["pcap".into()];
        let (internal, copied) = reverted_disks(&disks, &s, &["pcap".to_string()]).expect("matches");
        assert_eq!(internal.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["root"]);
        assert_eq!(copied.iter().map(|(d, _)| d.name.as_str()).collect::<Vec<_>>(), ["nsm"]);
        // Not excluded now nor then, and not in the snapshot: refused.
        assert!(reverted_disks(&disks, &s, &[]).is_none());
        // A disk now raw that the snapshot tagged: refused.
        let mut other = disks;
        other[0].format = DiskFormat::Raw;
        assert!(reverted_disks(&other, &s, &["pcap".to_string()]).is_none());
    }

    #[test]
    fn a_revert_that_would_replace_a_qcow2_file_holding_other_snapshots_tags_is_refused() {
        let disks = vec![disk(DiskRole::Root, "root", DiskFormat::Qcow2), disk(DiskRole::Data, "nsm", DiskFormat::Raw)];
        // Taken before internal snapshots: both disks copied.
        let mut old = super::super::tests::snapshot(None, None);
        old.name = "old".into();
        old.disks = vec![snapshot_entry(&disks[0]), snapshot_entry(&disks[1])];
        let mut newer = super::super::tests::snapshot(None, None);
        newer.name = "newer".into();
        newer.internal = vec![InternalDisk {
            role: DiskRole::Root,
            name: "root".into(),
            kind: SnapshotKind::Internal,
            tag: "vmhost-newer-00000001".into(),
        }];
        newer.disks = vec![snapshot_entry(&disks[1])];
        let (internal, copied) = reverted_disks(&disks, &old, &[]).expect("matches");
        assert!(internal.is_empty());
        assert!(check_no_dropped_tags(&copied, &old, std::slice::from_ref(&old)).is_ok(), "no other snapshot");
        let all = vec![old.clone(), newer.clone()];
        assert_eq!(dropped_tags(&copied, &old, &all), [("newer".to_string(), "root".to_string())]);
        let e = check_no_dropped_tags(&copied, &old, &all).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("snapshot"));
        assert!(
            e.message.contains("newer in disk root") && e.message.contains("delete snapshot(s) newer first"),
            "{}",
            e.message
        );
        // Reverting to the newer one loads its tag and copies only the raw disk: nothing dropped.
        let (_, copied) = reverted_disks(&disks, &newer, &[]).expect("matches");
        assert!(check_no_dropped_tags(&copied, &newer, &all).is_ok());
    }
}
