//! Capture NICs end to end (issue 31, item 6): a real vmhostd in its own network namespace, a
//! veth pair as the monitored source, real TCG guests with the agent counting what reaches
//! their capture NIC (`vm.exec` reads `/sys/class/net/eth0/statistics`).
//!
//! The wire is quiet: IPv6 is off in the namespace before any link is made (no router
//! solicitations, no MLD), nothing has an address the tests did not give it, so every frame a
//! guest counts is one a test sent ([`vmhost_tests::frames`]: random locally administered MACs,
//! 802.1Q tags, runts). Frames "into the source" are sent on its veth peer and arrive as the
//! source's received frames; frames "the source sends" are sent on the source itself.
//!
//! Trunk NICs (bridge VLAN filtering, 802.1Q sub-interfaces, bonds) need modules this kernel
//! lacks: the lab proves them (tests/lab/scenarios/capture.sh).

use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;
use vmhost_tests::frames::{self, Counters, Rng};
use vmhost_tests::{agent_guest, wait, HostOptions, TestHost, GUEST_READY};

/// The monitored source and its peer, both in the daemon's namespace.
const SRC: &str = "src0";
const PEER: &str = "peer0";

/// A failure bound for TCG boots on a shared 2-core machine.
const BOOT: Duration = Duration::from_secs(600);

/// A failure bound for facts the daemon or the kernel make quickly.
const SOON: Duration = Duration::from_secs(60);

/// The hex of `b"vmhc"`: how every vmhost mirror's action cookie starts (design31 "Marker").
const COOKIE_HEX: &str = "766d6863";

/// A host whose daemon runs in a quiet namespace of its own, allows `vm.exec`, lists `sources`
/// as capture interfaces, and has each of them as a veth (peer `peerN`... see [`make_source`]).
fn capture_host(sources: &[(&str, &str)]) -> TestHost {
    let list: Vec<String> = sources.iter().map(|(s, _)| format!("{s:?}")).collect();
    let host = TestHost::start(HostOptions {
        netns: true,
        extra: format!("[agent]\nallow_exec = true\n[capture]\ninterfaces = [{}]\n", list.join(", ")),
        ..HostOptions::default()
    });
    // Every link made from here on is born without IPv6: nothing speaks unless a test makes it.
    in_ns(&host, &["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]);
    for (src, peer) in sources {
        make_source(&host, src, peer);
    }
    host
}

/// Runs `argv` inside the host's namespace (`ip netns exec`, which also mounts its sysfs) and
/// returns stdout; panics when it fails.
fn in_ns(host: &TestHost, argv: &[&str]) -> String {
    let ns = host.netns.as_deref().expect("a host with a netns");
    vmhost_tests::run_ok(Command::new("ip").args(["netns", "exec", ns]).args(argv))
}

/// Makes the veth pair `src`/`peer`, both up (IPv6 off by the namespace's default).
fn make_source(host: &TestHost, src: &str, peer: &str) {
    host.ip(&["link", "add", src, "type", "veth", "peer", "name", peer]);
    host.ip(&["link", "set", src, "up"]);
    host.ip(&["link", "set", peer, "up"]);
}

fn ns(host: &TestHost) -> &str {
    host.netns.as_deref().expect("a host with a netns")
}

/// The host-side counters of `link` in the daemon's namespace.
fn host_counters(host: &TestHost, link: &str) -> Counters {
    frames::counters(Some(ns(host)), link).unwrap_or_else(|e| panic!("counters of {link}: {e}"))
}

/// Sends `frames` on `link` in the daemon's namespace.
fn send_on(host: &TestHost, link: &str, list: &[Vec<u8>]) {
    let sent = frames::send(Some(ns(host)), link, list).unwrap_or_else(|e| panic!("send on {link}: {e}"));
    assert_eq!(sent, list.len());
}

/// A VM booting the agent guest with `nics`.
fn spec(name: &str, nics: Value) -> Value {
    let g = agent_guest();
    json!({"name": name, "cpu": 1, "memory_mib": 256, "nics": nics,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}})
}

/// One monitor NIC on `source`, `direction` when given.
fn monitor(source: &str, direction: Option<&str>) -> Value {
    let mut nic = json!({"mode": "monitor", "source": source});
    if let Some(d) = direction {
        nic["direction"] = json!(d);
    }
    json!([nic])
}

/// `vm.exec` of `argv` in `vm`.
fn exec(host: &TestHost, vm: &str, argv: &[&str]) -> Value {
    host.call("vm.exec", json!({"name": vm, "argv": argv}))
}

/// The guest's counters of its interface `dev`, read through `vm.exec`.
fn guest_counters(host: &TestHost, vm: &str, dev: &str) -> Counters {
    let argv = frames::counters_argv(dev);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let r = exec(host, vm, &argv);
    assert_eq!(r["exit_code"], 0, "{vm}: {r}");
    frames::parse_counters(r["stdout"].as_str().unwrap_or_default()).unwrap_or_else(|e| panic!("{vm}: {e}"))
}

/// Creates `spec`, waits for the guest and its exec server, and for its capture NIC `eth0` to be
/// ready to count: up and promiscuous, which the guest agent makes it on the daemon's `net.apply`
/// (virtio-net in QEMU hands a guest only its own unicast otherwise). Returns the VM's tap.
fn boot_monitor(host: &TestHost, spec: Value) -> String {
    let name = spec["name"].as_str().expect("a name").to_string();
    let created = host.call("vm.create", json!({ "spec": spec }));
    assert!(host.wait_serial(&name, GUEST_READY, BOOT), "{name}:\n{}", host.serial(&name));
    wait::until(&format!("{name}'s exec server to answer"), BOOT, || {
        match host.client().call::<Value>("vm.exec", json!({"name": name, "argv": ["true"]})) {
            Ok(v) if v["exit_code"] == 0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    wait::until(&format!("the agent to make {name}'s eth0 up and promiscuous"), SOON, || {
        let flags = exec(host, &name, &["cat", "/sys/class/net/eth0/flags"]);
        let text = flags["stdout"].as_str().unwrap_or_default().trim().to_string();
        let bits = u32::from_str_radix(text.trim_start_matches("0x"), 16).unwrap_or(0);
        // IFF_UP 0x1, IFF_PROMISC 0x100.
        if bits & 0x101 == 0x101 {
            Ok(())
        } else {
            Err(text)
        }
    });
    created["vm"]["nics"][0]["tap"].as_str().expect("a tap").to_string()
}

/// Sends single probe frames into `source` (on `peer`) until each of `vms` counted one: the
/// mirror, the tap and the guest's driver all pass frames now. Returns nothing; the counters
/// read after it are the baseline of an exact count.
fn wait_for_wire(host: &TestHost, peer: &str, vms: &[&str]) {
    let mut rng = Rng::new();
    for vm in vms {
        let before = guest_counters(host, vm, "eth0").rx_packets;
        wait::until(&format!("a probe frame to reach {vm}"), SOON, || {
            send_on(host, peer, &frames::random_frames(&mut rng, 1, &[]));
            let now = guest_counters(host, vm, "eth0").rx_packets;
            if now > before {
                Ok(())
            } else {
                Err(format!("{vm} rx_packets still {now}"))
            }
        });
    }
}

/// Waits until `vm`'s eth0 counted `n` frames more than `base`, then asserts it is exactly `n`.
fn expect_delivered(host: &TestHost, vm: &str, base: u64, n: u64, what: &str) {
    let got = wait::until(&format!("{n} frames ({what}) in {vm}"), SOON, || {
        let now = guest_counters(host, vm, "eth0").rx_packets - base;
        if now >= n {
            Ok(now)
        } else {
            Err(format!("{now} of {n}"))
        }
    });
    assert_eq!(got, n, "{vm}: {what}: exactly the frames sent, nothing else");
}

/// The action cookies (hex) of every tc filter on `link`, both hooks of its clsact; empty
/// without clsact.
fn cookies(host: &TestHost, link: &str) -> Vec<String> {
    let mut found = Vec::new();
    for hook in ["ingress", "egress"] {
        let out = Command::new("ip")
            .args(["netns", "exec", ns(host), "tc", "-s", "-j", "filter", "show", "dev", link, hook])
            .output()
            .expect("run tc");
        let filters: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        for f in filters.as_array().into_iter().flatten() {
            for a in f["options"]["actions"].as_array().into_iter().flatten() {
                if let Some(c) = a["cookie"].as_str() {
                    found.push(c.to_string());
                }
            }
        }
    }
    found
}

/// vmhost's mirrors on `link` (filters whose action cookie is vmhost's marker).
fn vmhost_filters(host: &TestHost, link: &str) -> usize {
    cookies(host, link).iter().filter(|c| c.starts_with(COOKIE_HEX)).count()
}

/// The prefs of u32 filters on `link`'s ingress (the operator's foreign filter).
fn u32_prefs(host: &TestHost, link: &str) -> Vec<u64> {
    let out = in_ns(host, &["tc", "-j", "filter", "show", "dev", link, "ingress"]);
    let filters: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
    let mut prefs: Vec<u64> = filters
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["kind"] == "u32")
        .filter_map(|f| f["pref"].as_u64())
        .collect();
    prefs.dedup();
    prefs
}

fn has_clsact(host: &TestHost, link: &str) -> bool {
    in_ns(host, &["tc", "-j", "qdisc", "show", "dev", link]).contains("\"clsact\"")
}

/// The user-set promiscuous flag of `link` (what `ip link` shows as PROMISC).
fn promisc(host: &TestHost, link: &str) -> bool {
    let v: Value = serde_json::from_str(&host.ip(&["-j", "link", "show", "dev", link])).expect("ip -j link");
    v[0]["flags"].as_array().is_some_and(|f| f.iter().any(|x| x == "PROMISC"))
}

/// Adds what an operator might have on a source before vmhost: a clsact qdisc with a u32
/// filter at pref 7 (no action cookie) on its ingress, for IPv4 frames only (`protocol ip`)
/// when `match_all` is false, else for every frame (`protocol all`, match 0/0): a filter whose
/// match ends classification there.
fn add_foreign_filter(host: &TestHost, link: &str, match_all: bool) {
    in_ns(host, &["tc", "qdisc", "add", "dev", link, "clsact"]);
    let protocol = if match_all { "all" } else { "ip" };
    in_ns(
        host,
        &[
            "tc", "filter", "add", "dev", link, "ingress", "prio", "7", "protocol", protocol, "u32", "match", "u32",
            "0", "0", "classid", "1:1",
        ],
    );
}

/// Frames vmhost's mirrors on `link`'s `hook` copied so far: the packets of every action
/// carrying vmhost's cookie (the kernel's own count, no guest needed).
fn mirrored(host: &TestHost, link: &str, hook: &str) -> u64 {
    let out = in_ns(host, &["tc", "-s", "-j", "filter", "show", "dev", link, hook]);
    let filters: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
    let mut n = 0;
    for f in filters.as_array().into_iter().flatten() {
        for a in f["options"]["actions"].as_array().into_iter().flatten() {
            if a["cookie"].as_str().is_some_and(|c| c.starts_with(COOKIE_HEX)) {
                n += a["stats"]["packets"].as_u64().unwrap_or(0);
            }
        }
    }
    n
}

/// What the source looked like before vmhost monitored it.
#[derive(Debug, Clone, Copy)]
struct Before {
    promisc: bool,
    foreign: bool,
}

/// Waits until nothing of vmhost's is left on `link` (no cookie, no ledger) and asserts it is
/// as it was: the promiscuous flag as `before`, the foreign filter and its clsact there when
/// `before.foreign`, else no clsact (vmhost made it and took it away).
fn expect_given_back(host: &TestHost, link: &str, before: Before, when: &str) {
    let ledger = host.state().join("capture").join(format!("{link}.json"));
    wait::until(&format!("{link} given back ({when})"), SOON, || {
        let (filters, promisc_now, ledger_there) = (vmhost_filters(host, link), promisc(host, link), ledger.exists());
        let clsact = has_clsact(host, link);
        if filters == 0 && promisc_now == before.promisc && !ledger_there && clsact == before.foreign {
            Ok(())
        } else {
            Err(format!("vmhost filters {filters}, promisc {promisc_now}, ledger {ledger_there}, clsact {clsact}"))
        }
    });
    if before.foreign {
        assert_eq!(u32_prefs(host, link), vec![7], "{when}: the operator's filter survives");
    }
}

/// `vm.get` nics[0].capture of `vm`.
fn capture_state(host: &TestHost, vm: &str) -> Value {
    host.call("vm.get", json!({ "name": vm }))["nics"][0]["capture"].clone()
}

#[test]
fn every_frame_into_the_source_reaches_the_guest_nothing_it_sends_leaks_and_stop_gives_the_source_back() {
    let host = capture_host(&[(SRC, PEER)]);
    let before = Before { promisc: false, foreign: false };
    assert!(!promisc(&host, SRC) && !has_clsact(&host, SRC));
    let tap = boot_monitor(&host, spec("sensor", monitor(SRC, None)));

    // While monitored: vmhost's mirrors (ingress and egress: direction both), the source
    // promiscuous, the ledger written, the view says attached.
    assert_eq!(vmhost_filters(&host, SRC), 2, "{:?}", cookies(&host, SRC));
    assert!(promisc(&host, SRC));
    assert!(host.state().join("capture").join(format!("{SRC}.json")).exists());
    let view = host.call("vm.get", json!({"name": "sensor"}));
    let nic = &view["nics"][0];
    assert_eq!(
        (nic["mode"].clone(), nic["source"].clone(), nic["capture"].clone()),
        (json!("monitor"), json!(SRC), json!("attached")),
        "{nic}"
    );
    // The agent's network check treats it as a capture NIC: up, promiscuous, no address.
    let check = host.call("vm.check", json!({"name": "sensor"}));
    assert_eq!(check["ok"], true, "{check}");
    let names: Vec<&str> =
        check["checks"].as_array().into_iter().flatten().filter_map(|c| c["name"].as_str()).collect();
    assert!(names.iter().any(|n| n.starts_with("capture") && n.ends_with("promiscuous")), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("capture") && n.ends_with("no address")), "{names:?}");
    // The tap is vmhost's, not enslaved, and drops what the guest sends (its own ingress).
    let link: Value = serde_json::from_str(&host.ip(&["-j", "-d", "link", "show", "dev", &tap])).unwrap();
    assert!(link[0]["master"].is_null(), "{link}");
    assert_eq!(
        link[0]["mtu"],
        serde_json::from_str::<Value>(&host.ip(&["-j", "link", "show", "dev", SRC])).unwrap()[0]["mtu"]
    );

    // Random MACs (none the guest's), VLAN tags, runts: each arrives once.
    wait_for_wire(&host, PEER, &["sensor"]);
    let base = guest_counters(&host, "sensor", "eth0").rx_packets;
    let sent = frames::random_frames(&mut Rng::new(), 200, &[10, 20, 4094]);
    send_on(&host, PEER, &sent);
    expect_delivered(&host, "sensor", base, 200, "random MACs, tags 10/20/4094, runts");

    // The guest sends on its capture NIC, to an address the host owns on the monitored side:
    // dropped on the tap's ingress, so no ARP answer, no ping answer, nothing on the wire.
    host.ip(&["addr", "add", "192.0.2.1/24", "dev", PEER]);
    let (peer0, src0, tap0) = (host_counters(&host, PEER), host_counters(&host, SRC), host_counters(&host, &tap));
    let guest0 = guest_counters(&host, "sensor", "eth0");
    assert_eq!(exec(&host, "sensor", &["ip", "addr", "add", "192.0.2.2/24", "dev", "eth0"])["exit_code"], 0);
    let arping = exec(&host, "sensor", &["arping", "-c", "3", "-w", "3", "-I", "eth0", "192.0.2.1"]);
    let ping = exec(&host, "sensor", &["ping", "-c", "2", "-W", "1", "192.0.2.1"]);
    assert_eq!(exec(&host, "sensor", &["ip", "addr", "del", "192.0.2.2/24", "dev", "eth0"])["exit_code"], 0);
    host.ip(&["addr", "del", "192.0.2.1/24", "dev", PEER]);
    assert_ne!(arping["exit_code"], 0, "nobody may answer: {arping}");
    assert_ne!(ping["exit_code"], 0, "nobody may answer: {ping}");
    let (peer1, src1, tap1) = (host_counters(&host, PEER), host_counters(&host, SRC), host_counters(&host, &tap));
    assert!(tap1.rx_packets >= tap0.rx_packets + 3, "the guest sent: tap {tap0:?} -> {tap1:?}");
    assert_eq!(peer1.rx_packets, peer0.rx_packets, "nothing reached the source's peer");
    assert_eq!(src1.tx_packets, src0.tx_packets, "the source sent nothing");
    assert_eq!(tap1.tx_packets, tap0.tx_packets, "nothing came back to the guest");
    assert_eq!(guest_counters(&host, "sensor", "eth0").rx_packets, guest0.rx_packets);

    // Stop: every filter gone, promiscuous flag off again, the clsact vmhost made removed.
    host.call("vm.stop", json!({"name": "sensor", "force": true}));
    expect_given_back(&host, SRC, before, "after stop");
    // Start again and destroy: the same.
    host.call("vm.start", json!({"name": "sensor"}));
    wait::until("sensor monitoring again", SOON, || match vmhost_filters(&host, SRC) {
        2 => Ok(()),
        n => Err(format!("{n} filters")),
    });
    assert!(promisc(&host, SRC));
    host.call("vm.destroy", json!({"name": "sensor"}));
    expect_given_back(&host, SRC, before, "after destroy");
}

#[test]
fn two_guests_on_one_source_see_every_frame_ingress_sees_received_only_and_foreign_settings_stay() {
    let host = capture_host(&[(SRC, PEER)]);
    // The operator's own tc filter and promiscuous flag: vmhost shares them and leaves them.
    add_foreign_filter(&host, SRC, false);
    host.ip(&["link", "set", SRC, "promisc", "on"]);
    let before = Before { promisc: true, foreign: true };
    boot_monitor(&host, spec("both", monitor(SRC, None)));
    boot_monitor(&host, spec("ingress", monitor(SRC, Some("ingress"))));
    assert_eq!(vmhost_filters(&host, SRC), 3, "two ingress mirrors, one egress: {:?}", cookies(&host, SRC));
    assert_eq!(u32_prefs(&host, SRC), vec![7]);

    let info = host.call("host.info", json!({}));
    let cap = info["capture"].as_array().and_then(|c| c.iter().find(|i| i["interface"] == SRC)).cloned();
    let cap = cap.unwrap_or_else(|| panic!("host.info capture: {info}"));
    assert_eq!((cap["present"].clone(), cap["promisc"].clone()), (json!(true), json!(true)), "{cap}");
    let mut monitors: Vec<String> = cap["monitors"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| format!("{} {} {}", m["vm"], m["direction"], m["state"]))
        .collect();
    monitors.sort();
    assert_eq!(monitors, vec![r#""both" "both" "attached""#, r#""ingress" "ingress" "attached""#], "{cap}");

    wait_for_wire(&host, PEER, &["both", "ingress"]);
    let base = |vm: &str| guest_counters(&host, vm, "eth0").rx_packets;
    let (both0, ingress0) = (base("both"), base("ingress"));
    let mut rng = Rng::new();
    // Received by the source: both see all of them.
    send_on(&host, PEER, &frames::random_frames(&mut rng, 120, &[7, 300]));
    // Sent by the source: only the guest monitoring both directions.
    send_on(&host, SRC, &frames::random_frames(&mut rng, 40, &[]));
    expect_delivered(&host, "both", both0, 160, "received and sent");
    expect_delivered(&host, "ingress", ingress0, 120, "received only");

    // One stops: the other still sees everything; the source stays promiscuous.
    host.call("vm.stop", json!({"name": "ingress", "force": true}));
    assert_eq!(vmhost_filters(&host, SRC), 2);
    let both1 = base("both");
    send_on(&host, PEER, &frames::random_frames(&mut rng, 30, &[]));
    expect_delivered(&host, "both", both1, 30, "after the other stopped");
    host.call("vm.destroy", json!({"name": "ingress"}));
    host.call("vm.destroy", json!({"name": "both"}));
    expect_given_back(&host, SRC, before, "after both destroyed");
}

/// Events of `host` as raw JSON, read from a subscription of their own: the test looks at
/// fields (`capture`) without depending on the client's typed `Event`.
struct Events(vmhost::client::Client);

impl Events {
    fn subscribe(host: &TestHost) -> Events {
        let mut c = host.client();
        c.set_timeout(Duration::from_secs(5)).expect("a timeout");
        c.subscribe_events().expect("events.subscribe");
        Events(c)
    }

    /// Waits for an event of `vm` whose `capture.state` is `state`; returns it.
    fn wait_capture(&mut self, vm: &str, state: &str) -> Value {
        let mut seen = Vec::new();
        wait::until(&format!("a capture event {state} of {vm}"), SOON, || {
            let line = match self.0.read_raw_line() {
                Ok(Some(l)) => l,
                Ok(None) => panic!("the event connection closed; seen {seen:?}"),
                Err(e) => return Err(format!("{e}; seen {seen:?}")),
            };
            let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
            let e = v["params"]["result"].clone();
            seen.push(line);
            if e["vm"] == vm && e["capture"]["state"] == state {
                Ok(e)
            } else {
                Err(format!("seen {seen:?}"))
            }
        })
    }
}

#[test]
fn a_source_that_goes_away_is_reported_and_reattached_when_it_returns() {
    let host = capture_host(&[(SRC, PEER)]);
    boot_monitor(&host, spec("watch", monitor(SRC, Some("ingress"))));
    assert_eq!(capture_state(&host, "watch"), "attached");
    let mut events = Events::subscribe(&host);

    host.ip(&["link", "del", SRC]);
    let lost = events.wait_capture("watch", "source_missing");
    assert_eq!((lost["capture"]["source"].clone(), lost["capture"]["nic"].clone()), (json!(SRC), json!(0)), "{lost}");
    assert_eq!(lost["reason"], format!("capture source {SRC} lost"), "{lost}");
    assert_eq!(lost["to"], "running", "the VM runs on: {lost}");
    host.wait_vm("watch", "to report its source missing", SOON, |v| v["nics"][0]["capture"] == "source_missing");
    let ledger = host.state().join("capture").join(format!("{SRC}.json"));

    make_source(&host, SRC, PEER);
    let back = events.wait_capture("watch", "attached");
    assert_eq!(back["reason"], format!("capture source {SRC} is back"), "{back}");
    host.wait_vm("watch", "to report its source attached", SOON, |v| v["nics"][0]["capture"] == "attached");
    assert!(promisc(&host, SRC), "the new link is promiscuous while monitored");
    assert_eq!(vmhost_filters(&host, SRC), 1);
    assert!(ledger.exists(), "the new link has a ledger");
    wait_for_wire(&host, PEER, &["watch"]);
    let base = guest_counters(&host, "watch", "eth0").rx_packets;
    send_on(&host, PEER, &frames::random_frames(&mut Rng::new(), 50, &[99]));
    expect_delivered(&host, "watch", base, 50, "after the source came back");

    host.call("vm.stop", json!({"name": "watch", "force": true}));
    expect_given_back(&host, SRC, Before { promisc: false, foreign: false }, "after stop");
}

#[test]
fn a_daemon_killed_at_any_capture_step_leaves_nothing_of_vmhosts_after_restart_and_stop() {
    // Autostart off: what a restart settles is checked before anything starts a VM again.
    let mut host = TestHost::start(HostOptions {
        netns: true,
        extra: format!("[capture]\ninterfaces = [{SRC:?}]\n[lifecycle]\nautostart = false\n"),
        ..HostOptions::default()
    });
    in_ns(&host, &["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]);
    make_source(&host, SRC, PEER);
    add_foreign_filter(&host, SRC, false);
    let before = Before { promisc: false, foreign: true };
    for (round, step) in
        ["launch:capture", "capture:ledger", "capture:promisc", "capture:mirror"].into_iter().enumerate()
    {
        let name = format!("c{round}");
        let spec = crash_spec(&host, &name);
        host.crash_during(step, "vm.create", json!({ "spec": spec }));
        settle_and_stop(&host, &name, step, before);
    }
    // The last step is on the way out: a stop that dies after the filters went.
    host.call("vm.create", json!({ "spec": crash_spec(&host, "out") }));
    assert!(vmhost_filters(&host, SRC) > 0 && promisc(&host, SRC));
    host.crash_during("capture:removed", "vm.stop", json!({"name": "out", "force": true}));
    settle_and_stop(&host, "out", "capture:removed", before);
    assert!(host.qemu_pids().is_empty(), "no QEMU left");
}

/// A VM of the plain guest with one monitor NIC on [`SRC`]: the crash points need QEMU and its
/// tap, not a booted guest.
fn crash_spec(host: &TestHost, name: &str) -> Value {
    let mut s = host.kernel_spec(name);
    s["nics"] = monitor(SRC, None);
    s
}

/// After a restart: waits until `name` settled (running again, or failed), stops it if it runs,
/// checks the source is as `before`, destroys it and checks again.
fn settle_and_stop(host: &TestHost, name: &str, step: &str, before: Before) {
    let v = host
        .wait_vm(name, "to settle after the restart", SOON, |v| v["status"] != "starting" && v["status"] != "stopping");
    if v["status"] == "running" {
        host.call("vm.stop", json!({"name": name, "force": true}));
    }
    expect_given_back(host, SRC, before, &format!("{step}: restart and stop"));
    host.call("vm.destroy", json!({"name": name}));
    expect_given_back(host, SRC, before, &format!("{step}: destroy"));
}

#[test]
fn a_source_not_listed_or_not_present_is_refused_naming_the_nic_and_creates_nothing() {
    // "gone0" is listed but does not exist; "src0" exists but a NIC may not name "peer0".
    let host = TestHost::start(HostOptions {
        netns: true,
        extra: format!("[capture]\ninterfaces = [{SRC:?}, \"gone0\"]\n"),
        ..HostOptions::default()
    });
    make_source(&host, SRC, PEER);
    let links_before = host.links().len();
    let cases: [(&str, Value, i32, &str, &[&str]); 4] = [
        (
            "unlisted",
            monitor(PEER, None),
            3001,
            "spec.nics[0].source",
            &["the host config lists no capture interface", PEER],
        ),
        ("absent", monitor("gone0", None), 3001, "spec.nics[0].source", &["no interface", "gone0", "on the host"]),
        ("nosource", json!([{"mode": "monitor"}]), 2001, "spec.nics[0].source", &[]),
        ("withnet", json!([{"mode": "monitor", "source": SRC, "network": "lan"}]), 2001, "spec.nics[0].network", &[]),
    ];
    for (name, nics, code, field, words) in cases {
        let (got, e) = host.call_err("vm.create", json!({ "spec": crash_spec_with(&host, name, nics) }));
        assert_eq!((got, e.field.as_deref()), (code, Some(field)), "{name}: {e:?}");
        assert!(words.iter().all(|w| e.message.contains(w)), "{name}: {}", e.message);
        assert_eq!(host.call_err("vm.get", json!({ "name": name })).0, 4040, "{name}: no record");
    }
    assert_eq!(host.links().len(), links_before, "no link was created");
    assert_eq!(vmhost_filters(&host, SRC), 0);
    assert!(!promisc(&host, SRC));
}

/// The plain guest with `nics`.
fn crash_spec_with(host: &TestHost, name: &str, nics: Value) -> Value {
    let mut s = host.kernel_spec(name);
    s["nics"] = nics;
    s
}

#[test]
fn an_operators_match_all_filter_on_the_source_does_not_hide_frames_from_the_monitor() {
    // The operator's u32 filter matches every frame and ends classification where it stands:
    // a mirror placed after it would copy nothing. vmhost's mirror must see every frame the
    // source receives, and the operator's filter still every frame too.
    let host = TestHost::start(HostOptions {
        netns: true,
        extra: format!("[capture]\ninterfaces = [{SRC:?}]\n"),
        ..HostOptions::default()
    });
    in_ns(&host, &["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]);
    make_source(&host, SRC, PEER);
    add_foreign_filter(&host, SRC, true);
    // QEMU and its tap are enough: the kernel counts what the mirror copies.
    host.call("vm.create", json!({ "spec": crash_spec_with(&host, "early", monitor(SRC, Some("ingress"))) }));
    assert_eq!(vmhost_filters(&host, SRC), 1);
    let before = mirrored(&host, SRC, "ingress");
    send_on(&host, PEER, &frames::random_frames(&mut Rng::new(), 20, &[5]));
    let copied = mirrored(&host, SRC, "ingress") - before;
    let prefs = in_ns(&host, &["tc", "filter", "show", "dev", SRC, "ingress"]);
    assert_eq!(copied, 20, "every frame the source received was mirrored; filters:\n{prefs}");
    assert_eq!(u32_prefs(&host, SRC), vec![7]);
    host.call("vm.destroy", json!({"name": "early"}));
    expect_given_back(&host, SRC, Before { promisc: false, foreign: true }, "after destroy");
}
