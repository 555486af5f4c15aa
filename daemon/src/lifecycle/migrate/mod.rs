//! Moving VMs between vmhostds (docs/moving.md): `vm.migrate_in` ([`incoming`], the
//! destination), `vm.migrate` ([`outgoing`], the source, live), `vm.move` ([`cold`], the
//! source, a stopped VM), and what a restart of either side settles ([`settle`]).
//!
//! The lifecycle is the only coordinator of what a migration touches on each host: the
//! migration port's streams ([`crate::migration`]), QEMU's side ([`crate::qemu::migration`]),
//! NICs, disks and the record. The protocol's state lives in the record
//! ([`crate::state::migration`]), written before each step that depends on it.

mod carry;
pub(crate) mod cold;
pub(crate) mod incoming;
mod machine;
pub(crate) mod outgoing;
mod progress;
mod source_outcome;
mod source_settle;

pub(crate) use source_settle::{migrate_settle, Unsettled};

use super::held::HeldVm;
use super::Manager;
use crate::api::ApiError;
use crate::process::ProcessIdentity;
use crate::state::migration::MigrationRole;
use crate::state::VmRecord;

/// Recovery of a VM whose record names a migration (or says `migrating` / `incoming`): each
/// side settles its own (the source, live or cold, [`source_settle::recover`]; the destination
/// [`incoming::recover`], a cold one's [`cold::receive::recover`]). `live` is the VM's
/// QEMU found running. Returns true when the VM is settled, false when recovery goes on as for
/// any VM (a committed incoming VM is an ordinary running one).
///
/// # Errors
/// As the side's recovery.
pub(super) async fn settle(
    mgr: &std::sync::Arc<Manager>,
    held: &HeldVm,
    rec: &VmRecord,
    live: Option<ProcessIdentity>,
) -> Result<bool, ApiError> {
    let role = match rec.migration() {
        Some(m) => m.role,
        None if rec.status == crate::api::VmStatus::Incoming => MigrationRole::Incoming,
        None => MigrationRole::Outgoing,
    };
    let cold = rec.migration().is_some_and(|m| m.mode == crate::api::migration::MoveMode::Cold);
    match (role, cold) {
        (MigrationRole::Incoming, true) => {
            cold::receive::recover(held, rec, |h, why| Box::pin(incoming::abandon(h, why))).await
        }
        (MigrationRole::Incoming, false) => incoming::recover(mgr, held, rec, live).await,
        (MigrationRole::Outgoing, _) => source_settle::recover(mgr, held, rec, live).await.map(|()| true),
    }
}

/// What the source's `Hello` gives the destination's record, live or cold: the source's
/// address, and the guest's seed and NICs as the source gave them (cloud-init must see the same
/// instance, the guest the same interfaces).
fn adopt_source(r: &mut crate::state::VmRecord, peer: String, hello: &crate::migration::Hello) {
    if let Some(m) = r.migration.as_mut() {
        m.peer = peer;
    }
    if hello.instance_id.is_some() {
        r.instance_id = hello.instance_id.clone();
    }
    for (nic, mac) in r.nics.iter_mut().zip(&hello.macs) {
        nic.mac = mac.to_ascii_lowercase();
    }
}
