//! Host networking end to end: a real vmhostd in its own network namespace, real taps and
//! bridges made through netlink, real TCG guests pinging each other.
//!
//! This kernel has no VLAN filtering and no 802.1Q: VLAN behaviour is proven in the lab host
//! (tests/tests/lab.rs).

use serde_json::{json, Value};
use std::time::Duration;
use vmhost_tests::{HostOptions, TestHost, GUEST_READY};

const BOOT: Duration = Duration::from_secs(90);

const LAN: &str = vmhost_tests::LAN_NETWORK;

fn host_with(extra: &str) -> TestHost {
    TestHost::start(HostOptions { netns: true, extra: extra.into(), ..HostOptions::default() })
}

fn nic_spec(host: &TestHost, name: &str, addr: &str, ping: &[&str]) -> Value {
    let mut s = host.kernel_spec(name);
    s["nics"] = json!([{ "network": "lan", "ipv4": {
        "mode": "static", "address": addr, "gateway": "10.0.0.1", "dns": ["10.0.0.1"], "search": ["lab.example"]
    }}]);
    let cmdline = format!("console=ttyS0 panic=-1 quiet vmhost.ping={}", ping.join(","));
    s["boot"]["cmdline"] = json!(cmdline);
    s
}

fn link<'a>(links: &'a [Value], name: &str) -> Option<&'a Value> {
    links.iter().find(|l| l["ifname"] == name)
}

#[test]
fn two_vms_on_a_bridge_reach_each_other_and_the_host() {
    let host = host_with(LAN);
    let br = link(&host.links(), "br-lan").cloned().expect("vmhostd created the bridge");
    assert_eq!(br["ifalias"], "vmhost:net=lan");
    assert!(host.ip(&["-4", "addr", "show", "dev", "br-lan"]).contains("10.0.0.1/24"));

    let a =
        host.call("vm.create", json!({ "spec": nic_spec(&host, "vm-a", "10.0.0.5/24", &["10.0.0.6", "10.0.0.1"]) }));
    let b =
        host.call("vm.create", json!({ "spec": nic_spec(&host, "vm-b", "10.0.0.6/24", &["10.0.0.5", "10.0.0.1"]) }));
    let tap_a = a["vm"]["nics"][0]["tap"].as_str().unwrap().to_string();
    let mac_a = a["vm"]["nics"][0]["mac"].as_str().unwrap().to_string();
    assert!(tap_a.len() <= 15);
    assert_ne!(b["vm"]["nics"][0]["tap"], a["vm"]["nics"][0]["tap"]);
    assert_ne!(b["vm"]["nics"][0]["mac"], a["vm"]["nics"][0]["mac"]);

    // Host side: a marked tap per NIC, on the bridge, up, with the bridge's MTU.
    let links = host.links();
    let t = link(&links, &tap_a).expect("tap exists");
    assert_eq!(t["ifalias"], "vmhost:vm=vm-a");
    assert_eq!(t["master"], "br-lan");
    assert_eq!(t["mtu"], br["mtu"]);
    assert!(t["flags"].as_array().unwrap().iter().any(|f| f == "UP"));

    // Guest side: the declared address applied, the MAC we chose, and both peers reachable.
    for (vm, peer) in [("vm-a", "10.0.0.6"), ("vm-b", "10.0.0.5")] {
        assert!(host.wait_serial(vm, GUEST_READY, BOOT), "{vm}:\n{}", host.serial(vm));
        for target in [peer, "10.0.0.1"] {
            let ok = format!("VMHOST-PING {target} ok");
            assert!(host.wait_serial(vm, &ok, BOOT), "{vm} cannot reach {target}:\n{}", host.serial(vm));
        }
    }
    assert!(host.serial("vm-a").contains("VMHOST-IP eth0 10.0.0.5/24 gw=10.0.0.1"));
    let neigh = host.ip(&["neigh", "show", "dev", "br-lan"]);
    assert!(neigh.contains(&mac_a), "the host saw vm-a's MAC {mac_a}: {neigh}");

    // host.info lists the network and its NICs.
    let info = host.call("host.info", json!({}));
    let lan = &info["networks"][0];
    assert_eq!((lan["name"].clone(), lan["ready"].clone()), (json!("lan"), json!(true)));
    let vms: Vec<&str> = lan["nics"].as_array().unwrap().iter().map(|n| n["vm"].as_str().unwrap()).collect();
    assert_eq!(vms, vec!["vm-a", "vm-b"]);

    // Destroy removes the VM's tap and nothing else.
    host.call("vm.destroy", json!({ "name": "vm-a" }));
    let links = host.links();
    assert!(link(&links, &tap_a).is_none(), "tap removed");
    assert!(link(&links, "br-lan").is_some(), "the network's bridge stays");
    assert_eq!(host.call("vm.get", json!({ "name": "vm-b" }))["status"], "running");
}

#[test]
fn orphans_are_removed_foreign_links_are_never_touched_and_bridges_are_adopted() {
    let mut host = host_with(LAN);
    let br_index = link(&host.links(), "br-lan").unwrap()["ifindex"].clone();
    host.call("vm.create", json!({ "spec": nic_spec(&host, "keep", "10.0.0.7/24", &[]) }));
    let keep_tap = host.call("vm.get", json!({ "name": "keep" }))["nics"][0]["tap"].as_str().unwrap().to_string();
    host.kill_daemon();

    // Fixtures made behind the daemon's back: an orphan with our marker, a foreign tap and a
    // foreign veth pair without it (one carrying an operator's alias).
    host.ip(&["tuntap", "add", "mode", "tap", "name", "vmhdeadbeefn0"]);
    host.ip(&["link", "set", "vmhdeadbeefn0", "alias", "vmhost:vm=ghost"]);
    host.ip(&["tuntap", "add", "mode", "tap", "name", "othertap"]);
    host.ip(&["link", "add", "foreign0", "type", "veth", "peer", "name", "foreign1"]);
    host.ip(&["link", "set", "foreign1", "alias", "operator:keep-out"]);
    host.ip(&["link", "set", "foreign0", "master", "br-lan"]);
    host.spawn_daemon();

    let links = host.links();
    assert!(link(&links, "vmhdeadbeefn0").is_none(), "orphan with our marker removed");
    for name in ["othertap", "foreign0", "foreign1"] {
        assert!(link(&links, name).is_some(), "{name} must be left alone");
    }
    assert_eq!(link(&links, "foreign0").unwrap()["master"], "br-lan", "a foreign port is not detached");
    assert_eq!(link(&links, "br-lan").unwrap()["ifindex"], br_index, "bridge adopted, not recreated");
    assert!(link(&links, &keep_tap).is_some(), "a running VM's tap survives the restart");
    assert!(host.daemon_log().contains("removed orphaned link"));
}

#[test]
fn an_unmarked_bridge_is_not_taken_over() {
    let mut host = host_with("");
    host.kill_daemon();
    host.ip(&["link", "add", "br-lan", "type", "bridge"]);
    std::fs::write(&host.config, std::fs::read_to_string(&host.config).unwrap() + LAN).unwrap();
    host.spawn_daemon();
    let check = host.call("host.check", json!({}));
    let item = check["items"].as_array().unwrap().iter().find(|i| i["name"] == "network.lan").unwrap().clone();
    assert_eq!(item["status"], "error", "{item}");
    assert!(item["detail"].as_str().unwrap().contains("marker"));
    let br = link(&host.links(), "br-lan").cloned().unwrap();
    assert!(br["ifalias"].is_null(), "nothing was written to the foreign bridge");
    assert!(!host.ip(&["-4", "addr", "show", "dev", "br-lan"]).contains("10.0.0.1"));
}

#[test]
fn bad_nic_input_is_refused_and_creates_nothing() {
    let host = host_with(LAN);
    host.call("vm.create", json!({ "spec": nic_spec(&host, "first", "10.0.0.5/24", &[]) }));
    let links_before = host.links().len();
    let base = |name: &str| nic_spec(&host, name, "10.0.0.9/24", &[]);
    let cases: Vec<(Value, i32, &str)> = vec![
        (
            {
                let mut s = base("dup");
                s["nics"][0]["ipv4"]["address"] = json!("10.0.0.5/24");
                s
            },
            3003,
            "spec.nics[0].ipv4.address",
        ),
        (
            {
                let mut s = base("host");
                s["nics"][0]["ipv4"]["address"] = json!("10.0.0.1/24");
                s["nics"][0]["ipv4"]["gateway"] = Value::Null;
                s
            },
            3003,
            "spec.nics[0].ipv4.address",
        ),
        (
            {
                let mut s = base("out");
                s["nics"][0]["ipv4"]["address"] = json!("10.0.1.9/24");
                s
            },
            2001,
            "spec.nics[0].ipv4.address",
        ),
        (
            {
                let mut s = base("mac");
                s["nics"][0]["mac"] = json!("01:00:5e:00:00:01");
                s
            },
            2001,
            "spec.nics[0].mac",
        ),
        (
            {
                let mut s = base("net");
                s["nics"][0]["network"] = json!("wan");
                s
            },
            3001,
            "spec.nics[0].network",
        ),
        (
            {
                let mut s = base("v0");
                s["nics"][0]["vlan"] = json!(0);
                s
            },
            2001,
            "spec.nics[0].vlan",
        ),
        (
            {
                let mut s = base("v4095");
                s["nics"][0]["vlan"] = json!(4095);
                s
            },
            2001,
            "spec.nics[0].vlan",
        ),
        (
            {
                let mut s = base("many");
                s["nics"] = json!(vec![json!({"network": "lan"}); 9]);
                s
            },
            2001,
            "spec.nics",
        ),
    ];
    for (spec, code, field) in cases {
        let name = spec["name"].as_str().unwrap().to_string();
        let (got, e) = host.call_err("vm.create", json!({ "spec": spec }));
        assert_eq!((got, e.field.as_deref()), (code, Some(field)), "{name}: {e:?}");
        assert_eq!(host.call_err("vm.get", json!({ "name": name })).0, 4040, "{name}: no record");
    }
    assert_eq!(host.links().len(), links_before, "no link was created");
}

#[test]
fn a_failed_launch_leaves_no_tap() {
    let host = host_with(LAN);
    let junk = host.images().join("junk-kernel");
    std::fs::write(&junk, vec![0u8; 4096]).unwrap();
    let mut spec = nic_spec(&host, "broken", "10.0.0.5/24", &[]);
    spec["boot"]["kernel"] = json!(junk);
    let before = host.links().len();
    assert_eq!(host.call_err("vm.create", json!({ "spec": spec })).0, 4001);
    assert_eq!(host.links().len(), before, "the tap went away with the failed launch");
    // The address is free again: a new VM may take it.
    host.call("vm.destroy", json!({ "name": "broken" }));
    host.call("vm.create", json!({ "spec": nic_spec(&host, "fixed", "10.0.0.5/24", &[]) }));
}

#[test]
fn image_vms_get_a_cloud_init_seed_matching_their_nics() {
    let mut host = host_with(LAN);
    for image in ["base.qcow2", "base2.qcow2"] {
        let st = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(host.images().join(image))
            .arg("64M")
            .status();
        assert!(st.unwrap().success());
    }
    let spec = json!({"name": "cloud", "cpu": 1, "memory_mib": 128,
        "boot": {"image": "base.qcow2", "disk_gib": 1},
        "nics": [{"network": "lan", "ipv4": {"mode": "static", "address": "10.0.0.8/24", "gateway": "10.0.0.1",
                  "dns": ["10.0.0.1"], "search": ["lab.example"]}}]});
    let r = host.call("vm.create", json!({ "spec": spec }));
    let mac = r["vm"]["nics"][0]["mac"].as_str().unwrap().to_string();
    let seed = host.state().join("seeds/cloud.img");
    let read = |name: &str| -> String { read_seed(&seed, name) };
    let net: Value = serde_json::from_str(&read("network-config")).unwrap();
    assert_eq!(
        net,
        json!({"version": 1, "config": [{"type": "physical", "name": "eth0", "mac_address": mac,
               "subnets": [{"type": "static", "address": "10.0.0.8/24", "gateway": "10.0.0.1",
                            "dns_nameservers": ["10.0.0.1"], "dns_search": ["lab.example"]}]}]})
    );
    assert!(read("meta-data").contains("\"local-hostname\":\"cloud\""));
    // The network config is applied at every boot, not only a new instance's.
    assert_eq!(read("vendor-data"), "#cloud-config\nupdates:\n  network:\n    when: [boot-new-instance, boot]\n");
    // A new instance id: 128 random bits, shown in the view.
    let id = instance_id(&seed);
    let hex = id.strip_prefix("vmhost-cloud-").unwrap_or_else(|| panic!("{id}"));
    assert!(hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    assert_eq!(r["vm"]["instance_id"], id.as_str());
    // QEMU has it attached read-only: a read-only descriptor the daemon opened, and a read-only
    // drive on that fd set.
    let pid = r["vm"]["pid"].as_i64().unwrap();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    let set = cmdline
        .split(' ')
        .find_map(|a| a.strip_suffix(&format!(",opaque={}", seed.display()))?.split(",set=").nth(1))
        .unwrap_or_else(|| panic!("no fd set for the seed: {cmdline}"))
        .to_string();
    assert!(cmdline.contains(&format!("file=/dev/fdset/{set},if=none,id=seed,format=raw,readonly=on")), "{cmdline}");
    let fd_dir = format!("/proc/{pid}/fd");
    let seed_fd = std::fs::read_dir(&fd_dir)
        .unwrap()
        .flatten()
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == seed))
        .expect("QEMU holds the seed");
    let fdinfo =
        std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", seed_fd.file_name().to_string_lossy())).unwrap();
    let flags = fdinfo.lines().find_map(|l| l.strip_prefix("flags:")).unwrap().trim();
    assert_eq!(u32::from_str_radix(flags, 8).unwrap() & 0o3, 0, "the seed is open read-only: {fdinfo}");

    // A changed network and memory: changed in place, QEMU restarted with a new seed holding
    // the new address, and the same instance id (cloud-init must not see a new instance: its
    // per-instance modules would run again); vendor-data makes it apply the new network.
    let mut changed = host.call("vm.get", json!({ "name": "cloud" }))["spec"].clone();
    changed["nics"][0]["ipv4"]["address"] = json!("10.0.0.9/24");
    changed["memory_mib"] = json!(160);
    let applied = host.call("vm.apply", json!({ "spec": changed, "timeout_s": 1 }));
    assert_ne!(applied["vm"]["pid"], r["vm"]["pid"], "restarted: {applied}");
    assert!(read("network-config").contains("10.0.0.9/24"));
    assert_eq!(instance_id(&seed), id, "vm.apply of a new network and memory_mib");
    assert_eq!(applied["vm"]["instance_id"], id.as_str());
    host.call("vm.restart", json!({ "name": "cloud", "force": true }));
    assert_eq!(instance_id(&seed), id, "vm.restart");

    // A daemon restart, then a start by the new daemon: the same id.
    host.stop_daemon();
    host.spawn_daemon();
    assert_eq!(host.call("vm.get", json!({ "name": "cloud" }))["instance_id"], id.as_str());
    host.call("vm.restart", json!({ "name": "cloud", "force": true }));
    assert_eq!(instance_id(&seed), id, "a daemon restart");

    // A revert to a snapshot puts the same root disk back: the same instance.
    host.call("vm.snapshot", json!({ "name": "cloud", "snapshot": "s1" }));
    host.call("vm.stop", json!({ "name": "cloud", "force": true }));
    host.call("vm.revert", json!({ "name": "cloud", "snapshot": "s1" }));
    host.call("vm.start", json!({ "name": "cloud" }));
    assert_eq!(instance_id(&seed), id, "a revert");
    host.call("vm.snapshot_delete", json!({ "name": "cloud", "snapshot": "s1" }));

    // A record written by a vmhost before ids were recorded keeps the id its guest last booted
    // with: the one in its seed, else the digest of its spec that vmhost used to derive.
    let record = host.state().join("vms/cloud.json");
    let drop_id = |host: &mut TestHost| {
        host.stop_daemon();
        let mut rec: Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
        assert!(rec.as_object_mut().unwrap().remove("instance_id").is_some(), "{rec}");
        std::fs::write(&record, serde_json::to_vec_pretty(&rec).unwrap()).unwrap();
        host.spawn_daemon();
        let rec: Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
        (rec["instance_id"].as_str().expect("recorded at start").to_string(), rec["spec"].clone())
    };
    let (adopted, _) = drop_id(&mut host);
    assert_eq!(adopted, id, "the id in the seed");
    std::fs::remove_file(&seed).unwrap();
    let (adopted, spec) = drop_id(&mut host);
    let spec: vmhost::api::VmSpec = serde_json::from_value(spec).unwrap();
    assert_eq!(adopted, vmhost::seed::legacy_instance_id(&spec), "no seed: the old digest");
    assert_eq!(host.call("vm.get", json!({ "name": "cloud" }))["instance_id"], adopted.as_str());
    host.call("vm.restart", json!({ "name": "cloud", "force": true }));
    assert_eq!(instance_id(&seed), adopted);

    // A replace with a new boot image makes a new root disk: a new instance.
    let mut replaced = host.call("vm.get", json!({ "name": "cloud" }))["spec"].clone();
    replaced["boot"]["image"] = json!("base2.qcow2");
    let r = host.call("vm.apply", json!({ "spec": replaced, "replace": true }));
    let new_id = instance_id(&seed);
    assert!(new_id.starts_with("vmhost-cloud-") && new_id != id && new_id != adopted, "{new_id}");
    assert_eq!(r["vm"]["instance_id"], new_id.as_str());
    host.call("vm.destroy", json!({ "name": "cloud" }));
    assert!(!seed.exists(), "destroy removes the seed");
}

/// File `name` of the seed volume at `seed` (a FAT volume labelled CIDATA).
fn read_seed(seed: &std::path::Path, name: &str) -> String {
    use std::io::Read;
    let fs = fatfs::FileSystem::new(std::fs::File::open(seed).unwrap(), fatfs::FsOptions::new()).unwrap();
    assert_eq!(fs.volume_label().trim(), "CIDATA");
    let mut text = String::new();
    fs.root_dir().open_file(name).unwrap().read_to_string(&mut text).unwrap();
    text
}

/// The `instance-id` in the seed's meta-data.
fn instance_id(seed: &std::path::Path) -> String {
    let meta: Value = serde_json::from_str(&read_seed(seed, "meta-data")).unwrap();
    meta["instance-id"].as_str().unwrap().to_string()
}

#[test]
fn killing_the_daemon_mid_create_leaves_no_orphan_link() {
    // Autostart off: the check is what the restart settles, before anything starts a VM again.
    let mut host = host_with(&format!("{LAN}\n[lifecycle]\nautostart = false\n"));
    // Kill vmhostd at each step of a create with two NICs (its crash points, docs/lifecycle.md),
    // restart, and check that every link carrying a VM marker belongs to a VM whose QEMU runs.
    let steps =
        ["create:recorded", "create:disks", "launch:recorded", "launch:taps", "launch:spawned", "launch:launched"];
    for (round, step) in steps.into_iter().enumerate() {
        let name = format!("k{round}");
        let mut spec = nic_spec(&host, &name, &format!("10.0.0.{}/24", 20 + round), &[]);
        spec["nics"] = json!([spec["nics"][0].clone(), {"network": "lan"}]);
        host.crash_during(step, "vm.create", json!({ "spec": spec }));
        let running: Vec<String> = host
            .call("vm.list", json!({}))
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["status"] == "running")
            .map(|v| v["name"].as_str().unwrap().to_string())
            .collect();
        for l in host.links() {
            if let Some(owner) = l["ifalias"].as_str().and_then(|a| a.strip_prefix("vmhost:vm=")) {
                assert!(
                    running.iter().any(|r| r == owner),
                    "round {round}: orphan {} of {owner} after {step}",
                    l["ifname"]
                );
            }
        }
        let pids = host.qemu_pids();
        assert!(pids.len() <= running.len(), "round {round}: QEMUs {pids:?} but running {running:?}");
    }
}

#[test]
fn a_networking_failure_rolls_the_create_back() {
    // "ext" names a bridge that does not exist: the tap step fails after the record was written.
    let host = host_with(&format!("{LAN}\n[networks.ext]\nbridge = \"br-missing\"\n"));
    let check = host.call("host.check", json!({}));
    let ext = check["items"].as_array().unwrap().iter().find(|i| i["name"] == "network.ext").unwrap().clone();
    assert_eq!(ext["status"], "error");
    let before = host.links().len();
    let mut spec = nic_spec(&host, "half", "10.0.0.5/24", &[]);
    spec["nics"] = json!([spec["nics"][0].clone(), {"network": "ext"}]);
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!(code, 4001, "{e:?}");
    assert_eq!(e.details["step"], "network.bridge");
    assert_eq!(e.field.as_deref(), Some("spec.nics[1]"));
    assert_eq!(host.links().len(), before, "the first NIC's tap was removed too");
    assert!(host.qemu_pids().is_empty());
    let v = host.call("vm.get", json!({ "name": "half" }));
    assert_eq!(v["status"], "failed");
    assert_eq!(host.call("host.info", json!({}))["cpu"]["allocated"], 0, "allocations released");
    // Its address is free for another VM.
    host.call("vm.create", json!({ "spec": nic_spec(&host, "other", "10.0.0.5/24", &[]) }));
}
