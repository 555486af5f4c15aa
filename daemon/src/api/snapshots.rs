//! `vm.snapshot`, `vm.snapshots`, `vm.revert`, `vm.snapshot_delete`'s wire types
//! (docs/snapshots.md).

use super::disks::BackupDisk;
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
    /// Longest the copy may take, in seconds (`vm.revert`; default 3600).
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
