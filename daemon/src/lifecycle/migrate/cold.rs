//! `vm.move` (docs/moving.md, "Cold moves"): a stopped VM (or, with `stop`, a running one
//! stopped first) sent to another vmhostd as its spec and its disk files, for VMs that cannot
//! migrate live (passthrough) or need not. Both sides are here: the source's operation
//! ([`move_vm`]) and the destination's receive ([`receive::receive`], run by `vm.migrate_in`
//! with `mode: cold`). What the source does when the move fails, is not answered, or a restart
//! finds it unfinished is the live migration's code ([`super::source_settle`]); a restart of
//! the destination is [`receive::recover`].
//!
//! Source, in order: refusals ([`plan::admit`]); the control channel opened (nothing changed
//! when the destination cannot be reached); the VM stopped when asked; the record `migrating`
//! with a cold migration (crash point `move:recorded`); `Hello`; `Announce` (every file to come
//! with its length and occupied bytes: the disks, a `tpm` VM's TPM state files (read through
//! the spawner into root's copies, [`TpmCopies`]), then the VM's snapshots, which go with it
//! since its copy here is deleted at the end); each file with its sha256 over the `files`
//! channel ([`crate::migration::files`]); the destination's `Ready` (every file
//! arrived and matched; crash point `move:sent`); phase `committing`; `Commit`; on `Committed`
//! the VM ends here as a destroy ends it ([`VmOp::destroy_steps`], data disks kept as a destroy
//! keeps them). Any failure before `Commit` leaves the VM here `stopped` (started again if this
//! move stopped it); a `Commit` without an answer is settled by asking the destination, as a
//! live migration's is.
//!
//! The destination's files land where a create puts them ([`plan::placement`]): the overlay
//! of an image VM, the root disk of a `boot.disk` VM, data disks and UEFI variables in the VM's
//! disk directory. They are received under partial names and renamed once their sha256 matched,
//! so a half-received disk never looks like the VM's. The TPM state waits beside them and is
//! put in the VM's state directory, as `qemu.user`'s, just before the commit (docs/moving.md,
//! "TPM").

pub(super) mod plan;
pub(in crate::lifecycle) mod receive;

pub(in crate::lifecycle) use receive::{receive, Abandon};

use super::super::op::VmOp;
use super::super::Manager;
use super::carry;
use super::source_settle::{self, Side};
use crate::api::migration::{MigrateResult, MoveMode, MoveParams};
use crate::api::{ApiError, Code, StopParams, VmStatus};
use crate::migration::{ChannelKind, Control, ControlMsg, Hello, Secret};
use crate::state::migration::{MigrationPhase, MigrationRecord, MigrationRole};
use plan::SourceFile;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// How long the source waits to reach the destination's port.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a `stop: true` move gives the guest to power off before QEMU is killed.
const STOP_TIMEOUT_S: u64 = 60;
/// How long the source waits for the destination's verdict on the files (it hashes the last
/// one as it arrives, so little after the last byte).
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the source waits for `Committed` (the destination writes one record).
const COMMIT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the source looks for the destination's `Abort` after the files channel failed.
const ABORT_WAIT: Duration = Duration::from_secs(10);
/// A cold move's settle: one implementation with the live migration's
/// ([`super::source_settle`]); a cold VM has no QEMU to re-adopt.
const COLD: Side = Side { mode: MoveMode::Cold, readopt: false };

/// 4097 `not_movable` with `reason`.
fn not_movable(reason: &str, message: impl Into<String>) -> ApiError {
    ApiError::new(Code::NotMovable, message).details(json!({ "reason": reason }))
}

/// 4001 at `step`.
fn failed(step: &str, message: impl Into<String>) -> ApiError {
    super::super::provisioning(step, message.into())
}

/// The destination's `Abort` as this call's error: its code when it is one of ours.
fn aborted(code: i32, message: &str) -> ApiError {
    match Code::from_i32(code) {
        Some(code) => ApiError::new(code, format!("the destination gave up: {message}")),
        None => failed("destination", format!("the destination gave up: {message}")),
    }
    .details(json!({ "step": "destination" }))
}

/// `vm.move` (module doc).
///
/// # Errors
/// 2001 `secret`; 4040, 4090; 4097 reason `status` (neither stopped, nor running with
/// `stop`); 4001 step `connect` when the destination cannot be reached (nothing changed); as
/// `vm.stop` for the stop; 4001 step `move` or the destination's own code (2003 for a file that
/// arrived with another sha256) when the move failed before the commit (the VM stays here);
/// 4001 step `commit` when the destination's answer is unknown (recorded `failed`, disks kept,
/// asked again in the background).
pub(crate) async fn move_vm(mgr: &Arc<Manager>, p: MoveParams) -> Result<MigrateResult, ApiError> {
    let span = tracing::info_span!("vm.move", vm = %p.name, destination = %p.destination);
    async move {
        let secret =
            Secret::parse(&p.secret).map_err(|_| ApiError::invalid("secret", "the secret is not 64 hex digits"))?;
        let started = Instant::now();
        let (mut op, rec) = mgr.begin_op(&p.name).await?;
        // Half-reverted disks must not travel, and the snapshot that finishes the revert
        // would be deleted with the source's copy.
        super::super::snapshots::check_not_reverting(&rec)?;
        // What a crash left of a snapshot operation is finished first: a disk must not carry
        // the tags of a half-taken or half-deleted snapshot, which the destination would never
        // delete (it has no record of them).
        if !super::super::snapshots::recover_vm(mgr, &rec, super::super::copies::DEFAULT_COPY_TIMEOUT).await {
            return Err(ApiError::new(
                crate::api::Code::Busy,
                format!(
                    "{}: an interrupted snapshot operation could not be finished (vmhostd's log says why); \
                     its disks would carry tags the destination has no record of: not moved",
                    p.name
                ),
            )
            .field("name"));
        }
        let live = op.find_live(rec.process.as_ref())?.is_some();
        let stop = plan::admit(rec.status, live, p.stop).map_err(|e| not_movable("status", e.to_string()))?;
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            crate::migration::connect(&p.destination, &p.name, &secret, &ChannelKind::Control),
        )
        .await
        .map_err(|_| failed("connect", format!("{} did not answer in time", p.destination)))?
        .map_err(|e| failed("connect", format!("cannot reach the destination {}: {e}", p.destination)))?;
        let mut control = Control::new(stream, &secret);
        if stop {
            let sp = StopParams {
                name: p.name.clone(),
                timeout_s: STOP_TIMEOUT_S,
                force: false,
                method: Default::default(),
            };
            op.stop_steps(&sp, 0).await?;
        }
        let record = MigrationRecord {
            role: MigrationRole::Outgoing,
            mode: MoveMode::Cold,
            peer: p.destination.clone(),
            secret: secret.to_hex(),
            phase: MigrationPhase::Sending,
            since: crate::api::now_rfc3339(),
            stopped: stop,
        };
        if let Err(e) = op.update_status("vm.move", VmStatus::Migrating, |r| r.migration = Some(record)) {
            restart(&mut op, stop).await;
            return Err(e);
        }
        op.crashpoint("move:recorded");
        let disk_bytes = match send(&op, &p, &secret, &mut control).await {
            Ok(bytes) => bytes,
            Err(e) => return Err(source_settle::give_up(&mut op, COLD, Some(&mut control), e, None).await),
        };
        op.crashpoint("move:sent");
        op.update("vm.move: committing", |r| source_settle::set_phase(r, MigrationPhase::Committing))?;
        let answer = match control.send(&ControlMsg::Commit).await {
            Ok(()) => control.recv(COMMIT_TIMEOUT).await,
            Err(e) => Err(e),
        };
        match answer {
            Ok(ControlMsg::Committed) => source_settle::finish(&mut op, COLD, &p.destination, None).await?,
            Ok(ControlMsg::Abort { code, message }) => {
                return Err(source_settle::give_up(&mut op, COLD, None, aborted(code, &message), None).await);
            }
            other => {
                tracing::warn!(answer = ?other, "no answer to the commit: asking the destination");
                source_settle::settle(&mut op, COLD, &p.destination, &secret, None).await?;
            }
        }
        Ok(MigrateResult {
            name: p.name.clone(),
            destination: p.destination.clone(),
            mode: MoveMode::Cold,
            total_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            downtime_ms: 0,
            ram_bytes: 0,
            disk_bytes,
        })
    }
    .instrument(span)
    .await
}

/// `Hello`, the files, and the destination's `Ready` (every file arrived with its sha256).
/// Returns the bytes sent.
async fn send(op: &VmOp, p: &MoveParams, secret: &Secret, control: &mut Control) -> Result<u64, ApiError> {
    let rec = op.record()?;
    let paths = op.paths().clone();
    let root = rec.root_disk.as_ref().map(|r| (r.format, r.imported_bytes));
    let spec = rec.spec.clone();
    let files: Vec<SourceFile> = crate::blocking::run(|| {
        plan::source_files(&spec, &paths, root, |path| {
            std::fs::symlink_metadata(path).ok().filter(|m| m.is_file()).map(|m| m.len())
        })
    });
    // The snapshots go with the VM: the source's are deleted with its copy once the
    // destination committed, and it commits only when every one arrived.
    let mut sent: Vec<(String, std::path::PathBuf)> = files.iter().map(|f| (f.name.clone(), f.path.clone())).collect();
    // The TPM's state too, as copies the daemon can read (removed when this returns).
    let tpm = TpmCopies::take(&spec, &paths).await?;
    sent.extend(tpm.files.iter().cloned());
    sent.extend(carry::snapshot_files(op.mgr(), op.name())?);
    let announced = crate::blocking::run(|| carry::announce(&sent)).map_err(|e| failed("move", e))?;
    // The spec as the orchestrator admitted it on the destination: each NIC with its MAC.
    let mut spec = rec.spec.clone();
    for (nic, alloc) in spec.nics.iter_mut().zip(&rec.nics) {
        nic.mac.get_or_insert_with(|| alloc.mac.clone());
    }
    let hello = Hello {
        spec,
        instance_id: rec.instance_id.clone(),
        macs: rec.nics.iter().map(|n| n.mac.clone()).collect(),
        disks: files.iter().map(|f| f.hello.clone()).collect(),
        // A cold move's guest boots afresh on the destination's machine.
        machine: None,
    };
    control.send(&ControlMsg::Hello(Box::new(hello))).await.map_err(|e| failed("move", format!("hello: {e}")))?;
    control
        .send(&ControlMsg::Announce { files: announced })
        .await
        .map_err(|e| failed("move", format!("announcing the files: {e}")))?;
    // A destination that refused the announcement has let go of the files channel: its
    // `Abort`, read below, says why.
    let mut sent = carry::send_files(&p.destination, &p.name, secret, &sent)
        .await
        .map_err(|e| failed("move", format!("sending the files: {e}")));
    // The destination says why it stopped reading, if it did: its verdict decides the error.
    let wait = if sent.is_ok() { READY_TIMEOUT } else { ABORT_WAIT };
    match control.recv(wait).await {
        Ok(ControlMsg::Ready { .. }) if sent.is_ok() => {}
        Ok(ControlMsg::Abort { code, message }) => sent = Err(aborted(code, &message)),
        Ok(other) if sent.is_ok() => {
            sent = Err(failed("move", format!("an unexpected answer to the files: {other:?}")))
        }
        Err(e) if sent.is_ok() => sent = Err(failed("move", format!("no answer to the files: {e}"))),
        _ => {}
    }
    sent
}

/// A `tpm` VM's TPM state as root's copies the move can send (`tpm:FILE`, [`plan::tpm_wire_name`]):
/// swtpm's files are `qemu.user`'s, 0600, which the daemon reads only through the spawner
/// ([`crate::tpm::read_state`]), while the `files` channel sends files by path. They are a few
/// KiB; kept in `RUN/NAME/tpm-move` (a stopped VM's run dir holds nothing else, and every
/// launch and teardown empties it) and removed when this value is dropped.
struct TpmCopies {
    dir: Option<std::path::PathBuf>,
    files: Vec<(String, std::path::PathBuf)>,
}

impl TpmCopies {
    /// Reads the state (the VM is stopped: swtpm wrote each file whole before it ended) and
    /// writes each file as a copy. None for a VM without `tpm` or never started with one.
    ///
    /// # Errors
    /// 4001 step `move` when the state cannot be read or a copy written.
    async fn take(spec: &crate::api::VmSpec, paths: &crate::qemu::argv::VmPaths) -> Result<TpmCopies, ApiError> {
        let mut copies = TpmCopies { dir: None, files: Vec::new() };
        if !spec.tpm {
            return Ok(copies);
        }
        let state =
            crate::tpm::read_state(paths).await.map_err(|e| failed("move", format!("reading the TPM state: {e}")))?;
        if state.is_empty() {
            return Ok(copies);
        }
        let dir = paths.run_dir.join("tpm-move");
        copies.dir = Some(dir.clone());
        let written = crate::blocking::run(|| {
            use std::io::Write;
            use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
            let mut files = Vec::new();
            for (name, bytes) in &state {
                let path = dir.join(name);
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)?;
                f.write_all(bytes)?;
                files.push((plan::tpm_wire_name(name), path));
            }
            Ok::<_, std::io::Error>(files)
        });
        copies.files =
            written.map_err(|e| failed("move", format!("copying the TPM state into {}: {e}", dir.display())))?;
        Ok(copies)
    }
}

impl Drop for TpmCopies {
    fn drop(&mut self) {
        if let Some(dir) = self.dir.take() {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the TPM state's copies");
            }
        }
    }
}

/// Starts the VM again if this move stopped it (a failure before the commit: it was running
/// when the move began). A failed start is logged; the VM is then `failed` as after any start.
async fn restart(op: &mut VmOp, stopped_here: bool) {
    if !stopped_here {
        return;
    }
    if let Err(e) = op.start_steps("vm.move failed: started again").await {
        tracing::error!(error = %e.message, "the VM this move stopped could not be started again");
    }
}
