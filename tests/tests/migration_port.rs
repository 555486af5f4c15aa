//! The migration port against a real vmhostd under `sandbox = "require"` (docs/sandbox.md,
//! docs/config.md `[migration]`): with `[migration] listen` the sandboxed daemon binds the
//! port, accepts streams, speaks the wire's opening exchange and refuses a stream whose proof is
//! wrong (and keeps serving); without `[migration]` it holds no IP socket at all.
//!
//! The test talks the wire itself over a plain `TcpStream`, so it checks what a source (or an
//! attacker on the path) sees, not the library's view of it.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use vmhost::migration::{wire, ChannelKind, Secret};
use vmhost_tests::{HostOptions, TestHost};

/// A port the kernel considers free now (bound and released at once), for a fixed `listen`.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a probe port");
    l.local_addr().expect("probe port").port()
}

/// Socket inodes of process `pid`'s descriptors.
fn socket_inodes(pid: u32) -> HashSet<u64> {
    let mut out = HashSet::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("list the daemon's fds").flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else { continue };
        let t = target.to_string_lossy();
        if let Some(inode) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
            out.insert(inode.parse().expect("socket inode"));
        }
    }
    out
}

/// One line of `/proc/PID/net/{tcp,tcp6,udp,udp6,raw,raw6}`: (table, local port, state, inode).
fn ip_sockets(pid: u32) -> Vec<(String, u16, String, u64)> {
    let mut out = Vec::new();
    for table in ["tcp", "tcp6", "udp", "udp6", "raw", "raw6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 {
                continue;
            }
            let port = f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()).unwrap_or(0);
            out.push((table.to_string(), port, f[3].to_string(), f[9].parse().unwrap_or(0)));
        }
    }
    out
}

/// The daemon's own IP sockets: the entries of its network namespace whose inode is one of its
/// descriptors.
fn daemon_ip_sockets(pid: u32) -> Vec<(String, u16, String, u64)> {
    let mine = socket_inodes(pid);
    ip_sockets(pid).into_iter().filter(|s| mine.contains(&s.3)).collect()
}

/// Opens a stream and reads the server's greeting and nonce.
fn open(port: u16) -> (TcpStream, [u8; wire::NONCE_LEN]) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("the migration port accepts");
    s.set_read_timeout(Some(Duration::from_secs(20))).expect("read timeout");
    let mut greeting = vec![0u8; wire::GREETING.len() + wire::NONCE_LEN];
    s.read_exact(&mut greeting).expect("the greeting and nonce");
    assert_eq!(&greeting[..wire::GREETING.len()], b"VMHOST-MIGRATE/1\n");
    let mut nonce = [0u8; wire::NONCE_LEN];
    nonce.copy_from_slice(&greeting[wire::GREETING.len()..]);
    (s, nonce)
}

/// Everything the server sends until it closes.
fn rest(mut s: TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn a_sandboxed_daemon_binds_its_port_accepts_and_refuses_a_wrong_proof() {
    let port = free_port();
    let host = TestHost::start(HostOptions {
        sandbox: "require".into(),
        extra: format!("[migration]\nlisten = \"127.0.0.1:{port}\"\n"),
        ..HostOptions::default()
    });
    let pid = host.daemon_pid().expect("daemon pid");
    // The listening socket is the daemon's own (state 0A: LISTEN), on the configured port.
    let listening: Vec<_> =
        daemon_ip_sockets(pid).into_iter().filter(|s| s.0 == "tcp" && s.1 == port && s.2 == "0A").collect();
    assert_eq!(listening.len(), 1, "no listening socket of the daemon on {port}: {:?}", daemon_ip_sockets(pid));

    // Two streams open at once, each with a nonce of its own.
    let (a, nonce_a) = open(port);
    let (mut b, nonce_b) = open(port);
    assert_ne!(nonce_a, nonce_b, "a nonce was reused");
    drop(a);

    // A proof for a VM this host does not expect (no vm.migrate_in made a secret for it):
    // refused, then closed.
    let wrong = Secret::generate().expect("secret");
    let kind = ChannelKind::Control;
    b.write_all(&wire::encode_open("web-1", &kind, &wire::proof(&wrong, &nonce_b, "web-1", &kind))).expect("send");
    assert_eq!(rest(b), b"refused\n");
    // The same proof replayed on another stream (whose nonce differs): refused.
    let (mut c, _) = open(port);
    c.write_all(&wire::encode_open(
        "web-1",
        &ChannelKind::Ram,
        &wire::proof(&wrong, &nonce_b, "web-1", &ChannelKind::Ram),
    ))
    .expect("send");
    assert_eq!(rest(c), b"refused\n");
    // Not the wire at all: refused.
    let (mut d, _) = open(port);
    d.write_all(b"GET / HTTP/1.0\r\n\r\n").expect("send");
    assert_eq!(rest(d), b"refused\n");
    // A client that says nothing is cut off by the server's bound, not kept forever.
    let (e, _) = open(port);
    let started = Instant::now();
    assert_eq!(rest(e), b"");
    assert!(started.elapsed() < Duration::from_secs(20), "a silent client was kept {:?}", started.elapsed());

    // Each refusal is logged at warn with the peer and the reason; never a secret.
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = host.daemon_log();
        if log.matches("migration port: refused a stream").count() >= 4 || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let refusals: Vec<&str> = log.lines().filter(|l| l.contains("migration port: refused a stream")).collect();
    assert!(refusals.len() >= 4, "refusals not logged:\n{log}");
    assert!(refusals.iter().all(|l| l.contains("WARN") && l.contains("127.0.0.1:")), "{refusals:?}");
    assert!(!log.contains(&wrong.to_hex()), "a secret reached the log");

    // Still serving, still sandboxed.
    let (f, _) = open(port);
    drop(f);
    let check = host.call("host.check", serde_json::json!({}));
    let items = check["items"].as_array().cloned().unwrap_or_default();
    for name in ["sandbox", "landlock", "seccomp"] {
        let item = items.iter().find(|i| i["name"] == name).unwrap_or_else(|| panic!("no {name} in {check}"));
        assert_eq!(item["status"], "ok", "{item}");
    }
}

#[test]
fn without_a_migration_section_the_daemon_holds_no_ip_socket() {
    let host = TestHost::start(HostOptions { sandbox: "require".into(), ..HostOptions::default() });
    let pid = host.daemon_pid().expect("daemon pid");
    // Some traffic first, so any socket opened on demand would exist by now.
    host.call("vm.list", serde_json::json!({}));
    host.call("host.info", serde_json::json!({}));
    let sockets = daemon_ip_sockets(pid);
    assert!(sockets.is_empty(), "the daemon holds IP sockets without [migration]: {sockets:?}");
    // The check can see one: the daemon holds Unix and netlink sockets, and the tables are read.
    assert!(!socket_inodes(pid).is_empty(), "no sockets at all: the check is blind");
    assert!(std::path::Path::new(&format!("/proc/{pid}/net/tcp")).exists());
    assert!(!host.daemon_log().contains("migration port listening"));
}
