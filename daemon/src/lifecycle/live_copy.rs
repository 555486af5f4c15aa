//! Copying a running VM's disks (a snapshot or an export, [`super::snapshots`],
//! [`super::backup`]): every disk as it was at one instant, with the guest's file systems frozen
//! for that instant when its agent can.
//!
//! The order: QEMU's sizes of the disks (`query-block`); the empty targets made (0600, a raw one
//! at its size, a qcow2 one's header by QEMU without a guest); the guest agent's `fs.freeze`
//! (when a session is open; without one, or with an agent that cannot, the copy is
//! crash-consistent), the targets having been added to QEMU before; one QMP transaction
//! starting every copy ([`crate::disk::export`]);
//! `fs.thaw` right after (QEMU keeps copying what the guest overwrites from then on, so the
//! freeze lasts a few QMP round trips, not the copy); then the copies awaited.

use super::Manager;
use crate::api::ApiError;
use crate::disk::export::{LiveDisk, QcowTarget};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

/// How long the agent keeps the file systems frozen at most if no thaw comes.
const FREEZE_TIMEOUT_S: u32 = 10;

/// One disk of a running VM to copy.
#[derive(Debug)]
pub(super) struct Target {
    /// The QEMU block device or node (`virtio0`, `data-NAME`).
    pub device: String,
    /// The file to make.
    pub path: PathBuf,
    /// `qcow2` or `raw`.
    pub format: &'static str,
    /// What a qcow2 copy's header names as its backing file (an overlay's copy: its base).
    pub backing: Option<(PathBuf, String)>,
    /// `full` or `top` ([`LiveDisk::sync`]).
    pub sync: &'static str,
    /// The disk's size, filled in from QEMU.
    pub virtual_size: u64,
}

fn failed(step: &str, message: String) -> ApiError {
    super::provisioning(step, message)
}

impl Manager {
    /// Copies VM `name`'s disks into `targets` (module doc); `step` names the operation in
    /// errors. Returns the mount points the guest froze.
    ///
    /// # Errors
    /// 4001 with `step`.
    pub(super) async fn copy_disks_live(
        &self,
        name: &str,
        targets: &mut [Target],
        within: Duration,
        step: &str,
    ) -> Result<Vec<String>, ApiError> {
        let mut q = self.qmp(name, Duration::from_secs(5)).await.map_err(|e| failed(step, format!("QMP: {e}")))?;
        let blocks = q.execute("query-block", None).await.map_err(|e| failed(step, format!("query-block: {e}")))?;
        let mut qcow2 = Vec::new();
        let mut disks = Vec::new();
        for t in targets.iter_mut() {
            let found = blocks.as_array().into_iter().flatten().find(|b| {
                b.get("device").and_then(|v| v.as_str()) == Some(t.device.as_str())
                    || b.pointer("/inserted/node-name").and_then(|v| v.as_str()) == Some(t.device.as_str())
            });
            t.virtual_size = found
                .and_then(|b| b.pointer("/inserted/image/virtual-size"))
                .and_then(|v| v.as_u64())
                .ok_or_else(|| failed(step, format!("QEMU has no disk {}", t.device)))?;
            let raw = t.format == "raw";
            let fd = super::copies::create_target(&t.path, if raw { t.virtual_size } else { 0 }, step)?;
            if !raw {
                let copy = fd.try_clone().map_err(|e| failed(step, format!("cannot duplicate a descriptor: {e}")))?;
                qcow2.push(QcowTarget { fd: copy, bytes: t.virtual_size, backing: t.backing.clone() });
            }
            disks.push(LiveDisk { device: t.device.clone(), target: fd, format: t.format, sync: t.sync });
        }
        crate::disk::export::make_qcow2_targets(&self.disk_tool(), qcow2)
            .await
            .map_err(|e| failed(step, format!("cannot make the copies: {e}")))?;
        let (mut started, mut result) = crate::disk::export::prepare_live(&mut q, &disks).await;
        let mut frozen = None;
        if result.is_ok() {
            frozen = self.freeze_guest(name).await;
            result = crate::disk::export::trigger_live(&mut q, &mut started, &disks).await;
            if frozen.is_some() {
                self.thaw_guest(name).await;
            }
        }
        crate::disk::export::finish_live(&mut q, started, &disks, result, within)
            .await
            .map_err(|e| failed(step, format!("cannot copy the running VM's disks: {e}")))?;
        Ok(frozen.unwrap_or_default())
    }

    /// The guest agent's `fs.freeze`: the mount points frozen, `None` when it could not be
    /// asked (no session, an agent without it) or failed (logged): the copy is then
    /// crash-consistent.
    async fn freeze_guest(&self, name: &str) -> Option<Vec<String>> {
        let params = json!({ "timeout_s": FREEZE_TIMEOUT_S });
        match self.agents.call::<vmhost_agent_protocol::FreezeReport>(name, "fs.freeze", params).await {
            Ok(report) => {
                tracing::info!(vm = name, mounts = ?report.mounts, "guest file systems frozen");
                Some(report.mounts)
            }
            Err(e) => {
                tracing::info!(vm = name, error = %e, "guest file systems not frozen: the copy is crash-consistent");
                None
            }
        }
    }

    /// The guest agent's `fs.thaw` (its own watchdog thaws anyway after the freeze's timeout).
    async fn thaw_guest(&self, name: &str) {
        if let Err(e) = self.agents.call::<vmhost_agent_protocol::FreezeReport>(name, "fs.thaw", json!({})).await {
            tracing::warn!(vm = name, error = %e, "fs.thaw failed; the agent thaws by itself after its timeout");
        }
    }
}
