//! The source's side of a move whose end it did not see, carried out: one implementation for a
//! live migration and a cold move (they differ only in how the VM stays here: a live guest runs
//! again, a cold VM stays `stopped` and is started again if its move stopped it), used by the
//! operation that sent `Commit` ([`settle`]), its failure before `Commit` ([`give_up`]), the
//! background retry ([`spawn_retry`]), a restart's recovery ([`recover`]) and the operator's
//! word (`vm.migrate_settle`, [`migrate_settle`]). [`super::source_outcome`] holds the rules.
//!
//! Order: the operation calls [`give_up`] on a failure before `Commit`, [`finish`] on
//! `Committed`, [`settle`] on no answer; [`settle`] asks for a while, then records
//! the outcome unknown ([`unknown`]) and leaves it to [`spawn_retry`], which asks every
//! [`source_outcome::RETRY_EVERY`] until the destination answers or the operator settles it.

use super::progress::Reporter;
use super::source_outcome::{self, Answer, ManualRefusal, SourceAction, SourceQemu};
use crate::api::migration::{MigrateSettleParams, MigrateSettleResult, MoveMode, SettleOutcome};
use crate::api::{ApiError, Code, DesiredState, VmStatus};
use crate::lifecycle::held::HeldVm;
use crate::lifecycle::op::VmOp;
use crate::lifecycle::Manager;
use crate::migration::{Control, ControlMsg, Outcome, Secret};
use crate::process::ProcessIdentity;
use crate::qemu::migration as qemu_mig;
use crate::state::migration::{MigrationPhase, MigrationRecord, MigrationRole};
use crate::state::VmRecord;
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest one QMP command may take.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);

/// The VMs whose outcome is unknown and asked about in the background, each with whether its
/// QEMU is watched by this vmhostd (false: recovery found it while the outcome was unknown, so
/// a resume re-adopts it). One retry per VM: a second [`spawn_retry`] only updates the flag.
#[derive(Debug, Default)]
pub(crate) struct Unsettled(Mutex<HashMap<String, bool>>);

impl Unsettled {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, bool>> {
        // The table holds flags only: a panic elsewhere cannot leave it half-written.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether VM `name`'s QEMU must be re-adopted when its guest runs here again.
    fn readopt(&self, name: &str) -> bool {
        // Not listed: no retry ran for it in this vmhostd's life, so nothing here watches it.
        self.table().get(name).copied().unwrap_or(true)
    }
}

/// How the VM stays here, by mode: a live guest runs again (`cancel_source`), a cold VM stays
/// `stopped`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Side {
    /// Live or cold.
    pub mode: MoveMode,
    /// Live: its QEMU is not watched (see [`resume`]).
    pub readopt: bool,
}

impl Side {
    /// The operation's name and the verb of its events, by mode.
    fn words(self) -> (&'static str, &'static str) {
        match self.mode {
            MoveMode::Live => ("vm.migrate", "migrated to"),
            MoveMode::Cold => ("vm.move", "moved to"),
        }
    }
}

/// 4001 naming `step`.
fn failed(step: &str, message: impl Into<String>) -> ApiError {
    super::super::provisioning(step, message.into())
}

/// The record's migration in phase `phase`.
pub(super) fn set_phase(r: &mut VmRecord, phase: MigrationPhase) {
    if let Some(m) = r.migration.as_mut() {
        m.phase = phase;
    }
}

/// The destination has the VM: phase `committed`, then the VM ends here as `vm.destroy` ends it
/// (QEMU killed, data disks kept as a destroy keeps them, the record removed).
///
/// # Errors
/// As `vm.destroy`'s steps (the record then says `failed`; a restart finishes it).
pub(super) async fn finish(
    op: &mut VmOp,
    side: Side,
    destination: &str,
    reporter: Option<&mut Reporter>,
) -> Result<(), ApiError> {
    let (what, verb) = side.words();
    op.update(&format!("{what}: the destination committed"), |r| set_phase(r, MigrationPhase::Committed))?;
    if side.mode == MoveMode::Live {
        op.crashpoint("migrate:confirmed");
    }
    tracing::info!(vm = op.name(), destination, "the destination has the VM; ending it here");
    if let Some(reporter) = reporter {
        reporter.phase("done");
        reporter.clear();
    }
    op.destroy_steps(&format!("{what}: the VM is on the destination"), &format!("{verb} {destination}")).await?;
    Ok(())
}

/// The VM stays here (the destination does not have it): `action` [`SourceAction::Resume`]
/// runs a live guest again, [`SourceAction::Dead`] records a live VM whose QEMU is gone `dead`;
/// a cold VM is recorded `stopped` either way (any QEMU found is not its guest and is ended).
/// With `op`, a cold VM its move stopped is started again.
///
/// # Errors
/// The record cannot be written, or QEMU refused to run the guest again (the record then says
/// `failed`).
async fn keep_here(held: &HeldVm, op: Option<&mut VmOp>, side: Side, action: SourceAction) -> Result<(), ApiError> {
    match (side.mode, action) {
        (MoveMode::Live, SourceAction::Dead) => settle_dead(held),
        (MoveMode::Live, _) => resume(held, side.readopt).await,
        (MoveMode::Cold, _) => {
            let rec = held.record()?;
            if let Some(id) = super::super::launch::find_live(held.mgr(), held.name(), rec.process.as_ref())? {
                held.mgr().processes.kill(held.name(), &id).await?;
            }
            let restart = rec.migration().is_some_and(|m| m.stopped);
            held.update_status("the cold move did not complete: the VM stays here", VmStatus::Stopped, |r| {
                r.migration = None;
                r.process = None;
            })?;
            if let (true, Some(op)) = (restart, op) {
                // It was running when the move began: give it back as it was.
                if let Err(e) = op.start_steps("the move did not complete: started again").await {
                    tracing::error!(vm = op.name(), error = %e.message, "the VM the move stopped could not be started again");
                }
            }
            Ok(())
        }
    }
}

/// A failure before `Commit` was sent: the destination told (`Abort`, when the channel is up),
/// the VM kept here ([`keep_here`]). Returns the error to report: `error`, or the resume's.
pub(super) async fn give_up(
    op: &mut VmOp,
    side: Side,
    control: Option<&mut Control>,
    error: ApiError,
    reporter: Option<&mut Reporter>,
) -> ApiError {
    tracing::warn!(vm = op.name(), error = %error.message, "the move failed before the commit: the VM stays here");
    if let Some(control) = control {
        let abort = ControlMsg::Abort { code: error.code.as_i32(), message: error.message.clone() };
        if let Err(e) = control.send(&abort).await {
            tracing::info!(vm = op.name(), error = %e, "the destination could not be told (it gives up on its own)");
        }
    }
    if let Some(reporter) = reporter {
        reporter.phase("failed");
        reporter.clear();
    }
    let held = HeldVm::new(op.mgr(), op.name());
    match keep_here(&held, Some(op), side, SourceAction::Resume).await {
        Ok(()) => error,
        Err(kept) => kept,
    }
}

/// `Commit` went out and no answer came: asks the destination every
/// [`source_outcome::ASK_EVERY`] for up to [`source_outcome::ASK_FOR`], then does what it said.
/// While it cannot tell, the VM is recorded `failed` (a live guest kept paused, a cold VM's
/// disks kept) and [`spawn_retry`] asks on.
///
/// # Errors
/// 4001 step `commit` when the outcome stays unknown, or the destination gave the move up (the
/// VM stays here); as [`finish`] or [`keep_here`].
pub(super) async fn settle(
    op: &mut VmOp,
    side: Side,
    destination: &str,
    secret: &Secret,
    mut reporter: Option<&mut Reporter>,
) -> Result<(), ApiError> {
    let name = op.name().to_string();
    let until = Instant::now() + source_outcome::ASK_FOR;
    loop {
        let answer = source_outcome::ask(destination, &name, secret).await;
        let qemu = qemu_now(op.held(), side.mode).await;
        match source_outcome::decide(Some(MigrationPhase::Committing), qemu, answer) {
            SourceAction::Finish => return finish(op, side, destination, reporter).await,
            action @ (SourceAction::Resume | SourceAction::Dead) => {
                if let Some(r) = reporter.as_deref_mut() {
                    r.phase("failed");
                    r.clear();
                }
                let held = HeldVm::new(op.mgr(), op.name());
                keep_here(&held, Some(op), side, action).await?;
                return Err(failed(
                    "commit",
                    "the destination gave the move up after the commit was sent: the VM stays here",
                ));
            }
            SourceAction::Ask | SourceAction::Wait if Instant::now() < until => {
                tokio::time::sleep(source_outcome::ASK_EVERY).await;
            }
            SourceAction::Ask | SourceAction::Wait => {
                if let Some(r) = reporter.as_deref_mut() {
                    r.clear();
                }
                let e = unknown(op.held(), side.mode)?;
                spawn_retry(op.mgr(), &name, side.readopt);
                return Err(e);
            }
        }
    }
}

/// The source's QEMU as it is now (a cold move's VM has none that matters: always `Gone`).
async fn qemu_now(held: &HeldVm, mode: MoveMode) -> SourceQemu {
    if mode == MoveMode::Cold {
        return SourceQemu::Gone;
    }
    let rec = held.record().ok();
    let found = super::super::launch::find_live(held.mgr(), held.name(), rec.as_ref().and_then(|r| r.process.as_ref()));
    if !matches!(found, Ok(Some(_))) {
        return SourceQemu::Gone;
    }
    let status = match held.mgr().qmp(held.name(), QMP_TIMEOUT).await {
        Ok(mut q) => q.query_status().await.ok(),
        Err(_) => None,
    };
    SourceQemu::of(true, status.as_deref())
}

/// Records the outcome unknown: `failed`, the migration (phase `committing`) and the process
/// kept, a live guest left paused. Returns the error to report.
///
/// # Errors
/// The record cannot be written.
fn unknown(held: &HeldVm, mode: MoveMode) -> Result<ApiError, ApiError> {
    let kept = match mode {
        MoveMode::Live => "the guest is kept paused here",
        MoveMode::Cold => "the VM's disks are kept here",
    };
    let message = format!(
        "the destination's answer is unknown: {kept}; vmhostd asks the destination again every {} s and settles \
         the VM when it answers (or settle it with vm.migrate_settle)",
        source_outcome::RETRY_EVERY.as_secs()
    );
    let e = failed("commit", message.clone());
    let le = crate::api::LastError { code: e.code.as_i32(), message };
    held.update_status("the move's outcome is unknown", VmStatus::Failed, |r| r.last_error = Some(le))?;
    Ok(e)
}

/// The guest was this host's but its QEMU is gone: recorded `dead` as recovery records a VM
/// whose QEMU ended unseen (`stopped` when it was recorded `failed`), the migration cleared.
///
/// # Errors
/// The record cannot be written.
fn settle_dead(held: &HeldVm) -> Result<(), ApiError> {
    remove_tls(held);
    if held.record()?.status == VmStatus::Failed {
        held.update_status("migration undone; QEMU is gone", VmStatus::Stopped, |r| {
            r.process = None;
            r.migration = None;
        })?;
        return Ok(());
    }
    super::super::recover::settle_without_process(held, VmStatus::Running)?;
    held.update("migration undone; QEMU is gone", |r| r.migration = None)?;
    Ok(())
}

/// The live guest is this host's after all: QEMU's migration state undone and the guest running
/// again (`cancel_source`), the TLS key removed, the record `running` with no migration. A
/// QEMU that is gone is left to its exit watcher (queued behind the operation) or recovery.
/// `readopt`: the QEMU is not watched (recovery found it while the outcome was unknown), so it
/// is re-adopted as recovery re-adopts a running VM.
///
/// # Errors
/// QEMU refused to run the guest again: the record then says `failed` (the process kept, its
/// migration cleared) with that error.
async fn resume(held: &HeldVm, readopt: bool) -> Result<(), ApiError> {
    let (mgr, name) = (held.mgr(), held.name());
    let cancelled = match mgr.qmp(name, QMP_TIMEOUT).await {
        Ok(mut q) => qemu_mig::cancel_source(&mut q).await.map_err(|e| failed("migrate", format!("{e}"))),
        Err(e) => Err(failed("migrate", format!("QEMU's monitor: {e}"))),
    };
    remove_tls(held);
    match cancelled {
        Ok(()) if readopt => {
            let rec = held.update("migration undone: the guest runs here", |r| r.migration = None)?;
            match super::super::launch::find_live(held.mgr(), held.name(), rec.process.as_ref())? {
                Some(id) => super::super::recover::readopt(held, id, &rec).await,
                None => settle_dead(held),
            }
        }
        Ok(()) => {
            held.update_status("migration undone: the guest runs here", VmStatus::Running, |r| r.migration = None)?;
            Ok(())
        }
        Err(e) => {
            let le = crate::api::LastError {
                code: e.code.as_i32(),
                message: format!("the guest could not be resumed after the migration failed: {}", e.message),
            };
            held.update_status("migration undone; the guest may be paused", VmStatus::Failed, |r| {
                r.migration = None;
                r.last_error = Some(le);
            })?;
            Err(e)
        }
    }
}

/// Removes QEMU's TLS key directory (errors logged: the run dir goes with the VM anyway).
pub(super) fn remove_tls(held: &HeldVm) {
    let run_dir = held.paths().run_dir.clone();
    if let Err(e) = crate::blocking::run(|| qemu_mig::remove_psk_dir(&run_dir)) {
        tracing::warn!(vm = held.name(), error = %e, "cannot remove the migration's TLS key");
    }
}

/// The record's outgoing migration if its outcome is still unknown (phase `committing`).
fn unsettled(rec: &VmRecord) -> Option<MigrationRecord> {
    rec.migration().filter(|m| m.role == MigrationRole::Outgoing && m.phase == MigrationPhase::Committing).cloned()
}

/// VM `name`'s unknown outcome, if it still is; else its entry in [`Unsettled`] is dropped
/// (in one step with the read, so a retry spawned for a new unknown outcome is never lost).
fn still_unsettled(mgr: &Manager, name: &str) -> Option<MigrationRecord> {
    let mut table = mgr.unsettled.table();
    let m = mgr.record(name).ok().as_ref().and_then(unsettled);
    if m.is_none() {
        table.remove(name);
    }
    m
}

/// Asks the destination (first after [`source_outcome::ASK_EVERY`], then every
/// [`source_outcome::RETRY_EVERY`]) what became of VM `name`'s move recorded unknown, and
/// settles it once it answers. It asks without holding the VM (an operator's
/// `vm.migrate_settle` or `vm.destroy` is never refused busy because of it) and takes the VM only
/// to act. Ends when the record no longer names an outgoing move in phase `committing` (settled
/// here, by the operator, or destroyed). `readopt`: the VM's QEMU is not watched (see
/// [`resume`]).
pub(super) fn spawn_retry(mgr: &Arc<Manager>, name: &str, readopt: bool) {
    if mgr.unsettled.table().insert(name.to_string(), readopt).is_some() {
        return; // its retry runs already, and now knows the flag
    }
    let (mgr, name) = (Arc::clone(mgr), name.to_string());
    tokio::spawn(async move {
        // The first question soon: a destination that lost the source abandons within seconds.
        let mut wait = source_outcome::ASK_EVERY;
        loop {
            tokio::time::sleep(wait).await;
            wait = source_outcome::RETRY_EVERY;
            let Some(m) = still_unsettled(&mgr, &name) else { return };
            let Ok(secret) = Secret::parse(&m.secret) else {
                tracing::error!(vm = %name, "the recorded migration secret does not read: only the operator can settle it");
                mgr.unsettled.table().remove(&name);
                return;
            };
            let answer = source_outcome::ask(&m.peer, &name, &secret).await;
            if !matches!(answer, Answer::Said(Outcome::Committed | Outcome::Abandoned)) {
                continue;
            }
            let Ok((mut op, rec)) = mgr.begin_op(&name).await else {
                continue; // another operation holds the VM (or it is gone): see next time
            };
            if unsettled(&rec).as_ref().map(|n| &n.secret) != Some(&m.secret) {
                continue; // settled meanwhile
            }
            let side = Side { mode: m.mode, readopt: mgr.unsettled.readopt(&name) };
            let qemu = qemu_now(op.held(), m.mode).await;
            let action = source_outcome::decide(Some(MigrationPhase::Committing), qemu, answer);
            let done = match action {
                SourceAction::Finish => finish(&mut op, side, &m.peer, None).await,
                SourceAction::Resume | SourceAction::Dead => {
                    let held = HeldVm::new(op.mgr(), op.name());
                    keep_here(&held, Some(&mut op), side, action).await
                }
                SourceAction::Ask | SourceAction::Wait => continue,
            };
            match done {
                Ok(()) => tracing::info!(vm = %name, ?action, "the move's outcome is settled"),
                Err(e) => tracing::error!(vm = %name, error = %e.message, "settling the move failed"),
            }
        }
    });
}

/// Recovery of the source's record of a move (live or cold) after a vmhostd restart: the
/// action [`source_outcome::decide`] picks from the recorded phase, the QEMU found (`live`)
/// and, in phase `committing`, the destination's answer.
///
/// # Errors
/// A record write, or a step of the teardown, failed (the record keeps what still exists).
pub(super) async fn recover(
    mgr: &Arc<Manager>,
    held: &HeldVm,
    rec: &VmRecord,
    live: Option<ProcessIdentity>,
) -> Result<(), ApiError> {
    let name = held.name();
    let m = rec.migration();
    let mode = m.map_or(MoveMode::Live, |m| m.mode);
    let phase = m.map(|m| m.phase);
    let qemu = match (&live, mode) {
        (None, _) | (_, MoveMode::Cold) => SourceQemu::Gone,
        (Some(_), MoveMode::Live) => {
            let status = match crate::qemu::qmp::Qmp::connect(&held.paths().qmp, Duration::from_secs(5)).await {
                Ok(mut q) => q.query_status().await.ok(),
                Err(_) => None,
            };
            SourceQemu::of(true, status.as_deref())
        }
    };
    let mut action = source_outcome::decide(phase, qemu, Answer::NotAsked);
    if action == SourceAction::Ask {
        let answer = match m.map(|m| (Secret::parse(&m.secret), m.peer.as_str())) {
            Some((Ok(secret), peer)) => source_outcome::ask(peer, name, &secret).await,
            _ => Answer::Unreachable,
        };
        action = source_outcome::decide(phase, qemu, answer);
    }
    tracing::info!(vm = name, ?mode, ?phase, ?qemu, ?action, "settling an interrupted outgoing move");
    let side = Side { mode, readopt: true };
    match (action, live) {
        (SourceAction::Resume, Some(id)) if mode == MoveMode::Live => {
            match crate::qemu::qmp::Qmp::connect(&held.paths().qmp, QMP_TIMEOUT).await {
                Ok(mut q) => {
                    if let Err(e) = qemu_mig::cancel_source(&mut q).await {
                        tracing::error!(vm = name, error = %e, "the guest could not be resumed; re-adopted as it is");
                    }
                }
                Err(e) => tracing::error!(vm = name, error = %e, "QEMU's monitor: the guest is re-adopted as it is"),
            }
            remove_tls(held);
            held.update("migration undone after a restart", |r| r.migration = None)?;
            super::super::recover::readopt(held, id, rec).await
        }
        (SourceAction::Finish, live) => {
            if let Some(id) = live {
                mgr.processes.kill(name, &id).await?;
            }
            held.update_status("the VM is on the destination (after a restart)", VmStatus::Destroying, |r| {
                r.spec.state = DesiredState::Stopped;
                r.process = None;
            })?;
            super::super::recover::finish_destroy(held).await
        }
        (SourceAction::Ask | SourceAction::Wait, _) => {
            if rec.status != VmStatus::Failed {
                unknown(held, mode)?;
            }
            spawn_retry(mgr, name, true);
            Ok(())
        }
        (action @ (SourceAction::Resume | SourceAction::Dead), _) => keep_here(held, None, side, action).await,
    }
}

/// `vm.migrate_settle`: the operator, having looked at the destination, says what became of a
/// move whose outcome is unknown here. The destination is asked first when it can be reached,
/// and an answer of the operator's that contradicts its own is refused; unreachable, the
/// operator's word decides. `committed` ends the VM here as the automatic path does;
/// `abandoned` keeps it here (a live guest runs again, a cold VM is `stopped`, started again if
/// its move stopped it). The background retry ends with the record's migration.
///
/// # Errors
/// 4040; 4090 while another operation holds the VM (the move itself, still asking), or when
/// the destination contradicts the operator (`details.reason` `destination_disagrees`, with
/// `destination`) or has not decided yet (`destination_pending`); 4097 reason `status` for a VM
/// whose move's outcome is not unknown; as [`finish`] or the resume.
pub(crate) async fn migrate_settle(
    mgr: &Arc<Manager>,
    p: MigrateSettleParams,
) -> Result<MigrateSettleResult, ApiError> {
    let (mut op, rec) = mgr.begin_op(&p.name).await?;
    let m = source_outcome::check_settleable(&rec).map_err(|why| {
        ApiError::new(Code::NotMovable, format!("VM {:?}: {why}", p.name)).details(json!({ "reason": "status" }))
    })?;
    let answer = match Secret::parse(&m.secret) {
        Ok(secret) => source_outcome::ask(&m.peer, &p.name, &secret).await,
        Err(_) => Answer::Unreachable,
    };
    let destination = match answer {
        Answer::Said(Outcome::Committed) => "committed",
        Answer::Said(Outcome::Abandoned) => "abandoned",
        Answer::Said(Outcome::Pending) => "pending",
        Answer::NotAsked | Answer::Unreachable => "unreachable",
    };
    let operator = match p.outcome {
        SettleOutcome::Committed => Outcome::Committed,
        SettleOutcome::Abandoned => Outcome::Abandoned,
    };
    let outcome = source_outcome::decide_manual(operator, answer).map_err(|refusal| {
        let reason = match refusal {
            ManualRefusal::Disagrees(_) => "destination_disagrees",
            ManualRefusal::Pending => "destination_pending",
        };
        ApiError::new(Code::Busy, format!("VM {:?}: {refusal}", p.name))
            .details(json!({ "reason": reason, "destination": destination }))
    })?;
    tracing::warn!(vm = %p.name, ?outcome, destination, "the operator settles the move's unknown outcome");
    let side = Side { mode: m.mode, readopt: mgr.unsettled.readopt(&p.name) };
    if outcome == Outcome::Committed {
        finish(&mut op, side, &m.peer, None).await?;
    } else {
        let qemu = qemu_now(op.held(), m.mode).await;
        let action = source_outcome::decide(Some(MigrationPhase::Committing), qemu, Answer::Said(outcome));
        let held = HeldVm::new(op.mgr(), op.name());
        keep_here(&held, Some(&mut op), side, action).await?;
    }
    mgr.unsettled.table().remove(&p.name);
    let status = mgr.record(&p.name).ok().map(|r| r.status);
    Ok(MigrateSettleResult { name: p.name, outcome: p.outcome, destination: destination.to_string(), status })
}
