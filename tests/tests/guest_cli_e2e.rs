//! `vmhostctl exec|push|pull|ssh` against a real vmhostd and real TCG guests (the test guest with
//! the static agent). `ssh` runs a fake `ssh` first in `PATH` that records its argv: the test
//! guest has no sshd, and what is checked is the address and user vmhostctl chose and handed on.
//! The CLI's own behaviour against every answer shape is in `guest_cli.rs`.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;
use vmhost_tests::{agent_guest, bin, wait, HostOptions, TestHost};

const LAN: &str = vmhost_tests::LAN_NETWORK;

/// An OpenSSH public key for a spec's `ssh.keys`.
const KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBcBLv4CxEnkCV3cbVwOWXhTlpvaBNB7ymBlsvDu0wOA ops@example";

/// A direct-kernel VM of the agent guest with `nics`.
fn spec(name: &str, nics: Value) -> Value {
    let g = agent_guest();
    json!({"name": name, "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"},
        "nics": nics})
}

/// vmhostctl against `host` with `PATH` as given.
fn ctl(host: &TestHost, path: &str, args: &[&str]) -> Output {
    Command::new(bin("vmhostctl"))
        .arg("--socket")
        .arg(&host.socket)
        .args(args)
        .env("PATH", path)
        .stdin(Stdio::null())
        .output()
        .expect("run vmhostctl")
}

/// A fake `ssh` in `dir` that writes its argv, one per line, to the returned file and exits 7.
fn fake_ssh(dir: &Path) -> (String, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let record = dir.join("argv");
    let script = dir.join("ssh");
    let body = format!("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done > {}\nexit 7\n", record.display());
    std::fs::write(&script, body).expect("write fake ssh");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod fake ssh");
    (format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default()), record)
}

#[test]
fn ssh_runs_ssh_at_the_spec_s_address_or_else_the_agent_s() {
    let host = TestHost::start(HostOptions { netns: true, extra: LAN.into(), ..HostOptions::default() });
    host.call(
        "vm.create",
        json!({"spec": spec("fixed", json!([{"network": "lan", "ipv4": {"mode": "static", "address": "10.0.0.5/24"}}]))}),
    );
    // No address in the spec: the one the agent reports (an interface it made itself).
    let mut dynamic = spec("dynamic", json!([{"network": "lan"}]));
    dynamic["guest_interfaces"] =
        json!([{"name": "eth0.20", "link": "eth0", "vlan_id": 20, "address": "10.20.0.7/24"}]);
    host.call("vm.create", json!({ "spec": dynamic }));

    let dir = tempfile::tempdir().expect("tempdir");
    let (path, record) = fake_ssh(dir.path());
    let argv = || -> Vec<String> {
        let text = std::fs::read_to_string(&record).unwrap_or_default();
        let _ = std::fs::remove_file(&record);
        text.lines().map(str::to_string).collect()
    };

    let out = ctl(&host, &path, &["ssh", "fixed", "--", "-p", "2222", "uptime"]);
    assert_eq!(out.status.code(), Some(7), "vmhostctl became the fake ssh: {out:?}");
    assert_eq!(argv(), ["-l", "root", "10.0.0.5", "-p", "2222", "uptime"]);

    wait::until("the agent of dynamic to report eth0.20", Duration::from_secs(300), || {
        let net: Value =
            host.client().call("vm.guest_network", json!({"name": "dynamic"})).map_err(|e| e.to_string())?;
        let has = net["interfaces"].as_array().into_iter().flatten().any(|i| i["addresses"] == json!(["10.20.0.7/24"]));
        if has {
            Ok(())
        } else {
            Err(net.to_string())
        }
    });
    let out = ctl(&host, &path, &["ssh", "dynamic", "-l", "admin"]);
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert_eq!(argv(), ["-l", "admin", "10.20.0.7"]);

    // The spec's ssh account is the default user.
    let mut keyed = spec("keyed", json!([{"network": "lan", "ipv4": {"mode": "static", "address": "10.0.0.9/24"}}]));
    keyed["ssh"] = json!({"user": "ops", "keys": [KEY]});
    host.call("vm.create", json!({ "spec": keyed }));
    let out = ctl(&host, &path, &["ssh", "keyed"]);
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert_eq!(argv(), ["-l", "ops", "10.0.0.9"]);

    let out = ctl(&host, &path, &["ssh", "nosuch"]);
    assert_eq!(out.status.code(), Some(1), "vmhostd's 4040: {out:?}");
    assert!(argv().is_empty(), "ssh not run for a VM that does not exist");
}

/// `[agent]` with exec on and `files_dir`.
fn exec_host(files_dir: &Path) -> TestHost {
    let extra = format!("[agent]\nallow_exec = true\nfiles_dir = \"{}\"\n", files_dir.display());
    TestHost::start(HostOptions { extra, ..HostOptions::default() })
}

/// Waits until `vmhostctl exec NAME -- true` succeeds: the guest booted and its exec server
/// answers.
fn wait_exec(host: &TestHost, name: &str) {
    wait::until(&format!("the exec server of {name}"), Duration::from_secs(300), || {
        let out = host.ctl(&["exec", name, "--", "true"]);
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("{:?}: {}", out.status.code(), String::from_utf8_lossy(&out.stderr)))
        }
    });
}

#[test]
fn exec_passes_status_and_output_through_and_files_go_both_ways() {
    let files = tempfile::Builder::new().prefix("vmhfiles").tempdir_in("/tmp").expect("tempdir");
    let host = exec_host(files.path());
    host.call("vm.create", json!({ "spec": spec("ex", json!([])) }));
    wait_exec(&host, "ex");

    for (cmd, code) in [("exit 7", 7), ("kill -TERM $$", 143), ("exit 0", 0)] {
        let out = host.ctl(&["exec", "ex", "--", "sh", "-c", cmd]);
        assert_eq!(out.status.code(), Some(code), "{cmd}: {out:?}");
    }
    let out = host.ctl(&["exec", "ex", "--timeout", "2", "--", "sleep", "60"]);
    assert_eq!(out.status.code(), Some(124), "{out:?}");

    // Output arrives while the command runs: the command waits for a file that only a second
    // command, run after the first line was read, creates.
    let mut child = Command::new(bin("vmhostctl"))
        .arg("--socket")
        .arg(&host.socket)
        .args(["exec", "ex", "--", "sh", "-c", "echo first; while [ ! -e /tmp/go ]; do sleep 1; done; echo second >&2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run vmhostctl exec");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut first).expect("read the first line");
    assert_eq!(first, "first\n");
    assert!(host.ctl(&["exec", "ex", "--", "touch", "/tmp/go"]).status.success());
    let out = child.wait_with_output().expect("wait for vmhostctl");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "second\n");

    // stdin, env and cwd reach the command.
    let mut child = Command::new(bin("vmhostctl"))
        .arg("--socket")
        .arg(&host.socket)
        .args([
            "exec",
            "ex",
            "--stdin",
            "--env",
            "GREETING=hello",
            "--cwd",
            "/tmp",
            "--",
            "sh",
            "-c",
            "cat; echo \" $GREETING $(pwd)\"",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run vmhostctl exec");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), b"from stdin").expect("write stdin");
    let out = child.wait_with_output().expect("wait for vmhostctl");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from stdin hello /tmp\n", "{out:?}");

    // A file pushed inline and pulled back, and one vmhostd reads from files_dir.
    let local = tempfile::tempdir().expect("tempdir");
    let blob: Vec<u8> = (0..700_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(local.path().join("blob"), &blob).expect("write blob");
    let blob_path = local.path().join("blob");
    let out =
        host.ctl(&["push", "ex", blob_path.to_str().unwrap_or_default(), "/root/in/blob", "--mkdir", "--mode", "0600"]);
    assert!(out.status.success(), "{out:?}");
    let sum = host.ctl(&["exec", "ex", "--", "sha256sum", "/root/in/blob"]);
    assert!(String::from_utf8_lossy(&sum.stdout).starts_with(&vmhost_tests::sha256_hex(&blob)), "{sum:?}");
    let back = local.path().join("back");
    let out = host.ctl(&["pull", "ex", "/root/in/blob", back.to_str().unwrap_or_default()]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(vmhost_tests::sha256_file(&back), vmhost_tests::sha256_hex(&blob));

    let big: Vec<u8> = (0..1_500_000u32).map(|i| (i % 253) as u8).collect();
    std::fs::write(files.path().join("big.bin"), &big).expect("write big.bin");
    let out = host.ctl(&["push", "ex", "/root/big.bin", "--source", "big.bin"]);
    assert!(out.status.success(), "{out:?}");
    let big_back = local.path().join("big.bin");
    let out =
        host.ctl(&["pull", "ex", "/root/big.bin", big_back.to_str().unwrap_or_default(), "--max-bytes", "2097152"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(vmhost_tests::sha256_file(&big_back), vmhost_tests::sha256_hex(&big));
}
