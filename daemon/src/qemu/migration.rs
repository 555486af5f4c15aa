//! QEMU's side of a migration, over the VM's QMP session (docs/moving.md).
//!
//! The daemon owns every socket of a migration and hands QEMU only descriptors (`getfd`,
//! `add-fd`): QEMU never opens an IP socket or a path of ours. Everything this module makes in
//! QEMU carries the prefix `vmhost-mig-` ([`PREFIX`]), so that [`cancel_source`] (also run by
//! recovery, which knows nothing of the attempt) finds and removes exactly what a migration
//! left, and never what the operator or a hot-plug made.
//!
//! Destination, in order: [`psk_dir`], [`add_tls`], [`start_nbd_server`], [`export_disks`],
//! [`start_incoming`], then [`incoming_status`] at the commit, [`finish_incoming`], [`resume`].
//! Source, in order: [`psk_dir`], [`add_tls`], [`start_mirror`] per disk, [`mirrors`] until all
//! are ready, [`start_memory`], [`progress`] until `completed`, then [`finish_source`] BEFORE
//! the source tells the destination to commit (its `block-job-cancel` makes each ready mirror
//! copy what is still dirty before it ends: only then does the destination have every block;
//! the memory's `completed` says nothing about the disks), or [`cancel_source`] on any failure
//! before the destination confirmed (also after [`finish_source`], and by recovery). Both sides
//! remove the key directory with [`remove_psk_dir`] once QEMU no longer needs it.
//!
//! The QMP sequence is the one checked by hand on QEMU 7.2 (docs/moving.md); the parsers of
//! QEMU's answers ([`parse_memory_progress`], [`parse_mirrors`]) are pure and unit-tested.

use super::qmp::Qmp;
use serde_json::{json, Value};
use std::io::{self, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Prefix of every name (object, fd, node, job, fd set description) a migration gives QEMU.
pub const PREFIX: &str = "vmhost-mig-";
/// The TLS credentials object, on both sides.
pub const TLS_ID: &str = "vmhost-mig-tls";
/// The description of the fd set holding the key directory.
pub const TLS_FDSET_OPAQUE: &str = "vmhost-mig-tls";
/// The destination's NBD listener (`getfd` name).
pub const NBD_FDNAME: &str = "vmhost-mig-nbd";
/// The memory stream (`getfd` name), on both sides.
pub const RAM_FDNAME: &str = "vmhost-mig-ram";
/// The PSK identity QEMU's client presents; the key file names it.
pub const PSK_USER: &str = "vmhost";
/// The key directory inside the VM's run dir.
pub const PSK_DIR: &str = "migration-tls";
/// How long cancelled or finished mirror jobs may take to go away.
const JOB_GONE_WAIT: Duration = Duration::from_secs(30);
/// How long a cancelled memory stream may take to stop.
const MIGRATE_STOP_WAIT: Duration = Duration::from_secs(30);
/// How often QEMU is asked while waiting for jobs or the stream to stop.
const POLL: Duration = Duration::from_millis(50);
/// `max-bandwidth` without a cap: QEMU's own default is 128 MiB/s, far below a LAN's.
const UNCAPPED_BYTES_S: u64 = 1 << 40;

/// Why a QEMU migration step failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrationQemuError {
    /// A QMP command failed (QEMU refused it or its session broke).
    #[error("QMP: {0}")]
    Qmp(#[from] super::qmp::QmpError),
    /// The key directory or file could not be made or opened.
    #[error("cannot {what} {}: {source}", path.display())]
    File {
        /// What was being done (`create`, `write`, `chown`, `open`, ...).
        what: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// QEMU answered something this module cannot use (a reply without a field it needs, a
    /// disk that is not there).
    #[error("unexpected answer from QEMU: {0}")]
    Protocol(String),
    /// QEMU did not get to the expected state in time (jobs still there, stream not stopped).
    #[error("QEMU did not {what} within {after:?}")]
    Timeout {
        /// What it did not do.
        what: &'static str,
        /// How long it was given.
        after: Duration,
    },
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
    /// The job ended (`concluded`: kept listed until dismissed, so that its end is read, not
    /// lost): with `error` when it did not complete, a cancel before `ready` included.
    pub concluded: bool,
    /// Why it did not complete (QEMU's `error`).
    pub error: Option<String>,
}

/// The `getfd` name of disk `export`'s NBD stream on the source.
pub fn nbd_fdname(export: &str) -> String {
    format!("{PREFIX}n-{export}")
}

/// The source's NBD client node of disk `export`, the mirror's target.
pub fn nbd_node(export: &str) -> String {
    format!("{PREFIX}{export}")
}

/// The mirror job of disk `export` (job ids and node names are separate names in QEMU).
pub fn job_id(export: &str) -> String {
    format!("{PREFIX}{export}")
}

/// The disks of a VM's QEMU to mirror, in a fixed order (pure): the boot disk (its overlay's top
/// layer for an image VM: the destination makes its own overlay on the same base; all of an
/// imported `boot.disk`), each data disk, the UEFI variables store. Not the seed (the
/// destination writes an identical one) nor the UEFI code (the host's firmware, read-only); a
/// direct-kernel VM has no boot disk.
pub fn disks_of(spec: &crate::api::VmSpec) -> Vec<MigDisk> {
    let mut disks = Vec::new();
    let boot = super::argv::DISK_DRIVE;
    if spec.boot.image.is_some() {
        disks.push(MigDisk { device: boot.to_string(), export: boot.to_string(), top_only: true });
    } else if spec.boot.disk.is_some() {
        disks.push(MigDisk { device: boot.to_string(), export: boot.to_string(), top_only: false });
    }
    for disk in &spec.disks {
        let node = super::hotplug::data_drive(&disk.name);
        disks.push(MigDisk { device: node.clone(), export: node, top_only: false });
    }
    if spec.boot.firmware == crate::api::Firmware::Uefi {
        let node = super::argv::UEFI_VARS_NODE;
        disks.push(MigDisk { device: node.to_string(), export: node.to_string(), top_only: false });
    }
    disks
}

/// The key directory of the VM whose run dir is `run_dir`.
pub fn psk_dir_path(run_dir: &Path) -> PathBuf {
    run_dir.join(PSK_DIR)
}

/// The key file's contents: QEMU's `keys.psk` format, one `IDENTITY:HEXKEY` line.
pub fn psk_file_contents(key_hex: &str) -> String {
    format!("{PSK_USER}:{key_hex}\n")
}

/// Writes the TLS key file QEMU reads into a directory of `run_dir` only QEMU's user reads,
/// and returns that directory opened (QEMU reads it through `/proc/self/fd/N`).
///
/// The directory (`RUN_DIR/migration-tls`) and `keys.psk` stay the daemon's: its sandbox may
/// not change a file's owner. When QEMU runs as another user (`qemu_user`), the directory is
/// 0711 and the file 0444, so that QEMU can read the file through its descriptor of the
/// directory; nobody else reaches either by path, because the VM's run dir above them is the
/// daemon's alone (0700). Otherwise they are 0700 and 0400. A directory left by an earlier
/// attempt is replaced. The file is written under a temporary name, synced and renamed, so QEMU never
/// reads half a key. Blocking: call it off the runtime's workers.
///
/// # Errors
/// [`MigrationQemuError::Protocol`] when `key_hex` is not hex (it would break QEMU's file
/// format); [`MigrationQemuError::File`] when the directory or file cannot be made.
pub fn psk_dir(
    run_dir: &Path,
    key_hex: &str,
    qemu_user: Option<&crate::config::UserIds>,
) -> Result<OwnedFd, MigrationQemuError> {
    if key_hex.is_empty() || !key_hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(MigrationQemuError::Protocol("the TLS key is not hex".to_string()));
    }
    let dir = psk_dir_path(run_dir);
    let file_err = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source: io::Error| MigrationQemuError::File { what, path, source }
    };
    remove_psk_dir(run_dir).map_err(file_err("remove", &dir))?;
    let (dir_mode, file_mode) = if qemu_user.is_some() { (0o711, 0o444) } else { (0o700, 0o400) };
    std::fs::DirBuilder::new().mode(dir_mode).create(&dir).map_err(file_err("create", &dir))?;
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(&dir)
        .map_err(file_err("open", &dir))?;
    // The umask may have taken bits the modes need; through the descriptors (fchmod), as the
    // sandbox allows no chmod of a path.
    opened.set_permissions(std::fs::Permissions::from_mode(dir_mode)).map_err(file_err("chmod", &dir))?;
    let tmp = dir.join("keys.psk.tmp");
    let file = dir.join("keys.psk");
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(file_mode)
            .open(&tmp)
            .map_err(file_err("create", &tmp))?;
        f.set_permissions(std::fs::Permissions::from_mode(file_mode)).map_err(file_err("chmod", &tmp))?;
        f.write_all(psk_file_contents(key_hex).as_bytes()).map_err(file_err("write", &tmp))?;
        f.sync_all().map_err(file_err("sync", &tmp))?;
    }
    std::fs::rename(&tmp, &file).map_err(file_err("rename", &file))?;
    // std opens with O_CLOEXEC: only the copy handed over with add-fd reaches QEMU.
    opened.sync_all().map_err(file_err("sync", &dir))?;
    Ok(opened.into())
}

/// Removes the key directory of `run_dir` (nothing to do when it is not there).
///
/// # Errors
/// When it exists and cannot be removed.
pub fn remove_psk_dir(run_dir: &Path) -> io::Result<()> {
    match std::fs::remove_dir_all(psk_dir_path(run_dir)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The arguments of `object-add` for the credentials in QEMU's descriptor `fd`.
fn tls_object_args(fd: i64, endpoint: Endpoint) -> Value {
    let mut args = json!({
        "qom-type": "tls-creds-psk",
        "id": TLS_ID,
        "endpoint": match endpoint { Endpoint::Server => "server", Endpoint::Client => "client" },
        "dir": format!("/proc/self/fd/{fd}"),
    });
    if endpoint == Endpoint::Client {
        args["username"] = Value::from(PSK_USER);
    }
    args
}

/// Gives QEMU the TLS credentials (`tls-creds-psk`) from `dir`.
///
/// The directory goes into a new fd set (described [`TLS_FDSET_OPAQUE`], so the cleanup finds
/// it): QEMU keeps that descriptor and reads the key through it. Credentials left by an
/// earlier attempt are removed first.
///
/// # Errors
/// When QEMU refuses.
pub async fn add_tls(qmp: &mut Qmp, dir: BorrowedFd<'_>, endpoint: Endpoint) -> Result<(), MigrationQemuError> {
    remove_tls(qmp).await?;
    let reply = qmp.execute_with_fd("add-fd", Some(json!({ "opaque": TLS_FDSET_OPAQUE })), dir).await?;
    let fd = reply
        .get("fd")
        .and_then(Value::as_i64)
        .ok_or_else(|| MigrationQemuError::Protocol(format!("add-fd answered {reply} without fd")))?;
    if let Err(e) = qmp.execute("object-add", Some(tls_object_args(fd, endpoint))).await {
        remove_tls(qmp).await.ok();
        return Err(e.into());
    }
    Ok(())
}

/// Removes the TLS object and the fd sets of the key directory, whichever exist.
async fn remove_tls(qmp: &mut Qmp) -> Result<(), MigrationQemuError> {
    let objects = qmp.execute("qom-list", Some(json!({ "path": "/objects" }))).await?;
    if has_named(&objects, TLS_ID) {
        qmp.execute("object-del", Some(json!({ "id": TLS_ID }))).await?;
    }
    remove_tls_fdsets(qmp).await
}

/// Removes the fd sets of the key directory. QEMU closes a removed descriptor only while the
/// guest runs (`monitor_fdset_cleanup`): for a paused guest the set stays listed, marked
/// removed, until [`resume`] asks again or the process ends.
async fn remove_tls_fdsets(qmp: &mut Qmp) -> Result<(), MigrationQemuError> {
    let sets = qmp.execute("query-fdsets", None).await?;
    for id in fdsets_described(&sets, TLS_FDSET_OPAQUE) {
        qmp.execute("remove-fd", Some(json!({ "fdset-id": id }))).await?;
    }
    Ok(())
}

/// Whether a `qom-list` answer has an entry `name`.
fn has_named(list: &Value, name: &str) -> bool {
    list.as_array().is_some_and(|a| a.iter().any(|o| o.get("name").and_then(Value::as_str) == Some(name)))
}

/// The ids of the fd sets in a `query-fdsets` answer with a descriptor described `opaque`.
fn fdsets_described(sets: &Value, opaque: &str) -> Vec<u64> {
    let Some(sets) = sets.as_array() else { return Vec::new() };
    sets.iter()
        .filter(|s| {
            s.get("fds")
                .and_then(Value::as_array)
                .is_some_and(|fds| fds.iter().any(|f| f.get("opaque").and_then(Value::as_str) == Some(opaque)))
        })
        .filter_map(|s| s.get("fdset-id").and_then(Value::as_u64))
        .collect()
}

/// Destination: QEMU's NBD server on `listener` (a listening Unix socket), with TLS.
///
/// # Errors
/// When QEMU refuses.
pub async fn start_nbd_server(qmp: &mut Qmp, listener: BorrowedFd<'_>) -> Result<(), MigrationQemuError> {
    // A descriptor of an earlier attempt under the same name would be replaced silently; an
    // explicit close keeps QEMU's table clean.
    let _ = qmp.execute("closefd", Some(json!({ "fdname": NBD_FDNAME }))).await;
    qmp.execute_with_fd("getfd", Some(json!({ "fdname": NBD_FDNAME })), listener).await?;
    qmp.execute(
        "nbd-server-start",
        Some(json!({
            // SocketAddressLegacy: the fd's name is under `data`.
            "addr": { "type": "fd", "data": { "str": NBD_FDNAME } },
            "tls-creds": TLS_ID,
        })),
    )
    .await?;
    Ok(())
}

/// The node name of `device` in a `query-block` answer (`inserted.node-name`).
fn node_of_device(block: &Value, device: &str) -> Option<String> {
    block
        .as_array()?
        .iter()
        .find(|b| b.get("device").and_then(Value::as_str) == Some(device))
        .and_then(|b| b.get("inserted").and_then(|i| i.get("node-name")).and_then(Value::as_str).map(str::to_string))
}

/// Destination: every disk exported writable under its export name.
///
/// A `-drive` disk (`virtio0`) is exported by the node QEMU named itself (`query-block`); the
/// others' device is their node name.
///
/// # Errors
/// When QEMU refuses, or a drive is not in `query-block`.
pub async fn export_disks(qmp: &mut Qmp, disks: &[MigDisk]) -> Result<(), MigrationQemuError> {
    let block = qmp.execute("query-block", None).await?;
    for disk in disks {
        let node = if disk.device == super::argv::DISK_DRIVE {
            node_of_device(&block, &disk.device).ok_or_else(|| {
                MigrationQemuError::Protocol(format!("no node for drive {} in query-block", disk.device))
            })?
        } else {
            disk.device.clone()
        };
        qmp.execute(
            "block-export-add",
            Some(json!({
                "type": "nbd",
                "id": format!("{PREFIX}e-{}", disk.export),
                "node-name": node,
                "writable": true,
                "name": disk.export,
            })),
        )
        .await?;
    }
    Ok(())
}

/// The memory stream's settings both sides need before it starts: QEMU's events and the TLS
/// credentials (and on the source its limits).
async fn set_memory_parameters(qmp: &mut Qmp, extra: Value) -> Result<(), MigrationQemuError> {
    qmp.execute(
        "migrate-set-capabilities",
        Some(json!({ "capabilities": [{ "capability": "events", "state": true }] })),
    )
    .await?;
    let mut params = json!({ "tls-creds": TLS_ID });
    if let (Some(p), Some(extra)) = (params.as_object_mut(), extra.as_object()) {
        p.extend(extra.clone());
    }
    qmp.execute("migrate-set-parameters", Some(params)).await?;
    Ok(())
}

/// Hands QEMU `stream` as the memory stream's descriptor.
async fn give_ram_fd(qmp: &mut Qmp, stream: BorrowedFd<'_>) -> Result<(), MigrationQemuError> {
    let _ = qmp.execute("closefd", Some(json!({ "fdname": RAM_FDNAME }))).await;
    qmp.execute_with_fd("getfd", Some(json!({ "fdname": RAM_FDNAME })), stream).await?;
    Ok(())
}

/// Destination: QEMU reads the memory stream from `stream`.
///
/// # Errors
/// When QEMU refuses.
pub async fn start_incoming(qmp: &mut Qmp, stream: BorrowedFd<'_>) -> Result<(), MigrationQemuError> {
    set_memory_parameters(qmp, json!({})).await?;
    give_ram_fd(qmp, stream).await?;
    qmp.execute("migrate-incoming", Some(json!({ "uri": format!("fd:{RAM_FDNAME}") }))).await?;
    Ok(())
}

/// Destination: the incoming stream's state (`completed` once the guest's state arrived).
///
/// # Errors
/// When QEMU does not answer.
pub async fn incoming_status(qmp: &mut Qmp) -> Result<MemoryProgress, MigrationQemuError> {
    progress(qmp).await
}

/// Destination: the NBD server stopped and the TLS object removed.
///
/// `nbd-server-stop` also ends the server's exports. Idempotent: a server already stopped is
/// skipped. The key directory's fd set is removed too, but QEMU closes its descriptor only
/// while the guest runs: [`resume`] finishes that.
///
/// # Errors
/// When QEMU refuses.
pub async fn finish_incoming(qmp: &mut Qmp) -> Result<(), MigrationQemuError> {
    let exports = qmp.execute("query-block-exports", None).await?;
    let ours = exports.as_array().is_some_and(|a| {
        a.iter().any(|e| e.get("id").and_then(Value::as_str).is_some_and(|id| id.starts_with(PREFIX)))
    });
    if let Err(e) = qmp.execute("nbd-server-stop", None).await {
        // Not running is what this step wants; anything else with our exports still up is not.
        if ours {
            return Err(e.into());
        }
    }
    let _ = qmp.execute("migrate-set-parameters", Some(json!({ "tls-creds": "" }))).await;
    remove_tls(qmp).await
}

/// Runs the paused guest (`cont`), then closes the key directory's descriptor in QEMU, which
/// QEMU does only once the guest runs (see [`finish_incoming`]).
///
/// # Errors
/// When QEMU refuses.
pub async fn resume(qmp: &mut Qmp) -> Result<(), MigrationQemuError> {
    qmp.execute("cont", None).await?;
    remove_tls_fdsets(qmp).await
}

/// Source: mirrors `disk` into the destination's export over `stream` (a connected socket).
///
/// The stream becomes the NBD client node [`nbd_node`] (TLS over the stream), the mirror job
/// [`job_id`] copies into it: all of the disk, or only the top layer when
/// [`MigDisk::top_only`]. Connect only after the destination's exports are up: QEMU's NBD
/// handshake blocks QMP until it gives up.
///
/// # Errors
/// When QEMU refuses (the node is then removed again).
pub async fn start_mirror(qmp: &mut Qmp, disk: &MigDisk, stream: BorrowedFd<'_>) -> Result<(), MigrationQemuError> {
    let fdname = nbd_fdname(&disk.export);
    let node = nbd_node(&disk.export);
    let _ = qmp.execute("closefd", Some(json!({ "fdname": fdname }))).await;
    qmp.execute_with_fd("getfd", Some(json!({ "fdname": fdname })), stream).await?;
    qmp.execute(
        "blockdev-add",
        Some(json!({
            "driver": "nbd",
            "node-name": node,
            // SocketAddress (not the legacy one): the name is directly under `str`.
            "server": { "type": "fd", "str": fdname },
            "export": disk.export,
            "tls-creds": TLS_ID,
        })),
    )
    .await?;
    let mirror = qmp
        .execute(
            "blockdev-mirror",
            Some(json!({
                "job-id": job_id(&disk.export),
                "device": disk.device,
                "target": node,
                "sync": if disk.top_only { "top" } else { "full" },
                // Kept after it ends until dismissed: a mirror that fails must be seen to
                // have failed ([`end_mirrors`]), not vanish as one that completed does.
                "auto-dismiss": false,
            })),
        )
        .await;
    if let Err(e) = mirror {
        let _ = qmp.execute("blockdev-del", Some(json!({ "node-name": node }))).await;
        return Err(e.into());
    }
    Ok(())
}

/// This migration's mirror jobs in a `query-block-jobs` answer (pure): jobs named
/// [`job_id`], each with the export (= device) its name carries. Other jobs are not ours.
pub fn parse_mirrors(jobs: &Value) -> Vec<MirrorState> {
    let Some(jobs) = jobs.as_array() else { return Vec::new() };
    jobs.iter()
        .filter_map(|j| {
            // For a job with a job-id, query-block-jobs' `device` is that id.
            let id = j.get("device").and_then(Value::as_str)?;
            let device = id.strip_prefix(PREFIX)?;
            Some(MirrorState {
                device: device.to_string(),
                offset: j.get("offset").and_then(Value::as_u64).unwrap_or(0),
                len: j.get("len").and_then(Value::as_u64).unwrap_or(0),
                ready: j.get("ready").and_then(Value::as_bool).unwrap_or(false),
                concluded: j.get("status").and_then(Value::as_str) == Some("concluded"),
                error: j.get("error").and_then(Value::as_str).map(str::to_string),
            })
        })
        .collect()
}

/// Source: the state of this migration's mirror jobs.
///
/// # Errors
/// When QEMU does not answer.
pub async fn mirrors(qmp: &mut Qmp) -> Result<Vec<MirrorState>, MigrationQemuError> {
    let jobs = qmp.execute("query-block-jobs", None).await?;
    Ok(parse_mirrors(&jobs))
}

/// Source: sends the memory over `stream` (TLS), with QEMU's downtime limit and bandwidth cap.
///
/// # Errors
/// When QEMU refuses.
pub async fn start_memory(
    qmp: &mut Qmp,
    stream: BorrowedFd<'_>,
    max_downtime_ms: u64,
    bandwidth_mib_s: Option<u64>,
) -> Result<(), MigrationQemuError> {
    let bandwidth = bandwidth_mib_s.map_or(UNCAPPED_BYTES_S, |m| m.saturating_mul(1 << 20).min(UNCAPPED_BYTES_S));
    set_memory_parameters(qmp, json!({ "downtime-limit": max_downtime_ms, "max-bandwidth": bandwidth })).await?;
    give_ram_fd(qmp, stream).await?;
    qmp.execute("migrate", Some(json!({ "uri": format!("fd:{RAM_FDNAME}") }))).await?;
    Ok(())
}

/// A `query-migrate` answer as [`MemoryProgress`] (pure). No migration yet: an empty status
/// (QEMU answers `{}`).
pub fn parse_memory_progress(reply: &Value) -> MemoryProgress {
    let u = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0);
    let status = reply.get("status").and_then(Value::as_str).unwrap_or_default().to_string();
    let ram = reply.get("ram");
    let downtime = if status == "completed" { reply.get("downtime") } else { reply.get("expected-downtime") };
    MemoryProgress {
        transferred: u(ram.and_then(|r| r.get("transferred"))),
        remaining: u(ram.and_then(|r| r.get("remaining"))),
        total: u(ram.and_then(|r| r.get("total"))),
        downtime_ms: u(downtime),
        error: reply.get("error-desc").and_then(Value::as_str).map(str::to_string),
        status,
    }
}

/// Whether a memory stream in `status` still runs (cancelling it has something to stop).
pub fn memory_running(status: &str) -> bool {
    matches!(status, "setup" | "active" | "pre-switchover" | "device" | "postcopy-active" | "wait-unplug")
}

/// Source: the memory stream's progress.
///
/// # Errors
/// When QEMU does not answer.
pub async fn progress(qmp: &mut Qmp) -> Result<MemoryProgress, MigrationQemuError> {
    let mut reply = qmp.execute("query-migrate", None).await?;
    // Bounded: QEMU computes the figures right after it sets the status.
    for _ in 0..FIGURES_POLLS {
        if !figures_pending(&reply) {
            break;
        }
        tokio::time::sleep(FIGURES_POLL).await;
        reply = qmp.execute("query-migrate", None).await?;
    }
    Ok(parse_memory_progress(&reply))
}

/// How often and how long [`progress`] asks again for a completed stream's figures.
const FIGURES_POLL: std::time::Duration = std::time::Duration::from_millis(10);
const FIGURES_POLLS: u32 = 100;

/// Whether a `query-migrate` answer says `completed` before QEMU has computed the stream's
/// figures (pure). QEMU 7.2 sets the status first and `downtime`/`total-time` a moment later;
/// read in between, the answer says `downtime: 0` (seen in the fleet test), so the caller asks
/// again.
pub fn figures_pending(reply: &Value) -> bool {
    reply.get("status").and_then(Value::as_str) == Some("completed")
        && reply.get("total-time").and_then(Value::as_u64).unwrap_or(0) == 0
}

/// Ends this migration's mirror jobs without a pivot (the source keeps its disks), waits until
/// each has concluded, and removes the jobs and the NBD nodes. Without `force`, `expected`
/// names every disk that must have been mirrored: each must still have its job, `ready`, and
/// complete without error, or the destination lacks blocks and this fails (the caller then
/// gives up and the guest runs here). `force` cancels at once instead, whatever the jobs'
/// state (for a destination that may be gone).
async fn end_mirrors(qmp: &mut Qmp, force: bool, expected: &[MigDisk]) -> Result<(), MigrationQemuError> {
    let jobs = mirrors(qmp).await?;
    let mut incomplete: Vec<String> = Vec::new();
    if !force {
        for disk in expected {
            match jobs.iter().find(|m| m.device == disk.export) {
                Some(m) if m.ready && !m.concluded => {}
                Some(m) => incomplete.push(format!(
                    "{}: {}",
                    disk.device,
                    m.error.as_deref().unwrap_or(if m.concluded { "ended" } else { "not in step" })
                )),
                None => incomplete.push(format!("{}: its mirror is gone", disk.device)),
            }
        }
    }
    let cancel_force = force || !incomplete.is_empty();
    for job in jobs.iter().filter(|j| !j.concluded) {
        let id = job_id(&job.device);
        if let Err(e) = qmp.execute("block-job-cancel", Some(json!({ "device": id, "force": cancel_force }))).await {
            // A job that concluded between the query and the cancel is what we want.
            if mirrors(qmp).await?.iter().any(|m| m.device == job.device && !m.concluded) {
                return Err(e.into());
            }
        }
    }
    let deadline = tokio::time::Instant::now() + JOB_GONE_WAIT;
    let ended = loop {
        let now = mirrors(qmp).await?;
        if now.iter().all(|m| m.concluded) {
            break now;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(MigrationQemuError::Timeout { what: "end the mirror jobs", after: JOB_GONE_WAIT });
        }
        tokio::time::sleep(POLL).await;
    };
    for job in &ended {
        if let Some(error) = &job.error {
            if !cancel_force {
                incomplete.push(format!("{}: {error}", job.device));
            }
        }
        let _ = qmp.execute("job-dismiss", Some(json!({ "id": job_id(&job.device) }))).await;
    }
    let nodes = qmp.execute("query-named-block-nodes", Some(json!({ "flat": true }))).await?;
    for node in our_nodes(&nodes) {
        qmp.execute("blockdev-del", Some(json!({ "node-name": node }))).await?;
    }
    for fdname in [NBD_FDNAME, RAM_FDNAME] {
        let _ = qmp.execute("closefd", Some(json!({ "fdname": fdname }))).await;
    }
    if !force && !incomplete.is_empty() {
        return Err(MigrationQemuError::Protocol(format!(
            "a disk did not arrive whole on the destination ({})",
            incomplete.join("; ")
        )));
    }
    Ok(())
}

/// The node names of a `query-named-block-nodes` answer that a migration made (pure).
pub fn our_nodes(nodes: &Value) -> Vec<String> {
    let mut names: Vec<String> = nodes
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| n.get("node-name").and_then(Value::as_str))
                .filter(|n| n.starts_with(PREFIX))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names.dedup();
    names
}

/// Source, once the memory stream is `completed` and before the destination is told to commit:
/// each mirror job ends without a pivot after copying what is still dirty (the source keeps its
/// disks; the destination then has every block), the NBD nodes and TLS object are removed. The
/// guest stays paused: the caller ends it after the destination confirmed, or runs it again
/// with [`cancel_source`] if the destination abandons. The key directory's fd set stays listed in QEMU, marked
/// removed, while the guest is paused (QEMU closes it only for a running guest); it ends with
/// the process.
///
/// # Errors
/// When QEMU refuses.
pub async fn finish_source(qmp: &mut Qmp, disks: &[MigDisk]) -> Result<(), MigrationQemuError> {
    end_mirrors(qmp, false, disks).await?;
    let _ = qmp.execute("migrate-set-parameters", Some(json!({ "tls-creds": "" }))).await;
    remove_tls(qmp).await
}

/// Source, on any failure before the destination confirmed (and by recovery): the memory
/// stream cancelled, the mirror jobs cancelled, the NBD nodes and TLS object removed, and the
/// guest running again. Idempotent: whatever is already gone is skipped.
///
/// The guest is resumed only when the migration paused it: status `postmigrate` (the memory
/// went), or `paused` while mirror jobs of ours were there; a guest the operator paused stays
/// paused.
///
/// # Errors
/// When QEMU refuses to resume the guest, or a step of the cleanup.
pub async fn cancel_source(qmp: &mut Qmp) -> Result<(), MigrationQemuError> {
    let had_jobs = !mirrors(qmp).await?.is_empty();
    let memory = progress(qmp).await?;
    if memory_running(&memory.status) {
        qmp.execute("migrate_cancel", None).await?;
        let deadline = tokio::time::Instant::now() + MIGRATE_STOP_WAIT;
        while memory_running(&progress(qmp).await?.status) {
            if tokio::time::Instant::now() >= deadline {
                return Err(MigrationQemuError::Timeout { what: "cancel the memory stream", after: MIGRATE_STOP_WAIT });
            }
            tokio::time::sleep(POLL).await;
        }
    }
    end_mirrors(qmp, true, &[]).await?;
    let _ = qmp.execute("migrate-set-parameters", Some(json!({ "tls-creds": "" }))).await;
    remove_tls(qmp).await?;
    let status = qmp.query_status().await?;
    if status == "postmigrate" || (status == "paused" && had_jobs) {
        resume(qmp).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn spec(v: Value) -> crate::api::VmSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn disks_of_an_image_vm_mirrors_the_overlay_top_then_data_then_uefi_vars() {
        let s = spec(json!({"name": "a", "cpu": 1, "memory_mib": 256,
            "boot": {"image": "deb.qcow2", "firmware": "uefi"},
            "disks": [{"name": "d1", "size_gib": 1}, {"name": "logs", "size_gib": 1}]}));
        let d = disks_of(&s);
        let got: Vec<(&str, &str, bool)> =
            d.iter().map(|d| (d.device.as_str(), d.export.as_str(), d.top_only)).collect();
        assert_eq!(
            got,
            vec![
                ("virtio0", "virtio0", true),
                ("data-d1", "data-d1", false),
                ("data-logs", "data-logs", false),
                ("uefi-vars", "uefi-vars", false)
            ]
        );
    }

    #[test]
    fn disks_of_a_disk_vm_copies_all_of_it_and_a_kernel_vm_has_no_boot_disk() {
        let s = spec(json!({"name": "a", "cpu": 1, "memory_mib": 256, "boot": {"disk": "root.qcow2"}}));
        assert_eq!(disks_of(&s), vec![MigDisk { device: "virtio0".into(), export: "virtio0".into(), top_only: false }]);
        let s = spec(json!({"name": "a", "cpu": 1, "memory_mib": 256,
            "boot": {"kernel": "/k", "initrd": "/i"}, "disks": [{"name": "x", "size_gib": 1}]}));
        assert_eq!(disks_of(&s), vec![MigDisk { device: "data-x".into(), export: "data-x".into(), top_only: false }]);
    }

    #[test]
    fn memory_progress_while_active_uses_the_expected_downtime() {
        let p = parse_memory_progress(&json!({
            "status": "active", "expected-downtime": 300, "total-time": 900,
            "ram": {"transferred": 1000, "remaining": 2000, "total": 4000, "duplicate": 3}
        }));
        assert_eq!(
            p,
            MemoryProgress {
                status: "active".into(),
                transferred: 1000,
                remaining: 2000,
                total: 4000,
                downtime_ms: 300,
                error: None
            }
        );
        assert!(memory_running(&p.status));
    }

    #[test]
    fn memory_progress_once_completed_uses_the_real_downtime() {
        let p = parse_memory_progress(&json!({
            "status": "completed", "downtime": 104, "expected-downtime": 999, "total-time": 1000,
            "ram": {"transferred": 5, "remaining": 0, "total": 5}
        }));
        assert_eq!((p.status.as_str(), p.downtime_ms, p.remaining), ("completed", 104, 0));
        assert!(!memory_running(&p.status));
        assert!(!figures_pending(&json!({"status": "completed", "downtime": 104, "total-time": 1000})));
    }

    #[test]
    fn a_completed_stream_without_its_figures_is_asked_again() {
        assert!(figures_pending(&json!({"status": "completed", "downtime": 0, "total-time": 0})));
        assert!(figures_pending(&json!({"status": "completed"})));
        // Only a completed stream waits for figures: an active one's total-time is running.
        assert!(!figures_pending(&json!({"status": "active", "total-time": 0})));
        assert!(!figures_pending(&json!({})));
    }

    #[test]
    fn memory_progress_failed_carries_the_error_and_none_is_empty() {
        let p = parse_memory_progress(&json!({"status": "failed", "error-desc": "Unable to write"}));
        assert_eq!((p.status.as_str(), p.error.as_deref()), ("failed", Some("Unable to write")));
        assert_eq!(parse_memory_progress(&json!({})), MemoryProgress::default());
        assert_eq!(parse_memory_progress(&json!("nonsense")), MemoryProgress::default());
        assert!(!memory_running(""));
    }

    #[test]
    fn mirrors_are_only_our_jobs_with_their_export() {
        let jobs = json!([
            {"type": "mirror", "device": "vmhost-mig-virtio0", "len": 100, "offset": 100, "ready": true,
             "busy": false, "paused": false, "speed": 0, "io-status": "ok", "status": "ready"},
            {"type": "mirror", "device": "vmhost-mig-data-d1", "len": 300, "offset": 20, "ready": false,
             "status": "concluded", "error": "Input/output error"},
            {"type": "backup", "device": "operator-job", "len": 1, "offset": 0, "ready": false}
        ]);
        assert_eq!(
            parse_mirrors(&jobs),
            vec![
                MirrorState {
                    device: "virtio0".into(),
                    offset: 100,
                    len: 100,
                    ready: true,
                    concluded: false,
                    error: None
                },
                MirrorState {
                    device: "data-d1".into(),
                    offset: 20,
                    len: 300,
                    ready: false,
                    concluded: true,
                    error: Some("Input/output error".into())
                },
            ]
        );
        assert!(parse_mirrors(&json!({})).is_empty());
    }

    #[test]
    fn only_our_nodes_fdsets_and_objects_are_found() {
        let nodes = json!([{"node-name": "vmhost-mig-virtio0"}, {"node-name": "data-d1"},
            {"node-name": "vmhost-mig-virtio0"}, {"node-name": "#block123"}]);
        assert_eq!(our_nodes(&nodes), vec!["vmhost-mig-virtio0".to_string()]);
        let sets = json!([
            {"fdset-id": 3, "fds": [{"fd": 40, "opaque": "/run/x/serial.log"}]},
            {"fdset-id": 51, "fds": [{"fd": 41, "opaque": "vmhost-mig-tls"}]}
        ]);
        assert_eq!(fdsets_described(&sets, TLS_FDSET_OPAQUE), vec![51]);
        let objects = json!([{"name": "vmhost-mig-tls", "type": "child<tls-creds-psk>"}]);
        assert!(has_named(&objects, TLS_ID));
        assert!(!has_named(&json!([]), TLS_ID));
    }

    #[test]
    fn node_of_a_drive_is_its_inserted_node() {
        let block = json!([{"device": "virtio0", "inserted": {"node-name": "#block345"}}, {"device": "", "qdev": "x"}]);
        assert_eq!(node_of_device(&block, "virtio0").as_deref(), Some("#block345"));
        assert_eq!(node_of_device(&block, "virtio1"), None);
    }

    #[test]
    fn tls_object_of_a_client_names_the_user_and_reads_through_the_descriptor() {
        let c = tls_object_args(42, Endpoint::Client);
        assert_eq!(c["dir"], "/proc/self/fd/42");
        assert_eq!((c["endpoint"].as_str(), c["username"].as_str()), (Some("client"), Some(PSK_USER)));
        let s = tls_object_args(7, Endpoint::Server);
        assert_eq!((s["endpoint"].as_str(), s.get("username")), (Some("server"), None));
    }

    #[test]
    fn psk_dir_writes_one_key_line_readable_only_by_its_owner() {
        let run = tempfile::tempdir().unwrap();
        let fd = psk_dir(run.path(), "00ff", None).unwrap();
        let dir = psk_dir_path(run.path());
        assert_eq!(std::fs::read_to_string(dir.join("keys.psk")).unwrap(), "vmhost:00ff\n");
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(dir.join("keys.psk")).unwrap().permissions().mode() & 0o777, 0o400);
        assert_eq!(std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap(), dir);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("keys.psk")]);
        // A second attempt replaces the first; the removal leaves nothing.
        psk_dir(run.path(), "abcd", None).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("keys.psk")).unwrap(), "vmhost:abcd\n");
        remove_psk_dir(run.path()).unwrap();
        assert!(!dir.exists());
        remove_psk_dir(run.path()).unwrap();
        assert!(matches!(psk_dir(run.path(), "vmhost:1\n", None), Err(MigrationQemuError::Protocol(_))));
    }

    /// QEMU as an unprivileged user, in a run dir it cannot enter (root's 0700): it reads the key
    /// through its descriptor of the directory, and only once [`psk_dir`] gave it the files.
    #[tokio::test]
    async fn qemu_as_its_user_reads_the_key_through_the_descriptor() {
        use crate::qemu::launch::{launch, LaunchRequest, Launched};
        use std::os::fd::AsFd;
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let run = tempfile::tempdir().unwrap();
        let sock = run.path().join("qmp.sock");
        let listener: OwnedFd = std::os::unix::net::UnixListener::bind(&sock).unwrap().into();
        let argv = [
            "-accel",
            "tcg",
            "-M",
            "q35",
            "-m",
            "64",
            "-nodefaults",
            "-display",
            "none",
            "-chardev",
            "socket,id=qmp,fd=3,server=on,wait=off",
            "-mon",
            "chardev=qmp,mode=control",
        ];
        let user = crate::config::UserIds { uid: 65534, gid: 65534 };
        let req = LaunchRequest {
            binary: PathBuf::from("/usr/bin/qemu-system-x86_64"),
            argv: argv.iter().map(std::ffi::OsString::from).collect(),
            qmp: sock,
            log: run.path().join("qemu.log"),
            timeout: Duration::from_secs(20),
            fds: vec![listener],
            memlock: None,
            user: Some(user),
            kvm: false,
            affinity: Default::default(),
            incoming: false,
        };
        let Launched { identity, mut qmp } = launch(&req).await.unwrap();
        drop(req);
        // Root's key file: QEMU's user may not read it.
        let key = "3c".repeat(32);
        let dir = psk_dir(run.path(), &key, None).unwrap();
        let refused = add_tls(&mut qmp, dir.as_fd(), Endpoint::Client).await.unwrap_err();
        assert!(refused.to_string().contains("keys.psk"), "{refused}");
        let dir = psk_dir(run.path(), &key, Some(&user)).unwrap();
        add_tls(&mut qmp, dir.as_fd(), Endpoint::Client).await.unwrap();
        let objects = qmp.execute("qom-list", Some(json!({"path": "/objects"}))).await.unwrap();
        assert!(has_named(&objects, TLS_ID), "{objects}");
        qmp.quit().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), crate::process::wait_exit_of(&identity)).await.unwrap().unwrap();
    }

    #[test]
    fn psk_dir_for_another_user_is_readable_through_the_descriptor_only() {
        use std::os::unix::fs::MetadataExt;
        let run = tempfile::tempdir().unwrap();
        let user = crate::config::UserIds { uid: 64055, gid: 64056 };
        psk_dir(run.path(), "00ff", Some(&user)).unwrap();
        let dir = psk_dir_path(run.path());
        for (p, mode) in [(dir.clone(), 0o711), (dir.join("keys.psk"), 0o444)] {
            let m = std::fs::metadata(&p).unwrap();
            assert_eq!(
                (m.uid(), m.permissions().mode() & 0o777),
                (nix::unistd::geteuid().as_raw(), mode),
                "{}",
                p.display()
            );
        }
    }
}
