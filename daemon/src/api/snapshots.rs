//! `vm.snapshot`, `vm.snapshots`, `vm.revert`, `vm.snapshot_delete`'s wire types
//! (docs/snapshots.md).

use super::disks::{BackupDisk, DiskRole};
use super::VmSpec;
use serde::{Deserialize, Serialize};

pub use vmhost_agent_protocol::FreezeSkip;

/// Params of `vm.revert` and `vm.snapshot_delete`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotParams {
    /// The VM.
    pub name: String,
    /// The snapshot: 1-64 of `A-Z a-z 0-9 . _ -`, not starting with a dot.
    pub snapshot: String,
    /// Longest the work on the disks may take, in seconds (1-86400, default 3600): a revert's
    /// copies and offline session, a delete's offline session.
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

/// Params of `vm.snapshot`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TakeSnapshotParams {
    /// The VM.
    pub name: String,
    /// The snapshot: 1-64 of `A-Z a-z 0-9 . _ -`, not starting with a dot.
    pub snapshot: String,
    /// Longest the copy may take, in seconds (default 3600).
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// `frozen`: fail (4094) rather than take a running VM's snapshot crash-consistent.
    #[serde(default)]
    pub requires: Option<Requirement>,
}

/// What a copy of a VM's disks (`vm.snapshot`, `vm.export`) must be: with `frozen`, a copy that
/// would be `crash` (a running VM's whose guest file systems cannot all be frozen for the
/// instant it starts, a stopped VM's whose disks were not left by a clean power-off) is refused
/// (4094) and nothing is kept. A cleanly stopped VM's copy meets it (nothing writes its disks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Requirement {
    /// Every writable file system of the guest frozen for the instant the copy starts.
    Frozen,
}

/// How consistent a copy of a VM's disks is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Consistency {
    /// A running VM's, with every writable file system on a block device of the guest frozen by
    /// its agent for the instant the copy started: what a clean unmount would leave.
    Frozen,
    /// A running VM's without that, or a stopped VM's whose disks were not left by a clean
    /// power-off (its QEMU killed or crashed; `reason` says why): what a power cut would leave;
    /// the guest's file systems replay their journals (or need a check) when it boots from it.
    Crash,
    /// A stopped VM's whose disks were left by a clean power-off (or never written by a guest),
    /// nothing writing them meanwhile.
    Stopped,
}

impl Consistency {
    /// The wire word (`frozen`, `crash`, `stopped`).
    pub fn as_str(self) -> &'static str {
        match self {
            Consistency::Frozen => "frozen",
            Consistency::Crash => "crash",
            Consistency::Stopped => "stopped",
        }
    }
}

/// What a copy of a VM's disks is, as `vm.snapshot`, `vm.export` and their records say it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyConsistency {
    /// Frozen, crash or stopped.
    pub consistency: Consistency,
    /// Why a `crash` copy is one.
    pub reason: Option<String>,
    /// The mount points the guest's agent froze.
    pub frozen: Vec<String>,
    /// The writable file systems on block devices it could not freeze.
    pub skipped: Vec<FreezeSkip>,
}

impl CopyConsistency {
    /// A cleanly stopped VM's copy.
    pub fn stopped() -> CopyConsistency {
        CopyConsistency { consistency: Consistency::Stopped, reason: None, frozen: Vec::new(), skipped: Vec::new() }
    }

    /// A crash-consistent copy, `reason` why; nothing frozen or skipped.
    pub fn crash(reason: String) -> CopyConsistency {
        CopyConsistency {
            consistency: Consistency::Crash,
            reason: Some(reason),
            frozen: Vec::new(),
            skipped: Vec::new(),
        }
    }

    /// True when it meets `requires` (none, or `frozen` with a frozen or stopped copy: not
    /// crash).
    pub fn meets(&self, requires: Option<Requirement>) -> bool {
        match requires {
            None => true,
            Some(Requirement::Frozen) => self.consistency != Consistency::Crash,
        }
    }
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
    /// `frozen`, `crash` or `stopped` ([`Consistency`]); absent in snapshots taken before
    /// vmhostd recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency: Option<Consistency>,
    /// With `crash`: why (no agent session, its freeze failed, a file system it skipped, the
    /// copies started after the freeze timed out, a stopped VM's QEMU killed or crashed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The guest's file systems its agent froze for that instant (empty: not frozen).
    #[serde(default)]
    pub frozen: Vec<String>,
    /// Writable file systems on block devices the guest's agent could not freeze.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<FreezeSkip>,
    /// The VM's cloud-init instance id then (the one its root disk's guest booted with): a
    /// revert puts it back with the disks. Absent in snapshots taken before vmhostd recorded it
    /// (a revert to one keeps the VM's current id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// The VM's spec then: a revert needs the same disks.
    pub spec: VmSpec,
    /// The disks kept as copies (kind `copy`): `root` (an image VM's overlay, whose header names
    /// the same base image, or a `boot.disk` VM's root disk) and the data disks. Before vmhostd
    /// kept qcow2 disks' snapshots inside their files every disk was here; now only raw ones.
    pub disks: Vec<BackupDisk>,
    /// The snapshot's random id (8 hex digits): its tags are `vmhost-NAME-ID`, so a tag a crash
    /// left is never taken for a later snapshot of the same name. Absent in older snapshots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The disks kept inside their own qcow2 files (kind `internal`): an internal snapshot,
    /// taken in constant time, its blocks shared with the disk until the guest overwrites them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub internal: Vec<InternalDisk>,
    /// Data disks with `snapshot: false`: neither kept nor put back by a revert.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded: Vec<String>,
    /// A UEFI VM's variables store (boot entries, Secure Boot keys): a copy, put back by a revert.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uefi_vars: Option<VarsCopy>,
    /// A `tpm: true` VM's TPM state (swtpm's files): copies, put back by a revert. Absent in
    /// snapshots of VMs without TPM state and in those taken before vmhostd kept it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<TpmCopy>,
}

/// The copy of a VM's TPM state in a snapshot or a backup: swtpm's state files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TpmCopy {
    /// Each state file the TPM had ([`crate::tpm::STATE_FILE_NAMES`]).
    pub files: Vec<TpmFile>,
}

/// One TPM state file's copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TpmFile {
    /// swtpm's name for it (`tpm2-00.permall`, ...).
    pub name: String,
    /// The copy in the snapshot's or backup's directory (`tpm-NAME`).
    pub file: String,
    /// Its length in bytes.
    pub bytes: u64,
    /// Its sha256, lower-case hex.
    pub sha256: String,
}

/// How a snapshot keeps a disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    /// A qcow2 internal snapshot inside the disk's own file.
    Internal,
    /// A whole copy of the disk's file in the snapshot's directory (raw disks: no internal
    /// snapshots).
    Copy,
}

/// One disk of a snapshot kept inside its own qcow2 file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InternalDisk {
    /// Root or data.
    pub role: DiskRole,
    /// `root`, or the data disk's name.
    pub name: String,
    /// Always `internal` (the copies are [`Snapshot::disks`]).
    pub kind: SnapshotKind,
    /// The internal snapshot's tag in the disk's file: `vmhost-NAME-ID`.
    pub tag: String,
}

/// The copy of a UEFI VM's variables store in a snapshot or a backup (`uefi-vars.fd`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VarsCopy {
    /// The file in the snapshot's directory (`uefi-vars.fd`).
    pub file: String,
    /// Its length in bytes.
    pub bytes: u64,
    /// Its sha256, lower-case hex.
    pub sha256: String,
}

impl Snapshot {
    /// Every tag the snapshot's disks hold.
    pub fn tags(&self) -> Vec<&str> {
        self.internal.iter().map(|d| d.tag.as_str()).collect()
    }
}

/// Result of `vm.snapshot_delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotDeleted {
    /// False when there was no such snapshot.
    pub changed: bool,
    /// The snapshot's name.
    pub snapshot: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requires_takes_only_frozen_and_a_stopped_copy_meets_it() {
        let p: TakeSnapshotParams =
            serde_json::from_value(json!({"name": "a", "snapshot": "s", "requires": "frozen"})).expect("parses");
        assert_eq!(p.requires, Some(Requirement::Frozen));
        assert!(serde_json::from_value::<TakeSnapshotParams>(
            json!({"name": "a", "snapshot": "s", "requires": "crash"})
        )
        .is_err());
        assert!(
            serde_json::from_value::<SnapshotParams>(json!({"name": "a", "snapshot": "s", "requires": "frozen"}))
                .is_err(),
            "vm.revert and vm.snapshot_delete take no requires"
        );
        let crash = CopyConsistency { consistency: Consistency::Crash, ..CopyConsistency::stopped() };
        assert!(CopyConsistency::stopped().meets(Some(Requirement::Frozen)));
        assert!(!crash.meets(Some(Requirement::Frozen)));
        assert!(crash.meets(None));
        for c in [Consistency::Frozen, Consistency::Crash, Consistency::Stopped] {
            assert_eq!(serde_json::to_value(c).expect("serializes"), c.as_str());
        }
    }
}
