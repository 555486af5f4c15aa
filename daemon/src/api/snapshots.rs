//! `vm.snapshot`, `vm.snapshots`, `vm.revert`, `vm.snapshot_delete`'s wire types
//! (docs/snapshots.md).

use super::backup::BackupDisk;
use super::VmSpec;
use serde::{Deserialize, Serialize};

/// Params of `vm.snapshot`, `vm.revert` and `vm.snapshot_delete`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotParams {
    /// The VM.
    pub name: String,
    /// The snapshot: 1-64 of `A-Z a-z 0-9 . _ -`, not starting with a dot.
    pub snapshot: String,
    /// Longest the copy may take, in seconds (`vm.snapshot`, `vm.revert`; default 3600).
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

/// One snapshot of a VM, as `vm.snapshots` lists it and `STATE/snapshots/VM/NAME/snapshot.json`
/// keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// Its name.
    pub name: String,
    /// When it was taken, RFC 3339 UTC.
    pub created_at: String,
    /// Taken while the guest ran (every disk as at one instant).
    pub live: bool,
    /// The guest's file systems its agent froze for that instant (empty: crash-consistent).
    #[serde(default)]
    pub frozen: Vec<String>,
    /// The VM's spec then: a revert needs the same disks.
    pub spec: VmSpec,
    /// Each disk's copy: `root` (an image VM's overlay, whose header names the same base image,
    /// or a `boot.disk` VM's root disk) and the data disks.
    pub disks: Vec<BackupDisk>,
}

/// Result of `vm.snapshot_delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotDeleted {
    /// False when there was no such snapshot.
    pub changed: bool,
    /// The snapshot's name.
    pub snapshot: String,
}
