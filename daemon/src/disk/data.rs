//! A VM's data disks as files: made and grown here, never deleted here.
//!
//! A raw disk is a plain file: the daemon makes it itself (a length, and with `preallocate` every
//! block reserved with `fallocate`), since there is no format to write or parse. A qcow2 disk is
//! written by QEMU as `qemu.user` on a descriptor ([`super::offline_qemu`]), like an overlay but
//! without a backing file. Used in this order by the lifecycle:
//!
//! 1. [`create`] makes the file under a temporary name (exclusively, mode 0600) and removes it
//!    again if anything fails; the lifecycle renames it into place;
//! 2. [`grow`] grows a disk of a stopped VM (a running VM's disk is grown over its own QMP, then
//!    [`preallocate_tail`] reserves the new blocks of a preallocated raw disk);
//! 3. keeping, taking back and deleting files is the lifecycle's business (renames and
//!    unlinks, [`crate::lifecycle`]): nothing here deletes a disk that was made.
//!
//! Every failure of a data disk step, these and the lifecycle's, is a [`DataDiskError`]: the
//! disk it concerns and the underlying error, given its API code at `crate::owner_errors`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::offline_qemu::{Input, Session, Tool};
use super::{bounded, DiskError, GIB};
use crate::api::{DataDiskSpec, DiskFormat};

/// Why a data disk step failed (step `data_disk` in the API).
#[derive(Debug, thiserror::Error)]
pub enum DataDiskError {
    /// A data disk directory cannot be made.
    #[error("cannot create {}: {source}", .dir.display())]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A file cannot be deleted.
    #[error("cannot delete {}: {source}", .path.display())]
    Delete {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A disk cannot be moved (kept, or taken back).
    #[error("cannot move {} to {}: {source}", .from.display(), .to.display())]
    Move {
        /// Where it was.
        from: PathBuf,
        /// Where it was to go.
        to: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The free space of the state directory cannot be read.
    #[error("cannot read the free space of {}: {source}", .dir.display())]
    Space {
        /// The state directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A disk taken back from the kept disks cannot be grown to the spec's size.
    #[error("cannot grow data disk {disk:?}: {source}")]
    GrowTakenBack {
        /// The disk's name.
        disk: String,
        /// Why.
        #[source]
        source: DiskError,
    },
    /// A new disk cannot be made ([`create`]).
    #[error("cannot make data disk {disk:?}: {source}")]
    Create {
        /// The disk's name.
        disk: String,
        /// Why.
        #[source]
        source: DiskError,
    },
    /// A new disk cannot be renamed into place.
    #[error("cannot move data disk {disk:?} into place: {source}")]
    Place {
        /// The disk's name.
        disk: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A disk of a stopped VM cannot be grown ([`grow`]).
    #[error("cannot grow data disk {disk:?} to {size_gib} GiB: {source}")]
    Grow {
        /// The disk's name.
        disk: String,
        /// The size asked for.
        size_gib: u64,
        /// Why.
        #[source]
        source: DiskError,
    },
    /// A disk to keep cannot be: a kept disk of that name is already there.
    #[error("cannot keep data disk {disk:?}: {} already holds a kept disk; purge it first", .to.display())]
    KeptTaken {
        /// The disk's name.
        disk: String,
        /// The kept disk's path.
        to: PathBuf,
    },
    /// The kept disks' directory cannot be read.
    #[error("cannot read {}: {source}", .dir.display())]
    ReadKept {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A purge stopped at a file it could not delete, after deleting others.
    #[error("{source} (deleted before: {deleted:?})")]
    Purge {
        /// The failure.
        #[source]
        source: Box<DataDiskError>,
        /// What was deleted before it.
        deleted: Vec<PathBuf>,
    },
}

impl DataDiskError {
    /// The QEMU error under it, if any.
    pub fn disk_error(&self) -> Option<&DiskError> {
        match self {
            DataDiskError::GrowTakenBack { source, .. }
            | DataDiskError::Create { source, .. }
            | DataDiskError::Grow { source, .. } => Some(source),
            DataDiskError::Purge { source, .. } => source.disk_error(),
            _ => None,
        }
    }
}

/// Makes the data disk `spec` at `path`, which must not exist.
///
/// # Errors
/// [`DiskError::Exists`] if `path` exists (it is kept); [`DiskError::Io`] when the file cannot
/// be made, sized or preallocated (e.g. the file system is full or has no `fallocate`);
/// QEMU's errors for a qcow2 disk. On any error the new file is gone again.
pub async fn create(tool: &Tool, path: &Path, spec: &DataDiskSpec) -> Result<(), DiskError> {
    let file = match OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Err(DiskError::Exists(path.to_path_buf())),
        Err(source) => return Err(DiskError::Io { path: path.to_path_buf(), source }),
    };
    let mut guard = super::RemoveOnDrop { path, armed: true };
    let bytes = bytes_of(spec)?;
    match spec.format {
        DiskFormat::Raw => size_raw(file, path, 0, bytes, spec.preallocate).await?,
        DiskFormat::Qcow2 => {
            let preallocate = spec.preallocate;
            bounded("create", async {
                let mut session = Session::start(tool, vec![Input::Image(OwnedFd::from(file))], "create").await?;
                session.create_qcow2(0, bytes, None, preallocate).await?;
                session.finish().await
            })
            .await?
        }
    }
    guard.armed = false;
    Ok(())
}

/// Grows the data disk `spec` at `path` of a stopped VM to `spec.size_gib`; returns whether it
/// grew (a disk already that large, or larger, is left as it is: never shrunk).
///
/// # Errors
/// [`DiskError::Io`] when the file cannot be opened, sized or preallocated; QEMU's errors for a
/// qcow2 disk.
pub async fn grow(tool: &Tool, path: &Path, spec: &DataDiskSpec) -> Result<bool, DiskError> {
    let bytes = bytes_of(spec)?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| DiskError::Io { path: path.to_path_buf(), source })?;
    match spec.format {
        DiskFormat::Raw => {
            let now = file.metadata().map_err(|source| DiskError::Io { path: path.to_path_buf(), source })?.len();
            if now >= bytes {
                return Ok(false);
            }
            size_raw(file, path, now, bytes, spec.preallocate).await?;
            Ok(true)
        }
        DiskFormat::Qcow2 => super::grow_qcow2(tool, file, bytes).await,
    }
}

/// Reserves the blocks of a raw disk from `from` to its end (after QEMU grew a running VM's
/// disk; `fallocate` without changing the length or the contents, which read as zeros).
///
/// # Errors
/// [`DiskError::Io`] when the file cannot be opened or the space reserved.
pub async fn preallocate_tail(path: &Path, from: u64) -> Result<(), DiskError> {
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|source| DiskError::Io { path: path.to_path_buf(), source })?;
    let len = file.metadata().map_err(|source| DiskError::Io { path: path.to_path_buf(), source })?.len();
    if len > from {
        reserve(file, path, from, len).await?;
    }
    Ok(())
}

/// The disk's size in bytes.
fn bytes_of(spec: &DataDiskSpec) -> Result<u64, DiskError> {
    spec.size_gib
        .checked_mul(GIB)
        .ok_or_else(|| DiskError::Output(format!("{} GiB does not fit in 64 bits of bytes", spec.size_gib)))
}

/// Sets a raw file's length to `to` (from `from`), reserving the blocks in between with
/// `preallocate`.
async fn size_raw(file: File, path: &Path, from: u64, to: u64, preallocate: bool) -> Result<(), DiskError> {
    file.set_len(to).map_err(|source| DiskError::Io { path: path.to_path_buf(), source })?;
    if preallocate {
        reserve(file, path, from, to).await?;
    }
    Ok(())
}

/// `fallocate(from..to)` off the runtime's threads (a large disk takes a while).
async fn reserve(file: File, path: &Path, from: u64, to: u64) -> Result<(), DiskError> {
    let io_error = |source| DiskError::Io { path: path.to_path_buf(), source };
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(from), libc::off_t::try_from(to.saturating_sub(from))) else {
        return Err(io_error(io::Error::from(io::ErrorKind::InvalidInput)));
    };
    let done = tokio::task::spawn_blocking(move || {
        nix::fcntl::fallocate(&file, nix::fcntl::FallocateFlags::empty(), offset, len).map_err(io::Error::from)
    })
    .await
    .map_err(|e| io_error(io::Error::other(e)))?;
    done.map_err(io_error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{DiskCache, DiskFormat};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn tool() -> Tool {
        let root = nix::unistd::Uid::effective().is_root();
        Tool {
            binary: "/usr/bin/qemu-system-x86_64".into(),
            user: root.then_some(crate::config::UserIds { uid: 65534, gid: 65534 }),
            pin: None,
        }
    }

    fn disk(name: &str, size_gib: u64, format: DiskFormat, preallocate: bool) -> DataDiskSpec {
        DataDiskSpec {
            name: name.into(),
            size_gib,
            format,
            preallocate,
            cache: DiskCache::None,
            aio: None,
            keep_on_destroy: false,
            snapshot: true,
        }
    }

    fn private_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        dir
    }

    /// `qemu-img info --output=json` of `path`, independently of the module.
    fn info(path: &Path) -> serde_json::Value {
        let out =
            std::process::Command::new("/usr/bin/qemu-img").args(["info", "--output=json"]).arg(path).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    #[tokio::test]
    async fn raw_disks_are_sparse_or_preallocated_and_grow() {
        let dir = private_dir();
        let sparse = dir.path().join("a.raw");
        create(&tool(), &sparse, &disk("a", 1, DiskFormat::Raw, false)).await.unwrap();
        let m = std::fs::metadata(&sparse).unwrap();
        assert_eq!((m.len(), m.mode() & 0o777), (GIB, 0o600));
        assert!(m.blocks() * 512 < GIB / 16, "sparse: {} blocks", m.blocks());

        let full = dir.path().join("b.raw");
        create(&tool(), &full, &disk("b", 1, DiskFormat::Raw, true)).await.unwrap();
        let m = std::fs::metadata(&full).unwrap();
        assert!(m.blocks() * 512 >= GIB, "preallocated: {} blocks", m.blocks());

        assert!(grow(&tool(), &full, &disk("b", 2, DiskFormat::Raw, true)).await.unwrap());
        let m = std::fs::metadata(&full).unwrap();
        assert_eq!(m.len(), 2 * GIB);
        assert!(m.blocks() * 512 >= 2 * GIB, "the grown part is preallocated too: {} blocks", m.blocks());
        assert!(!grow(&tool(), &full, &disk("b", 1, DiskFormat::Raw, true)).await.unwrap(), "never shrunk");
        assert_eq!(std::fs::metadata(&full).unwrap().len(), 2 * GIB);
    }

    #[tokio::test]
    async fn qcow2_disks_are_made_by_qemu_and_grow() {
        let dir = private_dir();
        let path = dir.path().join("nsm.qcow2");
        create(&tool(), &path, &disk("nsm", 2, DiskFormat::Qcow2, false)).await.unwrap();
        let i = info(&path);
        assert_eq!((i["format"].as_str(), i["virtual-size"].as_u64()), (Some("qcow2"), Some(2 * GIB)));
        assert!(i.get("backing-filename").is_none(), "{i}");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        assert!(grow(&tool(), &path, &disk("nsm", 3, DiskFormat::Qcow2, false)).await.unwrap());
        assert_eq!(info(&path)["virtual-size"].as_u64(), Some(3 * GIB));

        let full = dir.path().join("full.qcow2");
        create(&tool(), &full, &disk("full", 1, DiskFormat::Qcow2, true)).await.unwrap();
        assert!(std::fs::metadata(&full).unwrap().blocks() * 512 >= GIB, "preallocated qcow2");
    }

    #[tokio::test]
    async fn an_existing_file_is_never_overwritten_and_a_failure_leaves_nothing() {
        let dir = private_dir();
        let path = dir.path().join("x.raw");
        std::fs::write(&path, b"precious").unwrap();
        match create(&tool(), &path, &disk("x", 1, DiskFormat::Raw, false)).await {
            Err(DiskError::Exists(p)) => assert_eq!(p, path),
            other => panic!("expected Exists, got {other:?}"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"precious");
        // Beyond what qcow2 allows: QEMU refuses, and the new file goes again.
        let huge = dir.path().join("huge.qcow2");
        let err = create(&tool(), &huge, &disk("huge", u64::MAX / GIB, DiskFormat::Qcow2, false)).await.unwrap_err();
        assert!(matches!(err, DiskError::Tool { .. }), "{err:?}");
        assert!(!huge.exists());
    }
}
