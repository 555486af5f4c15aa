//! Params and results of moving a VM to another vmhostd (docs/moving.md): `vm.migrate_in` on the
//! destination, then `vm.migrate` on the source.
//!
//! The destination prepares first (the spec admitted there as a create would be, its NICs and
//! empty disks made, QEMU waiting for the incoming stream) and answers where to send and a
//! one-time secret; the source then sends. Any orchestrator (the Salt runner, `vmhostctl`, a
//! script) drives the two calls; the daemons talk to each other for everything after that.

use super::VmSpec;
use serde::{Deserialize, Serialize};

/// Params of `vm.migrate_in` (destination).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateInParams {
    /// The VM as the source runs it: its `vm.get` spec, with every NIC's `mac` set to the MAC
    /// the source gave it (the guest keeps its interfaces).
    pub spec: VmSpec,
    /// `live` (default): QEMU waits for a running guest's disks and memory. `cold`: only the
    /// spec and disk files arrive (`vm.move`); no QEMU is started for it.
    #[serde(default)]
    pub mode: MoveMode,
}

/// How a VM moves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveMode {
    /// A running guest: disks mirrored, then memory, then the switch-over.
    #[default]
    Live,
    /// A stopped VM: its spec and disk files streamed.
    Cold,
}

/// Result of `vm.migrate_in`: what the source's `vm.migrate` (or `vm.move`) needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateInResult {
    /// The VM's name.
    pub name: String,
    /// `HOST:PORT` of this vmhostd's migration port (`[migration] advertise`).
    pub address: String,
    /// The one-time secret (64 hex digits) that authenticates and keys every stream of this
    /// migration; it is good for this VM's one migration only.
    pub secret: String,
    /// Seconds the destination waits for the source to connect before it gives up and
    /// removes what it prepared.
    pub expires_in_s: u64,
}

/// Params of `vm.migrate` (source): a running VM sent to a prepared destination.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateParams {
    /// The VM.
    pub name: String,
    /// `vm.migrate_in`'s `address`.
    pub destination: String,
    /// `vm.migrate_in`'s `secret`.
    pub secret: String,
    /// Longest pause of the guest the switch-over may take, in milliseconds (QEMU's
    /// `downtime-limit`; default 300).
    #[serde(default)]
    pub max_downtime_ms: Option<u64>,
    /// Bandwidth cap of the memory stream, MiB/s (default: none).
    #[serde(default)]
    pub bandwidth_mib_s: Option<u64>,
    /// Longest the whole migration may take, seconds (default 3600); then it is cancelled and
    /// the guest keeps running here.
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

/// Params of `vm.move` (source): a stopped VM (or, with `stop`, a running one stopped first)
/// sent to a destination prepared with `vm.migrate_in` `mode: "cold"`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveParams {
    /// The VM.
    pub name: String,
    /// `vm.migrate_in`'s `address`.
    pub destination: String,
    /// `vm.migrate_in`'s `secret`.
    pub secret: String,
    /// Stop a running VM first, and start it on the destination after the move.
    #[serde(default)]
    pub stop: bool,
}

/// Result of `vm.migrate` and `vm.move`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateResult {
    /// The VM's name.
    pub name: String,
    /// Where it runs (or is kept) now.
    pub destination: String,
    /// How it moved.
    pub mode: MoveMode,
    /// Milliseconds from the call to the destination's confirmation.
    pub total_ms: u64,
    /// Milliseconds the guest was paused (QEMU's `downtime`; 0 for a cold move).
    pub downtime_ms: u64,
    /// Bytes of guest memory sent.
    pub ram_bytes: u64,
    /// Bytes of disk data sent.
    pub disk_bytes: u64,
}

/// What a migration has done so far: the payload of `migration` events and of a VM view's
/// `migration` while one runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationProgress {
    /// `preparing`, `disks`, `memory`, `switching`, `committing`, `done`, `failed`.
    pub phase: String,
    /// Disk bytes copied and to copy (all disks).
    pub disk_done: u64,
    /// Disk bytes in all.
    pub disk_total: u64,
    /// Memory bytes sent (QEMU's `ram.transferred`).
    pub ram_done: u64,
    /// Guest memory in bytes.
    pub ram_total: u64,
    /// Memory still dirty (QEMU's `ram.remaining`).
    pub ram_remaining: u64,
    /// QEMU's current `expected-downtime`, ms (0 until it estimates).
    pub expected_downtime_ms: u64,
}

/// A VM view's `migration` (`vm.get`, `vm.list`): present while the record names a migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationView {
    /// `outgoing` (this host sends the VM) or `incoming`.
    pub role: String,
    /// The other vmhostd's migration address (empty on a destination until the source came).
    pub peer: String,
    /// The recorded phase: `sending`, `committing` or `committed`.
    pub phase: String,
    /// What the migration has done so far, while this vmhostd runs it (absent after a
    /// restart until it reports again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<MigrationProgress>,
}

/// Params of `vm.migrate_settle` (source): the operator's answer for a move whose outcome this
/// host could not learn (the VM `failed` with its migration in phase `committing`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateSettleParams {
    /// The VM.
    pub name: String,
    /// What the operator found on the destination.
    pub outcome: SettleOutcome,
}

/// What became of a move, as the operator tells `vm.migrate_settle`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SettleOutcome {
    /// The destination runs the VM: it ends here (data disks kept, as a destroy keeps them).
    Committed,
    /// The destination does not have it: it stays here (a live guest runs again; a cold VM is
    /// `stopped`, started again if its move stopped it).
    Abandoned,
}

/// Result of `vm.migrate_settle`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateSettleResult {
    /// The VM's name.
    pub name: String,
    /// What was carried out.
    pub outcome: SettleOutcome,
    /// What the destination said when asked: `committed` or `abandoned` (it agreed), or
    /// `unreachable` (the operator's word decided).
    pub destination: String,
    /// The VM's status here afterwards (absent: it ended here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<super::VmStatus>,
}
