//! SKELETON (issue 32): `vm.move`, a stopped VM's spec and disks streamed to another vmhostd
//! (docs/moving.md); the helper fills it.

use super::super::Manager;
use crate::api::ApiError;
use std::sync::Arc;

/// `vm.move`.
///
/// # Errors
/// Not built yet.
pub(crate) async fn move_vm(
    _mgr: &Arc<Manager>,
    _p: crate::api::migration::MoveParams,
) -> Result<crate::api::migration::MigrateResult, ApiError> {
    Err(ApiError::internal("vm.move is not built yet"))
}
