//! What a destination remembers of an incoming migration it gave up, after the VM's record is
//! gone: `STATE/migrations/NAME.json` (`{secret, outcome: "abandoned", at}`), so that a source
//! that lost its control channel and asks later (`Query`) is told, authenticated with the same
//! secret, that the guest must run on the source. And the answer to that `Query`
//! ([`RecordOutcomes`], the migration port's [`Outcomes`]): the record while there is one,
//! else the tombstone.
//!
//! Order of use: [`write`] by an abandon before the record is removed (atomically, so a crash
//! leaves the old tombstone or the new); [`remove`] by the next `vm.migrate_in` of the name
//! once it is admitted; [`read`] by [`RecordOutcomes`] whenever the listener asks.

use super::decide::outcome_of;
use crate::lifecycle::Manager;
use crate::migration::{Outcome, Outcomes, Secret};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

/// One tombstone's file content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Tombstone {
    /// The abandoned migration's secret (hex).
    pub secret: String,
    /// Always `abandoned`: only a migration given up leaves one.
    pub outcome: Outcome,
    /// RFC 3339, when it was given up.
    pub at: String,
}

/// `STATE/migrations`.
fn dir(state: &Path) -> PathBuf {
    state.join("migrations")
}

/// The tombstone of VM `vm` (a validated VM name: no path separators).
pub(crate) fn path(state: &Path, vm: &str) -> PathBuf {
    dir(state).join(format!("{vm}.json"))
}

/// Writes VM `vm`'s tombstone: its migration with `secret` was abandoned.
///
/// # Errors
/// The directory or file cannot be written.
pub(crate) fn write(state: &Path, vm: &str, secret: &str) -> std::io::Result<()> {
    let stone = Tombstone { secret: secret.to_string(), outcome: Outcome::Abandoned, at: crate::api::now_rfc3339() };
    let data = serde_json::to_vec_pretty(&stone).map_err(std::io::Error::other)?;
    crate::state::dirs::private_dir(&dir(state))?;
    crate::state::atomic::write_atomic(&path(state, vm), &data)
}

/// VM `vm`'s tombstone, if it has one that reads.
pub(crate) fn read(state: &Path, vm: &str) -> Option<Tombstone> {
    let data = std::fs::read(path(state, vm)).ok()?;
    match serde_json::from_slice(&data) {
        Ok(stone) => Some(stone),
        Err(e) => {
            tracing::warn!(vm, error = %e, "unreadable migration tombstone: a source's query is not answered");
            None
        }
    }
}

/// Removes VM `vm`'s tombstone (a new migration of the name begins). Absent is fine.
///
/// # Errors
/// It cannot be removed.
pub(crate) fn remove(state: &Path, vm: &str) -> std::io::Result<()> {
    crate::state::atomic::remove_durable(&path(state, vm)).map(|_| ())
}

/// The migration port's [`Outcomes`] on this host: a VM's record while it has one, else its
/// tombstone. Holds the manager weakly: the port lives inside it.
pub(crate) struct RecordOutcomes {
    mgr: Weak<Manager>,
}

impl Outcomes for RecordOutcomes {
    fn outcome(&self, vm: &str) -> Option<(Secret, Outcome)> {
        let mgr = self.mgr.upgrade()?;
        if let Ok(rec) = mgr.record(vm) {
            let outcome = outcome_of(rec.status, rec.migration())?;
            let secret = rec.migration().and_then(|m| Secret::parse(&m.secret).ok())?;
            return Some((secret, outcome));
        }
        let stone = read(&mgr.config.paths.state, vm)?;
        Some((Secret::parse(&stone.secret).ok()?, stone.outcome))
    }
}

impl Manager {
    /// What the migration port answers a source's `Query` from ([`RecordOutcomes`]): give it
    /// to [`crate::migration::Migrations::serve`].
    pub fn migration_outcomes(self: &Arc<Self>) -> Arc<dyn Outcomes> {
        Arc::new(RecordOutcomes { mgr: Arc::downgrade(self) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tombstone_is_written_read_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path(), "vm-1").is_none());
        write(dir.path(), "vm-1", &"ab".repeat(32)).unwrap();
        let stone = read(dir.path(), "vm-1").unwrap();
        assert_eq!((stone.secret.as_str(), stone.outcome), ("ab".repeat(32).as_str(), Outcome::Abandoned));
        assert!(path(dir.path(), "vm-1").starts_with(dir.path().join("migrations")));
        remove(dir.path(), "vm-1").unwrap();
        assert!(read(dir.path(), "vm-1").is_none());
        remove(dir.path(), "vm-1").unwrap();
    }
}
