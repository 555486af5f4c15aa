//! A `boot.disk` VM's root disk: an existing qcow2 or raw file the operator put in the import
//! directory (`paths.import`), moved (renamed, never copied) to `STATE/disks/NAME/root.FORMAT`
//! and owned by the VM from then on (docs/storage.md, "Importing an existing disk").
//!
//! The lifecycle calls, in this order:
//!
//! 1. [`inspect_import`] before anything is recorded: the file is opened without
//!    following a symlink, must be a regular file with one link on the state file system, and
//!    QEMU as `qemu.user` says its format (qcow2 or raw), size and whether it names a backing
//!    or data file (refused: flatten it first); then [`admit_import`] (disk space for
//!    what it grows by);
//! 2. [`VmOp::import_root_disk`] (or [`VmOp::ensure_root_disk`] for a start): the record names the disk and where it came from
//!    (`root_disk`, and the import in progress in its [`crate::state::DiskWork`]) before the
//!    rename, so a crash never loses it; the moved file is checked to be the inode inspected,
//!    made 0600 and grown to `disk_gib`;
//! 3. when the create (or the start that imported it again) has succeeded,
//!    [`HeldVm::end_root_disk_import`]; when it is undone, [`HeldVm::undo_root_disk`] moves the
//!    file back to the import directory (an operator's disk is never deleted by a failure);
//! 4. a destroy: [`HeldVm::dispose_root_disk`] deletes it (the operator asked to destroy the
//!    VM); one whose import never completed goes back instead.
//!
//! A changed `disk_gib` grows it like an overlay: live (`block_resize` of the boot drive) or
//! offline ([`VmOp::grow_root_disk`]), never below the size it had when imported
//! ([`check_root_disk_size`]).

use super::errors::{DiskStepError, FileError};
use super::held::HeldVm;
use super::op::VmOp;
use super::undo::Step;
use super::Manager;
use crate::api::{ApiError, DataDiskSpec, DiskFormat, VmSpec};
use crate::disk::GIB;
use crate::state::{RootDisk, VmRecord};
use crate::validate::{BootSource, ValidSpec};
use serde_json::json;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// A disk offered for import, inspected and not yet moved.
#[derive(Debug)]
pub(super) struct Import {
    /// `paths.import/FILE`.
    source: PathBuf,
    /// The file, open read-only (never through a symlink): the inode that was inspected.
    file: File,
    /// Its format.
    format: DiskFormat,
    /// Its virtual size in bytes.
    virtual_size: u64,
    /// Its permission bits.
    mode: u32,
}

/// The API step of this module's failures.
const STEP: &str = "root_disk";

fn failed(message: String) -> ApiError {
    super::provisioning(STEP, message)
}

fn refused(message: String) -> ApiError {
    ApiError::invalid("spec.boot.disk", message)
}

/// Opens `path` read-only without following a symlink in its last component and without
/// blocking on a FIFO (which is refused next as not a regular file).
fn open_no_follow(path: &Path) -> std::io::Result<File> {
    crate::blocking::run(|| {
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)
    })
}

/// Renames `from` to `to` unless `to` exists (`RENAME_NOREPLACE`: no disk is ever overwritten).
fn rename_no_replace(from: &Path, to: &Path) -> std::io::Result<()> {
    use nix::fcntl::{renameat2, RenameFlags, AT_FDCWD};
    crate::blocking::run(|| renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE))
        .map_err(std::io::Error::from)
}

/// 2001 on `spec.boot.disk_gib` when `spec` asks for a root disk smaller than `bytes`.
fn check_not_smaller(spec: &VmSpec, bytes: u64) -> Result<(), ApiError> {
    match spec.boot.disk_gib {
        Some(gib) if gib.saturating_mul(GIB) < bytes => Err(ApiError::invalid(
            "spec.boot.disk_gib",
            format!(
                "the imported disk is {bytes} bytes ({:.1} GiB); {gib} GiB is smaller and a disk is never shrunk",
                bytes as f64 / GIB as f64
            ),
        )),
        _ => Ok(()),
    }
}

/// A changed spec of a `boot.disk` VM may not ask for less than the size its disk had when it
/// was imported (a larger earlier `disk_gib` is kept by [`crate::plan::classify`]).
///
/// # Errors
/// 2001 on `spec.boot.disk_gib`.
pub(super) fn check_root_disk_size(current: &VmRecord, spec: &VmSpec) -> Result<(), ApiError> {
    match (&current.root_disk, &spec.boot.disk) {
        (Some(root), Some(_)) => check_not_smaller(spec, root.imported_bytes),
        _ => Ok(()),
    }
}

/// The data-disk description [`crate::disk::data::grow`] needs to grow a root disk.
fn as_disk(format: DiskFormat, size_gib: u64) -> DataDiskSpec {
    DataDiskSpec {
        name: crate::validate::ROOT_DISK_NAME.into(),
        size_gib,
        format,
        preallocate: false,
        cache: Default::default(),
        aio: None,
        keep_on_destroy: false,
        snapshot: true,
    }
}

/// The checks of a `boot.disk` spec's file, before anything is recorded; `None` for other
/// boot sources.
///
/// # Errors
/// 2001 on `spec.boot.disk` when the file is missing, a symlink, not a regular file, has
/// other hard links, is on another file system than the state directory, is neither qcow2
/// nor raw, or names a backing or data file; 2001 on `spec.boot.disk_gib` when that is
/// below the disk's size; 4001 step `root_disk` when QEMU cannot be run.
pub(super) async fn inspect_import(mgr: &Manager, vm: &ValidSpec) -> Result<Option<Import>, ApiError> {
    let BootSource::Disk { file, .. } = &vm.boot else { return Ok(None) };
    let dir = mgr.config.paths.import_dir();
    let source = dir.join(file);
    let opened = open_no_follow(&source).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => refused(format!("no file {file:?} in the import directory {}", dir.display())),
        Some(libc::ELOOP) => refused(format!(
            "{} is a symbolic link; move the disk file itself into {}",
            source.display(),
            dir.display()
        )),
        _ => FileError::OpenImport { path: source.clone(), source: e }.into(),
    })?;
    let meta = opened.metadata().map_err(FileError::file(STEP, "stat", &source))?;
    if !meta.file_type().is_file() {
        return Err(refused(format!("{} is not a regular file", source.display())));
    }
    if meta.nlink() != 1 {
        // Another name of the same inode (libvirt's pool?) would still reach the VM's disk.
        return Err(refused(format!(
            "{} has {} hard links; remove the others first (the disk must be the VM's alone)",
            source.display(),
            meta.nlink()
        )));
    }
    let disks = mgr.config.paths.state.join("disks");
    let state_dev = std::fs::metadata(&disks).map_err(FileError::file(STEP, "stat", &disks))?.dev();
    if meta.dev() != state_dev {
        return Err(refused(format!(
            "{} is on another file system than the state directory {}: vmhostd only renames an \
             imported disk, never copies it; use an import directory on that file system",
            source.display(),
            mgr.config.paths.state.display()
        ))
        .details(json!({ "reason": "cross_device" })));
    }
    let fd = opened.try_clone().map(OwnedFd::from).map_err(FileError::unnamed(STEP, "duplicate a descriptor"))?;
    let info = crate::disk::import::inspect(&mgr.disk_tool(), fd)
        .await
        .map_err(|e| DiskStepError::InspectImport { path: source.clone(), source: e })?;
    let format = match info.format.as_str() {
        "qcow2" => DiskFormat::Qcow2,
        "raw" => DiskFormat::Raw,
        other => {
            return Err(refused(format!(
                "{} is a {other:?} image; only qcow2 and raw disks are imported \
                 (qemu-img convert -O qcow2 it first)",
                source.display()
            )))
        }
    };
    if let Some(backing) = &info.backing {
        return Err(refused(format!(
            "{} is a qcow2 overlay on the backing file {backing:?}: flatten it first \
             (qemu-img convert -O qcow2 {} flat.qcow2) and import the flat file",
            source.display(),
            source.display()
        )));
    }
    if let Some(data) = &info.data_file {
        return Err(refused(format!(
            "{} keeps its data in the external file {data:?}: flatten it first (qemu-img convert -O qcow2)",
            source.display()
        )));
    }
    check_not_smaller(&vm.spec, info.virtual_size)?;
    let mode = meta.mode() & 0o7777;
    Ok(Some(Import { source, file: opened, format, virtual_size: info.virtual_size, mode }))
}

/// Disk-space admission of a create importing `import` ([`crate::disk::space`]): its data
/// disks and what the root disk grows by to reach `disk_gib`; the imported bytes are on
/// the file system already and a rename adds none.
///
/// # Errors
/// 3002 `resource: disk_gib`; 4001 when the free space cannot be read.
pub(super) fn admit_import(mgr: &Manager, spec: &VmSpec, import: &Import) -> Result<(), ApiError> {
    let mut request = crate::disk::space::new_provision(None, spec);
    let wanted = spec.boot.disk_gib.map_or(0, |g| g.saturating_mul(GIB));
    request.bytes = request.bytes.saturating_add(wanted.saturating_sub(import.virtual_size));
    super::data_disks::admit_provision(mgr, request)
}

/// The full size of the root disk a `boot.disk` VM owns (for `host.info`'s
/// `provisioned_bytes`, which [`crate::disk::space::provisioned`] leaves it out of): its
/// `disk_gib`, or the size it was imported with when that is larger.
pub(super) fn root_disk_bytes(rec: &VmRecord) -> u64 {
    let declared = rec.spec.boot.disk_gib.map_or(0, |g| g.saturating_mul(GIB));
    rec.root_disk.as_ref().map_or(0, |r| r.imported_bytes.max(declared))
}

impl HeldVm {
    /// The operation that imported the root disk has succeeded: the VM owns it. A create or
    /// start that imported it, and recovery ending an import whose VM got past its create.
    ///
    /// # Errors
    /// The record cannot be written.
    pub(super) fn end_root_disk_import(&self) -> Result<(), ApiError> {
        if !self.record()?.importing_root() {
            return Ok(());
        }
        self.update("root disk imported", |r| {
            r.end_root_import();
        })
        .map(drop)
    }

    /// Undoes an import the record says is in progress: the file goes back to the import
    /// directory with its permissions (to `FILE.returned` if its name was taken meanwhile), and
    /// the record stops naming it. Failures are logged: the record then keeps naming it, and a
    /// destroy tries again rather than deleting it. An operation's unwind ([`VmOp::fail`]) and
    /// recovery (a create or start that died) use it.
    pub(super) fn undo_root_disk(&self) {
        let name = self.name();
        let Ok(rec) = self.record() else { return };
        let Some(root) = rec.root_disk.as_ref().filter(|_| rec.importing_root()) else { return };
        let paths = self.paths();
        if let Err(e) = give_back(&paths.root_disk(root.format), root) {
            tracing::error!(vm = name, error = %e.message, "rollback: the imported disk was not given back");
            return;
        }
        remove_if_empty(&paths.disk_dir);
        if let Err(e) = self.update("root disk given back", VmRecord::drop_root_disk) {
            tracing::error!(vm = name, error = %e.message, "rollback: cannot record the returned disk");
        }
    }

    /// A destroy's share: deletes the VM's root disk (an import that never completed goes
    /// back to the import directory instead). A destroy and recovery (finishing one that
    /// died) use it.
    ///
    /// # Errors
    /// 4001 step `root_disk` when it cannot be deleted or given back.
    pub(super) fn dispose_root_disk(&self) -> Result<(), ApiError> {
        let name = self.name();
        let rec = self.record()?;
        let Some(root) = rec.root_disk.as_ref() else { return Ok(()) };
        let paths = self.paths();
        let file = paths.root_disk(root.format);
        if rec.importing_root() {
            give_back(&file, root)?;
        } else {
            match crate::blocking::run(|| std::fs::remove_file(&file)) {
                Ok(()) => tracing::info!(vm = name, path = %file.display(), "deleted the root disk"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(FileError::file(STEP, "delete", &file)(e).into()),
            }
        }
        remove_if_empty(&paths.disk_dir);
        self.update("root disk disposed of", VmRecord::drop_root_disk).map(drop)
    }
}

/// Moves the root disk `file` back to where `root` says it came from.
fn give_back(file: &Path, root: &RootDisk) -> Result<(), ApiError> {
    let opened = match open_no_follow(file) {
        Ok(f) => f,
        // Never moved (a crash before the rename), or already back.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(FileError::file(STEP, "open", file)(e).into()),
    };
    let mode = nix::sys::stat::Mode::from_bits_truncate(root.source_mode);
    if let Err(e) = nix::sys::stat::fchmod(opened.as_fd(), mode) {
        tracing::warn!(path = %file.display(), error = %e, "cannot restore the returned disk's mode");
    }
    let mut to = root.source.clone();
    let result = match rename_no_replace(file, &to) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            to.as_mut_os_string().push(".returned");
            rename_no_replace(file, &to)
        }
        other => other,
    };
    result.map_err(|e| FileError::MoveBack {
        step: STEP.into(),
        from: file.to_path_buf(),
        to: to.clone(),
        source: e,
    })?;
    tracing::warn!(path = %to.display(), "gave an imported disk back to the import directory");
    Ok(())
}

impl VmOp {
    /// The root disk step of a `boot.disk` create: moves `import` in as the VM's root disk.
    /// Recorded first (`root_disk`, and the import in progress), renamed (never over an existing
    /// file), checked to be the inspected inode, made 0600, grown to `disk_gib`. A file moved in
    /// is given back to the import directory if the operation fails.
    ///
    /// # Errors
    /// 4001 step `root_disk` when the record cannot be written or the file cannot be moved,
    /// checked, or grown; a file moved in stays named by the record, for
    /// [`HeldVm::undo_root_disk`].
    pub(super) async fn import_root_disk(&mut self, spec: &VmSpec, import: Import) -> Result<(), ApiError> {
        // Its undo reads the record, which names the disk before it is moved.
        self.push(Step::RootDisk);
        self.move_in(spec, import).await
    }

    /// The root disk step of a start: a `boot.disk` VM whose disk is not in place (its create
    /// failed and gave it back) imports it again, and gives it back again if this start fails.
    ///
    /// # Errors
    /// As [`inspect_import`] and [`VmOp::import_root_disk`].
    pub(super) async fn ensure_root_disk(&mut self, vm: &ValidSpec) -> Result<(), ApiError> {
        self.push(Step::RootDisk);
        if !matches!(vm.boot, BootSource::Disk { .. }) || self.record()?.root_disk.is_some() {
            return Ok(());
        }
        let Some(import) = inspect_import(self.mgr(), vm).await? else { return Ok(()) };
        self.move_in(&vm.spec, import).await
    }

    /// Grows the root disk of a `boot.disk` VM whose QEMU is not running to `gib` (a
    /// reconfigure).
    ///
    /// # Errors
    /// 4001 step `disk_grow` with QEMU's reason.
    pub(super) async fn grow_root_disk(&self, gib: u64) -> Result<(), ApiError> {
        let Some(root) = self.record()?.root_disk else { return Ok(()) };
        let file = self.paths().root_disk(root.format);
        crate::disk::data::grow(&self.mgr().disk_tool(), &file, &as_disk(root.format, gib))
            .await
            .map_err(|source| crate::disk::GrowError { gib, source })?;
        Ok(())
    }

    /// The import itself, once its undo is on the stack.
    async fn move_in(&self, spec: &VmSpec, import: Import) -> Result<(), ApiError> {
        let name = self.name();
        let paths = self.paths();
        let target = paths.root_disk(import.format);
        crate::state::dirs::private_dir(&paths.disk_dir).map_err(FileError::file(STEP, "create", &paths.disk_dir))?;
        let root = RootDisk {
            format: import.format,
            imported_bytes: import.virtual_size,
            source: import.source.clone(),
            source_mode: import.mode,
        };
        self.record_intent("importing the root disk", |r| r.start_root_import(root))?;
        if let Err(e) = rename_no_replace(&import.source, &target) {
            let _ = self.update("root disk not moved", VmRecord::drop_root_disk);
            return Err(FileError::Move { step: STEP.into(), from: import.source, to: target, source: e }.into());
        }
        tracing::info!(vm = name, from = %import.source.display(), to = %target.display(), "imported a root disk");
        self.crashpoint("root_disk:moved");
        // The name may have been swapped between the inspection and the rename: what moved in
        // must be the inode QEMU inspected, still not a symlink.
        let moved = open_no_follow(&target).and_then(|f| f.metadata());
        let inspected = import.file.metadata();
        let same = matches!((&moved, &inspected), (Ok(a), Ok(b)) if a.dev() == b.dev() && a.ino() == b.ino() && a.file_type().is_file());
        if !same {
            return Err(failed(format!("{} changed while it was being imported", import.source.display())));
        }
        nix::sys::stat::fchmod(import.file.as_fd(), nix::sys::stat::Mode::from_bits_truncate(0o600))
            .map_err(|e| FileError::MakePrivate { step: STEP.into(), path: target.clone(), source: e.into() })?;
        if let Some(gib) = spec.boot.disk_gib {
            crate::disk::data::grow(&self.mgr().disk_tool(), &target, &as_disk(import.format, gib))
                .await
                .map_err(|source| DiskStepError::GrowImport { gib, source })?;
        }
        Ok(())
    }
}

/// Removes `dir` if it is empty.
fn remove_if_empty(dir: &Path) {
    let _ = crate::blocking::run(|| std::fs::remove_dir(dir));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(disk_gib: Option<u64>, imported_bytes: u64) -> VmRecord {
        let mut spec = crate::validate::tests::spec("v");
        spec.boot = crate::api::BootSpec { disk: Some("d.qcow2".into()), disk_gib, ..Default::default() };
        let mut rec = VmRecord::new(spec);
        rec.root_disk = Some(RootDisk {
            format: DiskFormat::Qcow2,
            imported_bytes,
            source: "/var/lib/vmhost/import/d.qcow2".into(),
            source_mode: 0o640,
        });
        rec
    }

    #[test]
    fn a_root_disk_is_never_asked_to_be_smaller_than_it_was_imported() {
        let rec = record(None, 20 * GIB + 1);
        let mut spec = rec.spec.clone();
        spec.boot.disk_gib = Some(20);
        let e = check_root_disk_size(&rec, &spec).unwrap_err();
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("spec.boot.disk_gib")));
        spec.boot.disk_gib = Some(21);
        assert!(check_root_disk_size(&rec, &spec).is_ok());
        spec.boot.disk_gib = None;
        assert!(check_root_disk_size(&rec, &spec).is_ok());
        // host.info counts the imported size where the spec says less (or nothing).
        assert_eq!(root_disk_bytes(&rec), 20 * GIB + 1);
        assert_eq!(root_disk_bytes(&record(Some(30), 20 * GIB)), 30 * GIB);
        let mut failed = record(Some(30), 20 * GIB);
        failed.root_disk = None;
        assert_eq!(root_disk_bytes(&failed), 0, "a disk given back is not the VM's");
    }

    #[test]
    fn renames_never_replace_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, b"a").unwrap();
        std::fs::write(&b, b"b").unwrap();
        assert_eq!(rename_no_replace(&a, &b).unwrap_err().raw_os_error(), Some(libc::EEXIST));
        assert_eq!(std::fs::read(&b).unwrap(), b"b");
        std::fs::remove_file(&b).unwrap();
        rename_no_replace(&a, &b).unwrap();
        assert_eq!(std::fs::read(&b).unwrap(), b"a");
    }

    #[test]
    fn symlinks_are_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("disk.qcow2");
        std::fs::write(&target, b"x").unwrap();
        let link = dir.path().join("link.qcow2");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert_eq!(open_no_follow(&link).unwrap_err().raw_os_error(), Some(libc::ELOOP));
        assert!(open_no_follow(&target).is_ok());
    }
}
