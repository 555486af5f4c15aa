//! The daemon's sandbox (config `sandbox`, docs/sandbox.md).
//!
//! [`enter`] runs once at start, after the config is loaded and logging is set up and **before
//! the async runtime exists**, because capabilities, Landlock and seccomp apply to the calling
//! thread and are inherited only by threads created afterwards. In this order:
//!
//! 1. [`env`]: clear the environment and close stray descriptors (nothing inherited leaks into
//!    the daemon or what it starts);
//! 2. create the state, run and socket directories, and with passthrough configured load
//!    vfio-pci (Landlock rules need existing paths);
//! 3. set no_new_privs (needed for Landlock and seccomp without CAP_SYS_ADMIN, and no execve
//!    can gain privileges afterwards);
//! 4. [`spawn`]: fork the spawner, which confines itself ([`caps::spawner_caps`],
//!    [`landlock::spawner_rules`], no seccomp of its own) and then only starts the allowlisted
//!    programs, each but the image download under [`child_seccomp`] (no IP socket);
//! 5. [`caps`]: the daemon drops to CAP_NET_ADMIN and CAP_KILL, plus CAP_SYS_NICE when
//!    `[hardware] vm_cpus` is configured ([`caps::daemon_caps`]) (all five sets, securebits
//!    locked); VFIO group nodes are handed to QEMU by the spawner ([`spawn::vfio_node`]);
//! 6. [`landlock`]: the daemon's file rules ([`landlock::daemon_rules`]), no TCP;
//! 7. [`seccomp`]: the daemon's syscall table, last, so the steps before need no syscall the
//!    table lacks.
//!
//! With `require` any layer that cannot be put in force stops the start; with `best-effort` the
//! missing layers are logged and [`report`] shows them in `host.check`; with `off` nothing
//! happens and programs are started in-process as before. The spawner is never optional when
//! the sandbox is on: the daemon's filter has no execve.

pub mod caps;
pub mod child_seccomp;
pub mod env;
pub mod landlock;
#[cfg(debug_assertions)]
mod probe;
pub mod report;
pub mod seccomp;
pub mod socket;
pub mod spawn;

use crate::config::{Config, SandboxMode};
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

/// Why the sandbox could not be entered.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// A directory the rules name could not be created.
    #[error("sandbox: cannot create {path}: {source}")]
    Dir {
        /// The directory.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// The spawner process could not be started or did not confine itself.
    #[error("sandbox: spawner: {0}")]
    Spawner(String),
    /// A layer is not in force and `sandbox = "require"`.
    #[error("sandbox = \"require\" but {layer} is not in force: {reason}")]
    Required {
        /// `capabilities`, `no_new_privs`, `landlock`, `seccomp` or `environment`.
        layer: &'static str,
        /// What went wrong.
        reason: String,
    },
}

/// What [`enter`] put in force (the report's source).
#[derive(Debug, Clone, Default)]
pub struct State {
    /// The configured mode.
    pub mode: Option<SandboxMode>,
    /// no_new_privs was set.
    pub no_new_privs: bool,
    /// Variables removed from the environment.
    pub env_removed: usize,
    /// Descriptors closed.
    pub fds_closed: usize,
    /// The daemon's capability drop: `Ok(())` or the reason it failed.
    pub caps: Option<Result<(), String>>,
    /// The daemon's Landlock outcome or why it failed.
    pub landlock: Option<Result<landlock::Outcome, String>>,
    /// seccomp: the number of allowed syscalls or why it failed.
    pub seccomp: Option<Result<usize, String>>,
    /// The spawner's pid.
    pub spawner_pid: Option<i32>,
    /// The spawner's own report (capabilities and Landlock), as it sent it.
    pub spawner: Option<SpawnerReport>,
}

/// What the spawner reports after confining itself.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct SpawnerReport {
    /// Capability drop: empty when it worked, else the error.
    pub caps_error: String,
    /// Landlock status (`fully enforced`, ...) or the error.
    pub landlock: String,
    /// True when Landlock restricts the spawner.
    pub landlock_enforced: bool,
}

static STATE: OnceLock<State> = OnceLock::new();

/// What the sandbox put in force (default: nothing, e.g. in unit tests).
pub fn state() -> State {
    STATE.get().cloned().unwrap_or_default()
}

fn required(mode: SandboxMode, layer: &'static str, reason: String) -> Result<(), SandboxError> {
    if mode == SandboxMode::Require {
        return Err(SandboxError::Required { layer, reason });
    }
    tracing::warn!(layer, %reason, "sandbox layer not in force (best-effort)");
    Ok(())
}

/// Puts the sandbox in force for `config.sandbox` (see the module doc for the order).
///
/// Must be called while the process has a single thread.
///
/// # Errors
/// [`SandboxError`]: the spawner could not start, a directory could not be created, or (with
/// `require`) a layer is not in force. The daemon must not start then.
pub fn enter(config: &Config) -> Result<(), SandboxError> {
    let mode = config.sandbox;
    let mut st = State { mode: Some(mode), ..State::default() };
    if mode == SandboxMode::Off {
        tracing::warn!("sandbox = \"off\": running with every privilege vmhostd was started with");
        let _ = STATE.set(st);
        return Ok(());
    }
    #[cfg(debug_assertions)]
    let probe = probe::requested();
    // Test variables read later are read now, before the environment goes.
    crate::net::vhost::capture_test_override();

    // 1. Environment and descriptors.
    let keep = env::activation_fds(
        std::env::var("LISTEN_PID").ok().as_deref(),
        std::env::var("LISTEN_FDS").ok().as_deref(),
        std::process::id(),
    );
    st.env_removed = env::clear_env();
    match env::close_stray_fds(keep) {
        Ok(closed) => st.fds_closed = closed.len(),
        Err(e) => required(mode, "environment", format!("cannot list /proc/self/fd: {e}"))?,
    }

    // 2. Directories.
    // Modes given, not left to the umask: under umask 0 the socket's directory would be 0777,
    // which the server then refuses (rpc::socket_dir); the state's subdirectories are private.
    let p = &config.paths;
    let private = crate::state::dirs::PRIVATE.iter().map(|d| (p.state.join(d), crate::state::dirs::MODE));
    let mut dirs = vec![(p.state.clone(), 0o755), (p.run.clone(), 0o755)];
    dirs.extend(private);
    dirs.extend(p.socket.parent().map(|d| (d.to_path_buf(), 0o755)));
    for (d, mode) in dirs {
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), mode)
            .create(&d)
            .map_err(|source| SandboxError::Dir { path: d.display().to_string(), source })?;
    }

    // With passthrough configured, vfio-pci now, while the daemon may still run modprobe itself:
    // Landlock grants its bind and unbind files by name, and they exist only once it is loaded.
    let vfio_pci = std::path::Path::new("/sys/bus/pci/drivers").join(crate::pci::VFIO_PCI);
    if landlock::passthrough(config) && !vfio_pci.exists() {
        if let Err(e) = crate::pci::load_vfio_pci() {
            tracing::warn!(error = %e, "cannot load vfio-pci at start; passthrough cannot unbind from it until a restart");
        }
    }

    // 3. no_new_privs.
    match env::set_no_new_privs() {
        Ok(()) => st.no_new_privs = true,
        Err(e) => required(mode, "no_new_privs", e.to_string())?,
    }

    // 4. The spawner.
    let (pid, report) = start_spawner(config)?;
    st.spawner_pid = Some(pid);
    if !report.caps_error.is_empty() {
        required(mode, "capabilities", format!("spawner: {}", report.caps_error))?;
    }
    if !report.landlock_enforced {
        required(mode, "landlock", format!("spawner: {}", report.landlock))?;
    }
    st.spawner = Some(report);

    // 5. Capabilities.
    let pinning = config.hardware.vm_cpus.is_some();
    let keep: Vec<::caps::Capability> = caps::daemon_caps(pinning).iter().map(|(c, _)| *c).collect();
    match caps::restrict(&keep, &[]) {
        Ok(()) => st.caps = Some(Ok(())),
        Err(e) => {
            st.caps = Some(Err(e.to_string()));
            required(mode, "capabilities", e.to_string())?;
        }
    }

    // 6. Landlock.
    let pci_files = if landlock::passthrough(config) {
        landlock::pci_write_files(&landlock::pci_device_dirs(config), &landlock::recorded_original_drivers(config))
    } else {
        Vec::new()
    };
    let rules = landlock::daemon_rules(config, &pci_files);
    match landlock::apply(&rules, &landlock::daemon_tcp(config)) {
        Ok(outcome) if outcome.enforced() => st.landlock = Some(Ok(outcome)),
        Ok(outcome) => {
            let reason = format!("the kernel has no Landlock (ABI {})", outcome.kernel_abi);
            st.landlock = Some(Err(reason.clone()));
            required(mode, "landlock", reason)?;
        }
        Err(e) => {
            st.landlock = Some(Err(e.to_string()));
            required(mode, "landlock", e.to_string())?;
        }
    }

    // 7. seccomp.
    match seccomp::apply(config.seccomp) {
        Ok(n) => st.seccomp = Some(Ok(n)),
        Err(e) => {
            st.seccomp = Some(Err(e.to_string()));
            required(mode, "seccomp", e.to_string())?;
        }
    }
    tracing::info!(
        mode = mode.as_str(),
        caps = %caps::CapSets::of_self().describe(),
        landlock = ?st.landlock,
        seccomp = config.seccomp.as_str(),
        spawner = pid,
        "sandbox in force"
    );
    let _ = STATE.set(st);
    #[cfg(debug_assertions)]
    if let Some((outside, opens)) = probe {
        probe::run(&outside, &opens);
    }
    Ok(())
}

/// Adds the primary group of `qemu.user` to the calling process's supplementary groups (nothing
/// when QEMU runs as root or the config was not loaded from a file).
fn join_qemu_group(config: &Config) -> nix::Result<()> {
    let Some(user) = config.qemu_user.filter(|u| u.uid != 0) else { return Ok(()) };
    let gid = nix::unistd::Gid::from_raw(user.gid);
    let mut groups = nix::unistd::getgroups()?;
    if !groups.contains(&gid) {
        groups.push(gid);
        nix::unistd::setgroups(&groups)?;
    }
    Ok(())
}

/// Forks the spawner and waits for its report.
fn start_spawner(config: &Config) -> Result<(i32, SpawnerReport), SandboxError> {
    let (daemon_end, spawner_end) = spawn::control_pair().map_err(|e| SandboxError::Spawner(e.to_string()))?;
    let parent = std::process::id();
    // SAFETY: the process has a single thread here (see `enter`), so the child may run any code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(SandboxError::Spawner(format!("fork: {}", std::io::Error::last_os_error())));
    }
    if pid == 0 {
        drop(daemon_end);
        spawner_main(config, spawner_end, parent);
    }
    drop(spawner_end);
    // The spawner's first message is its report.
    let mut buf = vec![0u8; 4096];
    // SAFETY: recv into our buffer from our socket.
    let n = unsafe { libc::recv(daemon_end.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    let n = usize::try_from(n).map_err(|_| SandboxError::Spawner(std::io::Error::last_os_error().to_string()))?;
    if n == 0 {
        return Err(SandboxError::Spawner("it exited before reporting".into()));
    }
    let report: SpawnerReport =
        serde_json::from_slice(&buf[..n]).map_err(|e| SandboxError::Spawner(format!("bad report: {e}")))?;
    spawn::install(daemon_end).map_err(|e| SandboxError::Spawner(e.to_string()))?;
    Ok((pid, report))
}

/// The spawner process: confine, report, serve. Never returns.
fn spawner_main(config: &Config, control: std::os::fd::OwnedFd, parent: u32) -> ! {
    // SAFETY: prctl with integer arguments: die with the daemon.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } as u32 != parent {
        std::process::exit(0);
    }
    // Nothing but the control socket: not the listening socket systemd passed (the daemon
    // serves it; a spawner outliving the daemon must not keep it open), not the log.
    let own = control.as_raw_fd();
    let _ = env::close_stray_fds(own..own + 1);
    let passthrough = landlock::passthrough(config);
    let mut report = SpawnerReport::default();
    // With passthrough, the spawner joins the group of qemu.user (with CAP_SETGID, before the
    // drop): as owner of a VFIO group node (the kernel makes them root's) and a member of that
    // group it may give the node to it without CAP_CHOWN, which a service manager's bounding
    // set may lack. Programs it starts as qemu.user get their own groups (become_user).
    if passthrough {
        if let Err(e) = join_qemu_group(config) {
            report.caps_error = format!("cannot join the group of qemu.user: {e}");
        }
    }
    let keep: Vec<::caps::Capability> = caps::spawner_caps(passthrough).iter().map(|(c, _)| *c).collect();
    let inheritable: Vec<::caps::Capability> =
        if passthrough { vec![::caps::Capability::CAP_SYS_MODULE] } else { Vec::new() };
    if let Err(e) = caps::restrict(&keep, &inheritable) {
        report.caps_error = e.to_string();
    }
    // Permitted, not effective: raised only while a boot file is opened.
    let _ = ::caps::drop(None, ::caps::CapSet::Effective, ::caps::Capability::CAP_DAC_READ_SEARCH);
    // Likewise, only while a VFIO group node changes group.
    let _ = ::caps::drop(None, ::caps::CapSet::Effective, ::caps::Capability::CAP_CHOWN);
    match landlock::apply(
        &landlock::spawner_rules(config),
        &landlock::Tcp { bind: Vec::new(), connect: Some(config.images.download_ports.clone()) },
    ) {
        Ok(o) => {
            report.landlock_enforced = o.enforced();
            report.landlock = format!("{} (kernel ABI {}, {} rules)", o.status, o.kernel_abi, o.rules);
        }
        Err(e) => report.landlock = e.to_string(),
    }
    let text = serde_json::to_vec(&report).unwrap_or_default();
    // SAFETY: send from our buffer on our socket.
    unsafe { libc::send(control.as_raw_fd(), text.as_ptr().cast(), text.len(), libc::MSG_NOSIGNAL) };
    let allow = allowlist(config);
    spawn::serve(control, &allow, passthrough)
}

/// What the spawner may do for `config`: start the QEMU binary and swtpm (a VM's TPM,
/// [`crate::tpm`]), both as `qemu.user`, `modprobe vfio-pci` and hand VFIO group nodes over
/// when passthrough is configured. Nothing else: image files are worked on by the QEMU binary
/// too ([`crate::disk`]), so `qemu-img` never runs.
pub fn allowlist(config: &Config) -> spawn::Allowlist {
    let passthrough = landlock::passthrough(config);
    spawn::Allowlist {
        programs: vec![config.qemu.binary.clone(), config.qemu.swtpm.clone()],
        modprobe: passthrough,
        // QEMU first: the /dev/kvm probe runs as the first entry's user.
        run_as: config
            .qemu_user
            .map(|u| {
                vec![(config.qemu.binary.clone(), u), (config.images.curl.clone(), u), (config.qemu.swtpm.clone(), u)]
            })
            .unwrap_or_default(),
        kvm: config.qemu.accel == crate::config::Accel::Kvm,
        vfio_nodes: passthrough,
        boot_dirs: config.paths.boot_dirs(),
        fetch: Some(config.images.curl.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spawner_runs_only_qemu_as_its_user_and_never_qemu_img() {
        let mut c = crate::validate::tests::config();
        c.qemu_user = Some(crate::config::UserIds { uid: 4242, gid: 4242 });
        let allow = allowlist(&c);
        let img = std::path::Path::new("/usr/bin/qemu-img");
        for args in [vec!["info".to_string(), "/etc/shadow".into()], vec!["--version".into()], vec![]] {
            assert!(!allow.permits(img, &args, None), "{args:?}");
        }
        assert!(allow.permits(&c.qemu.binary, &["-version".into()], None));
        assert_eq!(allow.user_for(&c.qemu.binary), c.qemu_user);
        // curl fetches images, as QEMU's user, with the arguments and config the daemon makes only.
        let args = crate::images::download::curl_args(std::time::Duration::from_secs(9), 1 << 30);
        let config = "url = \"https://example.org/i.qcow2\"\nconnect-to = \"::93.184.216.34:443\"\n";
        assert!(allow.permits(&c.images.curl, &args, Some(config)));
        assert!(!allow.permits(&c.images.curl, &args, None));
        assert!(!allow.permits(&c.images.curl, &["-o".into(), "/etc/passwd".into(), "http://x/".into()], None));
        assert_eq!(allow.user_for(&c.images.curl), c.qemu_user);
        // swtpm (a VM's TPM) runs as QEMU's user too, never as the spawner's.
        assert!(allow.permits(&c.qemu.swtpm, &["--version".into()], None));
        assert_eq!(allow.user_for(&c.qemu.swtpm), c.qemu_user);
    }
}
