//! vmhost-bench's day-2 figures (docs/performance.md): how long changing a running VM takes
//! (`vm.apply` with a new memory size: ACPI power-off, start with the new spec) and how long
//! autostart takes to bring back 20 VMs desired running after a simulated host reboot
//! (vmhostd and every QEMU SIGKILLed). Prints figures; asserts nothing about time.

use crate::{alive, percentile, HostOptions, TestHost};
use serde_json::json;
use std::time::{Duration, Instant};

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

/// `rounds` in-place changes of a running direct-kernel VM (memory 128 ↔ 192 MiB, the guest
/// powering off on the ACPI button): median, p90, min, max of `vm.apply`.
pub fn reconfigure(rounds: usize) {
    if rounds == 0 {
        return;
    }
    let host = TestHost::start(HostOptions::default());
    let mut spec = host.kernel_spec("change");
    host.call("vm.create", json!({ "spec": spec }));
    let booted = |host: &TestHost| host.wait_serial("change", crate::GUEST_READY, Duration::from_secs(120));
    assert!(booted(&host), "the guest did not boot");
    let mut took = Vec::new();
    for i in 0..rounds {
        spec["memory_mib"] = json!(if i % 2 == 0 { 192 } else { 128 });
        // The guest must be up to honour the power button; wait for its ready line of this boot.
        let seen = host.serial("change").matches(crate::GUEST_READY).count();
        let t = Instant::now();
        let r = host.call("vm.apply", json!({ "spec": spec, "timeout_s": 30 }));
        took.push(t.elapsed());
        assert_eq!(r["vm"]["status"], "running", "{r}");
        let deadline = Instant::now() + Duration::from_secs(120);
        while host.serial("change").matches(crate::GUEST_READY).count() <= seen {
            assert!(Instant::now() < deadline, "the guest did not boot again");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    took.sort();
    println!();
    println!("Reconfigure of a running VM (vm.apply, memory changed: ACPI power-off, start), {rounds} rounds");
    println!("| median (ms) | p90 (ms) | min (ms) | max (ms) |");
    println!("|---:|---:|---:|---:|");
    println!(
        "| {} | {} | {} | {} |",
        ms(percentile(&took, 0.5)),
        ms(percentile(&took, 0.9)),
        ms(took[0]),
        ms(took[took.len() - 1])
    );
}

/// `vms` VMs desired running, vmhostd and every QEMU SIGKILLed, vmhostd started again: the time
/// from its start until every VM is `running` again (QEMU up and answering QMP), for each
/// `lifecycle.start_concurrency` in `concurrencies` (0: the CPU count).
pub fn autostart(vms: usize, concurrencies: &[u32]) {
    if vms == 0 {
        return;
    }
    println!();
    println!("Autostart of {vms} VMs desired running after a simulated host reboot");
    println!("| start_concurrency | all running after (s) |");
    println!("|---|---:|");
    for &n in concurrencies {
        let extra = format!("[lifecycle]\nstart_concurrency = {n}\n");
        let mut host = TestHost::start(HostOptions { cpu: 64, memory_gib: 64, extra, ..HostOptions::default() });
        for i in 0..vms {
            let mut spec = host.kernel_spec(&format!("auto{i:02}"));
            spec["memory_mib"] = json!(128);
            host.call("vm.create", json!({ "spec": spec }));
        }
        let pids = host.qemu_pids();
        host.kill_daemon();
        for pid in &pids {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL);
        }
        while pids.iter().any(|p| alive(*p)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let t = Instant::now();
        host.spawn_daemon();
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let list = host.call("vm.list", json!({}));
            let running = list.as_array().map_or(0, |l| l.iter().filter(|v| v["status"] == "running").count());
            if running == vms {
                break;
            }
            assert!(Instant::now() < deadline, "autostart did not bring every VM back");
            std::thread::sleep(Duration::from_millis(50));
        }
        let label = if n == 0 {
            format!("0 (CPU count, {})", std::thread::available_parallelism().map_or(1, usize::from))
        } else {
            n.to_string()
        };
        println!("| {label} | {:.2} |", t.elapsed().as_secs_f64());
        for i in 0..vms {
            host.call("vm.destroy", json!({ "name": format!("auto{i:02}") }));
        }
    }
}
