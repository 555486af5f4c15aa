//! Placement: which host CPUs, NUMA nodes and hugepages a VM's QEMU runs on.
//!
//! A sensor VM that captures at line rate needs CPUs no other VM's vCPU is scheduled on, its
//! memory on the node of its capture NIC, and no page faults on its hot path. This module owns
//! that decision, apart from the side effects, so it can be tested as a pure function.
//!
//! The order: [`topology::read`] learns the host's nodes, CPUs and hugepage pools from sysfs;
//! [`allocate::place`] (pure, under the lifecycle's allocation lock, against what the other VMs
//! hold) answers a [`Placement`] or the 3001/3002 refusal; the lifecycle records it in the VM's
//! record before QEMU runs (intent first); `pin` then makes it true on the host (affinity of
//! QEMU's threads) and [`allocate::shared_pool`] says where shared VMs float as dedicated
//! holdings come and go. The record's placement is cleared when the QEMU is gone.

pub mod allocate;
pub mod cpuset;
pub mod pin;
pub mod topology;

pub use allocate::{place, shared_cpus, shared_pool};
pub use cpuset::CpuSet;

use crate::api::{CpuPolicy, HugePageSize, NumaPolicy};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Where one VM runs: recorded in its record while its QEMU runs (`VmRecord::placement`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// The VM's CPU policy when it was placed.
    pub policy: CpuPolicy,
    /// Host CPU of each vCPU, in vCPU order (dedicated); empty for shared (they float over
    /// `cpus`).
    pub vcpus: Vec<u32>,
    /// Every CPU the VM's threads may use: dedicated: its vcpus (+ emulator CPU); shared: the
    /// shared pool when placed (re-pinned as it changes).
    pub cpus: CpuSet,
    /// Where QEMU's non-vCPU threads run: its emulator CPU, else the housekeeping set, else
    /// (none) the shared pool at pin time.
    pub emulator: CpuSet,
    /// NUMA nodes its memory is bound to (empty: no binding).
    pub nodes: Vec<u32>,
    /// Hugepages backing its memory.
    pub hugepages: Option<HugePageSize>,
    /// How many pages of that size on each node.
    pub hugepages_per_node: BTreeMap<u32, u64>,
    /// The VM's memory (MiB), for the nodes' room.
    pub memory_mib: u64,
}

impl Placement {
    /// True for a dedicated holding: its `cpus` are no one else's.
    pub fn is_dedicated(&self) -> bool {
        self.policy == CpuPolicy::Dedicated
    }
}

impl From<&Placement> for crate::api::PlacementView {
    fn from(p: &Placement) -> crate::api::PlacementView {
        crate::api::PlacementView {
            policy: p.policy,
            cpus: p.cpus.clone(),
            vcpus: p.vcpus.clone(),
            emulator: p.emulator.clone(),
            nodes: p.nodes.clone(),
            hugepages: p.hugepages,
            hugepages_per_node: p.hugepages_per_node.clone(),
        }
    }
}

/// What another VM holds, for the allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held<'a> {
    /// Its name.
    pub vm: &'a str,
    /// Its recorded placement.
    pub placement: &'a Placement,
    /// Its QEMU runs (its hugepages are already out of the pools' `free`).
    pub settled: bool,
}

/// What a VM asks to be placed with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'a> {
    /// Its name.
    pub vm: &'a str,
    /// `spec.cpu`.
    pub vcpus: u32,
    /// `spec.memory_mib`.
    pub memory_mib: u64,
    /// `spec.cpu_policy`.
    pub policy: CpuPolicy,
    /// `spec.numa`, with its default resolved ([`crate::api::VmSpec::numa_policy`]).
    pub numa: NumaPolicy,
    /// `spec.hugepages`.
    pub hugepages: Option<HugePageSize>,
    /// `spec.emulator_cpu`.
    pub emulator_cpu: bool,
    /// NUMA nodes of the VM's passthrough devices (devices without one left out).
    pub device_nodes: Vec<u32>,
}

impl<'a> Request<'a> {
    /// The request of `spec`, its devices on `device_nodes`.
    pub fn of(spec: &'a crate::api::VmSpec, device_nodes: Vec<u32>) -> Request<'a> {
        Request {
            vm: &spec.name,
            vcpus: spec.cpu,
            memory_mib: spec.memory_mib,
            policy: spec.cpu_policy,
            numa: spec.numa_policy(),
            hugepages: spec.hugepages,
            emulator_cpu: spec.emulator_cpu,
            device_nodes,
        }
    }
}
