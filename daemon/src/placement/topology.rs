//! The host's NUMA topology as the kernel shows it in sysfs: nodes, their online CPUs, memory
//! and hugepage pools, so the allocator places VMs on what the host has rather than on what the
//! config says.
//!
//! [`read`] is called when the daemon opens (and again for a fresh view of the hugepage pools);
//! it reads the files and hands their text to the pure parsers ([`parse_cpulist`],
//! [`parse_node_memtotal`], [`parse_memtotal`], [`parse_count`], [`hugepage_dir_size`]), which
//! are tested on text. [`pci_node`] says which node a passthrough device hangs off.

use super::CpuSet;
use crate::api::HugePageSize;
use crate::hardware::PciAddress;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Why the topology could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// A sysfs or procfs file or directory could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file did not hold what the kernel writes there.
    #[error("{}: {problem}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong with it.
        problem: String,
    },
}

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

    /// The node of `cpu`, if an online node has it.
    pub fn node_of_cpu(&self, cpu: u32) -> Option<u32> {
        self.nodes.iter().find(|n| n.cpus.contains(cpu)).map(|n| n.id)
    }
}

/// Reads the topology below `sys_root` (`/sys`): `devices/system/node/nodeN/{cpulist, meminfo,
/// hugepages/hugepages-<K>kB/{nr,free}_hugepages}` and `devices/system/cpu/online`. A kernel
/// without NUMA has no node directories: then one node 0 with every online CPU, its memory from
/// `meminfo` beside `sys_root` (`/proc/meminfo` for `/sys`: `<sys_root>/../proc/meminfo`) and its
/// hugepages from `kernel/mm/hugepages`. Hugepage sizes vmhost does not know are left out.
///
/// # Errors
/// [`TopologyError`] when a file the kernel always writes is missing or unreadable, or holds
/// something else than the kernel writes.
pub fn read(sys_root: &Path) -> Result<Topology, TopologyError> {
    let online_path = sys_root.join("devices/system/cpu/online");
    let online = parse_cpulist(&read_text(&online_path)?).map_err(|problem| parse(&online_path, problem))?;
    let node_dir = sys_root.join("devices/system/node");
    let mut ids = Vec::new();
    if node_dir.is_dir() {
        for entry in std::fs::read_dir(&node_dir).map_err(|source| read_err(&node_dir, source))? {
            let entry = entry.map_err(|source| read_err(&node_dir, source))?;
            let name = entry.file_name();
            let id = name.to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse::<u32>().ok());
            if let Some(id) = id.filter(|_| entry.path().is_dir()) {
                ids.push(id);
            }
        }
    }
    ids.sort_unstable();
    let mut nodes = Vec::new();
    for id in ids {
        let dir = node_dir.join(format!("node{id}"));
        let cpulist = dir.join("cpulist");
        let cpus = parse_cpulist(&read_text(&cpulist)?).map_err(|problem| parse(&cpulist, problem))?;
        let meminfo = dir.join("meminfo");
        let memory_mib = parse_node_memtotal(&read_text(&meminfo)?).map_err(|problem| parse(&meminfo, problem))?;
        let hugepages = read_pools(&dir.join("hugepages"))?;
        nodes.push(Node { id, cpus: cpus.intersection(&online), memory_mib, hugepages });
    }
    if nodes.is_empty() {
        let meminfo = sys_root.parent().unwrap_or(Path::new("/")).join("proc/meminfo");
        let memory_mib = parse_memtotal(&read_text(&meminfo)?).map_err(|problem| parse(&meminfo, problem))?;
        let hugepages = read_pools(&sys_root.join("kernel/mm/hugepages"))?;
        nodes.push(Node { id: 0, cpus: online.clone(), memory_mib, hugepages });
    }
    Ok(Topology { nodes, online })
}

/// The NUMA node a PCI device is attached to: `bus/pci/devices/ADDR/numa_node` below
/// `sys_root`; `None` when the file is missing or unreadable or says `-1` (no node known).
pub fn pci_node(sys_root: &Path, addr: PciAddress) -> Option<u32> {
    let text =
        std::fs::read_to_string(sys_root.join("bus/pci/devices").join(addr.to_string()).join("numa_node")).ok()?;
    text.trim().parse::<u32>().ok()
}

/// The pools of a `hugepages` directory (`hugepages-2048kB/{nr,free}_hugepages`); an absent
/// directory is a kernel without hugetlbfs: no pools.
fn read_pools(dir: &Path) -> Result<BTreeMap<HugePageSize, HugePool>, TopologyError> {
    let mut pools = BTreeMap::new();
    if !dir.is_dir() {
        return Ok(pools);
    }
    for entry in std::fs::read_dir(dir).map_err(|source| read_err(dir, source))? {
        let entry = entry.map_err(|source| read_err(dir, source))?;
        let Some(size) = entry.file_name().to_str().and_then(hugepage_dir_size) else { continue };
        let count = |file: &str| -> Result<u64, TopologyError> {
            let path = entry.path().join(file);
            parse_count(&read_text(&path)?).map_err(|problem| parse(&path, problem))
        };
        pools.insert(size, HugePool { total: count("nr_hugepages")?, free: count("free_hugepages")? });
    }
    Ok(pools)
}

fn read_text(path: &Path) -> Result<String, TopologyError> {
    std::fs::read_to_string(path).map_err(|source| read_err(path, source))
}

fn read_err(path: &Path, source: std::io::Error) -> TopologyError {
    TopologyError::Read { path: path.to_path_buf(), source }
}

fn parse(path: &Path, problem: String) -> TopologyError {
    TopologyError::Parse { path: path.to_path_buf(), problem }
}

/// A sysfs cpulist; an empty file (a node with memory and no CPU) is the empty set.
///
/// # Errors
/// The text is not a cpulist.
pub fn parse_cpulist(text: &str) -> Result<CpuSet, String> {
    if text.trim().is_empty() {
        return Ok(CpuSet::default());
    }
    CpuSet::parse(text)
}

/// `MemTotal` of a node's `meminfo` (`Node 0 MemTotal:  24683784 kB`), in MiB.
///
/// # Errors
/// No such line, or not a number of kB.
pub fn parse_node_memtotal(text: &str) -> Result<u64, String> {
    let line = text
        .lines()
        .find_map(|l| {
            let rest = l.trim_start().strip_prefix("Node")?.trim_start();
            let (_, rest) = rest.split_once(char::is_whitespace)?;
            rest.trim_start().strip_prefix("MemTotal:")
        })
        .ok_or("no \"Node N MemTotal:\" line")?;
    kb_to_mib(line)
}

/// `MemTotal` of `/proc/meminfo` (`MemTotal:  24683784 kB`), in MiB.
///
/// # Errors
/// No such line, or not a number of kB.
pub fn parse_memtotal(text: &str) -> Result<u64, String> {
    let line = text.lines().find_map(|l| l.strip_prefix("MemTotal:")).ok_or("no \"MemTotal:\" line")?;
    kb_to_mib(line)
}

fn kb_to_mib(value: &str) -> Result<u64, String> {
    let digits =
        value.trim().strip_suffix("kB").map(str::trim).ok_or_else(|| format!("{:?} is not in kB", value.trim()))?;
    digits.parse::<u64>().map(|kb| kb / 1024).map_err(|_| format!("{digits:?} is not a number of kB"))
}

/// A count file (`nr_hugepages`, `free_hugepages`): one decimal number.
///
/// # Errors
/// Anything else.
pub fn parse_count(text: &str) -> Result<u64, String> {
    text.trim().parse::<u64>().map_err(|_| format!("{:?} is not a page count", text.trim()))
}

/// The size a `hugepages-<K>kB` directory is for, if vmhost knows it (2M, 1G).
pub fn hugepage_dir_size(name: &str) -> Option<HugePageSize> {
    let kib = name.strip_prefix("hugepages-")?.strip_suffix("kB")?.parse::<u64>().ok()?;
    HugePageSize::from_kib(kib)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn parsers_read_what_the_kernel_writes() {
        assert_eq!(parse_cpulist("0-1\n").unwrap().to_string(), "0-1");
        assert_eq!(parse_cpulist("\n").unwrap(), CpuSet::default(), "a node without CPUs");
        assert!(parse_cpulist("x\n").is_err());
        let node = "Node 1 MemTotal:       24683784 kB\nNode 1 MemFree:         8477908 kB\n";
        assert_eq!(parse_node_memtotal(node), Ok(24683784 / 1024));
        assert_eq!(parse_node_memtotal("Node 12 MemTotal: 2048 kB\n"), Ok(2));
        assert!(parse_node_memtotal("Node 0 MemFree: 1 kB\n").unwrap_err().contains("no \"Node N MemTotal:\""));
        assert!(parse_node_memtotal("Node 0 MemTotal: many kB\n").unwrap_err().contains("not a number"));
        assert!(parse_node_memtotal("Node 0 MemTotal: 5 MB\n").unwrap_err().contains("not in kB"));
        assert_eq!(parse_memtotal("MemTotal:        8048576 kB\nMemFree: 1 kB\n"), Ok(8048576 / 1024));
        assert!(parse_memtotal("MemFree: 1 kB\n").is_err());
        assert_eq!(parse_count("512\n"), Ok(512));
        assert!(parse_count("-1\n").is_err());
        assert_eq!(hugepage_dir_size("hugepages-2048kB"), Some(HugePageSize::M2));
        assert_eq!(hugepage_dir_size("hugepages-1048576kB"), Some(HugePageSize::G1));
        assert_eq!(hugepage_dir_size("hugepages-64kB"), None, "a size vmhost does not offer");
        assert_eq!(hugepage_dir_size("hugepages-2048"), None);
    }

    /// Writes `files` (path, content) below `root`.
    pub(crate) fn tree(root: &Path, files: &[(&str, &str)]) {
        for (path, content) in files {
            let p = root.join(path);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, content).unwrap();
        }
    }

    #[test]
    fn reads_two_nodes_with_their_pools_and_device_nodes() {
        let d = tempfile::tempdir().unwrap();
        let sys = d.path().join("sys");
        let n = "devices/system/node";
        tree(
            &sys,
            &[
                ("devices/system/cpu/online", "0-5,7\n"),
                (&format!("{n}/online"), "0-1\n"),
                (&format!("{n}/node0/cpulist"), "0-3\n"),
                (&format!("{n}/node0/meminfo"), "Node 0 MemTotal:  4194304 kB\nNode 0 MemFree: 1 kB\n"),
                (&format!("{n}/node0/hugepages/hugepages-2048kB/nr_hugepages"), "512\n"),
                (&format!("{n}/node0/hugepages/hugepages-2048kB/free_hugepages"), "500\n"),
                (&format!("{n}/node0/hugepages/hugepages-1048576kB/nr_hugepages"), "0\n"),
                (&format!("{n}/node0/hugepages/hugepages-1048576kB/free_hugepages"), "0\n"),
                // CPU 6 is offline: the node lists it, the topology does not.
                (&format!("{n}/node1/cpulist"), "4-7\n"),
                (&format!("{n}/node1/meminfo"), "Node 1 MemTotal:  2097152 kB\n"),
                (&format!("{n}/node1/hugepages/hugepages-2048kB/nr_hugepages"), "256\n"),
                (&format!("{n}/node1/hugepages/hugepages-2048kB/free_hugepages"), "256\n"),
                (&format!("{n}/node1/hugepages/hugepages-64kB/nr_hugepages"), "9\n"),
                ("bus/pci/devices/0000:07:00.0/numa_node", "1\n"),
                ("bus/pci/devices/0000:08:00.0/numa_node", "-1\n"),
            ],
        );
        let t = read(&sys).unwrap();
        assert_eq!(t.online.to_string(), "0-5,7");
        let pool = |total, free| HugePool { total, free };
        assert_eq!(
            t.nodes,
            vec![
                Node {
                    id: 0,
                    cpus: CpuSet::parse("0-3").unwrap(),
                    memory_mib: 4096,
                    hugepages: [(HugePageSize::M2, pool(512, 500)), (HugePageSize::G1, pool(0, 0))].into(),
                },
                Node {
                    id: 1,
                    cpus: CpuSet::parse("4-5,7").unwrap(),
                    memory_mib: 2048,
                    hugepages: [(HugePageSize::M2, pool(256, 256))].into(),
                },
            ]
        );
        assert_eq!((t.node_of_cpu(5), t.node_of_cpu(6)), (Some(1), None));
        let addr = |s: &str| PciAddress::parse(s).unwrap();
        assert_eq!(pci_node(&sys, addr("0000:07:00.0")), Some(1));
        assert_eq!(pci_node(&sys, addr("0000:08:00.0")), None, "-1: no node known");
        assert_eq!(pci_node(&sys, addr("0000:09:00.0")), None, "no such device");
        // A broken file is an error naming it.
        fs::write(sys.join(format!("{n}/node1/meminfo")), "garbage\n").unwrap();
        let e = read(&sys).unwrap_err().to_string();
        assert!(e.contains("node1/meminfo") && e.contains("MemTotal"), "{e}");
        fs::remove_file(sys.join("devices/system/cpu/online")).unwrap();
        let e = read(&sys).unwrap_err();
        assert!(matches!(e, TopologyError::Read { .. }) && e.to_string().contains("cpu/online"), "{e}");
    }

    #[test]
    fn a_kernel_without_numa_is_one_node_of_every_cpu() {
        let d = tempfile::tempdir().unwrap();
        let sys = d.path().join("sys");
        tree(
            &sys,
            &[
                ("devices/system/cpu/online", "0-3\n"),
                ("kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", "8\n"),
                ("kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "6\n"),
            ],
        );
        tree(d.path(), &[("proc/meminfo", "MemTotal:  1048576 kB\nMemFree: 1 kB\n")]);
        let t = read(&sys).unwrap();
        assert_eq!(
            t.nodes,
            vec![Node {
                id: 0,
                cpus: CpuSet::parse("0-3").unwrap(),
                memory_mib: 1024,
                hugepages: [(HugePageSize::M2, HugePool { total: 8, free: 6 })].into(),
            }]
        );
    }

    /// This machine (and any Linux host vmhost runs on) reads: at least one node, every node's
    /// CPUs online, every online CPU on a node, memory on it.
    #[test]
    fn reads_this_hosts_sys() {
        let t = read(Path::new("/sys")).unwrap();
        assert!(!t.nodes.is_empty() && !t.online.is_empty(), "{t:?}");
        let on_nodes = t.nodes.iter().fold(CpuSet::default(), |all, n| all.union(&n.cpus));
        assert_eq!(on_nodes, t.online, "{t:?}");
        assert!(t.nodes.iter().map(|n| n.memory_mib).sum::<u64>() > 0, "{t:?}");
        // The machine this was written on: one node, CPUs 0-1, both hugepage sizes offered.
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
        if cpus == 2 && t.nodes.len() == 1 {
            assert_eq!(t.nodes[0].cpus.to_string(), "0-1");
            assert_eq!(t.nodes[0].id, 0);
        }
    }
}
