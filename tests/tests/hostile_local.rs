//! A local user who is not allowed to drive vmhostd attacks it (issue 14): real vmhostd
//! (sandboxed), real QEMU (TCG), real processes of real users.
//!
//! The fakes carry a VM's command-line marker, `opaque=STATE/logs/NAME.serial.log`, exactly
//! the text the daemon's QEMU carries. GNU `sleep` takes no extra argument, so the marker is the
//! fake's `argv[0]` (as `exec -a` would set it): `/proc/PID/cmdline` reads
//! `opaque=.../NAME.serial.log\01000\0`.

use serde_json::{json, Value};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use vmhost_tests::{alive, plain_log, wait, HostOptions, TestHost, GUEST_READY, QEMU_USER};

const BOOT: Duration = Duration::from_secs(90);
const QEMU: &str = "/usr/bin/qemu-system-x86_64";

/// A process a test started; SIGKILLed and reaped on drop.
struct Fake {
    child: Child,
    what: &'static str,
}

impl Fake {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// uid and gid of `user`.
fn ids(user: &str) -> (u32, u32) {
    let u = nix::unistd::User::from_name(user).expect("getpwnam").unwrap_or_else(|| panic!("no user {user}"));
    (u.uid.as_raw(), u.gid.as_raw())
}

/// The marker of VM `name` on `host` (VmPaths::cmdline_marker).
fn marker(host: &TestHost, name: &str) -> String {
    format!("opaque={}", host.state().join("logs").join(format!("{name}.serial.log")).display())
}

/// Starts `cmd` as `user` and waits until its command line shows `marker` (it has exec'd).
fn start_as(mut cmd: Command, user: &str, marker: &str, what: &'static str) -> Fake {
    let (uid, gid) = ids(user);
    cmd.uid(uid).gid(gid).current_dir("/").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    let child = cmd.spawn().unwrap_or_else(|e| panic!("start {what}: {e}"));
    let fake = Fake { child, what };
    let cmdline = || {
        String::from_utf8_lossy(&std::fs::read(format!("/proc/{}/cmdline", fake.pid())).unwrap_or_default())
            .into_owned()
    };
    wait::until_true(
        &format!("{what} to show the marker"),
        Duration::from_secs(60),
        || cmdline().contains(marker),
        cmdline,
    );
    fake
}

/// `sleep 1000` whose argv[0] is the marker, run as `user`.
fn sleeper(user: &str, marker: &str, what: &'static str) -> Fake {
    let mut cmd = Command::new("/usr/bin/sleep");
    cmd.arg0(marker).arg("1000");
    start_as(cmd, user, marker, what)
}

/// The fakes every test puts in place before the daemon looks for VM `name`'s QEMU: `sleep`
/// as an unprivileged user other than qemu.user (`nobody`), `sleep` as qemu.user itself (the
/// uid check alone would take it), and, when `with_qemu`, the real QEMU binary as qemu.user,
/// started by the test rather than the daemon's spawner, with the marker as an argument (`-L`,
/// a firmware search directory, which QEMU does not need to exist).
fn fakes(host: &TestHost, name: &str, with_qemu: bool) -> Vec<Fake> {
    let m = marker(host, name);
    let mut v = vec![sleeper("nobody", &m, "sleep as nobody"), sleeper(QEMU_USER, &m, "sleep as qemu.user")];
    if with_qemu {
        let mut cmd = Command::new(QEMU);
        cmd.args(["-accel", "tcg", "-M", "none", "-display", "none", "-nodefaults", "-S", "-L"]).arg(&m);
        v.push(start_as(cmd, QEMU_USER, &m, "qemu-system-x86_64 as qemu.user"));
    }
    for f in &v {
        assert!(alive(f.pid()), "{} exited", f.what);
    }
    v
}

/// Field 22 of /proc/PID/stat: when `pid` started, in clock ticks since boot.
fn start_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    rest.split_whitespace().nth(19).unwrap().parse().unwrap()
}

/// Waits until the clock has ticked past the start of every fake, so that any process
/// started from now on (the daemon's spawner) has a strictly later start time.
fn wait_past_start_of(fakes: &[Fake]) {
    let last = fakes.iter().map(|f| start_ticks(f.pid())).max().unwrap_or(0);
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).unwrap().unwrap() as f64;
    let ticks = || {
        let uptime = std::fs::read_to_string("/proc/uptime").unwrap();
        let secs: f64 = uptime.split_whitespace().next().unwrap().parse().unwrap();
        (secs * hz) as u64
    };
    wait::until_true(
        &format!("the clock to pass tick {last}"),
        Duration::from_secs(60),
        || ticks() > last + 1,
        || format!("tick {}", ticks()),
    );
}

/// The executable of `pid` (root reads any).
fn exe(pid: i32) -> String {
    std::fs::read_link(format!("/proc/{pid}/exe")).map(|p| p.display().to_string()).unwrap_or_default()
}

/// The uid of `pid` (`Uid:` of /proc/PID/status, real).
fn uid_of(pid: i32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .unwrap_or(u32::MAX)
}

/// Asserts that `vm` (a `vm.get`/`vm.create` view) runs a real QEMU, none of `fakes`.
fn assert_real_qemu(vm: &Value, fakes: &[Fake]) -> i32 {
    assert_eq!(vm["status"], "running", "{vm}");
    let pid = vm["pid"].as_i64().unwrap_or_else(|| panic!("no pid: {vm}")) as i32;
    for f in fakes {
        assert_ne!(pid, f.pid(), "the daemon recorded {} as the VM's QEMU", f.what);
    }
    assert_eq!(exe(pid), QEMU, "recorded pid {pid} is not QEMU");
    assert_eq!(uid_of(pid), ids(QEMU_USER).0);
    pid
}

/// How often the guest reached userspace, by its serial log.
fn wait_boots(host: &TestHost, name: &str, n: usize) {
    host.wait_serial_count(name, GUEST_READY, n, BOOT);
}

#[test]
fn a_fake_qemu_is_ignored_by_create_and_start() {
    let host = TestHost::start(HostOptions::default());
    let fakes = fakes(&host, "alpha", true);

    let created = host.call("vm.create", json!({ "spec": host.kernel_spec("alpha") }));
    let pid = assert_real_qemu(&created["vm"], &fakes);
    wait_boots(&host, "alpha", 1);
    let log = plain_log(&host.daemon_log());
    assert!(!log.contains("adopting it"), "create adopted a fake:\n{log}");
    // Each fake is reported with the rule it breaks: another user; qemu.user's own processes
    // (sleep and a real QEMU binary) were not started by the daemon's spawner.
    let nobody = ids("nobody").0;
    assert!(log.contains(&format!("runs as uid {nobody}")), "the fake of nobody was not reported:\n{log}");
    assert!(log.matches("but its parent is pid").count() >= 2, "qemu.user's fakes were not reported:\n{log}");

    host.call("vm.stop", json!({ "name": "alpha", "timeout_s": 30 }));
    assert!(!alive(pid));
    let started = host.call("vm.start", json!({ "name": "alpha" }));
    let pid2 = assert_real_qemu(&started["vm"], &fakes);
    assert_ne!(pid, pid2);
    wait_boots(&host, "alpha", 2);
    assert_real_qemu(&host.call("vm.get", json!({ "name": "alpha" })), &fakes);
    // The daemon neither adopted nor signalled them.
    for f in &fakes {
        assert!(alive(f.pid()), "{} was killed", f.what);
    }
    host.call("vm.destroy", json!({ "name": "alpha" }));
    assert!(!alive(pid2));
    for f in &fakes {
        assert!(alive(f.pid()), "{} was killed by destroy", f.what);
    }
}

#[test]
fn recovery_does_not_adopt_a_fake_and_still_adopts_the_real_qemu() {
    // No autostart: the test reads what recovery settled, before anything starts the VM again.
    let mut host =
        TestHost::start(HostOptions { extra: "[lifecycle]\nautostart = false\n".into(), ..HostOptions::default() });
    for name in ["gone", "kept"] {
        let created = host.call("vm.create", json!({ "spec": host.kernel_spec(name) }));
        assert_eq!(created["vm"]["status"], "running");
        wait_boots(&host, name, 1);
    }
    let gone = host.call("vm.get", json!({ "name": "gone" }))["pid"].as_i64().unwrap() as i32;
    let kept = host.call("vm.get", json!({ "name": "kept" }))["pid"].as_i64().unwrap() as i32;

    // The daemon dies; while it is down, the QEMU of "gone" dies too and fakes take its marker.
    host.kill_daemon();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(gone), nix::sys::signal::Signal::SIGKILL).unwrap();
    wait::until_true(&format!("QEMU {gone} to die"), Duration::from_secs(60), || !alive(gone), || "alive".into());
    let fakes = fakes(&host, "gone", false);
    // The daemon takes a process that started in the same clock tick as its spawner for one
    // started after it (judged by its parent); the fakes must be judged by their executable.
    wait_past_start_of(&fakes);
    // As under the packaged unit: no CAP_SYS_PTRACE, so QEMU's executable is read as qemu.user.
    host.without_ptrace = true;
    host.spawn_daemon();

    let v = host.call("vm.get", json!({ "name": "gone" }));
    assert_eq!(v["status"], "dead", "recovery adopted a fake: {v}");
    // Started before this daemon, qemu.user's sleep is judged by its executable.
    let log = plain_log(&host.daemon_log());
    assert!(log.contains("executes \"/usr/bin/sleep\", not qemu.binary"), "{log}");
    assert!(log.contains(&format!("runs as uid {}", ids("nobody").0)), "{log}");
    assert_eq!(v["pid"], Value::Null);
    for f in &fakes {
        assert!(alive(f.pid()), "{} was killed", f.what);
    }
    // A QEMU the previous daemon started (an orphan now, which the sandboxed daemon cannot
    // read the executable of) is still re-adopted.
    let k = host.call("vm.get", json!({ "name": "kept" }));
    assert_eq!(k["status"], "running", "{k}");
    assert_eq!(k["pid"], kept);

    // And a start after that boots a real QEMU, not a fake.
    let started = host.call("vm.start", json!({ "name": "gone" }));
    assert_real_qemu(&started["vm"], &fakes);
    wait_boots(&host, "gone", 2);
}

#[test]
fn state_subdirectories_are_private_and_tightened() {
    let mut host = TestHost::start(HostOptions::default());
    use std::os::unix::fs::PermissionsExt;
    let state = host.state();
    let mode = |d: &str| std::fs::metadata(state.join(d)).unwrap().permissions().mode() & 0o7777;
    for d in ["vms", "disks", "logs", "seeds"] {
        assert_eq!(mode(d), 0o700, "{d}");
    }
    // An older daemon left them 0755: a restart tightens them.
    host.stop_daemon();
    for d in ["vms", "logs"] {
        std::fs::set_permissions(state.join(d), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    host.spawn_daemon();
    for d in ["vms", "disks", "logs", "seeds"] {
        assert_eq!(mode(d), 0o700, "{d} after restart");
    }
    // A user other than root cannot list them.
    let out = Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "ls"])
        .arg(state.join("logs"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "nobody listed the logs");
}

#[test]
fn guest_interfaces_are_bounded_and_links_checked_before_anything_is_recorded() {
    let host = TestHost::start(HostOptions::default());
    let iface = |i: usize, link: &str| json!({ "name": format!("v{i}"), "link": link, "vlan_id": i, "address": format!("10.{i}.0.2/24") });
    let mut spec = host.kernel_spec("many");
    spec["guest_interfaces"] = Value::Array((1..=65).map(|i| iface(i, "eth0")).collect());
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.guest_interfaces")), "{e:?}");

    let mut spec = host.kernel_spec("badlink");
    spec["guest_interfaces"] = json!([iface(1, "eth0"), iface(2, "eth0"), iface(3, "eth0\u{1b}[2Jx"), iface(4, "x")]);
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.guest_interfaces[2].link")), "{e:?}");
    let mut spec = host.kernel_spec("longlink");
    spec["guest_interfaces"] = json!([iface(1, &"e".repeat(16))]);
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.guest_interfaces[0].link")), "{e:?}");

    for name in ["many", "badlink", "longlink"] {
        assert_eq!(host.call_err("vm.get", json!({ "name": name })).0, 4040, "{name} was recorded");
        assert!(!host.state().join(format!("vms/{name}.json")).exists());
    }
    assert!(host.qemu_pids().is_empty());
}
