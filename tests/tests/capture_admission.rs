//! Monitor NICs at the API's edge, end to end without a guest: a real vmhostd in its own network
//! namespace refuses what it must (2001/3001 naming the field, nothing recorded), records a
//! stopped VM with a monitor NIC and shows it, refuses to start it while its source is absent,
//! and reports the capture interfaces in `host.info` and `host.check`. Frames themselves are
//! proven in tests/tests/capture.rs.

use serde_json::{json, Value};
use std::time::Duration;
use vmhost_tests::{HostOptions, TestHost, LAN_NETWORK};

fn host() -> TestHost {
    host_with("")
}

fn host_with(more: &str) -> TestHost {
    let extra = format!("{LAN_NETWORK}\n[capture]\ninterfaces = [\"cap0\", \"gone0\"]\n{more}");
    let host = TestHost::start(HostOptions { netns: true, extra, ..HostOptions::default() });
    // The source: a veth in the daemon's namespace (its peer beside it, both down).
    host.ip(&["link", "add", "cap0", "type", "veth", "peer", "name", "cap0p"]);
    host.ip(&["link", "set", "cap0", "up"]);
    host
}

fn spec(host: &TestHost, name: &str, nics: Value, state: &str) -> Value {
    let mut s = host.kernel_spec(name);
    s["nics"] = nics;
    s["state"] = state.into();
    s
}

fn no_record(host: &TestHost, name: &str) {
    let list = host.call("vm.list", json!({}));
    assert!(list.as_array().unwrap().iter().all(|v| v["name"] != name), "{name} was recorded: {list}");
    assert!(!host.state().join("vms").join(format!("{name}.json")).exists(), "{name}: a record file");
}

#[test]
fn bad_monitor_and_trunk_nics_are_refused_naming_the_field_and_nothing_is_recorded() {
    let host = host();
    let cases: [(&str, Value, i32, &str); 8] = [
        ("no source", json!([{"mode": "monitor"}]), 2001, "spec.nics[0].source"),
        (
            "monitor with network",
            json!([{"mode": "monitor", "source": "cap0", "network": "lan"}]),
            2001,
            "spec.nics[0].network",
        ),
        (
            "monitor with mac",
            json!([{"mode": "monitor", "source": "cap0", "mac": "02:00:00:00:00:01"}]),
            2001,
            "spec.nics[0].mac",
        ),
        ("bridge with source", json!([{"network": "lan", "source": "cap0"}]), 2001, "spec.nics[0].source"),
        ("bridge without network", json!([{"network": "lan"}, {}]), 2001, "spec.nics[1].network"),
        ("vlans without filtering", json!([{"network": "lan", "vlans": [10]}]), 2001, "spec.nics[0].vlans"),
        ("not a capture interface", json!([{"mode": "monitor", "source": "eth9"}]), 3001, "spec.nics[0].source"),
        (
            "absent source",
            json!([{"network": "lan"}, {"mode": "monitor", "source": "gone0"}]),
            3001,
            "spec.nics[1].source",
        ),
    ];
    for (i, (what, nics, code, field)) in cases.into_iter().enumerate() {
        let name = format!("bad{i}");
        let (got, e) = host.call_err("vm.create", json!({"spec": spec(&host, &name, nics, "running")}));
        assert_eq!((got, e.field.as_deref()), (code, Some(field)), "{what}: {}", e.message);
        no_record(&host, &name);
    }
    let (_, e) = host.call_err(
        "vm.create",
        json!({"spec": spec(&host, "m", json!([{"mode": "monitor", "source": "eth9"}]), "running")}),
    );
    assert!(e.message.contains("lists no capture interface \"eth9\""), "{}", e.message);
    let (_, e) = host.call_err(
        "vm.create",
        json!({"spec": spec(&host, "m", json!([{"mode": "monitor", "source": "gone0"}]), "running")}),
    );
    assert!(e.message.contains("no interface \"gone0\" on the host"), "{}", e.message);
    // The source was never touched: not promiscuous, no qdisc.
    let cap0 = host.ip(&["-d", "link", "show", "dev", "cap0"]);
    assert!(!cap0.contains("PROMISC"), "{cap0}");
    let ns = host.netns.clone().expect("a netns");
    let tc = std::process::Command::new("tc").args(["-n", &ns, "qdisc", "show", "dev", "cap0"]).output().expect("tc");
    let qdiscs = String::from_utf8_lossy(&tc.stdout).into_owned();
    assert!(!qdiscs.contains("clsact"), "{qdiscs}");
}

#[test]
fn a_stopped_vm_with_a_monitor_nic_is_shown_and_cannot_start_without_its_source() {
    let host = host();
    let nics = json!([
        {"mode": "monitor", "source": "gone0", "direction": "ingress"},
        {"network": "lan"},
    ]);
    let created = host.call("vm.create", json!({"spec": spec(&host, "watch", nics, "stopped")}));
    assert_eq!(created["vm"]["status"], "stopped", "{created}");
    let vm = host.call("vm.get", json!({"name": "watch"}));
    let spec_nic = &vm["spec"]["nics"][0];
    assert_eq!((spec_nic["mode"].clone(), spec_nic["source"].clone()), (json!("monitor"), json!("gone0")), "{vm}");
    assert!(spec_nic.get("network").is_none(), "no network on a monitor NIC: {spec_nic}");
    let nic = &vm["nics"][0];
    assert_eq!(nic["mode"], "monitor", "{nic}");
    assert_eq!(nic["source"], "gone0", "{nic}");
    assert_eq!(nic["direction"], "ingress", "{nic}");
    assert!(nic.get("capture").is_none(), "no capture state while stopped: {nic}");
    assert!(nic["tap"].as_str().unwrap().starts_with("vmh"), "{nic}");
    let bridge = &vm["nics"][1];
    assert!(bridge.get("mode").is_none() && bridge.get("source").is_none(), "{bridge}");

    // Its source is absent: the start is refused naming it, and the VM stays stopped.
    let (code, e) = host.call_err("vm.start", json!({"name": "watch"}));
    assert_eq!((code, e.field.as_deref()), (3001, Some("spec.nics[0].source")), "{}", e.message);
    assert_eq!(host.call("vm.get", json!({"name": "watch"}))["status"], "stopped");

    // host.info: every configured interface, present or not; a stopped VM monitors nothing.
    let info = host.call("host.info", json!({}));
    let capture = info["capture"].as_array().expect("host.info capture").clone();
    assert_eq!(capture.len(), 2, "{capture:?}");
    assert_eq!(
        capture[0],
        json!({"interface": "cap0", "present": true, "promisc": false, "monitors": []}),
        "{capture:?}"
    );
    assert_eq!((capture[1]["interface"].clone(), capture[1]["present"].clone()), (json!("gone0"), json!(false)));

    // host.check: the capture item names the absent interface.
    let check = host.call("host.check", json!({}));
    let item = check["items"].as_array().unwrap().iter().find(|i| i["name"] == "capture").cloned();
    let item = item.expect("a capture item");
    assert_eq!(item["status"], "error", "{item}");
    let detail = item["detail"].as_str().unwrap();
    assert!(detail.contains("gone0") && !detail.contains("cap0"), "{detail}");

    // Once it exists the check is ok.
    host.ip(&["link", "add", "gone0", "type", "veth", "peer", "name", "gone0p"]);
    let check = host.call("host.check", json!({}));
    let item = check["items"].as_array().unwrap().iter().find(|i| i["name"] == "capture").cloned().unwrap();
    assert_eq!(item["status"], "ok", "{item}");
    host.call("vm.destroy", json!({"name": "watch"}));
}

/// The lifecycle around one running monitor NIC (no frames: tests/tests/capture.rs): the view
/// and `host.info` say `attached`, the source going away and coming back is seen by the link
/// watcher (view, events), and a stop gives the source back.
#[test]
fn a_running_monitor_follows_its_source_and_a_stop_gives_it_back() {
    let host = host();
    let mut events = host.client();
    events.subscribe_events().expect("subscribe");
    let nics = json!([{"mode": "monitor", "source": "cap0"}]);
    host.call("vm.create", json!({"spec": spec(&host, "mon", nics, "running")}));
    let timeout = Duration::from_secs(60);
    let vm = host.wait_vm("mon", "capture attached", timeout, |v| v["nics"][0]["capture"] == "attached");
    assert_eq!(vm["status"], "running", "{vm}");
    let info = host.call("host.info", json!({}));
    assert_eq!(info["capture"][0]["promisc"], true, "{info}");
    assert_eq!(
        info["capture"][0]["monitors"],
        json!([{"vm": "mon", "nic": 0, "direction": "both", "state": "attached"}]),
        "{info}"
    );

    // The source goes: the watcher notices, the VM keeps running.
    host.ip(&["link", "del", "cap0"]);
    let vm = host.wait_vm("mon", "capture source_missing", timeout, |v| v["nics"][0]["capture"] == "source_missing");
    assert_eq!(vm["status"], "running", "{vm}");
    // It comes back: mirrored again.
    host.ip(&["link", "add", "cap0", "type", "veth", "peer", "name", "cap0p"]);
    host.ip(&["link", "set", "cap0", "up"]);
    host.wait_vm("mon", "capture attached again", timeout, |v| v["nics"][0]["capture"] == "attached");
    let mut reasons = Vec::new();
    while let Ok(Some(e)) = events.next_event(Duration::from_secs(2)) {
        if e.capture.is_some() {
            reasons.push(e.reason.clone());
        }
        if reasons.len() == 2 {
            break;
        }
    }
    assert_eq!(reasons, ["capture source cap0 lost", "capture source cap0 is back"]);

    // A stop gives the source back: not promiscuous, no filter of ours.
    host.call("vm.stop", json!({"name": "mon", "force": true}));
    host.wait_status("mon", "stopped", timeout);
    let link = host.ip(&["link", "show", "dev", "cap0"]);
    assert!(!link.contains("PROMISC"), "{link}");
    let info = host.call("host.info", json!({}));
    assert_eq!(info["capture"][0]["promisc"], false, "{info}");
    assert_eq!(info["capture"][0]["monitors"], json!([]), "{info}");
    let vm = host.call("vm.get", json!({"name": "mon"}));
    assert!(vm["nics"][0].get("capture").is_none(), "{vm}");
    let ns = host.netns.clone().expect("a netns");
    for hook in ["ingress", "egress"] {
        let out = std::process::Command::new("tc")
            .args(["-n", &ns, "filter", "show", "dev", "cap0", hook])
            .output()
            .expect("tc");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.contains("mirred"), "{hook}: {text}");
    }
}

/// vmhostd killed right after a start's capture sync (`launch:capture`: mirrors, promiscuous
/// flag and ledger in place, no QEMU): the restart's recovery sync gives the source back.
/// (Every capture crash point with frames and foreign filters: tests/tests/capture.rs.)
#[test]
fn a_crash_after_the_capture_sync_of_a_start_leaves_nothing_on_the_source() {
    // Autostart off: what the restart's recovery settles, before anything starts the VM again.
    let mut host = host_with("[lifecycle]\nautostart = false\n");
    let nics = json!([{"mode": "monitor", "source": "cap0"}]);
    let s = spec(&host, "cr", nics, "running");
    host.crash_during("launch:capture", "vm.create", json!({ "spec": s }));
    let link = host.ip(&["link", "show", "dev", "cap0"]);
    assert!(!link.contains("PROMISC"), "{link}");
    let ns = host.netns.clone().expect("a netns");
    for hook in ["ingress", "egress"] {
        let out = std::process::Command::new("tc")
            .args(["-n", &ns, "filter", "show", "dev", "cap0", hook])
            .output()
            .expect("tc");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.contains("mirred"), "{hook}: {text}");
    }
    let ledgers: Vec<_> = std::fs::read_dir(host.state().join("capture"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(ledgers.is_empty(), "{ledgers:?}");
}
