//! The lifecycle's own errors: its file work, and an owner's error with the context of the
//! step that called the owner (which disk, which file, which step).
//!
//! The lifecycle steps return [`crate::api::ApiError`]; where a step calls an owner (the disk
//! tool, the QMP client, the launcher) or does file work of its own, it wraps what failed in one
//! of these types, keeping the owner's error as `#[source]`, and `?` converts it at the one
//! boundary, [`crate::owner_errors`], which alone decides the API code, field and `details`.
//! The texts here are the messages clients read, unchanged.
//!
//! [`FileError`] is the lifecycle's own `std::io` work (root disk import, snapshots, copies,
//! backups); [`DiskStepError`] a QEMU-without-a-guest step ([`crate::disk`]), whose pin refusal
//! stays 4002; [`QemuStepError`] the running QEMU's (its launch, QMP, its process);
//! [`LaunchFileError`] the files a launch needs; [`IntentRefused`] a record that would not begin an operation's intent.

use crate::disk::export::LiveError;
use crate::disk::DiskError;
use crate::qemu::hotplug::HotplugError;
use crate::qemu::launch::LaunchError;
use crate::qemu::qmp::QmpError;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A file operation of the lifecycle's own that failed, in the API step it belongs to (4001).
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// An operation on the named file (`cannot stat PATH`, `cannot create a copy in DIR`).
    #[error("cannot {action} {}: {source}", .path.display())]
    File {
        /// The API step (`details.step`).
        step: String,
        /// What was done, as the message says it.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An operation on no one named file (a descriptor, a copy being written).
    #[error("cannot {action}: {source}")]
    Unnamed {
        /// The API step.
        step: String,
        /// What was done.
        action: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A moved-in root disk could not be made private (mode 0600).
    #[error("cannot make {} private: {source}", .path.display())]
    MakePrivate {
        /// The API step.
        step: String,
        /// The disk.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A disk offered for import could not be renamed into the VM's directory.
    #[error("cannot move {} to {}: {}", .from.display(), .to.display(), not_moved(.source, .to))]
    Move {
        /// The API step.
        step: String,
        /// The disk in the import directory.
        from: PathBuf,
        /// Where it was to go.
        to: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An imported disk could not be given back to the import directory.
    #[error("cannot move {} back to {}: {source}", .from.display(), .to.display())]
    MoveBack {
        /// The API step.
        step: String,
        /// The VM's root disk.
        from: PathBuf,
        /// Its name in the import directory.
        to: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A checked copy could not be renamed over a disk (a revert).
    #[error("cannot put {} back: {source}", .path.display())]
    PutBack {
        /// The API step.
        step: String,
        /// The disk.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A disk could not be copied out of a backup or snapshot (`place`: `in the backup`).
    #[error("cannot copy {file} {place}: {source}")]
    CopyOut {
        /// The API step.
        step: String,
        /// The disk's file name there.
        file: String,
        /// Where it is, as the message says it.
        place: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A disk copied out of a backup could not be placed where the VM's disk goes.
    #[error("cannot place {file} from the backup: {source}")]
    PlaceOut {
        /// The API step.
        step: String,
        /// The disk's file name in the backup.
        file: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A disk copied out of a backup could not be read to inspect it.
    #[error("cannot inspect {file} from the backup: {source}")]
    InspectOut {
        /// The API step.
        step: String,
        /// The disk's file name in the backup.
        file: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// What a file was to hold (a snapshot's description) could not be encoded.
    #[error("{source}")]
    Encode {
        /// The API step.
        step: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The file offered for a `boot.disk` import cannot be opened (2001 on `spec.boot.disk`).
    #[error("cannot open {}: {source}", .path.display())]
    OpenImport {
        /// `paths.import/FILE`.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// A file a launch needs, or its UEFI variables store, that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LaunchFileError {
    /// The kernel or initrd the spec names cannot be opened by the spawner (2001 on `field`).
    #[error("{}", boot_file(.path, .source))]
    BootFile {
        /// `spec.boot.kernel` or `spec.boot.initrd`.
        field: &'static str,
        /// The file the spec names.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A UEFI VM's firmware files are missing or unreadable (2001 on `spec.boot.firmware`).
    #[error("boot.firmware uefi: {0}")]
    Firmware(#[source] crate::qemu::firmware::FirmwareError),
    /// A file QEMU is handed as a descriptor cannot be opened (4001 step `qemu_files`).
    #[error("cannot open {} for QEMU: {source}", .path.display())]
    OpenForQemu {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The host's UEFI variables template cannot be copied to the VM's store (4001 step
    /// `firmware`).
    #[error("cannot copy the UEFI variables store {} to {}: {source}", .from.display(), .to.display())]
    CopyVars {
        /// `firmware.uefi_vars`.
        from: PathBuf,
        /// The VM's store.
        to: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The VM's UEFI variables store cannot be removed (4001, no step).
    #[error("cannot remove the UEFI variables store {}: {source}", .path.display())]
    RemoveVars {
        /// The store.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Why a boot file cannot be used, in the words a user acts on.
fn boot_file(path: &Path, e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => format!("{} does not exist", path.display()),
        io::ErrorKind::PermissionDenied => format!("vmhostd cannot read {}: {e}", path.display()),
        _ => format!("cannot use {}: {e}", path.display()),
    }
}

/// A VM's record refused the intent an operation asked it to begin (an unfinished revert):
/// a bug, since every operation that makes disks refuses such a VM first (5000).
#[derive(Debug, thiserror::Error)]
#[error("VM {vm:?}: {source}")]
pub struct IntentRefused {
    /// The VM.
    pub vm: String,
    /// What the record said.
    #[source]
    pub source: crate::state::IntentError,
}

/// Why an import's rename failed, in the words a user acts on.
fn not_moved(e: &io::Error, to: &Path) -> String {
    match e.raw_os_error() {
        Some(libc::EXDEV) => "it is on another file system (a disk is renamed, never copied)".to_string(),
        Some(libc::EEXIST) => format!("{} exists", to.display()),
        _ => e.to_string(),
    }
}

impl FileError {
    /// The API step the failed operation belongs to (`None`: a refused import, no step).
    pub fn step(&self) -> Option<&str> {
        match self {
            FileError::File { step, .. }
            | FileError::Unnamed { step, .. }
            | FileError::MakePrivate { step, .. }
            | FileError::Move { step, .. }
            | FileError::MoveBack { step, .. }
            | FileError::PutBack { step, .. }
            | FileError::CopyOut { step, .. }
            | FileError::PlaceOut { step, .. }
            | FileError::InspectOut { step, .. }
            | FileError::Encode { step, .. } => Some(step),
            FileError::OpenImport { .. } => None,
        }
    }

    /// `cannot ACTION PATH` in `step`.
    pub fn file(step: &str, action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> FileError {
        let (step, path) = (step.to_string(), path.to_path_buf());
        move |source| FileError::File { step, action, path, source }
    }

    /// `cannot ACTION` in `step`.
    pub fn unnamed(step: &str, action: &'static str) -> impl FnOnce(io::Error) -> FileError {
        let step = step.to_string();
        move |source| FileError::Unnamed { step, action, source }
    }
}

/// A step done by QEMU without a guest ([`crate::disk`]) that failed, with what it worked on.
/// Each maps a [`DiskError::Pinned`] to 4002 as it is.
#[derive(Debug, thiserror::Error)]
pub enum DiskStepError {
    /// QEMU could not inspect the disk offered for import (2001 on `spec.boot.disk` when it
    /// refused the file, else 4001 `root_disk`).
    #[error("{}", inspect_import(.path, .source))]
    InspectImport {
        /// `paths.import/FILE`.
        path: PathBuf,
        /// Why.
        #[source]
        source: DiskError,
    },
    /// The imported root disk could not be grown to `disk_gib` (4001 `root_disk`, stderr).
    #[error("cannot grow the imported disk to {gib} GiB: {source}")]
    GrowImport {
        /// The size asked for.
        gib: u64,
        /// Why.
        #[source]
        source: DiskError,
    },
    /// QEMU could not inspect a disk copied out of a backup (2003 on `backup` when it refused
    /// the file, else 4001 `import`).
    #[error("{}", inspect_copy(.file, .source))]
    InspectCopy {
        /// The disk's file name in the backup.
        file: String,
        /// Why.
        #[source]
        source: DiskError,
    },
    /// QEMU could not read a stopped VM's disk to export it.
    #[error("cannot read {}: {source}", .path.display())]
    ReadDisk {
        /// The API step.
        step: String,
        /// The disk.
        path: PathBuf,
        /// Why.
        #[source]
        source: DiskError,
    },
    /// QEMU could not copy a stopped VM's disks (4001 `export`, stderr).
    #[error("cannot copy the disks: {source}")]
    Flatten {
        /// Why.
        #[source]
        source: DiskError,
    },
    /// QEMU could not read the format of the base image under a VM's overlay.
    #[error("cannot read the base image {}: {source}", .path.display())]
    BaseImage {
        /// The API step.
        step: String,
        /// The base image.
        path: PathBuf,
        /// Why.
        #[source]
        source: DiskError,
    },
    /// QEMU could not make the qcow2 targets of a running VM's copy.
    #[error("cannot make the copies: {source}")]
    MakeCopies {
        /// The API step.
        step: String,
        /// Why.
        #[source]
        source: DiskError,
    },
}

fn inspect_import(path: &Path, e: &DiskError) -> String {
    if e.file_refused() {
        format!("QEMU cannot read {} as a disk image: {e}", path.display())
    } else {
        format!("cannot inspect {}: {e}", path.display())
    }
}

fn inspect_copy(file: &str, e: &DiskError) -> String {
    if e.file_refused() {
        format!("{file} in the backup: QEMU cannot read it as a disk image: {e}; nothing was imported")
    } else {
        format!("cannot inspect {file} from the backup: {e}")
    }
}

impl DiskStepError {
    /// The disk tool's error inside.
    pub fn disk_error(&self) -> &DiskError {
        match self {
            DiskStepError::InspectImport { source, .. }
            | DiskStepError::GrowImport { source, .. }
            | DiskStepError::InspectCopy { source, .. }
            | DiskStepError::ReadDisk { source, .. }
            | DiskStepError::Flatten { source }
            | DiskStepError::BaseImage { source, .. }
            | DiskStepError::MakeCopies { source, .. } => source,
        }
    }
}

/// What a live data-disk step ([`super::hotplug`]) failed on.
#[derive(Debug, thiserror::Error)]
pub enum LiveDiskCause {
    /// QMP (the connection, or a command QEMU refused).
    #[error(transparent)]
    Qmp(#[from] QmpError),
    /// A hot-plug step.
    #[error(transparent)]
    Hotplug(#[from] HotplugError),
    /// The disk file (opening it, preallocating what it grew by).
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// Opening the disk file for QEMU.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// A step on the VM's running QEMU (or its start) that failed (4001).
#[derive(Debug, thiserror::Error)]
pub enum QemuStepError {
    /// QEMU did not start (`qemu`, with its log's tail).
    #[error("QEMU failed to start: {0}")]
    Start(#[source] LaunchError),
    /// QEMU started but QMP does not answer its status (`qemu_verify`).
    #[error("QEMU started but is not running: QMP check failed: {0}")]
    VerifyQmp(#[source] QmpError),
    /// QEMU started but reports another status than `running` (`qemu_verify`).
    #[error("QEMU started but is not running: QEMU reports status {0:?}")]
    VerifyStatus(String),
    /// QEMU may still run after SIGKILL (`kill`): its exit could not be watched (`source`) or
    /// did not come within `after`.
    #[error("QEMU (pid {pid}) may still run: {}", match .source {
        Some(e) => format!("cannot watch it exit: {e}"),
        None => format!("it did not exit within {after:?} of SIGKILL"),
    })]
    MayStillRun {
        /// Its pid.
        pid: i32,
        /// Why its exit was not seen, when watching it failed.
        #[source]
        source: Option<io::Error>,
        /// How long it was waited for.
        after: Duration,
    },
    /// Whether the VM's QEMU runs could not be told (`process`).
    #[error("cannot tell whether the VM's QEMU still runs ({0}); nothing was changed")]
    Liveness(#[source] io::Error),
    /// A QMP exchange of a copy of the running VM (`what`: `QMP` for the connection, else the
    /// command).
    #[error("{what}: {source}")]
    Qmp {
        /// The API step.
        step: String,
        /// The exchange.
        what: &'static str,
        /// Why.
        #[source]
        source: QmpError,
    },
    /// The running VM's disks could not be copied (its block jobs).
    #[error("cannot copy the running VM's disks: {source}")]
    LiveCopy {
        /// The API step.
        step: String,
        /// Why.
        #[source]
        source: LiveError,
    },
    /// The running VM's disk could not be grown (`disk_grow`).
    #[error("cannot grow the disk to {gib} GiB while running: {source}")]
    GrowLive {
        /// The size asked for.
        gib: u64,
        /// Why.
        #[source]
        source: QmpError,
    },
    /// A live data-disk step (`data_disk`, `details.disk`: the disk, `*` for all).
    #[error("cannot {what} data disk {disk:?} while running: {source}")]
    LiveDisk {
        /// The disk.
        disk: String,
        /// The step, as the message says it (`hot-plug`, `grow`, `unplug`).
        what: &'static str,
        /// Why.
        #[source]
        source: LiveDiskCause,
    },
}
