//! The pure allocator: given the host's topology, `[hardware] vm_cpus` and what other VMs
//! hold, where a VM goes ([`place`]) and where shared VMs float ([`shared_pool`]).

use super::topology::Topology;
use super::{CpuSet, Held, Placement, Request};
use crate::api::{ApiError, Code};

/// Pure. `vm_cpus` None = no pinning configured: shared VMs get a placement with empty
/// cpus/nodes unless numa/hugepages ask for something (memory-only placement), dedicated ->
/// 3001. `Ok(None)`: nothing to place (shared, no vm_cpus, no numa, no hugepages).
///
/// # Errors
/// 3001 when the host cannot do what is asked at all, 3002 when it has no room now.
pub fn place(
    _topo: &Topology,
    _vm_cpus: Option<&CpuSet>,
    _held: &[Held<'_>],
    req: &Request<'_>,
) -> Result<Option<Placement>, ApiError> {
    Err(ApiError::new(Code::NotInModel, format!("VM {:?}: placement is not implemented yet", req.vm)))
}

/// The CPUs shared VMs may use now: vm_cpus minus every dedicated holding (vm_cpus None: None).
pub fn shared_pool(vm_cpus: Option<&CpuSet>, held: &[Held<'_>]) -> Option<CpuSet> {
    let vm_cpus = vm_cpus?;
    Some(
        held.iter()
            .filter(|h| h.placement.is_dedicated())
            .fold(vm_cpus.clone(), |pool, h| pool.difference(&h.placement.cpus)),
    )
}
