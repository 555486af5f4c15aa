//! SKELETON (issue 32): the outgoing side of a migration; the helper fills it (docs/moving.md).

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

/// `vm.migrate`.
///
/// # Errors
/// Not built yet.
pub(crate) async fn migrate(
    _mgr: &Arc<Manager>,
    _p: crate::api::migration::MigrateParams,
) -> Result<crate::api::migration::MigrateResult, ApiError> {
    Err(ApiError::internal("vm.migrate is not built yet"))
}
