//! A migration a VM is part of, as its record remembers it ([`VmRecord::migration`]): written
//! before either vmhostd touches the host for it, so a restart of either knows which side of
//! which migration it was and how far it got (docs/moving.md, "Crash safety").
//!
//! The source's record says `status: migrating` for as long as the guest may still run there;
//! the destination's says `incoming` until the source's commit. The phase is the whole protocol
//! state a restart needs: before [`MigrationPhase::Committing`] the destination cannot have
//! committed (it commits only when asked), so the source resumes its guest; in `Committing` only
//! the destination's authenticated answer decides; from [`MigrationPhase::Committed`] the guest
//! runs on the destination and the source only finishes giving back what the VM held.

use crate::api::migration::MoveMode;
use serde::{Deserialize, Serialize};

use super::VmRecord;

/// Which side of a migration this host is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationRole {
    /// This host sends the VM (`vm.migrate`, `vm.move`).
    Outgoing,
    /// This host receives it (`vm.migrate_in`).
    Incoming,
}

/// How far a migration got (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationPhase {
    /// Destination: admitted and being made ready, or waiting for / receiving the streams.
    /// Source: the streams are being set up or run; the destination has not been asked to commit.
    Sending,
    /// Source only: the commit was (or is about to be) sent; the destination's answer decides.
    Committing,
    /// The destination committed: the guest runs there. Source: what the VM held here is being
    /// given back. Destination: its QEMU may still have to be resumed.
    Committed,
}

/// [`VmRecord::migration`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrationRecord {
    /// Which side this host is.
    pub role: MigrationRole,
    /// Live or cold.
    pub mode: MoveMode,
    /// The other vmhostd's migration address (`HOST:PORT`); empty on a destination until the
    /// source connected.
    pub peer: String,
    /// The one-time secret (hex), kept so that after a restart this side can still prove who it
    /// is to the other, and check the other's answer. The record file is root's, mode 0600.
    pub secret: String,
    /// How far it got.
    pub phase: MigrationPhase,
    /// RFC 3339, when this side began.
    pub since: String,
    /// Source of a cold move only: the move stopped the running VM (`stop: true`), so it is
    /// started again if the move does not happen.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopped: bool,
}

impl VmRecord {
    /// The migration this VM is part of, if any.
    pub fn migration(&self) -> Option<&MigrationRecord> {
        self.migration.as_ref()
    }

    /// Refuses a start, stop, replace or reconfigure of a VM that is being moved: an outgoing
    /// migration not settled (its outcome unknown: its paused guest may be the only copy, or
    /// the destination's may run), or an incoming one not committed (the guest runs on the
    /// source). Neither autostart nor an operator may run, end or rebuild it until the
    /// migration settles (a destroy still may, the operator's call). Here, beside the record,
    /// so that every operation can ask without importing the migration's lifecycle.
    ///
    /// # Errors
    /// 4090 naming the other host.
    pub fn check_not_moving(&self) -> Result<(), crate::api::ApiError> {
        let moving = self.migration().filter(|m| match m.role {
            MigrationRole::Outgoing => true,
            MigrationRole::Incoming => m.phase != MigrationPhase::Committed,
        });
        match moving {
            Some(m) => Err(crate::api::ApiError::new(
                crate::api::Code::Busy,
                format!(
                    "VM {:?} is being moved ({} {}; or its outcome is not known yet): vmhostd settles it \
                     when the other host answers",
                    self.spec.name,
                    if m.role == MigrationRole::Outgoing { "to" } else { "from" },
                    if m.peer.is_empty() { "another vmhostd" } else { m.peer.as_str() },
                ),
            )
            .field("name")),
            None => Ok(()),
        }
    }
}

/// The VM view's `migration` for `m`, with the progress the running side last reported.
pub fn view(
    m: &MigrationRecord,
    progress: Option<&crate::api::migration::MigrationProgress>,
) -> crate::api::migration::MigrationView {
    let name = |v: serde_json::Result<serde_json::Value>| v.ok().and_then(|v| v.as_str().map(str::to_string));
    crate::api::migration::MigrationView {
        role: name(serde_json::to_value(m.role)).unwrap_or_default(),
        peer: m.peer.clone(),
        phase: name(serde_json::to_value(m.phase)).unwrap_or_default(),
        progress: progress.cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_names_role_and_phase_as_the_record_writes_them_and_carries_the_progress() {
        let m = MigrationRecord {
            role: MigrationRole::Outgoing,
            mode: MoveMode::Live,
            peer: "10.0.0.2:7300".into(),
            secret: "00".repeat(32),
            phase: MigrationPhase::Committing,
            since: "2026-12-06T00:00:00Z".into(),
            stopped: false,
        };
        let p = crate::api::migration::MigrationProgress { phase: "committing".into(), ..Default::default() };
        let v = view(&m, Some(&p));
        assert_eq!((v.role.as_str(), v.phase.as_str(), v.peer.as_str()), ("outgoing", "committing", "10.0.0.2:7300"));
        assert_eq!(v.progress, Some(p));
        let json = serde_json::to_value(view(&m, None)).unwrap();
        assert!(json.get("progress").is_none() && json.get("secret").is_none(), "{json}");
    }
}
