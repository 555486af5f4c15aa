//! The source's side of a migration whose end it did not see: what it does when it finds one
//! unfinished (after a restart, or when the destination's answer to `Commit` never came).
//!
//! Only the destination knows whether it committed once `Commit` may have been sent, so the
//! source asks it ([`ask`], a new control channel and a `Query`); before that the destination
//! cannot have committed (it commits only when asked), and after the source recorded the
//! destination's `Committed` only the source's own teardown is left. [`decide`] is that rule as
//! a pure function, for a live migration and a cold move alike (a cold VM's QEMU counts as
//! [`SourceQemu::Gone`]); [`decide_manual`] is the rule for the operator's answer
//! (`vm.migrate_settle`). [`super::source_settle`] carries their actions out.
//!
//! Order: [`decide`] with [`Answer::NotAsked`]; on [`SourceAction::Ask`], [`ask`] (again every
//! [`ASK_EVERY`] for up to [`ASK_FOR`] in the operation) and [`decide`] with the answer; while
//! it stays [`SourceAction::Wait`], the VM is recorded `failed` with the guest kept paused and
//! the background retry asks every [`RETRY_EVERY`] until it can settle, or the operator settles
//! it ([`check_settleable`], [`ask`], [`decide_manual`]).

use crate::migration::{ChannelKind, Control, ControlMsg, Outcome, Secret};
use crate::state::migration::MigrationPhase;
use std::time::Duration;

/// How often the operation asks the destination after an unanswered `Commit`.
pub(super) const ASK_EVERY: Duration = Duration::from_secs(5);
/// How long the operation keeps asking before it records the outcome unknown.
pub(super) const ASK_FOR: Duration = Duration::from_secs(60);
/// How often the background retry asks once the outcome was recorded unknown.
pub(super) const RETRY_EVERY: Duration = Duration::from_secs(30);
/// Longest one question may take (connect, `Query`, `Outcome`).
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// The source's QEMU as found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SourceQemu {
    /// No QEMU of the VM runs here.
    Gone,
    /// It runs and QMP says the guest is paused (`postmigrate`, `paused`, `finish-migrate`).
    Paused,
    /// It runs and the guest runs (or QMP gave another status).
    Running,
    /// It runs but its monitor did not answer.
    Unknown,
}

impl SourceQemu {
    /// From whether the QEMU was found and the status QMP gave (`None`: it did not answer).
    pub(super) fn of(found: bool, run_status: Option<&str>) -> SourceQemu {
        match (found, run_status) {
            (false, _) => SourceQemu::Gone,
            (true, None) => SourceQemu::Unknown,
            (true, Some("postmigrate" | "paused" | "finish-migrate")) => SourceQemu::Paused,
            (true, Some(_)) => SourceQemu::Running,
        }
    }
}

/// What the destination said when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Answer {
    /// Not asked (yet).
    NotAsked,
    /// Asked, but no answer came (unreachable, refused, timed out, no such VM known there).
    Unreachable,
    /// Its answer.
    Said(Outcome),
}

/// What the source does about an unfinished migration (see [`decide`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SourceAction {
    /// The guest is this host's: QEMU's migration state undone and the guest run again
    /// (`cancel_source`), the record `running` with its migration cleared.
    Resume,
    /// The guest is this host's but its QEMU is gone: the VM is `dead`, the migration cleared.
    Dead,
    /// The destination runs the guest: end the VM here as `vm.destroy` would.
    Finish,
    /// Only the destination can tell: ask it.
    Ask,
    /// It was asked and has not told: keep the guest paused here (or gone), record the outcome
    /// unknown and ask again later.
    Wait,
}

/// The decision (pure): from the recorded `phase` (`None`: the record says `migrating` without
/// a migration, a crash between two writes of a resume, which is `sending`), the source's QEMU
/// and the destination's answer.
///
/// A QEMU whose monitor did not answer is treated as the one it is: resumed (recovery's
/// re-adoption copes with a silent monitor) or ended. A guest found running while the phase is
/// `committing` (an operator's `cont`) changes nothing: the destination's answer still decides,
/// and a committed destination's guest is the one that lives.
pub(super) fn decide(phase: Option<MigrationPhase>, qemu: SourceQemu, answer: Answer) -> SourceAction {
    let here = if qemu == SourceQemu::Gone { SourceAction::Dead } else { SourceAction::Resume };
    match phase.unwrap_or(MigrationPhase::Sending) {
        // The destination commits only when asked; `Commit` is sent after `committing` is
        // recorded.
        MigrationPhase::Sending => here,
        MigrationPhase::Committed => SourceAction::Finish,
        MigrationPhase::Committing => match answer {
            Answer::NotAsked => SourceAction::Ask,
            Answer::Said(Outcome::Committed) => SourceAction::Finish,
            Answer::Said(Outcome::Abandoned) => here,
            Answer::Said(Outcome::Pending) | Answer::Unreachable => SourceAction::Wait,
        },
    }
}

/// Asks the destination at `destination` what became of VM `vm`'s migration (one new control
/// channel, one `Query`); [`Answer::Unreachable`] when it cannot tell within a few seconds.
pub(super) async fn ask(destination: &str, vm: &str, secret: &Secret) -> Answer {
    let asked = async {
        let stream = crate::migration::connect(destination, vm, secret, &ChannelKind::Control).await.ok()?;
        let mut control = Control::new(stream, secret);
        control.send(&ControlMsg::Query).await.ok()?;
        match control.recv(ASK_TIMEOUT).await.ok()? {
            ControlMsg::Outcome { outcome } => Some(outcome),
            _ => None,
        }
    };
    match tokio::time::timeout(ASK_TIMEOUT * 2, asked).await {
        Ok(Some(outcome)) => {
            tracing::info!(vm, destination, ?outcome, "the destination answered");
            Answer::Said(outcome)
        }
        _ => {
            tracing::warn!(vm, destination, "the destination did not answer what became of the migration");
            Answer::Unreachable
        }
    }
}

/// Why `vm.migrate_settle` refuses the operator's answer ([`decide_manual`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum ManualRefusal {
    /// The destination answered, and not what the operator said: acting on the operator's word
    /// would leave the guest on no host or on two.
    #[error("the destination says {0:?}: the operator's answer contradicts it")]
    Disagrees(Outcome),
    /// The destination has not decided yet: it may still commit (or give up) on its own.
    #[error(
        "the destination has not decided yet: ask again once it has (it gives up within seconds of losing the source)"
    )]
    Pending,
}

/// What the operator's answer to an unknown outcome becomes (pure): the operator's own when the
/// destination cannot be asked ([`Answer::Unreachable`]: the operator looked at it, vmhostd
/// cannot) or agrees, refused when the destination answered otherwise or is still deciding.
///
/// # Errors
/// [`ManualRefusal`].
pub(super) fn decide_manual(operator: Outcome, destination: Answer) -> Result<Outcome, ManualRefusal> {
    match destination {
        Answer::NotAsked | Answer::Unreachable => Ok(operator),
        Answer::Said(Outcome::Pending) => Err(ManualRefusal::Pending),
        Answer::Said(said) if said == operator => Ok(operator),
        Answer::Said(said) => Err(ManualRefusal::Disagrees(said)),
    }
}

/// The migration of a VM whose move's outcome is unknown here (pure): an outgoing migration in
/// phase `committing`, the VM `failed` (recorded unknown) or `migrating` (the move still asks).
///
/// # Errors
/// A message saying what the VM is instead.
pub(super) fn check_settleable(
    rec: &crate::state::VmRecord,
) -> Result<crate::state::migration::MigrationRecord, String> {
    use crate::api::VmStatus;
    use crate::state::migration::MigrationRole;
    match rec.migration() {
        Some(m)
            if m.role == MigrationRole::Outgoing
                && m.phase == MigrationPhase::Committing
                && matches!(rec.status, VmStatus::Failed | VmStatus::Migrating) =>
        {
            Ok(m.clone())
        }
        Some(m) => Err(format!(
            "its move's outcome is not unknown (status {}, {:?} migration in phase {:?})",
            rec.status, m.role, m.phase
        )),
        None => Err(format!("it is {} and is not being moved", rec.status)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use MigrationPhase::{Committed, Committing, Sending};
    use SourceAction::{Ask, Dead, Finish, Resume, Wait};

    const ALIVE: [SourceQemu; 3] = [SourceQemu::Paused, SourceQemu::Running, SourceQemu::Unknown];
    const ANSWERS: [Answer; 5] = [
        Answer::NotAsked,
        Answer::Unreachable,
        Answer::Said(Outcome::Committed),
        Answer::Said(Outcome::Abandoned),
        Answer::Said(Outcome::Pending),
    ];

    #[test]
    fn before_the_commit_the_guest_is_always_the_sources_whatever_anyone_says() {
        for answer in ANSWERS {
            for qemu in ALIVE {
                assert_eq!(decide(Some(Sending), qemu, answer), Resume, "{qemu:?} {answer:?}");
                assert_eq!(decide(None, qemu, answer), Resume, "{qemu:?} {answer:?}");
            }
            assert_eq!(decide(Some(Sending), SourceQemu::Gone, answer), Dead);
        }
    }

    #[test]
    fn once_the_destination_confirmed_the_source_only_finishes() {
        for answer in ANSWERS {
            for qemu in ALIVE.into_iter().chain([SourceQemu::Gone]) {
                assert_eq!(decide(Some(Committed), qemu, answer), Finish, "{qemu:?} {answer:?}");
            }
        }
    }

    #[test]
    fn while_committing_only_the_destinations_answer_decides() {
        for qemu in ALIVE {
            assert_eq!(decide(Some(Committing), qemu, Answer::NotAsked), Ask);
            assert_eq!(decide(Some(Committing), qemu, Answer::Said(Outcome::Committed)), Finish);
            assert_eq!(decide(Some(Committing), qemu, Answer::Said(Outcome::Abandoned)), Resume);
            assert_eq!(decide(Some(Committing), qemu, Answer::Said(Outcome::Pending)), Wait);
            assert_eq!(decide(Some(Committing), qemu, Answer::Unreachable), Wait);
        }
        let gone = SourceQemu::Gone;
        assert_eq!(decide(Some(Committing), gone, Answer::Said(Outcome::Committed)), Finish);
        assert_eq!(decide(Some(Committing), gone, Answer::Said(Outcome::Abandoned)), Dead);
        // Gone here and unknown there: the guest may run there; nothing here may decide.
        assert_eq!(decide(Some(Committing), gone, Answer::Unreachable), Wait);
    }

    #[test]
    fn qemu_run_statuses_read_as_paused_or_running() {
        assert_eq!(SourceQemu::of(false, Some("running")), SourceQemu::Gone);
        assert_eq!(SourceQemu::of(true, None), SourceQemu::Unknown);
        assert_eq!(SourceQemu::of(true, Some("postmigrate")), SourceQemu::Paused);
        assert_eq!(SourceQemu::of(true, Some("paused")), SourceQemu::Paused);
        assert_eq!(SourceQemu::of(true, Some("running")), SourceQemu::Running);
    }

    #[test]
    fn the_operator_decides_only_when_the_destination_cannot_or_agrees() {
        use Outcome::{Abandoned, Committed, Pending};
        for said in [Committed, Abandoned] {
            assert_eq!(decide_manual(said, Answer::Unreachable), Ok(said));
            assert_eq!(decide_manual(said, Answer::NotAsked), Ok(said));
            assert_eq!(decide_manual(said, Answer::Said(said)), Ok(said));
            assert_eq!(decide_manual(said, Answer::Said(Pending)), Err(ManualRefusal::Pending));
        }
        assert_eq!(decide_manual(Committed, Answer::Said(Abandoned)), Err(ManualRefusal::Disagrees(Abandoned)));
        assert_eq!(decide_manual(Abandoned, Answer::Said(Committed)), Err(ManualRefusal::Disagrees(Committed)));
    }

    #[test]
    fn only_an_outgoing_move_in_commit_with_the_vm_failed_or_migrating_is_settled_by_hand() {
        use crate::api::migration::MoveMode;
        use crate::api::VmStatus;
        use crate::state::migration::{MigrationRecord, MigrationRole};
        let mut rec = crate::state::VmRecord::new(crate::validate::tests::spec("vm-1"));
        rec.status = VmStatus::Failed;
        assert!(check_settleable(&rec).is_err());
        let m = MigrationRecord {
            role: MigrationRole::Outgoing,
            mode: MoveMode::Live,
            peer: "10.0.0.2:7300".into(),
            secret: "00".repeat(32),
            phase: Committing,
            since: String::new(),
            stopped: false,
        };
        rec.migration = Some(m.clone());
        assert_eq!(check_settleable(&rec), Ok(m.clone()));
        rec.status = VmStatus::Migrating;
        assert!(check_settleable(&rec).is_ok());
        for status in [VmStatus::Running, VmStatus::Stopped, VmStatus::Dead] {
            rec.status = status;
            assert!(check_settleable(&rec).is_err(), "{status}");
        }
        rec.status = VmStatus::Failed;
        for phase in [Sending, Committed] {
            rec.migration = Some(MigrationRecord { phase, ..m.clone() });
            assert!(check_settleable(&rec).is_err(), "{phase:?}");
        }
        rec.migration = Some(MigrationRecord { role: MigrationRole::Incoming, ..m });
        assert!(check_settleable(&rec).is_err());
    }

    #[test]
    fn a_cold_move_stays_here_unless_the_destination_committed() {
        // A cold move's VM has no QEMU that matters: it is asked about as `Gone`.
        let gone = SourceQemu::Gone;
        assert_eq!(decide(Some(Sending), gone, Answer::NotAsked), Dead);
        assert_eq!(decide(None, gone, Answer::NotAsked), Dead);
        assert_eq!(decide(Some(Committed), gone, Answer::NotAsked), Finish);
        assert_eq!(decide(Some(Committing), gone, Answer::NotAsked), Ask);
        assert_eq!(decide(Some(Committing), gone, Answer::Said(Outcome::Committed)), Finish);
        assert_eq!(decide(Some(Committing), gone, Answer::Said(Outcome::Abandoned)), Dead);
        assert_eq!(decide(Some(Committing), gone, Answer::Said(Outcome::Pending)), Wait);
        assert_eq!(decide(Some(Committing), gone, Answer::Unreachable), Wait);
    }
}
