//! A hostile guest cannot fill the state file system through its logs (`logs.max_bytes`,
//! daemon/src/logcap.rs): real vmhostd, a real TCG guest printing to its console in a loop.

use serde_json::json;
use std::path::Path;
use std::time::{Duration, Instant};
use vmhost_tests::{HostOptions, TestHost};

/// The cap set for the test: 256 KiB per log.
const CAP: u64 = 256 * 1024;
/// Bytes per console line of tests/guest/hostile/flood-console.sh.
const LINE: u64 = 121;

/// The test guest whose "agent" prints numbered lines to the console forever.
fn flood_guest() -> vmhost_tests::Guest {
    vmhost_tests::hostile_guest("flood-console.sh", "initramfs-flood.cpio.gz")
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// The number of the newest complete `FLOOD` line in the serial log: how many lines the guest
/// has written in all, whatever was trimmed.
fn newest_line(host: &TestHost, name: &str) -> u64 {
    let text = host.serial(name);
    text.lines()
        .rev()
        // Only whole numbers: a line cut by the kill of QEMU ("FLOOD 0000935" of 00009351)
        // would read as a far older line.
        .filter_map(|l| l.strip_prefix("FLOOD ")?.split(' ').next().filter(|n| n.len() == 8)?.parse().ok())
        .find(|n: &u64| *n > 0)
        .unwrap_or(0)
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_guest_flooding_its_console_leaves_a_log_no_larger_than_the_cap() {
    let host = TestHost::start(HostOptions { extra: format!("[logs]\nmax_bytes = {CAP}\n"), ..HostOptions::default() });
    let g = flood_guest();
    let spec = json!({"name": "flood", "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}});
    host.call("vm.create", json!({ "spec": spec }));
    let log = host.state().join("logs/flood.serial.log");

    // The guest writes four times the cap in all.
    let enough = 4 * CAP / LINE;
    let mut largest = 0;
    wait_for("the guest never wrote four times the cap", Duration::from_secs(300), || {
        largest = largest.max(size(&log));
        newest_line(&host, "flood") > enough
    });
    let written = newest_line(&host, "flood") * LINE;
    eprintln!("the guest wrote {written} bytes; the log was at most {largest} bytes when sampled");

    // While it keeps writing, the log comes back under the cap, and what it holds is readable:
    // the newest lines, later than the ones seen above.
    let seen = newest_line(&host, "flood");
    wait_for("the log never came back under the cap", Duration::from_secs(60), || {
        size(&log) <= CAP && newest_line(&host, "flood") > seen
    });

    // Other VMs' records still write: a second VM is created, runs and stops.
    host.call("vm.create", json!({ "spec": host.kernel_spec("other") }));
    host.wait_status("other", "running", Duration::from_secs(60));
    host.call("vm.stop", json!({ "name": "other", "force": true }));
    host.wait_status("other", "stopped", Duration::from_secs(60));

    // The flooding VM stopped: what it leaves is no larger than the cap and ends with its newest
    // lines; reading it still works (vm.get's serial_log names it).
    host.call("vm.stop", json!({ "name": "flood", "force": true }));
    host.wait_status("flood", "stopped", Duration::from_secs(60));
    wait_for("the stopped VM's log stayed over the cap", Duration::from_secs(30), || size(&log) <= CAP);
    let last = newest_line(&host, "flood");
    assert!(last * LINE > 4 * CAP, "the log ends with the newest lines: {last}");
    let v = host.call("vm.get", json!({ "name": "flood" }));
    assert_eq!(v["serial_log"], json!(log));
    let daemon_log = vmhost_tests::plain_log(&host.daemon_log());
    assert!(daemon_log.contains("log over logs.max_bytes trimmed"), "{daemon_log}");
}
