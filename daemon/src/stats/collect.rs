//! Reads the figures of many VMs at once, from a snapshot taken without any lock held.
//!
//! Use: build one [`Target`] per VM from its record (the manager does this under its table lock,
//! then releases it), then call [`vms`] with the manager's [`Samplers`]. It makes one netlink dump
//! for every tap, then reads each running VM: `/proc` first, then the last sample of the VM's
//! stats monitor kept by [`super::sampler`] (vCPU threads and block counters), so no QEMU is asked
//! anything during a call. Only the first call for a new QEMU process waits for its first sample,
//! bounded by [`QMP_TIMEOUT`]. A part that fails, or a sample too old to be current, is named in
//! `missing`; the rest is still reported.

use super::procfs::{self, Ticks};
use super::sampler::{judge, Verdict, STALE_AFTER};
pub use super::sampler::{Samplers, QMP_TIMEOUT};
use crate::api::stats::{DiskStats, NicStats, VcpuStats, VmStats};
use crate::api::VmStatus;
use crate::net::link::{LinkCounters, Netlink};
use crate::process::ProcessIdentity;
use crate::qemu::qmp::BlockStats;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What the collector needs of one VM, copied out of its record.
#[derive(Debug, Clone)]
pub struct Target {
    /// VM name.
    pub name: String,
    /// Status as recorded.
    pub status: VmStatus,
    /// The recorded QEMU process, when running.
    pub process: Option<ProcessIdentity>,
    /// The VM's stats monitor socket.
    pub qmp_stats: PathBuf,
    /// `(mac, tap)` of each NIC, in spec order.
    pub nics: Vec<(String, String)>,
    /// Restarts by the restart policy.
    pub restarts: u32,
    /// Declared guest memory, in MiB.
    pub memory_mib: u64,
}

/// The figures of every target, in the order given. `all`: the targets are every VM, so
/// connections of VMs not running among them are closed.
pub async fn vms(targets: Vec<Target>, net: &Netlink, samplers: &Samplers, all: bool) -> Vec<VmStats> {
    let ticks = Ticks::system();
    let live = |t: &Target| t.status == VmStatus::Running && t.process.is_some();
    let counters = if targets.iter().any(|t| live(t) && !t.nics.is_empty()) {
        net.link_counters().await.map_err(|e| format!("cannot read tap counters: {e}"))
    } else {
        Ok(BTreeMap::new())
    };
    if all {
        let running: Vec<&str> = targets.iter().filter(|t| live(t)).map(|t| t.name.as_str()).collect();
        samplers.keep_only(&running);
    }
    let uptime = std::fs::read_to_string(Path::new(crate::process::PROC_ROOT).join("uptime")).unwrap_or_default();
    let reads = targets.into_iter().map(|t| {
        let counters = &counters;
        let uptime = uptime.as_str();
        async move {
            let mut stats = empty(&t);
            if let (VmStatus::Running, Some(process)) = (t.status, t.process.as_ref()) {
                read_running(&t, process, &mut stats, ticks, uptime, counters, samplers).await;
            }
            stats
        }
    });
    futures_util::future::join_all(reads).await
}

fn empty(t: &Target) -> VmStats {
    VmStats {
        name: t.name.clone(),
        status: t.status,
        pid: None,
        uptime_s: None,
        restarts: t.restarts,
        memory_bytes: t.memory_mib.saturating_mul(1 << 20),
        cpu_seconds: None,
        rss_bytes: None,
        vcpus: Vec::new(),
        disks: Vec::new(),
        disks_sampled_ms: None,
        nics: Vec::new(),
        missing: BTreeMap::new(),
    }
}

async fn read_running(
    t: &Target,
    process: &ProcessIdentity,
    stats: &mut VmStats,
    ticks: Ticks,
    uptime: &str,
    counters: &Result<BTreeMap<String, LinkCounters>, String>,
    samplers: &Samplers,
) {
    stats.pid = Some(process.pid);
    match counters {
        Ok(map) => stats.nics = nic_stats(&t.nics, map, &mut stats.missing),
        Err(e) => {
            stats.missing.insert("nics".into(), e.clone());
        }
    }
    let dir = match procfs::open_process_in(Path::new(crate::process::PROC_ROOT), process) {
        Ok(dir) => dir,
        Err(e) => {
            // Nothing else of a gone process is worth asking: its monitor is gone too.
            stats.missing.insert("process".into(), e.to_string());
            return;
        }
    };
    match procfs::read_process(&dir, ticks, uptime) {
        Ok(f) => {
            stats.cpu_seconds = Some(f.cpu_seconds);
            stats.rss_bytes = Some(f.rss_bytes);
            stats.uptime_s = Some(f.uptime_s);
        }
        Err(e) => {
            stats.missing.insert("process".into(), e.to_string());
        }
    }
    let mut rx = samplers.get(&t.name, process, &t.qmp_stats);
    let cache = Samplers::wait_first(&mut rx, QMP_TIMEOUT).await;
    let sample = match judge(&cache, Instant::now(), STALE_AFTER) {
        Verdict::Current(sample) => sample,
        Verdict::Missing(why) => {
            stats.missing.insert("vcpus".into(), why.clone());
            stats.missing.insert("disks".into(), why);
            return;
        }
    };
    stats.disks = disk_stats(&sample.blocks);
    stats.disks_sampled_ms = Some(sample.at_ms);
    for v in sample.threads.iter() {
        match procfs::read_thread(&dir, v.thread_id, ticks) {
            Ok(cpu_seconds) => stats.vcpus.push(VcpuStats { index: v.index, thread_id: v.thread_id, cpu_seconds }),
            Err(e) => {
                stats.missing.insert("vcpus".into(), format!("vCPU {} (thread {}): {e}", v.index, v.thread_id));
            }
        }
    }
}

/// The block devices the guest has, by drive name, or node name for a hot-plugged data disk
/// (QEMU also lists other nodes without a drive name: skipped).
fn disk_stats(blocks: &[BlockStats]) -> Vec<DiskStats> {
    blocks
        .iter()
        .filter_map(|b| match (b.device.as_str(), b.node_name.as_str()) {
            ("", node) if node.starts_with("data-") => Some((node, b)),
            ("", _) => None,
            (device, _) => Some((device, b)),
        })
        .map(|(device, b)| DiskStats {
            device: device.to_string(),
            read_bytes: b.stats.rd_bytes,
            write_bytes: b.stats.wr_bytes,
            read_ops: b.stats.rd_operations,
            write_ops: b.stats.wr_operations,
        })
        .collect()
}

/// Each NIC's counters from its tap's, swapped to the guest's side; a tap absent from the dump
/// is named in `missing`.
pub fn nic_stats(
    nics: &[(String, String)],
    counters: &BTreeMap<String, LinkCounters>,
    missing: &mut BTreeMap<String, String>,
) -> Vec<NicStats> {
    let mut out = Vec::new();
    for (index, (mac, tap)) in nics.iter().enumerate() {
        match counters.get(tap) {
            Some(c) => out.push(NicStats {
                index,
                tap: tap.clone(),
                mac: mac.clone(),
                rx_bytes: c.tx_bytes,
                rx_packets: c.tx_packets,
                rx_dropped: c.tx_dropped,
                tx_bytes: c.rx_bytes,
                tx_packets: c.rx_packets,
                tx_dropped: c.rx_dropped,
            }),
            None => {
                missing.insert("nics".into(), format!("tap {tap} of NIC {index} not found"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qemu::qmp::BlockCounters;

    #[test]
    fn nic_counters_are_seen_from_the_guest_and_a_missing_tap_is_named() {
        let mut counters = BTreeMap::new();
        let c =
            LinkCounters { rx_bytes: 10, rx_packets: 1, rx_dropped: 0, tx_bytes: 200, tx_packets: 2, tx_dropped: 3 };
        counters.insert("vmt-a-0".to_string(), c);
        let nics = vec![("02:00:00:00:00:01".to_string(), "vmt-a-0".to_string()), ("m".into(), "vmt-a-1".into())];
        let mut missing = BTreeMap::new();
        let out = nic_stats(&nics, &counters, &mut missing);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].rx_bytes, out[0].rx_packets, out[0].rx_dropped), (200, 2, 3));
        assert_eq!((out[0].tx_bytes, out[0].tx_packets, out[0].tx_dropped), (10, 1, 0));
        assert_eq!(missing.get("nics").map(String::as_str), Some("tap vmt-a-1 of NIC 1 not found"));
    }

    #[test]
    fn only_drives_with_a_name_and_hot_plugged_data_disks_are_disks() {
        let counters = BlockCounters { rd_bytes: 1, wr_bytes: 2, rd_operations: 3, wr_operations: 4 };
        let block =
            |device: &str, node: &str| BlockStats { device: device.into(), node_name: node.into(), stats: counters };
        let out = disk_stats(&[block("virtio0", "#block123"), block("", "#block456"), block("", "data-extra")]);
        let disk = |device: &str| DiskStats {
            device: device.into(),
            read_bytes: 1,
            write_bytes: 2,
            read_ops: 3,
            write_ops: 4,
        };
        assert_eq!(out, [disk("virtio0"), disk("data-extra")]);
    }

    #[tokio::test]
    async fn a_vm_whose_monitor_is_absent_gets_its_other_figures_and_a_marker() {
        let net = Netlink::connect().unwrap();
        // This test process stands in for QEMU: its own identity, no monitor socket.
        let me = crate::process::identify(std::process::id() as i32).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let target = Target {
            name: "a".into(),
            status: VmStatus::Running,
            process: Some(me),
            qmp_stats: dir.path().join("qmpst"),
            nics: vec![("02:00:00:00:00:01".into(), "lo".into())],
            restarts: 2,
            memory_mib: 64,
        };
        let stopped = Target { name: "b".into(), status: VmStatus::Stopped, process: None, ..target.clone() };
        let out = vms(vec![target, stopped], &net, &Samplers::default(), true).await;
        let a = &out[0];
        assert!(a.cpu_seconds.is_some() && a.rss_bytes.unwrap_or(0) > 0, "{a:?}");
        assert_eq!((a.restarts, a.memory_bytes, a.nics.len()), (2, 64 << 20, 1));
        assert!(a.missing.get("disks").is_some_and(|m| m.contains("stats monitor")), "{a:?}");
        assert!(a.missing.contains_key("vcpus") && !a.missing.contains_key("process"), "{a:?}");
        let b = &out[1];
        assert_eq!((b.pid, b.cpu_seconds, b.missing.is_empty()), (None, None, true));
    }
}
