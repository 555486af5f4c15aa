//! Wire types of `vm.stats` and `host.stats` (docs/metrics.md).
//!
//! Every figure is a cumulative counter or a gauge read at [`VmStatsReport::timestamp_ms`]; a
//! reader computes rates from two reports. A part that could not be read (QEMU's monitor did
//! not answer, the process is gone) is absent and named in `missing` with the reason, so one
//! slow VM never fails the whole call.

use super::VmStatus;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Params of `vm.stats`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatsParams {
    /// One VM; every VM when absent.
    #[serde(default)]
    pub name: Option<String>,
}

/// Result of `vm.stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmStatsReport {
    /// When the figures were read, milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// The same instant, RFC 3339.
    pub time: String,
    /// One entry per VM, by name.
    pub vms: Vec<VmStats>,
}

/// The figures of one VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmStats {
    /// VM name.
    pub name: String,
    /// Observed state; figures are only read for `running` VMs.
    pub status: VmStatus,
    /// QEMU's pid while running.
    pub pid: Option<i32>,
    /// Seconds since QEMU started.
    pub uptime_s: Option<f64>,
    /// How often the restart policy has restarted the VM.
    pub restarts: u32,
    /// Guest memory as declared, in bytes.
    pub memory_bytes: u64,
    /// CPU time of the whole QEMU process (user plus system), in seconds.
    pub cpu_seconds: Option<f64>,
    /// Resident memory of the QEMU process, in bytes.
    pub rss_bytes: Option<u64>,
    /// CPU time of each vCPU thread.
    #[serde(default)]
    pub vcpus: Vec<VcpuStats>,
    /// I/O of each block device.
    #[serde(default)]
    pub disks: Vec<DiskStats>,
    /// When `vcpus`' thread list and `disks` were sampled from QEMU (every few seconds, not at
    /// `timestamp_ms`), milliseconds since the Unix epoch: disk rates use this instant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disks_sampled_ms: Option<u64>,
    /// Traffic of each NIC, in spec order.
    #[serde(default)]
    pub nics: Vec<NicStats>,
    /// Parts that could not be read (`process`, `vcpus`, `disks`, `nics`), with the reason.
    #[serde(default)]
    pub missing: BTreeMap<String, String>,
}

/// One vCPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VcpuStats {
    /// vCPU index.
    pub index: u32,
    /// The host thread running it.
    pub thread_id: i32,
    /// Its CPU time (user plus system), in seconds.
    pub cpu_seconds: f64,
}

/// One block device, from QEMU's counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskStats {
    /// QEMU's drive name (`virtio0`, ...).
    pub device: String,
    /// Bytes the guest read.
    pub read_bytes: u64,
    /// Bytes the guest wrote.
    pub write_bytes: u64,
    /// Read requests.
    pub read_ops: u64,
    /// Write requests.
    pub write_ops: u64,
}

/// One NIC, from its tap's kernel counters, seen from the guest: `rx` is what the guest
/// received (the tap sent), `tx` what it sent (the tap received).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicStats {
    /// NIC index in the spec.
    pub index: usize,
    /// Host tap.
    pub tap: String,
    /// MAC address.
    pub mac: String,
    /// Bytes the guest received.
    pub rx_bytes: u64,
    /// Packets the guest received.
    pub rx_packets: u64,
    /// Packets for the guest dropped (it did not take them in time).
    pub rx_dropped: u64,
    /// Bytes the guest sent.
    pub tx_bytes: u64,
    /// Packets the guest sent.
    pub tx_packets: u64,
    /// Packets from the guest the host dropped.
    pub tx_dropped: u64,
}

/// Result of `host.stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostStats {
    /// When the figures were read, milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// The same instant, RFC 3339.
    pub time: String,
    /// Host CPU time (`/proc/stat`).
    pub cpu: Option<HostCpu>,
    /// Host memory (`/proc/meminfo`).
    pub memory: Option<HostMemory>,
    /// The sum over every running VM.
    pub vms: VmTotals,
    /// Host parts that could not be read (`cpu`, `memory`), with the reason.
    #[serde(default)]
    pub missing: BTreeMap<String, String>,
}

/// Host CPU time since boot, summed over every CPU, in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostCpu {
    /// Online CPUs.
    pub count: u32,
    /// User time (with nice).
    pub user_seconds: f64,
    /// System time (with interrupts).
    pub system_seconds: f64,
    /// Idle time.
    pub idle_seconds: f64,
    /// Time idle waiting for I/O.
    pub iowait_seconds: f64,
    /// Everything else (steal, guest time not already counted).
    pub other_seconds: f64,
}

/// Host memory, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMemory {
    /// `MemTotal`.
    pub total_bytes: u64,
    /// `MemAvailable`: what can be used without swapping.
    pub available_bytes: u64,
}

/// Figures summed over the running VMs (parts missing for a VM count as zero).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct VmTotals {
    /// VMs running.
    pub running: usize,
    /// VMs with a part missing.
    pub incomplete: usize,
    /// CPU seconds of their QEMU processes.
    pub cpu_seconds: f64,
    /// Resident memory of their QEMU processes.
    pub rss_bytes: u64,
    /// Declared guest memory.
    pub memory_bytes: u64,
    /// Disk bytes read.
    pub disk_read_bytes: u64,
    /// Disk bytes written.
    pub disk_write_bytes: u64,
    /// Bytes the guests received.
    pub net_rx_bytes: u64,
    /// Bytes the guests sent.
    pub net_tx_bytes: u64,
}

impl VmTotals {
    /// The sum over the running VMs of `vms`.
    pub fn of(vms: &[VmStats]) -> VmTotals {
        let mut t = VmTotals::default();
        for v in vms.iter().filter(|v| v.status == VmStatus::Running) {
            t.running += 1;
            t.incomplete += usize::from(!v.missing.is_empty());
            t.cpu_seconds += v.cpu_seconds.unwrap_or(0.0);
            t.rss_bytes += v.rss_bytes.unwrap_or(0);
            t.memory_bytes += v.memory_bytes;
            t.disk_read_bytes += v.disks.iter().map(|d| d.read_bytes).sum::<u64>();
            t.disk_write_bytes += v.disks.iter().map(|d| d.write_bytes).sum::<u64>();
            t.net_rx_bytes += v.nics.iter().map(|n| n.rx_bytes).sum::<u64>();
            t.net_tx_bytes += v.nics.iter().map(|n| n.tx_bytes).sum::<u64>();
        }
        t
    }
}
