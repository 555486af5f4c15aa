//! vmhost-bench's metrics figures (docs/metrics.md, docs/performance.md): the latency of
//! `vm.stats` for every VM at once with `vms` running VMs, of `vm.stats` for one VM and of
//! `host.stats`. The VMs are the smallest there are: a halting boot sector
//! ([`crate::boot_sector::HALT`], no kernel), 32 MiB, one NIC each on a bridge in a network
//! namespace, so every part of a VM's figures is read (`/proc`, the taps' counters, the stats
//! monitor). Prints figures; asserts nothing about time.

use crate::{boot_sector, percentile, HostOptions, TestHost, LAN_NETWORK};
use serde_json::json;
use std::time::{Duration, Instant};

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

/// Times `calls` sequential calls of `method` and returns them sorted.
fn time_calls(host: &TestHost, method: &str, params: &serde_json::Value, calls: usize) -> Vec<Duration> {
    let mut c = host.client();
    let mut took: Vec<Duration> = (0..calls)
        .map(|_| {
            let t = Instant::now();
            let r: serde_json::Value = c.call(method, params.clone()).expect("stats call");
            let d = t.elapsed();
            if method == "vm.stats" {
                let incomplete =
                    r["vms"].as_array().map_or(0, |v| v.iter().filter(|v| v["missing"] != json!({})).count());
                assert_eq!(incomplete, 0, "a VM's figures were incomplete: {r}");
            }
            d
        })
        .collect();
    took.sort();
    took
}

/// CPU seconds (user + system) used so far by process `pid` and by the QEMUs of `host`.
fn cpu_seconds(host: &TestHost, pid: u32) -> (f64, f64) {
    let of = |pid: i64| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let rest: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
        let field = |n: usize| rest.get(n - 3).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
        (field(14) + field(15)) / 100.0
    };
    (of(i64::from(pid)), host.qemu_pids().into_iter().map(|p| of(i64::from(p))).sum())
}

/// Starts `vms` idle VMs and prints the latency of `calls` stats calls of each kind.
pub fn stats(vms: usize, calls: usize) {
    if vms == 0 || calls == 0 {
        return;
    }
    let cpu = u32::try_from(vms).unwrap_or(u32::MAX).saturating_add(2);
    let host = TestHost::start(HostOptions { cpu, netns: true, extra: LAN_NETWORK.into(), ..HostOptions::default() });
    boot_sector::write_image(&host.images().join("halt.raw"), boot_sector::HALT);
    let t = Instant::now();
    for i in 0..vms {
        let spec = json!({"name": format!("stat-{i:02}"), "cpu": 1, "memory_mib": 32,
            "boot": {"image": "halt.raw", "disk_gib": 1}, "nics": [{"network": "lan"}]});
        let r = host.call("vm.create", json!({ "spec": spec }));
        assert_eq!(r["vm"]["status"], "running", "{r}");
    }
    let started = t.elapsed();
    let daemon = host.daemon_pid().expect("daemon pid");
    // What vmhostd and the QEMUs use over 5 s with no call and no samplers yet (TCG timers of
    // halted guests).
    let idle = |secs: u64| {
        let (d0, q0) = cpu_seconds(&host, daemon);
        std::thread::sleep(Duration::from_secs(secs));
        let (d1, q1) = cpu_seconds(&host, daemon);
        ((d1 - d0) / secs as f64, (q1 - q0) / secs as f64)
    };
    let (daemon_bare, qemu_bare) = idle(5);
    // One call first: it starts each VM's sampler and waits for its first sample.
    let _ = time_calls(&host, "vm.stats", &json!({}), 1);
    // The same with the samplers running (their background cost), and the base to subtract.
    let (daemon_idle, idle_per_s) = idle(5);
    let (d0, q0) = cpu_seconds(&host, daemon);
    let t0 = Instant::now();
    let all = time_calls(&host, "vm.stats", &json!({}), calls);
    let wall = t0.elapsed().as_secs_f64();
    let (d1, q1) = cpu_seconds(&host, daemon);
    // The QEMUs idle (halted) meanwhile: what they used is mostly answering the calls.
    let per_call = |s: f64| s * 1000.0 / calls as f64;
    let one = time_calls(&host, "vm.stats", &json!({"name": "stat-00"}), calls);
    let host_stats = time_calls(&host, "host.stats", &json!({}), calls);
    println!();
    println!(
        "Stats with {vms} running VMs (boot sector halting, 32 MiB, 1 NIC; started in {:.1} s), {calls} sequential calls each",
        started.as_secs_f64()
    );
    println!("| call | p50 (ms) | p90 (ms) | p99 (ms) | max (ms) |");
    println!("|---|---:|---:|---:|---:|");
    for (what, took) in [("vm.stats, all VMs", &all), ("vm.stats, one VM", &one), ("host.stats", &host_stats)] {
        println!(
            "| {what} | {} | {} | {} | {} |",
            ms(percentile(took, 0.5)),
            ms(percentile(took, 0.9)),
            ms(percentile(took, 0.99)),
            ms(took[took.len() - 1])
        );
    }
    println!(
        "CPU per `vm.stats` of all VMs: vmhostd {:.1} ms, the {vms} QEMUs together {:.1} ms beyond their idle \
         {:.0} ms/s ({:.1} ms wall per call)",
        per_call(d1 - d0),
        per_call((q1 - q0) - idle_per_s * wall),
        idle_per_s * 1000.0,
        wall * 1000.0 / calls as f64
    );
    println!(
        "Background sampling of the {vms} VMs, CPU per second with no call: vmhostd {:.1} ms/s, the QEMUs {:.1} ms/s",
        (daemon_idle - daemon_bare) * 1000.0,
        (idle_per_s - qemu_bare) * 1000.0
    );
}
