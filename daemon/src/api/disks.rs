//! A VM's data disks as the operator declares them (`spec.disks`), and what the API answers
//! about disks kept after a destroy.
//!
//! A data disk is a file vmhostd creates for the VM and owns (`STATE/disks/VM/NAME.FORMAT`),
//! attached after the boot disk in spec order, and found by the guest by its virtio serial,
//! which is the disk's name. The rules on the values are [`crate::validate`]'s; where the files
//! live is [`crate::qemu::argv::VmPaths`]'s; making and growing them is [`crate::disk::data`]'s.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Most data disks a VM may have.
pub const MAX_DATA_DISKS: usize = 16;

/// One data disk of a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataDiskSpec {
    /// 1-20 of `[a-z0-9-]`, unique in the VM: the file's name and the disk's virtio serial
    /// (`/dev/disk/by-id/virtio-NAME` in the guest).
    pub name: String,
    /// Size in GiB; grown when it grows, never shrunk.
    pub size_gib: u64,
    /// File format. Like every default, left out when echoed.
    #[serde(default, skip_serializing_if = "DiskFormat::is_default")]
    pub format: DiskFormat,
    /// Allocate every block at creation (and when grown), so the disk cannot run out of space
    /// later; otherwise the file is sparse.
    #[serde(default, skip_serializing_if = "is_false")]
    pub preallocate: bool,
    /// Host page cache use.
    #[serde(default, skip_serializing_if = "DiskCache::is_default")]
    pub cache: DiskCache,
    /// How QEMU submits I/O; default `native` with `cache: none`, else `threads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aio: Option<DiskAio>,
    /// A destroy keeps the disk (in `STATE/kept-disks/VM/`) instead of deleting it, and a later
    /// create of a VM of the same name with a disk of the same name and format takes it back.
    #[serde(default, skip_serializing_if = "is_false")]
    pub keep_on_destroy: bool,
    /// `false`: `vm.snapshot` leaves the disk out and `vm.revert` leaves it as it is (a disk of
    /// captured traffic that must outlive a revert of the system). Changeable in place; left out
    /// of views when true.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub snapshot: bool,
}

impl DataDiskSpec {
    /// The `aio` QEMU gets: the declared one, else `native` with `cache: none` (which opens the
    /// file `O_DIRECT`, what native AIO needs) and `threads` otherwise.
    pub fn effective_aio(&self) -> DiskAio {
        self.aio.unwrap_or(match self.cache {
            DiskCache::None => DiskAio::Native,
            DiskCache::Writeback => DiskAio::Threads,
        })
    }

    /// The disk's file name: `NAME.FORMAT`.
    pub fn file_name(&self) -> String {
        format!("{}.{}", self.name, self.format.as_str())
    }
}

fn is_false(b: &bool) -> bool {
    !b
}

fn is_true(b: &bool) -> bool {
    *b
}

fn yes() -> bool {
    true
}

/// A data disk's file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    /// qcow2, sparse unless preallocated.
    #[default]
    Qcow2,
    /// A plain file of the disk's size.
    Raw,
}

impl DiskFormat {
    fn is_default(&self) -> bool {
        *self == DiskFormat::default()
    }

    /// QEMU's name for it, also the file's extension.
    pub fn as_str(self) -> &'static str {
        match self {
            DiskFormat::Qcow2 => "qcow2",
            DiskFormat::Raw => "raw",
        }
    }
}

/// A data disk's use of the host page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskCache {
    /// `O_DIRECT`: the guest's own cache is the only one; writes are not lost in host RAM.
    #[default]
    None,
    /// Through the host page cache, flushed when the guest flushes.
    Writeback,
}

impl DiskCache {
    fn is_default(&self) -> bool {
        *self == DiskCache::default()
    }

    /// QEMU's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            DiskCache::None => "none",
            DiskCache::Writeback => "writeback",
        }
    }
}

/// How QEMU submits a data disk's I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskAio {
    /// Linux native AIO; needs `cache: none`.
    Native,
    /// A thread pool.
    Threads,
}

impl DiskAio {
    /// QEMU's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            DiskAio::Native => "native",
            DiskAio::Threads => "threads",
        }
    }
}

/// A data disk a destroy kept, as `host.info` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptDisk {
    /// The VM it belonged to (and will go back to if a VM of that name is created).
    pub vm: String,
    /// The disk's name.
    pub name: String,
    /// Its format.
    pub format: DiskFormat,
    /// Its file.
    pub path: PathBuf,
    /// The file's length in bytes (for qcow2 not the disk's size but what the file holds).
    pub file_bytes: u64,
}

/// Params of `host.purge_kept_disks`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PurgeKeptDisksParams {
    /// The VM whose kept disks are deleted.
    pub vm: String,
}

/// Result of `host.purge_kept_disks`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PurgeReport {
    /// The files deleted.
    pub deleted: Vec<PathBuf>,
}

/// Which disk of a VM a backup file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskRole {
    /// The boot disk (an image VM's overlay with its base flattened in, or a `boot.disk` VM's
    /// root disk), as `root.qcow2`.
    Root,
    /// A data disk, as `NAME.FORMAT`.
    Data,
}

/// One disk in a backup or a snapshot. Here, below both, since `vm.export`'s manifest
/// ([`super::backup`]) and a snapshot's entry ([`super::snapshots`]) share it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackupDisk {
    /// Root or data.
    pub role: DiskRole,
    /// `root`, or the data disk's name.
    pub name: String,
    /// The file in the backup directory.
    pub file: String,
    /// Its format.
    pub format: DiskFormat,
    /// Size of the disk the guest sees, in bytes.
    pub virtual_size: u64,
    /// Size of the file in bytes.
    pub bytes: u64,
    /// The file's sha256, lower-case hex.
    pub sha256: String,
}
