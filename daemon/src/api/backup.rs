//! `vm.export` and `vm.import`'s wire types (docs/backup.md).

pub use super::disks::{BackupDisk, DiskRole};
use super::snapshots::{Consistency, FreezeSkip, Requirement};
use super::{DesiredState, VmSpec};
use serde::{Deserialize, Serialize};

/// Params of `vm.export`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportParams {
    /// The VM.
    pub name: String,
    /// Longest the copy may take, in seconds (default 3600).
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// `frozen`: fail (4094) rather than copy a running VM crash-consistent.
    #[serde(default)]
    pub requires: Option<Requirement>,
    /// Copy only what changed since the parent backup, per disk, where the disk still tracks
    /// its changes since then (a dirty bitmap); every other disk is copied whole, with why.
    #[serde(default)]
    pub incremental: bool,
    /// The parent of an incremental backup: a backup directory name of this VM (default: its
    /// newest backup in `paths.backups`).
    #[serde(default)]
    pub since: Option<String>,
    /// Keep only the VM's newest `keep` backups once this one is made (at least 1); an
    /// increment whose parent would go is merged into a new full backup first.
    #[serde(default)]
    pub keep: Option<u32>,
}

/// Params of `vm.backups_prune`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PruneParams {
    /// The VM whose backups (by the manifest's `vm`) are pruned.
    pub name: String,
    /// How many of its newest backups stay (at least 1).
    pub keep: u32,
}

/// Result of `vm.backups_prune`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PruneResult {
    /// The backup directories removed, oldest first.
    pub removed: Vec<String>,
    /// The increments merged into a new full backup (old directory name, new one).
    pub merged: Vec<(String, String)>,
    /// The VM's backups left, oldest first.
    pub kept: Vec<String>,
}

/// Whether a backup (or one disk of it) holds everything or only what changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackupKind {
    /// Everything the guest reads.
    Full,
    /// Only the clusters written since the parent backup (a qcow2 with no backing file).
    Incremental,
}

/// The backup an incremental backup builds on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParentRef {
    /// Its directory name in `paths.backups`.
    pub dir: String,
    /// Its `id`.
    pub id: String,
    /// The sha256 of its `manifest.json`, as written.
    pub manifest_sha256: String,
}

/// How one disk of a version 2 backup was copied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskChange {
    /// The disk (`root` or a data disk's name).
    pub name: String,
    /// `full`, or `incremental` over the same disk in the parent backup.
    pub kind: BackupKind,
    /// Why a disk of an incremental backup was copied whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_reason: Option<String>,
}

/// A UEFI VM's variables store in a backup: the same record as in a snapshot.
pub use super::snapshots::VarsCopy;

/// Params of `vm.import`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportVmParams {
    /// The backup: a directory name in `paths.backups` (what `vm.export` returned).
    pub backup: String,
    /// The new VM's name (default: the exported VM's).
    #[serde(default)]
    pub name: Option<String>,
    /// Its desired state (default: the exported spec's).
    #[serde(default)]
    pub state: Option<DesiredState>,
}

/// `manifest.json` of a backup.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always `vmhost-backup`.
    pub format: String,
    /// Layout version: 2 (1: written before incremental backups, still imported).
    pub version: u32,
    /// Version 2: the backup's id (16 hex digits), also the name of the dirty bitmap
    /// (`vmhost-backup-ID`) its disks carry until the next backup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Version 2: `full` (no disk needs another backup) or `incremental`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<BackupKind>,
    /// Version 2, incremental: the backup it builds on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRef>,
    /// Version 2, a full backup made by merging an increment with the backups below it
    /// (retention): the sha256 of that increment's `manifest.json`, which backups building on
    /// it recorded as their parent's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_from: Option<String>,
    /// When it was written, RFC 3339 UTC.
    pub created_at: String,
    /// The vmhostd that wrote it.
    pub vmhost_version: String,
    /// The VM's name.
    pub vm: String,
    /// The VM's spec as recorded.
    pub spec: VmSpec,
    /// Copied while the guest ran (every disk as at one instant).
    pub live: bool,
    /// `frozen`, `crash` or `stopped` ([`Consistency`]); absent in backups written before
    /// vmhostd recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency: Option<Consistency>,
    /// With `crash`: why (no agent session, its freeze failed, a file system it skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The guest's file systems its agent froze for that instant (empty: not frozen).
    #[serde(default)]
    pub frozen: Vec<String>,
    /// Writable file systems on block devices the guest's agent could not freeze.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<FreezeSkip>,
    /// The disks, root first then data disks in spec order.
    pub disks: Vec<BackupDisk>,
    /// Version 2: how each disk of `disks` was copied, in the same order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<DiskChange>,
    /// A UEFI VM's variables store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uefi_vars: Option<VarsCopy>,
    /// A `tpm: true` VM's TPM state (swtpm's files, `tpm-NAME`), put back by an import before
    /// the VM first starts. Absent for VMs without TPM state and in older backups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<crate::api::snapshots::TpmCopy>,
}

/// Result of `vm.export`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportResult {
    /// The backup's directory name in `paths.backups`: what `vm.import` takes.
    pub backup: String,
    /// Its path.
    pub path: std::path::PathBuf,
    /// What it holds.
    pub manifest: Manifest,
}
