//! The guest agent end to end: real vmhostd, real TCG guests running the real static agent over
//! virtio-serial, in a network namespace with a bridge vmhostd owns.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
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
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let v = host.call("vm.get", json!({ "name": name }));
        if v["agent"]["connected"] == true {
            return v;
        }
        assert!(Instant::now() < deadline, "agent of {name} never connected: {v}\n{}", host.serial(name));
        std::thread::sleep(Duration::from_millis(250));
    }
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
    let deadline = Instant::now() + Duration::from_secs(120);
    while !f() {
        if Instant::now() > deadline {
            let log = host.daemon_log();
            let agent: Vec<&str> =
                log.lines().filter(|l| l.contains("vmhost::agent") || l.contains("lifecycle::agent")).collect();
            panic!("timed out waiting for {what}; agent log:\n{}\nserial:\n{}", agent.join("\n"), host.serial("gi"));
        }
        std::thread::sleep(Duration::from_millis(300));
    }
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
    let deadline = Instant::now() + Duration::from_secs(120);
    while !guest_ifaces(&host, "gi").iter().any(|i| i["name"] == "eth0.20") {
        let log = host.daemon_log();
        let tail: Vec<&str> =
            log.lines().filter(|l| !l.contains("rpc_conn") && (l.contains("agent") || l.contains("guest"))).collect();
        assert!(Instant::now() < deadline, "eth0.20 not back after the reboot; daemon log:\n{}", tail.join("\n"));
        std::thread::sleep(Duration::from_millis(300));
    }

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
    let t = Instant::now();
    assert!(host.call("vm.list", json!({})).is_array());
    assert!(t.elapsed() < Duration::from_secs(5), "reads are not held up by agent sessions");
}

/// The test guest with a flooding script as its "agent" (tests/guest/hostile/flood-agent.sh).
fn hostile_guest() -> vmhost_tests::Guest {
    let base = vmhost_tests::guest();
    let root = vmhost_tests::workspace();
    let script = root.join("tests/guest/hostile/flood-agent.sh");
    let out = root.join("target/guest");
    let st = std::process::Command::new(root.join("tests/guest/build.sh"))
        .env("EXTRA_FILES", format!("{}:/bin/vmhost-agent", script.display()))
        .env("INITRAMFS_NAME", "initramfs-hostile.cpio.gz")
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    vmhost_tests::Guest { kernel: base.kernel, initrd: out.join("initramfs-hostile.cpio.gz") }
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
    let started = Instant::now();
    let mut refused = 0;
    while started.elapsed() < Duration::from_secs(20) {
        // The hostile guest never gets a session: its calls are refused in bounded time.
        let t = Instant::now();
        let (code, _) = host.call_err("vm.check", json!({ "name": "evil" }));
        assert!(code == 5001 || code == 5002, "code {code}");
        assert!(t.elapsed() < Duration::from_secs(25), "a refused call is bounded");
        refused += 1;
        // Other calls are answered at once.
        let t = Instant::now();
        assert_eq!(host.call("vm.get", json!({ "name": "evil" }))["agent"]["connected"], false);
        assert!(host.call("vm.list", json!({})).is_array());
        assert!(t.elapsed() < Duration::from_secs(2), "reads held up: {:?}", t.elapsed());
    }
    assert!(refused > 0);
    let log = host.daemon_log();
    assert!(log.contains("longer than 65536") || log.contains("invalid reply"), "the flood was noticed");
    let rss_kib = vmhost_tests::rss_kib(daemon);
    assert!(rss_kib > 0, "vmhostd's VmRSS is readable");
    assert!(rss_kib < 200 * 1024, "the flood is not buffered: vmhostd RSS {rss_kib} KiB");
    assert_eq!(host.call("vm.get", json!({ "name": "evil" }))["status"], "running");
}
