//! vmhost-bench's capture figures (issue 31, docs/performance.md "Capture NICs"): frames per
//! second a monitored source delivers into one and into four monitoring guests.
//!
//! Setup: a vmhostd in a network namespace of its own with IPv6 off (a quiet wire), a veth pair
//! `bsrc0`/`bpeer0` with `bsrc0` as the capture interface, and N test guests with the agent,
//! each with one monitor NIC on `bsrc0` (`direction: "ingress"`) made promiscuous. A sender
//! thread writes minimal frames ([`crate::frames`], 60 bytes before the FCS, random locally
//! administered MACs) into `bpeer0` for a fixed number of seconds as fast as its packet socket
//! takes them; every frame `bsrc0` receives is mirrored by the kernel into each tap. Delivered =
//! the sum of the guests' `rx_packets` deltas (read through `vm.exec` once the taps have
//! accounted for every frame and the guests' counters stopped moving); the taps' `tx_dropped`
//! is what the kernel dropped because QEMU did not read fast enough. A row without guests is the
//! sender alone (no mirror). Prints figures; asserts nothing about speed.

use crate::frames::{self, Counters, Rng, Sender};
use crate::{agent_guest, wait, HostOptions, TestHost, GUEST_READY};
use serde_json::{json, Value};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const SRC: &str = "bsrc0";
const PEER: &str = "bpeer0";

/// A failure bound for TCG boots of several guests on a shared 2-core machine.
const BOOT: Duration = Duration::from_secs(900);

/// One row of the table.
struct Row {
    guests: usize,
    secs: f64,
    sent: u64,
    delivered: u64,
    tap_dropped: u64,
    per_guest: Vec<u64>,
}

fn ns(host: &TestHost) -> &str {
    host.netns.as_deref().unwrap_or_default()
}

fn exec(host: &TestHost, vm: &str, argv: &[&str]) -> Value {
    host.client()
        .call::<Value>("vm.exec", json!({"name": vm, "argv": argv}))
        .unwrap_or_else(|e| json!({"error": e.to_string()}))
}

fn guest_rx(host: &TestHost, vm: &str) -> u64 {
    let argv = frames::counters_argv("eth0");
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let r = exec(host, vm, &argv);
    frames::parse_counters(r["stdout"].as_str().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{vm}'s counters: {e} ({r})"))
        .rx_packets
}

fn tap_counters(host: &TestHost, tap: &str) -> Counters {
    frames::counters(Some(ns(host)), tap).unwrap_or_else(|e| panic!("{tap}: {e}"))
}

/// Boots `n` monitoring guests named `capN-I` and returns (name, tap) of each, promiscuous and
/// with a probe frame seen by every one.
fn boot_guests(host: &TestHost, n: usize) -> Vec<(String, String)> {
    let g = agent_guest();
    let mut vms = Vec::new();
    for i in 0..n {
        let name = format!("cap{n}-{i}");
        let spec = json!({"name": name, "cpu": 1, "memory_mib": 256,
            "nics": [{"mode": "monitor", "source": SRC, "direction": "ingress"}],
            "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}});
        let r = host.call("vm.create", json!({ "spec": spec }));
        vms.push((name, r["vm"]["nics"][0]["tap"].as_str().unwrap_or_default().to_string()));
    }
    for (name, _) in &vms {
        assert!(host.wait_serial(name, GUEST_READY, BOOT), "{name}:\n{}", host.serial(name));
        wait::until(&format!("{name}'s exec server"), BOOT, || match exec(host, name, &["true"]) {
            v if v["exit_code"] == 0 => Ok(()),
            other => Err(other.to_string()),
        });
        // The agent makes a capture NIC up and promiscuous (the daemon's net.apply).
        wait::until(&format!("{name}'s eth0 promiscuous"), Duration::from_secs(120), || {
            let flags = exec(host, name, &["cat", "/sys/class/net/eth0/flags"]);
            let text = flags["stdout"].as_str().unwrap_or_default().trim().to_string();
            match u32::from_str_radix(text.trim_start_matches("0x"), 16) {
                Ok(bits) if bits & 0x101 == 0x101 => Ok(()),
                _ => Err(text),
            }
        });
    }
    let mut rng = Rng::new();
    let sender = Sender::open(Some(ns(host)), PEER).expect("a sender on the peer");
    for (name, _) in &vms {
        let before = guest_rx(host, name);
        wait::until(&format!("a probe frame in {name}"), Duration::from_secs(120), || {
            sender.send_all(&frames::random_frames(&mut rng, 1, &[])).map_err(|e| e.to_string())?;
            if guest_rx(host, name) > before {
                Ok(())
            } else {
                Err("nothing yet".into())
            }
        });
    }
    vms
}

/// Sends for `secs` seconds and measures what reached `vms`.
fn measure(host: &TestHost, vms: &[(String, String)], secs: u64, payload: usize) -> Row {
    let rx0: Vec<u64> = vms.iter().map(|(n, _)| guest_rx(host, n)).collect();
    let tap0: Vec<Counters> = vms.iter().map(|(_, t)| tap_counters(host, t)).collect();
    let mut rng = Rng::new();
    // 1024 distinct frames sent round robin: no building in the timed loop.
    let batch: Vec<Vec<u8>> = (0..1024)
        .map(|_| frames::frame(frames::random_mac(&mut rng), frames::random_mac(&mut rng), None, payload))
        .collect();
    let sender = Sender::open(Some(ns(host)), PEER).expect("a sender on the peer");
    let stop = AtomicBool::new(false);
    let (sent, took) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let t = Instant::now();
            let mut sent = 0u64;
            // The flag is looked at once per 1024 frames (well under a millisecond of sending).
            while !stop.load(Ordering::Relaxed) {
                for f in &batch {
                    if sender.send(f).is_ok() {
                        sent += 1;
                    }
                }
            }
            (sent, t.elapsed())
        });
        std::thread::sleep(Duration::from_secs(secs));
        stop.store(true, Ordering::Relaxed);
        h.join().expect("the sender thread")
    });
    // Every frame is either read by QEMU (tx_packets) or dropped (tx_dropped) at each tap; then
    // the guests' counters stop moving once QEMU handed the last ones over.
    for (i, (_, tap)) in vms.iter().enumerate() {
        let _ = wait::poll(Duration::from_secs(120), || {
            let c = tap_counters(host, tap);
            let seen = (c.tx_packets - tap0[i].tx_packets) + (c.tx_dropped - tap0[i].tx_dropped);
            if seen >= sent {
                Ok(())
            } else {
                Err(format!("{seen} of {sent}"))
            }
        });
    }
    let per_guest: Vec<u64> = vms
        .iter()
        .enumerate()
        .map(|(i, (name, tap))| {
            let read = tap_counters(host, tap).tx_packets - tap0[i].tx_packets;
            let got = wait::poll(Duration::from_secs(120), || {
                let d = guest_rx(host, name) - rx0[i];
                if d >= read {
                    Ok(d)
                } else {
                    Err(format!("{d}"))
                }
            });
            got.unwrap_or_else(|last| last.parse().unwrap_or(0))
        })
        .collect();
    let tap_dropped =
        vms.iter().enumerate().map(|(i, (_, t))| tap_counters(host, t).tx_dropped - tap0[i].tx_dropped).sum();
    Row { guests: vms.len(), secs: took.as_secs_f64(), sent, delivered: per_guest.iter().sum(), tap_dropped, per_guest }
}

/// The machine's facts for the figures: CPU model and count, kernel, load average.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string());
    let cpus = cpuinfo.lines().filter(|l| l.starts_with("processor")).count();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    format!(
        "{cpus} x {}, kernel {}, load average {}",
        model.unwrap_or_else(|| "?".into()),
        kernel.trim(),
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    )
}

/// Frames per second into 0 (the sender alone), 1 and 4 monitoring guests (`counts`), `secs`
/// seconds of sending each, frames of `14 + payload` bytes. Prints the table.
pub fn capture(secs: u64, counts: &[usize], payload: usize) {
    if secs == 0 || counts.is_empty() {
        return;
    }
    let cpu = counts.iter().sum::<usize>() as u32 + 2;
    let host = TestHost::start(HostOptions {
        cpu: cpu.max(8),
        netns: true,
        extra: format!("[agent]\nallow_exec = true\n[capture]\ninterfaces = [{SRC:?}]\n"),
        ..HostOptions::default()
    });
    let ns = ns(&host).to_string();
    let sh = |args: &[&str]| {
        let st = Command::new("ip").args(args).status().expect("run ip");
        assert!(st.success(), "ip {args:?}");
    };
    sh(&[
        "netns",
        "exec",
        &ns,
        "sysctl",
        "-qw",
        "net.ipv6.conf.all.disable_ipv6=1",
        "net.ipv6.conf.default.disable_ipv6=1",
    ]);
    sh(&["-n", &ns, "link", "add", SRC, "type", "veth", "peer", "name", PEER]);
    sh(&["-n", &ns, "link", "set", SRC, "up"]);
    sh(&["-n", &ns, "link", "set", PEER, "up"]);
    println!();
    println!("capture: frames into monitoring guests, {secs} s of sending per row, {} byte frames", 14 + payload);
    let mut rows = Vec::new();
    for &n in counts {
        let vms = if n == 0 { Vec::new() } else { boot_guests(&host, n) };
        let row = measure(&host, &vms, secs, payload);
        println!("  ({} guests: {})", row.guests, machine());
        rows.push(row);
        for (name, _) in &vms {
            host.call("vm.destroy", json!({ "name": name }));
        }
    }
    println!("| monitoring guests | sent (frames/s) | delivered per guest (frames/s) | delivered, all guests (frames/s) | share of sent per guest | tap tx_dropped (all taps) |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let per: Vec<String> = r.per_guest.iter().map(|d| format!("{:.0}", *d as f64 / r.secs)).collect();
        let share = if r.guests == 0 || r.sent == 0 {
            "-".to_string()
        } else {
            format!("{:.1} %", r.delivered as f64 / r.guests as f64 / r.sent as f64 * 100.0)
        };
        println!(
            "| {} | {:.0} | {} | {:.0} | {share} | {} |",
            r.guests,
            r.sent as f64 / r.secs,
            if per.is_empty() { "-".to_string() } else { per.join(" / ") },
            r.delivered as f64 / r.secs,
            r.tap_dropped
        );
    }
}
