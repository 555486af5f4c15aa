//! The socket protocol of the real daemon: framing errors, JSON-RPC errors, peer credentials.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt; // uid/gid; std drops supplementary groups when root sets a uid
use std::process::Command;
use std::time::Duration;
use vmhost_tests::{bin, HostOptions, TestHost};

fn raw(host: &TestHost) -> (UnixStream, BufReader<UnixStream>) {
    let s = UnixStream::connect(&host.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let r = BufReader::new(s.try_clone().unwrap());
    (s, r)
}

fn send(s: &mut UnixStream, r: &mut BufReader<UnixStream>, bytes: &[u8]) -> Value {
    s.write_all(bytes).unwrap();
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"))
}

#[test]
fn jsonrpc_errors_on_one_connection() {
    let host = TestHost::start(HostOptions::default());
    let (mut s, mut r) = raw(&host);
    let v = send(&mut s, &mut r, b"{not json\n");
    assert_eq!(v["error"]["code"], -32700);
    assert_eq!(v["id"], Value::Null);
    let v = send(&mut s, &mut r, b"\xff\xfe\n");
    assert_eq!(v["error"]["code"], -32700, "invalid UTF-8");
    let v = send(&mut s, &mut r, b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"vm.nope\"}\n");
    assert_eq!((v["id"].clone(), v["error"]["code"].clone()), (json!(1), json!(-32601)));
    let v = send(&mut s, &mut r, b"{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"vm.get\",\"params\":{\"nmae\":\"x\"}}\n");
    assert_eq!(v["error"]["code"], -32602);
    assert_eq!(v["error"]["data"]["field"], "nmae");
    let v = send(
        &mut s,
        &mut r,
        b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"vm.create\",\"params\":{\"spec\":{\"name\":\"a\",\"cpu\":1,\"memory_mib\":64,\"boot\":{\"kernel\":\"/k\"},\"gpu\":1}}}\n",
    );
    assert_eq!((v["error"]["code"].clone(), v["error"]["data"]["field"].clone()), (json!(-32602), json!("spec.gpu")));
    let v = send(&mut s, &mut r, b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"vm.get\",\"params\":{\"name\":\"x\"}}\n");
    assert_eq!(v["error"]["code"], 4040);
    assert_eq!(v["error"]["data"]["kind"], "not_found");
    // A batch: two calls and a notification give one array of two responses.
    let v = send(
        &mut s,
        &mut r,
        b"[{\"jsonrpc\":\"2.0\",\"id\":10,\"method\":\"vm.list\"},{\"jsonrpc\":\"2.0\",\"method\":\"vm.list\"},{\"jsonrpc\":\"2.0\",\"id\":11,\"method\":\"host.info\"}]\n",
    );
    let ids: Vec<i64> = v.as_array().unwrap().iter().map(|x| x["id"].as_i64().unwrap()).collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&10) && ids.contains(&11));
    // Spec validation errors carry the field.
    let v = send(
        &mut s,
        &mut r,
        b"{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":\"vm.create\",\"params\":{\"spec\":{\"name\":\"Bad_Name\",\"cpu\":1,\"memory_mib\":64,\"boot\":{\"kernel\":\"/k\"}}}}\n",
    );
    assert_eq!((v["error"]["code"].clone(), v["error"]["data"]["field"].clone()), (json!(2001), json!("spec.name")));
}

#[test]
fn an_oversize_line_is_refused_and_other_clients_are_unaffected() {
    let host = TestHost::start(HostOptions::default());
    // A client that sends an endless line without newline must not stall anyone.
    let mut staller = UnixStream::connect(&host.socket).unwrap();
    staller.write_all(&vec![b'x'; 512 * 1024]).unwrap();
    assert!(host.call("vm.list", json!({})).is_array());

    let (mut s, mut r) = raw(&host);
    let big = vec![b' '; 1024 * 1024 + 16];
    // The daemon may close while we are still writing; the error line is what counts.
    let _ = s.write_all(&big);
    let _ = s.write_all(b"\n");
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["error"]["code"], -32600);
    let mut rest = Vec::new();
    let n = r.read_to_end(&mut rest).unwrap_or(0);
    assert_eq!(n, 0, "connection closed after the error");
    assert!(host.call("host.info", json!({}))["version"].is_string());
}

/// Runs vmhostctl as `uid`:`gid`. The checkout may be in a 0700 directory (a home, `mktemp -d`)
/// that other users cannot enter, so they run a copy in the host's own 0755 temp dir.
fn ctl_as(host: &TestHost, uid: u32, gid: u32, args: &[&str]) -> std::process::Output {
    use std::os::unix::fs::PermissionsExt;
    let ctl = host.dir.path().join("vmhostctl");
    if !ctl.exists() {
        std::fs::copy(bin("vmhostctl"), &ctl).unwrap();
        std::fs::set_permissions(&ctl, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    Command::new(&ctl).arg("--socket").arg(&host.socket).args(args).uid(uid).gid(gid).output().unwrap()
}

#[test]
fn peers_are_checked_by_kernel_credentials() {
    // Debian's "nogroup" is gid 65534: make it the read-only group.
    let host = TestHost::start(HostOptions { readonly_group: "nogroup".into(), ..HostOptions::default() });
    let spec = host.dir.path().join("spec.json");
    std::fs::write(&spec, host.kernel_spec("ro").to_string()).unwrap();
    std::fs::set_permissions(&spec, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();

    let out = ctl_as(&host, 65534, 65534, &["list"]);
    assert!(out.status.success(), "read-only peer may list: {}", String::from_utf8_lossy(&out.stderr));
    // Metrics are reads: vm.stats and host.stats (docs/metrics.md).
    let out = ctl_as(&host, 65534, 65534, &["stats", "--prometheus"]);
    assert!(out.status.success(), "read-only peer may read stats: {}", String::from_utf8_lossy(&out.stderr));
    let out = ctl_as(&host, 65534, 65534, &["create", spec.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("1002"), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(host.call("vm.list", json!({})), json!([]), "nothing was created");

    let out = ctl_as(&host, 4242, 4242, &["list"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("1001"), "{}", String::from_utf8_lossy(&out.stderr));
    // Root may do everything.
    let out = host.ctl(&["--json", "info"]);
    assert!(out.status.success());
}

#[test]
fn vmhostctl_prints_tables_json_and_errors() {
    let host = TestHost::start(HostOptions::default());
    let spec = host.dir.path().join("spec.json");
    std::fs::write(&spec, host.kernel_spec("cli").to_string()).unwrap();
    let out = host.ctl(&["create", spec.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "cli: changed, running");
    let out = host.ctl(&["list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    assert!(lines.next().unwrap().starts_with("NAME"));
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(&row[..5], &["cli", "running", "running", "1", "256"]);
    let out = host.ctl(&["--json", "get", "cli"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "running");
    // A reader that has closed the pipe (`| head -0`): no panic, just the pipe signal.
    let (reader, writer) = nix::unistd::pipe().unwrap();
    drop(reader);
    let out = Command::new(bin("vmhostctl"))
        .arg("--socket")
        .arg(&host.socket)
        .args(["--json", "get", "cli"])
        .stdout(std::process::Stdio::from(writer))
        .output()
        .unwrap();
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&out.status), Some(libc::SIGPIPE));
    let out = host.ctl(&["get", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error 4040 (not_found)"));
    let out = host.ctl(&["destroy", "cli"]);
    assert!(out.status.success());
    let out = Command::new(bin("vmhostctl")).args(["--socket", "/nonexistent.sock", "list"]).output().unwrap();
    assert_eq!(out.status.code(), Some(3));
}
