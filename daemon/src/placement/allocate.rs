//! The pure allocator: given the host's topology, `[hardware] vm_cpus` and what the other VMs
//! hold, where a VM goes ([`place`]) and where shared VMs float ([`shared_pool`]).
//!
//! Pure so that the lifecycle can call it under its allocation lock and record the answer
//! before anything on the host changes, and so that `host.reconcile`'s dry run can ask it
//! against a simulated host. The rules (docs/api.md, "CPU and NUMA placement"):
//! 1. a dedicated VM takes `cpu` (+1 with `emulator_cpu`) CPUs of `vm_cpus` on its node that no
//!    other dedicated VM holds, lowest numbers first, and may not empty the shared pool while a
//!    shared VM runs;
//! 2. its node is its passthrough devices' node, else the node with the most free CPUs (then the
//!    most memory room, then the lowest id) that fits;
//! 3. a node's memory room is its memory less what VMs bound to it hold (a VM bound to k nodes
//!    counts 1/k on each);
//! 4. hugepages come from the node's free pool less the pages of VMs placed but not yet running
//!    (a running VM's pages are already out of `free`);
//! 5. `spread` takes more nodes, in rule 2's order, when no single one fits;
//! 6. a shared VM floats over the shared pool (with a node: the pool's CPUs there, bound to it).
//!
//! Refusals are 3001 when the host can never do it (no `vm_cpus`, no such node, a hugepage size
//! the kernel does not offer) and 3002 when it has no room now, with `details.resource` and the
//! numbers.

use super::topology::{Node, Topology};
use super::{CpuSet, Held, Placement, Request};
use crate::api::{ApiError, Code, CpuPolicy, HugePageSize, NumaPolicy};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Places `req` next to `held` (the other VMs' placements; an entry for `req.vm` itself is
/// ignored). `vm_cpus` None = no pinning configured: shared VMs get a placement with empty
/// cpus (memory only) when numa or hugepages ask for something, dedicated ones are refused.
/// `Ok(None)`: nothing to place or pin (a shared VM without numa binding or hugepages on a host
/// without `vm_cpus`: its QEMU runs as before).
///
/// # Errors
/// 3001 when the host cannot do what is asked at all (no `vm_cpus` for a dedicated VM, no such
/// NUMA node, a hugepage size the kernel does not offer); 3002 when it has no room now, with
/// `details: {resource: "cpu"|"shared_cpus"|"memory"|"hugepages"|"numa", ...}`.
pub fn place(
    topo: &Topology,
    vm_cpus: Option<&CpuSet>,
    held: &[Held<'_>],
    req: &Request<'_>,
) -> Result<Option<Placement>, ApiError> {
    let others: Vec<&Held<'_>> = held.iter().filter(|h| h.vm != req.vm).collect();
    let a = Allocator { topo, vm_cpus, held: others, req };
    a.admissible()?;
    if req.policy == CpuPolicy::Shared && req.numa == NumaPolicy::None && req.hugepages.is_none() {
        return match vm_cpus {
            None => Ok(None),
            Some(_) => a.fit(&[], false).map(Some),
        };
    }
    a.choose().map(Some)
}

/// The CPUs shared VMs may use now: `vm_cpus` minus every dedicated holding (`vm_cpus` None:
/// None, nothing is pinned).
pub fn shared_pool(vm_cpus: Option<&CpuSet>, held: &[Held<'_>]) -> Option<CpuSet> {
    let vm_cpus = vm_cpus?;
    Some(dedicated(held.iter()).iter().fold(vm_cpus.clone(), |pool, cpus| pool.difference(cpus)))
}

/// Where a shared VM placed as `placement` floats when the shared pool is `pool`: the pool, or
/// the pool's CPUs on its nodes when it is bound to nodes (rule 6), for re-pinning it when
/// dedicated VMs come and go. A dedicated placement keeps its own CPUs.
pub fn shared_cpus(topo: &Topology, pool: &CpuSet, placement: &Placement) -> CpuSet {
    if placement.is_dedicated() {
        return placement.cpus.clone();
    }
    if placement.nodes.is_empty() {
        return pool.clone();
    }
    let span = topo
        .nodes
        .iter()
        .filter(|n| placement.nodes.contains(&n.id))
        .fold(CpuSet::default(), |all, n| all.union(&n.cpus));
    pool.intersection(&span)
}

/// The CPU sets of the dedicated holdings among `held`.
fn dedicated<'h, 'a: 'h>(held: impl Iterator<Item = &'h Held<'a>>) -> Vec<&'h CpuSet> {
    held.filter(|h| h.placement.is_dedicated()).map(|h| &h.placement.cpus).collect()
}

/// The 3001 of a dedicated VM on a host whose config names no `vm_cpus` (validation's and the
/// allocator's, which names the VM `vm`).
pub fn no_vm_cpus(vm: Option<&str>) -> ApiError {
    let who = vm.map(|vm| format!("VM {vm:?}: ")).unwrap_or_default();
    ApiError::new(
        Code::NotInModel,
        format!("{who}cpu_policy dedicated needs host CPUs to dedicate: the host config names no vm_cpus"),
    )
    .field("spec.cpu_policy")
    .details(json!({ "vm_cpus": Value::Null }))
}

/// One placement question: the request and what it is asked against.
struct Allocator<'t, 'h, 'a> {
    topo: &'t Topology,
    vm_cpus: Option<&'t CpuSet>,
    held: Vec<&'h Held<'a>>,
    req: &'t Request<'t>,
}

impl<'t> Allocator<'t, '_, '_> {
    /// The 3001s: what this host can never do, whatever the other VMs hold.
    fn admissible(&self) -> Result<(), ApiError> {
        let vm = self.req.vm;
        if self.req.policy == CpuPolicy::Dedicated && self.vm_cpus.is_none() {
            return Err(no_vm_cpus(Some(vm)));
        }
        if let NumaPolicy::Node(n) = self.req.numa {
            if self.topo.node(n).is_none() {
                let nodes: Vec<u32> = self.topo.nodes.iter().map(|n| n.id).collect();
                return Err(ApiError::new(
                    Code::NotInModel,
                    format!("VM {vm:?}: host has no NUMA node {n} (its nodes: {})", list(&nodes)),
                )
                .field("spec.numa")
                .details(json!({ "node": n, "nodes": nodes })));
            }
        }
        if let Some(size) = self.req.hugepages {
            if !self.topo.nodes.iter().any(|n| n.hugepages.contains_key(&size)) {
                let mut offered: Vec<&str> =
                    self.topo.nodes.iter().flat_map(|n| n.hugepages.keys()).map(|s| s.as_str()).collect();
                offered.sort_unstable();
                offered.dedup();
                return Err(ApiError::new(
                    Code::NotInModel,
                    format!("VM {vm:?}: the host's kernel offers no {size} hugepages"),
                )
                .field("spec.hugepages")
                .details(json!({ "size": size, "offered": offered })));
            }
        }
        Ok(())
    }

    /// Every CPU a dedicated VM holds.
    fn dedicated_held(&self) -> CpuSet {
        dedicated(self.held.iter().copied()).into_iter().fold(CpuSet::default(), |all, c| all.union(c))
    }

    /// The CPUs this request may take (dedicated) or float over (shared) within `cpus`.
    fn free_cpus(&self, cpus: &CpuSet) -> CpuSet {
        match self.vm_cpus {
            Some(vm_cpus) => vm_cpus.intersection(cpus).difference(&self.dedicated_held()),
            None => cpus.clone(),
        }
    }

    /// Node `id`'s memory less what VMs bound to it hold (1/k of a VM bound to k nodes).
    fn room(&self, node: &Node) -> u64 {
        let held: u64 = self
            .held
            .iter()
            .filter(|h| h.placement.nodes.contains(&node.id))
            .map(|h| h.placement.memory_mib / h.placement.nodes.len() as u64)
            .sum();
        node.memory_mib.saturating_sub(held)
    }

    /// Free pages of `size` on `node`, less those of VMs placed whose QEMU does not run yet.
    fn hugepages_free(&self, node: &Node, size: HugePageSize) -> u64 {
        let free = node.hugepages.get(&size).map_or(0, |p| p.free);
        let promised: u64 = self
            .held
            .iter()
            .filter(|h| !h.settled && h.placement.hugepages == Some(size))
            .filter_map(|h| h.placement.hugepages_per_node.get(&node.id))
            .sum();
        free.saturating_sub(promised)
    }

    /// The nodes in the order rule 2 prefers them: most free CPUs for this request, then most
    /// memory room, then lowest id.
    fn preferred(&self) -> Vec<&'t Node> {
        let mut nodes: Vec<&'t Node> = self.topo.nodes.iter().collect();
        nodes
            .sort_by_key(|n| (std::cmp::Reverse(self.free_cpus(&n.cpus).len()), std::cmp::Reverse(self.room(n)), n.id));
        nodes
    }

    /// The placement by the request's NUMA policy (rules 2 and 5).
    fn choose(&self) -> Result<Placement, ApiError> {
        let all: Vec<&Node> = self.topo.nodes.iter().collect();
        // Device nodes the topology does not have (a stale sysfs value) say nothing: left out.
        let devices: Vec<&'t Node> = self.topo.nodes.iter().filter(|n| self.req.device_nodes.contains(&n.id)).collect();
        match self.req.numa {
            NumaPolicy::None => self.fit(&all, false),
            NumaPolicy::Node(n) => {
                let node = self.topo.node(n).ok_or_else(|| ApiError::internal(format!("NUMA node {n} vanished")))?;
                self.fit(&[node], true)
            }
            NumaPolicy::Auto if devices.len() > 1 => {
                let nodes: Vec<u32> = devices.iter().map(|n| n.id).collect();
                Err(ApiError::new(
                    Code::CapacityExceeded,
                    format!(
                        "VM {:?}: its passthrough devices are on NUMA nodes {}; numa auto keeps a VM on one node \
                         (numa spread binds it to all of them)",
                        self.req.vm,
                        list(&nodes)
                    ),
                )
                .field("spec.numa")
                .details(json!({ "resource": "numa", "nodes": nodes })))
            }
            NumaPolicy::Auto | NumaPolicy::Spread if devices.len() == 1 => {
                let first = self.fit(&devices, true);
                if first.is_ok() || self.req.numa == NumaPolicy::Auto {
                    return first;
                }
                self.spread(devices, first)
            }
            NumaPolicy::Auto | NumaPolicy::Spread if devices.is_empty() => {
                let order = self.preferred();
                let mut first = None;
                for node in &order {
                    match self.fit(&[node], true) {
                        Ok(p) => return Ok(p),
                        Err(e) => {
                            first.get_or_insert(e);
                        }
                    }
                }
                let first = first.ok_or_else(|| ApiError::internal("the host has no NUMA node"))?;
                if self.req.numa == NumaPolicy::Auto {
                    return Err(first);
                }
                self.spread(Vec::new(), Err(first))
            }
            // Spread over devices on several nodes: all of them, and more when they are short.
            NumaPolicy::Auto | NumaPolicy::Spread => {
                let first = self.fit(&devices, true);
                if first.is_ok() {
                    return first;
                }
                self.spread(devices, first)
            }
        }
    }

    /// Rule 5: grows `set` by the other nodes in preferred order until the request fits; the
    /// last refusal (all nodes, or `last` when there was no node to add) when it never does.
    fn spread(&self, mut set: Vec<&'t Node>, mut last: Result<Placement, ApiError>) -> Result<Placement, ApiError> {
        for node in self.preferred() {
            if set.iter().any(|n| n.id == node.id) {
                continue;
            }
            set.push(node);
            last = self.fit(&set, true);
            if last.is_ok() {
                break;
            }
        }
        last
    }

    /// The placement on `nodes` (bound: memory bound to them; else CPUs from every node and
    /// memory unbound, `nodes` only for hugepages), or the refusal naming what is short.
    fn fit(&self, nodes: &[&Node], bound: bool) -> Result<Placement, ApiError> {
        let req = self.req;
        // Hugepages are taken in `nodes`' order; the record and messages list the nodes by id.
        let mut ids: Vec<u32> = nodes.iter().map(|n| n.id).collect();
        ids.sort_unstable();
        let place_of = |details: &mut Value| {
            if bound && ids.len() == 1 {
                details["node"] = json!(ids[0]);
            } else if bound {
                details["nodes"] = json!(ids);
            } else {
                details["node"] = Value::Null;
            }
        };
        let where_ = if !bound {
            "the host".to_string()
        } else if ids.len() == 1 {
            format!("NUMA node {}", ids[0])
        } else {
            format!("NUMA nodes {}", list(&ids))
        };
        let refuse = |resource: &str, field: &str, message: String, mut details: Value| {
            details["resource"] = json!(resource);
            place_of(&mut details);
            ApiError::new(Code::CapacityExceeded, format!("VM {:?}: {message}", req.vm)).field(field).details(details)
        };
        let span = if bound {
            nodes.iter().fold(CpuSet::default(), |all, n| all.union(&n.cpus))
        } else {
            self.topo.online.clone()
        };
        let free = self.free_cpus(&span);
        let housekeeping = self.vm_cpus.map(|v| self.topo.online.difference(v)).unwrap_or_default();
        let (vcpus, cpus, emulator) = match (req.policy, self.vm_cpus) {
            (CpuPolicy::Dedicated, _) => {
                let requested = u64::from(req.vcpus) + u64::from(req.emulator_cpu);
                if (free.len() as u64) < requested {
                    let extra = if req.emulator_cpu { " (its vCPUs and an emulator CPU)" } else { "" };
                    return Err(refuse(
                        "cpu",
                        "spec.cpu",
                        format!(
                            "{where_} has {} CPUs of vm_cpus no dedicated VM holds; {requested} requested{extra}",
                            free.len()
                        ),
                        json!({ "requested": requested, "available": free.len() }),
                    ));
                }
                let mut taken = free.iter();
                let vcpus: Vec<u32> = taken.by_ref().take(req.vcpus as usize).collect();
                let emulator = if req.emulator_cpu { CpuSet::from_cpus(taken.next()) } else { housekeeping };
                let own = if req.emulator_cpu { emulator.clone() } else { CpuSet::default() };
                (vcpus.clone(), CpuSet::from_cpus(vcpus).union(&own), emulator)
            }
            (CpuPolicy::Shared, Some(_)) => {
                if free.is_empty() {
                    let (resource, held) = if bound { ("cpu", "on it ") } else { ("shared_cpus", "") };
                    return Err(refuse(
                        resource,
                        "spec.cpu",
                        format!("{where_} has no shared CPU left: every CPU of vm_cpus {held}is dedicated to a VM"),
                        json!({ "requested": 1, "available": 0 }),
                    ));
                }
                (Vec::new(), free, housekeeping)
            }
            (CpuPolicy::Shared, None) => (Vec::new(), CpuSet::default(), CpuSet::default()),
        };
        if bound {
            let available: u64 = nodes.iter().map(|n| self.room(n)).sum();
            if req.memory_mib > available {
                return Err(refuse(
                    "memory",
                    "spec.memory_mib",
                    format!(
                        "{where_} has {available} MiB of memory no VM bound to it holds; {} MiB requested",
                        req.memory_mib
                    ),
                    json!({ "requested": req.memory_mib, "available": available }),
                ));
            }
        }
        let mut hugepages_per_node = BTreeMap::new();
        if let Some(size) = req.hugepages {
            let requested = size.pages_for(req.memory_mib);
            let pools: Vec<&Node> = if bound { nodes.to_vec() } else { self.topo.nodes.iter().collect() };
            let available: u64 = pools.iter().map(|n| self.hugepages_free(n, size)).sum();
            if requested > available {
                return Err(refuse(
                    "hugepages",
                    "spec.hugepages",
                    format!(
                        "{where_} has {available} free {size} hugepages not promised to a starting VM; {requested} \
                         requested ({} MiB)",
                        req.memory_mib
                    ),
                    json!({ "size": size, "requested": requested, "available": available }),
                ));
            }
            let mut left = requested;
            for node in pools {
                let take = left.min(self.hugepages_free(node, size));
                if take > 0 {
                    hugepages_per_node.insert(node.id, take);
                    left -= take;
                }
            }
        }
        let placement = Placement {
            policy: req.policy,
            vcpus,
            cpus,
            emulator,
            nodes: if bound { ids } else { Vec::new() },
            hugepages: req.hugepages,
            hugepages_per_node,
            memory_mib: req.memory_mib,
        };
        self.keeps_shared_pool(&placement)?;
        Ok(placement)
    }

    /// Rule 1's second half: a dedicated placement may not take the last shared CPU of a shared
    /// VM that holds a placement (runs): the last of the pool, or of the pool on the nodes a
    /// shared VM is bound to. They would have nowhere to run.
    fn keeps_shared_pool(&self, placement: &Placement) -> Result<(), ApiError> {
        if !placement.is_dedicated() {
            return Ok(());
        }
        let pool = self.vm_cpus.map(|v| v.difference(&self.dedicated_held())).unwrap_or_default();
        let after = pool.difference(&placement.cpus);
        let starved: Vec<&str> = self
            .held
            .iter()
            .filter(|h| !h.placement.is_dedicated())
            .filter(|h| shared_cpus(self.topo, &after, h.placement).is_empty())
            .map(|h| h.vm)
            .collect();
        if starved.is_empty() {
            return Ok(());
        }
        Err(ApiError::new(
            Code::CapacityExceeded,
            format!(
                "VM {:?}: its {} dedicated CPUs would take the last shared CPUs of {} running shared VM(s) ({}); \
                 the shared pool is {pool}",
                self.req.vm,
                placement.cpus.len(),
                starved.len(),
                starved.join(", "),
            ),
        )
        .field("spec.cpu")
        .details(json!({
            "resource": "shared_cpus",
            "shared_vms": starved.len(),
            "vms": starved,
            "requested": placement.cpus.len(),
            "available": pool.len(),
        })))
    }
}

/// `0, 1 and 3`.
fn list(ids: &[u32]) -> String {
    match ids {
        [] => "none".into(),
        [one] => one.to_string(),
        [rest @ .., last] => {
            format!("{} and {last}", rest.iter().map(u32::to_string).collect::<Vec<_>>().join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::topology::HugePool;
    use HugePageSize::{G1, M2};

    fn cpus(text: &str) -> CpuSet {
        if text.is_empty() {
            CpuSet::default()
        } else {
            CpuSet::parse(text).unwrap()
        }
    }

    fn node(id: u32, cpu_list: &str, memory_mib: u64, pools: &[(HugePageSize, u64)]) -> Node {
        let hugepages = pools.iter().map(|&(s, free)| (s, HugePool { total: free + 10, free })).collect();
        Node { id, cpus: cpus(cpu_list), memory_mib, hugepages }
    }

    /// Two nodes: 0 = CPUs 0-3, 4 GiB, 512 free 2M pages; 1 = CPUs 4-7, 2 GiB, 256 free 2M
    /// pages and 2 free 1G pages.
    fn two_nodes() -> Topology {
        Topology {
            nodes: vec![node(0, "0-3", 4096, &[(M2, 512)]), node(1, "4-7", 2048, &[(M2, 256), (G1, 2)])],
            online: cpus("0-7"),
        }
    }

    /// What a request differs in from a shared 1-vCPU 256 MiB VM "new" with numa none.
    #[derive(Clone, Copy, Default)]
    struct Ask {
        dedicated: bool,
        vcpus: u32,
        memory_mib: u64,
        numa: Option<NumaPolicy>,
        hugepages: Option<HugePageSize>,
        emulator_cpu: bool,
        devices: &'static [u32],
    }

    fn ded(vcpus: u32) -> Ask {
        Ask { dedicated: true, vcpus, ..Ask::default() }
    }

    fn shared() -> Ask {
        Ask { vcpus: 1, ..Ask::default() }
    }

    impl Ask {
        fn numa(self, numa: NumaPolicy) -> Ask {
            Ask { numa: Some(numa), ..self }
        }
        fn mem(self, memory_mib: u64) -> Ask {
            Ask { memory_mib, ..self }
        }
        fn huge(self, size: HugePageSize) -> Ask {
            Ask { hugepages: Some(size), ..self }
        }
        fn emu(self) -> Ask {
            Ask { emulator_cpu: true, ..self }
        }
        fn dev(self, devices: &'static [u32]) -> Ask {
            Ask { devices, ..self }
        }
        fn request(&self) -> Request<'static> {
            let policy = if self.dedicated { CpuPolicy::Dedicated } else { CpuPolicy::Shared };
            let default = if self.dedicated { NumaPolicy::Auto } else { NumaPolicy::None };
            Request {
                vm: "new",
                vcpus: self.vcpus,
                memory_mib: if self.memory_mib == 0 { 256 } else { self.memory_mib },
                policy,
                numa: self.numa.unwrap_or(default),
                hugepages: self.hugepages,
                emulator_cpu: self.emulator_cpu,
                device_nodes: self.devices.to_vec(),
            }
        }
    }

    /// A holding: dedicated CPUs (or shared when `dedicated` is false), nodes, memory,
    /// hugepages per node, settled.
    fn holding(dedicated: bool, cpu_list: &str, nodes: &[u32], memory_mib: u64, pages: &[(u32, u64)]) -> Placement {
        Placement {
            policy: if dedicated { CpuPolicy::Dedicated } else { CpuPolicy::Shared },
            vcpus: if dedicated { cpus(cpu_list).iter().collect() } else { Vec::new() },
            cpus: cpus(cpu_list),
            emulator: CpuSet::default(),
            nodes: nodes.to_vec(),
            hugepages: (!pages.is_empty()).then_some(M2),
            hugepages_per_node: pages.iter().copied().collect(),
            memory_mib,
        }
    }

    /// A placement as one line: `vcpus cpus emulator nodes hugepages`.
    fn line(p: &Placement) -> String {
        let pages: Vec<String> = p.hugepages_per_node.iter().map(|(n, c)| format!("{n}:{c}")).collect();
        format!(
            "vcpus={:?} cpus={} emu={} nodes={:?} hp={}",
            p.vcpus,
            p.cpus,
            p.emulator,
            p.nodes,
            match p.hugepages {
                Some(s) => format!("{s}[{}]", pages.join(",")),
                None => "-".into(),
            }
        )
    }

    /// A refusal as one line: `code field details`.
    fn refusal(e: &ApiError) -> String {
        format!("{} {} {}", e.code.as_i32(), e.field.as_deref().unwrap_or("-"), e.details)
    }

    struct Case {
        name: &'static str,
        topo: Topology,
        vm_cpus: Option<&'static str>,
        held: Vec<(&'static str, Placement, bool)>,
        ask: Ask,
        /// The placement's line, `none` for no placement, or the refusal's line.
        expected: &'static str,
    }

    fn case(name: &'static str, vm_cpus: Option<&'static str>, ask: Ask, expected: &'static str) -> Case {
        Case { name, topo: two_nodes(), vm_cpus, held: Vec::new(), ask, expected }
    }

    impl Case {
        fn holding(mut self, vm: &'static str, p: Placement, settled: bool) -> Case {
            self.held.push((vm, p, settled));
            self
        }
        fn topo(self, topo: Topology) -> Case {
            Case { topo, ..self }
        }
    }

    fn run(c: &Case) -> String {
        let vm_cpus = c.vm_cpus.map(cpus);
        let held: Vec<Held<'_>> =
            c.held.iter().map(|(vm, placement, settled)| Held { vm, placement, settled: *settled }).collect();
        let req = c.ask.request();
        match place(&c.topo, vm_cpus.as_ref(), &held, &req) {
            Ok(Some(p)) => {
                assert_eq!(
                    (p.policy, p.memory_mib, p.hugepages),
                    (req.policy, req.memory_mib, req.hugepages),
                    "{}",
                    c.name
                );
                line(&p)
            }
            Ok(None) => "none".into(),
            Err(e) => {
                assert!(e.message.starts_with("VM \"new\": "), "{}: {}", c.name, e.message);
                refusal(&e)
            }
        }
    }

    fn check(cases: Vec<Case>) {
        let mut wrong = Vec::new();
        for c in &cases {
            let got = run(c);
            if got != c.expected {
                wrong.push(format!("{}:\n  expected {}\n  got      {got}", c.name, c.expected));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    const ALL: Option<&str> = Some("1-7");

    #[test]
    fn dedicated_cpus() {
        check(vec![
            case(
                "fits on the node with most free CPUs (1: 4-7 over 0: 1-3), lowest first",
                ALL,
                ded(2),
                "vcpus=[4, 5] cpus=4-5 emu=0 nodes=[1] hp=-",
            ),
            case(
                "does not fit on any node",
                ALL,
                ded(5),
                r#"3002 spec.cpu {"available":4,"node":1,"requested":5,"resource":"cpu"}"#,
            ),
            case(
                "numa none: lowest of all vm_cpus",
                ALL,
                ded(5).numa(NumaPolicy::None),
                "vcpus=[1, 2, 3, 4, 5] cpus=1-5 emu=0 nodes=[] hp=-",
            ),
            case(
                "numa none: not enough in all of vm_cpus",
                ALL,
                ded(8).numa(NumaPolicy::None),
                r#"3002 spec.cpu {"available":7,"node":null,"requested":8,"resource":"cpu"}"#,
            ),
            case(
                "two VMs never share a CPU (settled or not)",
                ALL,
                ded(2).numa(NumaPolicy::Node(1)),
                "vcpus=[6, 7] cpus=6-7 emu=0 nodes=[1] hp=-",
            )
            .holding("a", holding(true, "4", &[1], 256, &[]), true)
            .holding("b", holding(true, "5", &[1], 256, &[]), false),
            case(
                "a holder's dedicated CPUs are not free",
                ALL,
                ded(2).numa(NumaPolicy::Node(1)),
                r#"3002 spec.cpu {"available":1,"node":1,"requested":2,"resource":"cpu"}"#,
            )
            .holding("a", holding(true, "4-6", &[1], 256, &[]), true),
            case(
                "the VM's own earlier holding is not another's",
                ALL,
                ded(2).numa(NumaPolicy::Node(1)),
                "vcpus=[4, 5] cpus=4-5 emu=0 nodes=[1] hp=-",
            )
            .holding("new", holding(true, "4-6", &[1], 256, &[]), true),
            case(
                "emulator_cpu: one more CPU on the node",
                ALL,
                ded(2).emu(),
                "vcpus=[4, 5] cpus=4-6 emu=6 nodes=[1] hp=-",
            ),
            case(
                "emulator_cpu counts in the request",
                ALL,
                ded(4).emu(),
                r#"3002 spec.cpu {"available":4,"node":1,"requested":5,"resource":"cpu"}"#,
            ),
            case(
                "no housekeeping CPU: emulator empty (the shared pool at pin time)",
                Some("0-7"),
                ded(1),
                "vcpus=[0] cpus=0 emu= nodes=[0] hp=-",
            ),
            case(
                "housekeeping is every online CPU not in vm_cpus",
                Some("2-3,6-7"),
                ded(1),
                "vcpus=[2] cpus=2 emu=0-1,4-5 nodes=[0] hp=-",
            ),
            case("vm_cpus only on node 0", Some("1-3"), ded(2), "vcpus=[1, 2] cpus=1-2 emu=0,4-7 nodes=[0] hp=-"),
            case("no vm_cpus: 3001", None, ded(1), r#"3001 spec.cpu_policy {"vm_cpus":null}"#),
        ]);
    }

    #[test]
    fn node_choice() {
        let eq = || Topology { nodes: vec![node(0, "0-3", 2048, &[]), node(1, "4-7", 4096, &[])], online: cpus("0-7") };
        let same =
            || Topology { nodes: vec![node(0, "0-3", 2048, &[]), node(1, "4-7", 2048, &[])], online: cpus("0-7") };
        check(vec![
            case(
                "the devices' node, though the other has more free CPUs",
                ALL,
                ded(2).dev(&[0]),
                "vcpus=[1, 2] cpus=1-2 emu=0 nodes=[0] hp=-",
            ),
            case(
                "the devices' node, short: refused, not moved",
                ALL,
                ded(4).dev(&[0]),
                r#"3002 spec.cpu {"available":3,"node":0,"requested":4,"resource":"cpu"}"#,
            ),
            case("several devices on one node", ALL, ded(1).dev(&[1, 1]), "vcpus=[4] cpus=4 emu=0 nodes=[1] hp=-"),
            case(
                "devices on two nodes, auto: refused naming both",
                ALL,
                ded(1).dev(&[1, 0]),
                r#"3002 spec.numa {"nodes":[0,1],"resource":"numa"}"#,
            ),
            case(
                "devices on two nodes, spread: bound to both",
                ALL,
                ded(2).dev(&[0, 1]).numa(NumaPolicy::Spread),
                "vcpus=[1, 2] cpus=1-2 emu=0 nodes=[0, 1] hp=-",
            ),
            case(
                "a device node the host does not have says nothing",
                ALL,
                ded(1).dev(&[7]),
                "vcpus=[4] cpus=4 emu=0 nodes=[1] hp=-",
            ),
            case(
                "an explicit node wins over the devices'",
                ALL,
                ded(1).dev(&[1]).numa(NumaPolicy::Node(0)),
                "vcpus=[1] cpus=1 emu=0 nodes=[0] hp=-",
            ),
            case(
                "explicit node missing: 3001",
                ALL,
                ded(1).numa(NumaPolicy::Node(2)),
                r#"3001 spec.numa {"node":2,"nodes":[0,1]}"#,
            ),
            case("most free CPUs first", Some("0-5"), ded(1), "vcpus=[0] cpus=0 emu=6-7 nodes=[0] hp=-"),
            case("tie on CPUs: most memory room", Some("0-7"), ded(1), "vcpus=[4] cpus=4 emu= nodes=[1] hp=-")
                .topo(eq()),
            case(
                "tie on CPUs, room taken by a bound holder: the other node",
                Some("0-7"),
                ded(1),
                "vcpus=[0] cpus=0 emu= nodes=[0] hp=-",
            )
            .topo(eq())
            .holding("a", holding(false, "", &[1], 3072, &[]), true),
            case("tie on CPUs and room: lowest id", Some("0-7"), ded(1), "vcpus=[0] cpus=0 emu= nodes=[0] hp=-")
                .topo(same()),
            case(
                "the preferred node lacks memory: the next that fits",
                ALL,
                ded(1).mem(3000),
                "vcpus=[1] cpus=1 emu=0 nodes=[0] hp=-",
            ),
            case(
                "no node fits: the preferred node's refusal",
                ALL,
                ded(1).mem(5000),
                r#"3002 spec.memory_mib {"available":2048,"node":1,"requested":5000,"resource":"memory"}"#,
            ),
            case(
                "spread: one node when one fits",
                ALL,
                ded(2).numa(NumaPolicy::Spread),
                "vcpus=[4, 5] cpus=4-5 emu=0 nodes=[1] hp=-",
            ),
            case(
                "spread: more nodes, in preferred order, until it fits",
                ALL,
                ded(6).numa(NumaPolicy::Spread),
                "vcpus=[1, 2, 3, 4, 5, 6] cpus=1-6 emu=0 nodes=[0, 1] hp=-",
            ),
            case(
                "spread: memory summed over the nodes",
                ALL,
                ded(1).numa(NumaPolicy::Spread).mem(5000),
                "vcpus=[1] cpus=1 emu=0 nodes=[0, 1] hp=-",
            ),
            case(
                "spread: every node short",
                ALL,
                ded(8).numa(NumaPolicy::Spread),
                r#"3002 spec.cpu {"available":7,"nodes":[0,1],"requested":8,"resource":"cpu"}"#,
            ),
            case(
                "spread from the device's node",
                ALL,
                ded(5).dev(&[0]).numa(NumaPolicy::Spread),
                "vcpus=[1, 2, 3, 4, 5] cpus=1-5 emu=0 nodes=[0, 1] hp=-",
            ),
        ]);
    }

    #[test]
    fn memory_and_hugepages() {
        let no_1g = || Topology { nodes: vec![node(0, "0-3", 4096, &[(M2, 8)])], online: cpus("0-3") };
        check(vec![
            case(
                "room: node memory less bound holders",
                ALL,
                ded(1).numa(NumaPolicy::Node(1)).mem(1024),
                r#"3002 spec.memory_mib {"available":512,"node":1,"requested":1024,"resource":"memory"}"#,
            )
            .holding("a", holding(false, "", &[1], 1536, &[]), true),
            case(
                "a holder bound to two nodes counts half on each",
                ALL,
                ded(1).numa(NumaPolicy::Node(1)).mem(1537),
                r#"3002 spec.memory_mib {"available":1536,"node":1,"requested":1537,"resource":"memory"}"#,
            )
            .holding("a", holding(false, "", &[0, 1], 1024, &[]), true),
            case(
                "unbound holders take no node's room",
                ALL,
                ded(1).numa(NumaPolicy::Node(1)).mem(2048),
                "vcpus=[4] cpus=4 emu=0 nodes=[1] hp=-",
            )
            .holding("a", holding(false, "", &[], 1024, &[]), true),
            case(
                "hugepages on the node",
                ALL,
                ded(1).numa(NumaPolicy::Node(1)).mem(512).huge(M2),
                "vcpus=[4] cpus=4 emu=0 nodes=[1] hp=2M[1:256]",
            ),
            case(
                "hugepages short",
                ALL,
                ded(1).numa(NumaPolicy::Node(1)).mem(1024).huge(M2),
                r#"3002 spec.hugepages {"available":256,"node":1,"requested":512,"resource":"hugepages","size":"2M"}"#,
            ),
            case(
                "hugepages of an unsettled holder are not free",
                ALL,
                ded(1).numa(NumaPolicy::Node(0)).mem(1024).huge(M2),
                r#"3002 spec.hugepages {"available":412,"node":0,"requested":512,"resource":"hugepages","size":"2M"}"#,
            )
            .holding("a", holding(false, "", &[0], 200, &[(0, 100)]), false),
            case(
                "a settled holder's are already out of free",
                ALL,
                ded(1).numa(NumaPolicy::Node(0)).mem(1024).huge(M2),
                "vcpus=[1] cpus=1 emu=0 nodes=[0] hp=2M[0:512]",
            )
            .holding("a", holding(false, "", &[0], 200, &[(0, 100)]), true),
            case("1G pages", ALL, ded(1).mem(2048).huge(G1), "vcpus=[4] cpus=4 emu=0 nodes=[1] hp=1G[1:2]"),
            case(
                "auto: the node with the pages",
                ALL,
                ded(1).mem(4096).huge(M2),
                "vcpus=[1] cpus=1 emu=0 nodes=[0] hp=2M[0:2048]",
            )
            .topo(Topology {
                nodes: vec![node(0, "0-3", 8192, &[(M2, 4096)]), node(1, "4-7", 8192, &[(M2, 8)])],
                online: cpus("0-7"),
            }),
            case(
                "numa none: across all nodes, taken greedily",
                ALL,
                ded(1).numa(NumaPolicy::None).mem(1200).huge(M2),
                "vcpus=[1] cpus=1 emu=0 nodes=[] hp=2M[0:512,1:88]",
            ),
            case(
                "numa none: all nodes short",
                ALL,
                ded(1).numa(NumaPolicy::None).mem(2048).huge(M2),
                r#"3002 spec.hugepages {"available":768,"node":null,"requested":1024,"resource":"hugepages","size":"2M"}"#,
            ),
            case(
                "spread: hugepages over the nodes",
                ALL,
                ded(1).numa(NumaPolicy::Spread).mem(1200).huge(M2),
                "vcpus=[1] cpus=1 emu=0 nodes=[0, 1] hp=2M[0:344,1:256]",
            ),
            case(
                "a size the kernel does not offer: 3001",
                ALL,
                ded(1).mem(1024).huge(G1),
                r#"3001 spec.hugepages {"offered":["2M"],"size":"1G"}"#,
            )
            .topo(no_1g()),
            case(
                "a size a node does not offer: none there",
                ALL,
                ded(1).numa(NumaPolicy::Node(0)).mem(1024).huge(G1),
                r#"3002 spec.hugepages {"available":0,"node":0,"requested":1,"resource":"hugepages","size":"1G"}"#,
            ),
        ]);
    }

    #[test]
    fn shared_vms() {
        check(vec![
            case("no vm_cpus, no numa, no hugepages: no placement", None, shared(), "none"),
            case(
                "no vm_cpus, numa auto: memory only",
                None,
                shared().numa(NumaPolicy::Auto),
                "vcpus=[] cpus= emu= nodes=[0] hp=-",
            ),
            case(
                "no vm_cpus, hugepages: memory only, unbound",
                None,
                shared().mem(1024).huge(M2),
                "vcpus=[] cpus= emu= nodes=[] hp=2M[0:512]",
            ),
            case("vm_cpus: the shared pool", ALL, shared(), "vcpus=[] cpus=1-7 emu=0 nodes=[] hp=-"),
            case(
                "vm_cpus: the pool less dedicated holdings",
                ALL,
                shared(),
                "vcpus=[] cpus=1-3,6-7 emu=0 nodes=[] hp=-",
            )
            .holding("a", holding(true, "4-5", &[1], 256, &[]), true),
            case(
                "every vm_cpu dedicated: no shared CPU",
                Some("4-5"),
                shared(),
                r#"3002 spec.cpu {"available":0,"node":null,"requested":1,"resource":"shared_cpus"}"#,
            )
            .holding("a", holding(true, "4-5", &[1], 256, &[]), true),
            case(
                "numa auto: the pool on the node with most of it",
                ALL,
                shared().numa(NumaPolicy::Auto),
                "vcpus=[] cpus=1-3 emu=0 nodes=[0] hp=-",
            )
            .holding("a", holding(true, "4-5", &[1], 256, &[]), true),
            case(
                "numa on a node without shared CPUs",
                ALL,
                shared().numa(NumaPolicy::Node(1)),
                r#"3002 spec.cpu {"available":0,"node":1,"requested":1,"resource":"cpu"}"#,
            )
            .holding("a", holding(true, "4-7", &[1], 256, &[]), true),
            case(
                "dedicated may not empty the pool while a shared VM runs",
                Some("4-5"),
                ded(2),
                r#"3002 spec.cpu {"available":2,"requested":2,"resource":"shared_cpus","shared_vms":1,"vms":["s"]}"#,
            )
            .holding("s", holding(false, "4-5", &[], 256, &[]), true),
            case("... and may when none runs", Some("4-5"), ded(2), "vcpus=[4, 5] cpus=4-5 emu=0-3,6-7 nodes=[1] hp=-"),
            case(
                "... and may leave one shared CPU",
                Some("4-6"),
                ded(2),
                "vcpus=[4, 5] cpus=4-5 emu=0-3,7 nodes=[1] hp=-",
            )
            .holding("s", holding(false, "4-6", &[], 256, &[]), true),
        ]);
    }

    /// A shared VM bound to a node keeps at least one shared CPU there; `auto` then takes the
    /// other node.
    #[test]
    fn dedicated_vms_leave_a_bound_shared_vm_a_cpu_on_its_node() {
        check(vec![
            case(
                "node 1's last shared CPUs: refused",
                Some("4-7"),
                ded(4).numa(NumaPolicy::Node(1)),
                r#"3002 spec.cpu {"available":4,"requested":4,"resource":"shared_cpus","shared_vms":1,"vms":["s"]}"#,
            )
            .holding("s", holding(false, "4-7", &[1], 256, &[]), true),
            case("auto: the other node", ALL, ded(4), "vcpus=[4, 5, 6, 7] cpus=4-7 emu=0 nodes=[1] hp=-").holding(
                "s",
                holding(false, "1-3", &[0], 256, &[]),
                true,
            ),
            case(
                "auto: node 1 (preferred: more room) would starve it, node 0 does not",
                ALL,
                ded(3),
                "vcpus=[1, 2, 3] cpus=1-3 emu=0 nodes=[0] hp=-",
            )
            .holding("d", holding(true, "7", &[1], 256, &[]), true)
            .holding("m", holding(true, "", &[0], 3000, &[]), true)
            .holding("s", holding(false, "4-6", &[1], 256, &[]), true),
            case(
                "an unbound shared VM keeps the pool elsewhere",
                ALL,
                ded(4),
                "vcpus=[4, 5, 6, 7] cpus=4-7 emu=0 nodes=[1] hp=-",
            )
            .holding("s", holding(false, "1-7", &[], 256, &[]), true),
        ]);
    }

    #[test]
    fn shared_pool_is_vm_cpus_less_dedicated_holdings() {
        let a = holding(true, "2-3", &[0], 256, &[]);
        let s = holding(false, "1-7", &[], 256, &[]);
        let held = [Held { vm: "a", placement: &a, settled: false }, Held { vm: "s", placement: &s, settled: true }];
        assert_eq!(shared_pool(Some(&cpus("1-7")), &held), Some(cpus("1,4-7")));
        assert_eq!(shared_pool(Some(&cpus("1-7")), &[]), Some(cpus("1-7")));
        assert_eq!(shared_pool(None, &held), None);
    }

    #[test]
    fn a_shared_vm_floats_over_the_pool_on_its_nodes() {
        let topo = two_nodes();
        let pool = cpus("1-3,6-7");
        assert_eq!(shared_cpus(&topo, &pool, &holding(false, "1-7", &[], 256, &[])), pool);
        assert_eq!(shared_cpus(&topo, &pool, &holding(false, "4-7", &[1], 256, &[])), cpus("6-7"));
        assert_eq!(shared_cpus(&topo, &pool, &holding(false, "", &[0, 1], 256, &[])), pool);
        assert_eq!(shared_cpus(&topo, &pool, &holding(true, "4-5", &[1], 256, &[])), cpus("4-5"));
    }

    #[test]
    fn lists_read_as_prose() {
        assert_eq!(
            (list(&[]), list(&[1]), list(&[0, 1]), list(&[0, 1, 3])),
            ("none".into(), "1".into(), "0 and 1".into(), "0, 1 and 3".into())
        );
    }
}
