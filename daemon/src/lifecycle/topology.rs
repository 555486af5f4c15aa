//! The host's topology as the lifecycle holds it, and the placement views made from it.
//!
//! [`HostTopology::open`] reads sysfs once when the manager opens (logging what it found, or
//! why it fell back to the config's CPU and memory counts); [`HostTopology::now`] re-reads it
//! for each question that needs the hugepage pools as they are (admission, `host.info`, a dry
//! run). [`held`] turns the records into the allocator's [`Held`] list; [`node_infos`] and
//! [`cpu_info`] make `host.info`'s `numa` and `cpus`.

use crate::api::{CpuInfo, DedicatedCpu, HugePagesInfo, NodeHolder, NodeInfo, VmSpec, VmStatus};
use crate::config::Config;
use crate::placement::topology::{self, Node, Topology};
use crate::placement::{shared_pool, CpuSet, Held};
use crate::state::VmRecord;
use std::path::PathBuf;

/// Where the topology is read from, and what was read when the manager opened.
#[derive(Debug, Clone)]
pub(crate) struct HostTopology {
    /// The sysfs root (`/sys`; a tree of a test's making).
    sys_root: PathBuf,
    /// Read at open, or made from the config when that failed: the answer when a later read
    /// fails.
    at_open: Topology,
}

impl HostTopology {
    /// Reads the topology below `sys_root`; on failure logs it and uses one node of the
    /// config's `cpu` CPUs and memory, without hugepages (placement still works on
    /// `vm_cpus`; NUMA binding and hugepages are then refused or unbound).
    pub(crate) fn open(sys_root: impl Into<PathBuf>, config: &Config) -> HostTopology {
        let sys_root = sys_root.into();
        let at_open = match topology::read(&sys_root) {
            Ok(t) => {
                for n in &t.nodes {
                    let pools: Vec<String> =
                        n.hugepages.iter().map(|(s, p)| format!("{s}: {}/{} free", p.free, p.total)).collect();
                    tracing::info!(node = n.id, cpus = %n.cpus, memory_mib = n.memory_mib, hugepages = ?pools, "NUMA node");
                }
                t
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot read the host's NUMA topology: one node of the config's CPUs and memory assumed");
                fallback(config)
            }
        };
        HostTopology { sys_root, at_open }
    }

    /// The topology now (hugepage pools as they are), or the one read at open when sysfs
    /// cannot be read now (logged).
    pub(crate) fn now(&self) -> Topology {
        topology::read(&self.sys_root).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot re-read the host's NUMA topology: using the one read at start");
            self.at_open.clone()
        })
    }

    /// The sysfs root it reads.
    pub(crate) fn sys_root(&self) -> &std::path::Path {
        &self.sys_root
    }

    /// The NUMA nodes of `spec`'s passthrough devices (devices without a known node left out).
    pub(crate) fn device_nodes(&self, spec: &VmSpec, config: &Config) -> Vec<u32> {
        let mut nodes: Vec<u32> = crate::validate::requested_devices(spec, &config.hardware)
            .into_iter()
            .filter_map(|addr| topology::pci_node(&self.sys_root, addr))
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }
}

/// One node 0 of the config's CPUs and memory, no hugepages.
fn fallback(config: &Config) -> Topology {
    let online = CpuSet::from_cpus(0..config.hardware.cpu);
    let node =
        Node { id: 0, cpus: online.clone(), memory_mib: config.hardware.memory_mib, hugepages: Default::default() };
    Topology { nodes: vec![node], online }
}

/// What the records hold, for the allocator: every recorded placement, settled when the VM's
/// QEMU runs.
pub(crate) fn held<'a>(records: impl IntoIterator<Item = &'a VmRecord>) -> Vec<Held<'a>> {
    records
        .into_iter()
        .filter_map(|r| {
            let placement = r.placement.as_ref()?;
            let settled = r.status == VmStatus::Running && r.process.is_some();
            Some(Held { vm: r.name(), placement, settled })
        })
        .collect()
}

/// `host.info`'s `numa`: each node with its pools, the model's devices on it and the VMs bound
/// to it or holding dedicated CPUs on it.
pub(crate) fn node_infos(
    topo: &Topology,
    vm_cpus: Option<&CpuSet>,
    held: &[Held<'_>],
    devices: &[(String, Option<u32>)],
) -> Vec<NodeInfo> {
    topo.nodes
        .iter()
        .map(|n| NodeInfo {
            node: n.id,
            cpus: n.cpus.clone(),
            vm_cpus: vm_cpus.map(|v| v.intersection(&n.cpus)).unwrap_or_default(),
            memory_mib: n.memory_mib,
            hugepages: n.hugepages.iter().map(|(s, p)| (*s, HugePagesInfo { total: p.total, free: p.free })).collect(),
            devices: devices.iter().filter(|(_, node)| *node == Some(n.id)).map(|(pci, _)| pci.clone()).collect(),
            holders: held
                .iter()
                .filter_map(|h| {
                    let cpus = h.placement.cpus.intersection(&n.cpus);
                    let dedicated = h.placement.is_dedicated();
                    let on_it = h.placement.nodes.contains(&n.id) || (dedicated && !cpus.is_empty());
                    on_it.then(|| NodeHolder { vm: h.vm.to_string(), cpus, dedicated })
                })
                .collect(),
        })
        .collect()
}

/// `host.info`'s `cpus`.
pub(crate) fn cpu_info(topo: &Topology, vm_cpus: Option<&CpuSet>, held: &[Held<'_>]) -> CpuInfo {
    let mut dedicated: Vec<DedicatedCpu> = held
        .iter()
        .filter(|h| h.placement.is_dedicated())
        .flat_map(|h| h.placement.cpus.iter().map(|cpu| DedicatedCpu { cpu, vm: h.vm.to_string() }))
        .collect();
    dedicated.sort_by_key(|d| d.cpu);
    CpuInfo {
        vm_cpus: vm_cpus.cloned(),
        housekeeping: vm_cpus.map(|v| topo.online.difference(v)).unwrap_or_default(),
        shared_pool: shared_pool(vm_cpus, held),
        dedicated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{CpuPolicy, HugePageSize};
    use crate::placement::topology::HugePool;
    use crate::placement::Placement;

    fn cpus(t: &str) -> CpuSet {
        CpuSet::parse(t).unwrap()
    }

    fn placement(policy: CpuPolicy, c: &str, nodes: &[u32]) -> Placement {
        Placement {
            policy,
            vcpus: Vec::new(),
            cpus: cpus(c),
            emulator: CpuSet::default(),
            nodes: nodes.to_vec(),
            hugepages: None,
            hugepages_per_node: Default::default(),
            memory_mib: 256,
        }
    }

    #[test]
    fn host_info_views_of_nodes_and_cpus() {
        let topo = Topology {
            nodes: vec![
                Node {
                    id: 0,
                    cpus: cpus("0-3"),
                    memory_mib: 4096,
                    hugepages: [(HugePageSize::M2, HugePool { total: 8, free: 6 })].into(),
                },
                Node { id: 1, cpus: cpus("4-7"), memory_mib: 4096, hugepages: Default::default() },
            ],
            online: cpus("0-7"),
        };
        let ded = placement(CpuPolicy::Dedicated, "4-5", &[1]);
        let shared_bound = placement(CpuPolicy::Shared, "1-3,6-7", &[0]);
        let shared_free = placement(CpuPolicy::Shared, "1-3,6-7", &[]);
        let held = [
            Held { vm: "d", placement: &ded, settled: true },
            Held { vm: "s", placement: &shared_bound, settled: true },
            Held { vm: "f", placement: &shared_free, settled: false },
        ];
        let vm_cpus = cpus("1-7");
        let devices = [("0000:07:00.0".to_string(), Some(1)), ("0000:08:00.0".to_string(), None)];
        let v = serde_json::to_value(node_infos(&topo, Some(&vm_cpus), &held, &devices)).unwrap();
        assert_eq!(
            v,
            serde_json::json!([
                {"node": 0, "cpus": "0-3", "vm_cpus": "1-3", "memory_mib": 4096,
                 "hugepages": {"2M": {"total": 8, "free": 6}}, "devices": [],
                 "holders": [{"vm": "s", "cpus": "1-3", "dedicated": false}]},
                {"node": 1, "cpus": "4-7", "vm_cpus": "4-7", "memory_mib": 4096, "hugepages": {},
                 "devices": ["0000:07:00.0"], "holders": [{"vm": "d", "cpus": "4-5", "dedicated": true}]},
            ])
        );
        let c = serde_json::to_value(cpu_info(&topo, Some(&vm_cpus), &held)).unwrap();
        assert_eq!(
            c,
            serde_json::json!({"vm_cpus": "1-7", "housekeeping": "0", "shared_pool": "1-3,6-7",
                "dedicated": [{"cpu": 4, "vm": "d"}, {"cpu": 5, "vm": "d"}]})
        );
        let none = serde_json::to_value(cpu_info(&topo, None, &held)).unwrap();
        assert_eq!(none["vm_cpus"], serde_json::Value::Null);
        assert_eq!((none["housekeeping"].as_str(), &none["shared_pool"]), (Some(""), &serde_json::Value::Null));
    }

    #[test]
    fn records_hold_their_placements_settled_while_their_qemu_runs() {
        let spec = crate::validate::tests::spec("a");
        let mut running = VmRecord::new(spec.clone());
        running.placement = Some(placement(CpuPolicy::Dedicated, "2", &[]));
        running.status = VmStatus::Running;
        running.process = Some(crate::process::ProcessIdentity { pid: 1, start_ticks: 1 });
        let mut starting = VmRecord::new(crate::validate::tests::spec("b"));
        starting.placement = Some(placement(CpuPolicy::Dedicated, "3", &[]));
        starting.status = VmStatus::Starting;
        let stopped = VmRecord::new(crate::validate::tests::spec("c"));
        let h = held([&running, &starting, &stopped]);
        let seen: Vec<(&str, bool)> = h.iter().map(|h| (h.vm, h.settled)).collect();
        assert_eq!(seen, vec![("a", true), ("b", false)]);
    }

    #[test]
    fn a_specs_devices_are_on_the_nodes_sysfs_names() {
        let d = tempfile::tempdir().unwrap();
        let sys = d.path().join("sys");
        crate::placement::topology::tests::tree(
            &sys,
            &[
                ("bus/pci/devices/0000:ca:00.0/numa_node", "1\n"),
                ("bus/pci/devices/0000:ca:00.1/numa_node", "1\n"),
                ("bus/pci/devices/0000:c8:00.0/numa_node", "-1\n"),
            ],
        );
        let config = crate::validate::tests::config();
        let t = HostTopology::open(&sys, &config);
        let mut spec = crate::validate::tests::spec("a");
        assert_eq!(t.device_nodes(&spec, &config), Vec::<u32>::new());
        spec.hardware.sfp = vec![5, 6];
        spec.hardware.copper = vec![1];
        assert_eq!(t.device_nodes(&spec, &config), vec![1], "once per node; no node known left out");
    }

    #[test]
    fn an_unreadable_sysfs_falls_back_to_the_config() {
        let d = tempfile::tempdir().unwrap();
        let config = crate::validate::tests::config();
        let t = HostTopology::open(d.path().join("sys"), &config);
        assert_eq!(t.now(), fallback(&config));
        assert_eq!(t.now().nodes[0].cpus.to_string(), "0-7");
        // The real one reads.
        let real = HostTopology::open("/sys", &config);
        assert!(!real.now().online.is_empty());
    }
}
