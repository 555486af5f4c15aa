//! The exec-port client against fake exec servers on Unix sockets: scripted, some hostile.

use super::base64;
use super::files::{self, PushContent, PushRequest, SourceError};
use super::session::{self, ExecError, OutputChunk, Session};
use super::slots::{ExecSlots, EXEC_SLOTS};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixListener;
use vmhost_agent_protocol::exec::{ExecParams, MAX_CHUNK};

type Reader = BufReader<OwnedReadHalf>;

/// A fake exec server on `path`: answers `sync` and `hello` (listing `caps`), reads one request
/// and the body it announces (`stdin_bytes` or `size`), then hands over to `then`.
fn fake<F, Fut>(path: PathBuf, caps: Vec<&'static str>, then: F)
where
    F: FnOnce(Value, Vec<u8>, Reader, OwnedWriteHalf) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        let mut r = BufReader::new(r);
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            let Ok(v) = serde_json::from_str::<Value>(&line) else { continue };
            let id = v["id"].clone();
            match v["method"].as_str() {
                Some("sync") => {
                    let reply = json!({"jsonrpc": "2.0", "id": id, "result": {"nonce": v["params"]["nonce"]}});
                    w.write_all(format!("\n{reply}\n").as_bytes()).await.unwrap();
                }
                Some("hello") => {
                    let reply = json!({"jsonrpc": "2.0", "id": id, "result":
                        {"agent_version": "t", "protocol_version": 1, "capabilities": caps}});
                    w.write_all(format!("{reply}\n").as_bytes()).await.unwrap();
                }
                Some(_) => {
                    let want = v["params"]["stdin_bytes"].as_u64().or(v["params"]["size"].as_u64()).unwrap_or(0);
                    let mut body = Vec::new();
                    while (body.len() as u64) < want {
                        let mut line = String::new();
                        if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let c: Value = serde_json::from_str(&line).unwrap();
                        let bytes = base64::decode(c["data"].as_str().unwrap()).unwrap();
                        assert!(bytes.len() <= MAX_CHUNK);
                        body.extend(bytes);
                    }
                    then(v, body, r, w).await;
                    return;
                }
                None => {}
            }
        }
    });
}

fn all_caps() -> Vec<&'static str> {
    vmhost_agent_protocol::exec::EXEC_CAPABILITIES.to_vec()
}

async fn send(w: &mut OwnedWriteHalf, v: Value) {
    let _ = w.write_all(format!("{v}\n").as_bytes()).await;
}

fn output(id: &Value, stream: &str, data: &[u8]) -> Value {
    json!({"jsonrpc": "2.0", "method": "exec.output", "params": {"id": id, "stream": stream, "data": base64::encode(data)}})
}

fn exec_reply(id: &Value, code: i32, out: u64, err: u64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": {"exit_code": code, "signal": null, "timed_out": false,
        "duration_ms": 3, "stdout_bytes": out, "stderr_bytes": err}})
}

fn params(stdin: u64, max_output: u64, timeout_s: u32) -> ExecParams {
    ExecParams { argv: vec!["cat".into()], env: vec![], cwd: None, stdin_bytes: stdin, timeout_s, max_output }
}

/// One socket per slot in a temporary directory.
fn sockets(dir: &tempfile::TempDir) -> Vec<PathBuf> {
    (0..EXEC_SLOTS).map(|i| dir.path().join(format!("exec{i}"))).collect()
}

async fn open(slots: &ExecSlots, socks: &[PathBuf], method: &str) -> Result<Session, ExecError> {
    Session::open(socks, slots.try_acquire("vm")?, method).await
}

#[tokio::test]
async fn a_whole_exec_with_stdin_chunks_and_output_chunks() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    fake(socks[0].clone(), all_caps(), |req, stdin, _r, mut w| async move {
        let id = req["id"].clone();
        assert_eq!(req["params"]["argv"], json!(["cat"]));
        // stdin came in several chunks; it is echoed back in chunks, with some stderr.
        for piece in stdin.chunks(MAX_CHUNK) {
            send(&mut w, output(&id, "stdout", piece)).await;
        }
        send(&mut w, output(&id, "stderr", b"warn\n")).await;
        send(&mut w, exec_reply(&id, 3, stdin.len() as u64, 5)).await;
    });
    let slots = ExecSlots::default();
    let stdin: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let s = open(&slots, &socks, "exec").await.unwrap();
    let out = s.exec(&params(stdin.len() as u64, 1 << 20, 5), &stdin, None).await.unwrap();
    assert_eq!(out.stdout, stdin);
    assert_eq!(out.stderr, b"warn\n");
    assert_eq!((out.reply.exit_code, out.slot), (Some(3), 0));
    assert!(!out.stdout_truncated() && !out.stderr_truncated());
    assert_eq!(slots.in_use("vm"), 0, "the slot is back once the session is gone");
}

#[tokio::test]
async fn output_beyond_max_output_is_reported_truncated() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    fake(socks[0].clone(), all_caps(), |req, _stdin, _r, mut w| async move {
        let id = req["id"].clone();
        // The guest sends what was asked for (10 bytes) and counts the 1000 written.
        send(&mut w, output(&id, "stdout", &[b'x'; 10])).await;
        send(&mut w, exec_reply(&id, 0, 1000, 0)).await;
    });
    let slots = ExecSlots::default();
    let s = open(&slots, &socks, "exec").await.unwrap();
    let out = s.exec(&params(0, 10, 5), &[], None).await.unwrap();
    assert_eq!(out.stdout.len(), 10);
    assert!(out.stdout_truncated() && !out.stderr_truncated());
}

#[tokio::test]
async fn streamed_output_goes_to_the_channel_in_order_before_the_reply() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    fake(socks[0].clone(), all_caps(), |req, _stdin, _r, mut w| async move {
        let id = req["id"].clone();
        send(&mut w, output(&id, "stdout", b"one ")).await;
        send(&mut w, output(&id, "stderr", b"two ")).await;
        send(&mut w, output(&id, "stdout", b"three")).await;
        send(&mut w, exec_reply(&id, 0, 9, 4)).await;
    });
    let slots = ExecSlots::default();
    let s = open(&slots, &socks, "exec").await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let collect = tokio::spawn(async move {
        let mut got = Vec::new();
        while let Some(c) = rx.recv().await {
            got.push(c);
        }
        got
    });
    let out = s.exec(&params(0, 100, 5), &[], Some(tx)).await.unwrap();
    assert!(out.stdout.is_empty() && out.stderr.is_empty());
    assert_eq!(out.received, [9, 4]);
    use vmhost_agent_protocol::exec::OutputStream::{Stderr, Stdout};
    assert_eq!(
        collect.await.unwrap(),
        [
            OutputChunk { stream: Stdout, data: b"one ".to_vec() },
            OutputChunk { stream: Stderr, data: b"two ".to_vec() },
            OutputChunk { stream: Stdout, data: b"three".to_vec() },
        ]
    );
}

#[tokio::test]
async fn a_flooding_guest_ends_the_call_with_an_error_not_with_memory() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    fake(socks[0].clone(), all_caps(), |req, _stdin, _r, mut w| async move {
        let id = req["id"].clone();
        let line = format!("{}\n", output(&id, "stdout", &[b'f'; MAX_CHUNK]));
        // Endless output, far past max_output: the host must stop reading.
        for _ in 0..100_000 {
            if w.write_all(line.as_bytes()).await.is_err() {
                return;
            }
        }
    });
    let slots = ExecSlots::default();
    let s = open(&slots, &socks, "exec").await.unwrap();
    let started = std::time::Instant::now();
    let e = s.exec(&params(0, 1 << 20, 60), &[], None).await.unwrap_err();
    assert!(matches!(&e, ExecError::Session(m) if m.to_string().contains("more than the 1048576 bytes")), "{e}");
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(slots.in_use("vm"), 0);
}

#[tokio::test]
async fn a_guest_flooding_unrelated_lines_is_cut_off_by_the_skip_budget() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    fake(socks[0].clone(), all_caps(), |_req, _stdin, _r, mut w| async move {
        let line = format!("{}\n", "g".repeat(60 * 1024));
        for _ in 0..1000 {
            if w.write_all(line.as_bytes()).await.is_err() {
                return;
            }
        }
    });
    let slots = ExecSlots::default();
    let mut s = open(&slots, &socks, "time.set").await.unwrap();
    let e = s.request::<_, Value>(&json!({"unix_ns": 1}), Duration::from_secs(30)).await.unwrap_err();
    assert!(matches!(&e, ExecError::Session(m) if m.to_string().contains("unrelated lines")), "{e}");
}

#[tokio::test]
async fn a_silent_guest_times_out_and_its_slot_is_released() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    fake(socks[0].clone(), all_caps(), |_req, _stdin, r, w| async move {
        let _open = (r, w);
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    let slots = ExecSlots::default();
    let started = std::time::Instant::now();
    let e = session::call::<_, Value>(&slots, "vm", &socks, "guest.shutdown", &json!({}), Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(matches!(e, ExecError::Timeout { .. }), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(slots.in_use("vm"), 0);
}

#[tokio::test(start_paused = true)]
async fn a_silent_command_ends_at_its_timeout_plus_the_grace() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    fake(socks[0].clone(), all_caps(), |_req, _stdin, mut r, w| async move {
        // Holds the session open without a word until the host hangs up.
        let _open = w;
        let mut line = String::new();
        let _ = r.read_line(&mut line).await;
    });
    let slots = ExecSlots::default();
    let s = open(&slots, &socks, "exec").await.unwrap();
    let e = s.exec(&params(0, 10, 2), &[], None).await.unwrap_err();
    assert!(matches!(e, ExecError::Timeout { after, .. } if after == Duration::from_secs(12)), "{e}");
    assert_eq!(slots.in_use("vm"), 0);
}

#[tokio::test]
async fn eight_concurrent_sessions_then_the_ninth_is_busy_and_other_vms_are_not() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    let (go_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    for sock in &socks {
        let mut go = go_tx.subscribe();
        fake(sock.clone(), all_caps(), move |req, _stdin, _r, mut w| async move {
            let _ = go.recv().await;
            send(&mut w, json!({"jsonrpc": "2.0", "id": req["id"], "result": {"how": "test"}})).await;
        });
    }
    let slots = std::sync::Arc::new(ExecSlots::default());
    let mut calls = Vec::new();
    for _ in 0..EXEC_SLOTS {
        let (slots, socks) = (std::sync::Arc::clone(&slots), socks.clone());
        calls.push(tokio::spawn(async move {
            session::call::<_, Value>(&slots, "vm", &socks, "guest.shutdown", &json!({}), Duration::from_secs(10)).await
        }));
    }
    crate::agent::exec::tests::wait_until(|| slots.in_use("vm") == EXEC_SLOTS).await;
    let e = session::call::<_, Value>(&slots, "vm", &socks, "guest.shutdown", &json!({}), Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(e, ExecError::Busy(_)), "{e}");
    assert_eq!(slots.try_acquire("other").unwrap().slot(), 0, "another VM has its own slots");
    go_tx.send(()).unwrap();
    let mut used: Vec<usize> = Vec::new();
    for c in calls {
        let (reply, slot) = c.await.unwrap().unwrap();
        assert_eq!(reply["how"], "test");
        used.push(slot);
    }
    used.sort_unstable();
    assert_eq!(used, (0..EXEC_SLOTS).collect::<Vec<_>>());
    assert_eq!(slots.in_use("vm"), 0);
}

/// Polls `cond` until it holds (bounded: fails the test after 10 s).
pub(super) async fn wait_until(cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "condition not reached");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_vm_without_exec_ports_or_server_gets_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    let slots = ExecSlots::default();
    let e = open(&slots, &socks, "exec").await.unwrap_err();
    assert!(matches!(e, ExecError::NoPorts), "{e}");
    assert!(e.to_string().contains("restart the VM to get exec ports"), "{e}");
    // An exec server that does not list the method.
    fake(socks[0].clone(), vec!["exec"], |_req, _stdin, _r, _w| async move {});
    let e = open(&slots, &socks, "ssh.authorize").await.unwrap_err();
    assert!(matches!(e, ExecError::NotServed(_)), "{e}");
    assert_eq!(slots.in_use("vm"), 0);
}

#[tokio::test]
async fn a_refusal_carries_the_guests_error() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    fake(socks[0].clone(), all_caps(), |req, _stdin, _r, mut w| async move {
        send(&mut w, json!({"jsonrpc": "2.0", "id": req["id"], "error": {"code": 5100, "message": "no such user", "data": {"field": "user"}}})).await;
    });
    let slots = ExecSlots::default();
    let e = session::call::<_, Value>(
        &slots,
        "vm",
        &socks,
        "ssh.authorize",
        &json!({"user": "x", "keys": []}),
        Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    match e {
        ExecError::Refused { code, message, data, .. } => {
            assert_eq!((code, message.as_str(), data), (5100, "no such user", json!({"field": "user"})));
        }
        other => panic!("{other}"),
    }
}

fn push_request(sha256: Option<String>) -> PushRequest {
    PushRequest { path: "/etc/x".into(), mode: 0o644, owner: None, sha256, mkdir: false }
}

/// A fake `file.push` that hashes what it received and answers with it.
fn push_server(sock: PathBuf) {
    fake(sock, all_caps(), |req, body, _r, mut w| async move {
        assert_eq!(req["params"]["size"].as_u64(), Some(body.len() as u64));
        assert_eq!(req["params"]["sha256"].as_str(), Some(files::sha256(&body).as_str()));
        let reply = json!({"size": body.len(), "sha256": files::sha256(&body)});
        send(&mut w, json!({"jsonrpc": "2.0", "id": req["id"], "result": reply})).await;
    });
}

#[tokio::test]
async fn push_sends_the_bytes_the_sha256_names_and_checks_the_guests_answer() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    let slots = ExecSlots::default();
    let content: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 256) as u8).collect();
    push_server(socks[0].clone());
    let mut s = open(&slots, &socks, "file.push").await.unwrap();
    let want = files::sha256(&content);
    let reply =
        files::push(&mut s, &push_request(Some(want.clone())), PushContent::Bytes(content.clone())).await.unwrap();
    assert_eq!((reply.size, reply.sha256), (content.len() as u64, want));
    drop(s);
    // From a file under files_dir, streamed.
    let files_dir = tempfile::tempdir().unwrap();
    std::fs::write(files_dir.path().join("blob"), &content).unwrap();
    push_server(socks[1].clone());
    let _held = slots.try_acquire("vm").unwrap();
    let mut s = open(&slots, &socks, "file.push").await.unwrap();
    let source = files::open_source(Some(files_dir.path()), "blob", 1 << 20).unwrap();
    let reply = files::push(&mut s, &push_request(None), source).await.unwrap();
    assert_eq!(reply.sha256, files::sha256(&content));
}

#[tokio::test]
async fn push_refuses_content_that_is_not_what_the_sha256_says_before_sending() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    let slots = ExecSlots::default();
    fake(socks[0].clone(), all_caps(), |_req, _body, _r, _w| async move {
        panic!("nothing may be sent");
    });
    let mut s = open(&slots, &socks, "file.push").await.unwrap();
    let e =
        files::push(&mut s, &push_request(Some("0".repeat(64))), PushContent::Bytes(b"hi".to_vec())).await.unwrap_err();
    assert!(matches!(&e, ExecError::Checksum { expected, .. } if expected == &"0".repeat(64)), "{e}");
}

/// A fake `file.pull` that sends `data` and claims `sha`.
fn pull_server(sock: PathBuf, data: Vec<u8>, sha: String) {
    fake(sock, all_caps(), move |req, _body, _r, mut w| async move {
        let id = req["id"].clone();
        for piece in data.chunks(MAX_CHUNK) {
            send(
                &mut w,
                json!({"jsonrpc": "2.0", "method": "file.data", "params": {"id": id, "data": base64::encode(piece)}}),
            )
            .await;
        }
        send(&mut w, json!({"jsonrpc": "2.0", "id": id, "result": {"size": data.len(), "sha256": sha, "mode": 420}}))
            .await;
    });
}

#[tokio::test]
async fn pull_checks_the_sha256_of_what_arrived_against_the_guests_claim() {
    let d = tempfile::tempdir().unwrap();
    let socks = sockets(&d);
    let slots = ExecSlots::default();
    let data: Vec<u8> = (0..150_000u32).map(|i| (i % 13) as u8).collect();
    pull_server(socks[0].clone(), data.clone(), files::sha256(&data));
    let mut s = open(&slots, &socks, "file.pull").await.unwrap();
    let (reply, got) = files::pull(&mut s, "/etc/x", 1 << 20).await.unwrap();
    assert_eq!((got, reply.mode), (data.clone(), 0o644));
    drop(s);
    pull_server(socks[0].clone(), data.clone(), "0".repeat(64));
    let mut s =
        Session::open(&socks, slots.try_acquire("vm").unwrap(), "file.pull").await.unwrap_or_else(|e| panic!("{e}"));
    let e = files::pull(&mut s, "/etc/x", 1 << 20).await.unwrap_err();
    assert!(matches!(e, ExecError::Checksum { .. }), "{e}");
    drop(s);
    // More than max_bytes: the session ends, nothing more is kept.
    pull_server(socks[0].clone(), data.clone(), files::sha256(&data));
    let mut s =
        Session::open(&socks, slots.try_acquire("vm").unwrap(), "file.pull").await.unwrap_or_else(|e| panic!("{e}"));
    let e = files::pull(&mut s, "/etc/x", 1000).await.unwrap_err();
    assert!(matches!(&e, ExecError::Session(m) if m.to_string().contains("more than the 1000 bytes")), "{e}");
}

#[test]
fn a_source_outside_files_dir_is_refused() {
    let files_dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"s").unwrap();
    std::fs::write(files_dir.path().join("ok"), b"fine").unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), files_dir.path().join("link")).unwrap();
    std::os::unix::fs::symlink("../", files_dir.path().join("up")).unwrap();
    std::fs::create_dir(files_dir.path().join("sub")).unwrap();
    let dir = Some(files_dir.path());
    for bad in ["../secret", "/etc/passwd", "", "./ok", "sub/../ok", "a\0b"] {
        assert!(matches!(files::open_source(dir, bad, 100), Err(SourceError::NotRelative(_))), "{bad:?}");
    }
    for escaping in ["link", "up/secret"] {
        assert!(matches!(files::open_source(dir, escaping, 100), Err(SourceError::Open { .. })), "{escaping}");
    }
    assert!(matches!(files::open_source(dir, "sub", 100), Err(SourceError::Open { .. })), "a directory");
    assert!(matches!(files::open_source(dir, "ok", 3), Err(SourceError::TooLarge { size: 4, .. })));
    assert!(matches!(files::open_source(None, "ok", 100), Err(SourceError::NoFilesDir)));
    assert!(matches!(files::open_source(dir, "ok", 100), Ok(PushContent::File(..))));
}
