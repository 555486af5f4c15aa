//! How far a migration got, told to whoever watches: `migration` events and the VM view's
//! `migration.progress` (docs/api.md). The source's operation ([`super::outgoing`]) is the one
//! reporter.
//!
//! Order: [`Reporter::new`] when the operation records the migration; [`Reporter::phase`] at
//! each phase change (always published), [`Reporter::tick`] while disks or memory are sent
//! (published at most every [`EVERY`]); [`Reporter::clear`] once the migration is over. What
//! QEMU reports is folded into a [`MigrationProgress`] by the pure [`with_mirrors`] and
//! [`with_memory`].

use super::super::Manager;
use crate::api::migration::MigrationProgress;
use crate::api::VmStatus;
use crate::qemu::migration::{MemoryProgress, MirrorState};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Least time between two progress events within one phase.
pub(super) const EVERY: Duration = Duration::from_secs(1);

/// `progress` with the disks' figures from the mirror jobs' states (pure).
pub(super) fn with_mirrors(mut progress: MigrationProgress, mirrors: &[MirrorState]) -> MigrationProgress {
    progress.disk_done = mirrors.iter().map(|m| m.offset).sum();
    progress.disk_total = mirrors.iter().map(|m| m.len).sum();
    progress
}

/// `progress` with the memory's figures from `query-migrate` (pure). Once completed, QEMU's
/// downtime is the one it took, not an estimate.
pub(super) fn with_memory(mut progress: MigrationProgress, memory: &MemoryProgress) -> MigrationProgress {
    progress.ram_done = memory.transferred;
    progress.ram_total = memory.total;
    progress.ram_remaining = memory.remaining;
    progress.expected_downtime_ms = memory.downtime_ms;
    progress
}

/// Publishes one migration's progress for VM `name`.
pub(super) struct Reporter {
    mgr: Arc<Manager>,
    name: String,
    /// What was last published (or is about to be).
    now: MigrationProgress,
    /// When the last event went out.
    last: Option<Instant>,
}

impl Reporter {
    /// A reporter for VM `name`'s migration, in phase `preparing`.
    pub(super) fn new(mgr: &Arc<Manager>, name: &str) -> Reporter {
        let now = MigrationProgress { phase: "preparing".into(), ..Default::default() };
        Reporter { mgr: Arc::clone(mgr), name: name.to_string(), now, last: None }
    }

    /// The progress as last reported.
    pub(super) fn progress(&self) -> &MigrationProgress {
        &self.now
    }

    /// Enters `phase` (figures kept) and publishes it.
    pub(super) fn phase(&mut self, phase: &str) {
        self.now.phase = phase.to_string();
        self.publish();
    }

    /// New figures within the current phase: published unless the last event is younger than
    /// [`EVERY`]; the view always shows them.
    pub(super) fn tick(&mut self, progress: MigrationProgress) {
        self.now = MigrationProgress { phase: self.now.phase.clone(), ..progress };
        if self.last.is_some_and(|t| t.elapsed() < EVERY) {
            self.mgr.registry.set_migration_progress(&self.name, Some(self.now.clone()));
            return;
        }
        self.publish();
    }

    /// The migration is over: the view shows no progress any more.
    pub(super) fn clear(&self) {
        self.mgr.registry.set_migration_progress(&self.name, None);
    }

    fn publish(&mut self) {
        self.last = Some(Instant::now());
        self.mgr.registry.set_migration_progress(&self.name, Some(self.now.clone()));
        let status = self.mgr.record(&self.name).ok().map(|r| r.status).or(Some(VmStatus::Migrating));
        let reason = format!("migration: {}", self.now.phase);
        self.mgr.events.emit_migration(&self.name, status, reason, self.now.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mirror(offset: u64, len: u64) -> MirrorState {
        MirrorState { device: "d".into(), offset, len, ready: false, concluded: false, error: None }
    }

    #[test]
    fn disks_add_up_over_every_mirror_and_the_phase_stays() {
        let p = MigrationProgress { phase: "disks".into(), ram_total: 7, ..Default::default() };
        let p = with_mirrors(p, &[mirror(1, 10), mirror(5, 20)]);
        assert_eq!((p.phase.as_str(), p.disk_done, p.disk_total, p.ram_total), ("disks", 6, 30, 7));
    }

    #[test]
    fn memory_figures_come_from_query_migrate() {
        let m = MemoryProgress {
            status: "active".into(),
            transferred: 100,
            remaining: 50,
            total: 256,
            downtime_ms: 120,
            error: None,
        };
        let p = with_memory(MigrationProgress { disk_done: 3, ..Default::default() }, &m);
        assert_eq!(
            (p.ram_done, p.ram_remaining, p.ram_total, p.expected_downtime_ms, p.disk_done),
            (100, 50, 256, 120, 3)
        );
    }
}
