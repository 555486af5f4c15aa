//! Placement on a real host (docs/lifecycle.md, "Placement"): a dedicated VM's vCPU thread on
//! its own CPU and QEMU's other threads on the housekeeping CPUs, capacity refusals, the
//! record surviving a `kill -9` of vmhostd, a pin changed behind the daemon's back repaired at
//! its restart, CPUs given back at stop; hugepages taken from the kernel's pool while a VM runs.
//!
//! This machine has CPUs 0-1 and one NUMA node: `vm_cpus = "1"` leaves CPU 0 as housekeeping.
//! What the test reads is the kernel's view: `Cpus_allowed_list` in /proc/QEMU/task/TID/status,
//! vCPU threads by their names (`CPU 0/TCG`, QEMU's `debug-threads=on`).

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;
use vmhost_tests::{wait, HostOptions, TestHost};

/// One TestHost at a time: both tests boot TCG guests on a two-CPU machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const BOUND: Duration = Duration::from_secs(300);

fn host(extra: &str) -> TestHost {
    let extra = format!("{extra}\n[lifecycle]\nautostart = false\n");
    TestHost::start(HostOptions { extra, ..HostOptions::default() })
}

fn spec(host: &TestHost, name: &str, policy: &str) -> Value {
    let mut s = host.kernel_spec(name);
    s["memory_mib"] = json!(64);
    if policy != "shared" {
        s["cpu_policy"] = json!(policy);
    }
    s
}

fn view(host: &TestHost, name: &str) -> Value {
    host.call("vm.get", json!({ "name": name }))
}

fn pid_of(host: &TestHost, name: &str) -> i32 {
    let v = view(host, name);
    v["pid"].as_i64().unwrap_or_else(|| panic!("{name} has no pid: {v}")) as i32
}

/// Each thread of `pid`: its name and its `Cpus_allowed_list`.
fn threads(pid: i32) -> BTreeMap<i32, (String, String)> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return out };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else { continue };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default().trim().to_string();
        let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
        let Some(list) = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")) else { continue };
        out.insert(tid, (comm, list.trim().to_string()));
    }
    out
}

/// Waits until QEMU `pid`'s vCPU threads are all on `vcpus` and every other thread on `others`;
/// panics naming the threads as last seen.
fn wait_pins(pid: i32, vcpus: &str, others: &str) {
    let r = wait::poll(BOUND, || {
        let t = threads(pid);
        let vcpu_threads = t.values().filter(|(n, _)| n.starts_with("CPU ")).count();
        let ok =
            vcpu_threads > 0 && t.values().all(|(n, l)| if n.starts_with("CPU ") { l == vcpus } else { l == others });
        if ok {
            Ok(())
        } else {
            Err(format!("{t:?}"))
        }
    });
    if let Err(e) = r {
        panic!("QEMU {pid}: vCPUs not on {vcpus} / others not on {others}: {e}");
    }
}

fn set_affinity(tid: i32, cpus: &[usize]) {
    let mut set = nix::sched::CpuSet::new();
    for c in cpus {
        set.set(*c).unwrap();
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid), &set).expect("sched_setaffinity");
}

#[test]
fn dedicated_vcpus_get_their_cpu_and_keep_it_across_restarts() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = host("vm_cpus = \"1\"");
    // The daemon keeps CAP_SYS_NICE with vm_cpus configured (it pins another user's threads).
    let r = host.call("vm.create", json!({ "spec": spec(&host, "ded", "dedicated") }));
    assert_eq!(r["vm"]["status"], "running", "{r}");
    let qemu = pid_of(&host, "ded");
    wait_pins(qemu, "1", "0");
    let p = &view(&host, "ded")["placement"];
    assert_eq!(
        (p["policy"].clone(), p["cpus"].clone(), p["vcpus"].clone()),
        (json!("dedicated"), json!("1"), json!([1])),
        "{p}"
    );
    assert_eq!(p["emulator"], "0", "{p}");

    // No CPU left for a second dedicated VM: 3002, and nothing of it stays running.
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec(&host, "ded2", "dedicated") }));
    assert_eq!(code, 3002, "{e:?}");
    assert_eq!(
        threads(qemu).values().filter(|(_, l)| l == "1").count(),
        threads(qemu).values().filter(|(n, _)| n.starts_with("CPU ")).count()
    );

    // A shared VM while the shared pool is empty (CPU 1 is dedicated, CPU 0 housekeeping): the
    // allocator refuses it (3002, `shared_cpus`) rather than run it on a dedicated CPU.
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec(&host, "sh", "shared") }));
    assert_eq!((code, e.details["resource"].clone()), (3002, json!("shared_cpus")), "{e:?}");

    // kill -9 of vmhostd: the QEMU runs on with its pins, and the restarted daemon shows them.
    host.kill_daemon();
    host.spawn_daemon();
    assert_eq!(pid_of(&host, "ded"), qemu);
    wait_pins(qemu, "1", "0");
    assert_eq!(view(&host, "ded")["placement"]["vcpus"], json!([1]));

    // A pin changed behind the daemon's back is repaired at its next start.
    let vcpu = threads(qemu).into_iter().find(|(_, (n, _))| n.starts_with("CPU ")).map(|(t, _)| t).unwrap();
    host.stop_daemon();
    set_affinity(vcpu, &[0, 1]);
    assert_eq!(threads(qemu)[&vcpu].1, "0-1");
    host.spawn_daemon();
    wait_pins(qemu, "1", "0");
    let log = vmhost_tests::plain_log(&host.daemon_log());
    assert!(log.contains("re-pinning"), "the repair is logged");

    // Stop gives CPU 1 back: another dedicated VM gets it.
    host.call("vm.stop", json!({ "name": "ded", "force": true }));
    assert!(view(&host, "ded")["placement"].is_null(), "a stopped VM holds no placement");
    // A start killed right after its placement was recorded: the restart finds no QEMU and
    // releases it, so CPU 1 is free again.
    host.crash_during("placement:recorded", "vm.create", json!({ "spec": spec(&host, "ded3", "dedicated") }));
    let v = view(&host, "ded3");
    assert_eq!((v["status"].clone(), v["placement"].clone()), (json!("failed"), Value::Null), "{v}");
    let r = host.call("vm.start", json!({ "name": "ded3" }));
    assert_eq!(r["vm"]["placement"]["vcpus"], json!([1]), "{r}");
    wait_pins(pid_of(&host, "ded3"), "1", "0");
    for vm in ["ded3", "ded"] {
        host.call("vm.destroy", json!({ "name": vm }));
    }
}

/// Every thread of `pid` on `cpus`; panics naming them as last seen.
fn wait_all_on(pid: i32, cpus: &str) {
    let r = wait::poll(BOUND, || {
        let t = threads(pid);
        if !t.is_empty() && t.values().all(|(_, l)| l == cpus) {
            Ok(())
        } else {
            Err(format!("{t:?}"))
        }
    });
    if let Err(e) = r {
        panic!("QEMU {pid}: not every thread on {cpus}: {e}");
    }
}

/// With no housekeeping CPU (`vm_cpus` = every CPU), a running shared VM floats over the shared
/// pool, and is moved as dedicated VMs take CPUs from it and give them back.
#[test]
fn shared_vms_follow_the_shared_pool() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let host = host("vm_cpus = \"0-1\"");
    host.call("vm.create", json!({ "spec": spec(&host, "sh", "shared") }));
    let shared = pid_of(&host, "sh");
    wait_all_on(shared, "0-1");
    assert_eq!(view(&host, "sh")["placement"]["cpus"], "0-1");
    // A dedicated VM takes CPU 0: the shared VM moves to CPU 1, record and threads.
    let r = host.call("vm.create", json!({ "spec": spec(&host, "ded", "dedicated") }));
    assert_eq!(r["vm"]["placement"]["vcpus"], json!([0]), "{r}");
    wait_all_on(shared, "1");
    assert_eq!(view(&host, "sh")["placement"]["cpus"], "1");
    let vcpu_ok = threads(pid_of(&host, "ded")).values().filter(|(n, _)| n.starts_with("CPU ")).all(|(_, l)| l == "0");
    assert!(vcpu_ok, "the dedicated vCPU on CPU 0");
    // The last shared CPU is not given to a dedicated VM while a shared VM runs.
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec(&host, "ded2", "dedicated") }));
    assert_eq!((code, e.details["resource"].clone()), (3002, json!("shared_cpus")), "{e:?}");
    // Destroyed, its CPU goes back to the pool, and the shared VM with it.
    host.call("vm.destroy", json!({ "name": "ded" }));
    wait_all_on(shared, "0-1");
    assert_eq!(view(&host, "sh")["placement"]["cpus"], "0-1");
    host.call("vm.destroy", json!({ "name": "sh" }));
}

/// The 2 MiB pool's `(total, free)` pages, system-wide.
fn hugepages() -> (u64, u64) {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let field = |key: &str| {
        meminfo.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(0)
    };
    (field("HugePages_Total:"), field("HugePages_Free:"))
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// Puts the kernel's pool back when the test ends, however it ends.
struct RestorePool(String);

impl Drop for RestorePool {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, &self.0);
    }
}

#[test]
fn hugepages_back_a_vm_while_it_runs() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let before = std::fs::read_to_string(NR_HUGEPAGES).unwrap();
    let _restore = RestorePool(before.trim().to_string());
    let _ = std::fs::write(NR_HUGEPAGES, "64");
    let (total, free0) = hugepages();
    if total < 64 || free0 < 32 {
        println!("SKIPPED: the kernel gave {total} hugepages of 2 MiB ({free0} free), the test needs 64 with 32 free");
        return;
    }
    let host = host("");
    let mut s = spec(&host, "huge", "shared");
    s["hugepages"] = json!("2M");
    let r = host.call("vm.create", json!({ "spec": s }));
    assert_eq!(r["vm"]["status"], "running", "{r}");
    assert_eq!(r["vm"]["placement"]["hugepages"], "2M", "{r}");
    // 64 MiB in 2 MiB pages, taken at start (prealloc).
    assert_eq!(hugepages().1, free0 - 32, "HugePages_Free while it runs");
    // A second one asking more than is free (64 pages for 128 MiB, 32 free).
    let mut big = spec(&host, "huge2", "shared");
    big["hugepages"] = json!("2M");
    big["memory_mib"] = json!(128);
    let (code, e) = host.call_err("vm.create", json!({ "spec": big }));
    assert_eq!(code, 3002, "{e:?}");
    assert_eq!(e.details["resource"], "hugepages", "{e:?}");
    host.call("vm.stop", json!({ "name": "huge", "force": true }));
    wait::poll(BOUND, || if hugepages().1 == free0 { Ok(()) } else { Err(format!("{:?}", hugepages())) })
        .expect("the pages come back after stop");
    host.call("vm.destroy", json!({ "name": "huge" }));
}
