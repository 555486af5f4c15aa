//! The migration port against a real vmhostd under `sandbox = "require"` (docs/sandbox.md,
//! docs/config.md `[migration]`): with `[migration] listen` the sandboxed daemon binds the
//! port, accepts streams, speaks the wire's opening exchange and refuses a stream whose proof is
//! wrong (and keeps serving); without `[migration]` it holds no IP socket at all.
//!
//! The test talks the wire itself over a plain `TcpStream`, so it checks what a source (or an
//! attacker on the path) sees, not the library's view of it.
//!
//! The framed streams (issue 32: encrypted and authenticated, kept alive): the daemon's control
//! channel carries only ciphertext, sends keep-alives while the source is silent, drops a
//! source that replays or changes a frame, and gives a half-open channel up within its idle
//! timeout; through a relay in this test, the bytes of a control channel and of a `files`
//! channel hold no trace of a marker their messages and file carry.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use vmhost::migration::{wire, ChannelKind, Secret};
use vmhost::migration::{Control, ControlMsg, IDLE_TIMEOUT, PING_INTERVAL};
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

/// Opens VM `vm`'s control channel as a source does, by hand: the proof with `secret`, `ok`,
/// then the frame nonce exchange. Returns the stream and its keys (ours).
fn control_channel(port: u16, vm: &str, secret: &Secret) -> (TcpStream, wire::FrameKeys) {
    let (mut s, nonce) = open(port);
    let kind = ChannelKind::Control;
    s.write_all(&wire::encode_open(vm, &kind, &wire::proof(secret, &nonce, vm, &kind))).expect("send the proof");
    let mut ok = [0u8; 3];
    s.read_exact(&mut ok).expect("the answer to the proof");
    assert_eq!(&ok, b"ok\n");
    let mine = Secret::generate().expect("nonce").to_hex();
    let mine: [u8; 32] = std::array::from_fn(|i| u8::from_str_radix(&mine[2 * i..2 * i + 2], 16).unwrap());
    s.write_all(&mine).expect("our nonce");
    let mut theirs = [0u8; 32];
    s.read_exact(&mut theirs).expect("the daemon's nonce");
    let keys = wire::frame_keys(secret, &mine, &theirs).expect("two nonces");
    (s, keys)
}

/// One frame as it is on the wire: (header, body).
fn read_raw_frame(s: &mut TcpStream) -> std::io::Result<([u8; 4], Vec<u8>)> {
    let mut header = [0u8; 4];
    s.read_exact(&mut header)?;
    let len = wire::frame_len(header).map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok((header, body))
}

/// `vm.migrate_in` (cold) of a kernel VM `name`: the secret.
fn expect_vm(host: &TestHost, name: &str) -> Secret {
    let r = host.call("vm.migrate_in", serde_json::json!({ "spec": host.kernel_spec(name), "mode": "cold" }));
    Secret::parse(r["secret"].as_str().expect("secret")).expect("a secret of 64 hex digits")
}

/// Waits (at most `within`) until VM `name` has no record; returns how long that took.
fn wait_gone(host: &TestHost, name: &str, within: Duration) -> Duration {
    let started = Instant::now();
    host.wait_vm(name, "given up", within, |v| v.get("vm.get error").is_some());
    started.elapsed()
}

#[test]
fn the_daemons_control_channel_is_encrypted_kept_alive_and_drops_replays_tampering_and_silence() {
    let port = free_port();
    let host = TestHost::start(HostOptions {
        sandbox: "require".into(),
        extra: format!("[migration]\nlisten = \"127.0.0.1:{port}\"\nprepare_timeout_s = 300\n"),
        ..HostOptions::default()
    });

    // A source that opened the channel and then says nothing: the daemon's keep-alives come
    // every PING_INTERVAL, as ciphertext that opens only with this stream's key, in sequence.
    let secret = expect_vm(&host, "silent");
    let (mut s, keys) = control_channel(port, "silent", &secret);
    let opened = Instant::now();
    s.set_read_timeout(Some(PING_INTERVAL * 3)).expect("read timeout");
    let mut raw = Vec::new();
    for seq in 0..2u64 {
        let (header, body) = read_raw_frame(&mut s).expect("a keep-alive from the daemon");
        raw.extend_from_slice(&header);
        raw.extend_from_slice(&body);
        assert!(wire::open_frame(&keys.send, seq, header, body.clone()).is_err(), "opened with our own key");
        let payload = wire::open_frame(&keys.receive, seq, header, body).expect("an authentic frame");
        assert_eq!(serde_json::from_slice::<ControlMsg>(&payload).expect("a control message"), ControlMsg::Ping);
    }
    let took = opened.elapsed();
    assert!(took >= PING_INTERVAL && took < PING_INTERVAL * 3, "two keep-alives in {took:?}");
    assert!(!raw.windows(4).any(|w| w == b"ping"), "a keep-alive in plaintext");
    // Half-open: we neither read nor write any more (and do not close). The daemon gives the
    // migration up after IDLE_TIMEOUT without a frame, not after its 600 s wait for Hello.
    let gone = wait_gone(&host, "silent", IDLE_TIMEOUT * 3);
    let silent_for = opened.elapsed();
    assert!(
        silent_for >= IDLE_TIMEOUT - Duration::from_secs(1),
        "given up after {silent_for:?} of silence (before the idle timeout), waited {gone:?}"
    );
    assert!(host.daemon_log().contains("keep-alive"), "the reason is not logged");
    drop(s);

    // A replayed frame (a valid keep-alive sent twice): the channel and the migration end.
    let secret = expect_vm(&host, "replay");
    let (mut s, keys) = control_channel(port, "replay", &secret);
    let ping = wire::seal(&keys.send, 0, br#"{"msg":"ping"}"#).expect("seal");
    s.write_all(&ping).expect("send");
    s.write_all(&ping).expect("send again");
    wait_gone(&host, "replay", Duration::from_secs(15));
    drop(s);

    // A frame with one byte changed on the way: the same.
    let secret = expect_vm(&host, "flip");
    let (mut s, keys) = control_channel(port, "flip", &secret);
    let mut frame = wire::seal(&keys.send, 0, br#"{"msg":"abort","code":4001,"message":"x"}"#).expect("seal");
    frame[10] ^= 0x01;
    s.write_all(&frame).expect("send");
    wait_gone(&host, "flip", Duration::from_secs(15));
    drop(s);
    let log = host.daemon_log();
    assert!(log.matches("frame not authentic").count() >= 2, "the refusals are not logged:\n{log}");
    assert!(!log.contains(&secret.to_hex()), "a secret reached the log");
}

/// A TCP relay in this process between `from` (accepted here) and `to`: copies both ways and
/// keeps every byte it saw, each direction on its own.
fn capturing_relay(to: std::net::SocketAddr) -> (u16, std::sync::mpsc::Receiver<Vec<u8>>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the relay");
    let port = l.local_addr().expect("relay port").port();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (client, _) = l.accept().expect("accept");
        let server = TcpStream::connect(to).expect("connect through");
        for (mut a, mut b) in
            [(client.try_clone().expect("clone"), server.try_clone().expect("clone")), (server, client)]
        {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut buf = [0u8; 65536];
                loop {
                    let n = match a.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    seen.extend_from_slice(&buf[..n]);
                    if b.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = b.shutdown(std::net::Shutdown::Write);
                let _ = tx.send(seen);
            });
        }
    });
    (port, rx)
}

#[test]
fn nothing_a_control_channel_or_a_files_channel_carries_is_on_the_wire_in_plaintext() {
    const MARKER: &[u8] = b"VMHOST-PLAINTEXT-MARKER";
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    // A file made of the marker over and over (and a run of zeros, sent as its length).
    let mut content = MARKER.repeat(50_000);
    content.extend(vec![0u8; 1 << 20]);
    std::fs::write(dir.path().join("disk"), &content).expect("write the file");
    let secret = Secret::generate().expect("secret");
    let marker = String::from_utf8(MARKER.to_vec()).expect("ascii");
    let mut captured = Vec::new();
    for files in [false, true] {
        let end = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let (relay, seen) = capturing_relay(end.local_addr().expect("addr"));
        let a = TcpStream::connect(("127.0.0.1", relay)).expect("connect to the relay");
        let (b, _) = end.accept().expect("accept");
        let (secret, dir, marker) = (secret.clone(), dir.path().to_path_buf(), marker.clone());
        rt.block_on(async move {
            if files {
                let mut tx = vmhost::migration::files::FileSender::new(a, &secret);
                let mut rx = vmhost::migration::files::FileReceiver::new(b, &secret);
                let source = dir.join("disk");
                let send = tokio::spawn(async move {
                    let done = tx.send(&marker, &source).await.expect("send the file");
                    tx.finish().await.expect("finish");
                    done
                });
                let header = rx.next(Duration::from_secs(10)).await.expect("header").expect("a file");
                let got = rx.receive(&header, &dir.join("received")).await.expect("receive the file");
                assert_eq!(got, send.await.expect("sender"));
                assert_eq!(
                    std::fs::read(dir.join("received")).expect("read"),
                    std::fs::read(dir.join("disk")).expect("read")
                );
            } else {
                let (mut src, mut dst) = (Control::new(a, &secret), Control::new(b, &secret));
                let msg = ControlMsg::Abort { code: 4001, message: marker.clone() };
                // Both ends at once: each waits for the other's nonce before its first frame.
                let sent = msg.clone();
                let source = tokio::spawn(async move {
                    src.send(&sent).await.expect("send");
                    src.recv(Duration::from_secs(10)).await.expect("the answer")
                });
                assert_eq!(dst.recv(Duration::from_secs(10)).await.expect("receive"), msg);
                dst.send(&msg).await.expect("send back");
                assert_eq!(source.await.expect("source"), msg);
            }
        });
        for _ in 0..2 {
            captured.push(seen.recv_timeout(Duration::from_secs(10)).expect("the relay's capture"));
        }
    }
    // The relay saw the traffic (the file's bytes and more) and not one copy of the marker, nor
    // of any 8 bytes of it, in either direction of either channel.
    assert!(captured.iter().map(Vec::len).sum::<usize>() > 50_000 * MARKER.len(), "the relay saw too little");
    for (i, bytes) in captured.iter().enumerate() {
        for w in MARKER.windows(8) {
            assert!(!bytes.windows(8).any(|b| b == w), "stream {i}: {:?} in plaintext", String::from_utf8_lossy(w));
        }
    }
}
