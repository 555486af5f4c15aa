//! `vmhostctl exec|push|pull|ssh` as a user runs them: the real binary against a scripted
//! daemon on a Unix socket, which answers each method as vmhostd's design says (docs/api.md:
//! `vm.exec` with `vm.exec.output` notifications before its answer, `vm.file_push`,
//! `vm.file_pull`, `vm.get`, `vm.guest_network`), so what is checked is the CLI: exit codes,
//! streaming, the files it writes and the argv it hands to `ssh`. The same commands against a
//! real vmhostd and guest are in `guest_cli_e2e.rs`.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vmhost_tests::{bin, sha256_hex};

type Handler = dyn Fn(&Value, &mut UnixStream) + Send + Sync;

/// A daemon that answers each connection's requests with `handler(request, stream)`; the
/// requests are recorded.
struct Scripted {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    requests: Arc<Mutex<Vec<Value>>>,
}

impl Scripted {
    fn start(handler: impl Fn(&Value, &mut UnixStream) + Send + Sync + 'static) -> Scripted {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vmhostd.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        let handler: Arc<Handler> = Arc::new(handler);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let seen = seen.clone();
                let handler = handler.clone();
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    let mut line = String::new();
                    while reader.read_line(&mut line).unwrap_or(0) > 0 {
                        let request: Value = serde_json::from_str(&line).unwrap();
                        seen.lock().unwrap().push(request.clone());
                        handler(&request, &mut stream);
                        line.clear();
                    }
                });
            }
        });
        Scripted { _dir: dir, socket, requests }
    }

    fn ctl(&self) -> Command {
        let mut c = Command::new(bin("vmhostctl"));
        c.arg("--socket").arg(&self.socket);
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.ctl().args(args).stdin(Stdio::null()).output().unwrap()
    }

    fn params(&self, method: &str) -> Vec<Value> {
        self.requests.lock().unwrap().iter().filter(|r| r["method"] == method).map(|r| r["params"].clone()).collect()
    }
}

fn send(stream: &mut UnixStream, message: Value) {
    let mut line = message.to_string();
    line.push('\n');
    let _ = stream.write_all(line.as_bytes());
}

fn answer(stream: &mut UnixStream, request: &Value, result: Value) {
    send(stream, json!({"jsonrpc": "2.0", "id": request["id"], "result": result}));
}

fn fail(stream: &mut UnixStream, request: &Value, code: i32, message: &str, details: Value) {
    let error = json!({"code": code, "message": message, "data": {"kind": "x", "field": "name", "details": details}});
    send(stream, json!({"jsonrpc": "2.0", "id": request["id"], "error": error}));
}

fn output(stream: &mut UnixStream, which: &str, data: &[u8]) {
    let params = json!({"name": "vm1", "stream": which, "data": b64(data)});
    send(stream, json!({"jsonrpc": "2.0", "method": "vm.exec.output", "params": params}));
}

fn b64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let n =
            (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            out.push(if i <= c.len() { char::from(A[((n >> (18 - 6 * i)) & 63) as usize]) } else { '=' });
        }
    }
    out
}

fn exec_answer(exit_code: Value, signal: Value, timed_out: bool) -> Value {
    json!({"exit_code": exit_code, "signal": signal, "timed_out": timed_out, "duration_ms": 5,
           "stdout": "", "stderr": "", "stdout_bytes": 0, "stderr_bytes": 0,
           "stdout_truncated": false, "stderr_truncated": false, "encoding": "base64", "slot": 0})
}

#[test]
fn exec_passes_the_command_s_status_and_bytes_through() {
    let daemon = Scripted::start(|req, s| {
        let argv: Vec<&str> = req["params"]["argv"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        match argv.as_slice() {
            ["exit", code] => answer(s, req, exec_answer(json!(code.parse::<i32>().unwrap()), Value::Null, false)),
            ["kill"] => answer(s, req, exec_answer(Value::Null, json!(15), false)),
            ["sleep"] => answer(s, req, exec_answer(Value::Null, json!(9), true)),
            ["off"] => fail(s, req, 4095, "guest exec is off on this host", json!({"reason": "host"})),
            ["cat"] => {
                output(s, "stdout", b"\x00\xffbinary\x1b[31m\n");
                output(s, "stderr", b"warn\n");
                output(s, "stdout", b"second\n");
                answer(s, req, exec_answer(json!(0), Value::Null, false));
            }
            _ => answer(s, req, exec_answer(json!(0), Value::Null, false)),
        }
    });
    for (argv, code) in [
        (vec!["exit", "0"], 0),
        (vec!["exit", "3"], 3),
        (vec!["exit", "255"], 255),
        (vec!["kill"], 143),
        (vec!["sleep"], 124),
    ] {
        let mut args = vec!["exec", "vm1", "--"];
        args.extend(argv.iter().copied());
        let out = daemon.run(&args);
        assert_eq!(out.status.code(), Some(code), "{argv:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = daemon.run(&["exec", "vm1", "--", "sleep"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("killed at its timeout"), "{out:?}");

    // vmhostd's refusal: 255 and its message, never one of the command's codes.
    let out = daemon.run(&["exec", "vm1", "--", "off"]);
    assert_eq!(out.status.code(), Some(255));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error 4095 (exec_disabled)") && stderr.contains("guest exec is off"), "{stderr}");

    // To a pipe the output is the guest's bytes, each stream on its own.
    let out = daemon.run(&["exec", "vm1", "--", "cat"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, b"\x00\xffbinary\x1b[31m\nsecond\n");
    assert_eq!(out.stderr, b"warn\n");

    // The request: argv after --, env, cwd, timeout, stdin from --stdin, streamed.
    let mut child = daemon
        .ctl()
        .args(["exec", "vm1", "--env", "A=1", "--cwd", "/srv", "--timeout", "7", "--stdin", "--", "exit", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"input bytes").unwrap();
    assert!(child.wait().unwrap().success());
    let sent = daemon.params("vm.exec").pop().unwrap();
    assert_eq!(
        sent,
        json!({"name": "vm1", "argv": ["exit", "0"], "env": ["A=1"], "cwd": "/srv", "timeout_s": 7,
               "stdin": b64(b"input bytes"), "stream": true, "encoding": "base64"})
    );

    // --json: not streamed, the answer printed, the same exit code.
    let out = daemon.run(&["--json", "exec", "vm1", "--", "exit", "3"]);
    assert_eq!(out.status.code(), Some(3));
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["exit_code"], 3);
    assert_eq!(daemon.params("vm.exec").pop().unwrap()["stream"], false);
}

#[test]
fn exec_prints_output_as_it_comes() {
    // The daemon sends a first chunk, then holds its answer until the test has read that chunk
    // from vmhostctl's stdout: a vmhostctl that waited for the answer would never print it.
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release = Mutex::new(release_rx);
    let daemon = Scripted::start(move |req, s| {
        output(s, "stdout", b"first line\n");
        let _ = release.lock().unwrap().recv_timeout(Duration::from_secs(60));
        output(s, "stdout", b"last line\n");
        answer(s, req, exec_answer(json!(0), Value::Null, false));
    });
    let mut child = daemon.ctl().args(["exec", "vm1", "--", "long"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let (line_tx, line_rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        line_tx.send(line).unwrap();
        let mut rest = String::new();
        stdout.read_to_string(&mut rest).unwrap();
        rest
    });
    let first = line_rx.recv_timeout(Duration::from_secs(60)).expect("the first chunk before the answer");
    assert_eq!(first, "first line\n");
    release_tx.send(()).unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(reader.join().unwrap(), "last line\n");
}

#[test]
fn push_and_pull_move_files_checked_by_sha256() {
    let content: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let pulled = content.clone();
    let daemon = Scripted::start(move |req, s| match req["method"].as_str().unwrap() {
        "vm.file_push" => {
            let p = &req["params"];
            answer(s, req, json!({"path": p["path"], "size": 300_000, "sha256": p["sha256"]}));
        }
        "vm.file_pull" if req["params"]["path"] == "/lying" => answer(
            s,
            req,
            json!({"path": "/lying", "size": 5, "sha256": sha256_hex(b"other"), "mode": 420, "content": b64(b"hello")}),
        ),
        "vm.file_pull" => answer(
            s,
            req,
            json!({"path": req["params"]["path"], "size": pulled.len(), "sha256": sha256_hex(&pulled),
                   "mode": 0o4755, "content": b64(&pulled)}),
        ),
        _ => fail(s, req, -32601, "Method not found", Value::Null),
    });
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("payload.bin");
    std::fs::write(&local, &content).unwrap();

    let out = daemon.run(&["push", "vm1", local.to_str().unwrap(), "/opt/payload.bin", "--mode", "0600", "--mkdir"]);
    assert!(out.status.success(), "{out:?}");
    let sent = daemon.params("vm.file_push").pop().unwrap();
    assert_eq!(sent["sha256"], sha256_hex(&content));
    assert_eq!(
        (sent["mode"].as_u64(), &sent["mkdir"], &sent["path"]),
        (Some(0o600), &json!(true), &json!("/opt/payload.bin"))
    );
    assert_eq!(sent["content"], b64(&content));
    let out = daemon.run(&["push", "vm1", "/opt/big.iso", "--source", "isos/big.iso"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(daemon.params("vm.file_push").pop().unwrap()["source"], "isos/big.iso");

    let copy = dir.path().join("copy.bin");
    std::fs::write(&copy, b"old").unwrap();
    let out = daemon.run(&["pull", "vm1", "/opt/payload.bin", copy.to_str().unwrap(), "--max-bytes", "400000"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(sha256_hex(&std::fs::read(&copy).unwrap()), sha256_hex(&content));
    assert_eq!(
        daemon.params("vm.file_pull").pop().unwrap(),
        json!({"name": "vm1", "path": "/opt/payload.bin", "max_bytes": 400000})
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&copy).unwrap().permissions().mode() & 0o7000, 0, "never the guest's set-id bit");

    // Content that is not what the answer says: refused, LOCAL as it was, no temp file left.
    let kept = dir.path().join("kept.bin");
    std::fs::write(&kept, b"old").unwrap();
    let out = daemon.run(&["pull", "vm1", "/lying", kept.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing written"), "{out:?}");
    assert_eq!(std::fs::read(&kept).unwrap(), b"old");
    let mut names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(names, ["copy.bin", "kept.bin", "payload.bin"]);
}

/// A fake `ssh` first in PATH that writes its argv, one per line, to `ARGV_FILE`.
fn fake_ssh(dir: &Path) -> (String, PathBuf) {
    let record = dir.join("argv");
    let script = dir.join("ssh");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done > {}\nexit 7\n", record.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default());
    (path, record)
}

#[test]
fn ssh_finds_the_address_and_user_and_execs_ssh() {
    let daemon = Scripted::start(|req, s| {
        let name = req["params"]["name"].as_str().unwrap_or_default();
        match (req["method"].as_str().unwrap(), name) {
            ("vm.get", "static") => answer(
                s,
                req,
                json!({"name": name, "spec": {"nics": [
                {"network": "a", "ipv4": {"mode": "dhcp"}},
                {"network": "b", "ipv4": {"mode": "static", "address": "10.1.2.3/24"}}],
                "ssh": {"user": "ops", "keys": ["ssh-ed25519 AAAA x"]}}}),
            ),
            ("vm.get", _) => {
                answer(s, req, json!({"name": name, "spec": {"nics": [{"network": "a", "ipv4": {"mode": "dhcp"}}]}}))
            }
            ("vm.guest_network", "dhcp") => answer(
                s,
                req,
                json!({"interfaces": [
                {"name": "lo", "mac": "", "up": true, "mtu": 65536, "kind": "", "alias": "", "addresses": ["127.0.0.1/8"]},
                {"name": "eth0", "mac": "52:54:00:00:00:01", "up": true, "mtu": 1500, "kind": "", "alias": "",
                 "addresses": ["169.254.1.1/16", "-oProxyCommand=evil", "192.168.5.6/24"]}],
                "routes": [], "dns": {"servers": [], "search": []}}),
            ),
            ("vm.guest_network", _) => fail(s, req, 5001, "the guest agent is not connected", Value::Null),
            _ => fail(s, req, -32601, "Method not found", Value::Null),
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let (path, record) = fake_ssh(dir.path());
    let ssh = |args: &[&str]| {
        let out = daemon.ctl().args(args).env("PATH", &path).stdin(Stdio::null()).output().unwrap();
        let argv = std::fs::read_to_string(&record).unwrap_or_default();
        let _ = std::fs::remove_file(&record);
        (out, argv.lines().map(str::to_string).collect::<Vec<_>>())
    };

    let (out, argv) = ssh(&["ssh", "static"]);
    assert_eq!(out.status.code(), Some(7), "vmhostctl became ssh: its exit code");
    assert_eq!(argv, ["-l", "ops", "10.1.2.3"]);
    assert!(daemon.params("vm.guest_network").is_empty(), "the spec's address needs no agent");

    let (_, argv) = ssh(&["ssh", "dhcp", "-l", "admin", "--", "-p", "2222", "uptime"]);
    assert_eq!(argv, ["-l", "admin", "192.168.5.6", "-p", "2222", "uptime"]);
    let (_, argv) = ssh(&["ssh", "dhcp"]);
    assert_eq!(argv, ["-l", "root", "192.168.5.6"], "no spec user: root");

    let (out, argv) = ssh(&["ssh", "noagent"]);
    assert!(argv.is_empty(), "ssh not run without an address");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no static address in its spec"), "{out:?}");
}
