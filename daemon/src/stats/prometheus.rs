//! The Prometheus text exposition format (version 0.0.4) of a `vm.stats` report and, when
//! given, a `host.stats` one: what `vmhostctl stats --prometheus` prints for node_exporter's
//! textfile collector.
//!
//! [`render`] writes each metric family once, HELP and TYPE first, then one sample per VM
//! (and per vCPU, disk or NIC). Counters end in `_total`. Label values are escaped
//! ([`escape`]); a VM that is not running appears only in `vmhost_vm_up` (0).

use crate::api::stats::{HostStats, VmStats, VmStatsReport};
use crate::api::VmStatus;
use std::fmt::Write;

/// One metric family being written.
struct Family<'a> {
    out: &'a mut String,
}

impl Family<'_> {
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        let labels = if labels.is_empty() { String::new() } else { format!("{{{}}}", labels.join(",")) };
        let _ = writeln!(self.out, "{name}{labels} {}", number(value));
    }
}

fn family<'a>(out: &'a mut String, name: &str, kind: &str, help: &str) -> Family<'a> {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    Family { out }
}

/// A label value with `\`, `"` and newlines escaped as the format requires.
pub fn escape(value: &str) -> String {
    value.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n")
}

/// A sample value: integers without a fraction, others as Rust prints them (shortest exact).
fn number(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// A per-VM metric: the VM's one value, if it has one.
type Scalar = fn(&VmStats) -> Option<f64>;

/// A metric with one sample per vCPU, disk or NIC: the extra labels and the value of each.
type Per<'a> = fn(&'a VmStats) -> Vec<(Vec<(&'static str, String)>, f64)>;

/// The exposition of `vms` (and `host`, if given).
pub fn render(vms: &VmStatsReport, host: Option<&HostStats>) -> String {
    let mut out = String::new();
    let running: Vec<&VmStats> = vms.vms.iter().filter(|v| v.status == VmStatus::Running).collect();
    {
        let mut f = family(&mut out, "vmhost_vm_up", "gauge", "1 when the VM's QEMU runs, else 0.");
        for v in &vms.vms {
            f.sample("vmhost_vm_up", &[("vm", &v.name)], f64::from(u8::from(v.status == VmStatus::Running)));
        }
    }
    let scalar: [(&str, &str, &str, Scalar); 6] = [
        ("vmhost_vm_cpu_seconds_total", "counter", "CPU time of the VM's QEMU process (user and system).", |v| {
            v.cpu_seconds
        }),
        ("vmhost_vm_memory_rss_bytes", "gauge", "Resident memory of the VM's QEMU process.", |v| {
            v.rss_bytes.map(|b| b as f64)
        }),
        ("vmhost_vm_memory_bytes", "gauge", "Guest memory as declared.", |v| Some(v.memory_bytes as f64)),
        ("vmhost_vm_uptime_seconds", "gauge", "Seconds since the VM's QEMU started.", |v| v.uptime_s),
        ("vmhost_vm_restarts_total", "counter", "Restarts by the restart policy.", |v| Some(f64::from(v.restarts))),
        ("vmhost_vm_stats_missing_parts", "gauge", "Parts of the VM's figures that could not be read.", |v| {
            Some(v.missing.len() as f64)
        }),
    ];
    for (name, kind, help, get) in scalar {
        let mut f = family(&mut out, name, kind, help);
        for v in &running {
            if let Some(x) = get(v) {
                f.sample(name, &[("vm", &v.name)], x);
            }
        }
    }
    let per: [(&str, &str, &str, Per<'_>); 11] = [
        ("vmhost_vm_vcpu_seconds_total", "counter", "CPU time of each vCPU thread.", |v| {
            v.vcpus.iter().map(|c| (vec![("vcpu", c.index.to_string())], c.cpu_seconds)).collect()
        }),
        ("vmhost_vm_disk_read_bytes_total", "counter", "Bytes the guest read from each disk.", |v| {
            v.disks.iter().map(|d| (vec![("device", d.device.clone())], d.read_bytes as f64)).collect()
        }),
        ("vmhost_vm_disk_write_bytes_total", "counter", "Bytes the guest wrote to each disk.", |v| {
            v.disks.iter().map(|d| (vec![("device", d.device.clone())], d.write_bytes as f64)).collect()
        }),
        ("vmhost_vm_disk_read_ops_total", "counter", "Read requests of each disk.", |v| {
            v.disks.iter().map(|d| (vec![("device", d.device.clone())], d.read_ops as f64)).collect()
        }),
        ("vmhost_vm_disk_write_ops_total", "counter", "Write requests of each disk.", |v| {
            v.disks.iter().map(|d| (vec![("device", d.device.clone())], d.write_ops as f64)).collect()
        }),
        ("vmhost_vm_net_rx_bytes_total", "counter", "Bytes each NIC's guest received.", |v| nic(v, |n| n.rx_bytes)),
        ("vmhost_vm_net_rx_packets_total", "counter", "Packets each NIC's guest received.", |v| {
            nic(v, |n| n.rx_packets)
        }),
        ("vmhost_vm_net_rx_dropped_total", "counter", "Packets for each NIC's guest dropped.", |v| {
            nic(v, |n| n.rx_dropped)
        }),
        ("vmhost_vm_net_tx_bytes_total", "counter", "Bytes each NIC's guest sent.", |v| nic(v, |n| n.tx_bytes)),
        ("vmhost_vm_net_tx_packets_total", "counter", "Packets each NIC's guest sent.", |v| nic(v, |n| n.tx_packets)),
        ("vmhost_vm_net_tx_dropped_total", "counter", "Packets from each NIC's guest dropped.", |v| {
            nic(v, |n| n.tx_dropped)
        }),
    ];
    for (name, kind, help, get) in per {
        let mut f = family(&mut out, name, kind, help);
        for v in &running {
            for (labels, x) in get(v) {
                let mut all: Vec<(&str, &str)> = vec![("vm", &v.name)];
                all.extend(labels.iter().map(|(k, val)| (*k, val.as_str())));
                f.sample(name, &all, x);
            }
        }
    }
    if let Some(h) = host {
        render_host(&mut out, h);
    }
    out
}

fn nic(v: &VmStats, get: fn(&crate::api::stats::NicStats) -> u64) -> Vec<(Vec<(&'static str, String)>, f64)> {
    v.nics.iter().map(|n| (vec![("nic", n.index.to_string()), ("tap", n.tap.clone())], get(n) as f64)).collect()
}

fn render_host(out: &mut String, h: &HostStats) {
    if let Some(c) = &h.cpu {
        let name = "vmhost_host_cpu_seconds_total";
        let mut f = family(out, name, "counter", "Host CPU time since boot over every CPU, by mode.");
        for (mode, x) in [
            ("user", c.user_seconds),
            ("system", c.system_seconds),
            ("idle", c.idle_seconds),
            ("iowait", c.iowait_seconds),
            ("other", c.other_seconds),
        ] {
            f.sample(name, &[("mode", mode)], x);
        }
        family(out, "vmhost_host_cpus", "gauge", "Online host CPUs.").sample(
            "vmhost_host_cpus",
            &[],
            f64::from(c.count),
        );
    }
    if let Some(m) = &h.memory {
        for (name, help, x) in [
            ("vmhost_host_memory_total_bytes", "Host memory (MemTotal).", m.total_bytes),
            ("vmhost_host_memory_available_bytes", "Host memory available (MemAvailable).", m.available_bytes),
        ] {
            family(out, name, "gauge", help).sample(name, &[], x as f64);
        }
    }
    family(out, "vmhost_host_vms_running", "gauge", "VMs running.").sample(
        "vmhost_host_vms_running",
        &[],
        h.vms.running as f64,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::stats::{DiskStats, NicStats, VcpuStats};
    use std::collections::BTreeMap;

    fn vm(name: &str, status: VmStatus) -> VmStats {
        VmStats {
            name: name.into(),
            status,
            pid: Some(7),
            uptime_s: Some(1.5),
            restarts: 1,
            memory_bytes: 64 << 20,
            cpu_seconds: Some(2.25),
            rss_bytes: Some(4096),
            vcpus: vec![VcpuStats { index: 0, thread_id: 8, cpu_seconds: 2.0 }],
            disks: vec![DiskStats {
                device: "virtio0".into(),
                read_bytes: 1,
                write_bytes: 2,
                read_ops: 3,
                write_ops: 4,
            }],
            disks_sampled_ms: None,
            nics: vec![NicStats {
                index: 0,
                tap: "vmt\"x".into(),
                mac: "m".into(),
                rx_bytes: 5,
                rx_packets: 6,
                rx_dropped: 0,
                tx_bytes: 7,
                tx_packets: 8,
                tx_dropped: 0,
            }],
            missing: BTreeMap::new(),
        }
    }

    #[test]
    fn every_family_once_with_help_and_type_and_a_sample_per_vm() {
        let report = VmStatsReport {
            timestamp_ms: 1,
            time: "t".into(),
            vms: vec![vm("a", VmStatus::Running), vm("b", VmStatus::Stopped)],
        };
        let text = render(&report, None);
        assert!(text.contains("# TYPE vmhost_vm_cpu_seconds_total counter\n"), "{text}");
        assert!(text.contains("vmhost_vm_cpu_seconds_total{vm=\"a\"} 2.25\n"), "{text}");
        assert!(text.contains("vmhost_vm_up{vm=\"b\"} 0\n"), "{text}");
        assert!(!text.contains("vmhost_vm_cpu_seconds_total{vm=\"b\"}"), "{text}");
        assert!(text.contains("vmhost_vm_disk_write_bytes_total{vm=\"a\",device=\"virtio0\"} 2\n"), "{text}");
        assert!(text.contains("vmhost_vm_net_rx_packets_total{vm=\"a\",nic=\"0\",tap=\"vmt\\\"x\"} 6\n"), "{text}");
        let types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let mut names: Vec<&str> = types.iter().map(|l| l.split(' ').nth(2).unwrap_or("")).collect();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "each family once");
        assert_eq!(escape("a\\b\"c\nd"), r#"a\\b\"c\nd"#);
    }
}
