//! `vm.stats`, `host.stats`, `vmhostctl stats --prometheus` and `vmhostctl top` end to end
//! (docs/metrics.md): a real vmhostd in its own network namespace, real TCG guests.
//!
//! Two guests: `disk`, a boot sector that writes its disk through the BIOS in a loop and never
//! idles (tests/src/boot_sector.rs), and `net`, the test guest pinging the host's bridge over
//! its NIC. Each figure must rise from a sample taken before the guest could have moved it.

use serde_json::{json, Value};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;
use vmhost_tests::{boot_sector, workspace, HostOptions, TestHost, LAN_NETWORK};

const BOOT: Duration = Duration::from_secs(90);

fn vm<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["vms"].as_array().and_then(|vms| vms.iter().find(|v| v["name"] == name)).unwrap_or(&Value::Null)
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(-1.0)
}

/// Polls `vm.stats` until `ok` holds for the report, and returns that report.
fn wait_stats(host: &TestHost, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    vmhost_tests::wait::until(what, BOOT, || {
        let r = host.call("vm.stats", json!({}));
        if ok(&r) {
            Ok(r)
        } else {
            Err(format!("{r:#}"))
        }
    })
}

fn start_host() -> TestHost {
    let host = TestHost::start(HostOptions { netns: true, extra: LAN_NETWORK.into(), ..HostOptions::default() });
    boot_sector::write_image(&host.images().join("writer.raw"), boot_sector::WRITE_LOOP);
    let disk = json!({"name": "disk", "cpu": 1, "memory_mib": 32, "boot": {"image": "writer.raw", "disk_gib": 1}});
    host.call("vm.create", json!({ "spec": disk }));
    let mut net = host.kernel_spec("net");
    net["nics"] = json!([{ "network": "lan", "ipv4": { "mode": "static", "address": "10.0.0.5/24" } }]);
    net["boot"]["cmdline"] = json!("console=ttyS0 panic=-1 quiet vmhost.ping=10.0.0.1");
    host.call("vm.create", json!({ "spec": net }));
    host
}

#[test]
fn cpu_disk_and_network_counters_rise_with_what_the_guests_do() {
    let host = start_host();
    // Before either guest has run much: the test guest needs seconds to load its NIC driver.
    let before = host.call("vm.stats", json!({}));
    let (d0, n0) = (vm(&before, "disk").clone(), vm(&before, "net").clone());
    assert!(before["timestamp_ms"].as_u64().unwrap_or(0) > 0 && before["time"].is_string(), "{before:#}");
    assert_eq!(d0["status"], "running", "{before:#}");
    assert_eq!(d0["disks"][0]["device"], "virtio0", "{d0:#}");
    assert_eq!(d0["vcpus"].as_array().map(Vec::len), Some(1), "{d0:#}");
    assert!(d0["disks_sampled_ms"].as_u64().is_some_and(|ms| ms > 0), "{before:#}");
    assert!(d0["vcpus"][0]["thread_id"].as_i64().unwrap_or(0) > 0, "{d0:#}");
    assert!(num(&d0["rss_bytes"]) > 0.0 && num(&d0["uptime_s"]) >= 0.0, "{d0:#}");
    assert_eq!((d0["memory_bytes"].clone(), d0["missing"].clone()), (json!(32 << 20), json!({})), "{d0:#}");
    assert_eq!(n0["nics"][0]["tap"], host.call("vm.get", json!({"name": "net"}))["nics"][0]["tap"], "{n0:#}");

    // The writer burns CPU and writes its disk.
    let w0 = num(&d0["disks"][0]["write_bytes"]);
    let r = wait_stats(&host, "the writer's CPU time and written bytes rise", |r| {
        let d = vm(r, "disk");
        num(&d["cpu_seconds"]) > num(&d0["cpu_seconds"]) + 0.5
            && num(&d["vcpus"][0]["cpu_seconds"]) > num(&d0["vcpus"][0]["cpu_seconds"]) + 0.5
            && num(&d["disks"][0]["write_bytes"]) > w0
            && num(&d["disks"][0]["write_ops"]) > num(&d0["disks"][0]["write_ops"])
    });
    assert!(vm(&r, "disk")["disks"][0]["write_bytes"].as_u64().unwrap_or(1).is_multiple_of(512), "{r:#}");

    // The pinger's packets both ways, once it says its ping was answered.
    assert!(host.wait_serial("net", "VMHOST-PING 10.0.0.1 ok", BOOT), "{}", host.serial("net"));
    wait_stats(&host, "the pinger's packets rise both ways", |r| {
        let n = &vm(r, "net")["nics"][0];
        num(&n["tx_packets"]) > num(&n0["nics"][0]["tx_packets"])
            && num(&n["rx_packets"]) > num(&n0["nics"][0]["rx_packets"])
            && num(&n["tx_bytes"]) > num(&n0["nics"][0]["tx_bytes"])
    });

    // One VM by name; an unknown one is 4040.
    let one = host.call("vm.stats", json!({"name": "net"}));
    assert_eq!(one["vms"].as_array().map(Vec::len), Some(1), "{one:#}");
    assert_eq!(host.call_err("vm.stats", json!({"name": "nosuch"})).0, 4040);

    // host.stats: the host's figures and the sum over both VMs.
    let h = host.call("host.stats", json!({}));
    assert_eq!(h["vms"]["running"], 2, "{h:#}");
    assert!(num(&h["vms"]["cpu_seconds"]) > num(&vm(&r, "disk")["cpu_seconds"]), "{h:#}");
    assert!(num(&h["cpu"]["count"]) >= 1.0 && num(&h["memory"]["total_bytes"]) > 0.0, "{h:#}");
    assert_eq!(h["missing"], json!({}), "{h:#}");
}

#[test]
fn a_vm_whose_monitor_does_not_answer_gets_its_other_figures_and_a_marker() {
    let host = start_host();
    let pid = host.call("vm.get", json!({"name": "disk"}))["pid"].as_i64().expect("pid") as i32;
    // A sample first, so what follows proves that a stale one is marked, not served.
    wait_stats(&host, "a first sample", |r| vm(r, "disk")["missing"] == json!({}));
    let frozen = nix::unistd::Pid::from_raw(pid);
    nix::sys::signal::kill(frozen, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let r = wait_stats(&host, "the frozen VM's sample marked stale", |r| vm(r, "disk")["missing"]["disks"].is_string());
    nix::sys::signal::kill(frozen, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    let d = vm(&r, "disk");
    assert!(d["missing"]["disks"].as_str().is_some_and(|m| m.contains("stats monitor")), "{r:#}");
    assert!(d["missing"]["vcpus"].is_string() && d["disks"] == json!([]), "{r:#}");
    assert!(num(&d["cpu_seconds"]) >= 0.0 && num(&d["rss_bytes"]) > 0.0, "{r:#}");
    let n = vm(&r, "net");
    assert_eq!((n["missing"].clone(), n["nics"].as_array().map(Vec::len)), (json!({}), Some(1)), "{r:#}");
    // Answered again once QEMU runs.
    wait_stats(&host, "the monitor answers again", |r| vm(r, "disk")["missing"] == json!({}));
    // A new QEMU of the same VM: its own figures through a new connection, counters from zero.
    let before = host.call("vm.stats", json!({"name": "disk"}));
    let r = host.call("vm.restart", json!({"name": "disk", "force": true}));
    let new_pid = r["vm"]["pid"].clone();
    assert_ne!(new_pid, json!(pid), "{r:#}");
    let after = wait_stats(&host, "the restarted VM's figures", |r| {
        let d = vm(r, "disk");
        d["pid"] == new_pid && d["missing"] == json!({}) && d["disks"].as_array().is_some_and(|a| !a.is_empty())
    });
    let d = vm(&after, "disk");
    assert!(num(&d["uptime_s"]) < num(&vm(&before, "disk")["uptime_s"]) + 1.0, "{after:#}");
    assert_ne!(d["vcpus"][0]["thread_id"], vm(&before, "disk")["vcpus"][0]["thread_id"], "{after:#}");
}

/// Parses `text` with prometheus_client's text parser (target/salt-venv, tests/setup.sh) and
/// returns `[sample name, labels, value]` of every sample.
fn parse_prometheus(text: &str) -> Vec<Value> {
    let python = workspace().join("target/salt-venv/bin/python");
    assert!(python.exists(), "{} not found: run tests/setup.sh first", python.display());
    let script = "import sys, json\n\
        from prometheus_client.parser import text_string_to_metric_families\n\
        out = [[s.name, s.labels, s.value] for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples]\n\
        print(json.dumps(out))\n";
    let mut child = Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write exposition");
    let out = child.wait_with_output().expect("python");
    assert!(
        out.status.success(),
        "the parser refused the exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("parser output")
}

#[test]
fn prometheus_output_parses_and_names_every_running_vm_and_top_shows_rates() {
    let host = start_host();
    let out = host.ctl(&["stats", "--prometheus"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("# TYPE vmhost_vm_cpu_seconds_total counter"), "{text}");
    let samples = parse_prometheus(&text);
    let running: Vec<String> = host
        .call("vm.list", json!({}))
        .as_array()
        .expect("list")
        .iter()
        .filter(|v| v["status"] == "running")
        .map(|v| v["name"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(running.len(), 2);
    for name in &running {
        for metric in ["vmhost_vm_cpu_seconds_total", "vmhost_vm_memory_rss_bytes", "vmhost_vm_up"] {
            assert!(
                samples.iter().any(|s| s[0] == metric && s[1]["vm"] == name.as_str()),
                "{metric} of {name} missing:\n{text}"
            );
        }
    }
    assert!(samples.iter().any(|s| s[0] == "vmhost_host_memory_total_bytes"), "{text}");
    assert!(
        samples.iter().any(|s| s[0] == "vmhost_vm_disk_write_bytes_total" && s[1]["device"] == "virtio0"),
        "{text}"
    );

    // top: two samples, one table, every VM with its CPU % and the writer's disk rate (disk
    // counters are sampled every 2 s, so the interval spans at least one new sample).
    let out = host.ctl(&["top", "--iterations", "1", "--interval", "3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(table.contains("CPU%") && table.contains("DISK_WR"), "{table}");
    let row = table.lines().find(|l| l.starts_with("disk ")).unwrap_or_else(|| panic!("no row for disk:\n{table}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert!(cells.get(2).and_then(|c| c.parse::<f64>().ok()).is_some_and(|p| p > 0.0), "{table}");
    assert!(cells.get(5).is_some_and(|c| *c != "-/s" && *c != "0B/s"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("net ")), "{table}");
}
