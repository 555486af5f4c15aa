//! Flat copies of a VM's disks, for `vm.export` (docs/backup.md): a disk and the layers below it
//! (an overlay and its base image) copied into one image with no backing file, by QEMU's
//! `blockdev-backup` job: without a guest ([`flatten`], a stopped VM) or in the VM's own QEMU
//! while the guest runs ([`trigger_live`]: one transaction, so every disk is copied as it was at
//! the same instant).
//!
//! Order of use: the caller makes each target file (empty; a raw one `virtual_size` long), then
//! [`flatten`], or [`prepare_live`], [`trigger_live`] and [`finish_live`] (the guest's file
//! systems may be frozen just around the trigger), then [`seal`] each target (its sha256; a raw one made sparse
//! again: QEMU writes the zeros it copies as allocated zero ranges). The sources are only read.

use super::offline_qemu::{Input, Session};
use super::{bounded_within, DiskError, Tool};
use crate::qemu::qmp::{Qmp, QmpError};
use serde_json::{json, Value};
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

/// One disk of a stopped VM to flatten.
#[derive(Debug)]
pub struct FlatDisk {
    /// The disk's layers, bottom first, each read-only with its format: a base image then the
    /// VM's overlay, or the one file of a disk without backing.
    pub layers: Vec<(OwnedFd, String)>,
    /// The empty target, read-write.
    pub target: OwnedFd,
    /// `qcow2` or `raw`.
    pub format: &'static str,
    /// Size of the disk the guest sees, in bytes.
    pub virtual_size: u64,
}

/// Copies every disk of `disks` into its target in one QEMU without a guest, within `within`.
///
/// # Errors
/// QEMU's errors ([`DiskError::Tool`]), [`DiskError::Timeout`].
pub async fn flatten(tool: &Tool, disks: Vec<FlatDisk>, within: Duration) -> Result<(), DiskError> {
    let mut inputs = Vec::new();
    let mut plan = Vec::new();
    for disk in disks {
        let (layers, target) = super::offline_qemu::push_disk(&mut inputs, disk.layers, Input::Layer, disk.target);
        plan.push((layers, target, disk.format, disk.virtual_size));
    }
    bounded_within("export", within, async {
        let mut session = Session::start(tool, inputs, "export").await?;
        for (layers, target, format, bytes) in &plan {
            let chain: Vec<(usize, &str)> = layers.iter().map(|(i, f)| (*i, f.as_str())).collect();
            let top = session.add_chain(&chain).await?;
            session.backup(&top, *target, format, *bytes, within).await?;
        }
        session.finish().await
    })
    .await
}

/// Writes an empty qcow2 of each size into each of `targets` (files of no length), recording
/// the backing file given (absolute path and format; not opened), in one QEMU without a guest:
/// the targets of [`prepare_live`].
///
/// # Errors
/// QEMU's errors.
pub async fn make_qcow2_targets(tool: &Tool, targets: Vec<QcowTarget>) -> Result<(), DiskError> {
    if targets.is_empty() {
        return Ok(());
    }
    let rest: Vec<(u64, Option<(std::path::PathBuf, String)>)> =
        targets.iter().map(|t| (t.bytes, t.backing.clone())).collect();
    let inputs = targets.into_iter().map(|t| Input::Image(t.fd)).collect();
    super::bounded("create", async {
        let mut session = Session::start(tool, inputs, "create").await?;
        for (i, (bytes, backing)) in rest.iter().enumerate() {
            let backing = backing.as_ref().map(|(p, f)| (p.as_path(), f.as_str()));
            session.create_qcow2(i, *bytes, backing, false).await?;
        }
        session.finish().await
    })
    .await
}

/// An empty file to become a qcow2 for [`make_qcow2_targets`].
#[derive(Debug)]
pub struct QcowTarget {
    /// The file, read-write.
    pub fd: OwnedFd,
    /// Its virtual size.
    pub bytes: u64,
    /// The backing file its header names (an overlay's copy names the overlay's base).
    pub backing: Option<(std::path::PathBuf, String)>,
}

/// One disk of a running VM to copy.
#[derive(Debug)]
pub struct LiveDisk {
    /// The block device (`virtio0`, `data-NAME`) or node the guest's disk is.
    pub device: String,
    /// The target, read-write; a qcow2 target already has its header (made without a guest).
    pub target: OwnedFd,
    /// `qcow2` or `raw`.
    pub format: &'static str,
    /// `full` (everything the guest reads) or `top` (what the disk's own file holds, not its
    /// backing: an overlay's copy, whose header names the same base).
    pub sync: &'static str,
}

/// What a live copy failed at.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// A QMP step failed.
    #[error("{step}: {source}")]
    Qmp {
        /// The QMP command.
        step: &'static str,
        /// Its error.
        source: QmpError,
    },
    /// A copy job ended with an error.
    #[error("copying {device}: {reason}")]
    Job {
        /// The disk.
        device: String,
        /// QEMU's reason.
        reason: String,
    },
    /// The jobs did not end in time (they were cancelled).
    #[error("the copy did not finish within {0:?}")]
    Timeout(Duration),
    /// The caller gave the copy up after it started (its jobs are cancelled); why.
    #[error("the copy was given up: {0}")]
    Abandoned(&'static str),
}

fn step(step: &'static str) -> impl Fn(QmpError) -> LiveError {
    move |source| LiveError::Qmp { step, source }
}

/// The node and job names of live target `i` of copy `op` (unique per copy: a node a failed
/// copy could not remove never blocks the next one).
fn names(op: u64, i: usize) -> (String, String) {
    (format!("vmhost-copy{op}-{i}"), format!("vmhost-copy{op}-job{i}"))
}

/// The `transaction` that starts one copy per disk (device, sync mode) of copy `op` at the same
/// instant.
pub fn transaction(op: u64, disks: &[(&str, &str)]) -> Value {
    let actions: Vec<Value> = disks
        .iter()
        .enumerate()
        .map(|(i, (device, sync))| {
            let (node, job) = names(op, i);
            json!({ "type": "blockdev-backup",
                    "data": { "job-id": job, "device": device, "target": node, "sync": sync } })
        })
        .collect();
    json!({ "actions": actions })
}

/// A live copy's targets added to QEMU ([`prepare_live`]); [`finish_live`] removes them.
#[derive(Debug)]
#[must_use = "finish_live removes the copies' nodes and descriptors from QEMU"]
pub struct Started {
    op: u64,
    sets: Vec<u64>,
    nodes: usize,
    triggered: bool,
}

/// Adds `disks`' targets to the running QEMU behind `q` as nodes over new fd sets (nothing is
/// copied yet). Then [`trigger_live`] and, also after an error of either, [`finish_live`].
///
/// # Errors
/// [`LiveError::Qmp`]; the `Started` to finish comes with it.
pub async fn prepare_live(q: &mut Qmp, disks: &[LiveDisk]) -> (Started, Result<(), LiveError>) {
    static OPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let op = OPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut started = Started { op, sets: Vec::new(), nodes: 0, triggered: false };
    let result = async {
        for (i, disk) in disks.iter().enumerate() {
            let (node, _) = names(op, i);
            let set = q.add_fd(disk.target.as_fd(), None, &node).await.map_err(step("add-fd"))?;
            started.sets.push(set);
            let mut add = json!({ "driver": disk.format, "node-name": node, "discard": "unmap", "detect-zeroes": "unmap",
                              "file": { "driver": "file", "filename": format!("/dev/fdset/{set}"), "locking": "off" } });
            if disk.format == "qcow2" {
                // A backing file its header names is the source's, never opened here.
                add["backing"] = Value::Null;
            }
            q.execute("blockdev-add", Some(add)).await.map_err(step("blockdev-add"))?;
            started.nodes += 1;
        }
        Ok(())
    }
    .await;
    (started, result)
}

/// Starts every copy at the same instant with one transaction (QEMU copies a block before the
/// guest overwrites it, so the copies are of that instant): the one step the guest's file
/// systems are frozen for.
///
/// # Errors
/// [`LiveError::Qmp`].
pub async fn trigger_live(q: &mut Qmp, started: &mut Started, disks: &[LiveDisk]) -> Result<(), LiveError> {
    trigger_live_with(q, started, disks, &Extras::default()).await
}

/// What an incremental backup adds to a live copy's transaction ([`super::bitmaps`]): per disk
/// (same order) the bitmap whose dirty clusters alone are copied (`sync: incremental`), and
/// more actions at the same instant (the new backup's bitmaps).
#[derive(Debug, Default, Clone)]
pub struct Extras {
    /// Per disk: `Some(bitmap)` to copy only its dirty clusters.
    pub bitmaps: Vec<Option<String>>,
    /// Actions put in the same transaction, before the copies.
    pub actions: Vec<Value>,
}

/// [`trigger_live`] with `extras` in the same transaction.
///
/// # Errors
/// [`LiveError::Qmp`].
pub async fn trigger_live_with(
    q: &mut Qmp,
    started: &mut Started,
    disks: &[LiveDisk],
    extras: &Extras,
) -> Result<(), LiveError> {
    let devices: Vec<(&str, &str)> = disks.iter().map(|d| (d.device.as_str(), d.sync)).collect();
    let mut t = transaction(started.op, &devices);
    if let Some(actions) = t.get_mut("actions").and_then(Value::as_array_mut) {
        for (action, bitmap) in actions.iter_mut().zip(&extras.bitmaps) {
            if let Some(b) = bitmap {
                action["data"]["sync"] = json!("bitmap");
                action["data"]["bitmap"] = json!(b);
                action["data"]["bitmap-mode"] = json!("never");
            }
        }
        let copies = std::mem::take(actions);
        actions.extend(extras.actions.iter().cloned());
        actions.extend(copies);
    }
    q.execute("transaction", Some(t)).await.map_err(step("transaction"))?;
    started.triggered = true;
    Ok(())
}

/// Waits up to `within` for the copies (when `result`, the outcome so far, is Ok), then removes
/// the targets' nodes and fd sets; after a failure the copies still running are cancelled and
/// their end awaited first (a node a job holds cannot be removed).
///
/// # Errors
/// `result`'s error, or [`LiveError`] of the wait.
pub async fn finish_live(
    q: &mut Qmp,
    started: Started,
    disks: &[LiveDisk],
    result: Result<(), LiveError>,
    within: Duration,
) -> Result<(), LiveError> {
    let jobs: Vec<String> = (0..disks.len()).map(|i| names(started.op, i).1).collect();
    let result = match result {
        Ok(()) if started.triggered => wait_jobs(q, &jobs, disks, within).await,
        other => other,
    };
    if result.is_err() && started.triggered {
        for job in &jobs {
            let _ = q.execute("block-job-cancel", Some(json!({ "device": job, "force": true }))).await;
        }
        // Until none of ours is listed (cancelled jobs dismiss themselves), within a bound.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::time::Instant::now() < deadline {
            let Ok(listed) = q.execute("query-jobs", None).await else { break };
            let ours = listed
                .as_array()
                .into_iter()
                .flatten()
                .any(|j| j.get("id").and_then(Value::as_str).is_some_and(|id| jobs.iter().any(|o| o == id)));
            if !ours {
                break;
            }
            let _ = q.wait_event(|e| e.get("event").is_some(), Duration::from_millis(500)).await;
        }
    }
    for i in 0..started.nodes {
        if let Err(e) = q.execute("blockdev-del", Some(json!({ "node-name": names(started.op, i).0 }))).await {
            tracing::warn!(error = %e, "a copy's node stays in QEMU until it exits");
        }
    }
    for set in started.sets {
        let _ = q.execute("remove-fd", Some(json!({ "fdset-id": set }))).await;
    }
    result
}

/// Waits for every job of `jobs` to complete (`BLOCK_JOB_COMPLETED`, in any order), within
/// `within`; the first with an error fails the copy.
async fn wait_jobs(q: &mut Qmp, jobs: &[String], disks: &[LiveDisk], within: Duration) -> Result<(), LiveError> {
    let deadline = tokio::time::Instant::now() + within;
    let mut done = vec![false; jobs.len()];
    while done.iter().any(|d| !d) {
        let ours = |e: &Value| {
            e.get("event").and_then(Value::as_str) == Some("BLOCK_JOB_COMPLETED")
                && e.pointer("/data/device").and_then(Value::as_str).is_some_and(|id| jobs.iter().any(|j| j == id))
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let event = q.wait_event(ours, left).await.map_err(step("BLOCK_JOB_COMPLETED"))?;
        let Some(event) = event else { return Err(LiveError::Timeout(within)) };
        let Some(i) =
            event.pointer("/data/device").and_then(Value::as_str).and_then(|id| jobs.iter().position(|j| j == id))
        else {
            continue;
        };
        if let Some(reason) = event.pointer("/data/error").and_then(Value::as_str) {
            return Err(LiveError::Job { device: disks[i].device.clone(), reason: reason.to_string() });
        }
        done[i] = true;
    }
    Ok(())
}

/// Reads `file` to its end and returns its sha256 (lower-case hex); with `punch`, every
/// all-zero MiB is also deallocated (`FALLOC_FL_PUNCH_HOLE`), so a copied raw disk takes only the
/// space its data needs. Blocking: call it off the runtime's workers.
///
/// # Errors
/// A read error, or a failed hole punch (other than a file system without hole support).
pub fn seal(file: &std::fs::File, punch: bool) -> std::io::Result<String> {
    use nix::fcntl::{fallocate, FallocateFlags};
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut offset: i64 = 0;
    let mut reader = file;
    let mut can_punch = punch;
    loop {
        let n = crate::images::read_full(&mut reader, &mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        if can_punch && buf[..n].iter().all(|b| *b == 0) {
            let flags = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
            match fallocate(file, flags, offset, n as i64) {
                Ok(()) => {}
                Err(nix::errno::Errno::EOPNOTSUPP) => can_punch = false,
                Err(e) => return Err(e.into()),
            }
        }
        offset += n as i64;
    }
    Ok(crate::qemu::integrity::hex(&hasher.finalize()))
}

#[cfg(test)]
mod tests;
