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

    let out = ctl(&host, &path, &["ssh", "nosuch"]);
    assert_eq!(out.status.code(), Some(1), "vmhostd's 4040: {out:?}");
    assert!(argv().is_empty(), "ssh not run for a VM that does not exist");
}
