//! The daemon's sandbox (docs/sandbox.md) against a real vmhostd: the capability sets in
//! /proc/PID/status are exactly the documented ones (daemon, spawner, QEMU), QEMU runs as the
//! unprivileged user on descriptors the daemon opened, the test-only probe
//! cannot read /etc/shadow, write outside the daemon's directories, exec or use TCP,
//! `host.check` reports each layer, `off` changes nothing, and `require` refuses to start on a
//! host without Landlock while `best-effort` starts and reports it missing. Every other
//! end-to-end test runs with `sandbox = "require"` too (the harness's default).

use serde_json::{json, Value};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;
use vmhost_tests::{bin, HostOptions, TestHost};

const CAP_DAC_READ_SEARCH: u64 = 1 << 2;
const CAP_KILL: u64 = 1 << 5;
const CAP_SETGID: u64 = 1 << 6;
const CAP_SETUID: u64 = 1 << 7;
const CAP_NET_ADMIN: u64 = 1 << 12;
const CAP_SYS_RESOURCE: u64 = 1 << 24;

fn status_field(pid: i32, name: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string()).unwrap_or_default()
}

fn caps(pid: i32, set: &str) -> u64 {
    u64::from_str_radix(&status_field(pid, &format!("Cap{set}:")), 16).unwrap_or(u64::MAX)
}

/// What this test process may hand down (a container may lack some capabilities).
fn our_permitted() -> u64 {
    caps(std::process::id() as i32, "Prm")
}

/// The spawner: the daemon's child named vmhostd.
fn spawner_of(daemon: i32) -> i32 {
    vmhost_tests::children_of(daemon)
        .into_iter()
        .find(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "vmhostd"))
        .unwrap_or_else(|| panic!("no spawner child of {daemon}"))
}

fn check_items(host: &TestHost) -> Vec<Value> {
    host.call("host.check", json!({}))["items"].as_array().cloned().unwrap_or_default()
}

fn item<'a>(items: &'a [Value], name: &str) -> &'a Value {
    items.iter().find(|i| i["name"] == name).unwrap_or_else(|| panic!("no item {name}: {items:?}"))
}

#[test]
fn capability_sets_are_exactly_the_documented_ones() {
    let host = TestHost::start(HostOptions::default());
    let daemon = host.daemon_pid().unwrap() as i32;
    let want = CAP_NET_ADMIN | CAP_KILL;
    for set in ["Eff", "Prm", "Bnd"] {
        assert_eq!(caps(daemon, set), want, "daemon Cap{set}");
    }
    assert_eq!(caps(daemon, "Inh"), 0);
    assert_eq!(caps(daemon, "Amb"), 0);
    assert_eq!(status_field(daemon, "NoNewPrivs:"), "1");
    assert_eq!(status_field(daemon, "Seccomp:"), "2", "filter mode");

    // The spawner: CAP_SETUID, CAP_SETGID, CAP_SYS_RESOURCE (those the daemon was started with),
    // and CAP_DAC_READ_SEARCH permitted but not effective (raised only to open a boot file); no
    // seccomp filter, no_new_privs.
    let spawner = spawner_of(daemon);
    let want = (CAP_SETUID | CAP_SETGID | CAP_SYS_RESOURCE) & our_permitted();
    assert_eq!(caps(spawner, "Eff"), want, "spawner CapEff");
    for set in ["Prm", "Bnd"] {
        assert_eq!(caps(spawner, set), want | (CAP_DAC_READ_SEARCH & our_permitted()), "spawner Cap{set}");
    }
    assert_eq!(caps(spawner, "Inh") | caps(spawner, "Amb"), 0);
    assert_eq!(status_field(spawner, "NoNewPrivs:"), "1");
    assert_eq!(status_field(spawner, "Seccomp:"), "0");

    // QEMU: see qemu_runs_unprivileged_on_descriptors.
    host.call("vm.create", json!({ "spec": host.kernel_spec("caps") }));
    let qemu = *host.qemu_pids().first().expect("a QEMU");
    assert_qemu_unprivileged(qemu);
    assert_eq!(parent_of(qemu), spawner, "QEMU is the spawner's child");
    assert!(host.wait_serial("caps", vmhost_tests::GUEST_READY, Duration::from_secs(60)), "guest did not boot");
    host.call("vm.destroy", json!({"name": "caps"}));
}

fn parent_of(pid: i32) -> i32 {
    status_field(pid, "PPid:").parse().unwrap_or(0)
}

/// The uid and gid of the test QEMU user.
fn qemu_user_ids() -> (String, String) {
    let out = Command::new("getent").args(["passwd", vmhost_tests::QEMU_USER]).output().unwrap();
    let line = String::from_utf8_lossy(&out.stdout).to_string();
    let fields: Vec<&str> = line.trim().split(':').collect();
    assert!(fields.len() > 3, "no user {} (tests/setup.sh creates it)", vmhost_tests::QEMU_USER);
    (fields[2].to_string(), fields[3].to_string())
}

/// QEMU runs as the configured user (real, effective, saved and filesystem ids), with no
/// supplementary groups, no capabilities, no_new_privs and its own seccomp filter.
fn assert_qemu_unprivileged(qemu: i32) {
    let (uid, gid) = qemu_user_ids();
    assert_ne!(uid, "0");
    let ids = |field: &str| status_field(qemu, field).split_whitespace().map(str::to_string).collect::<Vec<_>>();
    assert_eq!(ids("Uid:"), vec![uid; 4], "QEMU uids");
    assert_eq!(ids("Gid:"), vec![gid; 4], "QEMU gids");
    assert_eq!(status_field(qemu, "Groups:"), "", "QEMU supplementary groups");
    for set in ["Eff", "Prm", "Inh", "Amb"] {
        assert_eq!(caps(qemu, set), 0, "QEMU Cap{set}");
    }
    assert_eq!(status_field(qemu, "NoNewPrivs:"), "1");
    assert_eq!(status_field(qemu, "Seccomp:"), "2", "QEMU's -sandbox filter");
}

/// QEMU as the unprivileged user with an image-booted VM: every VM file it uses (sockets,
/// serial log, overlay, base image, seed) is a descriptor the daemon opened; the files and the
/// run dir stay root's and private, so QEMU could not open them by path.
#[test]
fn qemu_runs_unprivileged_on_descriptors() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let host = TestHost::start(HostOptions::default());
    let base = host.images().join("base.qcow2");
    let made = Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(&base).arg("64M").status().unwrap();
    assert!(made.success());
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o600)).unwrap();
    let spec = json!({"name": "img", "cpu": 1, "memory_mib": 128, "boot": {"image": "base.qcow2", "disk_gib": 1}});
    let vm = host.call("vm.create", json!({ "spec": spec }));
    assert_eq!(vm["vm"]["status"], "running", "{vm}");
    let qemu = *host.qemu_pids().first().expect("a QEMU");
    assert_qemu_unprivileged(qemu);

    let state = host.dir.path().join("state");
    let run_dir = host.dir.path().join("run/img");
    let expected = [
        run_dir.join("qmp"),
        run_dir.join("agent"),
        state.join("logs/img.serial.log"),
        state.join("disks/img.qcow2"),
        base.clone(),
        state.join("seeds/img.img"),
    ];
    let mut open: Vec<std::path::PathBuf> = Vec::new();
    let mut sockets = 0;
    for e in std::fs::read_dir(format!("/proc/{qemu}/fd")).unwrap().flatten() {
        let target = std::fs::read_link(e.path()).unwrap_or_default();
        if target.to_string_lossy().starts_with("socket:") {
            sockets += 1;
        }
        open.push(target);
    }
    for file in &expected[2..] {
        assert!(open.contains(file), "QEMU does not hold {}: {open:?}", file.display());
        let meta = std::fs::metadata(file).unwrap();
        assert_eq!(meta.uid(), 0, "{} stays root's", file.display());
        assert_eq!(meta.mode() & 0o077, 0, "{} is private: {:o}", file.display(), meta.mode());
    }
    assert!(sockets >= 2, "the QMP and agent listening sockets: {open:?}");
    let run = std::fs::metadata(&run_dir).unwrap();
    assert_eq!((run.uid(), run.mode() & 0o777), (0, 0o700), "the run dir is the daemon's alone");
    // QEMU's stderr is its log.
    let stderr = std::fs::read_link(format!("/proc/{qemu}/fd/2")).unwrap();
    assert_eq!(stderr, state.join("logs/img.qemu.log"));
    // And the VM works through them: QMP answered (status running above), stop and destroy.
    host.call("vm.stop", json!({"name": "img", "timeout_s": 1}));
    host.call("vm.destroy", json!({"name": "img"}));
    assert!(!state.join("logs/img.qemu.log").exists(), "destroy removes QEMU's log");
}

#[test]
fn the_probe_cannot_escape() {
    if !cfg!(debug_assertions) {
        eprintln!("skipped: the probe exists only in debug builds");
        return;
    }
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("escaped");
    let host = TestHost::start(HostOptions {
        env: vec![("VMHOST_TEST_SANDBOX_PROBE".into(), target.display().to_string())],
        ..HostOptions::default()
    });
    let log = host.daemon_log();
    let line = |what: &str| {
        log.lines()
            .find(|l| l.starts_with(&format!("sandbox-probe: {what}")))
            .unwrap_or_else(|| panic!("no probe line for {what}:\n{log}"))
            .to_string()
    };
    // Landlock refuses files with EACCES; seccomp refuses syscalls with EPERM.
    assert!(line("read /etc/shadow").ends_with("errno 13"), "{log}");
    assert!(line("create").ends_with("errno 13"), "{log}");
    assert!(line("exec /bin/true").ends_with("errno 1"), "{log}");
    assert!(line("tcp bind").ends_with("errno 13"), "{log}");
    assert!(line("unshare").ends_with("errno 1"), "{log}");
    assert!(line("unshare user").ends_with("errno 1"), "{log}");
    assert!(line("chmod /dev/null").ends_with("errno 1"), "{log}");
    assert!(line("fork").ends_with("errno 1"), "{log}");
    assert!(line("clone3").ends_with("errno 38"), "clone3 says ENOSYS: {log}");
    assert!(!target.exists(), "the probe wrote outside the daemon's directories");
    // The daemon still works.
    assert!(host.call("host.info", json!({}))["version"].is_string());
}

#[test]
fn host_check_reports_each_layer() {
    let host = TestHost::start(HostOptions::default());
    let items = check_items(&host);
    let names: Vec<&str> = items.iter().filter_map(|i| i["name"].as_str()).collect();
    let n = names.len();
    assert_eq!(&names[n - 5..], ["sandbox", "capabilities", "landlock", "seccomp", "qemu_user"], "last five, in order");
    let qemu = item(&items, "qemu_user");
    assert_eq!(qemu["status"], "ok", "{qemu}");
    assert!(qemu["detail"].as_str().unwrap().contains(vmhost_tests::QEMU_USER), "{qemu}");
    for name in ["sandbox", "capabilities", "landlock", "seccomp"] {
        assert_eq!(item(&items, name)["status"], "ok", "{name}: {}", item(&items, name));
    }
    let detail = |n: &str| item(&items, n)["detail"].as_str().unwrap_or_default().to_string();
    assert!(detail("sandbox").contains("mode require; no_new_privs set"), "{}", detail("sandbox"));
    assert!(detail("capabilities").starts_with("daemon: effective=cap_kill,cap_net_admin permitted=cap_kill,cap_net_admin bounding=cap_kill,cap_net_admin inheritable=none ambient=none; spawner: effective=cap_setgid,cap_setuid"), "{}", detail("capabilities"));
    assert!(
        detail("landlock").starts_with("daemon: fully enforced with ABI 5 rights (kernel ABI "),
        "{}",
        detail("landlock")
    );
    assert!(detail("landlock").contains("spawner: fully enforced"), "{}", detail("landlock"));
    assert!(detail("seccomp").starts_with("enforce: "), "{}", detail("seccomp"));
}

#[test]
fn off_changes_nothing() {
    let host = TestHost::start(HostOptions { sandbox: "off".into(), ..HostOptions::default() });
    let daemon = host.daemon_pid().unwrap() as i32;
    assert_eq!(caps(daemon, "Eff"), caps(std::process::id() as i32, "Eff"));
    assert_eq!(status_field(daemon, "Seccomp:"), "0");
    let items = check_items(&host);
    for name in ["sandbox", "capabilities", "landlock", "seccomp"] {
        assert_eq!(item(&items, name)["status"], "ok");
        assert!(item(&items, name)["detail"].as_str().unwrap().contains("\"off\""));
    }
    // Programs run in-process then: QEMU starts all the same, still as the unprivileged user.
    host.call("vm.create", json!({ "spec": host.kernel_spec("off") }));
    let qemu = *host.qemu_pids().first().expect("a QEMU");
    assert_qemu_unprivileged(qemu);
    assert_eq!(parent_of(qemu), daemon, "without a spawner QEMU is the daemon's child");
    assert!(host.wait_serial("off", vmhost_tests::GUEST_READY, Duration::from_secs(60)), "guest did not boot");
}

/// Runs vmhostd on `host`'s config as if the kernel had no Landlock: a seccomp filter installed
/// before exec makes landlock_create_ruleset fail with ENOSYS.
fn without_landlock(host: &TestHost) -> Command {
    use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};
    let rules = [(libc::SYS_landlock_create_ruleset, vec![])].into_iter().collect();
    let filter =
        SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), TargetArch::x86_64)
            .unwrap();
    let program: BpfProgram = filter.try_into().unwrap();
    let mut cmd = Command::new(bin("vmhostd"));
    cmd.arg("--config").arg(&host.config);
    // SAFETY: prctl and seccomp only; the program was built before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            seccompiler::apply_filter(&program).map_err(std::io::Error::other)
        });
    }
    cmd
}

#[test]
fn require_refuses_a_kernel_without_landlock_and_best_effort_reports_it() {
    let mut host = TestHost::prepare(HostOptions::default());
    let out = without_landlock(&host).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("vmhostd: refusing to start: sandbox = \"require\" but landlock is not in force"),
        "{stderr}"
    );
    assert!(!host.socket.exists(), "nothing served");

    // best-effort: starts, and host.check says Landlock is missing.
    let text =
        std::fs::read_to_string(&host.config).unwrap().replace("sandbox = \"require\"", "sandbox = \"best-effort\"");
    std::fs::write(&host.config, text).unwrap();
    let mut child = without_landlock(&host).stderr(std::process::Stdio::null()).spawn().unwrap();
    vmhost_tests::wait::daemon_answers(&host.socket, &mut child, || host.daemon_log());
    let items = check_items(&host);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(item(&items, "landlock")["status"], "missing", "{items:?}");
    assert!(item(&items, "landlock")["detail"].as_str().unwrap().contains("no Landlock"), "{items:?}");
    assert_eq!(item(&items, "seccomp")["status"], "ok");
    assert_eq!(item(&items, "capabilities")["status"], "ok");
    host.env.clear();
}

/// QEMU cannot open an IP socket (docs/sandbox.md, "No IP socket for QEMU"): the spawner starts
/// it under a seccomp filter that refuses every socket family but AF_UNIX, so QMP `chardev-add`
/// of a UDP backend (which needs no listener and no TCP rule: it worked before the filter) and of
/// a TCP client socket fail with EAFNOSUPPORT, on any kernel. A Unix socket backend still
/// connects, so the filter refuses IP, not sockets; and the VM still boots.
#[test]
fn qemu_cannot_open_an_ip_socket() {
    use std::os::unix::fs::PermissionsExt;
    let host = TestHost::start(HostOptions::default());
    // A TCP listener of our own, so a connect would succeed if QEMU could make the socket (port 9
    // would be refused by nobody listening, and prove nothing).
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = tcp.local_addr().unwrap().port().to_string();
    // A Unix listener QEMU's user may connect to.
    let dir = tempfile::Builder::new().prefix("vmh-peer").tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let peer = dir.path().join("peer.sock");
    let unix = std::os::unix::net::UnixListener::bind(&peer).unwrap();
    std::fs::set_permissions(&peer, std::fs::Permissions::from_mode(0o777)).unwrap();
    unix.set_nonblocking(true).unwrap();

    host.call("vm.create", json!({ "spec": host.kernel_spec("noip") }));
    let qemu = *host.qemu_pids().first().expect("a QEMU");
    let add = |id: &str, backend: Value| json!({"execute": "chardev-add", "arguments": {"id": id, "backend": backend}});
    let inet = |host: &str, port: &str| json!({"type": "inet", "data": {"host": host, "port": port}});
    let answers = vmhost_tests::qmp_commands(
        &host.run().join("noip").join("qmp"),
        &[
            add("udp", json!({"type": "udp", "data": {"remote": inet("127.0.0.1", "9")}})),
            add("udp6", json!({"type": "udp", "data": {"remote": inet("::1", "9")}})),
            add("tcp", json!({"type": "socket", "data": {"addr": inet("127.0.0.1", &port), "server": false}})),
            add(
                "unix",
                json!({"type": "socket", "data": {"addr": {"type": "unix", "data": {"path": peer}}, "server": false}}),
            ),
        ],
    );
    for (answer, what) in answers.iter().zip(["udp", "udp6", "tcp"]) {
        let desc = answer["error"]["desc"].as_str().unwrap_or_default();
        // EAFNOSUPPORT is the filter's answer (Landlock's would be EACCES, and only for TCP).
        assert!(desc.contains("Address family not supported"), "{what}: {answer}");
    }
    assert_eq!(answers[3], json!({"return": {}}), "a Unix socket backend still works");
    vmhost_tests::wait::until("QEMU to connect to the Unix listener", Duration::from_secs(60), || {
        unix.accept().map_err(|e| e.to_string())
    });
    tcp.set_nonblocking(true).unwrap();
    assert!(tcp.accept().is_err(), "QEMU connected over TCP");
    assert_eq!(host.qemu_pids(), vec![qemu], "the same QEMU runs on");
    assert!(host.wait_serial("noip", vmhost_tests::GUEST_READY, Duration::from_secs(120)), "{}", host.serial("noip"));
}
