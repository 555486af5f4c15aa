//! qcow2 internal snapshots (docs/snapshots.md): a snapshot of a qcow2 disk kept inside its own
//! file, taken in constant time (QEMU copies the L1 table and raises refcounts; no data block is
//! read), its blocks shared with the disk until the guest overwrites them.
//!
//! A running VM's QEMU takes and deletes them itself ([`take_actions`] go into the transaction
//! that also starts the raw disks' copies; [`delete_live`]). A stopped VM's disks are worked on
//! in an offline QEMU session ([`super::offline_qemu`], files as descriptors, never by name),
//! in this order per operation: [`take`] (one transaction of `blockdev-snapshot-internal-sync`),
//! [`delete`] (each tag where present), [`revert`]. Each is bounded by the caller's `within`
//! (the operation's `timeout_s`), which also lets each QMP call and job of the session run that
//! long: on a large disk a step's refcount updates may take far longer than a small call.
//!
//! Why the revert is roundabout: QEMU 7.2 has no QMP command that applies a disk-only internal
//! snapshot (`snapshot-load` wants a VM state; `qemu-img snapshot -a` cannot open our files, see
//! offline_qemu.rs). [`revert`] therefore saves a tiny VM state of the guestless machine under
//! the same tag into a scratch qcow2 (`aux`), then loads the tag with `aux` as the state and the
//! disks as the devices: each disk goes back to its internal snapshot. Persistent dirty bitmaps
//! named `vmhost-*` (the incremental backups' change tracking) are removed first: QEMU refuses
//! to apply a snapshot to a disk with bitmaps, and after a revert they would be wrong anyway.

use super::offline_qemu::{Input, Session};
use super::{DiskError, Tool};
use crate::qemu::qmp::{Qmp, QmpError};
use serde_json::{json, Value};
use std::os::fd::OwnedFd;
use std::time::Duration;

/// Size of the scratch image a revert saves the guestless machine's state into.
pub const AUX_BYTES: u64 = 1 << 20;

/// Prefix of the bitmaps a revert removes (vmhostd's own).
const BITMAP_PREFIX: &str = "vmhost-";

/// The transaction actions that take internal snapshot `tag` of each of `devices` (a running
/// VM's block devices or nodes, or a session's nodes).
pub fn take_actions(devices: &[&str], tag: &str) -> Vec<Value> {
    devices
        .iter()
        .map(|d| json!({ "type": "blockdev-snapshot-internal-sync", "data": { "device": d, "name": tag } }))
        .collect()
}

/// The internal snapshots' names of each node in a `query-named-block-nodes` answer, by node.
fn snapshot_names(nodes: &Value, node: &str) -> Vec<String> {
    nodes
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n.get("node-name").and_then(Value::as_str) == Some(node))
        .and_then(|n| n.pointer("/image/snapshots"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| s.get("name").and_then(Value::as_str).map(str::to_string))
        .collect()
}

/// The `vmhost-*` persistent bitmaps of `node` in a `query-named-block-nodes` answer.
fn vmhost_bitmaps(nodes: &Value, node: &str) -> Vec<String> {
    nodes
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n.get("node-name").and_then(Value::as_str) == Some(node))
        .and_then(|n| n.get("dirty-bitmaps"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|b| b.get("name").and_then(Value::as_str))
        .filter(|n| n.starts_with(BITMAP_PREFIX))
        .map(str::to_string)
        .collect()
}

/// Opens `disks` (qcow2 files, read-write) in a new session for `operation` whose calls may
/// each take up to `within`; returns it and their nodes, in order. `extra` inputs come after
/// the disks.
async fn open(
    tool: &Tool,
    disks: Vec<OwnedFd>,
    extra: Vec<OwnedFd>,
    operation: &'static str,
    within: Duration,
) -> Result<(Session, Vec<String>), DiskError> {
    let count = disks.len();
    let inputs = disks.into_iter().chain(extra).map(Input::Image).collect();
    let mut session = Session::start(tool, inputs, operation).await?;
    session.allow(within);
    let mut nodes = Vec::new();
    for i in 0..count {
        nodes.push(session.open_qcow2(i).await?);
    }
    Ok((session, nodes))
}

/// Takes internal snapshot `tag` of every disk of `disks` (qcow2 files, read-write) at once.
///
/// # Errors
/// QEMU's errors ([`DiskError::Tool`]), [`DiskError::Timeout`] after `within`.
pub async fn take(tool: &Tool, disks: Vec<OwnedFd>, tag: &str, within: Duration) -> Result<(), DiskError> {
    if disks.is_empty() {
        return Ok(());
    }
    super::bounded_within("snapshot", within, async {
        let (mut session, nodes) = open(tool, disks, Vec::new(), "snapshot", within).await?;
        let devices: Vec<&str> = nodes.iter().map(String::as_str).collect();
        session.execute("transaction", Some(json!({ "actions": take_actions(&devices, tag) }))).await?;
        session.finish().await
    })
    .await
}

/// Deletes every tag of `tags` from every disk of `disks` that holds it (a tag a disk does not
/// hold is no error: a crash may have come before it was made or after it was deleted).
///
/// # Errors
/// QEMU's errors ([`DiskError::Tool`]), [`DiskError::Timeout`] after `within`.
pub async fn delete(tool: &Tool, disks: Vec<OwnedFd>, tags: &[String], within: Duration) -> Result<(), DiskError> {
    if disks.is_empty() || tags.is_empty() {
        return Ok(());
    }
    super::bounded_within("delete a snapshot of", within, async {
        let (mut session, nodes) = open(tool, disks, Vec::new(), "delete a snapshot of", within).await?;
        let listed = session.execute("query-named-block-nodes", Some(json!({ "flat": true }))).await?;
        for node in &nodes {
            let held = snapshot_names(&listed, node);
            for tag in tags.iter().filter(|t| held.contains(t)) {
                let args = json!({ "device": node, "name": tag });
                session.execute("blockdev-snapshot-delete-internal-sync", Some(args)).await?;
            }
        }
        session.finish().await
    })
    .await
}

/// Which disks of `disks` (qcow2 files) do not hold internal snapshot `tag`, by index: checked
/// before a revert records its intent (a disk replaced since, a file changed by hand).
///
/// # Errors
/// QEMU's errors ([`DiskError::Tool`]), [`DiskError::Timeout`] after `within`.
pub async fn missing(tool: &Tool, disks: Vec<OwnedFd>, tag: &str, within: Duration) -> Result<Vec<usize>, DiskError> {
    if disks.is_empty() {
        return Ok(Vec::new());
    }
    super::bounded_within("read the snapshots of", within, async {
        let (mut session, nodes) = open(tool, disks, Vec::new(), "read the snapshots of", within).await?;
        let listed = session.execute("query-named-block-nodes", Some(json!({ "flat": true }))).await?;
        let missing = nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| !snapshot_names(&listed, n).iter().any(|t| t == tag))
            .map(|(i, _)| i);
        let missing = missing.collect();
        session.finish().await?;
        Ok(missing)
    })
    .await
}

/// Puts every disk of `disks` (qcow2 files, read-write) back as it was at internal snapshot
/// `tag`, using `aux` (an empty file, removed by the caller afterwards) as the scratch image
/// (module doc). Running it again is harmless.
///
/// # Errors
/// QEMU's errors ([`DiskError::Tool`]: a disk without the tag), [`DiskError::Timeout`] after
/// `within`.
pub async fn revert(
    tool: &Tool,
    disks: Vec<OwnedFd>,
    aux: OwnedFd,
    tag: &str,
    within: Duration,
) -> Result<(), DiskError> {
    if disks.is_empty() {
        return Ok(());
    }
    super::bounded_within("revert", within, async {
        let count = disks.len();
        let (mut session, nodes) = open(tool, disks, vec![aux], "revert", within).await?;
        let listed = session.execute("query-named-block-nodes", Some(json!({ "flat": true }))).await?;
        for node in &nodes {
            if !snapshot_names(&listed, node).iter().any(|t| t == tag) {
                return Err(DiskError::Output(format!("a disk has no internal snapshot {tag}")));
            }
            for bitmap in vmhost_bitmaps(&listed, node) {
                let args = json!({ "node": node, "name": bitmap });
                session.execute("block-dirty-bitmap-remove", Some(args)).await?;
            }
        }
        session.create_qcow2(count, AUX_BYTES, None, false).await?;
        let aux = session.open_qcow2(count).await?;
        let save = json!({ "job-id": "save", "tag": tag, "vmstate": aux, "devices": [aux] });
        session.execute("snapshot-save", Some(save)).await?;
        session.run_job("save").await?;
        let mut devices = vec![aux.clone()];
        devices.extend(nodes);
        let load = json!({ "job-id": "load", "tag": tag, "vmstate": aux, "devices": devices });
        session.execute("snapshot-load", Some(load)).await?;
        session.run_job("load").await?;
        session.finish().await
    })
    .await
}

/// Internal snapshot names of the running VM's `device` (a block device or node).
async fn live_names(q: &mut Qmp, device: &str) -> Result<Vec<String>, QmpError> {
    let blocks = q.execute("query-block", None).await?;
    let block = blocks.as_array().into_iter().flatten().find(|b| {
        b.get("device").and_then(Value::as_str) == Some(device)
            || b.pointer("/inserted/node-name").and_then(Value::as_str) == Some(device)
    });
    Ok(block
        .and_then(|b| b.pointer("/inserted/image/snapshots"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| s.get("name").and_then(Value::as_str).map(str::to_string))
        .collect())
}

/// Deletes every tag of `tags` that `device` of the running VM behind `q` holds.
///
/// # Errors
/// QMP's errors.
pub async fn delete_live(q: &mut Qmp, device: &str, tags: &[String]) -> Result<(), QmpError> {
    let held = live_names(q, device).await?;
    for tag in tags.iter().filter(|t| held.contains(t)) {
        q.execute("blockdev-snapshot-delete-internal-sync", Some(json!({ "device": device, "name": tag }))).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
