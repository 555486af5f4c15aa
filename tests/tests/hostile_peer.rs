//! A hostile read-only peer against a real vmhostd with 200 VM records (docs/api.md, "Limits"):
//! it cannot grow the daemon's memory past a stated bound, starve an admin's calls, open more
//! subscriptions or connections than its share, make concurrent `host.check`s each start their
//! own probes, drive guest-agent calls faster than the rate limit, or flood the log with refused
//! connects; an idle connection is closed; and the daemon refuses a socket directory others may
//! write.
//!
//! The read-only peers are real credentials: a thread of this (root) test process drops to a uid
//! in group `nogroup` (the host's read-only group here) with raw `setresuid`, which changes only
//! that thread, and connects; the kernel records that uid for the connection.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use vmhost::client::Client;
use vmhost_tests::{bin, plain_log, rss_kib, wait, HostOptions, TestHost};

/// Debian's `nogroup`: the read-only group of these hosts.
const NOGROUP: u32 = 65534;

/// The bound docs/api.md states for this scenario: vmhostd's RSS stays below it.
const RSS_BOUND_KIB: u64 = 128 * 1024;

/// VM records on the host: every `vm.list` answer holds all of them.
const RECORDS: usize = 200;

/// Connects to `socket` as `uid` with primary group `gid` and no supplementary groups.
fn connect_as(socket: &Path, uid: u32, gid: u32) -> std::io::Result<UnixStream> {
    let socket = socket.to_path_buf();
    std::thread::spawn(move || {
        // SAFETY: raw system calls on plain integers; they change only this thread's
        // credentials (glibc's wrappers would change every thread's), and the thread ends here.
        let dropped = unsafe {
            libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) == 0
                && libc::syscall(libc::SYS_setresgid, gid, gid, gid) == 0
                && libc::syscall(libc::SYS_setresuid, uid, uid, uid) == 0
        };
        assert!(dropped, "cannot drop to {uid}:{gid}: {}", std::io::Error::last_os_error());
        UnixStream::connect(&socket)
    })
    .join()
    .expect("connecting thread")
}

/// A read-only connection with a reader, answers awaited up to 60 s.
fn reader_as(socket: &Path, uid: u32) -> (UnixStream, BufReader<UnixStream>) {
    let s = connect_as(socket, uid, NOGROUP).expect("connect as a read-only peer");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
    let r = BufReader::new(s.try_clone().unwrap());
    (s, r)
}

fn read_json(r: &mut BufReader<UnixStream>) -> Value {
    let mut line = String::new();
    r.read_line(&mut line).expect("an answer line");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"))
}

fn request(id: usize, method: &str) -> String {
    json!({"jsonrpc": "2.0", "id": id, "method": method}).to_string()
}

fn batch(n: usize, method: &str) -> Vec<u8> {
    let elements: Vec<String> = (0..n).map(|i| request(i, method)).collect();
    format!("[{}]\n", elements.join(",")).into_bytes()
}

/// Occurrences of `needle` in the daemon's log.
fn log_count(host: &TestHost, needle: &str) -> usize {
    plain_log(&host.daemon_log()).lines().filter(|l| l.contains(needle)).count()
}

/// True once `check` holds, false when `limit` (a failure bound, never a speed) passed first:
/// [`wait::poll`] for the checks below, which add their own failure message.
fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    wait::poll(limit, || if check() { Ok(()) } else { Err(String::new()) }).is_ok()
}

/// The bound of a wait for something the daemon does at once (frees a place, logs a close,
/// exits on a refused config, serves): generous, only the point where the test fails.
const AT_ONCE: Duration = Duration::from_secs(60);

/// An admin (root) client whose calls must keep being answered.
fn admin(host: &TestHost) -> Client {
    let mut c = Client::connect(&host.socket).expect("admin connects");
    c.set_timeout(Duration::from_secs(60)).unwrap();
    c
}

fn admin_is_served(host: &TestHost, what: &str) {
    let mut c = admin(host);
    let list: Value = c.call("vm.list", json!({})).unwrap_or_else(|e| panic!("admin vm.list {what}: {e}"));
    assert_eq!(list.as_array().map(Vec::len), Some(RECORDS), "admin vm.list {what}");
    let info: Value = c.call("host.info", json!({})).unwrap_or_else(|e| panic!("admin host.info {what}: {e}"));
    assert!(info["version"].is_string());
}

/// Samples the daemon's RSS until dropped; keeps the highest value.
struct RssWatch {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssWatch {
    fn start(pid: u32) -> RssWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(rss_kib(pid)));
        let (s, p) = (Arc::clone(&stop), Arc::clone(&peak));
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                p.fetch_max(rss_kib(pid), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        RssWatch { stop, peak, thread: Some(thread) }
    }

    fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }
}

impl Drop for RssWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A host with `nogroup` as its read-only group and [`RECORDS`] stopped VMs (records only).
fn host_with_records() -> TestHost {
    let host = TestHost::start(HostOptions {
        readonly_group: "nogroup".into(),
        cpu: RECORDS as u32 + 2,
        memory_gib: (RECORDS as u64 * 64 / 1024) + 2,
        ..HostOptions::default()
    });
    // Any file in the images directory will do as a kernel: the VMs are never launched.
    let kernel = host.images().join("vmlinuz");
    std::fs::write(&kernel, b"not a kernel").unwrap();
    let mut c = admin(&host);
    for i in 0..RECORDS {
        let spec = json!({"name": format!("rec-{i:03}"), "cpu": 1, "memory_mib": 64, "state": "stopped",
            "boot": {"kernel": kernel, "cmdline": format!("console=ttyS0 {}", "x".repeat(200))}});
        let _: Value = c.call("vm.create", json!({ "spec": spec })).expect("create a record");
    }
    host
}

#[test]
fn a_hostile_readonly_peer_cannot_exhaust_the_daemon() {
    let host = host_with_records();
    let pid = host.daemon_pid().expect("daemon pid");
    let idle = rss_kib(pid);
    let watch = RssWatch::start(pid);

    // (a) One huge batch line of vm.list calls, then many batches of the largest allowed size,
    // and never a read: the first is refused as a whole, the rest stop being read once the
    // connection's answers fill its byte budget.
    let mut sluggard = connect_as(&host.socket, 60001, NOGROUP).expect("connect");
    sluggard.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    sluggard.write_all(&batch(2000, "vm.list")).unwrap();
    for _ in 0..20 {
        if let Err(e) = sluggard.write_all(&batch(64, "vm.list")) {
            // The daemon stopped reading it: back-pressure.
            assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}");
            break;
        }
    }
    admin_is_served(&host, "while a peer does not read");
    // It is dropped by the write timeout (30 s) once its socket buffer is full; until then the
    // daemon holds what it computed for it. (300 s: a failure bound well past those 30 s.)
    let dropped =
        eventually(Duration::from_secs(300), || log_count(&host, "peer is not reading; dropping the connection") >= 1);
    let peak = watch.peak();
    eprintln!("vmhostd RSS: {idle} KiB with {RECORDS} records, peak {peak} KiB while a peer did not read");
    assert!(peak < RSS_BOUND_KIB, "vmhostd grew to {peak} KiB (bound {RSS_BOUND_KIB} KiB, idle {idle} KiB)");
    assert!(dropped, "the non-reading peer was never dropped");
    admin_is_served(&host, "after a peer that did not read was dropped");

    // (b) Subscriptions: 8 per connection, 32 per uid; the rest get 1003.
    let mut subscribers = Vec::new();
    let mut accepted = 0;
    let mut refused_limits = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..5 {
        let (mut s, mut r) = reader_as(&host.socket, 60002);
        let lines: String = (0..10).map(|i| request(i, "events.subscribe") + "\n").collect();
        s.write_all(lines.as_bytes()).unwrap();
        for _ in 0..10 {
            let v = read_json(&mut r);
            if v["result"].is_null() {
                assert_eq!(v["error"]["code"], 1003, "{v}");
                assert_eq!(v["error"]["data"]["kind"], "limit_exceeded", "{v}");
                refused_limits.push(v["error"]["data"]["details"]["limit"].as_str().unwrap_or("").to_string());
            } else {
                accepted += 1;
                ids.push(v["result"].clone());
            }
        }
        subscribers.push((s, r));
    }
    assert_eq!(accepted, 32, "32 subscriptions per uid: {refused_limits:?}");
    assert_eq!(refused_limits.iter().filter(|l| *l == "subscriptions_per_connection").count(), 4 * 2);
    assert_eq!(refused_limits.iter().filter(|l| *l == "subscriptions_per_uid").count(), 10);
    // Unsubscribing gives the place back: the first connection may subscribe once more.
    let (s0, r0) = &mut subscribers[0];
    let unsubscribe = json!({"jsonrpc": "2.0", "id": 98, "method": "events.unsubscribe", "params": [ids[0]]});
    s0.write_all(format!("{unsubscribe}\n").as_bytes()).unwrap();
    assert_eq!(read_json(r0)["result"], true);
    // (The place is freed once the subscription's task has ended, just after the answer.)
    let resubscribed = eventually(AT_ONCE, || {
        s0.write_all((request(99, "events.subscribe") + "\n").as_bytes()).unwrap();
        read_json(r0)["result"].is_number()
    });
    assert!(resubscribed, "a freed place is usable again");

    // (c) 64 host.check at once: one run of the probes, every caller gets its report.
    let runs_before = log_count(&host, "host check running");
    let (mut s, mut r) = reader_as(&host.socket, 60003);
    s.write_all(&batch(64, "host.check")).unwrap();
    let answers = read_json(&mut r);
    let answers = answers.as_array().expect("a batch answer");
    assert_eq!(answers.len(), 64);
    assert!(answers.iter().all(|a| a["result"]["items"].is_array()), "{:?}", answers.first());
    let runs = log_count(&host, "host check running") - runs_before;
    assert!((1..8).contains(&runs), "64 concurrent host.check calls ran the check {runs} times");

    // (d) Connection slots: 64 for one uid; the 65th is closed at accept without a word, and a
    // peer hammering connects is logged once per interval, not once per connect.
    let held: Vec<UnixStream> = (0..64).map(|_| connect_as(&host.socket, 60004, NOGROUP).expect("slot")).collect();
    // Each held connection is served (so the daemon has classified every one).
    for s in &held {
        let mut w = s.try_clone().unwrap();
        w.write_all((request(1, "host.info") + "\n").as_bytes()).unwrap();
        w.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        assert!(read_json(&mut BufReader::new(w))["result"]["version"].is_string());
    }
    let refusals_before = log_count(&host, "closing new connection");
    for _ in 0..300 {
        let mut extra = connect_as(&host.socket, 60004, NOGROUP).expect("connect");
        extra.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut got = Vec::new();
        let _ = extra.read_to_end(&mut got);
        assert!(got.is_empty(), "closed without a message: {}", String::from_utf8_lossy(&got));
    }
    let logged = log_count(&host, "closing new connection") - refusals_before;
    assert!(logged <= 3, "300 refused connects logged {logged} lines");
    admin_is_served(&host, "with one uid's connections all taken");

    admin_is_served(&host, "after the attack");
    let peak = watch.peak();
    drop(watch);
    eprintln!("vmhostd RSS: peak {peak} KiB after every attack");
    assert!(peak < RSS_BOUND_KIB, "vmhostd grew to {peak} KiB (bound {RSS_BOUND_KIB} KiB, idle {idle} KiB)");

    // What the sluggard can still read starts with the refusal of its 2000-element batch.
    let mut r = BufReader::new(sluggard);
    let mut first = String::new();
    let _ = r.read_line(&mut first);
    let v: Value = serde_json::from_str(&first).unwrap_or_else(|e| panic!("{e}: {first:?}"));
    assert_eq!(v["error"]["code"], 1003, "{v}");
    assert_eq!(v["error"]["data"]["details"], json!({"limit": "batch_length", "max": 64, "got": 2000}));
    drop(held);
    drop(subscribers);
}

#[test]
fn readonly_agent_calls_are_rate_limited_per_vm() {
    let host = TestHost::start(HostOptions { readonly_group: "nogroup".into(), ..HostOptions::default() });
    let kernel = host.images().join("vmlinuz");
    std::fs::write(&kernel, b"not a kernel").unwrap();
    let spec = json!({"name": "probe", "cpu": 1, "memory_mib": 64, "state": "stopped",
        "boot": {"kernel": kernel, "cmdline": "console=ttyS0"}});
    host.call("vm.create", json!({ "spec": spec }));
    let (mut s, mut r) = reader_as(&host.socket, 60010);
    let calls: Vec<String> = (0..20)
        .map(|i| json!({"jsonrpc": "2.0", "id": i, "method": "vm.check", "params": {"name": "probe"}}).to_string())
        .collect();
    s.write_all(format!("[{}]\n", calls.join(",")).as_bytes()).unwrap();
    let answers = read_json(&mut r);
    let codes: Vec<i64> = answers.as_array().unwrap().iter().map(|a| a["error"]["code"].as_i64().unwrap()).collect();
    // Its agent is not connected (5001) for the calls the rate allows; the rest get 1004.
    assert!(codes.iter().all(|c| *c == 5001 || *c == 1004), "{codes:?}");
    let limited = codes.iter().filter(|c| **c == 1004).count();
    assert!(limited >= 10, "20 calls at once: {limited} rate-limited ({codes:?})");
    let one = answers.as_array().unwrap().iter().find(|a| a["error"]["code"] == 1004).unwrap();
    assert_eq!(one["error"]["data"]["kind"], "rate_limited");
    assert_eq!(one["error"]["data"]["field"], "name");
    assert!(one["error"]["data"]["details"]["retry_after_ms"].as_u64().unwrap() >= 1);
    // Admins have their own bucket: the read-only peers' flood does not spend it.
    let (code, _) = host.call_err("vm.check", json!({"name": "probe"}));
    assert_eq!(code, 5001);
    // Another VM name is not limited by this one's bucket.
    let (code, _) = host.call_err("vm.check", json!({"name": "nosuch"}));
    assert_eq!(code, 4040);
}

#[test]
fn idle_connections_are_closed_busy_ones_are_not() {
    let mut host = TestHost::prepare(HostOptions { readonly_group: "nogroup".into(), ..HostOptions::default() });
    let text = std::fs::read_to_string(&host.config).unwrap().replace("[access]\n", "[access]\nidle_timeout_s = 2\n");
    std::fs::write(&host.config, text).unwrap();
    host.spawn_daemon();
    let (mut idle, mut idle_r) = reader_as(&host.socket, 60020);
    let (mut sub, mut sub_r) = reader_as(&host.socket, 60021);
    sub.write_all((request(1, "events.subscribe") + "\n").as_bytes()).unwrap();
    assert!(read_json(&mut sub_r)["result"].is_number());
    idle.write_all((request(1, "host.info") + "\n").as_bytes()).unwrap();
    assert!(read_json(&mut idle_r)["result"]["version"].is_string());
    // The idle one is closed (EOF) ...
    let mut rest = Vec::new();
    assert_eq!(idle_r.read_to_end(&mut rest).expect("EOF, not a timeout"), 0);
    assert!(
        eventually(AT_ONCE, || log_count(&host, "connection idle; closing it") == 1),
        "the idle close was not logged"
    );
    // ... the subscribed one, silent since before the idle one's last request, is still served.
    sub.write_all((request(2, "host.info") + "\n").as_bytes()).unwrap();
    assert!(read_json(&mut sub_r)["result"]["version"].is_string());
}

#[test]
fn a_socket_directory_others_may_write_is_refused() {
    let host = TestHost::prepare(HostOptions::default());
    let shared: PathBuf = host.dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let socket = shared.join("vmhostd.sock");
    let text = std::fs::read_to_string(&host.config).unwrap();
    let text =
        text.replace(&format!("socket = \"{}\"", host.socket.display()), &format!("socket = \"{}\"", socket.display()));
    std::fs::write(&host.config, text).unwrap();
    let log = host.dir.path().join("refused.log");
    let mut daemon = std::process::Command::new(bin("vmhostd"))
        .arg("--config")
        .arg(&host.config)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let exited = eventually(AT_ONCE, || matches!(daemon.try_wait(), Ok(Some(_))));
    if !exited {
        let _ = daemon.kill();
        let _ = daemon.wait();
    }
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(exited, "vmhostd served from a 1777 directory:\n{stderr}");
    assert_eq!(daemon.wait().unwrap().code(), Some(1), "{stderr}");
    assert!(stderr.contains("has mode 1777: group or others may write it"), "{stderr}");
    assert!(!socket.exists(), "no socket was made there");
    // The same directory made 0755 is accepted.
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut host = host;
    host.socket = socket;
    host.spawn_daemon();
    assert!(host.call("host.info", json!({}))["version"].is_string());
}

#[test]
fn a_socket_directory_the_daemon_creates_is_0755_whatever_the_umask() {
    let host = TestHost::prepare(HostOptions::default());
    let made = host.dir.path().join("made/here");
    let socket = made.join("vmhostd.sock");
    let text = std::fs::read_to_string(&host.config).unwrap();
    let text =
        text.replace(&format!("socket = \"{}\"", host.socket.display()), &format!("socket = \"{}\"", socket.display()));
    std::fs::write(&host.config, text).unwrap();
    let log = host.dir.path().join("umask0.log");
    let mut cmd = std::process::Command::new(bin("vmhostd"));
    cmd.arg("--config").arg(&host.config).stdout(std::process::Stdio::null());
    cmd.stderr(std::fs::File::create(&log).unwrap());
    // SAFETY: umask is async-signal-safe and the closure allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            libc::umask(0);
            Ok(())
        });
    }
    let mut daemon = cmd.spawn().unwrap();
    let up = eventually(AT_ONCE, || {
        matches!(daemon.try_wait(), Ok(Some(_))) || vmhost::client::Client::connect(&socket).is_ok()
    });
    let exited = matches!(daemon.try_wait(), Ok(Some(_)));
    let _ = daemon.kill();
    let _ = daemon.wait();
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(up && !exited, "vmhostd under umask 0 did not serve:\n{stderr}");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&made), 0o755, "{stderr}");
}

#[test]
fn readonly_peers_cannot_take_the_slots_kept_for_admins() {
    let host = TestHost::start(HostOptions { readonly_group: "nogroup".into(), ..HostOptions::default() });
    // 448 read-only connections (7 uids × 64), each served once so the daemon has classified it.
    let mut held = Vec::new();
    for uid in 60100..60107 {
        for _ in 0..64 {
            let (mut s, mut r) = reader_as(&host.socket, uid);
            s.write_all((request(1, "host.info") + "\n").as_bytes()).unwrap();
            assert!(read_json(&mut r)["result"]["version"].is_string());
            held.push((s, r));
        }
    }
    // One more read-only peer, of a uid with no connection yet, is told why and closed.
    let (_s, mut r) = reader_as(&host.socket, 60200);
    let v = read_json(&mut r);
    assert_eq!(v["error"]["code"], 1003, "{v}");
    assert_eq!(v["error"]["data"]["details"]["limit"], "readonly_connections", "{v}");
    let mut rest = Vec::new();
    assert_eq!(r.read_to_end(&mut rest).unwrap_or(0), 0, "then closed");
    // Root still gets in and is served.
    let mut c = admin(&host);
    let info: Value = c.call("host.info", json!({})).expect("an admin is served");
    assert!(info["version"].is_string());
    drop(held);
}
