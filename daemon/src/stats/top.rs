//! Rates between two `vm.stats` reports, one row per VM: what `vmhostctl top` shows.
//!
//! Use: keep the previous report, fetch the next, call [`rows`]. A VM absent from the previous
//! report, restarted in between (a counter went down) or missing a part shows `-` for the rates
//! it cannot have.

use crate::api::stats::{VmStats, VmStatsReport};

/// One VM's line.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// VM name.
    pub name: String,
    /// Observed state.
    pub status: String,
    /// CPU use of its QEMU process, in percent of one host CPU.
    pub cpu_percent: Option<f64>,
    /// Resident memory, in bytes.
    pub rss_bytes: Option<u64>,
    /// Disk bytes read and written per second.
    pub disk_read_per_s: Option<f64>,
    /// Disk bytes written per second.
    pub disk_write_per_s: Option<f64>,
    /// Network bytes received (by the guest) per second.
    pub net_rx_per_s: Option<f64>,
    /// Network bytes sent per second.
    pub net_tx_per_s: Option<f64>,
}

/// The rows for `cur`, with rates against `prev`.
pub fn rows(prev: &VmStatsReport, cur: &VmStatsReport) -> Vec<Row> {
    let secs = cur.timestamp_ms.saturating_sub(prev.timestamp_ms) as f64 / 1000.0;
    cur.vms
        .iter()
        .map(|v| {
            let before = prev.vms.iter().find(|p| p.name == v.name && p.pid == v.pid && v.pid.is_some());
            let rate_over = |secs: f64, get: &dyn Fn(&VmStats) -> Option<f64>| -> Option<f64> {
                let (b, a) = (get(before?)?, get(v)?);
                (secs > 0.0 && a >= b).then(|| (a - b) / secs)
            };
            let rate = |get: &dyn Fn(&VmStats) -> Option<f64>| rate_over(secs, get);
            // Disk counters carry their own sampling instant (docs/metrics.md): two reports
            // within one sampling interval have the same sample and so no disk rate.
            let disk_secs = before.map_or(0.0, |b| {
                let (t0, t1) =
                    (b.disks_sampled_ms.unwrap_or(prev.timestamp_ms), v.disks_sampled_ms.unwrap_or(cur.timestamp_ms));
                t1.saturating_sub(t0) as f64 / 1000.0
            });
            let disk_rate = |get: &dyn Fn(&VmStats) -> Option<f64>| rate_over(disk_secs, get);
            Row {
                name: v.name.clone(),
                status: v.status.to_string(),
                cpu_percent: rate(&|s| s.cpu_seconds).map(|r| r * 100.0),
                rss_bytes: v.rss_bytes,
                disk_read_per_s: disk_rate(&|s| total(s, "disks", |s| s.disks.iter().map(|d| d.read_bytes).sum())),
                disk_write_per_s: disk_rate(&|s| total(s, "disks", |s| s.disks.iter().map(|d| d.write_bytes).sum())),
                net_rx_per_s: rate(&|s| total(s, "nics", |s| s.nics.iter().map(|n| n.rx_bytes).sum())),
                net_tx_per_s: rate(&|s| total(s, "nics", |s| s.nics.iter().map(|n| n.tx_bytes).sum())),
            }
        })
        .collect()
}

/// `sum` of `s`, unless `part` could not be read (a partial sum would fake a rate).
fn total(s: &VmStats, part: &str, sum: fn(&VmStats) -> u64) -> Option<f64> {
    (!s.missing.contains_key(part)).then(|| sum(s) as f64)
}

/// A byte count or rate for a table cell: `-` when unknown, else B, KiB, MiB or GiB.
pub fn human_bytes(v: Option<f64>) -> String {
    let Some(mut x) = v else { return "-".into() };
    for unit in ["B", "KiB", "MiB"] {
        if x < 1024.0 {
            return format!("{x:.0}{unit}");
        }
        x /= 1024.0;
    }
    format!("{x:.1}GiB")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::stats::{DiskStats, NicStats};
    use crate::api::VmStatus;
    use std::collections::BTreeMap;

    fn vm(pid: i32, cpu: f64, written: u64, rx: u64) -> VmStats {
        VmStats {
            name: "a".into(),
            status: VmStatus::Running,
            pid: Some(pid),
            uptime_s: None,
            restarts: 0,
            memory_bytes: 0,
            cpu_seconds: Some(cpu),
            rss_bytes: Some(2 << 20),
            vcpus: vec![],
            disks: vec![DiskStats {
                device: "virtio0".into(),
                read_bytes: 0,
                write_bytes: written,
                read_ops: 0,
                write_ops: 0,
            }],
            disks_sampled_ms: None,
            nics: vec![NicStats {
                index: 0,
                tap: "t".into(),
                mac: "m".into(),
                rx_bytes: rx,
                rx_packets: 0,
                rx_dropped: 0,
                tx_bytes: 0,
                tx_packets: 0,
                tx_dropped: 0,
            }],
            missing: BTreeMap::new(),
        }
    }

    fn report(ms: u64, vms: Vec<VmStats>) -> VmStatsReport {
        VmStatsReport { timestamp_ms: ms, time: String::new(), vms }
    }

    #[test]
    fn rates_over_the_interval_and_none_across_a_restart() {
        let r = rows(&report(1000, vec![vm(5, 1.0, 0, 100)]), &report(3000, vec![vm(5, 2.0, 4096, 2148)]));
        assert_eq!(r[0].cpu_percent, Some(50.0));
        assert_eq!((r[0].disk_write_per_s, r[0].disk_read_per_s), (Some(2048.0), Some(0.0)));
        assert_eq!(r[0].net_rx_per_s, Some(1024.0));
        let restarted = rows(&report(1000, vec![vm(5, 1.0, 0, 0)]), &report(3000, vec![vm(6, 0.5, 0, 0)]));
        assert_eq!(restarted[0].cpu_percent, None);
        let mut partial = vm(5, 2.0, 9, 0);
        partial.missing.insert("disks".into(), "timeout".into());
        let r = rows(&report(1000, vec![vm(5, 1.0, 0, 0)]), &report(3000, vec![partial]));
        assert_eq!((r[0].disk_write_per_s, r[0].cpu_percent), (None, Some(50.0)));
        assert_eq!(human_bytes(Some(2048.0)), "2KiB");
        assert_eq!(human_bytes(None), "-");
        assert_eq!(human_bytes(Some(3.0 * 1024.0 * 1024.0 * 1024.0)), "3.0GiB");
    }

    #[test]
    fn disk_rates_run_between_the_instants_the_disks_were_sampled() {
        let sampled = |ms, written| VmStats { disks_sampled_ms: Some(ms), ..vm(5, 1.0, written, 0) };
        // Reports 2 s apart, disk samples 4 s apart.
        let r = rows(&report(5000, vec![sampled(1000, 0)]), &report(7000, vec![sampled(5000, 4096)]));
        assert_eq!(r[0].disk_write_per_s, Some(1024.0));
        // The same sample in both reports gives no disk rate, not a rate of zero.
        let r = rows(&report(5000, vec![sampled(5000, 4096)]), &report(6000, vec![sampled(5000, 4096)]));
        assert_eq!(r[0].disk_write_per_s, None);
    }
}
