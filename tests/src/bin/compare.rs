//! vmhost-compare: vmhost against libvirt 9 (Debian 12's `libvirt-daemon-system`) on this machine,
//! both measured in one run on the same kernel, initramfs and TCG settings, printed as a markdown
//! table; `--update-docs` also replaces its section of docs/performance.md.
//!
//! 1. Create → running → guest ready → agent serving, alternately vmhost, libvirt, vmhost, ... for
//!    `--rounds` rounds after one warm-up start each (libvirt probes QEMU's capabilities at its
//!    first start). vmhost: `vmhostctl create SPEC.json`; libvirt: `virsh create DOMAIN.xml`
//!    (transient). Both boot the agent test guest (`target/guest/initramfs-agent.cpio.gz`, the
//!    static vmhost-agent inside) with 1 vCPU, 256 MiB, q35, TCG, serial console to a file and a
//!    virtio-serial port named `org.vmhost.agent.0`; readiness is seen on that console
//!    (`VMHOST-GUEST-READY`, then `vmhost-agent: serving on`), plus for vmhost when `vm.get`
//!    reports `agent.connected`.
//! 2. List/get with `--vms` records: vmhost VMs created `stopped`, libvirt domains defined (not
//!    started). CLI (one process per call: `vmhostctl list|get`, `virsh list --all|dominfo`) and
//!    in one connection (vmhost: `vm.list`/`vm.get` over the socket; libvirt: the same virsh
//!    commands fed to one `virsh` session, which keeps its connection).
//! 3. Memory: vmhostd against libvirtd + virtlogd (Debian 12's libvirt is the monolithic
//!    libvirtd; its QEMU driver lives inside it); the guest agent's size and RSS against
//!    qemu-guest-agent's (Debian 12's package). Both agents run in one guest
//!    (`target/guest/initramfs-compare.cpio.gz`, tests/guest/build-compare-guest.sh: the same kernel
//!    and busybox, qemu-ga with its shared libraries and the loader), each answers one request
//!    over its own virtio-serial port, and the guest prints both resident set sizes on its console
//!    (tests/compare/agents-init.sh).
//!
//! libvirt runs privately (tests/compare/libvirt-private.sh: own mount and network namespaces,
//! tmpfs over its state dirs) so nothing on the host is defined or changed beyond the packages
//! installed if missing. Takes several minutes; not part of the tests.
//!
//! Interrupting (SIGINT, e.g. Ctrl-C, or SIGTERM) stops the run at the next step: everything it
//! started is stopped (vmhostd and its QEMUs, libvirtd, virtlogd and their QEMUs, the agent
//! guest, a command in flight), libvirt's domains go with its private state dir, the temp dirs are
//! removed, and it exits with 128 + the signal (130 for SIGINT) after one line on stderr.
//! tests/tests/compare_interrupt.rs proves it. Each temp dir is named on stderr when made.
//!
//! Usage: `vmhost-compare [--rounds N] [--vms N] [--cli-calls N] [--api-calls N] [--update-docs]`,
//! or `vmhost-compare --vmhost-boot-only [--rounds N]`: only vmhost's half of part 1, without
//! libvirt (a quick look at vmhost's boot latency; what the interrupt test drives).

use serde_json::{json, Value};
use std::fmt::Write as _;
use std::fs;
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, ExitCode, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use vmhost::client::Client;
use vmhost_tests::{bin, build_guest_image, qemu_pids_under, rss_kib, workspace, HostOptions, TestHost, GUEST_READY};

const AGENT_SERVING: &str = "vmhost-agent: serving on";
const CMDLINE: &str = "console=ttyS0 panic=-1 quiet";
const MEMORY_MIB: u64 = 256;
const BEGIN: &str = "<!-- compare:begin -->";
const END: &str = "<!-- compare:end -->";
/// Console line of the agent guest (tests/compare/agents-init.sh).
const AGENTS_RSS: &str = "VMHOST-AGENTS-RSS";

/// The signal (SIGINT or SIGTERM) that asked the run to stop; 0 while none has.
static SIGNAL: AtomicUsize = AtomicUsize::new(0);

/// The unwind payload of [`check`]: main turns it into the exit status.
struct Interrupted;

fn interrupted() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig as i32),
    }
}

/// Unwinds to main once a signal has arrived. Unwinding rather than exiting is what stops
/// everything: each owner of something started (TestHost, Libvirt, Guarded, TempDir) cleans up
/// as it drops, exactly as on a normal end or a failed assertion. resume_unwind skips the panic
/// hook, so the interrupt prints no backtrace.
fn check() {
    if interrupted().is_some() {
        std::panic::resume_unwind(Box::new(Interrupted));
    }
}

/// Sleeps `d`, then [`check`]s: every polling loop here goes through this, so an interrupt is
/// seen within one poll interval.
fn pause(d: Duration) {
    std::thread::sleep(d);
    check();
}

/// A child process that is killed (and reaped) when dropped, so that an interrupt or a failed
/// step ends it like the rest.
struct Guarded(Child);

impl Drop for Guarded {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Names a temp dir on stderr, so an operator (and the interrupt test) knows what to look for.
fn announce(dir: &Path) {
    eprintln!("vmhost-compare: temp dir {}", dir.display());
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse().ok()).unwrap_or(default)
}

fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / 1048576.0)
}

/// Wraps prose lines at `width` columns like the rest of the docs; tables, lists, headings and
/// markers stay as they are.
fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.len() <= width || line.starts_with(['|', '#', '-', '<']) {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let mut cur = String::new();
        for word in line.split(' ') {
            if !cur.is_empty() && cur.len() + 1 + word.len() > width {
                out.push_str(&cur);
                out.push('\n');
                cur.clear();
            }
            if !cur.is_empty() {
                cur.push(' ');
            }
            cur.push_str(word);
        }
        out.push_str(&cur);
        out.push('\n');
    }
    out
}

/// Waits for a spawned child like `wait_with_output`, which runs on a thread so that an interrupt
/// is noticed at once (SIGTERM to the child, SIGKILL after 5 s) while a normal exit is seen without
/// polling delay: the timed commands (`vmhostctl create`, `virsh create`) both wait here.
fn wait_output(child: Child) -> Output {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(out) => return out.expect("wait for child"),
            Err(mpsc::RecvTimeoutError::Timeout) if interrupted().is_some() => {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
                if rx.recv_timeout(Duration::from_secs(5)).is_err() {
                    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                    let _ = rx.recv();
                }
                check();
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("waiter thread died"),
        }
    }
}

/// Runs a command to its end (interruptibly, see [`wait_output`]), returning its output.
fn output(cmd: &mut Command) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    wait_output(child)
}

fn run(cmd: &mut Command) -> String {
    let out = output(cmd);
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Installs libvirt's daemon and client if missing (no recommends: no dnsmasq, no lvm2).
/// Debian's policy-rc.d on these machines keeps the packages from starting their services.
fn ensure_libvirt() {
    if Path::new("/usr/sbin/libvirtd").exists() && Path::new("/usr/bin/virsh").exists() {
        return;
    }
    eprintln!("installing libvirt-daemon-system and libvirt-clients ...");
    run(Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends", "libvirt-daemon-system", "libvirt-clients"])
        .env("DEBIAN_FRONTEND", "noninteractive"));
}

/// The libvirt package versions, e.g. "libvirt-daemon 9.0.0-4+deb12u2".
fn pkg_version(pkg: &str) -> String {
    let out = Command::new("dpkg-query").args(["-W", "-f", "${Version}", pkg]).output();
    out.ok().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
}

/// A private libvirtd (and virtlogd) in its own namespaces; see tests/compare/libvirt-private.sh.
struct Libvirt {
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// Cgroup dirs libvirt makes for its domains (`machine` under each controller) that did not
    /// exist before: removed (when empty) at the end.
    new_cgroups: Vec<std::path::PathBuf>,
}

fn machine_cgroups() -> Vec<std::path::PathBuf> {
    let Ok(entries) = fs::read_dir("/sys/fs/cgroup") else { return Vec::new() };
    entries.flatten().map(|e| e.path().join("machine")).filter(|p| p.is_dir()).collect()
}

/// Removes a cgroup dir and its child cgroups, deepest first (rmdir works on an empty cgroup).
fn rmdir_cgroup(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                rmdir_cgroup(&e.path());
            }
        }
    }
    let _ = fs::remove_dir(dir);
}

impl Libvirt {
    fn start() -> Libvirt {
        let dir = tempfile::Builder::new().prefix("vmhcmp").tempdir_in("/tmp").expect("tempdir");
        announce(dir.path());
        let log = fs::File::create(dir.path().join("libvirtd.log")).expect("libvirtd log");
        let err = log.try_clone().expect("dup log");
        let child = Command::new(workspace().join("tests/compare/libvirt-private.sh"))
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            // Out of the terminal's process group: Ctrl-C reaches only vmhost-compare, whose
            // cleanup still needs libvirtd to destroy the domains.
            .process_group(0)
            .spawn()
            .expect("spawn tests/compare/libvirt-private.sh");
        let before = machine_cgroups();
        let mut lv = Libvirt { dir, child: Some(child), new_cgroups: Vec::new() };
        lv.new_cgroups =
            ["cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd", "unified"]
                .iter()
                .map(|c| Path::new("/sys/fs/cgroup").join(c).join("machine"))
                .filter(|p| !before.contains(p))
                .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if lv.dir.path().join("libvirt-sock").exists() && lv.virsh_ok(&["version"]) {
                return lv;
            }
            if let Some(Ok(Some(st))) = lv.child.as_mut().map(Child::try_wait) {
                panic!("libvirtd exited with {st}: {}", lv.log());
            }
            assert!(Instant::now() < deadline, "libvirtd did not come up: {}", lv.log());
            pause(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("libvirtd.log")).unwrap_or_default()
    }

    fn uri(&self) -> String {
        format!("qemu:///system?socket={}", self.dir.path().join("libvirt-sock").display())
    }

    fn virsh(&self) -> Command {
        let mut c = Command::new("virsh");
        c.arg("-q").arg("-c").arg(self.uri());
        c
    }

    fn virsh_ok(&self, args: &[&str]) -> bool {
        self.virsh().args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    }

    fn pid(&self, name: &str) -> Option<u32> {
        fs::read_to_string(self.dir.path().join(format!("{name}.pid"))).ok()?.trim().parse().ok()
    }

    /// RSS of libvirtd and of virtlogd.
    fn rss(&self) -> (u64, u64) {
        (self.pid("libvirtd").map_or(0, rss_kib), self.pid("virtlogd").map_or(0, rss_kib))
    }

    /// Runs commands in one virsh session (one connection kept). Returns the wall time and each
    /// command's own time as virsh measures it (`-t`).
    fn session(&self, commands: &str) -> (Duration, Vec<Duration>) {
        let mut child = self
            .virsh()
            .arg("-t")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn virsh");
        let t = Instant::now();
        let mut stdin = child.stdin.take().expect("virsh stdin");
        let text = commands.to_string();
        let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
        let out = wait_output(child);
        let elapsed = t.elapsed();
        writer.join().expect("writer thread").expect("write to virsh");
        assert!(out.status.success(), "virsh session failed: {}", String::from_utf8_lossy(&out.stderr));
        let times = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().strip_prefix("(Time: ")?.strip_suffix(" ms)")?.parse::<f64>().ok())
            .map(|v| Duration::from_secs_f64(v / 1e3))
            .collect();
        (elapsed, times)
    }

    fn domain_xml(&self, name: &str, kernel: &Path, initrd: &Path, serial: &Path) -> String {
        format!(
            r#"<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>{MEMORY_MIB}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{kernel}</kernel>
    <initrd>{initrd}</initrd>
    <cmdline>{CMDLINE}</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <serial type='file'><source path='{serial}'/><target port='0'/></serial>
    <channel type='unix'>
      <source mode='bind' path='{agent}'/>
      <target type='virtio' name='org.vmhost.agent.0'/>
    </channel>
    <memballoon model='none'/>
  </devices>
</domain>
"#,
            kernel = kernel.display(),
            initrd = initrd.display(),
            serial = serial.display(),
            agent = self.dir.path().join(format!("{name}.agent.sock")).display(),
        )
    }
}

impl Drop for Libvirt {
    fn drop(&mut self) {
        // Running domains first (libvirt then removes their cgroups), then anything left.
        if let Ok(out) = self.virsh().args(["list", "--name"]).output() {
            for name in String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.trim().is_empty()) {
                let _ = self.virsh().args(["destroy", name.trim()]).stdout(Stdio::null()).status();
            }
        }
        for pid in qemu_pids_under(self.dir.path()) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
        let virtlogd = self.pid("virtlogd");
        if let Some(mut c) = self.child.take() {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(pid) = virtlogd {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while vmhost_tests::alive(pid.as_raw()) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            if vmhost_tests::alive(pid.as_raw()) {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
        for dir in &self.new_cgroups {
            rmdir_cgroup(dir);
        }
    }
}

/// One boot: command returned (VM running), console ready line, console agent line, and (vmhost
/// only) `agent.connected`.
#[derive(Default, Clone)]
struct Boot {
    running: Duration,
    ready: Duration,
    serving: Duration,
    connected: Option<Duration>,
}

/// Picks one figure of a boot.
type Pick = fn(&Boot) -> Option<Duration>;

/// Polls the serial log (and `vm.get` when `host` is given) until the agent is seen serving
/// (and connected).
fn wait_boot(t0: Instant, running: Duration, serial: &Path, host: Option<(&TestHost, &str)>) -> Boot {
    let mut b = Boot { running, ..Boot::default() };
    let (mut ready, mut serving) = (None, None);
    let deadline = t0 + Duration::from_secs(180);
    loop {
        let log = fs::read_to_string(serial).unwrap_or_default();
        if ready.is_none() && log.contains(GUEST_READY) {
            ready = Some(t0.elapsed());
        }
        if serving.is_none() && log.contains(AGENT_SERVING) {
            serving = Some(t0.elapsed());
        }
        if let Some((h, name)) = host {
            if b.connected.is_none() && h.call("vm.get", json!({ "name": name }))["agent"]["connected"] == true {
                b.connected = Some(t0.elapsed());
            }
        }
        if let (Some(r), Some(s)) = (ready, serving) {
            if host.is_none() || b.connected.is_some() {
                b.ready = r;
                b.serving = s;
                return b;
            }
        }
        assert!(Instant::now() < deadline, "guest did not boot within 180 s; console:\n{log}");
        pause(Duration::from_millis(20));
    }
}

fn boot_vmhost(host: &TestHost, name: &str, spec_dir: &Path) -> (Boot, Option<u64>) {
    let g = vmhost_tests::agent_guest();
    let spec = json!({"name": name, "cpu": 1, "memory_mib": MEMORY_MIB,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": CMDLINE}});
    let file = spec_dir.join(format!("{name}.json"));
    fs::write(&file, spec.to_string()).expect("write spec");
    let mut ctl = Command::new(bin("vmhostctl"));
    ctl.arg("--socket").arg(&host.socket).arg("create").arg(&file);
    let t0 = Instant::now();
    let out = output(&mut ctl);
    let running = t0.elapsed();
    assert!(out.status.success(), "vmhostctl create: {}", String::from_utf8_lossy(&out.stderr));
    let serial = host.state().join("logs").join(format!("{name}.serial.log"));
    let b = wait_boot(t0, running, &serial, Some((host, name)));
    let rss = host.call("vm.guest_info", json!({ "name": name }))["rss_kib"].as_u64();
    host.call("vm.destroy", json!({ "name": name }));
    (b, rss)
}

fn boot_libvirt(lv: &Libvirt, name: &str) -> Boot {
    let g = vmhost_tests::agent_guest();
    let serial = lv.dir.path().join(format!("{name}.serial.log"));
    let xml = lv.dir.path().join(format!("{name}.xml"));
    fs::write(&xml, lv.domain_xml(name, &g.kernel, &g.initrd, &serial)).expect("write domain xml");
    let t0 = Instant::now();
    run(lv.virsh().arg("create").arg(&xml));
    let running = t0.elapsed();
    let b = wait_boot(t0, running, &serial, None);
    run(lv.virsh().args(["destroy", name]));
    b
}

/// Median wall time of `n` runs of a command (process spawn included).
fn cli_median(n: usize, mut make: impl FnMut(usize) -> Command) -> Duration {
    let times = (0..n)
        .map(|i| {
            check();
            let mut c = make(i);
            c.stdout(Stdio::null()).stderr(Stdio::null());
            let t = Instant::now();
            let st = c.status().expect("spawn CLI");
            let d = t.elapsed();
            assert!(st.success(), "{c:?} failed");
            d
        })
        .collect();
    median(times)
}

/// qemu-guest-agent as packaged (binary size, shared libraries) and both agents' memory as
/// measured in one guest.
struct Agents {
    qga_version: String,
    qga_size: u64,
    qga_libs: Vec<(String, u64)>,
    /// KiB: (`Rss` of smaps_rollup, `VmRSS` of status) in the guest, after one request each.
    vmhost_agent: (u64, u64),
    qemu_ga: (u64, u64),
}

/// One JSON request line to an agent's port (a QEMU chardev socket); returns the reply line.
/// QEMU holds what is written until the guest opens the port, so this may be sent while the
/// guest still boots.
fn ask(sock: &Path, request: &str, console: &Path) -> (std::os::unix::net::UnixStream, String) {
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut s = loop {
        if let Ok(s) = std::os::unix::net::UnixStream::connect(sock) {
            break s;
        }
        assert!(Instant::now() < deadline, "cannot connect to {}", sock.display());
        pause(Duration::from_millis(20));
    };
    s.write_all(request.as_bytes()).and_then(|_| s.write_all(b"\n")).expect("write agent request");
    s.set_read_timeout(Some(Duration::from_millis(200))).expect("read timeout");
    let mut reply = Vec::new();
    let mut buf = [0u8; 65536];
    while !reply.contains(&b'\n') {
        match std::io::Read::read(&mut s, &mut buf) {
            Ok(0) => panic!("{} closed without a reply", sock.display()),
            Ok(n) => reply.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => panic!("read {}: {e}", sock.display()),
        }
        let console = || fs::read_to_string(console).unwrap_or_default();
        assert!(Instant::now() < deadline, "no reply on {} within 180 s; console:\n{}", sock.display(), console());
        check();
    }
    (s, String::from_utf8_lossy(&reply).into_owned())
}

/// `VMHOST-AGENTS-RSS vmhost-agent.rss=N ...`: the value of `key`, in KiB.
fn agents_figure(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

fn agents(work: &Path) -> Agents {
    let out = build_guest_image("build-compare-guest.sh");
    let deb = out.join("qga/qemu-guest-agent.deb");
    let ga = out.join("qga/root/usr/sbin/qemu-ga");
    let qga_version = run(Command::new("dpkg-deb").args(["-f"]).arg(&deb).arg("Version")).trim().to_string();
    let qga_size = fs::metadata(&ga).map(|m| m.len()).expect("qemu-ga in the package");
    // The libraries the build script copied into the guest: this Debian 12 host's.
    let ldd = run(Command::new("ldd").arg(&ga));
    let qga_libs = ldd
        .lines()
        .filter_map(|l| {
            let path = l.split("=>").nth(1)?.split_whitespace().next()?;
            let real = fs::canonicalize(path).ok()?;
            let name = l.split_whitespace().next()?.to_string();
            Some((name, fs::metadata(real).ok()?.len()))
        })
        .collect();

    let dir = work.join("agents");
    fs::create_dir_all(&dir).expect("mkdir agents");
    let (console, vh, qga) = (dir.join("serial.log"), dir.join("vmhost-agent.sock"), dir.join("qga.sock"));
    let chardev = |id: &str, path: &Path| format!("socket,id={id},path={},server=on,wait=off", path.display());
    // The same machine as the boot rounds (vmhostd's argv for a direct-kernel VM), plus the second
    // port qemu-ga looks for.
    let qemu = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg", "-machine", "q35", "-smp", "1", "-m", &MEMORY_MIB.to_string()])
        .args(["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .arg("-kernel")
        .arg(out.join("vmlinuz"))
        .arg("-initrd")
        .arg(out.join("initramfs-compare.cpio.gz"))
        .args(["-append", &format!("{CMDLINE} rdinit=/compare-init")])
        .args(["-device", "virtio-serial-pci,id=vser0"])
        .args(["-chardev", &chardev("vh", &vh)])
        .args(["-device", "virtserialport,bus=vser0.0,chardev=vh,name=org.vmhost.agent.0"])
        .args(["-chardev", &chardev("qga", &qga)])
        .args(["-device", "virtserialport,bus=vser0.0,chardev=qga,name=org.qemu.guest_agent.0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(dir.join("qemu.log")).expect("qemu log"))
        // Out of the terminal's process group, like libvirtd: Ctrl-C is vmhost-compare's to handle.
        .process_group(0)
        .spawn()
        .expect("spawn qemu-system-x86_64");
    let _qemu = Guarded(qemu);
    eprintln!("agents in one guest ...");
    let (_vh_conn, r) = ask(&vh, r#"{"jsonrpc":"2.0","id":1,"method":"agent.info"}"#, &console);
    assert!(r.contains("\"result\""), "agent.info: {r}");
    let (_qga_conn, r) = ask(&qga, r#"{"execute":"guest-info"}"#, &console);
    assert!(r.contains("\"return\""), "guest-info: {r}");
    // The guest prints a line a second; the second one after the replies was sampled after them.
    let lines = |text: &str| text.lines().filter(|l| l.starts_with(AGENTS_RSS)).map(str::to_string).collect::<Vec<_>>();
    let seen = lines(&fs::read_to_string(&console).unwrap_or_default()).len();
    let deadline = Instant::now() + Duration::from_secs(60);
    let line = loop {
        let text = fs::read_to_string(&console).unwrap_or_default();
        if let Some(l) = lines(&text).get(seen + 1) {
            break l.clone();
        }
        assert!(Instant::now() < deadline, "no {AGENTS_RSS} line; console:\n{text}");
        pause(Duration::from_millis(100));
    };
    let figure = |key: &str| {
        agents_figure(&line, key).unwrap_or_else(|| {
            let text = fs::read_to_string(&console).unwrap_or_default();
            panic!("{key} missing or gone in {line:?}; console:\n{text}")
        })
    };
    Agents {
        qga_version,
        qga_size,
        qga_libs,
        vmhost_agent: (figure("vmhost-agent.rss"), figure("vmhost-agent.vmrss")),
        qemu_ga: (figure("qemu-ga.rss"), figure("qemu-ga.vmrss")),
    }
}

fn main() -> ExitCode {
    if flag("--vmhost-boot-only") && flag("--update-docs") {
        eprintln!("vmhost-compare: --vmhost-boot-only measures one side only; it cannot --update-docs");
        return ExitCode::from(2);
    }
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_usize(sig, &SIGNAL, sig as usize).expect("install signal handler");
    }
    // A failure after an interrupt (a command the terminal's Ctrl-C also reached, a daemon that
    // went with it) is the interrupt's doing: no panic message for it.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if interrupted().is_none() {
            hook(info);
        }
    }));
    let result = std::panic::catch_unwind(compare);
    if let Some(sig) = interrupted() {
        let name = nix::sys::signal::Signal::try_from(sig).map_or("a signal", |s| s.as_str());
        eprintln!("vmhost-compare: interrupted by {name}; stopped the processes it started and removed its temp dirs");
        return ExitCode::from(128 + sig as u8);
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(101),
    }
}

fn compare() {
    let rounds = arg("--rounds", 5);
    let vms = arg("--vms", 1000);
    let cli_calls = arg("--cli-calls", 20);
    let api_calls = arg("--api-calls", 200);
    let update_docs = flag("--update-docs");
    let boot_only = flag("--vmhost-boot-only");

    if !boot_only {
        ensure_libvirt();
    }
    let guest = vmhost_tests::agent_guest();
    let work = tempfile::Builder::new().prefix("vmhcmpw").tempdir_in("/tmp").expect("tempdir");
    announce(work.path());
    let mut out = String::new();
    let date = run(Command::new("date").args(["-u", "+%Y-%m-%d"])).trim().to_string();
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load1 = load.split_whitespace().next().unwrap_or("?").to_string();

    // 1. Boot latency, alternating.
    let host = TestHost::start(HostOptions::default());
    announce(host.dir.path());
    let lv = (!boot_only).then(Libvirt::start);
    let lv_rss = |lv: &Option<Libvirt>| lv.as_ref().map_or((0, 0), Libvirt::rss);
    let (vmhostd_idle, (libvirtd_idle, virtlogd_idle)) = (host.daemon_pid().map_or(0, rss_kib), lv_rss(&lv));
    eprintln!("warm-up starts ...");
    let _ = boot_vmhost(&host, "warm", work.path());
    if let Some(lv) = &lv {
        let _ = boot_libvirt(lv, "warm");
    }
    let (mut vh, mut lb, mut agent_rss) = (Vec::new(), Vec::new(), None);
    for r in 0..rounds {
        eprintln!("round {} of {rounds}", r + 1);
        let (b, rss) = boot_vmhost(&host, &format!("cmp{r}"), work.path());
        agent_rss = agent_rss.or(rss);
        vh.push(b);
        if let Some(lv) = &lv {
            lb.push(boot_libvirt(lv, &format!("cmp{r}")));
        }
    }
    let (vmhostd_boots, (libvirtd_boots, virtlogd_boots)) = (host.daemon_pid().map_or(0, rss_kib), lv_rss(&lv));
    drop(host);

    let col = |v: &[Boot], f: Pick| -> Option<Duration> {
        let xs: Vec<Duration> = v.iter().filter_map(f).collect();
        (!xs.is_empty()).then(|| median(xs))
    };
    let min = |v: &[Boot], f: Pick| -> Option<Duration> { v.iter().filter_map(f).min() };
    let cell = |d: Option<Duration>| d.map_or("n/a".to_string(), |d| format!("{:.2}", d.as_secs_f64()));
    let ratio = |a: Option<Duration>, b: Option<Duration>| match (a, b) {
        (Some(a), Some(b)) if a > Duration::ZERO => format!("{:.2}", b.as_secs_f64() / a.as_secs_f64()),
        _ => "n/a".into(),
    };
    let _ = writeln!(out, "### Boot: create → running → guest ready → agent serving\n");
    let _ = writeln!(
        out,
        "p50 of {rounds} rounds, alternating vmhost and libvirt after one warm-up start each; seconds from \
         the command's start. Same kernel and initramfs (`initramfs-agent.cpio.gz`), 1 vCPU, {MEMORY_MIB} MiB, \
         q35, TCG, serial console to a file, virtio-serial port for the agent. Ratio = libvirt / vmhost. \
         The minimum is the least disturbed round on this shared machine.\n"
    );
    let _ = writeln!(out, "| step | vmhost p50 (s) | libvirt p50 (s) | ratio | vmhost min (s) | libvirt min (s) |");
    let _ = writeln!(out, "|------|---------------:|----------------:|------:|---------------:|----------------:|");
    let rows: [(&str, Pick); 3] = [
        ("command returned (VM running): `vmhostctl create` / `virsh create`", |b| Some(b.running)),
        ("console `VMHOST-GUEST-READY`", |b| Some(b.ready)),
        ("console `vmhost-agent: serving on`", |b| Some(b.serving)),
    ];
    for (label, f) in rows {
        let (a, b) = (col(&vh, f), col(&lb, f));
        let (c, d) = (min(&vh, f), min(&lb, f));
        let _ = writeln!(out, "| {label} | {} | {} | {} | {} | {} |", cell(a), cell(b), ratio(a, b), cell(c), cell(d));
    }
    let _ = writeln!(
        out,
        "| vmhost: `vm.get` shows `agent.connected` (daemon's session up) | {} | — | — | {} | — |",
        cell(col(&vh, |b| b.connected)),
        cell(min(&vh, |b| b.connected))
    );
    let _ = writeln!(out, "\nEach round (vmhost; libvirt), seconds to running / ready / serving:\n");
    let times = |b: &Boot| {
        format!("{:.2} / {:.2} / {:.2}", b.running.as_secs_f64(), b.ready.as_secs_f64(), b.serving.as_secs_f64())
    };
    for (i, a) in vh.iter().enumerate() {
        let b = lb.get(i).map_or("—".into(), times);
        let _ = writeln!(out, "- round {}: {}; {b}", i + 1, times(a));
    }
    let Some(lv) = lv else {
        println!("{out}");
        return;
    };

    // 2. List/get with N records.
    eprintln!("defining {vms} records on each side ...");
    let host = TestHost::start(HostOptions {
        cpu: (vms as u32) + 2,
        memory_gib: (vms as u64 * 64 / 1024) + 2,
        ..HostOptions::default()
    });
    announce(host.dir.path());
    let name = |i: usize| format!("cmp-{i:04}");
    let t = Instant::now();
    let mut c = Client::connect(&host.socket).expect("connect");
    for i in 0..vms {
        let spec = json!({"name": name(i), "cpu": 1, "memory_mib": 64, "state": "stopped",
            "boot": {"kernel": guest.kernel, "initrd": guest.initrd, "cmdline": CMDLINE}});
        let _: Value = c.call("vm.create", json!({ "spec": spec })).expect("vm.create stopped");
        check();
    }
    let vmhost_define = t.elapsed();
    let xml_dir = work.path().join("xml");
    fs::create_dir_all(&xml_dir).expect("mkdir xml");
    let mut cmds = String::new();
    for i in 0..vms {
        let f = xml_dir.join(format!("{}.xml", name(i)));
        let serial = lv.dir.path().join(format!("{}.serial.log", name(i)));
        fs::write(&f, lv.domain_xml(&name(i), &guest.kernel, &guest.initrd, &serial)).expect("write xml");
        let _ = writeln!(cmds, "define {}", f.display());
    }
    let (libvirt_define, _) = lv.session(&cmds);
    let listed = run(lv.virsh().args(["list", "--all", "--name"])).lines().filter(|l| !l.trim().is_empty()).count();
    assert!(listed >= vms, "virsh list shows {listed} domains, expected {vms}");

    let sock = host.socket.clone();
    let ctl = bin("vmhostctl");
    let v_list_cli = cli_median(cli_calls, |_| {
        let mut c = Command::new(&ctl);
        c.arg("--socket").arg(&sock).arg("list");
        c
    });
    let v_get_cli = cli_median(cli_calls, |i| {
        let mut c = Command::new(&ctl);
        c.arg("--socket").arg(&sock).args(["get", &name(i * 37 % vms)]);
        c
    });
    let l_list_cli = cli_median(cli_calls, |_| {
        let mut c = lv.virsh();
        c.args(["list", "--all"]);
        c
    });
    let l_get_cli = cli_median(cli_calls, |i| {
        let mut c = lv.virsh();
        c.args(["dominfo", &name(i * 37 % vms)]);
        c
    });
    let mut api = |method: &str, n: usize| -> Duration {
        let mut lat = Vec::with_capacity(n);
        for i in 0..n {
            check();
            let params = if method == "vm.get" { json!({ "name": name(i * 37 % vms) }) } else { json!({}) };
            let t = Instant::now();
            let _: Value = c.call(method, params).expect("api call");
            lat.push(t.elapsed());
        }
        median(lat)
    };
    let list_api_calls = (api_calls / 10).max(5);
    let v_list_api = api("vm.list", list_api_calls);
    let v_get_api = api("vm.get", api_calls);
    // One virsh session: p50 of virsh's own per-command times (`virsh -t`).
    let l_list_api = median(lv.session(&"list --all\n".repeat(list_api_calls)).1);
    let l_get_api =
        median(lv.session(&(0..api_calls).map(|i| format!("dominfo {}\n", name(i * 37 % vms))).collect::<String>()).1);
    let (vmhostd_loaded, (libvirtd_loaded, virtlogd_loaded)) = (host.daemon_pid().map_or(0, rss_kib), lv.rss());

    let _ = writeln!(out, "\n### List and get with {vms} records\n");
    let _ = writeln!(
        out,
        "vmhost: {vms} VMs created `stopped` ({:.2} s over one connection, each record fsynced); libvirt: \
         {vms} domains defined, not started ({:.2} s of `define` in one virsh session); both on the same ext4 \
         file system. CLI rows: p50 of \
         {cli_calls} runs, process start included. Connection rows: vmhost p50 of {list_api_calls} `vm.list` / \
         {api_calls} `vm.get` calls over one socket connection; libvirt the same count of `list --all` / \
         `dominfo` commands in one virsh session (its connection kept), p50 of virsh's own per-command \
         times (`virsh -t`).\n",
        vmhost_define.as_secs_f64(),
        libvirt_define.as_secs_f64()
    );
    let _ = writeln!(out, "| operation | vmhost (ms) | libvirt (ms) | ratio |");
    let _ = writeln!(out, "|-----------|------------:|-------------:|------:|");
    let r = |a: Duration, b: Duration| format!("{:.2}", b.as_secs_f64() / a.as_secs_f64().max(1e-9));
    for (label, a, b) in [
        ("list, CLI: `vmhostctl list` / `virsh list --all`", v_list_cli, l_list_cli),
        ("get, CLI: `vmhostctl get` / `virsh dominfo`", v_get_cli, l_get_cli),
        ("list, one connection: `vm.list` / `list --all`", v_list_api, l_list_api),
        ("get, one connection: `vm.get` / `dominfo`", v_get_api, l_get_api),
    ] {
        let _ = writeln!(out, "| {label} | {:.2} | {:.2} | {} |", ms(a), ms(b), r(a, b));
    }
    drop(host);

    // 3. Memory and the agents.
    drop(lv);
    let qga = agents(work.path());
    let ours = workspace().join("target/guest-agent/vmhost-agent");
    let ours_size = fs::metadata(&ours).map(|m| m.len()).unwrap_or(0);
    let libs_total: u64 = qga.qga_libs.iter().map(|l| l.1).sum();
    let _ = writeln!(out, "\n### Daemon memory (RSS, KiB)\n");
    let _ = writeln!(
        out,
        "libvirt: Debian 12's libvirt 9 runs the monolithic `libvirtd` (its QEMU driver inside) plus `virtlogd` \
         (QEMU's console and log output); both are counted.\n"
    );
    let _ = writeln!(out, "| when | vmhostd | libvirtd | virtlogd | libvirt total | ratio (libvirt / vmhost) |");
    let _ = writeln!(out, "|------|--------:|---------:|---------:|--------------:|------------------------:|");
    for (label, v, l, g) in [
        ("started, nothing defined", vmhostd_idle, libvirtd_idle, virtlogd_idle),
        (&*format!("after {} boots", rounds + 1), vmhostd_boots, libvirtd_boots, virtlogd_boots),
        (&*format!("{vms} records, after the list/get calls"), vmhostd_loaded, libvirtd_loaded, virtlogd_loaded),
    ] {
        let _ = writeln!(out, "| {label} | {v} | {l} | {g} | {} | {:.1} |", l + g, (l + g) as f64 / v.max(1) as f64);
    }
    let _ = writeln!(out, "\n### Guest agent\n");
    let _ = writeln!(out, "| figure | vmhost-agent | qemu-guest-agent |");
    let _ = writeln!(out, "|--------|-------------:|-----------------:|");
    let _ = writeln!(
        out,
        "| binary (stripped) | {} bytes ({}), static | {} bytes ({}), dynamic, version {} |",
        ours_size,
        mib(ours_size),
        qga.qga_size,
        mib(qga.qga_size),
        qga.qga_version
    );
    let _ = writeln!(
        out,
        "| shared libraries it loads (sizes on Debian 12) | none | {} bytes ({}) in {} libraries |",
        libs_total,
        mib(libs_total),
        qga.qga_libs.len()
    );
    let _ = writeln!(
        out,
        "| RSS in one guest, after one request each (`Rss` of /proc/PID/smaps_rollup) | {} KiB | {} KiB |",
        qga.vmhost_agent.0, qga.qemu_ga.0
    );
    let _ = writeln!(
        out,
        "| `VmRSS` of /proc/PID/status, same moment | {} KiB | {} KiB |",
        qga.vmhost_agent.1, qga.qemu_ga.1
    );
    let _ = writeln!(
        out,
        "| RSS the agent reports in `vm.guest_info` (boot rounds above) | {} KiB | — |",
        agent_rss.map_or("n/a".into(), |v| v.to_string())
    );
    let _ = writeln!(
        out,
        "\nBoth agents ran in one guest (`initramfs-compare.cpio.gz`, `tests/guest/build-compare-guest.sh`: the \
         boot rounds' kernel, busybox and static vmhost-agent, plus qemu-ga with the shared libraries and loader \
         of this Debian 12 host), 1 vCPU, {MEMORY_MIB} MiB, q35, TCG, each on its own virtio-serial port \
         (`org.vmhost.agent.0`, `org.qemu.guest_agent.0`). Each answered one request from the host \
         (`agent.info`, `guest-info`) and kept its connection; the guest's init \
         (`tests/compare/agents-init.sh`) then read both figures from /proc. `Rss` of smaps_rollup walks the \
         page tables; this 6.1 kernel folds per-thread counters into `VmRSS` only every 64 page faults, which \
         is why a process as small as vmhost-agent can show a few KiB there. qemu-ga's libraries: {}.",
        qga.qga_libs.iter().map(|(n, s)| format!("{n} {s}")).collect::<Vec<_>>().join(", ")
    );

    let section = format!(
        "{BEGIN}\n## Against libvirt 9 ({date})\n\n`cargo build --release --workspace --bins && target/release/vmhost-compare \
         --update-docs` (see docs/testing.md; 5 to 10 minutes): vmhostd (release build) and libvirt {} (Debian 12 `libvirt-daemon-system`, QEMU {}) on the same machine in one run. \
         Machine: 2 cores, TCG, other builds and tests running at the same time (1-minute load {load1} at the \
         start), so absolute figures are inflated and noisy; the ratios matter. libvirt ran privately \
         (`tests/compare/libvirt-private.sh`: own mount and network namespaces, its config and state on the same \
         ext4 file system as vmhostd's, libvirt's QEMU as root (with its default user it re-probes QEMU at every start here; vmhostd's QEMU runs as an unprivileged user), defaults otherwise: per-domain cgroups and /dev namespace, virtlogd for the console).\n\n{out}{END}\n",
        pkg_version("libvirt-daemon"),
        pkg_version("qemu-system-x86"),
    );
    let section = wrap(&section, 100);
    println!("{section}");
    if update_docs {
        let path = workspace().join("docs/performance.md");
        let doc = fs::read_to_string(&path).expect("read docs/performance.md");
        let new = match (doc.find(BEGIN), doc.find(END)) {
            (Some(b), Some(e)) if e > b => {
                let tail = doc[e + END.len()..].trim_start_matches('\n');
                format!("{}{section}{}{tail}", &doc[..b], if tail.is_empty() { "" } else { "\n" })
            }
            _ => format!("{}\n{section}", doc.trim_end_matches('\n').to_string() + "\n"),
        };
        fs::write(&path, new).expect("write docs/performance.md");
        eprintln!("updated {}", path.display());
    }
}
