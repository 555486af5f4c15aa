//! Test harness for vmhost's end-to-end tests and benchmark.
//!
//! Every [`TestHost`] runs its daemon with `sandbox = "require"` unless a test says otherwise,
//! so the whole end-to-end suite proves the sandbox lets the daemon do its work.
//!
//! [`guest`] builds (once, cached in `target/guest`) the real guest: Debian's cloud kernel and a
//! busybox initramfs, via `tests/guest/build.sh`. [`TestHost`] runs a real `vmhostd` with
//! `accel = "tcg"` in a temp dir and talks to it through the real socket; dropping it kills the
//! daemon and every QEMU it started, so a failing test leaves no process behind.
//!
//! The binaries are taken from the cargo target dir: run `cargo build --workspace --bins` before
//! `cargo test` (the README's test command and `.ci/run` do).

use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use vmhost::client::Client;

/// How long [`TestHost::wait_status`] looks for the event of a status `vm.get` already shows
/// before it reports the change as made without one (a bound on a report, not on the test).
const EVENT_AFTER_VIEW: Duration = Duration::from_secs(5);

/// A `[networks.lan]` table: a bridge vmhostd creates, host address 10.0.0.1/24.
pub const LAN_NETWORK: &str = r#"
[networks.lan]
bridge = "br-lan"
create = true
address = "10.0.0.1/24"
subnet = "10.0.0.0/24"
"#;

/// Console line the test guest prints once userspace runs.
pub const GUEST_READY: &str = "VMHOST-GUEST-READY";

/// The unprivileged user test hosts run QEMU as (`qemu.user`), created by tests/setup.sh. Not
/// `vmhost-qemu`: the packaging test installs and purges the package that owns that user.
pub const QEMU_USER: &str = "vmhost-test-qemu";

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

/// The cargo target dir holding this test binary (`target/debug`).
pub fn target_dir() -> PathBuf {
    // current_exe is target/debug/deps/NAME-HASH (tests) or target/debug/NAME (bins).
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// Path of a workspace binary; panics with instructions when it was not built.
pub fn bin(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(p.exists(), "{} not found: run `cargo build --workspace --bins` first", p.display());
    p
}

/// The test guest's kernel and initramfs.
#[derive(Debug, Clone)]
pub struct Guest {
    /// `target/guest/vmlinuz`.
    pub kernel: PathBuf,
    /// `target/guest/initramfs.cpio.gz`.
    pub initrd: PathBuf,
}

/// Runs `tests/guest/SCRIPT target/guest` (the guest build scripts are cached and flock-safe)
/// and returns that output dir.
pub fn build_guest_image(script: &str) -> PathBuf {
    let out = workspace().join("target/guest");
    let status = Command::new(workspace().join("tests/guest").join(script))
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("run tests/guest/{script}: {e}"));
    assert!(status.success(), "tests/guest/{script} failed");
    out
}

/// Builds the guest once per process.
pub fn guest() -> Guest {
    static GUEST: OnceLock<Guest> = OnceLock::new();
    GUEST
        .get_or_init(|| {
            let out = build_guest_image("build.sh");
            Guest { kernel: out.join("vmlinuz"), initrd: out.join("initramfs.cpio.gz") }
        })
        .clone()
}

/// The test guest with the static `vmhost-agent` as /bin/vmhost-agent (built once per process by
/// `tests/guest/build-agent-guest.sh`).
pub fn agent_guest() -> Guest {
    static GUEST: OnceLock<Guest> = OnceLock::new();
    GUEST
        .get_or_init(|| {
            let base = guest();
            let out = build_guest_image("build-agent-guest.sh");
            Guest { kernel: base.kernel, initrd: out.join("initramfs-agent.cpio.gz") }
        })
        .clone()
}

/// The test guest with a hostile stand-in for the agent: `tests/guest/hostile/SCRIPT` packed as
/// /bin/vmhost-agent into `target/guest/INITRAMFS` (the guest's init starts it after boot).
pub fn hostile_guest(script: &str, initramfs: &str) -> Guest {
    let base = guest();
    let root = workspace();
    let out = root.join("target/guest");
    let st = Command::new(root.join("tests/guest/build.sh"))
        .env("EXTRA_FILES", format!("{}:/bin/vmhost-agent", root.join("tests/guest/hostile").join(script).display()))
        .env("INITRAMFS_NAME", initramfs)
        .arg(&out)
        .status()
        .expect("run tests/guest/build.sh");
    assert!(st.success(), "tests/guest/build.sh {script}: {st}");
    Guest { kernel: base.kernel, initrd: out.join(initramfs) }
}

/// Runs `cmd` to completion and returns its stdout; panics with its status, stdout and stderr
/// when it fails.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Builds the two Debian packages into `target/deb` (`packaging/build-debs.sh`; cargo reuses
/// `target/release`) and returns their paths, asserting there are two.
pub fn build_debs() -> Vec<String> {
    let printed = run_ok(Command::new(workspace().join("packaging/build-debs.sh")).arg(workspace().join("target/deb")));
    let debs: Vec<String> = printed.lines().filter(|l| l.ends_with(".deb")).map(str::to_string).collect();
    assert_eq!(debs.len(), 2, "build-debs.sh printed {debs:?}");
    debs
}

/// The `paths.boot` list of a test host: its images dir, the test guest's dir (`target/guest`,
/// where [`guest`] builds) and `extra`, as a TOML array.
pub fn boot_dirs_toml(images: &Path, extra: &[PathBuf]) -> String {
    let mut dirs = vec![images.to_path_buf(), workspace().join("target/guest")];
    dirs.extend(extra.iter().cloned());
    let quoted: Vec<String> = dirs.iter().map(|d| format!("{:?}", d.display().to_string())).collect();
    format!("[{}]", quoted.join(", "))
}

/// A vmhostd running in a temp dir.
pub struct TestHost {
    /// Temp dir holding config, state, run and images.
    pub dir: tempfile::TempDir,
    /// Config file.
    pub config: PathBuf,
    /// API socket.
    pub socket: PathBuf,
    /// The daemon's network namespace (`ip netns` name), if it has one.
    pub netns: Option<String>,
    /// Extra environment of the daemon (e.g. the sandbox probe's variable).
    pub env: Vec<(String, String)>,
    /// Start the daemon without `CAP_SYS_PTRACE` in its bounding set, as the packaged unit
    /// does (the tests otherwise run it as root with every capability).
    pub without_ptrace: bool,
    /// A file the daemon sees as `/etc/hosts` (bound over it in a mount namespace of its own).
    pub hosts: Option<PathBuf>,
    daemon: Option<Child>,
}

/// Options of a test host.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// `hardware.cpu`.
    pub cpu: u32,
    /// `hardware.memory_gib`.
    pub memory_gib: u64,
    /// Extra TOML appended (e.g. `[hardware.sfp]` tables).
    pub extra: String,
    /// `qemu.machine`.
    pub machine: String,
    /// `[access]` groups.
    pub readonly_group: String,
    /// Run the daemon (and so its QEMUs and links) in a network namespace of its own.
    pub netns: bool,
    /// Top-level `sandbox`: `require` by default, so every end-to-end test runs sandboxed.
    pub sandbox: String,
    /// Top-level `seccomp`: `enforce`, or the value of `VMHOST_TEST_SECCOMP` (`log` to find
    /// syscalls the table lacks, see docs/sandbox.md).
    pub seccomp: String,
    /// Extra environment of the daemon.
    pub env: Vec<(String, String)>,
    /// `qemu.accel`: `tcg` (this machine's nested KVM hangs guests, ../shared/ENVIRONMENT.md).
    pub accel: String,
    /// `qemu.cpu_model`, empty for the default.
    pub cpu_model: String,
    /// Extra lines of the `[qemu]` table (e.g. `binary = "..."`).
    pub qemu_extra: String,
    /// Boot directories (`paths.boot`) besides the host's images dir and the test guest's
    /// `target/guest`, for tests that boot kernels from elsewhere.
    pub boot_dirs: Vec<PathBuf>,
    /// The daemon's `/etc/hosts`: these lines, bound over the host's file in a mount namespace
    /// of the daemon's own (its resolver, the test's names), when not `None`.
    pub hosts: Option<String>,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            cpu: 8,
            memory_gib: 8,
            extra: String::new(),
            machine: "q35".into(),
            readonly_group: "vmhost-ro".into(),
            netns: false,
            sandbox: "require".into(),
            seccomp: std::env::var("VMHOST_TEST_SECCOMP").unwrap_or_else(|_| "enforce".into()),
            env: Vec::new(),
            accel: "tcg".into(),
            cpu_model: String::new(),
            qemu_extra: String::new(),
            boot_dirs: Vec::new(),
            hosts: None,
        }
    }
}

impl TestHost {
    /// Writes a config and starts the daemon.
    pub fn start(opts: HostOptions) -> TestHost {
        // Short prefix: the run dir must stay short enough for socket paths.
        let dir = tempfile::Builder::new().prefix("vmh").tempdir_in("/tmp").expect("tempdir");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod tempdir");
        let d = dir.path();
        fs::create_dir_all(d.join("images")).expect("images dir");
        let config = d.join("vmhostd.toml");
        let socket = d.join("vmhostd.sock");
        let text = format!(
            r#"sandbox = "{sandbox}"
seccomp = "{seccomp}"
[paths]
state = "{state}"
run = "{run}"
images = "{images}"
socket = "{socket}"
boot = {boot}
[qemu]
accel = "{accel}"
cpu_model = "{cpu_model}"
machine = "{machine}"
user = "{qemu_user}"
{qemu_extra}
[access]
admin_group = "vmhost-test-admin"
readonly_group = "{ro}"
[hardware]
cpu = {cpu}
memory_gib = {mem}
reserved_cpu = 1
reserved_memory_gib = 1
{extra}
"#,
            sandbox = opts.sandbox,
            seccomp = opts.seccomp,
            state = d.join("state").display(),
            run = d.join("run").display(),
            images = d.join("images").display(),
            socket = socket.display(),
            boot = boot_dirs_toml(&d.join("images"), &opts.boot_dirs),
            machine = opts.machine,
            accel = opts.accel,
            cpu_model = opts.cpu_model,
            qemu_user = QEMU_USER,
            qemu_extra = opts.qemu_extra,
            ro = opts.readonly_group,
            cpu = opts.cpu,
            mem = opts.memory_gib,
            extra = opts.extra,
        );
        fs::write(&config, text).expect("write config");
        let netns = opts.netns.then(|| {
            let name = d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let st = Command::new("ip").args(["netns", "add", &name]).status().expect("ip netns add");
            assert!(st.success(), "ip netns add {name} failed");
            name
        });
        let hosts = opts.hosts.map(|lines| {
            let file = d.join("hosts");
            fs::write(&file, lines).expect("write hosts file");
            fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).expect("chmod hosts file");
            file
        });
        let mut host =
            TestHost { dir, config, socket, netns, env: opts.env, without_ptrace: false, hosts, daemon: None };
        host.spawn_daemon();
        host
    }

    /// Creates the network namespace the daemon will run in without starting it, so a test can
    /// put fixtures there first. Returns the host; call [`TestHost::spawn_daemon`] next.
    pub fn prepare(opts: HostOptions) -> TestHost {
        let mut h = TestHost::start(opts);
        h.stop_daemon();
        h
    }

    /// Starts (or restarts) vmhostd and waits until its socket answers.
    pub fn spawn_daemon(&mut self) {
        self.launch_daemon();
        let log = self.dir.path().join("vmhostd.log");
        let Some(daemon) = self.daemon.as_mut() else { return };
        wait::daemon_answers(&self.socket, daemon, || fs::read_to_string(&log).unwrap_or_default());
    }

    /// Starts (or restarts) vmhostd and returns at once, without waiting for its socket (the
    /// benchmark times the start itself).
    pub fn launch_daemon(&mut self) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("vmhostd.log"))
            .expect("daemon log");
        let err = log.try_clone().expect("dup log");
        let mut cmd = Command::new(bin("vmhostd"));
        cmd.arg("--config").arg(&self.config).env("VMHOST_LOG", "debug").stdin(Stdio::null()).stdout(log).stderr(err);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(ns) = &self.netns {
            let nsfile = fs::File::open(format!("/run/netns/{ns}")).expect("open netns");
            // SAFETY: setns is async-signal-safe and the closure allocates nothing.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    nix::sched::setns(&nsfile, nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
                });
            }
        }
        if let Some(hosts) = &self.hosts {
            let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("a path without NUL");
            let (source, target, root) = (c(hosts), c(Path::new("/etc/hosts")), c(Path::new("/")));
            // SAFETY: unshare and mount are async-signal-safe; the strings were made before the fork.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    let none = std::ptr::null();
                    if libc::unshare(libc::CLONE_NEWNS) != 0
                        || libc::mount(none, root.as_ptr(), none, libc::MS_REC | libc::MS_PRIVATE, std::ptr::null())
                            != 0
                        || libc::mount(source.as_ptr(), target.as_ptr(), none, libc::MS_BIND, std::ptr::null()) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        if self.without_ptrace {
            // SAFETY: prctl is async-signal-safe and the closure allocates nothing.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                    // CAP_SYS_PTRACE is capability 19 (linux/capability.h).
                    if libc::prctl(libc::PR_CAPBSET_DROP, 19, 0, 0, 0) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }
        let child = cmd.spawn().expect("spawn vmhostd");
        self.daemon = Some(child);
    }

    /// The daemon's pid.
    pub fn daemon_pid(&self) -> Option<u32> {
        self.daemon.as_ref().map(Child::id)
    }

    /// SIGKILLs the daemon (VMs keep running).
    pub fn kill_daemon(&mut self) {
        if let Some(mut c) = self.daemon.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERMs the daemon and waits for it.
    pub fn stop_daemon(&mut self) -> std::process::ExitStatus {
        let mut c = self.daemon.take().expect("daemon running");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM);
        c.wait().expect("wait vmhostd")
    }

    /// Waits for the daemon to exit on its own (a signal someone else sent) and returns its
    /// status; it is not signalled here.
    ///
    /// # Panics
    /// When no daemon runs, or it has not exited within `bound` (it is killed then).
    pub fn daemon_exited(&mut self, bound: std::time::Duration) -> std::process::ExitStatus {
        let mut c = self.daemon.take().expect("daemon running");
        wait::exited(&mut c, "vmhostd", bound)
    }

    /// The daemon's log so far.
    pub fn daemon_log(&self) -> String {
        fs::read_to_string(self.dir.path().join("vmhostd.log")).unwrap_or_default()
    }

    /// A fresh client.
    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect to vmhostd")
    }

    /// Calls a method, panicking with the daemon's error on failure.
    pub fn call(&self, method: &str, params: Value) -> Value {
        match self.client().call::<Value>(method, params.clone()) {
            Ok(v) => v,
            Err(e) => panic!("{method} {params} failed: {e}"),
        }
    }

    /// Calls a method that must fail; returns the error object's code and the full error.
    pub fn call_err(&self, method: &str, params: Value) -> (i32, vmhost::api::ApiError) {
        match self.client().call::<Value>(method, params.clone()) {
            Ok(v) => panic!("{method} {params} unexpectedly succeeded: {v}"),
            Err(vmhost::client::ClientError::Api(e)) => (e.code.as_i32(), e),
            Err(e) => panic!("{method}: transport error {e}"),
        }
    }

    /// Runs vmhostctl against this host.
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(bin("vmhostctl")).arg("--socket").arg(&self.socket).args(args).output().expect("run vmhostctl")
    }

    /// Every entry of the images directory, hidden ones (an import's temp file) included, sorted.
    pub fn image_dir_entries(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.images())
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Image `name` as `image.list` shows it.
    pub fn listed_image(&self, name: &str) -> Option<Value> {
        self.call("image.list", json!({})).as_array()?.iter().find(|i| i["name"] == name).cloned()
    }

    /// State dir.
    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Run dir.
    pub fn run(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    /// Images dir.
    pub fn images(&self) -> PathBuf {
        self.dir.path().join("images")
    }

    /// A direct-kernel spec booting the test guest.
    pub fn kernel_spec(&self, name: &str) -> Value {
        let g = guest();
        json!({
            "name": name,
            "cpu": 1,
            "memory_mib": 256,
            "boot": {
                "kernel": g.kernel,
                "initrd": g.initrd,
                "cmdline": "console=ttyS0 panic=-1 quiet",
            }
        })
    }

    /// The guest's serial log (lossy UTF-8: a guest writes any bytes, and a log trimmed to
    /// `logs.max_bytes` may start in the middle of a character).
    pub fn serial(&self, name: &str) -> String {
        let bytes = fs::read(self.state().join("logs").join(format!("{name}.serial.log"))).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Waits until the serial log of `name` contains `needle`; false when `timeout` (a failure
    /// bound, not a speed) passed first.
    pub fn wait_serial(&self, name: &str, needle: &str, timeout: Duration) -> bool {
        wait::poll(timeout, || if self.serial(name).contains(needle) { Ok(()) } else { Err(String::new()) }).is_ok()
    }

    /// Waits until the serial log of `name` holds `needle` at least `n` times (the `n`th boot,
    /// the `n`th thaw, ...).
    ///
    /// # Panics
    /// When `timeout` (a failure bound) passes first, with the log.
    pub fn wait_serial_count(&self, name: &str, needle: &str, n: usize, timeout: Duration) {
        wait::until(&format!("{n} times {needle:?} on {name}'s console"), timeout, || {
            let log = self.serial(name);
            if log.matches(needle).count() >= n {
                Ok(())
            } else {
                Err(format!("serial:\n{log}"))
            }
        });
    }

    /// Waits until `vm.get` of `name` satisfies `ok` and returns that view. Woken by the VM's
    /// events (`events.subscribe`, made before the first look so no change is missed), not by a
    /// timer; see [`wait`].
    ///
    /// # Panics
    /// When `timeout` (a failure bound) passes first, naming `what`, the last view and the
    /// VM's events seen meanwhile.
    pub fn wait_vm(&self, name: &str, what: &str, timeout: Duration, ok: impl FnMut(&Value) -> bool) -> Value {
        let read = |c: &mut Client| match c.call::<Value>("vm.get", json!({ "name": name })) {
            Ok(v) => v,
            Err(e) => json!({ "vm.get error": e.to_string() }),
        };
        let what = format!("{name} {what}");
        self.wait_on_events(&what, timeout, read, |e| e.vm == name, ok).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waits until `vm.list` satisfies `ok` and returns that list: [`TestHost::wait_vm`] for a
    /// fact about the host's whole set of VMs (which exist, which run). Woken by any VM's event,
    /// and looks again once a second without one.
    ///
    /// # Errors
    /// When `timeout` (a failure bound) passes first: a message naming `what`, the last list
    /// and the events seen meanwhile, for the caller to add what it knows and panic with.
    pub fn wait_list(&self, what: &str, timeout: Duration, ok: impl FnMut(&Value) -> bool) -> Result<Value, String> {
        let read = |c: &mut Client| match c.call::<Value>("vm.list", json!({})) {
            Ok(v) => v,
            Err(e) => json!({ "vm.list error": e.to_string() }),
        };
        self.wait_on_events(what, timeout, read, |_| true, ok)
    }

    /// The one event-driven wait under [`TestHost::wait_vm`] and [`TestHost::wait_list`]: reads
    /// with `read` until `ok` holds, again at each event `relevant` selects (subscribed before
    /// the first read, so no change is missed) or after [`wait::RECHECK`] without one (a change
    /// made without an event is still seen).
    ///
    /// # Errors
    /// When `timeout` (a failure bound) passes first: a message naming `what`, the last value
    /// read and the relevant events seen meanwhile.
    fn wait_on_events(
        &self,
        what: &str,
        timeout: Duration,
        mut read: impl FnMut(&mut Client) -> Value,
        relevant: impl Fn(&vmhost::api::Event) -> bool,
        mut ok: impl FnMut(&Value) -> bool,
    ) -> Result<Value, String> {
        let mut events = self.client();
        events.subscribe_events().unwrap_or_else(|e| panic!("events.subscribe while waiting for {what}: {e}"));
        let mut reads = self.client();
        let deadline = Instant::now() + timeout;
        let mut seen: Vec<String> = Vec::new();
        loop {
            let value = read(&mut reads);
            if ok(&value) {
                return Ok(value);
            }
            // The next relevant event, or a look again after a while.
            loop {
                let now = Instant::now();
                if now >= deadline {
                    return Err(format!(
                        "gave up waiting for {what} after {timeout:?}; last read: {value}; events meanwhile: {seen:?}"
                    ));
                }
                match events.next_event((deadline - now).min(wait::RECHECK)) {
                    Ok(Some(e)) if relevant(&e) => {
                        seen.push(format!("{}: {:?} -> {:?} ({})", e.vm, e.from, e.to, e.reason));
                        break;
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) => panic!("events while waiting for {what}: {e}"),
                }
            }
        }
    }

    /// Waits until `vm.get` reports `status` for `name` ([`TestHost::wait_vm`]), and returns
    /// that view.
    ///
    /// # Panics
    /// When `timeout` (a failure bound) passes first.
    pub fn wait_status(&self, name: &str, status: &str, timeout: Duration) -> Value {
        let mut events = self.client();
        events.subscribe_events().unwrap_or_else(|e| panic!("events.subscribe while waiting for {name}: {e}"));
        let before = self.client().call::<Value>("vm.get", json!({ "name": name })).ok();
        let v = self.wait_vm(name, &format!("to become {status}"), timeout, |v| v["status"] == status);
        // A status change must be an event: tell when this one came without one.
        let already = before.is_some_and(|b| b["status"] == status);
        // The event follows the record's commit, so it may come just after vm.get saw it.
        let mut told = already;
        while !told {
            let Ok(Some(e)) = events.next_event(EVENT_AFTER_VIEW) else { break };
            told = e.vm == name && e.to.is_some_and(|t| serde_json::to_value(t).is_ok_and(|t| t == status));
        }
        if !told {
            eprintln!("note: {name} became {status} without an events.event saying so");
        }
        v
    }

    /// Arms the daemon's crash point `step` (`RUN/crashpoint`, docs/lifecycle.md): the daemon
    /// kills itself with SIGKILL when it reaches that step.
    pub fn arm_crash(&self, step: &str) {
        fs::write(self.run().join(vmhost::crashpoint::FILE), step).expect("arm the crash point");
    }

    /// Disarms the crash point.
    pub fn disarm_crash(&self) {
        let _ = fs::remove_file(self.run().join(vmhost::crashpoint::FILE));
    }

    /// Waits until the daemon died at the armed crash point `step` (its log says so), reaps
    /// it, disarms the point and restarts the daemon: the exact place of a "daemon killed
    /// mid-operation" instead of a kill after some time.
    ///
    /// # Panics
    /// When the daemon does not die, or died elsewhere.
    pub fn restart_after_crash(&mut self, step: &str) {
        let pid = self.daemon_pid().expect("daemon") as i32;
        wait::until_true(
            &format!("vmhostd to die at the crash point {step}"),
            Duration::from_secs(120),
            || !alive(pid),
            || "still running".into(),
        );
        let log = self.daemon_log();
        let reached = log.lines().any(|l| l.contains("crash point reached") && l.contains(&format!("\"{step}\"")));
        assert!(reached, "{step}: the crash point was not what killed it; log:\n{log}");
        self.kill_daemon(); // reap
        self.disarm_crash();
        self.spawn_daemon();
    }

    /// Calls `method` with the crash point `step` armed, expecting the daemon to die under it,
    /// then restarts it ([`TestHost::restart_after_crash`]).
    ///
    /// # Panics
    /// When the call is answered, or the daemon does not die at `step`.
    pub fn crash_during(&mut self, step: &str, method: &str, params: Value) {
        self.arm_crash(step);
        let answer = self.client().call::<Value>(method, params);
        assert!(answer.is_err(), "{step}: {method} answered although the daemon should have died: {answer:?}");
        self.restart_after_crash(step);
    }

    /// Runs `ip -n NETNS ARGS...` (inspection and fixtures only) and returns its stdout.
    pub fn ip(&self, args: &[&str]) -> String {
        let ns = self.netns.as_deref().expect("host has a netns");
        let out = Command::new("ip").arg("-n").arg(ns).args(args).output().expect("run ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Links in the host's netns as `ip -j link` objects.
    pub fn links(&self) -> Vec<Value> {
        serde_json::from_str(&self.ip(&["-j", "-d", "link", "show"])).unwrap_or_default()
    }

    /// Pids of every live (non-zombie) QEMU whose command line mentions this host's dir.
    pub fn qemu_pids(&self) -> Vec<i32> {
        qemu_pids_under(self.dir.path())
    }
}

/// Pids whose parent is `pid` (from `/proc/*/stat`).
pub fn children_of(pid: i32) -> Vec<i32> {
    let mut found = Vec::new();
    let Ok(entries) = fs::read_dir("/proc") else { return found };
    for e in entries.flatten() {
        let Ok(child) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let stat = fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok());
        if ppid == Some(pid) {
            found.push(child);
        }
    }
    found
}

/// Live QEMU processes whose command line mentions `dir`.
pub fn qemu_pids_under(dir: &Path) -> Vec<i32> {
    let needle = dir.to_string_lossy().into_owned();
    let mut pids = Vec::new();
    let Ok(entries) = fs::read_dir("/proc") else { return pids };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let cmd = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        if !cmd.contains("qemu-system") || !cmd.contains(&needle) {
            continue;
        }
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(')').map(|(_, r)| r.trim_start().chars().next().unwrap_or('?'));
        if matches!(state, Some('Z') | Some('X') | None) {
            continue;
        }
        pids.push(pid);
    }
    pids
}

/// The resident set size of `pid` in KiB (`VmRSS` of /proc/PID/status); 0 when it cannot be read.
pub fn rss_kib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// True while `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    matches!(stat.rsplit_once(')').map(|(_, r)| r.trim_start().chars().next()), Some(Some(c)) if c != 'Z' && c != 'X')
}

impl Drop for TestHost {
    fn drop(&mut self) {
        self.kill_daemon();
        for pid in self.qemu_pids() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
        if let Some(ns) = &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// The `p`-quantile (0.0-1.0) of `sorted` durations, nearest rank; zero for none. For the
/// benchmarks' tables.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub mod bench_backups;
pub mod bench_capture;
pub mod bench_images;
pub mod bench_lifecycle;
pub mod bench_migration;
pub mod bench_stats;
pub mod bench_storage;
pub mod boot_sector;
pub mod frames;
pub mod lab;
pub mod migration_pair;
pub mod salt;
pub mod wait;

/// `text` without ANSI colour sequences: the daemon's log is coloured, and tests read it.
pub fn plain_log(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Sends `commands` (whole QMP command objects) on a VM's monitor socket `sock` (`run/NAME/qmp`)
/// after the greeting and `qmp_capabilities`, and returns the answer to each (`{"return": ...}`
/// or `{"error": ...}`; events are skipped). vmhostd keeps no QMP session between operations, so
/// the monitor is free while no operation runs on the VM.
pub fn qmp_commands(sock: &Path, commands: &[Value]) -> Vec<Value> {
    use std::io::{BufRead, BufReader, Write};
    let s = std::os::unix::net::UnixStream::connect(sock).expect("connect to the QMP socket");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("read timeout");
    let mut w = s.try_clone().expect("clone the QMP socket");
    let mut lines = BufReader::new(s).lines();
    let mut answer = || -> Value {
        loop {
            let line = lines.next().expect("QMP closed").expect("read QMP");
            let v: Value = serde_json::from_str(&line).expect("QMP sends JSON");
            if v.get("event").is_none() {
                return v;
            }
        }
    };
    assert!(answer().get("QMP").is_some(), "the QMP greeting");
    writeln!(w, "{}", json!({"execute": "qmp_capabilities"})).expect("write QMP");
    assert!(answer().get("return").is_some(), "qmp_capabilities");
    commands
        .iter()
        .map(|c| {
            writeln!(w, "{c}").expect("write QMP");
            answer()
        })
        .collect()
}

/// The command line of process `pid` (a VM's QEMU), one string per argument.
pub fn argv_of(pid: i64) -> Vec<String> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).expect("QEMU's command line");
    raw.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect()
}

/// The argument after the first `flag` in `argv` (empty when there is none).
pub fn value_after(argv: &[String], flag: &str) -> String {
    argv.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone()).unwrap_or_default()
}

/// The inode of VM `name`'s overlay disk on `host`: the same inode means the same disk.
pub fn overlay_ino(host: &TestHost, name: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(host.state().join("disks").join(format!("{name}.qcow2"))).expect("overlay").ino()
}

/// Serves `files` (URL path → file whose content is the body) over HTTP/1.0 on a loopback port
/// until the test process ends; any other path is a 404. Returns the port. For `image.import`
/// from a URL: the port goes into the daemon's `[images] download_ports` before it starts.
pub fn serve_http(files: Vec<(String, PathBuf)>) -> u16 {
    serve_routes("127.0.0.1", files.into_iter().map(|(p, f)| (p, Reply::File(f))).collect()).port
}

/// What [`serve_routes`] answers on a path.
#[derive(Debug, Clone)]
pub enum Reply {
    /// 200 with the file's content.
    File(PathBuf),
    /// 302 to this `Location`.
    Redirect(String),
    /// 200 with the file's content, of which only the first half until the flag is set.
    Held(PathBuf, std::sync::Arc<std::sync::atomic::AtomicBool>),
}

/// A server of [`serve_routes`].
#[derive(Debug, Clone)]
pub struct Served {
    /// Its port.
    pub port: u16,
    /// Every request target it got (path and query), in order.
    pub requests: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Served {
    /// The request targets so far.
    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

/// Serves `routes` (URL path without the query → reply) over HTTP/1.0 on `addr` (a loopback
/// address: 127.0.0.1, 127.0.0.2, ...) on a new port until the test process ends; any other
/// path is a 404.
pub fn serve_routes(addr: &str, routes: Vec<(String, Reply)>) -> Served {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind((addr, 0)).expect("bind a loopback port");
    let port = listener.local_addr().expect("local address").port();
    let files = std::sync::Arc::new(routes);
    let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = std::sync::Arc::clone(&requests);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let files = std::sync::Arc::clone(&files);
            let log = std::sync::Arc::clone(&log);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(&stream);
                let mut request = String::new();
                if reader.read_line(&mut request).is_err() {
                    return;
                }
                // The headers, up to the empty line.
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    line.clear();
                }
                let target = request.split_whitespace().nth(1).unwrap_or("").to_string();
                if let Ok(mut l) = log.lock() {
                    l.push(target.clone());
                }
                let path = target.split('?').next().unwrap_or("");
                let mut out = &stream;
                let send =
                    |out: &mut &std::net::TcpStream, file: &Path, held: Option<&std::sync::atomic::AtomicBool>| {
                        let data = fs::read(file)?;
                        out.write_all(format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", data.len()).as_bytes())?;
                        let half = if held.is_some() { data.len() / 2 } else { data.len() };
                        out.write_all(&data[..half])?;
                        out.flush()?;
                        // Waiting for the test's go, not for time: the flag is set once it looked.
                        while held.is_some_and(|h| !h.load(std::sync::atomic::Ordering::SeqCst)) {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        out.write_all(&data[half..])
                    };
                let _ = match files.iter().find(|(p, _)| p == path).map(|(_, r)| r) {
                    Some(Reply::File(f)) => send(&mut out, f, None),
                    Some(Reply::Held(f, flag)) => send(&mut out, f, Some(flag)),
                    Some(Reply::Redirect(to)) => out.write_all(
                        format!("HTTP/1.0 302 Found\r\nLocation: {to}\r\nContent-Length: 5\r\n\r\nmoved").as_bytes(),
                    ),
                    None => out.write_all(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n"),
                };
            });
        }
    });
    Served { port, requests }
}

/// The sha256 of the file at `path`, lower-case hex (sha256sum).
pub fn sha256_file(path: &Path) -> String {
    let out = run_ok(Command::new("sha256sum").arg(path));
    out.split_whitespace().next().unwrap_or_default().to_string()
}

/// The sha256 of `data`, lower-case hex (sha256sum).
pub fn sha256_hex(data: &[u8]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("data");
    fs::write(&file, data).expect("write");
    sha256_file(&file)
}

/// A direct-kernel guest reporting its disks (`vmhost.disks`), with `disks` and extra kernel
/// arguments (`vmhost.writemark=SERIAL:WORD` writes WORD to that disk first).
pub fn disk_spec(host: &TestHost, name: &str, disks: Value, extra_cmdline: &str) -> Value {
    let mut spec = host.kernel_spec(name);
    let cmdline = format!("{} vmhost.disks {extra_cmdline}", spec["boot"]["cmdline"].as_str().unwrap_or_default());
    spec["boot"]["cmdline"] = serde_json::json!(cmdline.trim());
    spec["disks"] = disks;
    spec
}

/// Waits up to `timeout` for the guest's `boot`-th disk report (1-based) and returns its lines
/// as `(dev, serial, sectors, mark)`.
pub fn disk_report(host: &TestHost, name: &str, boot: usize, timeout: Duration) -> Vec<(String, String, u64, String)> {
    let marker = "VMHOST-GUEST-READY";
    wait::until(&format!("{name}'s disk report of boot {boot}"), timeout, || {
        let log = host.serial(name);
        let boots: Vec<&str> = log.split(marker).skip(1).collect();
        // The guest prints its report after READY and ends it with VMHOST-DISKS-DONE.
        let section = boots.get(boot.wrapping_sub(1)).filter(|s| s.contains("VMHOST-DISKS-DONE"));
        let Some(section) = section else { return Err(format!("serial:\n{log}")) };
        Ok(section
            .lines()
            .filter_map(|l| l.trim().strip_prefix("VMHOST-DISK "))
            .filter_map(|l| {
                let mut parts = l.split_whitespace();
                let dev = parts.next()?.to_string();
                let serial = parts.next()?.strip_prefix("serial=")?.to_string();
                let sectors = parts.next()?.strip_prefix("sectors=")?.parse().ok()?;
                let mark = parts.next()?.strip_prefix("mark=")?.to_string();
                Some((dev, serial, sectors, mark))
            })
            .collect())
    })
}

/// The TPM reset counts the test guest printed on `host` for VM `name` (`VMHOST-TPM present
/// reset_count=N`, one per boot, in order): a count that goes on across boots, restarts, moves
/// and imports shows the same TPM state.
pub fn tpm_reset_counts(host: &TestHost, name: &str) -> Vec<u64> {
    host.serial(name)
        .lines()
        .filter_map(|l| l.split("VMHOST-TPM present reset_count=").nth(1))
        .map(|n| n.trim().parse().unwrap_or_else(|_| panic!("an unreadable TPM answer: {n}")))
        .collect()
}
