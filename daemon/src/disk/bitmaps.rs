//! Persistent dirty bitmaps for incremental backups (docs/backup.md): each backup leaves a
//! bitmap `vmhost-backup-ID` on every qcow2 disk it copied, added at the instant of its copy,
//! so the next backup copies only the clusters written since (`sync: incremental`).
//!
//! Why here: the bitmaps live in the qcow2 files and only QEMU reads or writes them, in the
//! VM's own QEMU while it runs ([`live_state`], [`remove_live`]) and in an offline session
//! (QEMU without a guest, [`super::offline_qemu`]) while it is stopped ([`export_offline`],
//! [`remove_offline`]). A bitmap QEMU did not store at a clean close (QEMU killed) is
//! `inconsistent` and never used: that disk's next backup is full.
//!
//! Order of use, per export: the bitmaps found ([`live_state`], or inside
//! [`export_offline`]); the copies started in one transaction with the new backup's bitmap
//! ([`add_action`], [`backup_action`]); after the backup is sealed, every other
//! `vmhost-backup-*` bitmap removed ([`remove_live`], [`remove_offline`]). Restoring a chain
//! is [`super::export::flatten`] over the chain's files, bottom first.

use super::offline_qemu::{input_path, Input, Session, Tool};
use super::{bounded, bounded_within, DiskError};
use crate::qemu::qmp::{Qmp, QmpError};
use serde_json::{json, Value};
use std::os::fd::OwnedFd;
use std::time::Duration;

/// What a disk holds of the bitmap a backup would build on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tracking {
    /// The bitmap is there and usable.
    Tracked,
    /// Not there (never added, removed by a revert, a disk replaced, imported or moved).
    Absent,
    /// There but not stored at a clean close (QEMU killed): unusable.
    Inconsistent,
}

/// One bitmap as QEMU lists it (`BlockDirtyInfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bitmap {
    /// Its name.
    pub name: String,
    /// Not stored at a clean close: unusable.
    pub inconsistent: bool,
}

/// The bitmaps of a `dirty-bitmaps` list (of `query-block`'s `inserted` or a node of
/// `query-named-block-nodes`).
pub fn parse(list: Option<&Value>) -> Vec<Bitmap> {
    list.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|b| {
            Some(Bitmap {
                name: b.get("name")?.as_str()?.to_string(),
                inconsistent: b.get("inconsistent").and_then(Value::as_bool).unwrap_or(false),
            })
        })
        .collect()
}

/// What `bitmaps` hold of bitmap `wanted` (none: no parent, [`Tracking::Absent`]).
pub fn tracking(bitmaps: &[Bitmap], wanted: Option<&str>) -> Tracking {
    match wanted.and_then(|w| bitmaps.iter().find(|b| b.name == w)) {
        None => Tracking::Absent,
        Some(b) if b.inconsistent => Tracking::Inconsistent,
        Some(_) => Tracking::Tracked,
    }
}

/// The `vmhost-backup-*` bitmaps of `bitmaps` other than `keep`: what goes once a backup is
/// sealed (its parent's, and any a failed or interrupted backup left).
pub fn stale<'a>(bitmaps: &'a [Bitmap], keep: &str) -> Vec<&'a str> {
    bitmaps
        .iter()
        .map(|b| b.name.as_str())
        .filter(|n| n.starts_with(crate::backup::BITMAP_PREFIX) && *n != keep)
        .collect()
}

/// The transaction action adding persistent bitmap `name` to `node`.
pub fn add_action(node: &str, name: &str) -> Value {
    json!({ "type": "block-dirty-bitmap-add", "data": { "node": node, "name": name, "persistent": true } })
}

/// The transaction action copying `device` into `target` as job `job`: everything, or with
/// `bitmap` only its dirty clusters (`sync: bitmap` with `bitmap-mode: never`: QEMU 7.2 allows
/// no other mode with `sync: incremental`; the bitmap is left as it is).
pub fn backup_action(job: &str, device: &str, target: &str, bitmap: Option<&str>) -> Value {
    let mut data = json!({ "job-id": job, "device": device, "target": target, "sync": "full" });
    if let Some(b) = bitmap {
        data["sync"] = json!("bitmap");
        data["bitmap"] = json!(b);
        data["bitmap-mode"] = json!("never");
    }
    json!({ "type": "blockdev-backup", "data": data })
}

/// The bitmaps of a running VM's disk `device` (a device or node name), from `query-block`.
///
/// # Errors
/// QMP's.
pub async fn live_state(q: &mut Qmp, device: &str) -> Result<Vec<Bitmap>, QmpError> {
    let blocks = q.execute("query-block", None).await?;
    let found = blocks.as_array().into_iter().flatten().find(|b| {
        b.get("device").and_then(Value::as_str) == Some(device)
            || b.pointer("/inserted/node-name").and_then(Value::as_str) == Some(device)
    });
    Ok(parse(found.and_then(|b| b.pointer("/inserted/dirty-bitmaps"))))
}

/// Removes bitmaps `names` from running VM disk `device`.
///
/// # Errors
/// QMP's (the first failure; the rest are still tried).
pub async fn remove_live(q: &mut Qmp, device: &str, names: &[&str]) -> Result<(), QmpError> {
    let mut first = Ok(());
    for name in names {
        let r = q.execute("block-dirty-bitmap-remove", Some(json!({ "node": device, "name": name }))).await;
        if let Err(e) = r {
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

/// One disk of a stopped VM to copy into a backup.
#[derive(Debug)]
pub struct OfflineDisk {
    /// Its layers, bottom first, each with its format; the top read-write when `track`.
    pub layers: Vec<(OwnedFd, String)>,
    /// Whether the top is a qcow2 that gets the new bitmap (and may use the parent's).
    pub track: bool,
    /// The empty target, read-write.
    pub target: OwnedFd,
    /// `qcow2` or `raw` (an incremental copy is always a qcow2).
    pub format: &'static str,
    /// The disk's virtual size.
    pub virtual_size: u64,
}

/// Copies each disk of a stopped VM into its target in one QEMU without a guest: a tracked
/// disk holding a usable `parent` bitmap only its dirty clusters, every other disk whole; the
/// new bitmap `new` is added to every tracked disk in the same transaction that starts the
/// copies. Returns each disk's [`Tracking`] of `parent` (incremental exactly when
/// [`Tracking::Tracked`] and `incremental`).
///
/// # Errors
/// QEMU's ([`DiskError::Tool`]), [`DiskError::Timeout`] after `within`.
pub async fn export_offline(
    tool: &Tool,
    disks: Vec<OfflineDisk>,
    new: &str,
    parent: Option<&str>,
    within: Duration,
) -> Result<Vec<Tracking>, DiskError> {
    let mut inputs = Vec::new();
    let mut plan = Vec::new();
    for disk in disks {
        let (layers, target) = super::offline_qemu::push_disk(&mut inputs, disk.layers, Input::Image, disk.target);
        plan.push((layers, disk.track, target, disk.format, disk.virtual_size));
    }
    bounded_within("export", within, async {
        let mut s = Session::start(tool, inputs, "export").await?;
        let mut actions = Vec::new();
        let mut found = Vec::new();
        for (d, (layers, track, target, format, bytes)) in plan.iter().enumerate() {
            let top = add_layers(&mut s, layers, *track).await?;
            let state = if *track {
                let nodes = s.execute("query-named-block-nodes", Some(json!({ "flat": true }))).await?;
                let node = nodes
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|n| n.get("node-name").and_then(Value::as_str) == Some(top.as_str()));
                tracking(&parse(node.and_then(|n| n.get("dirty-bitmaps"))), parent)
            } else {
                Tracking::Absent
            };
            let target_node = add_target(&mut s, *target, format, *bytes).await?;
            if *track {
                actions.push(add_action(&top, new));
            }
            let bitmap = if state == Tracking::Tracked { parent } else { None };
            actions.push(backup_action(&format!("bk-job{d}"), &top, &target_node, bitmap));
            found.push(state);
        }
        for a in &mut actions {
            if a["type"] == "blockdev-backup" {
                a["data"]["auto-dismiss"] = json!(false);
            }
        }
        s.execute("transaction", Some(json!({ "actions": actions }))).await?;
        for d in 0..plan.len() {
            s.wait_job_until(&format!("bk-job{d}"), within).await?;
        }
        s.finish().await?;
        Ok(found)
    })
    .await
}

/// Removes every `vmhost-backup-*` bitmap but `keep` from each of `disks` (qcow2 files of a
/// stopped VM, read-write; their backing files are not opened).
///
/// # Errors
/// QEMU's.
pub async fn remove_offline(tool: &Tool, disks: Vec<OwnedFd>, keep: &str) -> Result<(), DiskError> {
    if disks.is_empty() {
        return Ok(());
    }
    let n = disks.len();
    let inputs = disks.into_iter().map(Input::Image).collect();
    bounded("bitmaps", async {
        let mut s = Session::start(tool, inputs, "bitmaps").await?;
        for i in 0..n {
            let top = add_layers(&mut s, &[(i, "qcow2".to_string())], true).await?;
            let nodes = s.execute("query-named-block-nodes", Some(json!({ "flat": true }))).await?;
            let node = nodes
                .as_array()
                .into_iter()
                .flatten()
                .find(|n| n.get("node-name").and_then(Value::as_str) == Some(top.as_str()));
            let bitmaps = parse(node.and_then(|n| n.get("dirty-bitmaps")));
            for name in stale(&bitmaps, keep) {
                s.execute("block-dirty-bitmap-remove", Some(json!({ "node": top, "name": name }))).await?;
            }
        }
        s.finish().await
    })
    .await
}

/// Opens inputs `layers` (bottom first) as one chain, each qcow2 layer's backing the node
/// below (the bottom none) whatever its header names; the top read-write when `writable`.
async fn add_layers(s: &mut Session, layers: &[(usize, String)], writable: bool) -> Result<String, DiskError> {
    let mut below: Option<String> = None;
    for (k, (i, format)) in layers.iter().enumerate() {
        let ro = !(writable && k + 1 == layers.len());
        let file = format!("bk-file{i}");
        s.execute(
            "blockdev-add",
            Some(json!({ "driver": "file", "node-name": file, "filename": input_path(*i), "read-only": ro })),
        )
        .await?;
        let node = format!("bk-layer{i}");
        let mut add = json!({ "driver": format, "node-name": node, "file": file, "read-only": ro });
        if format == "qcow2" {
            add["backing"] = below.as_ref().map_or(Value::Null, |b| json!(b));
        }
        s.execute("blockdev-add", Some(add)).await?;
        below = Some(node);
    }
    below.ok_or_else(|| DiskError::Output("a chain of no layer".to_string()))
}

/// Makes input `i` (an empty file; a raw one already `bytes` long) a target node: a qcow2 of
/// `bytes` with no backing, or raw; zeros written become holes or zero clusters.
async fn add_target(s: &mut Session, i: usize, format: &str, bytes: u64) -> Result<String, DiskError> {
    let file = format!("bk-tfile{i}");
    s.execute(
        "blockdev-add",
        Some(json!({ "driver": "file", "node-name": file, "filename": input_path(i), "discard": "unmap" })),
    )
    .await?;
    if format == "qcow2" {
        let job = format!("bk-create{i}");
        let options = json!({ "driver": "qcow2", "file": file, "size": bytes });
        s.execute("blockdev-create", Some(json!({ "job-id": job, "options": options }))).await?;
        s.wait_job_until(&job, Duration::from_secs(30)).await?;
    }
    let node = format!("bk-target{i}");
    let mut add =
        json!({ "driver": format, "node-name": node, "file": file, "discard": "unmap", "detect-zeroes": "unmap" });
    if format == "qcow2" {
        add["backing"] = Value::Null;
    }
    s.execute("blockdev-add", Some(add)).await?;
    Ok(node)
}

#[cfg(test)]
mod tests;
