//! Which status changes a VM record may make: one table, checked on every write.
//!
//! A record's [`VmStatus`] says what the VM is doing and so what recovery must settle after a
//! crash. Before this table existed the status was assigned from anywhere and nothing said
//! which change was meant; a wrong one (a VM being destroyed recorded `running` again) would
//! only show as an odd recovery. Now:
//!
//! 1. [`EDGES`] lists every allowed change with the step that makes it (derived from every
//!    write site of the lifecycle, recovery and exit handling included);
//! 2. [`check`] answers for one change (keeping a status is always allowed);
//! 3. [`crate::state::VmRecord::set_status`] is how the lifecycle changes a status, and the
//!    registry's write checks every committed record against its predecessor once more, so a
//!    change made another way (a replace writes a new record) is checked too.
//!
//! A refused change is a bug: it is logged at error and returned as [`TransitionError`] (API
//! code 5000), and nothing is written. docs/lifecycle.md ("Status changes") shows the same
//! table; a test keeps the two equal.

use crate::api::VmStatus;
use VmStatus::{Creating, Dead, Destroying, Failed, Incoming, Migrating, Running, Starting, Stopped, Stopping};

/// One allowed change of status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edge {
    /// The status the record had.
    pub from: VmStatus,
    /// The status it gets.
    pub to: VmStatus,
    /// The step that makes this change (for the docs and the reader).
    pub why: &'static str,
}

const fn edge(from: VmStatus, to: VmStatus, why: &'static str) -> Edge {
    Edge { from, to, why }
}

/// Every allowed change between two different statuses. `destroying` is left only by a
/// failure (or by removing the record); `dead` is reached only from `running` and `migrating`.
pub const EDGES: &[Edge] = &[
    edge(Creating, Running, "a create's QEMU is up"),
    edge(Creating, Stopped, "a create with `state: stopped` is done"),
    edge(Creating, Failed, "a create failed, or a vmhostd restart interrupted it"),
    edge(Creating, Destroying, "vm.destroy"),
    edge(Starting, Running, "a start's QEMU is up, or recovery re-adopts it"),
    edge(Starting, Stopped, "vm.stop finds no QEMU"),
    edge(Starting, Failed, "a start failed, or a vmhostd restart interrupted it"),
    edge(Starting, Destroying, "vm.destroy"),
    edge(Running, Creating, "vm.apply replaces the VM"),
    edge(Running, Starting, "vm.start finds the recorded QEMU gone and launches another"),
    edge(Running, Stopping, "a stop, a reconfigure or a host shutdown powers it off"),
    edge(Running, Stopped, "the guest powered off (policy never or on-failure), or vm.stop finds no QEMU"),
    edge(Running, Failed, "an operation failed and kept a QEMU it could not end, or the restart policy gave up"),
    edge(Running, Dead, "QEMU ended without vmhostd asking"),
    edge(Running, Destroying, "vm.destroy"),
    edge(Stopping, Creating, "vm.apply replaces a VM whose stop could not end its QEMU"),
    edge(Stopping, Starting, "vm.start after a stop whose QEMU is gone"),
    edge(Stopping, Running, "vm.start adopts the QEMU a failed stop left"),
    edge(Stopping, Stopped, "the stopped QEMU ended (also finished by recovery)"),
    edge(Stopping, Failed, "a start failed before its launch"),
    edge(Stopping, Destroying, "vm.destroy"),
    edge(Stopped, Creating, "vm.apply replaces the VM"),
    edge(Stopped, Starting, "vm.start launches QEMU"),
    edge(Stopped, Running, "a start or recovery adopts a QEMU of the VM found running"),
    edge(Stopped, Failed, "a start failed before its launch"),
    edge(Stopped, Destroying, "vm.destroy"),
    edge(Failed, Creating, "vm.apply replaces the VM"),
    edge(Failed, Starting, "vm.start launches QEMU"),
    edge(Failed, Running, "a start or recovery adopts the QEMU a failed operation kept"),
    edge(Failed, Stopping, "vm.stop powers off the QEMU a failed operation kept"),
    edge(Failed, Stopped, "vm.stop"),
    edge(Failed, Destroying, "vm.destroy"),
    edge(Dead, Creating, "vm.apply replaces the VM"),
    edge(Dead, Starting, "vm.start or the restart policy launches QEMU"),
    edge(Dead, Running, "a start or recovery adopts a QEMU of the VM found running"),
    edge(Dead, Stopped, "vm.stop"),
    edge(Dead, Failed, "the restart policy's start, or another start, failed before its launch"),
    edge(Dead, Destroying, "vm.destroy"),
    edge(Destroying, Failed, "a destroy failed; what still exists stays recorded"),
    edge(Creating, Incoming, "vm.migrate_in admitted the VM: what it needs is made, its guest does not run here yet"),
    edge(Running, Migrating, "vm.migrate begins sending the running VM to another vmhostd"),
    edge(Stopped, Migrating, "vm.move begins sending the stopped VM to another vmhostd"),
    edge(Dead, Migrating, "vm.move begins sending the VM whose QEMU ended without vmhostd asking"),
    edge(
        Migrating,
        Running,
        "a migration failed or was cancelled before the destination confirmed: the guest runs here",
    ),
    edge(Migrating, Stopped, "a cold move failed before the destination confirmed: the VM stays here"),
    edge(Migrating, Destroying, "the destination confirmed: the source gives back what the VM held, as a destroy"),
    edge(
        Migrating,
        Failed,
        "the outcome cannot be known yet (the destination cannot be asked): the paused guest is kept",
    ),
    edge(Migrating, Dead, "QEMU ended during a migration without vmhostd asking"),
    edge(Incoming, Running, "the source's commit: the guest runs here"),
    edge(Incoming, Stopped, "a cold move's files arrived and were checked"),
    edge(Incoming, Destroying, "an incoming migration was abandoned (the source failed, went away or never came)"),
    edge(Incoming, Failed, "abandoning an incoming migration failed; what still exists stays recorded"),
];

/// A status change the table does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// `from` to `to` is not in [`EDGES`]: a bug in the step that asked for it.
    #[error("VM {vm:?}: the status change {from} -> {to} is not allowed (a bug; nothing was written)")]
    Refused {
        /// The VM.
        vm: String,
        /// Its recorded status.
        from: VmStatus,
        /// The status asked for.
        to: VmStatus,
    },
}

impl From<TransitionError> for crate::api::ApiError {
    fn from(e: TransitionError) -> Self {
        crate::api::ApiError::internal(e.to_string())
    }
}

/// Whether the table allows `from` to `to` (keeping a status always is).
pub fn allowed(from: VmStatus, to: VmStatus) -> bool {
    from == to || EDGES.iter().any(|e| e.from == from && e.to == to)
}

/// Checks the change of VM `vm`'s status from `from` to `to` against [`EDGES`]; a refusal is
/// logged at error.
///
/// # Errors
/// [`TransitionError::Refused`] when the table does not allow it.
pub fn check(vm: &str, from: VmStatus, to: VmStatus) -> Result<(), TransitionError> {
    if allowed(from, to) {
        return Ok(());
    }
    let e = TransitionError::Refused { vm: vm.to_string(), from, to };
    tracing::error!(vm, %from, %to, "refused status change: {e}");
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The table as written out here, independently of [`EDGES`]: every change the lifecycle
    /// makes today. A change to the table must change this too.
    const EXPECTED: &[(VmStatus, &[VmStatus])] = &[
        (Creating, &[Running, Stopped, Failed, Destroying, Incoming]),
        (Starting, &[Running, Stopped, Failed, Destroying]),
        (Running, &[Creating, Starting, Stopping, Stopped, Failed, Dead, Destroying, Migrating]),
        (Stopping, &[Creating, Starting, Running, Stopped, Failed, Destroying]),
        (Stopped, &[Creating, Starting, Running, Failed, Destroying, Migrating]),
        (Failed, &[Creating, Starting, Running, Stopping, Stopped, Destroying]),
        (Dead, &[Creating, Starting, Running, Stopped, Failed, Destroying, Migrating]),
        (Destroying, &[Failed]),
        (Migrating, &[Running, Stopped, Destroying, Failed, Dead]),
        (Incoming, &[Running, Stopped, Destroying, Failed]),
    ];

    #[test]
    fn every_pair_is_allowed_or_refused_as_the_table_says() {
        assert_eq!(EXPECTED.len(), VmStatus::ALL.len());
        let mut allowed_pairs = 0;
        for from in VmStatus::ALL {
            let to_list = EXPECTED.iter().find(|(f, _)| *f == from).map(|(_, t)| *t).unwrap_or_default();
            for to in VmStatus::ALL {
                let result = check("v", from, to);
                if from == to || to_list.contains(&to) {
                    assert_eq!(result, Ok(()), "{from} -> {to} must be allowed");
                    allowed_pairs += 1;
                } else {
                    assert_eq!(
                        result,
                        Err(TransitionError::Refused { vm: "v".into(), from, to }),
                        "{from} -> {to} must be refused"
                    );
                }
            }
        }
        assert_eq!(allowed_pairs, VmStatus::ALL.len() + EDGES.len());
    }

    #[test]
    fn the_table_has_no_duplicate_and_no_self_edge() {
        let set: BTreeSet<(&str, &str)> = EDGES.iter().map(|e| (e.from.as_str(), e.to.as_str())).collect();
        assert_eq!(set.len(), EDGES.len());
        assert!(EDGES.iter().all(|e| e.from != e.to && !e.why.is_empty()));
    }

    #[test]
    fn a_refusal_is_an_internal_error() {
        let e = check("v", Destroying, Running).unwrap_err();
        let api = crate::api::ApiError::from(e);
        assert_eq!(api.code, crate::api::Code::Internal);
        assert!(api.message.contains("destroying -> running"), "{}", api.message);
    }

    /// Outside tests, nothing in lifecycle/ or state/ assigns a record's status but
    /// [`crate::state::VmRecord::set_status`] (a view's display status is not a record).
    #[test]
    fn no_status_is_assigned_but_through_set_status() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut found = Vec::new();
        for dir in ["lifecycle", "state"] {
            for entry in std::fs::read_dir(src.join(dir)).unwrap() {
                let path = entry.unwrap().path();
                if path.extension() != Some(std::ffi::OsStr::new("rs")) {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
                for (n, line) in code.lines().enumerate() {
                    let line = line.trim();
                    let assigns = line.contains(".status = ") && !line.starts_with("//");
                    let allowed = line.starts_with("view.status = ") || line == "self.status = to;";
                    if assigns && !allowed {
                        found.push(format!("{}:{}: {line}", path.display(), n + 1));
                    }
                }
            }
        }
        assert!(found.is_empty(), "status assigned directly:\n{}", found.join("\n"));
    }

    /// The "Status changes" section of docs/lifecycle.md lists exactly [`EDGES`]: one table row
    /// `| \`from\` | \`to\` | why |` per edge.
    #[test]
    fn lifecycle_md_lists_every_status_change() {
        let doc = include_str!("../../../docs/lifecycle.md");
        let start = doc.find("## Status changes").expect("docs/lifecycle.md has a \"Status changes\" section");
        let section = &doc[start..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
        let listed: BTreeSet<(String, String)> = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| {
                let mut cells = l.split('|').map(|c| c.trim().trim_matches('`').to_string());
                Some((cells.next()?, cells.next()?))
            })
            .collect();
        let code: BTreeSet<(String, String)> =
            EDGES.iter().map(|e| (e.from.as_str().to_string(), e.to.as_str().to_string())).collect();
        assert_eq!(listed, code, "docs/lifecycle.md's status change table differs from state::transition::EDGES");
    }
}
