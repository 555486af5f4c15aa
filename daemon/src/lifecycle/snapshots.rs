//! `vm.snapshot`, `vm.snapshots`, `vm.revert`, `vm.snapshot_delete` (docs/snapshots.md): copies of
//! a VM's disks kept with it, and the VM's disks put back as they were.
//!
//! A snapshot is a directory `STATE/snapshots/VM/NAME/` with one copy per disk and
//! `snapshot.json` (the spec and the cloud-init instance id then, each copy's sha256). Of a
//! running VM, the copies are made by its own QEMU, every disk as at one instant (one QMP
//! transaction), with the guest's file
//! systems frozen for that instant when its agent can ([`super::live_copy`]); of a stopped VM,
//! by reading the files. An image VM's boot disk is copied as an overlay (only what
//! the VM wrote; its header names the same base image, which the image store keeps from
//! changing while VMs use it); a `boot.disk` root disk and data disks whole (raw ones sparse).
//! Like a backup, a snapshot is written into `.NAME.partial` and renamed once whole.
//!
//! A revert (stopped VM only) first checks the snapshot was of the same disks (names, formats,
//! sizes: 2001 otherwise), records the intent ([`crate::state::Intent::Revert`]: no start until
//! a revert completes), copies every disk out of the snapshot next to the VM's own file checking
//! its sha256, then renames each over the VM's file and clears the intent, in the same record
//! update putting back the cloud-init instance id the snapshot recorded (a snapshot survives a
//! replace: image A, B, then A again passes the disk check with a root disk of the first
//! instance) and whether the disks are clean ([`crate::state::VmRecord::unclean_end`]). Only
//! the VM's own disk files are written; nothing outside the VM is touched. Newer snapshots
//! stay. A destroy removes the VM's snapshots with its disks.
//!
//! A snapshot, a revert and a delete are operations on the VM ([`VmOp`], begun with
//! [`Manager::begin_op`]); none records a failure on the VM (what they made is removed, the
//! VM's disks are untouched until a revert's copies are all checked).

use super::copies::{copy_checked, copy_timeout, seal_copies, CheckedFrom, VmDisk};
use super::errors::FileError;
use super::held::HeldVm;
use super::op::VmOp;
use super::Manager;
use crate::api::backup::BackupDisk;
use crate::api::disks::DiskFormat;
use crate::api::snapshots::{CopyConsistency, Snapshot, SnapshotDeleted, SnapshotParams, TakeSnapshotParams};
use crate::api::{ApiError, Code, Mutation, VmSpec, VmStatus};
use crate::state::VmRecord;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Most snapshots a VM keeps.
pub const MAX_SNAPSHOTS: usize = 16;

/// The API step of this module's failures.
const STEP: &str = "snapshot";

fn failed(message: String) -> ApiError {
    super::provisioning(STEP, message)
}

/// True for a snapshot's name (and a name a move may give a snapshot's directory).
pub(in crate::lifecycle) fn is_snapshot_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

fn check_name(name: &str) -> Result<(), ApiError> {
    if is_snapshot_name(name) {
        Ok(())
    } else {
        Err(ApiError::invalid("snapshot", format!("{name:?}: 1-64 of A-Z a-z 0-9 . _ -, not starting with a dot")))
    }
}

/// A disk's copy in a snapshot: `root.FORMAT` or `NAME.FORMAT`, in the disk's own format (an
/// image VM's overlay copied as an overlay).
fn snapshot_entry(disk: &VmDisk) -> BackupDisk {
    disk.entry(format!("{}.{}", disk.name, disk.format.as_str()), disk.format)
}

/// The record of a VM whose disks were just put back as they were in `snapshot`: no revert
/// pending; the instance id the snapshot recorded (the root disk's guest booted with it: a
/// snapshot of an earlier root disk, taken before a replace, must not boot as a new instance),
/// the current one when it recorded none; the disks clean only when the snapshot's copy was
/// (`frozen` or `stopped`).
fn complete_revert(r: &mut VmRecord, snapshot: &Snapshot) {
    r.end_revert();
    if let Some(id) = &snapshot.instance_id {
        r.instance_id = Some(id.clone());
    }
    r.unclean_end =
        super::copies::restored_unclean(&format!("reverted to snapshot {:?}", snapshot.name), snapshot.consistency);
}

/// What must be equal for a revert: each disk's name, format and size, and the boot source.
fn disks_of(spec: &VmSpec) -> (Vec<(String, DiskFormat, u64)>, crate::api::BootSpec) {
    let mut boot = spec.boot.clone();
    boot.cmdline = None;
    let disks = spec.disks.iter().map(|d| (d.name.clone(), d.format, d.size_gib)).collect();
    (disks, boot)
}

/// `STATE/snapshots/VM`.
pub(in crate::lifecycle) fn snapshots_dir(mgr: &Manager, name: &str) -> PathBuf {
    mgr.config.paths.state.join("snapshots").join(name)
}

/// `vm.snapshot` (module doc).
///
/// # Errors
/// 2001 on `snapshot` (a bad or taken name, or [`MAX_SNAPSHOTS`] reached) or `timeout_s`,
/// 4040, 4090 (also while the VM is being moved), 4001 `step: snapshot`, 4094 on `requires` (a running VM's guest file systems
/// not all frozen); nothing is kept.
pub(crate) async fn snapshot(mgr: &Arc<Manager>, p: TakeSnapshotParams) -> Result<Snapshot, ApiError> {
    check_name(&p.snapshot)?;
    let within = copy_timeout(p.timeout_s)?;
    let (op, rec) = mgr.begin_op(&p.name).await?;
    check_not_reverting(&rec)?;
    // A snapshot taken while a move's outcome is unknown would not be on the destination, and
    // the source's copy (snapshots included) goes when the destination answers `committed`.
    rec.check_not_moving()?;
    let existing = list_snapshots(mgr, &p.name)?;
    if existing.iter().any(|s| s.name == p.snapshot) {
        return Err(ApiError::invalid("snapshot", format!("VM {:?} has a snapshot {:?} already", p.name, p.snapshot)));
    }
    if existing.len() >= MAX_SNAPSHOTS {
        return Err(ApiError::invalid(
            "snapshot",
            format!("VM {:?} has {MAX_SNAPSHOTS} snapshots: delete one", p.name),
        ));
    }
    let (live, spec, disks) = super::copies::copy_sources(mgr, &rec, "snapshot").await?;
    let stopped = super::live_copy::check_requires(mgr, &rec, live, p.requires, "snapshot")?;
    let mut entries: Vec<BackupDisk> = disks.iter().map(snapshot_entry).collect();
    let files: Vec<&Path> = disks.iter().map(|d| d.file.as_path()).collect();
    let _room = crate::disk::space::reserve_copy_room(&mgr.reservations, &mgr.config.paths.state, &files, "snapshot")?;
    let dir = snapshots_dir(mgr, &p.name);
    let partial = dir.join(format!(".{}.partial", p.snapshot));
    let done = dir.join(&p.snapshot);
    crate::blocking::run(|| {
        crate::state::dirs::private_dir(&mgr.config.paths.state.join("snapshots"))?;
        crate::state::dirs::private_dir(&dir)?;
        let _ = std::fs::remove_dir_all(&partial);
        crate::state::dirs::private_dir(&partial)
    })
    .map_err(FileError::file(STEP, "create", &partial))?;
    let mut cleanup = RemoveDir(Some(partial.clone()));
    let made = if let Some(stopped) = stopped {
        for (d, e) in disks.iter().zip(&entries) {
            let mut temp = crate::images::Temp::create(&partial, &e.file).map_err(FileError::file(
                STEP,
                "create a copy in",
                &partial,
            ))?;
            crate::images::copy(&d.file, &mut temp).map_err(FileError::file(STEP, "copy", &d.file))?;
            temp.finish().map_err(FileError::unnamed(STEP, "write a copy"))?;
            temp.place(&partial.join(&e.file)).map_err(FileError::unnamed(STEP, "place a copy"))?;
        }
        stopped
    } else {
        op.snapshot_live(&disks, &mut entries, &partial, within, p.requires).await?
    };
    seal_copies(&partial, &mut entries, "snapshot")?;
    let snapshot = Snapshot {
        name: p.snapshot.clone(),
        created_at: crate::api::now_rfc3339(),
        live,
        consistency: Some(made.consistency),
        reason: made.reason,
        frozen: made.frozen,
        skipped: made.skipped,
        instance_id: rec.instance_id.clone(),
        spec,
        disks: entries,
    };
    let json =
        serde_json::to_vec_pretty(&snapshot).map_err(|source| FileError::Encode { step: STEP.into(), source })?;
    crate::blocking::run(|| {
        crate::state::atomic::write_atomic(&partial.join("snapshot.json"), &json)?;
        std::fs::rename(&partial, &done)?;
        std::fs::File::open(&dir)?.sync_all()
    })
    .map_err(FileError::file(STEP, "finish the snapshot in", &partial))?;
    cleanup.0 = None;
    let consistency = snapshot.consistency.map_or("-", |c| c.as_str());
    tracing::info!(vm = %p.name, snapshot = %p.snapshot, live, consistency, "snapshot taken");
    Ok(snapshot)
}

/// The VM's snapshots, oldest first.
fn list_snapshots(mgr: &Manager, name: &str) -> Result<Vec<Snapshot>, ApiError> {
    let dir = snapshots_dir(mgr, name);
    let mut out: Vec<Snapshot> = crate::blocking::run(|| {
        let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
        entries
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(is_snapshot_name))
            .filter_map(|e| std::fs::read(e.path().join("snapshot.json")).ok())
            .filter_map(|b| serde_json::from_slice::<Snapshot>(&b).ok())
            .collect()
    });
    out.sort_by(|a, b| (&a.created_at, &a.name).cmp(&(&b.created_at, &b.name)));
    Ok(out)
}

/// `vm.snapshots`: the VM's snapshots, oldest first.
///
/// # Errors
/// 4040.
pub(crate) fn snapshots(mgr: &Manager, name: &str) -> Result<Vec<Snapshot>, ApiError> {
    mgr.record(name)?;
    list_snapshots(mgr, name)
}

/// `vm.revert` (module doc).
///
/// # Errors
/// 2001 on `snapshot` (a bad name; the VM's disks are not the snapshot's), 4040 (no VM; no
/// such snapshot, on `snapshot`), 4090 (running: stop it first; another operation), 2003
/// on `snapshot` (a copy is not what the snapshot recorded; nothing replaced), 4001.
pub(crate) async fn revert(mgr: &Arc<Manager>, p: SnapshotParams) -> Result<Mutation, ApiError> {
    check_name(&p.snapshot)?;
    let (_op, rec) = mgr.begin_op(&p.name).await?;
    rec.check_not_moving()?;
    let snapshot = list_snapshots(mgr, &p.name)?.into_iter().find(|s| s.name == p.snapshot).ok_or_else(|| {
        ApiError::new(Code::NotFound, format!("VM {:?} has no snapshot {:?}", p.name, p.snapshot)).field("snapshot")
    })?;
    if matches!(rec.status, VmStatus::Running | VmStatus::Starting | VmStatus::Stopping) {
        return Err(ApiError::new(
            Code::Busy,
            format!("VM {:?} is {}: stop it before a revert", p.name, rec.status.as_str()),
        )
        .field("name"));
    }
    if disks_of(&snapshot.spec) != disks_of(&rec.spec) {
        return Err(ApiError::invalid(
            "snapshot",
            format!(
                "VM {:?}'s boot disk or data disks (names, formats, sizes) changed since snapshot {:?}: a revert puts back \
                 disks as they were, so they must be the same",
                p.name, p.snapshot
            ),
        ));
    }
    let (_, _, disks) = super::copies::copy_sources(mgr, &rec, "snapshot").await?;
    let same_files = disks.len() == snapshot.disks.len()
        && disks.iter().map(snapshot_entry).zip(&snapshot.disks).all(|(d, s)| d.file == s.file && d.format == s.format);
    if !same_files {
        return Err(ApiError::invalid(
            "snapshot",
            format!("snapshot {:?} does not hold the files of VM {:?}'s disks", p.snapshot, p.name),
        ));
    }
    let from = snapshots_dir(mgr, &p.name).join(&p.snapshot);
    let copies: Vec<PathBuf> = snapshot.disks.iter().map(|s| from.join(&s.file)).collect();
    let copies: Vec<&Path> = copies.iter().map(PathBuf::as_path).collect();
    let _room = crate::disk::space::reserve_copy_room(&mgr.reservations, &mgr.config.paths.state, &copies, "snapshot")?;
    // Copies an interrupted revert left beside the disks (named after the disk's file, so
    // another VM's revert in the same directory keeps its own).
    for d in &disks {
        crate::blocking::run(|| crate::images::remove_leftovers_of(&d.file));
    }
    // Copied out first, next to each file (the same file system: the rename is atomic).
    let place = format!("of snapshot {:?}", p.snapshot);
    let checked = CheckedFrom { dir: &from, field: "snapshot", place: &place, undone: "reverted", step: "snapshot" };
    let mut copies = Vec::new();
    for (disk, saved) in disks.iter().zip(&snapshot.disks) {
        let dir = disk.file.parent().ok_or_else(|| failed("a disk without a directory".into()))?;
        let own = disk.file.file_name().and_then(|n| n.to_str()).unwrap_or(&saved.file);
        copies.push((copy_checked(&checked, saved, dir, own)?, disk.file.clone()));
    }
    mgr.update(&p.name, "vm.revert", |r| r.start_revert(&p.snapshot))?;
    mgr.crashpoint("revert:recorded");
    for (temp, file) in copies {
        temp.replace(&file).map_err(|source| FileError::PutBack { step: STEP.into(), path: file, source })?;
    }
    // The disks and the instance id their guest booted with go back together.
    mgr.update(&p.name, "vm.revert", |r| complete_revert(r, &snapshot))?;
    tracing::info!(vm = %p.name, snapshot = %p.snapshot, "reverted");
    Ok(Mutation::new(true, Some(mgr.get(&p.name)?)))
}

/// `vm.snapshot_delete`.
///
/// # Errors
/// 2001 on `snapshot`, 4040, 4090, 4001.
pub(crate) async fn snapshot_delete(mgr: &Arc<Manager>, p: SnapshotParams) -> Result<SnapshotDeleted, ApiError> {
    check_name(&p.snapshot)?;
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
    let dir = snapshots_dir(mgr, &p.name).join(&p.snapshot);
    let changed = crate::blocking::run(|| match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    })
    .map_err(FileError::file(STEP, "delete", &dir))?;
    Ok(SnapshotDeleted { changed, snapshot: p.snapshot })
}

/// One snapshot's files as a move carries them ([`files_to_move`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::lifecycle) struct SnapshotFile {
    /// The snapshot's name.
    pub snapshot: String,
    /// The file's name in the snapshot's directory (`snapshot.json`, then each disk's copy).
    pub file: String,
    /// Where it is.
    pub path: PathBuf,
    /// Its length.
    pub bytes: u64,
    /// The bytes it occupies (allocated blocks).
    pub allocated: u64,
}

/// The name of a snapshot's record in its directory.
pub(in crate::lifecycle) const SNAPSHOT_JSON: &str = "snapshot.json";

/// Every file of every snapshot of VM `name`, oldest snapshot first, each snapshot's
/// `snapshot.json` before its copies: what a cold move sends so that the snapshots go with the
/// VM. Strict, since the source's copy (with its snapshots) is deleted once the destination
/// has them all: a snapshot directory that is not a whole snapshot (unreadable record, a copy
/// missing) refuses the move rather than being left behind. Interrupted snapshots
/// (`.NAME.partial`) are not snapshots and stay out.
///
/// # Errors
/// 4001 step `snapshot` naming the snapshot that cannot be read whole.
pub(in crate::lifecycle) fn files_to_move(mgr: &Manager, name: &str) -> Result<Vec<SnapshotFile>, ApiError> {
    use std::os::unix::fs::MetadataExt;
    let dir = snapshots_dir(mgr, name);
    crate::blocking::run(|| {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(failed(format!("{}: {e}", dir.display()))),
        };
        let mut snapshots = Vec::new();
        for e in entries.flatten() {
            let Some(snap) = e.file_name().to_str().map(str::to_string) else {
                return Err(failed(format!("{}: a snapshot whose name is not UTF-8", dir.display())));
            };
            if snap.starts_with('.') {
                continue;
            }
            let damaged = |why: String| {
                failed(format!(
                    "snapshot {snap:?} of VM {name:?} is not whole ({why}): delete it or repair it to move the VM"
                ))
            };
            let json =
                std::fs::read(e.path().join(SNAPSHOT_JSON)).map_err(|e| damaged(format!("{SNAPSHOT_JSON}: {e}")))?;
            let s: Snapshot = serde_json::from_slice(&json).map_err(|e| damaged(format!("{SNAPSHOT_JSON}: {e}")))?;
            if s.name != snap || !is_snapshot_name(&snap) {
                return Err(damaged(format!("its record names {:?}", s.name)));
            }
            let mut files = Vec::new();
            for file in std::iter::once(SNAPSHOT_JSON).chain(s.disks.iter().map(|d| d.file.as_str())) {
                let path = e.path().join(file);
                let m = std::fs::symlink_metadata(&path).map_err(|e| damaged(format!("{file}: {e}")))?;
                if !m.is_file() {
                    return Err(damaged(format!("{file} is not a file")));
                }
                let allocated = m.blocks().saturating_mul(512).min(m.len());
                files.push(SnapshotFile {
                    snapshot: snap.clone(),
                    file: file.to_string(),
                    path,
                    bytes: m.len(),
                    allocated,
                });
            }
            snapshots.push(((s.created_at, snap.clone()), files));
        }
        snapshots.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(snapshots.into_iter().flat_map(|(_, f)| f).collect())
    })
}

/// `STATE/snapshots/.incoming-VM`: where a cold move's snapshots arrive, each whole snapshot
/// renamed in from its `.NAME.partial`, and renamed as a whole to [`snapshots_dir`] after the
/// commit point. Only the move of VM `name` writes it (one expectation per name), so a give-up
/// removes it whole. Not a VM's directory: VM names never start with a dot.
pub(in crate::lifecycle) fn incoming_dir(mgr: &Manager, name: &str) -> PathBuf {
    mgr.config.paths.state.join("snapshots").join(format!(".incoming-{name}"))
}

/// Removes the `.NAME.partial` directories of snapshots a crash interrupted (at start).
pub(super) fn remove_partial_snapshots(mgr: &Manager) {
    let root = mgr.config.paths.state.join("snapshots");
    let Ok(vms) = std::fs::read_dir(&root) else { return };
    for vm in vms.flatten() {
        let Ok(entries) = std::fs::read_dir(vm.path()) else { continue };
        for e in entries.flatten() {
            let partial = e.file_name().to_str().is_some_and(|n| n.starts_with('.') && n.ends_with(".partial"));
            if partial {
                match std::fs::remove_dir_all(e.path()) {
                    Ok(()) => tracing::info!(dir = %e.path().display(), "removed an interrupted snapshot"),
                    Err(err) => {
                        tracing::warn!(dir = %e.path().display(), error = %err, "cannot remove an interrupted snapshot")
                    }
                }
            }
        }
    }
}

/// 4090 when a revert of VM `rec` was interrupted: its disks may be part reverted.
pub(super) fn check_not_reverting(rec: &crate::state::VmRecord) -> Result<(), ApiError> {
    match rec.reverting() {
        Some(s) => Err(ApiError::new(
            Code::Busy,
            format!("a revert of VM {:?} to snapshot {s:?} was interrupted: run vm.revert again", rec.spec.name),
        )
        .field("name")),
        None => Ok(()),
    }
}

impl HeldVm {
    /// Removes every snapshot of the VM: its destroy's, with its data disks
    /// ([`HeldVm::dispose_data_disks`]).
    ///
    /// # Errors
    /// 4001 when the directory cannot be removed.
    pub(super) fn dispose_snapshots(&self) -> Result<(), ApiError> {
        let dir = snapshots_dir(self.mgr(), self.name());
        crate::blocking::run(|| match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        })
        .map_err(|e| FileError::file(STEP, "delete the snapshots in", &dir)(e).into())
    }
}

/// Removes a directory when dropped unless cleared.
struct RemoveDir(Option<PathBuf>);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        if let Some(dir) = &self.0 {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove an unfinished snapshot");
            }
        }
    }
}

impl VmOp {
    /// Copies a running VM's disks in its QEMU, all at one instant ([`super::live_copy`]);
    /// returns what the copy is.
    async fn snapshot_live(
        &self,
        disks: &[VmDisk],
        entries: &mut [BackupDisk],
        partial: &Path,
        within: Duration,
        requires: Option<crate::api::snapshots::Requirement>,
    ) -> Result<CopyConsistency, ApiError> {
        let mut live: Vec<super::live_copy::Target> = disks
            .iter()
            .zip(entries.iter())
            .map(|(d, e)| super::live_copy::Target {
                device: d.device.clone(),
                path: partial.join(&e.file),
                format: e.format.as_str(),
                backing: d.base.clone(),
                // An overlay's copy holds what the VM wrote; its header names the same base.
                sync: if d.base.is_some() { "top" } else { "full" },
                virtual_size: 0,
            })
            .collect();
        let made = self.copy_disks_live(&mut live, within, requires, "snapshot").await?;
        for (e, t) in entries.iter_mut().zip(&live) {
            e.virtual_size = t.virtual_size;
        }
        Ok(made)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::snapshots::Consistency;

    #[test]
    fn snapshot_names_are_plain() {
        for ok in ["s1", "before-upgrade", "2026.12.04_a"] {
            assert!(is_snapshot_name(ok), "{ok}");
        }
        for bad in ["", ".x", "a/b", "a b", &"x".repeat(65), "..", "ü"] {
            assert!(!is_snapshot_name(bad), "{bad:?}");
        }
    }

    fn snapshot(instance_id: Option<&str>, consistency: Option<Consistency>) -> Snapshot {
        Snapshot {
            name: "s1".into(),
            created_at: "2026-12-04T14:22:31Z".into(),
            live: false,
            consistency,
            reason: None,
            frozen: Vec::new(),
            skipped: Vec::new(),
            instance_id: instance_id.map(str::to_string),
            spec: crate::validate::tests::spec("v"),
            disks: Vec::new(),
        }
    }

    #[test]
    fn a_revert_puts_back_the_instance_id_the_snapshots_root_disk_booted_with() {
        // Taken under instance X; a replace (A -> B) and another (B -> A) made Z since.
        let mut rec = VmRecord::new(crate::validate::tests::spec("v"));
        rec.instance_id = Some("vmhost-v-z".into());
        rec.start_revert("s1");
        complete_revert(&mut rec, &snapshot(Some("vmhost-v-x"), Some(Consistency::Stopped)));
        assert_eq!((rec.instance_id.as_deref(), rec.reverting()), (Some("vmhost-v-x"), None));
        assert_eq!(rec.unclean_end, None, "a stopped copy is clean");
        // A snapshot from before vmhostd recorded the id keeps the current one.
        complete_revert(&mut rec, &snapshot(None, Some(Consistency::Frozen)));
        assert_eq!(rec.instance_id.as_deref(), Some("vmhost-v-x"));
        // Snapshot JSON without the member still reads; with it, it reads back.
        let mut old = serde_json::to_value(snapshot(None, None)).unwrap_or_default();
        assert!(old.get("instance_id").is_none(), "{old}");
        old["instance_id"] = serde_json::json!("vmhost-v-x");
        let read: Snapshot = serde_json::from_value(old).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(read.instance_id.as_deref(), Some("vmhost-v-x"));
    }

    #[test]
    fn a_revert_to_a_crash_copy_leaves_the_disks_unclean() {
        let mut rec = VmRecord::new(crate::validate::tests::spec("v"));
        complete_revert(&mut rec, &snapshot(None, Some(Consistency::Crash)));
        assert!(rec.unclean_end.as_deref().is_some_and(|r| r.contains("crash-consistent")), "{rec:?}");
        complete_revert(&mut rec, &snapshot(None, None));
        assert!(rec.unclean_end.as_deref().is_some_and(|r| r.contains("does not record")), "{rec:?}");
        complete_revert(&mut rec, &snapshot(None, Some(Consistency::Frozen)));
        assert_eq!(rec.unclean_end, None);
    }

    #[test]
    fn a_revert_needs_the_same_disks_but_not_the_same_kernel_arguments() {
        let mut spec = crate::validate::tests::spec("v");
        spec.disks = vec![crate::validate::tests::data_disk("nsm", 2, DiskFormat::Raw)];
        let mut other = spec.clone();
        other.boot.cmdline = Some("quiet".into());
        other.memory_mib += 64;
        assert_eq!(disks_of(&spec), disks_of(&other));
        other.disks[0].size_gib = 3;
        assert_ne!(disks_of(&spec), disks_of(&other), "grown since");
        let mut other = spec.clone();
        other.disks[0].format = DiskFormat::Qcow2;
        assert_ne!(disks_of(&spec), disks_of(&other));
        let mut other = spec.clone();
        other.disks.clear();
        assert_ne!(disks_of(&spec), disks_of(&other));
    }
}
