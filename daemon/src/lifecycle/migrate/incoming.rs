//! SKELETON (issue 32): the incoming side of a migration; the helper fills it (docs/moving.md).

use super::super::held::HeldVm;
use super::super::Manager;
use crate::api::ApiError;
use crate::process::ProcessIdentity;
use crate::state::VmRecord;
use std::sync::Arc;

/// Recovery of this side after a vmhostd restart (module doc of [`super`]).
///
/// # Errors
/// Not built yet.
pub(in crate::lifecycle) async fn recover(
    _mgr: &Arc<Manager>,
    _held: &HeldVm,
    _rec: &VmRecord,
    _live: Option<ProcessIdentity>,
) -> Result<(), ApiError> {
    Err(ApiError::internal("migration recovery is not built yet"))
}

/// `vm.migrate_in`.
///
/// # Errors
/// Not built yet.
pub(crate) async fn migrate_in(
    _mgr: &Arc<Manager>,
    _p: crate::api::migration::MigrateInParams,
) -> Result<crate::api::migration::MigrateInResult, ApiError> {
    Err(ApiError::internal("vm.migrate_in is not built yet"))
}
