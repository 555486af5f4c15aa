//! Tests against the real kernel, each in a network namespace of its own.
//!
//! [`in_netns`] runs a test body in a new thread that first calls `unshare(CLONE_NEWNET)`: a
//! network namespace belongs to a thread, so tests running in parallel keep theirs, and everything
//! a body creates vanishes with its namespace. Netlink sockets, ICMP sockets and `ip` child
//! processes made inside the body all live in that namespace. Needs root.
//!
//! The development machines' kernel has veth but neither dummy nor 802.1Q links, so here `net.apply`
//! is exercised with what exists: deleting marked links (veths marked by hand), leaving foreign
//! ones alone, refusing names, idempotence, and a clear 5101 when the kernel cannot create a dummy.
//! Creating VLANs and dummies is proven in the test guest (`tests/guest.rs`), whose kernel has both;
//! the creation test here runs in full wherever the kernel has a dummy driver.

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::agent::{Agent, Paths};
use crate::apply::{self, ApplyParams, MARKER};
use crate::netlink::{Netlink, NetlinkError};
use crate::probe::{ping_within, ProbeOutcome};
use crate::protocol::{handle_line, parse_params, APPLY_FAILED, INVALID_SEMANTICS};
use crate::state::Snapshot;

/// Runs `body` in a fresh network namespace, on a thread of its own; re-raises its panic.
fn in_netns<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    let thread = std::thread::spawn(move || {
        // SAFETY: unshare affects only this thread's namespaces.
        let ret = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(ret, 0, "unshare(CLONE_NEWNET) needs root: {}", std::io::Error::last_os_error());
        body()
    });
    match thread.join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Runs `ip ARGS` in the current thread's namespace (test setup only: the agent never runs `ip`).
fn ip(args: &str) {
    let out = Command::new("ip").args(args.split_whitespace()).output().expect("run ip (iproute2)");
    assert!(out.status.success(), "ip {args}: {}", String::from_utf8_lossy(&out.stderr));
}

fn index_of(netlink: &mut Netlink, name: &str) -> u32 {
    netlink.link_by_name(name).expect("get link").unwrap_or_else(|| panic!("{name} missing")).index
}

fn call(agent: &mut Agent, method: &str, params: Value) -> Value {
    let line = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string();
    let text = handle_line(line.as_bytes(), agent).expect("a reply");
    serde_json::from_str(text.trim_start()).expect("reply is JSON")
}

fn test_agent(dir: &tempfile::TempDir) -> Agent {
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, "nameserver 10.1.0.1\nsearch example.org\n").expect("write resolv.conf");
    Agent::new(Paths { resolv_conf: resolv, intent: dir.path().join("run/intent.json"), ..Paths::default() })
}

#[test]
fn a_fresh_namespace_has_only_loopback() {
    in_netns(|| {
        let mut nl = Netlink::open().expect("netlink");
        let links = nl.links().expect("links");
        assert_eq!(links.len(), 1, "{links:?}");
        assert_eq!((links[0].name.as_str(), links[0].up, links[0].kind.as_str()), ("lo", false, ""));
        assert!(nl.addresses().expect("addresses").is_empty());
        nl.set_up(links[0].index, true).expect("lo up");
        let snapshot = Snapshot::take(&mut nl).expect("snapshot");
        assert!(snapshot.links[0].up);
        assert_eq!(snapshot.addresses_of(1), ["127.0.0.1/8".parse().expect("net")]);
        // Loopback routes live in the local table, which is not reported.
        assert!(snapshot.routes.is_empty(), "{:?}", snapshot.routes);
    });
}

#[test]
fn reads_and_changes_links_addresses_and_routes() {
    in_netns(|| {
        ip("link add va address 02:00:00:00:01:0a type veth peer name vb");
        let mut nl = Netlink::open().expect("netlink");
        let va = index_of(&mut nl, "va");
        nl.set_up(va, true).expect("up");
        nl.add_address(va, Ipv4Addr::new(10, 1, 0, 2), 24).expect("add address");
        nl.set_alias(va, "test alias").expect("alias");
        ip("route add default via 10.1.0.1 dev va metric 7");

        let s = Snapshot::take(&mut nl).expect("snapshot");
        let link = s.link("va").expect("va");
        assert_eq!((link.kind.as_str(), link.alias.as_str(), link.up), ("veth", "test alias", true));
        assert_eq!(link.mac, Some([2, 0, 0, 0, 1, 0x0a]));
        assert_eq!(s.addresses_of(va), ["10.1.0.2/24".parse().expect("net")]);
        let default = s.default_routes();
        assert_eq!(default.len(), 1);
        assert_eq!(
            (default[0].gateway, default[0].oif, default[0].priority),
            (Some(Ipv4Addr::new(10, 1, 0, 1)), Some(va), 7)
        );
        assert!(s.routes.iter().any(|r| r.dst == Ipv4Addr::new(10, 1, 0, 0) && r.dst_len == 24 && r.gateway.is_none()));

        // The kernel's refusals come back as errnos.
        let again = nl.add_address(va, Ipv4Addr::new(10, 1, 0, 2), 24).expect_err("duplicate address");
        assert_eq!(again.errno(), Some(libc::EEXIST), "{again}");
        let gone = nl.delete_link(9999).expect_err("no such link");
        assert_eq!(gone.errno(), Some(libc::ENODEV), "{gone}");
        assert_eq!(nl.link_by_name("nothere").expect("lookup"), None);
        // Deleting the address also takes the route via it.
        nl.delete_address(va, Ipv4Addr::new(10, 1, 0, 2), 24).expect("delete address");
        let s = Snapshot::take(&mut nl).expect("snapshot");
        assert!(s.addresses_of(va).is_empty());
        assert!(s.default_routes().is_empty());
        nl.delete_link(va).expect("delete link");
        assert_eq!(nl.link_by_name("vb").expect("lookup"), None, "the peer goes with it");
    });
}

#[test]
fn creating_links_the_kernel_lacks_is_a_clear_error() {
    in_netns(|| {
        let mut nl = Netlink::open().expect("netlink");
        match nl.create_dummy("d0") {
            Ok(()) => {
                // A kernel with the dummy driver: the link exists, down and unmarked.
                let link = nl.link_by_name("d0").expect("lookup").expect("created");
                assert_eq!((link.kind.as_str(), link.up, link.alias.as_str()), ("dummy", false, ""));
            }
            Err(e) => {
                assert!(matches!(e, NetlinkError::Kernel { errno: libc::EOPNOTSUPP, .. }), "{e}");
                assert!(e.to_string().starts_with("create dummy: "), "{e}");
            }
        }
        let lo = index_of(&mut nl, "lo");
        let e = nl.create_vlan("lo.5", lo, 5).expect_err("no VLAN on loopback, or no 8021q");
        assert!(e.errno().is_some(), "{e}");
    });
}

#[test]
fn apply_deletes_owned_links_keeps_foreign_ones_and_is_idempotent() {
    in_netns(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut agent = test_agent(&dir);
        ip("link add own0 type veth peer name own1");
        ip("link add eth0 address 02:00:00:00:00:01 type veth peer name eth0p");
        ip("link set eth0 up");
        ip("addr add 10.1.0.5/24 dev eth0");
        ip("route add default via 10.1.0.1 dev eth0");
        ip("link add mine type veth peer name minep");
        let mut nl = Netlink::open().expect("netlink");
        let own0 = index_of(&mut nl, "own0");
        nl.set_alias(own0, MARKER).expect("mark");
        let mine = index_of(&mut nl, "mine");
        nl.set_alias(mine, "operator").expect("alias");

        let v = call(&mut agent, "net.apply", json!({"interfaces": []}));
        assert_eq!(v["result"], json!({"changed": true, "created": [], "updated": [], "deleted": ["own0"]}), "{v}");
        assert!(nl.link_by_name("own0").expect("lookup").is_none());
        for kept in ["eth0", "mine", "minep"] {
            assert!(nl.link_by_name(kept).expect("lookup").is_some(), "{kept}");
        }
        let saved: ApplyParams =
            serde_json::from_slice(&std::fs::read(dir.path().join("run/intent.json")).expect("intent"))
                .expect("intent JSON");
        assert!(saved.interfaces.is_empty());

        let v = call(&mut agent, "net.apply", json!({"interfaces": []}));
        assert_eq!(v["result"]["changed"], false, "{v}");

        // Names of links the agent does not own are refused before anything changes.
        for name in ["eth0", "mine", "lo"] {
            let v = call(&mut agent, "net.apply", json!({"interfaces": [{"name": name, "address": "10.9.0.1/24"}]}));
            assert_eq!(v["error"]["code"], INVALID_SEMANTICS, "{v}");
            assert_eq!(v["error"]["data"]["field"], "interfaces[0].name");
        }
        let v = call(
            &mut agent,
            "net.apply",
            json!({"interfaces": [{"name": "v5", "link": "eth0", "vlan_id": 5, "address": "10.1.0.9/24"}]}),
        );
        assert_eq!(v["error"]["data"]["field"], "interfaces[0].address", "overlaps eth0's network: {v}");
        // The primary NIC and the default route are as they were.
        let s = Snapshot::take(&mut nl).expect("snapshot");
        let eth0 = index_of(&mut nl, "eth0");
        assert_eq!(s.addresses_of(eth0), ["10.1.0.5/24".parse().expect("net")]);
        assert_eq!(s.default_routes()[0].gateway, Some(Ipv4Addr::new(10, 1, 0, 1)));
    });
}

#[test]
fn apply_creates_dummies_where_the_kernel_can() {
    in_netns(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut agent = test_agent(&dir);
        let request = json!({"interfaces": [{"name": "dummy0", "address": "192.168.50.1/32"}]});
        let v = call(&mut agent, "net.apply", request.clone());
        let mut nl = Netlink::open().expect("netlink");
        if v["error"].is_object() {
            // This kernel has no dummy driver: 5101 names the step, nothing is left behind, and the
            // intent was saved before the attempt.
            assert_eq!(v["error"]["code"], APPLY_FAILED, "{v}");
            assert_eq!(v["error"]["data"]["step"], "create dummy dummy0");
            assert_eq!(v["error"]["data"]["interface"], "dummy0");
            assert_eq!(v["error"]["data"]["errno"], libc::EOPNOTSUPP);
            assert_eq!(v["error"]["data"]["completed"], json!([]));
            assert!(nl.link_by_name("dummy0").expect("lookup").is_none());
            let saved: ApplyParams =
                serde_json::from_slice(&std::fs::read(dir.path().join("run/intent.json")).expect("intent"))
                    .expect("intent JSON");
            assert_eq!(saved, parse_params::<ApplyParams>(Some(request)).expect("params"));
            return;
        }
        assert_eq!(v["result"], json!({"changed": true, "created": ["dummy0"], "updated": [], "deleted": []}), "{v}");
        let link = nl.link_by_name("dummy0").expect("lookup").expect("created");
        assert_eq!((link.kind.as_str(), link.alias.as_str(), link.up), ("dummy", MARKER, true));
        assert_eq!(call(&mut agent, "net.apply", request)["result"]["changed"], false);
        let v = call(&mut agent, "net.apply", json!({"interfaces": []}));
        assert_eq!(v["result"]["deleted"], json!(["dummy0"]), "{v}");
    });
}

#[test]
fn plan_execute_and_verify_on_the_real_state() {
    in_netns(|| {
        // The steps of net.apply one by one: a marked link with an address is planned away,
        // executed, and the result verifies; a default route changed behind the agent's back
        // does not.
        ip("link add own0 type veth peer name own1");
        ip("link add eth0 type veth peer name eth0p");
        ip("link set eth0 up");
        ip("addr add 10.1.0.5/24 dev eth0");
        ip("addr add 10.3.0.1/24 dev own0");
        ip("route add default via 10.1.0.1 dev eth0");
        let mut nl = Netlink::open().expect("netlink");
        let own0 = index_of(&mut nl, "own0");
        nl.set_alias(own0, MARKER).expect("mark");
        let before = Snapshot::take(&mut nl).expect("snapshot");
        let params: ApplyParams = parse_params(Some(json!({"interfaces": []}))).expect("params");
        let desired = apply::validate(&params, &before).expect("valid");
        let plan = apply::plan(&desired, &before);
        assert_eq!(plan.steps, [apply::Step::Delete { name: "own0".into(), index: own0 }]);
        apply::execute(&plan.steps, &mut nl, &before).expect("execute");
        let after = Snapshot::take(&mut nl).expect("snapshot");
        assert_eq!(apply::verify(&desired, &before, &after), Vec::<String>::new());
        ip("route replace default via 10.1.0.2 dev eth0");
        let moved = Snapshot::take(&mut nl).expect("snapshot");
        let failures = apply::verify(&desired, &before, &moved);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].starts_with("default routes changed"), "{failures:?}");
    });
}

#[test]
fn net_state_and_check_report_the_namespace() {
    in_netns(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut agent = test_agent(&dir);
        ip("link set lo up");
        ip("link add eth0 address 02:00:00:00:00:01 type veth peer name eth0p");
        ip("link set eth0 up");
        ip("link set eth0p up");
        ip("addr add 10.1.0.5/24 dev eth0");
        ip("addr add 10.1.0.1/24 dev eth0p");
        ip("route add default via 10.1.0.1 dev eth0");
        let v = call(&mut agent, "net.state", json!({}));
        let state = &v["result"];
        let eth0 = state["interfaces"].as_array().and_then(|a| a.iter().find(|i| i["name"] == "eth0")).expect("eth0");
        assert_eq!(
            eth0,
            &json!({"name": "eth0", "mac": "02:00:00:00:00:01", "up": true, "mtu": 1500, "kind": "veth", "alias": "",
                    "addresses": ["10.1.0.5/24"]})
        );
        assert!(state["routes"]
            .as_array()
            .expect("routes")
            .contains(&json!({"dst": "default", "gateway": "10.1.0.1", "dev": "eth0"})));
        assert_eq!(state["dns"], json!({"servers": ["10.1.0.1"], "search": ["example.org"]}));

        // The gateway (the veth peer, an address of this namespace) answers the probe.
        let good = json!({"expected": {"interfaces": [{"mac": "02:00:00:00:00:01", "addresses": ["10.1.0.5/24"], "up": true}],
                          "gateway": "10.1.0.1", "dns": ["10.1.0.1"], "search": ["example.org"], "probe_gateway": true}});
        let v = call(&mut agent, "net.check", good);
        assert_eq!(v["result"]["ok"], true, "{v}");
        let bad = json!({"expected": {"interfaces": [{"mac": "02:00:00:00:00:01", "addresses": ["10.1.0.6/24"]}],
                         "gateway": "10.1.0.254", "probe_gateway": true}});
        let start = Instant::now();
        let v = call(&mut agent, "net.check", bad);
        let failed: Vec<&str> = v["result"]["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .filter(|c| c["ok"] == false)
            .filter_map(|c| c["name"].as_str())
            .collect();
        assert_eq!(
            failed,
            ["address 10.1.0.6/24 on eth0", "default route via 10.1.0.254", "gateway 10.1.0.254 reachable"]
        );
        assert!(start.elapsed() < Duration::from_secs(3), "probe bounded: {:?}", start.elapsed());
    });
}

#[test]
fn a_capture_nic_is_made_promiscuous_and_up_checked_and_never_addressed() {
    in_netns(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut agent = test_agent(&dir);
        ip("link add eth0 address 02:00:00:00:00:01 type veth peer name eth0p");
        ip("link add eth1 address 02:00:00:00:00:02 type veth peer name eth1p");
        ip("link set eth0 up");
        ip("addr add 10.1.0.5/24 dev eth0");
        let mut nl = Netlink::open().expect("netlink");
        let eth1 = index_of(&mut nl, "eth1");
        // The flag round trip, as the kernel reports it.
        nl.set_promisc(eth1, true).expect("promisc on");
        assert!(nl.link_by_name("eth1").expect("get").expect("eth1").promisc);
        nl.set_promisc(eth1, false).expect("promisc off");
        assert!(!nl.link_by_name("eth1").expect("get").expect("eth1").promisc);

        let check = json!({"expected": {"interfaces": [
            {"mac": "02:00:00:00:00:01", "addresses": ["10.1.0.5/24"]},
            {"mac": "02:00:00:00:00:02", "capture": true}]}});
        let failed = |v: &Value| -> Vec<String> {
            v["result"]["checks"]
                .as_array()
                .expect("checks")
                .iter()
                .filter(|c| c["ok"] == false)
                .filter_map(|c| c["name"].as_str().map(str::to_string))
                .collect()
        };
        let v = call(&mut agent, "net.check", check.clone());
        assert_eq!(failed(&v), ["capture eth1 up", "capture eth1 promiscuous"], "{v}");

        let apply = json!({"interfaces": [], "capture": ["02:00:00:00:00:02"]});
        let v = call(&mut agent, "net.apply", apply.clone());
        assert_eq!(v["result"], json!({"changed": true, "created": [], "updated": ["eth1"], "deleted": []}), "{v}");
        let v = call(&mut agent, "net.check", check.clone());
        assert_eq!(v["result"]["ok"], true, "{v}");
        let v = call(&mut agent, "net.apply", apply);
        assert_eq!(v["result"]["changed"], false, "{v}");
        let s = Snapshot::take(&mut nl).expect("snapshot");
        let link = s.link("eth1").expect("eth1");
        assert!(link.up && link.promisc, "{link:?}");
        assert!(s.addresses_of(eth1).is_empty(), "the agent never addresses a capture NIC");
        assert_eq!(s.addresses_of(index_of(&mut nl, "eth0")), ["10.1.0.5/24".parse().expect("net")]);

        // net.state reports the flag only when asked.
        let v = call(&mut agent, "net.state", json!({}));
        let find = |v: &Value, name: &str| {
            v["result"]["interfaces"].as_array().and_then(|a| a.iter().find(|i| i["name"] == name).cloned())
        };
        assert!(find(&v, "eth1").expect("eth1").get("promisc").is_none(), "{v}");
        let v = call(&mut agent, "net.state", json!({"promisc": true}));
        assert_eq!(find(&v, "eth1").expect("eth1")["promisc"], true, "{v}");
        assert_eq!(find(&v, "eth0").expect("eth0")["promisc"], false, "{v}");

        // An address someone else puts on it fails the check by name.
        ip("addr add 192.168.9.9/24 dev eth1");
        let v = call(&mut agent, "net.check", check);
        assert_eq!(failed(&v), ["capture eth1 no address"], "{v}");
    });
}

#[test]
fn probes_use_raw_or_datagram_sockets_and_stay_bounded() {
    in_netns(|| {
        ip("link set lo up");
        // New namespaces forbid ICMP datagram sockets (ping_group_range "1 0"): the raw socket is used.
        let raw = ping_within(Ipv4Addr::LOCALHOST, Duration::from_secs(1));
        assert!(raw.is_reply(), "{raw}");
        std::fs::write("/proc/sys/net/ipv4/ping_group_range", "0 0").expect("allow ICMP datagram sockets");
        let dgram = ping_within(Ipv4Addr::LOCALHOST, Duration::from_secs(1));
        assert!(dgram.is_reply(), "{dgram}");
        // No route at all: a prompt failure, not a wait.
        let start = Instant::now();
        let outcome = ping_within(Ipv4Addr::new(10, 99, 0, 1), Duration::from_secs(1));
        assert!(matches!(outcome, ProbeOutcome::Failed(_)), "{outcome}");
        assert!(start.elapsed() < Duration::from_millis(500));
        // A silent neighbour: no reply within the bound.
        ip("link add va type veth peer name vb");
        ip("link set va up");
        ip("addr add 10.2.0.2/24 dev va");
        let start = Instant::now();
        let outcome = ping_within(Ipv4Addr::new(10, 2, 0, 1), Duration::from_millis(600));
        assert_eq!(outcome, ProbeOutcome::NoReply(Duration::from_millis(600)));
        assert!(start.elapsed() < Duration::from_millis(900), "{:?}", start.elapsed());
    });
}

/// A 64 MiB ext4 on a loop device mounted at a temp directory, and a read-only bind mount of it
/// (what a systemd unit's `ProtectSystem=` makes of a writable file system); unmounted when
/// dropped.
struct LoopFs {
    dir: tempfile::TempDir,
}

impl LoopFs {
    fn new() -> LoopFs {
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("fs.img");
        std::fs::File::create(&image).and_then(|f| f.set_len(64 << 20)).expect("image");
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image));
        std::fs::create_dir(dir.path().join("mnt")).expect("mount point");
        std::fs::create_dir(dir.path().join("view")).expect("mount point");
        run(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(dir.path().join("mnt")));
        let fs = LoopFs { dir };
        run(Command::new("mount").arg("--bind").arg(fs.mnt()).arg(fs.view()));
        run(Command::new("mount").args(["-o", "remount,bind,ro"]).arg(fs.view()));
        fs
    }

    fn mnt(&self) -> std::path::PathBuf {
        self.dir.path().join("mnt")
    }

    fn view(&self) -> std::path::PathBuf {
        self.dir.path().join("view")
    }

    /// The kernel's own `/proc/self/mountinfo` line of `point`.
    fn mountinfo_line(point: &std::path::Path) -> String {
        let table = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        table
            .lines()
            .find(|l| l.split_whitespace().nth(4) == point.to_str())
            .unwrap_or_else(|| panic!("{} is not mounted:\n{table}", point.display()))
            .to_string()
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.view()).status();
        let _ = Command::new("umount").arg(self.mnt()).status();
    }
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run");
    assert!(out.status.success(), "{cmd:?}: {out:?}");
}

/// FIFREEZE on `mnt` now: `EBUSY` when it is frozen already (then nothing changed), `Ok` when it
/// was not (and it is thawed again right away).
fn frozen(mnt: &std::path::Path) -> bool {
    use std::os::fd::AsRawFd;
    let dir = std::fs::File::open(mnt).expect("open the mount point");
    // SAFETY: plain ioctls on our own descriptor.
    let r = unsafe { libc::ioctl(dir.as_raw_fd(), 0xC004_5877, 0) };
    if r == 0 {
        unsafe { libc::ioctl(dir.as_raw_fd(), 0xC004_5878, 0) };
        return false;
    }
    std::io::Error::last_os_error().raw_os_error() == Some(libc::EBUSY)
}

/// An agent whose `/proc/self/mountinfo` is `table` (only the test's own mounts: the agent must
/// never freeze this machine's root).
fn agent_with_mounts(proc_root: &tempfile::TempDir, table: &str) -> Agent {
    std::fs::create_dir_all(proc_root.path().join("self")).expect("proc/self");
    std::fs::write(proc_root.path().join("self/mountinfo"), table).expect("mountinfo");
    Agent::new(Paths { proc_root: proc_root.path().to_path_buf(), ..Paths::default() })
}

fn rpc(agent: &mut Agent, line: &str) -> Value {
    serde_json::from_str(handle_line(line.as_bytes(), agent).expect("a reply").trim_start()).expect("JSON")
}

#[test]
fn fs_freeze_freezes_a_real_file_system_and_thaws_it_or_lets_the_watchdog() {
    let fs = LoopFs::new();
    let proc_root = tempfile::tempdir().expect("tempdir");
    let table = format!("22 1 0:21 / /proc rw,relatime - proc proc rw\n{}\n", LoopFs::mountinfo_line(&fs.mnt()));
    let mut agent = agent_with_mounts(&proc_root, &table);

    let v = rpc(&mut agent, r#"{"jsonrpc":"2.0","id":1,"method":"fs.freeze","params":{"timeout_s":30}}"#);
    assert_eq!(v["result"], json!({"mounts": [fs.mnt().display().to_string()], "skipped": []}), "{v}");
    assert!(frozen(&fs.mnt()), "FIFREEZE again is EBUSY: it is frozen");
    let v = rpc(&mut agent, r#"{"jsonrpc":"2.0","id":2,"method":"fs.thaw","params":{}}"#);
    assert_eq!(v["result"], json!({"mounts": [fs.mnt().display().to_string()]}), "{v}");
    assert!(!frozen(&fs.mnt()), "thawed");
    std::fs::write(fs.mnt().join("after"), b"x").expect("writable again");

    // No thaw: the watchdog thaws it after timeout_s.
    rpc(&mut agent, r#"{"jsonrpc":"2.0","id":3,"method":"fs.freeze","params":{"timeout_s":1}}"#);
    let deadline = Instant::now() + Duration::from_secs(30);
    while frozen(&fs.mnt()) {
        assert!(Instant::now() < deadline, "the watchdog did not thaw the file system");
        std::thread::sleep(Duration::from_millis(50));
    }
    let v = rpc(&mut agent, r#"{"jsonrpc":"2.0","id":4,"method":"fs.thaw","params":{}}"#);
    assert_eq!(v["result"]["mounts"], json!([]), "nothing left to thaw: {v}");
}

/// What the Debian 12 guest showed: under `ProtectSystem=strict` the root is a read-only mount of
/// a writable file system. The superblock decides: the read-only view is frozen (and the file
/// system with it), and a file system the kernel cannot freeze is reported as skipped, with the
/// others frozen.
#[test]
fn fs_freeze_freezes_through_a_read_only_view_and_reports_what_it_skipped() {
    let fs = LoopFs::new();
    let view = LoopFs::mountinfo_line(&fs.view());
    let fields: Vec<&str> = view.split_whitespace().collect();
    assert!(fields[5].split(',').any(|o| o == "ro"), "the view is a read-only mount: {view}");
    assert_eq!(fields.last().map(|o| o.split(',').next()), Some(Some("rw")), "of a writable superblock: {view}");
    // /proc, given a block device as its source, stands for a file system on a disk that the
    // kernel cannot freeze (vfat, ...): the real FIFREEZE on it fails with EOPNOTSUPP.
    let unfreezable = "23 1 0:21 / /proc rw,relatime - vfat /dev/vdz rw,fmask=0077";
    let proc_root = tempfile::tempdir().expect("tempdir");
    let mut agent = agent_with_mounts(&proc_root, &format!("{view}\n{unfreezable}\n"));

    let v = rpc(&mut agent, r#"{"jsonrpc":"2.0","id":1,"method":"fs.freeze","params":{"timeout_s":30}}"#);
    assert_eq!(v["result"]["mounts"], json!([fs.view().display().to_string()]), "{v}");
    assert_eq!(
        v["result"]["skipped"],
        json!([{"mount": "/proc", "fstype": "vfat", "errno": libc::EOPNOTSUPP,
                "error": std::io::Error::from_raw_os_error(libc::EOPNOTSUPP).to_string()}]),
        "{v}"
    );
    assert!(frozen(&fs.mnt()), "the file system is frozen, through its read-only view");
    let v = rpc(&mut agent, r#"{"jsonrpc":"2.0","id":2,"method":"fs.thaw","params":{}}"#);
    assert_eq!(v["result"]["mounts"], json!([fs.view().display().to_string()]), "{v}");
    assert!(!frozen(&fs.mnt()), "thawed");
}
