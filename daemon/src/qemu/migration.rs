//! QEMU's side of a migration, over the VM's QMP session (docs/moving.md).
//!
//! SKELETON (issue 32): signatures the lifecycle uses; the QEMU helper fills the bodies.
//! Destination, in order: [`psk_dir`], [`add_tls`], [`start_nbd_server`], [`export_disks`],
//! [`start_incoming`], then [`incoming_status`] at the commit, [`finish_incoming`], [`resume`].
//! Source, in order: [`psk_dir`], [`add_tls`], [`start_mirror`] per disk, [`mirrors`] until all
//! are ready, [`start_memory`], [`progress`] until `completed`, then [`finish_source`] after the
//! destination's confirmation, or [`cancel_source`] on any failure (also by recovery).

use super::qmp::Qmp;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;

/// Why a QEMU migration step failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrationQemuError {
    /// A QMP command failed.
    #[error("QMP: {0}")]
    Qmp(#[from] super::qmp::QmpError),
    /// Not built yet (skeleton).
    #[error("not built yet: {0}")]
    NotBuilt(&'static str),
}

/// Which end of the TLS session QEMU is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// The destination.
    Server,
    /// The source.
    Client,
}

/// One disk to mirror: the same on both sides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigDisk {
    /// QEMU's device (`virtio0`) or node name (`data-NAME`).
    pub device: String,
    /// The NBD export name on the destination.
    pub export: String,
    /// Mirror only the top layer (an image VM's overlay: the destination has the same base).
    pub top_only: bool,
}

/// QEMU's progress of the memory stream (`query-migrate`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryProgress {
    /// `setup`, `active`, `completed`, `failed`, `cancelled`, ...
    pub status: String,
    /// `ram.transferred`.
    pub transferred: u64,
    /// `ram.remaining`.
    pub remaining: u64,
    /// `ram.total`.
    pub total: u64,
    /// `expected-downtime` while active, `downtime` once completed (ms).
    pub downtime_ms: u64,
    /// `error-desc` when failed.
    pub error: Option<String>,
}

/// One mirror job's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorState {
    /// The disk's device.
    pub device: String,
    /// Bytes copied.
    pub offset: u64,
    /// Bytes to copy in all (grows while the guest writes).
    pub len: u64,
    /// Source and destination are in step (`ready`).
    pub ready: bool,
}

/// The disks of a VM's QEMU to mirror, in a fixed order (pure).
pub fn disks_of(_spec: &crate::api::VmSpec) -> Vec<MigDisk> {
    Vec::new()
}

/// Writes the TLS key file QEMU reads into a directory of `run_dir` only QEMU's user reads,
/// and returns that directory opened (QEMU reads it through `/proc/self/fd/N`).
///
/// # Errors
/// When the directory or file cannot be made.
pub fn psk_dir(
    _run_dir: &Path,
    _key_hex: &str,
    _qemu_user: Option<&crate::config::UserIds>,
) -> Result<OwnedFd, MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("psk_dir"))
}

/// Gives QEMU the TLS credentials (`tls-creds-psk`) from `dir`.
///
/// # Errors
/// When QEMU refuses.
pub async fn add_tls(_qmp: &mut Qmp, _dir: BorrowedFd<'_>, _endpoint: Endpoint) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("add_tls"))
}

/// Destination: QEMU's NBD server on `listener` (a listening Unix socket), with TLS.
///
/// # Errors
/// When QEMU refuses.
pub async fn start_nbd_server(_qmp: &mut Qmp, _listener: BorrowedFd<'_>) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("start_nbd_server"))
}

/// Destination: every disk exported writable under its export name.
///
/// # Errors
/// When QEMU refuses.
pub async fn export_disks(_qmp: &mut Qmp, _disks: &[MigDisk]) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("export_disks"))
}

/// Destination: QEMU reads the memory stream from `stream`.
///
/// # Errors
/// When QEMU refuses.
pub async fn start_incoming(_qmp: &mut Qmp, _stream: BorrowedFd<'_>) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("start_incoming"))
}

/// Destination: the incoming stream's state (`completed` once the guest's state arrived).
///
/// # Errors
/// When QEMU does not answer.
pub async fn incoming_status(_qmp: &mut Qmp) -> Result<MemoryProgress, MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("incoming_status"))
}

/// Destination: the NBD server stopped and the TLS object removed.
///
/// # Errors
/// When QEMU refuses.
pub async fn finish_incoming(_qmp: &mut Qmp) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("finish_incoming"))
}

/// Runs the paused guest (`cont`).
///
/// # Errors
/// When QEMU refuses.
pub async fn resume(_qmp: &mut Qmp) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("resume"))
}

/// Source: mirrors `disk` into the destination's export over `stream` (a connected socket).
///
/// # Errors
/// When QEMU refuses.
pub async fn start_mirror(_qmp: &mut Qmp, _disk: &MigDisk, _stream: BorrowedFd<'_>) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("start_mirror"))
}

/// Source: the state of this migration's mirror jobs.
///
/// # Errors
/// When QEMU does not answer.
pub async fn mirrors(_qmp: &mut Qmp) -> Result<Vec<MirrorState>, MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("mirrors"))
}

/// Source: sends the memory over `stream` (TLS), with QEMU's downtime limit and bandwidth cap.
///
/// # Errors
/// When QEMU refuses.
pub async fn start_memory(
    _qmp: &mut Qmp,
    _stream: BorrowedFd<'_>,
    _max_downtime_ms: u64,
    _bandwidth_mib_s: Option<u64>,
) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("start_memory"))
}

/// Source: the memory stream's progress.
///
/// # Errors
/// When QEMU does not answer.
pub async fn progress(_qmp: &mut Qmp) -> Result<MemoryProgress, MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("progress"))
}

/// Source, after the destination confirmed: the mirror jobs and NBD nodes removed (the paused
/// guest is then ended by the caller).
///
/// # Errors
/// When QEMU refuses.
pub async fn finish_source(_qmp: &mut Qmp) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("finish_source"))
}

/// Source, on any failure before the destination confirmed (and by recovery): the memory
/// stream cancelled, the mirror jobs cancelled, the NBD nodes and TLS object removed, and the
/// guest running again. Idempotent: whatever is already gone is skipped.
///
/// # Errors
/// When QEMU refuses to resume the guest.
pub async fn cancel_source(_qmp: &mut Qmp) -> Result<(), MigrationQemuError> {
    Err(MigrationQemuError::NotBuilt("cancel_source"))
}
