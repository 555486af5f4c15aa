//! A hostile guest cannot fill the state file system through its logs (`logs.max_bytes`,
//! daemon/src/logcap.rs): real vmhostd, a real TCG guest printing to its console in a loop.
//!
//! Every assertion is about what the daemon or the guest did, never about how much the guest
//! managed to write in some time: the guest's lines are numbered, so the log tells how far it
//! got, and the daemon logs each trim with the size it left.

use serde_json::json;
use std::path::Path;
use std::time::Duration;
use vmhost_tests::{wait, HostOptions, TestHost};

/// The cap set for the test: 256 KiB per log.
const CAP: u64 = 256 * 1024;
/// Bytes per console line of tests/guest/hostile/flood-console.sh as the log holds it: 117
/// printed and the newline, which the guest's serial tty turns into "\r\n".
const LINE: u64 = 119;
/// A failure bound for the guest's writing, not an expected speed (TCG under load is slow).
const PATIENCE: Duration = Duration::from_secs(600);

/// The test guest whose "agent" prints numbered lines to the console forever.
fn flood_guest() -> vmhost_tests::Guest {
    vmhost_tests::hostile_guest("flood-console.sh", "initramfs-flood.cpio.gz")
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// The numbers of the complete `FLOOD` lines of `text`, oldest first. Complete means ended by
/// its "\r\n" and exactly as the guest prints it: a line cut by the kill of QEMU
/// ("FLOOD 00009" of 00009351) or by a trim (the log's first line) is not one, and would read
/// as a far older line.
fn flood_lines(text: &str) -> Vec<u64> {
    text.split_inclusive('\n')
        .filter_map(|l| {
            let rest = l.strip_suffix("\r\n")?.strip_prefix("FLOOD ")?;
            let (number, pad) = rest.split_once(' ')?;
            let whole = number.len() == 8 && (l.len() as u64) == LINE && pad.bytes().all(|b| b == b'x');
            whole.then(|| number.parse().ok()).flatten()
        })
        .collect()
}

/// The number of the newest complete `FLOOD` line in the serial log: how many lines the guest
/// has written in all, whatever was trimmed.
fn newest_line(host: &TestHost, name: &str) -> u64 {
    flood_lines(&host.serial(name)).last().copied().unwrap_or(0)
}

/// The sizes the daemon left `flood.serial.log` at, one per trim it logged (`after=`).
fn trims(host: &TestHost) -> Vec<u64> {
    vmhost_tests::plain_log(&host.daemon_log())
        .lines()
        .filter(|l| l.contains("flood.serial.log") && l.contains("trimmed"))
        .filter_map(|l| l.split_once(" after=")?.1.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .collect()
}

#[test]
fn only_complete_lines_count() {
    let line = |n: u64| format!("FLOOD {n:08} {}\r\n", "x".repeat(102));
    assert_eq!(line(1).len() as u64, LINE);
    // The issue-28 failure: the kill of QEMU cut the last line after "FLOOD 00009" (of line
    // 9xxx), which the first parser read as line 9.
    let text = format!("OD 00009349 xxx\r\n{}{}FLOOD 00009", line(9350), line(9351));
    assert_eq!(flood_lines(&text), vec![9350, 9351]);
    assert_eq!(flood_lines(&format!("{}FLOOD 0000935", line(9351))), vec![9351]);
    assert_eq!(flood_lines(&format!("{}FLOOD 00009352 xx", line(9351))), vec![9351]);
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
    wait::until("the guest to write four times the cap", PATIENCE, || {
        largest = largest.max(size(&log));
        let newest = newest_line(&host, "flood");
        if newest > enough {
            Ok(())
        } else {
            Err(format!("newest line {newest}, log {} bytes", size(&log)))
        }
    });
    let seen = newest_line(&host, "flood");
    eprintln!("the guest wrote {} bytes; the log was at most {largest} bytes when sampled", seen * LINE);

    // While it keeps writing, the daemon trims its log, and every trim leaves it under the cap.
    let before = trims(&host).len();
    wait::until("a trim of the log after the guest wrote four times the cap", PATIENCE, || {
        let t = trims(&host);
        if t.len() > before {
            Ok(())
        } else {
            Err(format!("{} trims logged: {t:?}; log {} bytes", t.len(), size(&log)))
        }
    });
    let t = trims(&host);
    assert!(t.iter().all(|after| *after <= CAP), "a trim left the log over the cap: {t:?}");

    // Other VMs' records still write: a second VM is created, runs and stops.
    host.call("vm.create", json!({ "spec": host.kernel_spec("other") }));
    host.wait_status("other", "running", Duration::from_secs(120));
    host.call("vm.stop", json!({ "name": "other", "force": true }));
    host.wait_status("other", "stopped", Duration::from_secs(120));

    // The flooding VM stopped: what it leaves is no larger than the cap, holds the guest's
    // lines in order with none missing between the trims, and ends with lines at least as new
    // as the newest seen while it ran; reading it still works (vm.get's serial_log names it).
    let seen = newest_line(&host, "flood");
    host.call("vm.stop", json!({ "name": "flood", "force": true }));
    host.wait_status("flood", "stopped", Duration::from_secs(120));
    wait::until_true(
        "the stopped VM's log to be trimmed under the cap",
        PATIENCE,
        || size(&log) <= CAP,
        || format!("{} bytes", size(&log)),
    );
    let text = host.serial("flood");
    let lines = flood_lines(&text);
    let (first, last) = (lines.first().copied().unwrap_or(0), lines.last().copied().unwrap_or(0));
    assert!(last >= seen, "the log ends with the newest lines: {last}, but {seen} was seen before the stop");
    assert!(lines.windows(2).all(|w| w[0] < w[1]), "the kept lines are in order");
    // A line the kernel's own console messages broke in two is not complete; any other gap is
    // output lost.
    let missing = (last - first + 1) - lines.len() as u64;
    let broken = text.split_inclusive('\n').filter(|l| l.ends_with('\n') && flood_lines(l).is_empty()).count() as u64;
    assert!(missing <= broken, "{missing} lines between {first} and {last} are missing, {broken} broken");
    let v = host.call("vm.get", json!({ "name": "flood" }));
    assert_eq!(v["serial_log"], json!(log));
    let daemon_log = vmhost_tests::plain_log(&host.daemon_log());
    assert!(daemon_log.contains("log over logs.max_bytes trimmed"), "{daemon_log}");
}
