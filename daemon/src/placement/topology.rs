//! The host's NUMA topology as the kernel shows it in sysfs: nodes, their online CPUs, memory
//! and hugepage pools.

use super::CpuSet;
use crate::api::HugePageSize;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One hugepage pool of a node, in pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HugePool {
    /// Pages reserved (`nr_hugepages`).
    pub total: u64,
    /// Pages not in use (`free_hugepages`).
    pub free: u64,
}

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Its number (`nodeN`).
    pub id: u32,
    /// Its online CPUs.
    pub cpus: CpuSet,
    /// Its memory (`MemTotal` of the node), MiB.
    pub memory_mib: u64,
    /// The hugepage sizes the kernel offers on it, with their pools.
    pub hugepages: BTreeMap<HugePageSize, HugePool>,
}

/// The host's nodes, lowest id first, and its online CPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The nodes.
    pub nodes: Vec<Node>,
    /// Every online CPU.
    pub online: CpuSet,
}

impl Topology {
    /// The node numbered `id`.
    pub fn node(&self, id: u32) -> Option<&Node> {
        self.nodes.iter().find(|n| n.id == id)
    }
}
