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
}

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
    /// Layout version (1).
    pub version: u32,
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
