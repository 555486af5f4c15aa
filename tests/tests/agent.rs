//! The guest agent end to end: real vmhostd, real TCG guests running the real static agent over
//! virtio-serial, in a network namespace with a bridge vmhostd owns.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;
use vmhost_tests::{agent_guest, HostOptions, TestHost};

const LAN: &str = vmhost_tests::LAN_NETWORK;

fn spec(name: &str, addr: &str, extra_cmdline: &str) -> Value {
    let g = agent_guest();
    json!({"name": name, "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd,
                 "cmdline": format!("console=ttyS0 panic=-1 quiet {extra_cmdline}")},
        "nics": [{"network": "lan", "ipv4": {"mode": "static", "address": addr, "gateway": "10.0.0.1",
                  "dns": ["10.0.0.1"], "search": ["lab.example"]}}]})
}

fn wait_agent(host: &TestHost, name: &str) -> Value {
    let connected = |v: &Value| v["agent"]["connected"] == true;
    let v = host.wait_vm(name, "to have its agent connected", Duration::from_secs(300), connected);
    assert!(connected(&v), "{}", host.serial(name));
    v
}

fn check(host: &TestHost, name: &str) -> Value {
    host.call("vm.check", json!({ "name": name }))
}

#[test]
fn vm_check_passes_when_the_network_is_as_declared_and_names_what_is_not() {
    let host = TestHost::start(HostOptions { netns: true, extra: LAN.into(), ..HostOptions::default() });
    host.call("vm.create", json!({ "spec": spec("good", "10.0.0.5/24", "") }));
    host.call("vm.create", json!({ "spec": spec("bad", "10.0.0.6/24", "vmhost.skipip") }));
    let v = wait_agent(&host, "good");
    assert!(v["agent"]["version"].as_str().unwrap().starts_with('0'), "{v}");
    wait_agent(&host, "bad");

    let info = host.call("vm.guest_info", json!({ "name": "good" }));
    assert!(info["kernel"].as_str().unwrap().contains("cloud-amd64"), "{info}");
    let net = host.call("vm.guest_network", json!({ "name": "good" }));
    let eth0 = net["interfaces"].as_array().unwrap().iter().find(|i| i["name"] == "eth0").unwrap().clone();
    assert_eq!(eth0["addresses"], json!(["10.0.0.5/24"]));
    assert_eq!(eth0["mac"], host.call("vm.get", json!({"name": "good"}))["nics"][0]["mac"]);

    let good = check(&host, "good");
    assert_eq!(good["ok"], true, "{good}");
    let names: Vec<&str> = good["checks"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert!(names.iter().any(|n| n.contains("10.0.0.5/24")), "{names:?}");
    assert!(names.iter().any(|n| n.contains("reachable")), "the gateway was probed: {names:?}");

    let bad = check(&host, "bad");
    assert_eq!(bad["ok"], false, "{bad}");
    let failed: Vec<String> = bad["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ok"] == false)
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect();
    assert!(failed.iter().any(|n| n.contains("10.0.0.6/24")), "the missing address is named: {failed:?}");
    assert!(failed.iter().any(|n| n.contains("10.0.0.1")), "the missing gateway is named: {failed:?}");
    let out = host.ctl(&["check", "bad"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stdout).contains("FAIL"));
}

/// QMP `system_reset` on the VM's monitor (vmhostd holds no QMP session between operations).
fn reset(host: &TestHost, name: &str) {
    let s = UnixStream::connect(host.run().join(name).join("qmp")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    let mut line = String::new();
    r.read_line(&mut line).unwrap(); // greeting
    for cmd in ["qmp_capabilities", "system_reset"] {
        writeln!(w, "{{\"execute\": \"{cmd}\"}}").unwrap();
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            if line.contains("\"return\"") {
                break;
            }
        }
    }
}

fn guest_ifaces(host: &TestHost, name: &str) -> Vec<Value> {
    host.call("vm.guest_network", json!({ "name": name }))["interfaces"].as_array().unwrap().clone()
}

fn wait_for<F: Fn() -> bool>(host: &TestHost, what: &str, f: F) {
    vmhost_tests::wait::until_true(what, Duration::from_secs(300), f, || {
        let log = host.daemon_log();
        let agent: Vec<&str> =
            log.lines().filter(|l| l.contains("vmhost::agent") || l.contains("lifecycle::agent")).collect();
        format!("agent log:\n{}\nserial:\n{}", agent.join("\n"), host.serial("gi"))
    });
}

#[test]
fn guest_interfaces_are_applied_live_kept_across_reboots_and_removed() {
    let mut host = TestHost::start(HostOptions { netns: true, extra: LAN.into(), ..HostOptions::default() });
    let mut s = spec("gi", "10.0.0.7/24", "");
    host.call("vm.create", json!({ "spec": s }));
    wait_agent(&host, "gi");

    s["guest_interfaces"] = json!([{"name": "eth0.20", "link": "eth0", "vlan_id": 20, "address": "10.20.0.7/24"}]);
    let r = host.call("vm.apply", json!({ "spec": s }));
    assert_eq!(r["changed"], true);
    let pid = r["vm"]["pid"].clone();
    let vlan = guest_ifaces(&host, "gi").into_iter().find(|i| i["name"] == "eth0.20").expect("eth0.20 created");
    assert_eq!((vlan["kind"].clone(), vlan["alias"].clone()), (json!("vlan"), json!("vmhost-agent")));
    assert_eq!(vlan["addresses"], json!(["10.20.0.7/24"]));
    let again = host.call("vm.apply", json!({ "spec": s }));
    assert_eq!(again["changed"], false, "a second apply changes nothing");
    assert_eq!(again["vm"]["pid"], pid, "guest interfaces never restart the VM");

    // A guest reboot: the agent comes back, the daemon notices and applies the interfaces again.
    let before = host.call("vm.guest_info", json!({ "name": "gi" }))["boot_id"].clone();
    assert!(before.as_str().is_some_and(|b| b.len() == 36), "{before}");
    reset(&host, "gi");
    wait_for(&host, "the rebooted guest's agent", || {
        host.client().call::<Value>("vm.guest_info", json!({ "name": "gi" })).is_ok_and(|i| i["boot_id"] != before)
    });
    wait_for(&host, "eth0.20 back after the reboot", || {
        guest_ifaces(&host, "gi").iter().any(|i| i["name"] == "eth0.20")
    });

    // A daemon restart: the session comes back.
    host.kill_daemon();
    host.spawn_daemon();
    wait_agent(&host, "gi");

    // Removal through a reconcile of the whole desired set: no replace, applied live.
    s["guest_interfaces"] = json!([]);
    let r = host.call("host.reconcile", json!({ "vms": [s] }));
    assert_eq!(r["plan"][0]["action"], "none", "{r}");
    assert!(r["plan"][0]["reason"].as_str().unwrap().contains("guest interfaces"), "{r}");
    assert_eq!((r["results"][0]["ok"].clone(), r["results"][0]["changed"].clone()), (json!(true), json!(true)), "{r}");
    assert!(!guest_ifaces(&host, "gi").iter().any(|i| i["name"] == "eth0.20"), "removed from the spec, gone");
    assert_eq!(host.call("vm.get", json!({"name": "gi"}))["pid"], pid);
}

#[test]
fn a_vm_without_a_connected_agent_gets_5001_and_others_are_unaffected() {
    let host = TestHost::start(HostOptions::default());
    // The plain test guest has no agent.
    host.call("vm.create", json!({ "spec": host.kernel_spec("noagent") }));
    let (code, e) = host.call_err("vm.check", json!({ "name": "noagent" }));
    assert_eq!(code, 5001, "{e:?}");
    assert_eq!(host.call_err("vm.guest_info", json!({ "name": "nope" })).0, 4040);
    // Reads answer from the daemon's records, whatever the agent: the VM is listed running,
    // its agent reported not connected.
    let list = host.call("vm.list", json!({}));
    let listed = list.as_array().and_then(|l| l.iter().find(|v| v["name"] == "noagent")).cloned().unwrap_or_default();
    assert_eq!(listed["status"], "running", "{list}");
    assert_eq!(host.call("vm.get", json!({ "name": "noagent" }))["agent"]["connected"], false);
}

/// The test guest with a flooding script as its "agent" (tests/guest/hostile/flood-agent.sh).
fn hostile_guest() -> vmhost_tests::Guest {
    vmhost_tests::hostile_guest("flood-agent.sh", "initramfs-hostile.cpio.gz")
}

#[test]
fn a_hostile_guest_floods_its_port_and_the_daemon_stays_responsive() {
    let host = TestHost::start(HostOptions::default());
    let g = hostile_guest();
    let evil = json!({"name": "evil", "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}});
    host.call("vm.create", json!({ "spec": evil }));
    assert!(host.wait_serial("evil", vmhost_tests::GUEST_READY, Duration::from_secs(90)));
    let daemon = host.daemon_pid().unwrap();
    let mut refused = 0;
    let flood_noticed = |log: &str| log.contains("longer than 65536") || log.contains("invalid reply");
    // Calls go on until the daemon has noticed the flood and refused calls that reached the
    // agent's session (not only the rate limit): the facts, not a length of time.
    vmhost_tests::wait::until("the flood noticed and agent calls refused", Duration::from_secs(300), || {
        // The hostile guest never gets a session: its calls are refused (an answer, not the
        // client's timeout).
        let (code, _) = host.call_err("vm.check", json!({ "name": "evil" }));
        // 1004: this loop outruns the per-VM rate of agent calls (docs/api.md#limits), which
        // is refused at once without asking the guest.
        assert!(code == 5001 || code == 5002 || code == 1004, "code {code}");
        refused += usize::from(code != 1004);
        // Other calls are answered meanwhile.
        assert_eq!(host.call("vm.get", json!({ "name": "evil" }))["agent"]["connected"], false);
        assert!(host.call("vm.list", json!({})).is_array());
        if refused > 0 && flood_noticed(&host.daemon_log()) {
            Ok(())
        } else {
            Err(format!("{refused} refusals past the rate limit; flood noticed: {}", flood_noticed(&host.daemon_log())))
        }
    });
    let rss_kib = vmhost_tests::rss_kib(daemon);
    assert!(rss_kib > 0, "vmhostd's VmRSS is readable");
    assert!(rss_kib < 200 * 1024, "the flood is not buffered: vmhostd RSS {rss_kib} KiB");
    assert_eq!(host.call("vm.get", json!({ "name": "evil" }))["status"], "running");
}

/// The test guest with a lying "agent" whose every string forges lines and terminal sequences
/// (tests/guest/hostile/liar-agent.sh).
fn liar_guest() -> vmhost_tests::Guest {
    vmhost_tests::hostile_guest("liar-agent.sh", "initramfs-liar.cpio.gz")
}

/// No character that could forge a line or drive a terminal.
fn assert_inert(what: &str, text: &str) {
    let bad: Vec<char> = text.chars().filter(|c| (c.is_control() && *c != '\n') || *c == '\u{9b}').collect();
    assert!(bad.is_empty(), "{what} holds raw control characters {bad:?}:\n{text}");
}

#[test]
fn guest_strings_are_escaped_in_the_log_and_in_vmhostctl() {
    let host = TestHost::start(HostOptions::default());
    let g = liar_guest();
    let liar = json!({"name": "liar", "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}});
    host.call("vm.create", json!({ "spec": liar }));
    let v = wait_agent(&host, "liar");
    assert!(v["agent"]["version"].as_str().unwrap().contains("\nFORGED-LINE"), "the API keeps the raw value: {v}");

    // The log: the guest's version and its error message each stay on their own line, escaped.
    let log = vmhost_tests::wait::until("net.apply's refusal in the daemon's log", Duration::from_secs(120), || {
        let log = host.daemon_log();
        if log.contains("guest interfaces not applied") {
            Ok(log)
        } else {
            Err(log)
        }
    });
    let plain = vmhost_tests::plain_log(&log);
    let connected: Vec<&str> = plain.lines().filter(|l| l.contains("guest agent connected")).collect();
    assert_eq!(connected.len(), 1, "{plain}");
    assert!(
        connected[0]
            .contains(r"0.9\nFORGED-LINE level=ERROR vmhostd: root shell granted\r\x1b[2K\x1b]0;pwned\x07\u{9b}31m"),
        "{}",
        connected[0]
    );
    let refused: Vec<&str> = plain.lines().filter(|l| l.contains("guest interfaces not applied")).collect();
    assert!(refused.iter().all(|l| l.contains(r"refused\nFORGED-LINE")), "{refused:?}");
    for line in plain.lines().filter(|l| l.contains("FORGED")) {
        assert!(line.contains(r"\nFORGED-LINE"), "a forged line: {line:?}");
    }
    assert!(
        !log.contains('\r') && !log.contains("\u{1b}]0;pwned") && !log.contains("\u{1b}[2K"),
        "raw sequences in the log"
    );
    assert!(!log.contains('\u{9b}'), "a raw C1 CSI in the log");

    // vmhostctl's table: one row, its cells escaped; no raw control characters anywhere.
    let out = host.ctl(&["check", "liar"]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success(), "the liar says its network is not as declared");
    assert_inert("vmhostctl check", &stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "header, one row, summary:\n{stdout}");
    assert!(lines[1].starts_with("FAIL"), "{}", lines[1]);
    assert!(lines[1].contains(r"eth0\nFORGED-LINE level=ERROR"), "{}", lines[1]);
    assert!(lines[1].contains(r"\x1b[32mok\x1b[0m") && lines[1].contains(r"x\rFORGED-CELL"), "{}", lines[1]);

    // Plain-text errors (the agent's refusal of net.state) and JSON (guest-info) are inert too.
    let out = host.ctl(&["guest-network", "liar"]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_inert("vmhostctl guest-network", &stderr);
    assert!(stderr.lines().next().unwrap_or("").contains(r"refused\nFORGED-LINE"), "{stderr}");
    assert_eq!(stderr.lines().count(), 2, "the error and its details:\n{stderr}");
    let out = host.ctl(&["guest-info", "liar"]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_inert("vmhostctl guest-info", &stdout);
    let info: Value = serde_json::from_str(&stdout).unwrap();
    assert!(info["hostname"].as_str().unwrap().ends_with("\u{1b}]0;pwned\u{7}\u{9b}31m"), "JSON keeps the value");
}
