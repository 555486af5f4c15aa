//! End to end: the static agent inside the test guest (Debian cloud kernel, busybox initramfs,
//! QEMU/TCG), driven through the virtio-serial chardev socket exactly as vmhostd will drive it.
//!
//! The test builds the static x86_64 agent, strips a copy and puts it into a test initramfs
//! (`tests/guest/build-agent-guest.sh`), checks the size budget, boots the guest with a
//! virtio-serial port `org.vmhost.agent.0` on a UNIX socket plus a user-mode NIC configured through
//! `ip=`, and then plays the host: sync, hello, agent.info (RSS budget), net.state, net.check (passing,
//! and failing by name for a wrong address and a wrong gateway), net.apply (VLAN + dummy, again
//! unchanged, then removal), a capture NIC (a second NIC without address set promiscuous and up,
//! then checked), hostile frames, and a disconnect with stale data in both directions
//! followed by a reconnect and a successful sync, and finally a guest reset under a host that stays
//! connected.
//!
//! Needs root-free QEMU (qemu-system-x86_64) and whatever `tests/guest/build.sh` installs; takes
//! about a minute, most of it the first release build and the TCG boot.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Stripped binary size budget.
const SIZE_BUDGET: u64 = 2 * 1024 * 1024;
/// Resident set size budget, KiB.
const RSS_BUDGET_KIB: u64 = 4 * 1024;
/// The guest NIC's MAC.
const MAC: &str = "52:54:00:12:34:56";
/// The second guest NIC's MAC: no address, the guest side of a capture (monitor) NIC.
const CAPTURE_MAC: &str = "52:54:00:12:34:57";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace().join("target"))
}

/// Builds the static, stripped agent and the test initramfs holding it as /bin/vmhost-agent
/// (`tests/guest/build-agent-guest.sh`); returns (agent, kernel, initrd, kernel version).
fn build_guest() -> (PathBuf, PathBuf, PathBuf, String) {
    let out = target_dir().join("guest");
    let status = Command::new(workspace().join("tests/guest/build-agent-guest.sh"))
        .current_dir(workspace())
        .arg(&out)
        .status()
        .expect("run tests/guest/build-agent-guest.sh");
    assert!(status.success(), "tests/guest/build-agent-guest.sh failed");
    let version = std::fs::read_to_string(out.join("kernel-version")).expect("kernel-version").trim().to_string();
    let agent = target_dir().join("guest-agent/vmhost-agent");
    (agent, out.join("vmlinuz"), out.join("initramfs-agent.cpio.gz"), version)
}

/// A running QEMU, killed on drop.
struct Vm {
    child: Child,
    log: PathBuf,
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Vm {
    fn serial(&self) -> String {
        std::fs::read(&self.log).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    fn wait_for_serial(&mut self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.serial().contains(needle) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("QEMU exited ({status}) before {needle:?}; serial:\n{}", self.serial());
            }
            assert!(Instant::now() < deadline, "no {needle:?} within {timeout:?}; serial:\n{}", self.serial());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn boot(kernel: &Path, initrd: &Path, dir: &Path) -> Vm {
    let sock = dir.join("agent.sock");
    let log = dir.join("serial.log");
    let child = Command::new("qemu-system-x86_64")
        // No -no-reboot: the test resets the guest through QMP and expects it to boot again.
        .args(["-accel", "tcg", "-M", "q35", "-m", "256", "-nodefaults", "-display", "none"])
        .arg("-serial")
        .arg(format!("file:{}", log.display()))
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", dir.join("qmp.sock").display()))
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", "console=ttyS0 panic=-1 quiet ip=10.0.2.15::10.0.2.2:255.255.255.0:g:eth0:off:10.0.2.3:"])
        .args(["-device", "virtio-serial-pci,id=vser0"])
        .arg("-chardev")
        .arg(format!("socket,id=agent0,path={},server=on,wait=off", sock.display()))
        .args(["-device", "virtserialport,bus=vser0.0,chardev=agent0,name=org.vmhost.agent.0"])
        // Two of the eight exec ports (vmhost-agent --exec serves whichever exist).
        .arg("-chardev")
        .arg(format!("socket,id=exec0,path={},server=on,wait=off", dir.join("exec.0.sock").display()))
        .args(["-device", "virtserialport,bus=vser0.0,chardev=exec0,name=org.vmhost.exec.0"])
        .arg("-chardev")
        .arg(format!("socket,id=exec1,path={},server=on,wait=off", dir.join("exec.1.sock").display()))
        .args(["-device", "virtserialport,bus=vser0.0,chardev=exec1,name=org.vmhost.exec.1"])
        .args(["-netdev", "user,id=n0", "-device", &format!("virtio-net-pci,netdev=n0,mac={MAC}")])
        .args(["-netdev", "user,id=n1,restrict=on", "-device", &format!("virtio-net-pci,netdev=n1,mac={CAPTURE_MAC}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start qemu-system-x86_64");
    Vm { child, log }
}

/// Runs one QMP command (after the capabilities handshake) and returns its answer line.
fn qmp(sock: &Path, command: &str) -> String {
    let stream = UnixStream::connect(sock).expect("connect QMP");
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut reader = std::io::BufReader::new(stream.try_clone().expect("clone"));
    let mut writer = stream;
    let mut line = String::new();
    let mut next = |reader: &mut std::io::BufReader<UnixStream>| {
        // Skip asynchronous events; return the next greeting or command answer.
        loop {
            line.clear();
            std::io::BufRead::read_line(reader, &mut line).expect("QMP read");
            if !line.contains("\"event\"") {
                return line.clone();
            }
        }
    };
    next(&mut reader);
    writer.write_all(b"{\"execute\":\"qmp_capabilities\"}\n").expect("QMP write");
    next(&mut reader);
    writer.write_all(format!("{{\"execute\":\"{command}\"}}\n").as_bytes()).expect("QMP write");
    next(&mut reader)
}

/// The host end of the agent channel: newline-delimited JSON-RPC over the chardev socket.
struct Host {
    stream: UnixStream,
    pending: Vec<u8>,
    next_id: u64,
}

impl Host {
    fn connect(sock: &Path, timeout: Duration) -> Host {
        let deadline = Instant::now() + timeout;
        loop {
            match UnixStream::connect(sock) {
                Ok(stream) => return Host { stream, pending: Vec::new(), next_id: 1 },
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("connect {}: {e}", sock.display()),
            }
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write to the agent socket");
    }

    /// The next complete line, or `None` at the deadline.
    fn line(&mut self, deadline: Instant) -> Option<Vec<u8>> {
        loop {
            if let Some(at) = self.pending.iter().position(|&b| b == b'\n') {
                let line = self.pending.drain(..=at).collect::<Vec<u8>>();
                return Some(line[..line.len() - 1].to_vec());
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            self.stream.set_read_timeout(Some(left.max(Duration::from_millis(1)))).expect("timeout");
            let mut buf = [0u8; 65536];
            match self.stream.read(&mut buf) {
                Ok(0) => panic!("agent socket closed"),
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) => panic!("read: {e}"),
            }
        }
    }

    /// Starts a session: a bare newline, then sync with a nonce; discards everything until the
    /// answer to one of the syncs sent by this call. Resends (with a fresh nonce) every 5 s, since
    /// the agent may still be starting; all nonces of this call are new, so any of their answers
    /// proves the stream is in step. Returns how many lines were discarded.
    fn sync(&mut self, nonce: &str, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut discarded = 0;
        let mut sent: Vec<String> = Vec::new();
        loop {
            let nonce = format!("{nonce}-{}", sent.len());
            let request =
                json!({"jsonrpc": "2.0", "id": format!("sync-{nonce}"), "method": "sync", "params": {"nonce": nonce}});
            self.send(format!("\n{request}\n").as_bytes());
            sent.push(nonce);
            let resend = Instant::now() + Duration::from_secs(5);
            while let Some(line) = self.line(resend.min(deadline)) {
                let answer: Option<Value> = serde_json::from_slice(&line).ok();
                let matched = answer.as_ref().is_some_and(|v| {
                    sent.iter().any(|n| v["id"] == json!(format!("sync-{n}")) && v["result"] == json!({"nonce": n}))
                });
                if matched {
                    return discarded;
                }
                discarded += 1;
            }
            assert!(Instant::now() < deadline, "no sync answer within {timeout:?}");
        }
    }

    /// Sends a request and returns the whole response with that id (skipping any other line).
    fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let request = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        self.send(format!("{request}\n").as_bytes());
        self.response(&json!(id), Duration::from_secs(30))
            .unwrap_or_else(|| panic!("no answer to {method} within 30 s"))
    }

    fn response(&mut self, id: &Value, timeout: Duration) -> Option<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let line = self.line(deadline)?;
            assert!(line.len() <= 64 * 1024, "agent sent a frame of {} bytes", line.len());
            if line.is_empty() {
                continue;
            }
            let value: Value = serde_json::from_slice(&line)
                .unwrap_or_else(|e| panic!("agent sent non-JSON {:?}: {e}", String::from_utf8_lossy(&line)));
            if &value["id"] == id {
                return Some(value);
            }
        }
    }

    /// Sends request `id` and then `chunks` as chunk lines, without waiting.
    fn request(&mut self, id: u64, method: &str, params: Value, chunks: &[u8]) {
        let mut text = format!("{}\n", json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        for piece in chunks.chunks(32 * 1024) {
            text.push_str(&format!("{}\n", json!({"data": vmhost_agent_protocol::base64::encode(piece)})));
        }
        self.send(text.as_bytes());
    }

    /// The notifications for request `id` (their params) and then its reply.
    fn streamed(&mut self, id: u64, timeout: Duration) -> (Vec<Value>, Value) {
        let deadline = Instant::now() + timeout;
        let mut notes = Vec::new();
        loop {
            let line = self.line(deadline).unwrap_or_else(|| panic!("no reply to {id} within {timeout:?}"));
            assert!(line.len() <= 64 * 1024, "agent sent a frame of {} bytes", line.len());
            if line.is_empty() {
                continue;
            }
            let v: Value = serde_json::from_slice(&line).expect("JSON");
            if v["id"] == json!(id) {
                return (notes, v);
            }
            assert_eq!(v["params"]["id"], json!(id), "{v}");
            notes.push(v["params"].clone());
        }
    }

    /// A successful call's `result`.
    fn ok(&mut self, method: &str, params: Value) -> Value {
        let v = self.call(method, params);
        assert!(v.get("error").is_none(), "{method} failed: {v}");
        v["result"].clone()
    }
}

fn interface<'a>(state: &'a Value, name: &str) -> Option<&'a Value> {
    state["interfaces"].as_array().and_then(|a| a.iter().find(|i| i["name"] == name))
}

fn failed_checks(report: &Value) -> Vec<String> {
    report["checks"]
        .as_array()
        .map(|a| a.iter().filter(|c| c["ok"] == false).filter_map(|c| c["name"].as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// Times `f`, printing the duration with `label`.
fn timed<T>(label: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let value = f();
    eprintln!("timing: {label}: {:.1} ms", start.elapsed().as_secs_f64() * 1000.0);
    value
}

#[test]
fn agent_in_the_test_guest() {
    let (agent, kernel, initrd, kernel_version) = timed("static release build + strip + initramfs", build_guest);
    let size = std::fs::metadata(&agent).expect("stat agent").len();
    eprintln!("budget: stripped static vmhost-agent is {size} bytes ({:.2} MiB)", size as f64 / 1048576.0);
    assert!(size <= SIZE_BUDGET, "agent is {size} bytes, budget {SIZE_BUDGET}");

    let dir = tempfile::tempdir().expect("tempdir");
    let started = Instant::now();
    let mut vm = boot(&kernel, &initrd, dir.path());
    let mut host = Host::connect(&dir.path().join("agent.sock"), Duration::from_secs(10));
    host.sync("boot", Duration::from_secs(120));
    eprintln!("timing: QEMU start to first sync answer: {:.1} s", started.elapsed().as_secs_f64());
    vm.wait_for_serial("vmhost-agent: serving on /dev/vport", Duration::from_secs(5));

    // hello and agent.info.
    let hello = timed("hello", || host.ok("hello", json!({})));
    assert_eq!(hello["protocol_version"], 1);
    assert_eq!(
        hello["capabilities"],
        json!(["agent.info", "net.state", "net.check", "net.apply", "fs.freeze", "net.capture"])
    );
    assert_eq!(hello["agent_version"], env!("CARGO_PKG_VERSION"));
    let info = host.ok("agent.info", json!(null));
    assert_eq!(info["hostname"], "g", "{info}");
    assert_eq!(info["kernel"], json!(kernel_version));
    assert!(info["uptime_s"].as_u64().is_some(), "{info}");
    let rss = info["rss_kib"].as_u64().expect("rss_kib");
    eprintln!("budget: agent RSS after start-up {rss} KiB");
    assert!(rss > 0 && rss <= RSS_BUDGET_KIB, "RSS {rss} KiB, budget {RSS_BUDGET_KIB}");

    // fs.freeze and fs.thaw: the test guest's root is its initramfs (no block device), so there
    // is nothing to freeze; the kernel test freezes a real ext4 (src/kernel_tests.rs).
    assert_eq!(host.ok("fs.freeze", json!({"timeout_s": 5})), json!({"mounts": [], "skipped": []}));
    assert_eq!(host.ok("fs.thaw", json!({})), json!({"mounts": []}));

    // net.state: what ip= configured.
    let state = timed("net.state", || host.ok("net.state", json!({})));
    let eth0 = interface(&state, "eth0").unwrap_or_else(|| panic!("no eth0: {state}"));
    assert_eq!(
        (&eth0["mac"], &eth0["up"], &eth0["kind"], &eth0["addresses"]),
        (&json!(MAC), &json!(true), &json!(""), &json!(["10.0.2.15/24"]))
    );
    let routes = state["routes"].as_array().expect("routes");
    assert!(routes.contains(&json!({"dst": "default", "gateway": "10.0.2.2", "dev": "eth0"})), "{state}");
    assert!(routes.contains(&json!({"dst": "10.0.2.0/24", "gateway": null, "dev": "eth0"})), "{state}");
    assert_eq!(state["dns"], json!({"servers": ["10.0.2.3"], "search": []}));

    // net.check: passes for the right expectations (gateway probed: slirp answers ICMP echo).
    let right = json!({"expected": {"interfaces": [{"mac": MAC, "addresses": ["10.0.2.15/24"], "up": true}],
                       "gateway": "10.0.2.2", "dns": ["10.0.2.3"], "search": [], "probe_gateway": true}});
    let report = timed("net.check (probe)", || host.ok("net.check", right.clone()));
    assert_eq!(report["ok"], true, "{report}");
    assert_eq!(report["checks"].as_array().map(Vec::len), Some(6), "{report}");
    // ... and fails naming the item for a wrong address, or a wrong gateway.
    let wrong_address =
        json!({"expected": {"interfaces": [{"mac": MAC, "addresses": ["10.0.2.16/24"]}], "gateway": "10.0.2.2"}});
    let report = host.ok("net.check", wrong_address);
    assert_eq!(report["ok"], false);
    assert_eq!(failed_checks(&report), ["address 10.0.2.16/24 on eth0"], "{report}");
    let failed =
        report["checks"].as_array().and_then(|a| a.iter().find(|c| c["ok"] == false)).cloned().unwrap_or_default();
    assert_eq!((&failed["expected"], &failed["observed"]), (&json!("10.0.2.16/24"), &json!("10.0.2.15/24")));
    let wrong_gateway =
        json!({"expected": {"interfaces": [{"mac": MAC}], "gateway": "10.0.2.99", "probe_gateway": true}});
    let report = timed("net.check (unreachable gateway)", || host.ok("net.check", wrong_gateway));
    assert_eq!(failed_checks(&report), ["default route via 10.0.2.99", "gateway 10.0.2.99 reachable"], "{report}");

    // net.apply: a VLAN on eth0 and a dummy, created and marked.
    let declared = json!({"interfaces": [
        {"name": "eth0.20", "link": "eth0", "vlan_id": 20, "address": "10.20.0.5/24"},
        {"name": "dummy0", "address": "192.168.50.1/32"}
    ]});
    let applied = timed("net.apply (create VLAN + dummy)", || host.ok("net.apply", declared.clone()));
    assert_eq!(applied, json!({"changed": true, "created": ["eth0.20", "dummy0"], "updated": [], "deleted": []}));
    let state = host.ok("net.state", json!({}));
    let vlan = interface(&state, "eth0.20").unwrap_or_else(|| panic!("no eth0.20: {state}"));
    assert_eq!(
        (&vlan["kind"], &vlan["alias"], &vlan["up"], &vlan["mac"]),
        (&json!("vlan"), &json!("vmhost-agent"), &json!(true), &json!(MAC))
    );
    assert_eq!(vlan["addresses"], json!(["10.20.0.5/24"]));
    let dummy = interface(&state, "dummy0").unwrap_or_else(|| panic!("no dummy0: {state}"));
    assert_eq!(
        (&dummy["kind"], &dummy["alias"], &dummy["up"]),
        (&json!("dummy"), &json!("vmhost-agent"), &json!(true))
    );
    assert_eq!(dummy["addresses"], json!(["192.168.50.1/32"]));
    let eth0 = interface(&state, "eth0").expect("eth0");
    assert_eq!(eth0["addresses"], json!(["10.0.2.15/24"]), "primary NIC untouched");
    assert!(state["routes"]
        .as_array()
        .expect("routes")
        .contains(&json!({"dst": "default", "gateway": "10.0.2.2", "dev": "eth0"})));
    // The NIC check still finds eth0 (not the VLAN sharing its MAC) and everything passes.
    assert_eq!(host.ok("net.check", right.clone())["ok"], true);
    // Again: nothing changes.
    let again = timed("net.apply (unchanged)", || host.ok("net.apply", declared.clone()));
    assert_eq!(again, json!({"changed": false, "created": [], "updated": [], "deleted": []}));
    // Refusals name the field and change nothing.
    let v = host.call("net.apply", json!({"interfaces": [{"name": "eth0", "address": "10.9.0.1/24"}]}));
    assert_eq!(
        (&v["error"]["code"], &v["error"]["data"]["field"]),
        (&json!(5100), &json!("interfaces[0].name")),
        "{v}"
    );
    // Removal: declared no more, deleted.
    let removed = timed("net.apply (delete both)", || host.ok("net.apply", json!({"interfaces": []})));
    assert_eq!(removed, json!({"changed": true, "created": [], "updated": [], "deleted": ["eth0.20", "dummy0"]}));
    let state = host.ok("net.state", json!({}));
    assert!(interface(&state, "eth0.20").is_none() && interface(&state, "dummy0").is_none(), "{state}");
    assert_eq!(interface(&state, "eth0").map(|i| i["addresses"].clone()), Some(json!(["10.0.2.15/24"])));

    // A capture NIC (issue 31): eth1, which ip= left alone, is set promiscuous and up by net.apply,
    // never addressed, and then passes the capture checks; the promiscuous flag is in net.state
    // only when asked for.
    let capture = json!({"expected": {"interfaces": [{"mac": CAPTURE_MAC, "capture": true}]}});
    let report = host.ok("net.check", capture.clone());
    assert!(failed_checks(&report).contains(&"capture eth1 promiscuous".to_string()), "{report}");
    let applied =
        timed("net.apply (capture NIC)", || host.ok("net.apply", json!({"interfaces": [], "capture": [CAPTURE_MAC]})));
    assert_eq!(applied, json!({"changed": true, "created": [], "updated": ["eth1"], "deleted": []}));
    let report = host.ok("net.check", capture.clone());
    assert_eq!(report["ok"], true, "{report}");
    let names: Vec<&str> =
        report["checks"].as_array().expect("checks").iter().filter_map(|c| c["name"].as_str()).collect();
    let present = format!("nic {CAPTURE_MAC} present");
    assert_eq!(names, [present.as_str(), "capture eth1 up", "capture eth1 promiscuous", "capture eth1 no address"]);
    let state = host.ok("net.state", json!({"promisc": true}));
    let eth1 = interface(&state, "eth1").unwrap_or_else(|| panic!("no eth1: {state}"));
    assert_eq!(
        (&eth1["mac"], &eth1["up"], &eth1["promisc"], &eth1["addresses"]),
        (&json!(CAPTURE_MAC), &json!(true), &json!(true), &json!([]))
    );
    assert_eq!(interface(&state, "eth0").map(|i| i["promisc"].clone()), Some(json!(false)));
    let plain = host.ok("net.state", json!({}));
    assert!(interface(&plain, "eth1").is_some_and(|i| i.get("promisc").is_none()), "{plain}");
    let again = host.ok("net.apply", json!({"interfaces": [], "capture": [CAPTURE_MAC]}));
    assert_eq!(again["changed"], false, "{again}");

    // Hostile frames over the real port: an oversize line, invalid UTF-8, unknown members.
    let mut big = vec![b'x'; 100 * 1024];
    big.push(b'\n');
    host.send(&big);
    let v = host.response(&Value::Null, Duration::from_secs(30)).expect("answer to the oversize line");
    assert_eq!(v["error"]["code"], -32600, "{v}");
    host.send(b"{\"jsonrpc\":\"2.0\",\"id\":\"\xff\"}\n");
    let v = host.response(&Value::Null, Duration::from_secs(30)).expect("answer to invalid UTF-8");
    assert_eq!(v["error"]["code"], -32700, "{v}");
    let v = host.call("net.check", json!({"expected": {}, "extra": true}));
    assert_eq!((&v["error"]["code"], &v["error"]["data"]["field"]), (&json!(-32602), &json!("extra")));
    assert_eq!(host.ok("hello", json!({}))["protocol_version"], 1);

    // Round trips (TCG): a few net.check calls without the probe.
    let plain_check =
        json!({"expected": {"interfaces": [{"mac": MAC, "addresses": ["10.0.2.15/24"]}], "gateway": "10.0.2.2"}});
    let mut rtts: Vec<f64> = (0..20)
        .map(|_| {
            let start = Instant::now();
            assert_eq!(host.ok("net.check", plain_check.clone())["ok"], true);
            start.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    rtts.sort_by(f64::total_cmp);
    eprintln!(
        "timing: net.check round trip over 20 calls: min {:.1} ms, median {:.1} ms, max {:.1} ms",
        rtts[0], rtts[10], rtts[19]
    );

    // Host disconnects with stale data both ways: half a request the agent holds, and a request
    // whose answer the old session never reads.
    host.send(b"{\"jsonrpc\":\"2.0\",\"id\":99,\"method\":\"agent.info\"}\n{\"jsonrpc\":\"2.0\",\"id\":100,\"meth");
    drop(host);
    std::thread::sleep(Duration::from_millis(1500));
    let reconnect = Instant::now();
    let mut host = Host::connect(&dir.path().join("agent.sock"), Duration::from_secs(10));
    let discarded = host.sync("again", Duration::from_secs(30));
    eprintln!(
        "timing: reconnect to sync answer: {:.1} ms ({discarded} stale lines discarded)",
        reconnect.elapsed().as_secs_f64() * 1000.0
    );
    assert_eq!(host.ok("hello", json!({}))["protocol_version"], 1);
    // A disconnect in the middle of nothing, twice in a row, also recovers.
    for round in 0..2 {
        drop(host);
        host = Host::connect(&dir.path().join("agent.sock"), Duration::from_secs(10));
        host.sync(&format!("round{round}"), Duration::from_secs(30));
    }

    let info = host.ok("agent.info", json!({}));
    let rss = info["rss_kib"].as_u64().expect("rss_kib");
    eprintln!("budget: agent RSS after the whole session {rss} KiB");

    exec_ports(dir.path());

    // A guest reboot under a host that stays connected: the new agent answers a sync on the same
    // host connection (what the host sends meanwhile waits in the chardev), with a new uptime.
    let answer = qmp(&dir.path().join("qmp.sock"), "system_reset");
    assert!(answer.contains("\"return\""), "system_reset: {answer}");
    let reset = Instant::now();
    host.sync("after-reboot", Duration::from_secs(120));
    eprintln!("timing: guest reset to sync answer on the same connection: {:.1} s", reset.elapsed().as_secs_f64());
    assert_eq!(host.ok("hello", json!({}))["protocol_version"], 1);
    assert_eq!(vm.serial().matches("VMHOST-GUEST-READY").count(), 2, "booted twice");
    assert!(rss <= RSS_BUDGET_KIB, "RSS {rss} KiB, budget {RSS_BUDGET_KIB}");
    let serial = vm.serial();
    for line in serial.lines().filter(|l| l.contains("vmhost-agent")) {
        eprintln!("serial: {line}");
    }
    assert!(serial.contains("vmhost-agent: no host connected; waiting"), "{serial}");
    assert!(!serial.contains("panicked"), "{serial}");
    assert!(serial.contains("vmhost-agent: exec.0: serving on"), "{serial}");

    // Last: guest.shutdown powers the guest off (no systemd in the test guest: reboot(2)).
    let mut ex = Host::connect(&dir.path().join("exec.1.sock"), Duration::from_secs(10));
    ex.sync("off", Duration::from_secs(60));
    ex.request(1, "guest.shutdown", json!({}), b"");
    let (_, reply) = ex.streamed(1, Duration::from_secs(30));
    assert_eq!(reply["result"], json!({"how": "reboot(2)"}));
    let off = Instant::now();
    loop {
        if let Ok(Some(_)) = vm.child.try_wait() {
            break;
        }
        assert!(off.elapsed() < Duration::from_secs(60), "QEMU still running after guest.shutdown");
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("timing: guest.shutdown to QEMU exit: {:.1} s", off.elapsed().as_secs_f64());
    eprintln!("timing: whole guest session {:.1} s", started.elapsed().as_secs_f64());
}

/// Output bytes of `stream` in `exec.output` notifications (or all `file.data` when `None`).
fn streamed_bytes(notes: &[Value], stream: Option<&str>) -> Vec<u8> {
    notes
        .iter()
        .filter(|p| stream.map_or(true, |s| p["stream"] == s))
        .flat_map(|p| vmhost_agent_protocol::base64::decode(p["data"].as_str().unwrap_or("")).expect("base64"))
        .collect()
}

/// One exec-port session on `exec.N.sock`: sync, the request and its chunks, the notifications
/// and the reply.
fn exec_call(dir: &Path, slot: usize, method: &str, params: Value, chunks: &[u8]) -> (Vec<Value>, Value) {
    let mut ex = Host::connect(&dir.join(format!("exec.{slot}.sock")), Duration::from_secs(10));
    ex.sync(&format!("{method}-{slot}"), Duration::from_secs(60));
    ex.request(7, method, params, chunks);
    ex.streamed(7, Duration::from_secs(60))
}

/// The exec ports' server in the test guest: commands, the clock, files and SSH keys.
fn exec_ports(dir: &Path) {
    let mut ex = Host::connect(&dir.join("exec.0.sock"), Duration::from_secs(10));
    ex.sync("exec-hello", Duration::from_secs(60));
    let hello = ex.ok("hello", json!({}));
    assert_eq!(hello["capabilities"], json!(vmhost_agent_protocol::exec::EXEC_CAPABILITIES));
    drop(ex);

    let argv = json!(["/bin/sh", "-c", "cat; echo err >&2; exit 3"]);
    let (notes, reply) = timed("exec (sh with stdin)", || {
        exec_call(
            dir,
            0,
            "exec",
            json!({"argv": argv, "stdin_bytes": 5, "timeout_s": 30, "max_output": 1024}),
            b"hello",
        )
    });
    assert_eq!(
        (reply["result"]["exit_code"].clone(), reply["result"]["stdout_bytes"].clone()),
        (json!(3), json!(5)),
        "{reply}"
    );
    assert_eq!(streamed_bytes(&notes, Some("stdout")), b"hello");
    assert_eq!(streamed_bytes(&notes, Some("stderr")), b"err\n");

    let (_, reply) = timed("exec (timeout)", || {
        exec_call(dir, 0, "exec", json!({"argv": ["sleep", "100"], "timeout_s": 1, "max_output": 0}), b"")
    });
    assert_eq!(
        (reply["result"]["timed_out"].clone(), reply["result"]["signal"].clone()),
        (json!(true), json!(9)),
        "{reply}"
    );

    // Two slots at once: a command on exec.1 does not hold one on exec.0.
    let mut slow = Host::connect(&dir.join("exec.1.sock"), Duration::from_secs(10));
    slow.sync("slow", Duration::from_secs(60));
    slow.request(
        1,
        "exec",
        json!({"argv": ["/bin/sh", "-c", "sleep 5; echo slow"], "timeout_s": 60, "max_output": 100}),
        b"",
    );
    let (notes, reply) =
        exec_call(dir, 0, "exec", json!({"argv": ["echo", "fast"], "timeout_s": 30, "max_output": 100}), b"");
    assert_eq!(
        (streamed_bytes(&notes, Some("stdout")), reply["result"]["exit_code"].clone()),
        (b"fast\n".to_vec(), json!(0))
    );
    let (notes, reply) = slow.streamed(1, Duration::from_secs(60));
    assert_eq!(
        (streamed_bytes(&notes, Some("stdout")), reply["result"]["exit_code"].clone()),
        (b"slow\n".to_vec(), json!(0))
    );
    drop(slow);

    // A host hang-up mid-command kills it in the guest (the real port reports the hang-up).
    let mut gone = Host::connect(&dir.join("exec.1.sock"), Duration::from_secs(10));
    gone.sync("gone", Duration::from_secs(60));
    let argv = json!(["/bin/sh", "-c", "echo $$; exec sleep 1000"]);
    gone.request(1, "exec", json!({"argv": argv, "timeout_s": 600, "max_output": 100}), b"");
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid = loop {
        let line = gone.line(deadline).expect("the command's pid");
        if let Ok(v) = serde_json::from_slice::<Value>(&line) {
            if v["method"] == "exec.output" {
                break String::from_utf8_lossy(&streamed_bytes(&[v["params"].clone()], Some("stdout")))
                    .trim()
                    .to_string();
            }
        }
    };
    drop(gone);
    let check =
        format!("i=0; while kill -0 {pid} 2>/dev/null; do i=$((i+1)); [ $i -gt 200 ] && exit 1; sleep 0.1; done");
    let (_, reply) =
        exec_call(dir, 0, "exec", json!({"argv": ["/bin/sh", "-c", check], "timeout_s": 60, "max_output": 0}), b"");
    assert_eq!(reply["result"]["exit_code"], 0, "the command survived its host's hang-up: {reply}");

    // The clock: set to 2001, then back.
    let year = |dir: &Path| {
        let (notes, _) =
            exec_call(dir, 0, "exec", json!({"argv": ["date", "-u", "+%Y"], "timeout_s": 30, "max_output": 100}), b"");
        String::from_utf8_lossy(&streamed_bytes(&notes, Some("stdout"))).trim().to_string()
    };
    let (_, reply) = exec_call(dir, 1, "time.set", json!({"unix_ns": 978_307_200_000_000_000u64}), b"");
    assert_eq!(reply["result"]["after_ns"].as_u64().map(|ns| ns / 1_000_000_000), Some(978_307_200), "{reply}");
    assert_eq!(year(dir), "2001");
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let (_, reply) = exec_call(dir, 1, "time.set", json!({"unix_ns": now}), b"");
    assert!(reply["result"]["before_ns"].as_u64().is_some_and(|ns| ns < now), "{reply}");
    assert_ne!(year(dir), "2001");

    // Files: 1 MiB pushed (parents created) and pulled back equal.
    let content: Vec<u8> = (0..1024 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    let sha = vmhost_agent::exec::files::sha256_hex(&content);
    let (_, reply) = timed("file.push 1 MiB", || {
        exec_call(
            dir,
            0,
            "file.push",
            json!({"path": "/srv/data/blob", "mode": 0o600, "size": content.len(), "sha256": sha, "mkdir": true}),
            &content,
        )
    });
    assert_eq!(reply["result"], json!({"size": content.len(), "sha256": sha}));
    let (notes, reply) = timed("file.pull 1 MiB", || {
        exec_call(dir, 1, "file.pull", json!({"path": "/srv/data/blob", "max_bytes": 2 * 1024 * 1024}), b"")
    });
    assert_eq!(reply["result"], json!({"size": content.len(), "sha256": sha, "mode": 0o600}));
    assert!(streamed_bytes(&notes, None) == content, "pulled content differs");

    // The exec server's own memory (the command's parent), after the transfers.
    let rss = r#"grep -E '^Rss' /proc/$PPID/smaps_rollup"#;
    let (notes, _) =
        exec_call(dir, 1, "exec", json!({"argv": ["/bin/sh", "-c", rss], "timeout_s": 30, "max_output": 1000}), b"");
    eprintln!("budget: exec server {}", String::from_utf8_lossy(&streamed_bytes(&notes, Some("stdout"))).trim());

    // SSH keys: busybox has no useradd or adduser here, so the account is appended to passwd.
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0 operator@host";
    let (_, reply) = exec_call(dir, 0, "ssh.authorize", json!({"user": "vmhost", "keys": [key]}), b"");
    assert_eq!(
        reply["result"],
        json!({"created": true, "path": "/home/vmhost/.ssh/authorized_keys", "changed": true}),
        "{reply}"
    );
    let (_, reply) = exec_call(dir, 0, "ssh.authorize", json!({"user": "vmhost", "keys": [key]}), b"");
    assert_eq!(reply["result"]["changed"], false);
    let (notes, _) = exec_call(
        dir,
        0,
        "exec",
        json!({"argv": ["/bin/sh", "-c", "stat -c '%u %a' /home/vmhost/.ssh /home/vmhost/.ssh/authorized_keys; cat /home/vmhost/.ssh/authorized_keys"], "timeout_s": 30, "max_output": 1000}),
        b"",
    );
    let text = String::from_utf8_lossy(&streamed_bytes(&notes, Some("stdout"))).into_owned();
    assert_eq!(text, format!("1000 700\n1000 600\n{key}\n"));
}
