//! VMs outlive the daemon whatever signal its process group gets (issue 13).
//!
//! Every program vmhostd starts runs in a session and process group of its own
//! (`daemon/src/sandbox/spawn.rs`), so what is sent to the daemon's group or terminal (Ctrl-C,
//! `kill -- -PGID`) ends the daemon and its spawner but no QEMU, and the next daemon adopts every
//! VM with the same pid.
//!
//! The harness starts vmhostd in the test's own process group, where signalling the group would
//! kill the test, so this test stops that daemon and runs vmhostd itself in a process group of
//! its own (as a shell's job control does), with the same config and log.

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use std::fs;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;
use vmhost_tests::{alive, bin, HostOptions, TestHost, GUEST_READY};

const BOOT: Duration = Duration::from_secs(90);

/// Fields of /proc/PID/stat: (state, ppid, pgrp, session); `None` once the process is gone.
fn stat(pid: i32) -> Option<(char, i32, i32, i32)> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses; the fields after the last ')' do not.
    let rest: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let num = |i: usize| rest.get(i).and_then(|v| v.parse::<i32>().ok());
    Some((rest.first()?.chars().next()?, num(1)?, num(2)?, num(3)?))
}

/// Live (not zombie) processes in process group `pgid`.
fn live_members(pgid: i32) -> Vec<i32> {
    let mut found = Vec::new();
    for e in fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        if let Some((state, _, pgrp, _)) = stat(pid) {
            if pgrp == pgid && state != 'Z' && state != 'X' {
                found.push(pid);
            }
        }
    }
    found
}

/// vmhostd as the leader of a process group of its own. Dropping it while it runs (a failed
/// test) SIGKILLs the group; the VMs are the host's to clean up.
struct GroupDaemon {
    child: Child,
    exited: bool,
}

impl GroupDaemon {
    /// Starts vmhostd on `host`'s config in a new process group and waits until it answers.
    fn start(host: &TestHost) -> GroupDaemon {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(host.dir.path().join("vmhostd.log"))
            .expect("daemon log");
        let err = log.try_clone().expect("dup log");
        let child = Command::new(bin("vmhostd"))
            .arg("--config")
            .arg(&host.config)
            .env("VMHOST_LOG", "debug")
            .envs(host.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("spawn vmhostd");
        let mut d = GroupDaemon { child, exited: false };
        vmhost_tests::wait::daemon_answers(&host.socket, &mut d.child, || host.daemon_log());
        let pid = d.pid();
        let (_, _, pgrp, _) = stat(pid).expect("vmhostd's stat");
        assert_eq!(pgrp, pid, "vmhostd leads its own process group");
        assert_ne!(pgrp, nix::unistd::getpgrp().as_raw(), "not the test's group");
        d
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    /// Sends `sig` to the daemon's whole process group, then waits until the daemon has exited
    /// and nothing of its group is alive (its spawner included). Returns the daemon's status.
    fn signal_group(&mut self, sig: Signal, host: &TestHost) -> ExitStatus {
        let pgid = self.pid();
        assert!(!live_members(pgid).is_empty());
        kill(Pid::from_raw(-pgid), sig).unwrap_or_else(|e| panic!("kill -{sig} -- -{pgid}: {e}"));
        let status =
            vmhost_tests::wait::exited(&mut self.child, &format!("vmhostd after {sig}"), Duration::from_secs(60));
        self.exited = true;
        vmhost_tests::wait::until_true(
            &format!("{sig} to group {pgid} to end all of it"),
            Duration::from_secs(60),
            || live_members(pgid).is_empty(),
            || format!("left running: {:?}; daemon log:\n{}", live_members(pgid), host.daemon_log()),
        );
        status
    }
}

impl Drop for GroupDaemon {
    fn drop(&mut self) {
        if self.exited {
            // Reaped: its pid, and so the group id, may belong to someone else by now.
            return;
        }
        let _ = kill(Pid::from_raw(-self.pid()), Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// Each VM's recorded pid and status, by `vm.list`.
fn listed(host: &TestHost) -> Vec<(String, Value, Value)> {
    let list = host.call("vm.list", json!({}));
    list.as_array()
        .expect("vm.list is an array")
        .iter()
        .map(|v| (v["name"].as_str().unwrap_or_default().to_string(), v["status"].clone(), v["pid"].clone()))
        .collect()
}

#[test]
fn vms_outlive_sigint_and_sigkill_to_the_daemons_process_group() {
    // Stopped at once: the test runs its own daemon, in a group of its own.
    let host = TestHost::prepare(HostOptions::default());
    let mut daemon = GroupDaemon::start(&host);
    let names = ["one", "two"];
    for name in names {
        let v = host.call("vm.create", json!({ "spec": host.kernel_spec(name) }));
        assert_eq!(v["vm"]["status"], "running", "{v}");
    }
    for name in names {
        assert!(host.wait_serial(name, GUEST_READY, BOOT), "{name} never reached userspace:\n{}", host.serial(name));
    }
    let pids: Vec<i32> =
        names.iter().map(|n| host.call("vm.get", json!({ "name": n }))["pid"].as_i64().expect("pid") as i32).collect();
    let mut running = host.qemu_pids();
    running.sort_unstable();
    let mut expected = pids.clone();
    expected.sort_unstable();
    assert_eq!(running, expected, "one QEMU per VM");

    // Each QEMU leads its own session and process group, while its parent (the spawner) is in
    // the daemon's group: a signal to that group reaches the parent but not QEMU.
    let (_, _, daemon_pgrp, daemon_sid) = stat(daemon.pid()).expect("vmhostd's stat");
    for &pid in &pids {
        let (_, ppid, pgrp, sid) = stat(pid).expect("QEMU's stat");
        assert_eq!((pgrp, sid), (pid, pid), "QEMU {pid}: its own process group and session");
        assert_ne!(pgrp, daemon_pgrp);
        assert_ne!(sid, daemon_sid);
        let (_, _, parent_pgrp, _) = stat(ppid).expect("QEMU's parent's stat");
        assert_eq!(parent_pgrp, daemon_pgrp, "QEMU {pid}'s parent {ppid} (the spawner) is in vmhostd's group");
    }

    // Ctrl-C: SIGINT to the whole group. The daemon shuts down cleanly; no VM notices.
    let status = daemon.signal_group(Signal::SIGINT, &host);
    assert!(status.success(), "vmhostd after SIGINT: {status}; log:\n{}", host.daemon_log());
    assert!(host.daemon_log().contains("VMs keep running"), "SIGINT was handled as a shutdown");
    for &pid in &pids {
        assert!(alive(pid), "QEMU {pid} outlives SIGINT to vmhostd's group");
    }

    // Adopted, then SIGKILL to the whole group: nothing can be handled, still no VM dies.
    let mut daemon = GroupDaemon::start(&host);
    for (name, &pid) in names.iter().zip(&pids) {
        let v = host.call("vm.get", json!({ "name": name }));
        assert_eq!(v["status"], "running", "{v}");
        assert_eq!(v["pid"], pid, "{name} adopted, not restarted");
    }
    let status = daemon.signal_group(Signal::SIGKILL, &host);
    assert_eq!(status.signal(), Some(Signal::SIGKILL as i32), "{status}");
    for &pid in &pids {
        assert!(alive(pid), "QEMU {pid} outlives SIGKILL to vmhostd's group");
    }

    // The next daemon adopts both again, same pids, nothing started twice.
    let mut daemon = GroupDaemon::start(&host);
    let want: Vec<(String, Value, Value)> =
        names.iter().zip(&pids).map(|(n, p)| (n.to_string(), json!("running"), json!(p))).collect();
    assert_eq!(listed(&host), want);
    assert_eq!(host.qemu_pids().len(), 2, "nothing started twice");
    assert!(host.daemon_log().contains("re-adopted running VM"));
    for (name, &pid) in names.iter().zip(&pids) {
        assert_eq!(host.call("vm.destroy", json!({ "name": name }))["changed"], true);
        assert!(!alive(pid), "QEMU {pid} destroyed");
    }
    assert!(host.qemu_pids().is_empty());
    let status = daemon.signal_group(Signal::SIGTERM, &host);
    assert!(status.success(), "vmhostd after SIGTERM: {status}");
}
