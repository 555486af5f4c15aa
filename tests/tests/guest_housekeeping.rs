//! Guest housekeeping end to end (issue 29): real vmhostd, real TCG guests running the real
//! static agent and its exec server (`vmhost-agent --exec`) over virtio-serial.
//!
//! One direct-kernel guest that ignores the ACPI power button (`vmhost.noacpi`) lives through
//! all of it: the spec's SSH keys land in it (no cloud-init: the exec server writes them), a
//! live `vm.apply` of `ssh` rewrites them, `vm.guest_info` shows its OS, its clock set to 2001 is
//! corrected by `vm.sync_time` and again after it was paused and resumed, and
//! `vm.stop {method: "agent"}` powers it off. A guest without
//! an exec server is stopped with `method: "agent"` too: through ACPI, at once.

use serde_json::{json, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use vmhost_tests::{agent_guest, guest, qmp_commands, wait, HostOptions, TestHost};

const BOOT: Duration = Duration::from_secs(300);

const KEY1: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA ops@house";
const KEY2: &str = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBEmKSENjQEezOmxkZMy7opKgwFB9nkt5YRrYMjNuG5N87uRgg6CLrbo5wAdT/y6v0mKV0U2w0WZ2YB/++Tpockg= second@house";

/// A daemon whose config allows `vm.exec` and file transfers: the test reads the guest through
/// them (housekeeping itself needs no `allow_exec`).
fn host() -> TestHost {
    TestHost::start(HostOptions { extra: "[agent]\nallow_exec = true\n".into(), ..HostOptions::default() })
}

fn spec(name: &str, initrd: &std::path::Path, cmdline: &str) -> Value {
    let kernel = guest().kernel;
    json!({"name": name, "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": kernel, "initrd": initrd, "cmdline": format!("console=ttyS0 panic=-1 quiet {cmdline}")}})
}

fn wait_agent(host: &TestHost, name: &str) {
    let connected = |v: &Value| v["agent"]["connected"] == true;
    let v = host.wait_vm(name, "to have its agent connected", BOOT, connected);
    assert!(connected(&v), "{}", host.serial(name));
}

/// Runs `argv` in the guest; its stdout (the command must succeed).
fn run(host: &TestHost, name: &str, argv: &[&str]) -> String {
    let r = host.call("vm.exec", json!({"name": name, "argv": argv, "timeout_s": 60}));
    assert_eq!(r["exit_code"], 0, "{argv:?}: {r}");
    r["stdout"].as_str().unwrap_or_default().to_string()
}

fn host_now_s() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The guest's clock in seconds since the epoch, read through the exec server.
fn guest_now_s(host: &TestHost, name: &str) -> i64 {
    run(host, name, &["date", "+%s"]).trim().parse().expect("date +%s")
}

#[test]
fn a_guest_gets_its_keys_its_clock_and_an_agent_power_off() {
    let host = host();
    let g = agent_guest();
    let mut s = spec("house", &g.initrd, "vmhost.noacpi");
    s["ssh"] = json!({"user": "ops", "keys": [KEY1]});
    host.call("vm.create", json!({ "spec": s }));
    wait_agent(&host, "house");
    let v = host.call("vm.get", json!({"name": "house"}));
    assert_eq!(v["spec"]["ssh"], json!({"user": "ops", "keys": [KEY1]}), "vm.get shows ssh");

    // 1. The keys land in a direct-kernel guest (no seed): the account is made, the file is
    // the keys, owned by the account, 0600 in a 0700 .ssh. The session callback writes them
    // once the agent is up; the exec server may come up a little later, so wait for the file.
    let keys = wait::until("the ssh keys in the guest", BOOT, || {
        let r = host.client().call::<Value>(
            "vm.exec",
            json!({"name": "house", "argv": ["cat", "/home/ops/.ssh/authorized_keys"], "timeout_s": 30}),
        );
        match r {
            Ok(r) if r["exit_code"] == 0 => Ok(r["stdout"].as_str().unwrap_or_default().to_string()),
            Ok(r) => Err(r.to_string()),
            Err(e) => Err(e.to_string()),
        }
    });
    assert_eq!(keys, format!("{KEY1}\n"));
    let modes = run(&host, "house", &["stat", "-c", "%a %U", "/home/ops/.ssh", "/home/ops/.ssh/authorized_keys"]);
    assert_eq!(modes, "700 ops\n600 ops\n");
    assert!(run(&host, "house", &["grep", "^ops:", "/etc/passwd"]).starts_with("ops:"));

    // 2. A live vm.apply of ssh alone: recorded and written at once, no restart.
    let pid = v["pid"].clone();
    let mut s2 = s.clone();
    s2["ssh"] = json!({"user": "ops", "keys": [KEY1, KEY2]});
    let m = host.call("vm.apply", json!({ "spec": s2 }));
    assert_eq!((m["changed"].as_bool(), &m["vm"]["pid"]), (Some(true), &pid), "{m}");
    assert_eq!(m["vm"]["spec"]["ssh"]["keys"], json!([KEY1, KEY2]));
    assert_eq!(run(&host, "house", &["cat", "/home/ops/.ssh/authorized_keys"]), format!("{KEY1}\n{KEY2}\n"));
    let again = host.call("vm.apply", json!({ "spec": s2 }));
    assert_eq!(again["changed"], false, "the same ssh again changes nothing: {again}");

    // 3. vm.guest_info shows the OS (the initramfs has no os-release: give it one).
    let release = "PRETTY_NAME=\"vmhost test guest 29\"\nID=vmhost\n";
    let pushed = host
        .call("vm.file_push", json!({"name": "house", "path": "/etc/os-release", "content": b64(release.as_bytes())}));
    assert_eq!(pushed["size"], release.len(), "{pushed}");
    let info = host.call("vm.guest_info", json!({"name": "house"}));
    assert_eq!(info["os"], "vmhost test guest 29", "{info}");

    // 4. The guest's clock set to 2001 is corrected by vm.sync_time.
    run(&host, "house", &["date", "-u", "-s", "2001-01-01 00:00:00"]);
    let wrong = guest_now_s(&host, "house");
    assert!(wrong < 1_000_000_000, "the guest's clock is in 2001: {wrong}");
    let mut events = host.client();
    events.subscribe_events().expect("events.subscribe");
    let synced = host.call("vm.sync_time", json!({"name": "house"}));
    assert!(synced["before"].as_str().is_some_and(|b| b.starts_with("2001-01-01T")), "{synced}");
    let after = synced["after"].as_str().unwrap_or_default().to_string();
    let year = after.get(..4).and_then(|y| y.parse::<i64>().ok()).unwrap_or(0);
    assert!(year >= 2026, "{synced}");
    assert!(synced["offset_ms"].as_i64().is_some_and(|o| o > 20 * 365 * 86_400_000), "{synced}");
    let diff = (guest_now_s(&host, "house") - host_now_s()).abs();
    assert!(diff <= 5, "the guest's clock is within a few seconds of the host's: {diff} s apart");
    let e = events.next_event(Duration::from_secs(30)).expect("read events").expect("a sync_time event");
    let action = serde_json::to_value(&e).expect("event as JSON");
    assert_eq!((e.vm.as_str(), &action["guest"]["action"]), ("house", &json!("sync_time")), "{action}");
    assert!(host.daemon_log().contains("sync_time"), "an audit line");

    // 5. A paused guest that runs again gets its clock synced by vmhostd on its own (QEMU's
    // RESUME after STOP, here an operator's stop/cont on the VM's QMP socket).
    run(&host, "house", &["date", "-u", "-s", "2001-01-01 00:00:00"]);
    let monitor = host.run().join("house").join("qmp");
    let answers = qmp_commands(&monitor, &[json!({"execute": "stop"}), json!({"execute": "cont"})]);
    assert!(answers.iter().all(|a| a.get("return").is_some()), "{answers:?}");
    wait::until("the guest's clock synced after the resume", Duration::from_secs(120), || {
        let apart = (guest_now_s(&host, "house") - host_now_s()).abs();
        if apart <= 5 {
            Ok(())
        } else {
            Err(format!("{apart} s apart"))
        }
    });

    // 6. vm.stop {method: "agent"} powers off a guest that ignores ACPI, long before the
    // timeout would kill it.
    let stopped = host.call("vm.stop", json!({"name": "house", "method": "agent", "timeout_s": 600}));
    assert_eq!(stopped["vm"]["status"], "stopped", "{stopped}");
    let mut reasons = Vec::new();
    while !reasons.iter().any(|r: &(String, String)| r.1 == "stopped") {
        let Some(e) = events.next_event(BOOT).expect("read events") else { panic!("no stopped event: {reasons:?}") };
        let guest = serde_json::to_value(&e).ok().and_then(|v| v["guest"]["action"].as_str().map(str::to_string));
        reasons.push((guest.unwrap_or(e.reason), e.to.map(|s| s.to_string()).unwrap_or_default()));
    }
    assert!(reasons.iter().any(|r| r.0 == "shutdown"), "a shutdown event: {reasons:?}");
    assert_eq!(reasons.last().map(|r| r.0.as_str()), Some("guest powered off"), "not killed: {reasons:?}");
    assert!(!host.serial("house").contains("VMHOST-GUEST-POWEROFF"), "not through ACPI");
}

#[test]
fn an_agent_stop_of_a_guest_without_exec_server_falls_back_to_acpi_at_once() {
    let host = host();
    // The plain test guest: no agent, no exec server; acpid powers it off on the button.
    let plain = guest();
    host.call("vm.create", json!({ "spec": spec("plain", &plain.initrd, "") }));
    assert!(host.wait_serial("plain", "VMHOST-GUEST-READY", BOOT), "{}", host.serial("plain"));
    let stopped = host.call("vm.stop", json!({"name": "plain", "method": "agent", "timeout_s": 600}));
    assert_eq!(stopped["vm"]["status"], "stopped", "{stopped}");
    assert!(host.serial("plain").contains("VMHOST-GUEST-POWEROFF"), "ACPI powered it off");
    assert!(host.daemon_log().contains("falling back to ACPI"), "the log says why");
    // sync_time has nothing to fall back to: a clear error naming the VM.
    host.call("vm.start", json!({"name": "plain"}));
    let (code, e) = host.call_err("vm.sync_time", json!({"name": "plain"}));
    assert_eq!((code, e.field.as_deref()), (5001, Some("name")), "{e:?}");
    host.call("vm.destroy", json!({"name": "plain"}));
}

/// Standard base64 with padding.
fn b64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n =
            (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
