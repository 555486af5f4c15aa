//! Flat copies of a VM's disks, for `vm.export` (docs/backup.md): a disk and the layers below it
//! (an overlay and its base image) copied into one image with no backing file, by QEMU's
//! `blockdev-backup` job: without a guest ([`flatten`], a stopped VM) or in the VM's own QEMU
//! while the guest runs ([`start_live`]: one transaction, so every disk is copied as it was at
//! the same instant).
//!
//! Order of use: the caller makes each target file (empty; a raw one `virtual_size` long), then
//! [`flatten`], or [`start_live`] and [`finish_live`] (the guest's file systems may be frozen
//! just around the first), then [`seal`] each target (its sha256; a raw one made sparse
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
        let mut layers = Vec::new();
        for (fd, format) in disk.layers {
            layers.push((inputs.len(), format));
            inputs.push(Input::Layer(fd));
        }
        let target = inputs.len();
        inputs.push(Input::Image(disk.target));
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
/// the targets of [`start_live`].
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
}

fn step(step: &'static str) -> impl Fn(QmpError) -> LiveError {
    move |source| LiveError::Qmp { step, source }
}

/// The node and job names of live target `i`.
fn names(i: usize) -> (String, String) {
    (format!("vmhost-export{i}"), format!("vmhost-export-job{i}"))
}

/// The `transaction` that starts one copy per disk (device, sync mode) at the same instant.
pub fn transaction(disks: &[(&str, &str)]) -> Value {
    let actions: Vec<Value> = disks
        .iter()
        .enumerate()
        .map(|(i, (device, sync))| {
            let (node, job) = names(i);
            json!({ "type": "blockdev-backup",
                    "data": { "job-id": job, "device": device, "target": node, "sync": sync } })
        })
        .collect();
    json!({ "actions": actions })
}

/// Copies started by [`start_live`]: the fd sets to remove when they are done.
#[derive(Debug)]
#[must_use = "finish_live removes the copies' nodes and descriptors from QEMU"]
pub struct Started {
    sets: Vec<u64>,
}

/// Starts copying `disks` of the running QEMU behind `q` into their targets: the targets are
/// added as nodes over new fd sets and one transaction starts every copy at the same instant
/// (QEMU copies a block before the guest overwrites it, so the copies are of that instant).
/// Then [`finish_live`], also after an error of this one.
///
/// # Errors
/// [`LiveError::Qmp`]; the `Started` to finish comes with it.
pub async fn start_live(q: &mut Qmp, disks: &[LiveDisk]) -> (Started, Result<(), LiveError>) {
    let mut started = Started { sets: Vec::new() };
    let result = async {
        for (i, disk) in disks.iter().enumerate() {
            let (node, _) = names(i);
            let set = q.add_fd(disk.target.as_fd(), None, &node).await.map_err(step("add-fd"))?;
            started.sets.push(set);
            let mut add = json!({ "driver": disk.format, "node-name": node, "discard": "unmap", "detect-zeroes": "unmap",
                              "file": { "driver": "file", "filename": format!("/dev/fdset/{set}"), "locking": "off" } });
            if disk.format == "qcow2" {
                // A backing file its header names is the source's, never opened here.
                add["backing"] = Value::Null;
            }
            q.execute("blockdev-add", Some(add)).await.map_err(step("blockdev-add"))?;
        }
        let devices: Vec<(&str, &str)> = disks.iter().map(|d| (d.device.as_str(), d.sync)).collect();
        q.execute("transaction", Some(transaction(&devices))).await.map_err(step("transaction"))?;
        Ok(())
    }
    .await;
    (started, result)
}

/// Waits up to `within` for the copies [`start_live`] started (when `result`, its outcome, is
/// Ok), then removes the targets' nodes and fd sets (a job still running is cancelled first).
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
    let result = match result {
        Ok(()) => wait_jobs(q, disks, within).await,
        Err(e) => Err(e),
    };
    if result.is_err() {
        for i in 0..disks.len() {
            let _ = q.execute("block-job-cancel", Some(json!({ "device": names(i).1, "force": true }))).await;
        }
    }
    for i in 0..started.sets.len() {
        let _ = q.execute("blockdev-del", Some(json!({ "node-name": names(i).0 }))).await;
    }
    for set in started.sets {
        let _ = q.execute("remove-fd", Some(json!({ "fdset-id": set }))).await;
    }
    result
}

/// Waits for every copy job's `BLOCK_JOB_COMPLETED`.
async fn wait_jobs(q: &mut Qmp, disks: &[LiveDisk], within: Duration) -> Result<(), LiveError> {
    let deadline = tokio::time::Instant::now() + within;
    for (i, disk) in disks.iter().enumerate() {
        let (_, job) = names(i);
        let done = |e: &Value| {
            e.get("event").and_then(Value::as_str) == Some("BLOCK_JOB_COMPLETED")
                && e.pointer("/data/device").and_then(Value::as_str) == Some(job.as_str())
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let event = q.wait_event(done, left).await.map_err(step("BLOCK_JOB_COMPLETED"))?;
        let Some(event) = event else { return Err(LiveError::Timeout(within)) };
        if let Some(reason) = event.pointer("/data/error").and_then(Value::as_str) {
            return Err(LiveError::Job { device: disk.device.clone(), reason: reason.to_string() });
        }
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
    use std::io::Read;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut offset: i64 = 0;
    let mut reader = file;
    let mut can_punch = punch;
    loop {
        let mut n = 0;
        while n < buf.len() {
            match reader.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
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
