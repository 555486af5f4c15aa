//! Copying a running VM's disks (a snapshot or an export, [`super::snapshots`],
//! [`super::backup`]): every disk as it was at one instant, with the guest's file systems frozen
//! for that instant when its agent can, and the copy saying which it is ([`CopyConsistency`]).
//!
//! The order: with `requires: "frozen"`, a VM without an agent session is refused
//! ([`check_requires`], before the caller makes anything); QEMU's sizes of the disks
//! (`query-block`); the empty targets made (0600, a raw one at its size, a qcow2 one's header by
//! QEMU without a guest) and added to QEMU; the guest agent's `fs.freeze` (when a session is
//! open); what the copy will be ([`consistency_of`]): `frozen` only when the agent froze at least
//! one file system and skipped none, `crash` with the reason otherwise, and with `requires:
//! "frozen"` a `crash` copy stops here (thawed, the targets removed from QEMU, 4094: no copy was
//! started); one QMP transaction starting every copy ([`crate::disk::export`]); `fs.thaw` right
//! after, whenever a freeze was asked (QEMU keeps copying what the guest overwrites from then on,
//! so the freeze lasts a few QMP round trips, not the copy); a `frozen` copy whose transaction
//! answered [`FREEZE_TIMEOUT_S`] or more after the freeze was asked is `crash` (the agent's
//! watchdog may have thawed first: [`frozen_until_started`]), and under `requires: "frozen"` its
//! started jobs are cancelled (4094, nothing kept); then the copies awaited.
//!
//! A stopped VM's copy is known before anything is made ([`check_requires`]).
//!
//! [`VmOp::copy_disks_live`] and the freeze and thaw it uses are steps of the operation that
//! holds the VM: an export (`VmOp::export_live`, [`super::backup`]) or a snapshot
//! ([`super::snapshots`]). [`check_requires`] is a function taking the manager, not a step:
//! it reads only the record and the agent hub, before the caller makes anything.

use super::errors::{DiskStepError, FileError, QemuStepError};
use super::op::VmOp;
use super::Manager;
use crate::api::snapshots::{Consistency, CopyConsistency, Requirement};
use crate::api::{ApiError, Code};
use crate::disk::export::{LiveDisk, QcowTarget};
use crate::guest_text::{GuestList, GuestText};
use crate::state::VmRecord;
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;
use vmhost_agent_protocol::FreezeReport;

/// How long the agent keeps the file systems frozen at most if no thaw comes.
const FREEZE_TIMEOUT_S: u32 = 10;

/// Skipped file systems a reason names one by one; more are counted.
const REASON_NAMES: usize = 4;

/// What asking the guest agent to freeze came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Freeze {
    /// No agent session (the message says why).
    NoAgent(String),
    /// `fs.freeze` failed: refused by the agent, no answer in time, an invalid answer.
    Failed(String),
    /// The agent's report.
    Done(FreezeReport),
}

/// What a live copy made after `freeze` is (module doc).
pub(super) fn consistency_of(freeze: &Freeze) -> CopyConsistency {
    let crash = CopyConsistency::crash;
    match freeze {
        Freeze::NoAgent(why) => crash(format!("the guest's file systems were not frozen: {why}")),
        Freeze::Failed(why) => crash(format!("the guest agent's fs.freeze failed: {why}")),
        Freeze::Done(report) => {
            let frozen = report.mounts.clone();
            let reason = match &report.skipped {
                None => Some(
                    "the guest agent does not report the file systems it could not freeze (a vmhost-agent older \
                     than this vmhostd): update it"
                        .to_string(),
                ),
                Some(skipped) if !skipped.is_empty() => {
                    let mut named: Vec<String> = skipped
                        .iter()
                        .take(REASON_NAMES)
                        .map(|s| format!("{} ({}: {})", GuestText(&s.mount), GuestText(&s.fstype), GuestText(&s.error)))
                        .collect();
                    if skipped.len() > REASON_NAMES {
                        named.push(format!("{} more", skipped.len() - REASON_NAMES));
                    }
                    Some(format!(
                        "the guest agent could not freeze {} writable file system(s), left as they were: {}",
                        skipped.len(),
                        named.join(", ")
                    ))
                }
                Some(_) if frozen.is_empty() => Some(
                    "the guest agent found no file system to freeze (none writable on a block device: the guest's \
                     root is in memory, or its disks are not mounted)"
                        .to_string(),
                ),
                Some(_) => None,
            };
            CopyConsistency {
                consistency: if reason.is_some() { Consistency::Crash } else { Consistency::Frozen },
                reason,
                frozen,
                skipped: report.skipped.clone().unwrap_or_default(),
            }
        }
    }
}

/// What a live copy whose freeze came to `c` is, given that the transaction starting the copies
/// answered `held` after the freeze was asked: the agent thaws by itself [`FREEZE_TIMEOUT_S`]
/// after its answer, so a `frozen` copy started that late or later may be of thawed file
/// systems, and is `crash` with why (the mounts it froze are still listed).
pub(super) fn frozen_until_started(c: CopyConsistency, held: Duration) -> CopyConsistency {
    let limit = Duration::from_secs(u64::from(FREEZE_TIMEOUT_S));
    if c.consistency != Consistency::Frozen || held < limit {
        return c;
    }
    CopyConsistency {
        consistency: Consistency::Crash,
        reason: Some(format!(
            "the copies started {:.1} s after the guest agent was asked to freeze, not within its {FREEZE_TIMEOUT_S} s \
             freeze timeout: the guest may have thawed by then",
            held.as_secs_f64()
        )),
        ..c
    }
}

/// Mount points a guest reported, for a log line: at most [`REASON_NAMES`] of them, each
/// escaped and cut ([`GuestText`]), and how many more there are.
fn logged_mounts(mounts: &[String]) -> String {
    let shown = GuestList(&mounts[..mounts.len().min(REASON_NAMES)]).to_string();
    match mounts.len().saturating_sub(REASON_NAMES) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

/// 4094: `requires: "frozen"` and the copy of VM `name` would be `crash`; `step` is the
/// operation (`snapshot`, `export`). Nothing was copied.
pub(super) fn not_frozen(name: &str, step: &str, c: &CopyConsistency) -> ApiError {
    let reason = c.reason.clone().unwrap_or_default();
    ApiError::new(
        Code::NotFrozen,
        format!(
            "VM {name:?}'s {step} would be crash-consistent and requires is \"frozen\": {reason}; nothing was copied"
        ),
    )
    .field("requires")
    .details(json!({
        "consistency": c.consistency.as_str(),
        "reason": reason,
        "frozen": c.frozen,
        "skipped": c.skipped,
    }))
}

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

/// What can be known of a copy of VM `rec` before anything is made, checked against
/// `requires`: a stopped VM's copy is what [`super::copies::stopped_copy`] says (returned);
/// a running VM's is known only once the freeze answered ([`VmOp::copy_disks_live`]),
/// but without an agent session it cannot be frozen.
///
/// # Errors
/// 4094 when `requires` is `frozen` and the copy would be `crash`: a stopped VM whose disks
/// were not left by a clean power-off, a running VM whose agent has no session.
pub(super) fn check_requires(
    mgr: &Manager,
    rec: &VmRecord,
    live: bool,
    requires: Option<Requirement>,
    step: &str,
) -> Result<Option<CopyConsistency>, ApiError> {
    let name = rec.name();
    if !live {
        let made = super::copies::stopped_copy(rec);
        if !made.meets(requires) {
            tracing::warn!(vm = name, step, reason = ?made.reason, "refused: the copy would be crash-consistent");
            return Err(not_frozen(name, step, &made));
        }
        return Ok(Some(made));
    }
    if requires.is_none() || mgr.agents.status(name).connected {
        return Ok(None);
    }
    let why = format!("the guest agent of VM {name:?} is not connected");
    Err(not_frozen(name, step, &consistency_of(&Freeze::NoAgent(why))))
}

impl VmOp {
    /// Copies the VM's disks into `targets` (module doc), with `extras` in the transaction that
    /// starts the copies (an incremental backup's bitmaps, [`crate::disk::bitmaps`]; a
    /// snapshot's internal snapshots, [`crate::disk::internal_snapshots`]): all at the same
    /// instant or none. `step` names the operation in errors. Returns what the copy is.
    ///
    /// # Errors
    /// 4001 with `step`; 4094 when `requires` is `frozen` and the guest's file systems were not
    /// all frozen (no copy was started; the caller removes the targets).
    pub(super) async fn copy_disks_live(
        &self,
        targets: &mut [Target],
        within: Duration,
        requires: Option<Requirement>,
        step: &str,
        extras: &crate::disk::export::Extras,
    ) -> Result<CopyConsistency, ApiError> {
        let name = self.name();
        let mgr = self.mgr();
        let qmp = |what| move |source| QemuStepError::Qmp { step: step.into(), what, source };
        let mut q = mgr.qmp(name, Duration::from_secs(5)).await.map_err(qmp("QMP"))?;
        let blocks = q.execute("query-block", None).await.map_err(qmp("query-block"))?;
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
                let copy = fd.try_clone().map_err(FileError::unnamed(step, "duplicate a descriptor"))?;
                qcow2.push(QcowTarget { fd: copy, bytes: t.virtual_size, backing: t.backing.clone() });
            }
            disks.push(LiveDisk { device: t.device.clone(), target: fd, format: t.format, sync: t.sync });
        }
        crate::disk::export::make_qcow2_targets(&mgr.disk_tool(), qcow2)
            .await
            .map_err(|source| DiskStepError::MakeCopies { step: step.into(), source })?;
        let (mut started, mut result) = crate::disk::export::prepare_live(&mut q, &disks).await;
        let mut made = None;
        if result.is_ok() {
            // The agent's watchdog runs from its answer, so timing from the request is on the safe side.
            let asked = tokio::time::Instant::now();
            let freeze = self.freeze_guest().await;
            let consistency = consistency_of(&freeze);
            // Whatever the freeze answered (a timeout, an answer refused), something may be frozen.
            let thaw = !matches!(freeze, Freeze::NoAgent(_));
            if !consistency.meets(requires) {
                if thaw {
                    self.thaw_guest().await;
                }
                // Nothing was started: this only takes the targets out of QEMU again.
                if let Err(e) = crate::disk::export::finish_live(&mut q, started, &disks, Ok(()), within).await {
                    tracing::warn!(vm = name, error = %e, "removing the unused copies from QEMU failed");
                }
                tracing::warn!(vm = name, step, reason = ?consistency.reason, "refused: the copy would be crash-consistent");
                return Err(not_frozen(name, step, &consistency));
            }
            result = crate::disk::export::trigger_live_with(&mut q, &mut started, &disks, extras).await;
            let held = asked.elapsed();
            if thaw {
                self.thaw_guest().await;
            }
            let consistency = frozen_until_started(consistency, held);
            if result.is_ok() && !consistency.meets(requires) {
                // The copies started after the agent may have thawed: cancelled, nothing kept.
                let cancel = Err(crate::disk::export::LiveError::Abandoned("the copy would be crash-consistent"));
                if let Err(e) = crate::disk::export::finish_live(&mut q, started, &disks, cancel, within).await {
                    tracing::info!(vm = name, step, outcome = %e, "the started copies were cancelled");
                }
                tracing::warn!(vm = name, step, reason = ?consistency.reason, "refused: the copy would be crash-consistent");
                return Err(not_frozen(name, step, &consistency));
            }
            made = Some(consistency);
        }
        crate::disk::export::finish_live(&mut q, started, &disks, result, within)
            .await
            .map_err(|source| QemuStepError::LiveCopy { step: step.into(), source })?;
        let made = made.ok_or_else(|| failed(step, "the copies were not started".to_string()))?;
        match (&made.consistency, &made.reason) {
            (Consistency::Crash, Some(reason)) => {
                tracing::warn!(vm = name, step, %reason, "the copy of the running VM is crash-consistent");
            }
            _ => tracing::info!(
                vm = name,
                step,
                frozen = made.frozen.len(),
                mounts = %logged_mounts(&made.frozen),
                "the copy of the running VM is frozen"
            ),
        }
        Ok(made)
    }

    /// The guest agent's `fs.freeze` ([`Freeze`]).
    async fn freeze_guest(&self) -> Freeze {
        let params = json!({ "timeout_s": FREEZE_TIMEOUT_S });
        match self.mgr().agents.call::<FreezeReport>(self.name(), "fs.freeze", params).await {
            Ok(report) => Freeze::Done(report),
            Err(e) if e.code == Code::AgentNotConnected => Freeze::NoAgent(e.message),
            Err(e) => Freeze::Failed(e.message),
        }
    }

    /// The guest agent's `fs.thaw` (its own watchdog thaws anyway after the freeze's timeout).
    async fn thaw_guest(&self) {
        if let Err(e) = self.mgr().agents.call::<FreezeReport>(self.name(), "fs.thaw", json!({})).await {
            tracing::warn!(vm = self.name(), error = %e, "fs.thaw failed; the agent thaws by itself after its timeout");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmhost_agent_protocol::FreezeSkip;

    fn done(mounts: &[&str], skipped: Option<Vec<FreezeSkip>>) -> Freeze {
        Freeze::Done(FreezeReport { mounts: mounts.iter().map(|m| m.to_string()).collect(), skipped })
    }

    fn skip(mount: &str) -> FreezeSkip {
        FreezeSkip {
            mount: mount.into(),
            fstype: "vfat".into(),
            errno: 95,
            error: "Operation not supported (os error 95)".into(),
        }
    }

    #[test]
    fn frozen_only_when_something_was_frozen_and_nothing_skipped() {
        let c = consistency_of(&done(&["/", "/nsm"], Some(vec![])));
        assert_eq!(
            c,
            CopyConsistency {
                consistency: Consistency::Frozen,
                reason: None,
                frozen: vec!["/".into(), "/nsm".into()],
                skipped: vec![]
            }
        );
        assert!(c.meets(Some(Requirement::Frozen)));
    }

    #[test]
    fn every_other_outcome_is_crash_with_its_reason() {
        let no_agent = consistency_of(&Freeze::NoAgent("the guest agent of VM \"a\" is not connected".into()));
        assert_eq!(no_agent.consistency, Consistency::Crash);
        assert!(no_agent.reason.as_deref().is_some_and(|r| r.contains("not connected")), "{no_agent:?}");

        let failed = consistency_of(&Freeze::Failed("the guest agent refused fs.freeze: cannot freeze /".into()));
        assert!(failed.reason.as_deref().is_some_and(|r| r.contains("fs.freeze failed: the guest agent refused")));

        let skipped = consistency_of(&done(&["/"], Some(vec![skip("/boot/efi")])));
        assert_eq!((skipped.consistency, skipped.frozen.clone()), (Consistency::Crash, vec!["/".to_string()]));
        assert_eq!(skipped.skipped, [skip("/boot/efi")]);
        let reason = skipped.reason.clone().unwrap_or_default();
        assert!(reason.contains("/boot/efi (vfat: Operation not supported (os error 95))"), "{reason}");
        assert!(!skipped.meets(Some(Requirement::Frozen)));

        let nothing = consistency_of(&done(&[], Some(vec![])));
        assert!(nothing.reason.as_deref().is_some_and(|r| r.contains("no file system to freeze")), "{nothing:?}");
        assert_eq!(nothing.consistency, Consistency::Crash);

        let old_agent = consistency_of(&done(&["/"], None));
        assert_eq!((old_agent.consistency, old_agent.frozen.len()), (Consistency::Crash, 1));
        assert!(old_agent.reason.as_deref().is_some_and(|r| r.contains("does not report")));
    }

    #[test]
    fn a_reason_stays_bounded_and_escaped_whatever_the_guest_reports() {
        let many: Vec<FreezeSkip> = (0..500).map(|i| skip(&format!("/m{i}\n\x1b[2J{}", "x".repeat(4000)))).collect();
        let c = consistency_of(&done(&["/"], Some(many)));
        let reason = c.reason.unwrap_or_default();
        assert!(reason.len() < 2000, "{}", reason.len());
        assert!(reason.contains("496 more") && !reason.contains('\n') && !reason.contains('\x1b'), "{reason}");
        assert_eq!(c.skipped.len(), 500, "the record keeps the agent's list");
    }

    #[test]
    fn a_frozen_copy_started_at_or_after_the_freeze_timeout_is_crash() {
        let frozen = consistency_of(&done(&["/", "/nsm"], Some(vec![])));
        let limit = Duration::from_secs(u64::from(FREEZE_TIMEOUT_S));
        assert_eq!(frozen_until_started(frozen.clone(), Duration::from_millis(40)), frozen);
        assert_eq!(frozen_until_started(frozen.clone(), limit - Duration::from_millis(1)), frozen);
        for held in [limit, limit + Duration::from_secs(5)] {
            let late = frozen_until_started(frozen.clone(), held);
            assert_eq!(late.consistency, Consistency::Crash, "{held:?}");
            let reason = late.reason.clone().unwrap_or_default();
            assert!(reason.contains("freeze timeout") && reason.contains("may have thawed"), "{reason}");
            assert_eq!(late.frozen, frozen.frozen, "what the agent froze is still said");
            assert!(!late.meets(Some(Requirement::Frozen)));
        }
        // A crash copy keeps its own reason.
        let crash = consistency_of(&Freeze::NoAgent("not connected".into()));
        assert_eq!(frozen_until_started(crash.clone(), limit * 3), crash);
    }

    #[test]
    fn frozen_mounts_are_logged_counted_bounded_and_escaped() {
        let few = vec!["/".to_string(), "/nsm".to_string()];
        assert_eq!(logged_mounts(&few), "[/, /nsm]");
        let many: Vec<String> = (0..5000).map(|i| format!("/m{i}\n\x1b[2J{}", "x".repeat(4000))).collect();
        let line = logged_mounts(&many);
        assert!(line.len() < 2 * REASON_NAMES * crate::guest_text::MAX_LOGGED_CHARS, "{}", line.len());
        assert!(line.ends_with(" and 4996 more") && !line.contains('\n') && !line.contains('\x1b'), "{line}");
    }

    #[test]
    fn the_refusal_is_4094_on_requires_with_what_was_found() {
        let c = consistency_of(&done(&["/"], Some(vec![skip("/boot/efi")])));
        let e = not_frozen("db", "snapshot", &c);
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (4094, Some("requires")));
        assert_eq!(e.details["consistency"], "crash");
        assert_eq!(e.details["frozen"], json!(["/"]));
        assert_eq!(e.details["skipped"][0]["mount"], "/boot/efi");
        assert!(e.message.contains("nothing was copied"), "{}", e.message);
    }
}
