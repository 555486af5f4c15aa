//! What a destination remembers of an incoming migration it gave up, after the VM's record is
//! gone: one tombstone per abandoned migration, `STATE/migrations/NAME.TAG.json`
//! (`{secret, outcome: "abandoned", at}`; TAG a hash of the secret, never the secret itself),
//! so that a source that lost its control channel and asks later (`Query`) is told,
//! authenticated with that migration's secret, that the guest must run on the source. Keyed by
//! name and secret: a later migration of the same name (to this host, given up or not) does not
//! take an older source's answer away. And the answer to that `Query` ([`RecordOutcomes`], the
//! migration port's [`Outcomes`]): the record while there is one, and every tombstone of the
//! name.
//!
//! Tombstones live [`MAX_AGE`]: a source asks every 30 s while its outcome is unknown and an
//! operator settles within days (`vm.migrate_settle`); after that nobody asks, and an old one is
//! removed ([`prune`]) when the migration port starts and whenever a new one is written.
//!
//! Order of use: [`write`] by an abandon before the record is removed (atomically, so a crash
//! leaves it whole or absent); [`read_all`] by [`RecordOutcomes`] whenever the listener asks;
//! [`prune`] at start ([`Manager::migration_outcomes`]) and by [`write`].

use super::decide::outcome_of;
use crate::lifecycle::Manager;
use crate::migration::{Outcome, Outcomes, Secret};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

/// How long a tombstone answers (module doc): 7 days.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// The newest tombstones of one name a query is checked against: each costs the listener one
/// proof check, and only a name migrated here and given up this often within [`MAX_AGE`] has
/// more.
const MAX_PER_VM: usize = 16;
/// Hex digits of the secret's hash in a file name: enough that two migrations never collide.
const TAG_LEN: usize = 32;

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

/// The tag of a secret in a file name (pure): a domain-separated SHA-256, so the name says
/// which migration without letting anyone who can list the directory prove it.
fn tag(secret_hex: &str) -> String {
    let digest = Sha256::new().chain_update(b"vmhost-tombstone-v1\0").chain_update(secret_hex.as_bytes()).finalize();
    digest.iter().take(TAG_LEN / 2).map(|b| format!("{b:02x}")).collect()
}

/// The tombstone of VM `vm`'s migration with `secret_hex` (`vm` a validated VM name: no path
/// separators).
pub(crate) fn path(state: &Path, vm: &str, secret_hex: &str) -> PathBuf {
    dir(state).join(format!("{vm}.{}.json", tag(secret_hex)))
}

/// The VM name of a tombstone's file name (pure), or `None` for any other file (a partial
/// write's temp file, an older format).
fn vm_of(file_name: &str) -> Option<&str> {
    let (vm, tag) = file_name.strip_suffix(".json")?.rsplit_once('.')?;
    (tag.len() == TAG_LEN && tag.bytes().all(|b| b.is_ascii_hexdigit()) && !vm.is_empty()).then_some(vm)
}

/// Writes VM `vm`'s tombstone: its migration with `secret` was abandoned. Removes tombstones
/// older than [`MAX_AGE`] first.
///
/// # Errors
/// The directory or file cannot be written.
pub(crate) fn write(state: &Path, vm: &str, secret: &str) -> std::io::Result<()> {
    if let Err(e) = prune(state, MAX_AGE, SystemTime::now()) {
        tracing::warn!(error = %e, "cannot remove old migration tombstones");
    }
    let stone = Tombstone { secret: secret.to_string(), outcome: Outcome::Abandoned, at: crate::api::now_rfc3339() };
    let data = serde_json::to_vec_pretty(&stone).map_err(std::io::Error::other)?;
    crate::state::dirs::private_dir(&dir(state))?;
    crate::state::atomic::write_atomic(&path(state, vm, secret), &data)
}

/// VM `vm`'s tombstones that read, newest first, at most [`MAX_PER_VM`].
pub(crate) fn read_all(state: &Path, vm: &str) -> Vec<Tombstone> {
    let Ok(entries) = std::fs::read_dir(dir(state)) else { return Vec::new() };
    let mut found: Vec<(SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_name().to_str().and_then(vm_of) == Some(vm))
        .map(|e| (e.metadata().and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH), e.path()))
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    found
        .into_iter()
        .take(MAX_PER_VM)
        .filter_map(|(_, path)| {
            let data = std::fs::read(&path).ok()?;
            match serde_json::from_slice(&data) {
                Ok(stone) => Some(stone),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable migration tombstone: not answered from");
                    None
                }
            }
        })
        .collect()
}

/// Removes every tombstone last written more than `max_age` before `now` (and any other file
/// of that age in the directory: a temp file a crash left). Returns how many went.
///
/// # Errors
/// The directory cannot be listed (absent is fine).
pub(crate) fn prune(state: &Path, max_age: Duration, now: SystemTime) -> std::io::Result<usize> {
    let entries = match std::fs::read_dir(dir(state)) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Ok(modified) = e.metadata().and_then(|m| m.modified()) else { continue };
        if now.duration_since(modified).is_ok_and(|age| age > max_age) {
            match crate::state::atomic::remove_durable(&e.path()) {
                Ok(_) => removed += 1,
                Err(err) => tracing::warn!(path = %e.path().display(), error = %err, "cannot remove an old tombstone"),
            }
        }
    }
    if removed > 0 {
        tracing::info!(removed, "removed migration tombstones older than {} days", max_age.as_secs() / 86400);
    }
    Ok(removed)
}

/// The migration port's [`Outcomes`] on this host: a VM's record while it has one, and its
/// tombstones. Holds the manager weakly: the port lives inside it.
pub(crate) struct RecordOutcomes {
    mgr: Weak<Manager>,
}

impl RecordOutcomes {
    /// The record's answer, if it has a migration.
    fn of_record(mgr: &Manager, vm: &str) -> Option<(Secret, Outcome)> {
        let rec = mgr.record(vm).ok()?;
        let outcome = outcome_of(rec.status, rec.migration())?;
        let secret = rec.migration().and_then(|m| Secret::parse(&m.secret).ok())?;
        Some((secret, outcome))
    }
}

impl Outcomes for RecordOutcomes {
    fn outcome(&self, vm: &str) -> Option<(Secret, Outcome)> {
        self.outcomes(vm).into_iter().next()
    }

    fn outcomes(&self, vm: &str) -> Vec<(Secret, Outcome)> {
        let Some(mgr) = self.mgr.upgrade() else { return Vec::new() };
        let stones = read_all(&mgr.config.paths.state, vm).into_iter();
        let stones = stones.filter_map(|s| Some((Secret::parse(&s.secret).ok()?, s.outcome)));
        Self::of_record(&mgr, vm).into_iter().chain(stones).collect()
    }
}

impl Manager {
    /// What the migration port answers a source's `Query` from ([`RecordOutcomes`]): give it
    /// to [`crate::migration::Migrations::serve`]. Called once at start: tombstones older than
    /// [`MAX_AGE`] are removed here.
    pub fn migration_outcomes(self: &Arc<Self>) -> Arc<dyn Outcomes> {
        if let Err(e) = prune(&self.config.paths.state, MAX_AGE, SystemTime::now()) {
            tracing::warn!(error = %e, "cannot remove old migration tombstones");
        }
        Arc::new(RecordOutcomes { mgr: Arc::downgrade(self) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tombstones_are_kept_per_migration_and_read_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = ("ab".repeat(32), "cd".repeat(32));
        assert!(read_all(dir.path(), "vm-1").is_empty());
        write(dir.path(), "vm-1", &a).unwrap();
        std::thread::sleep(Duration::from_millis(20)); // distinct modification times
        write(dir.path(), "vm-1", &b).unwrap();
        write(dir.path(), "vm-1.x", &a).unwrap();
        let secrets: Vec<String> = read_all(dir.path(), "vm-1").into_iter().map(|s| s.secret).collect();
        assert_eq!(secrets, [b.clone(), a.clone()], "a second migration of the name keeps the first's answer");
        assert!(read_all(dir.path(), "vm-1").iter().all(|s| s.outcome == Outcome::Abandoned));
        assert_eq!(read_all(dir.path(), "vm-1.x").len(), 1, "names are matched whole");
        assert!(read_all(dir.path(), "vm").is_empty());
    }

    #[test]
    fn a_file_name_names_the_vm_and_a_hash_never_the_secret() {
        let secret = "ab".repeat(32);
        let p = path(Path::new("/s"), "vm-1", &secret);
        let name = p.file_name().and_then(|n| n.to_str()).unwrap();
        assert!(p.starts_with("/s/migrations"));
        assert!(!name.contains(&secret) && !name.contains(&secret[..16]), "{name}");
        assert_eq!(vm_of(name), Some("vm-1"));
        assert_ne!(tag(&secret), tag(&"cd".repeat(32)));
        for other in
            ["vm-1.json", "vm-1.json.tmp", ".tmp.vm-1.json", "vm-1.zz.json", ".0123456789abcdef0123456789abcdef.json"]
        {
            assert_eq!(vm_of(other), None, "{other}");
        }
    }

    #[test]
    fn old_tombstones_are_removed_and_recent_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(prune(dir.path(), MAX_AGE, SystemTime::now()).unwrap(), 0, "no directory yet");
        write(dir.path(), "vm-1", &"ab".repeat(32)).unwrap();
        assert_eq!(prune(dir.path(), MAX_AGE, SystemTime::now()).unwrap(), 0);
        assert_eq!(read_all(dir.path(), "vm-1").len(), 1);
        let later = SystemTime::now() + MAX_AGE + Duration::from_secs(60);
        assert_eq!(prune(dir.path(), MAX_AGE, later).unwrap(), 1);
        assert!(read_all(dir.path(), "vm-1").is_empty());
    }
}
