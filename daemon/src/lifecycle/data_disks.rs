//! A VM's data disks across its life: made before its QEMU starts, grown with its spec, kept
//! or deleted only when the operator says so, taken back by a VM of the same name.
//!
//! The files are `STATE/disks/NAME/DISK.FORMAT` ([`VmPaths::data_disk`]); a destroy moves those
//! with `keep_on_destroy` to `STATE/kept-disks/NAME/` and deletes the rest. Every step records
//! its intent first, so a crash never leaves a disk that nothing names or deletes one that a
//! create merely took back. The lifecycle calls, in this order:
//!
//! 0. before any of them: [`admit_disk_space`] (3002 when the new disks do not fit);
//! 1. a create: [`VmOp::clear_orphan_disks`] (files no record names), then
//!    [`VmOp::make_data_disks`] with tracking (each disk taken back from `kept-disks` is
//!    named in the record's disk work ([`crate::state::DiskWork`]) before the file is touched);
//!    [`HeldVm::end_disk_tracking`] when the create ends, or [`HeldVm::undo_data_disks`]
//!    when it is undone (new ones deleted, taken-back ones returned);
//! 2. a start: [`VmOp::make_data_disks`] without tracking (a disk added while stopped);
//!    before either, names an earlier operation left tracked become the VM's disks
//!    ([`VmOp::make_data_disks`]: a QEMU may have had them);
//! 3. a change of a stopped VM: [`VmOp::grow_data_disks`], then, once the VM runs its new
//!    spec, [`VmOp::retire_data_disks`] for the disks the spec dropped;
//! 4. a destroy: [`HeldVm::dispose_data_disks`], whose kept paths the reply names;
//! 5. the host: [`kept_disks`] (`host.info`), [`purge_kept_disks`].
//!
//! A replace (new `boot.image`) runs a create without clearing orphans or undoing anything
//! but what it made, so every data disk outlives it.

use super::errors::IntentRefused;
use super::held::HeldVm;
use super::op::VmOp;
use super::undo::Step;
use super::Manager;
use crate::api::{ApiError, Code, DataDiskSpec, DiskFormat, KeptDisk, VmSpec};
use crate::disk::data::DataDiskError;
use crate::qemu::argv::VmPaths;
use std::path::{Path, PathBuf};

/// Creates `dir` (mode 0700) unless it exists.
fn private_dir(dir: &Path) -> Result<(), ApiError> {
    crate::blocking::run(|| crate::state::dirs::private_dir(dir))
        .map(drop)
        .map_err(|source| DataDiskError::Dir { dir: dir.to_path_buf(), source }.into())
}

/// Removes `dir` if it is empty; anything else in it stays (and is logged).
fn remove_if_empty(dir: &Path) {
    match crate::blocking::run(|| std::fs::remove_dir(dir)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "left a data disk directory in place"),
    }
}

/// Removes `path`; absent is fine. (A disk of many gigabytes takes a while to unlink.)
fn remove_file(path: &Path) -> Result<(), ApiError> {
    delete(path).map_err(|source| DataDiskError::Delete { path: path.to_path_buf(), source }.into())
}

/// [`remove_file`] with the bare I/O error (a purge wraps it with what it deleted before).
fn delete(path: &Path) -> std::io::Result<()> {
    match crate::blocking::run(|| std::fs::remove_file(path)) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Moves `from` to `to` (same file system: a rename), creating `to`'s directory.
fn move_disk(from: &Path, to: &Path) -> Result<(), ApiError> {
    if let Some(dir) = to.parent() {
        private_dir(dir)?;
    }
    crate::blocking::run(|| std::fs::rename(from, to))
        .map_err(|source| DataDiskError::Move { from: from.to_path_buf(), to: to.to_path_buf(), source }.into())
}

/// Disk-space admission ([`crate::disk::space`]): refuses (3002) a create (`old` none), a
/// change or a replace whose new disks do not fit the state file system's free space.
/// Before anything is made or recorded.
///
/// # Errors
/// 3002 `resource: disk_gib`; 4001 when the free space cannot be read.
pub(super) fn admit_disk_space(mgr: &Manager, old: Option<&VmSpec>, new: &VmSpec) -> Result<(), ApiError> {
    admit_provision(mgr, crate::disk::space::new_provision(old, new))
}

/// Admits `request` (new provisioned bytes) against the state file system's free space,
/// less what running imports, snapshots and exports hold there ([`crate::disk::reserve`]).
///
/// # Errors
/// 3002 `resource: disk_gib`; 4001 when the free space cannot be read.
pub(super) fn admit_provision(mgr: &Manager, request: crate::disk::space::Provision) -> Result<(), ApiError> {
    if request.bytes == 0 {
        return Ok(());
    }
    let state = &mgr.config.paths.state;
    let space =
        mgr.reservations.space_left(state).map_err(|source| DataDiskError::Space { dir: state.clone(), source })?;
    Ok(crate::disk::space::admit(request, space, mgr.config.storage.overcommit_percent)?)
}

/// Every data disk in `STATE/kept-disks`, by VM and disk name.
pub(super) fn kept_disks(mgr: &Manager) -> Vec<KeptDisk> {
    let root = mgr.config.paths.state.join("kept-disks");
    let mut out = Vec::new();
    let Ok(vms) = std::fs::read_dir(&root) else { return out };
    for vm in vms.flatten() {
        let Ok(files) = std::fs::read_dir(vm.path()) else { continue };
        for file in files.flatten() {
            let path = file.path();
            let Some((disk, format)) = parse_file_name(&path) else { continue };
            let file_bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
            out.push(KeptDisk {
                vm: vm.file_name().to_string_lossy().into_owned(),
                name: disk,
                format,
                path,
                file_bytes,
            });
        }
    }
    out.sort_by(|a, b| (&a.vm, &a.name).cmp(&(&b.vm, &b.name)));
    out
}

/// `host.purge_kept_disks`: deletes the data disks kept for VM `vm`.
///
/// # Errors
/// 2001 on `vm` for a name that is not a VM name; 4040 when nothing is kept for it; 4090
/// while an operation holds a VM of that name; 4001 when a file cannot be deleted (those
/// deleted before are reported in the message).
pub(crate) fn purge_kept_disks(mgr: &Manager, vm: &str) -> Result<crate::api::disks::PurgeReport, ApiError> {
    if !crate::validate::is_valid_name(vm) {
        return Err(ApiError::invalid("vm", format!("{vm:?} is not a VM name")));
    }
    if mgr.lock().busy.contains(vm) {
        // A create of that name may be taking a kept disk back right now.
        return Err(super::busy(vm));
    }
    let dir = VmPaths::for_vm(&mgr.config, vm).kept_dir;
    let entries = match crate::blocking::run(|| std::fs::read_dir(&dir).map(|rd| rd.flatten().collect::<Vec<_>>())) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ApiError::new(Code::NotFound, format!("no kept disks for VM {vm:?}")).field("vm"));
        }
        Err(source) => return Err(DataDiskError::ReadKept { dir, source }.into()),
    };
    let mut deleted = Vec::new();
    for entry in entries {
        let path = entry.path();
        if let Err(source) = delete(&path) {
            let source = Box::new(DataDiskError::Delete { path, source });
            return Err(DataDiskError::Purge { source, deleted }.into());
        }
        tracing::info!(vm, path = %path.display(), "purged a kept data disk");
        deleted.push(path);
    }
    remove_if_empty(&dir);
    Ok(crate::api::disks::PurgeReport { deleted })
}

impl HeldVm {
    /// The create that tracked its disks has ended (made or undone): nothing is to be undone
    /// any more. A create's last step, and the end of [`HeldVm::undo_data_disks_except`].
    ///
    /// # Errors
    /// The record cannot be written.
    pub(super) fn end_disk_tracking(&self) -> Result<(), ApiError> {
        if !self.record()?.tracks_data_disks() {
            return Ok(());
        }
        self.update("data disks settled", |r| {
            r.end_disk_tracking();
        })
        .map(drop)
    }

    /// Undoes the data disk steps of a create: deletes the disks it made and returns those it
    /// took back to `kept-disks`, as the record names them; disks it found in place (a
    /// replace keeps them) are not touched. Failures are logged: an undo goes as far as it can.
    /// An operation's unwind ([`VmOp::fail`]) and recovery (an interrupted create) use it.
    pub(super) fn undo_data_disks(&self) {
        self.undo_data_disks_except(&std::collections::BTreeSet::new());
    }

    /// [`HeldVm::undo_data_disks`], except for the disks named in `attached` (a running QEMU
    /// has them: they are the VM's now): a refused hot-plug ([`VmOp::change_disks_live`]) and
    /// recovery's [`HeldVm::settle_hotplug`].
    pub(super) fn undo_data_disks_except(&self, attached: &std::collections::BTreeSet<String>) {
        let name = self.name();
        let Ok(rec) = self.record() else { return };
        let paths = self.paths();
        let nothing = crate::state::DiskWork::default();
        let work = rec.disk_work().unwrap_or(&nothing);
        let by_name = |n: &String| rec.spec.disks.iter().find(|d| &d.name == n && !attached.contains(n.as_str()));
        for disk in work.new.iter().filter_map(by_name) {
            for file in [paths.data_disk(disk), paths.partial_data_disk(disk)] {
                if let Err(e) = remove_file(&file) {
                    tracing::error!(vm = name, error = %e.message, "rollback: a new data disk stays");
                }
            }
        }
        for disk in work.reclaimed.iter().filter_map(by_name) {
            let file = paths.data_disk(disk);
            if file.exists() {
                if let Err(e) = move_disk(&file, &paths.kept_disk(disk)) {
                    tracing::error!(vm = name, error = %e.message, "rollback: a taken-back disk was not returned");
                }
            }
        }
        remove_if_empty(&paths.disk_dir);
        if let Err(e) = self.end_disk_tracking() {
            tracing::error!(vm = name, error = %e.message, "rollback: cannot clear the disk tracking");
        }
    }

    /// A destroy's share: every data disk of `spec` (the VM's) kept or deleted, leftovers of
    /// interrupted steps deleted, the directory removed when empty. Returns the kept paths.
    /// A destroy and recovery (finishing an interrupted one) use it.
    ///
    /// # Errors
    /// 4001 step `data_disk` when a disk cannot be moved or deleted.
    pub(super) fn dispose_data_disks(&self, spec: &VmSpec) -> Result<Vec<PathBuf>, ApiError> {
        // Snapshots are copies of the VM's disks: they go with them.
        self.dispose_snapshots()?;
        let all: Vec<&DataDiskSpec> = spec.disks.iter().collect();
        let kept = self.let_go(&all)?;
        let paths = self.paths();
        for disk in &spec.disks {
            remove_file(&paths.partial_data_disk(disk))?;
        }
        remove_if_empty(&paths.disk_dir);
        Ok(kept)
    }

    /// Keeps (moves) or deletes each of `disks` of the VM; returns the kept paths. A destroy,
    /// a change that drops disks (live or not) and recovery settling a hot-plug use it.
    ///
    /// # Errors
    /// 4001 step `data_disk` when a disk cannot be moved or deleted, or its kept name is taken.
    pub(super) fn let_go(&self, disks: &[&DataDiskSpec]) -> Result<Vec<PathBuf>, ApiError> {
        let name = self.name();
        let paths = self.paths();
        let mut kept = Vec::new();
        for disk in disks {
            let file = paths.data_disk(disk);
            if !file.exists() {
                continue;
            }
            if disk.keep_on_destroy {
                let to = paths.kept_disk(disk);
                if to.exists() {
                    return Err(DataDiskError::KeptTaken { disk: disk.name.clone(), to }.into());
                }
                move_disk(&file, &to)?;
                tracing::info!(vm = name, disk = %disk.name, path = %to.display(), "kept a data disk");
                kept.push(to);
            } else {
                remove_file(&file)?;
                tracing::info!(vm = name, disk = %disk.name, "deleted a data disk");
            }
        }
        Ok(kept)
    }
}

impl VmOp {
    /// Records what this operation is about to do to the host (`start`: a
    /// [`crate::state::Intent`] begun or extended), before it does it.
    ///
    /// # Errors
    /// The record cannot be written; 5000 when the record holds an intent this one cannot join
    /// (an unfinished revert: callers refuse such a VM first).
    pub(super) fn record_intent(
        &self,
        reason: &str,
        start: impl FnOnce(&mut crate::state::VmRecord) -> Result<(), crate::state::IntentError>,
    ) -> Result<(), ApiError> {
        let mut outcome = Ok(());
        self.update(reason, |r| outcome = start(r))?;
        outcome.map_err(|source| IntentRefused { vm: self.name().to_string(), source })?;
        Ok(())
    }

    /// Deletes files in the VM's data disk directory that no record names (a VM of this name
    /// is being created, so none can be its own): a new VM never inherits a stranger's disk,
    /// nor a UEFI variables store ([`VmPaths::uefi_vars`]) with a stranger's boot entries, which
    /// is therefore not exempt (its own is copied at its first start). Kept disks are elsewhere
    /// and are not touched.
    ///
    /// # Errors
    /// 4001 step `data_disk` when one cannot be deleted.
    pub(super) fn clear_orphan_disks(&self) -> Result<(), ApiError> {
        let name = self.name();
        let dir = self.paths().disk_dir.clone();
        // An entry that cannot be read is skipped, as before: the rest are still cleared.
        let Ok(entries) = crate::blocking::run(|| std::fs::read_dir(&dir).map(|rd| rd.flatten().collect::<Vec<_>>()))
        else {
            return Ok(());
        };
        for entry in entries {
            let path = entry.path();
            tracing::warn!(vm = name, path = %path.display(), "removing an orphaned file of the VM's disk directory");
            remove_file(&path)?;
        }
        remove_if_empty(&dir);
        Ok(())
    }

    /// The data disk step: makes every data disk `spec` lists that has no file yet
    /// ([`VmOp::ensure_data_disk`]). With `track` (a create) each disk is recorded before it is
    /// touched, and what the step made or took back is undone on failure.
    ///
    /// # Errors
    /// 4001 step `data_disk` when a disk cannot be made, moved or grown; the record cannot be
    /// written.
    pub(super) async fn make_data_disks(&mut self, spec: &VmSpec, track: bool) -> Result<(), ApiError> {
        // Disks still named from an earlier operation (a hot-plug whose answer was lost, then
        // its QEMU ended; a record written before recovery ended the tracking of a hot-plug
        // whose QEMU died in a crash) are the VM's from here on: a QEMU may have
        // had them and its guest written to them, so nothing this operation undoes may delete
        // them. This operation has tracked nothing yet, so every name there is such a leftover.
        self.held().end_disk_tracking()?;
        if track {
            // Its undo reads the record, which names each disk before it is touched.
            self.push(Step::DataDisks);
        }
        for disk in &spec.disks {
            self.ensure_data_disk(disk, track).await?;
        }
        Ok(())
    }

    /// Makes data disk `disk` unless it has a file: one kept by the destroy of a VM of this
    /// name (same disk name and format) is taken back and grown to the spec's size if smaller,
    /// else a new one is made (under a temporary name, then renamed). With `track` (a create, a
    /// hot-plug) it is named in the record's disk work ([`crate::state::DiskWork`]) before its
    /// file is touched.
    ///
    /// # Errors
    /// 4001 step `data_disk` when the disk cannot be made, moved or grown (what was made before
    /// stays; the operation decides whether to undo it).
    pub(super) async fn ensure_data_disk(&self, disk: &DataDiskSpec, track: bool) -> Result<(), ApiError> {
        let (mgr, name, paths) = (self.mgr(), self.name(), self.paths());
        private_dir(&paths.disk_dir)?;
        let file = paths.data_disk(disk);
        if file.exists() {
            return Ok(());
        }
        let kept = paths.kept_disk(disk);
        if kept.exists() {
            if track {
                self.record_intent("taking back a kept disk", |r| r.track_reclaimed_disk(&disk.name))?;
            }
            move_disk(&kept, &file)?;
            tracing::info!(vm = name, disk = %disk.name, "took back a kept data disk");
            // The last one taken back leaves no empty `kept-disks/NAME/` (an undo makes it
            // again); others kept there keep it.
            if let Err(e) = crate::blocking::run(|| std::fs::remove_dir(&paths.kept_dir)) {
                if e.raw_os_error() != Some(libc::ENOTEMPTY) {
                    tracing::warn!(dir = %paths.kept_dir.display(), error = %e, "left an empty kept-disks directory");
                }
            }
            self.crashpoint("data_disk:reclaimed");
            crate::disk::data::grow(&mgr.disk_tool(), &file, disk)
                .await
                .map_err(|source| DataDiskError::GrowTakenBack { disk: disk.name.clone(), source })?;
            return Ok(());
        }
        if track {
            self.record_intent("making a data disk", |r| r.track_new_disk(&disk.name))?;
        }
        let partial = paths.partial_data_disk(disk);
        remove_file(&partial)?;
        crate::disk::data::create(&mgr.disk_tool(), &partial, disk)
            .await
            .map_err(|source| DataDiskError::Create { disk: disk.name.clone(), source })?;
        crate::blocking::run(|| std::fs::rename(&partial, &file)).map_err(|source| {
            let _ = remove_file(&partial);
            DataDiskError::Place { disk: disk.name.clone(), source }
        })?;
        self.crashpoint("data_disk:made");
        Ok(())
    }

    /// Grows every data disk of a VM whose QEMU is not running to its size in `spec`.
    ///
    /// # Errors
    /// 4001 step `data_disk` naming the disk.
    pub(super) async fn grow_data_disks(&self, spec: &VmSpec) -> Result<(), ApiError> {
        let (mgr, paths) = (self.mgr(), self.paths());
        for disk in &spec.disks {
            let file = paths.data_disk(disk);
            if !file.exists() {
                continue; // made at the next start
            }
            crate::disk::data::grow(&mgr.disk_tool(), &file, disk).await.map_err(|source| DataDiskError::Grow {
                disk: disk.name.clone(),
                size_gib: disk.size_gib,
                source,
            })?;
        }
        Ok(())
    }

    /// Deals with the disks `old` lists and `new` does not (the VM runs `new` or is stopped):
    /// kept in `kept-disks` when `old` said `keep_on_destroy`, else deleted. Returns the kept
    /// paths.
    ///
    /// # Errors
    /// 4001 step `data_disk` when one cannot be moved or deleted.
    pub(super) fn retire_data_disks(&self, old: &VmSpec, new: &VmSpec) -> Result<Vec<PathBuf>, ApiError> {
        let dropped: Vec<&DataDiskSpec> =
            old.disks.iter().filter(|d| !new.disks.iter().any(|n| n.name == d.name && n.format == d.format)).collect();
        self.held().let_go(&dropped)
    }
}

/// `DISK.FORMAT` back into its parts, for a name a data disk can have.
fn parse_file_name(path: &Path) -> Option<(String, DiskFormat)> {
    let file = path.file_name()?.to_str()?;
    let (disk, ext) = file.rsplit_once('.')?;
    let format = match ext {
        "qcow2" => DiskFormat::Qcow2,
        "raw" => DiskFormat::Raw,
        _ => return None,
    };
    crate::validate::is_valid_disk_name(disk).then(|| (disk.to_string(), format))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_file_names_parse_back_and_others_are_skipped() {
        assert_eq!(parse_file_name(Path::new("/k/vm/nsm.raw")), Some(("nsm".into(), DiskFormat::Raw)));
        assert_eq!(parse_file_name(Path::new("/k/vm/logs-1.qcow2")), Some(("logs-1".into(), DiskFormat::Qcow2)));
        for other in ["/k/vm/nsm.raw.partial", "/k/vm/nsm.img", "/k/vm/NSM.raw", "/k/vm/.raw"] {
            assert_eq!(parse_file_name(Path::new(other)), None, "{other}");
        }
    }
}
