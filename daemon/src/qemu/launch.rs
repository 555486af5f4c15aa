//! Starting a daemonized QEMU and learning which process became the VM.
//!
//! QEMU is started with `-daemonize -pidfile PATH`, so the VM never is the daemon's child and
//! keeps running when the daemon stops or restarts. What the daemon spawns is only the
//! *foreground* QEMU: it forks, the child calls `setsid()` and forks again, and the grandchild
//! (the VM) writes the pidfile, initializes the machine, points its stdin, stdout and stderr at
//! `/dev/null` (stderr only if no `-D` log file is given) and then tells the foreground process,
//! which exits 0. If initialization fails, the grandchild prints the reason on the inherited
//! stderr and exits; the foreground process exits 1.
//!
//! [`launch`] therefore:
//!
//! 1. checks the request and removes a stale pidfile (a VM killed with SIGKILL leaves one);
//! 2. spawns the foreground process with stdin and stdout on `/dev/null` and stderr on a pipe;
//! 3. waits, bounded by the request's timeout, for it to exit, collecting the last
//!    [`STDERR_TAIL`] bytes of stderr;
//! 4. on exit 0 reads the pidfile, identifies the pid ([`process::identify`]) and checks that
//!    the process is alive and has this pidfile on its command line.
//!
//! On every failure path, including the caller dropping the future, the foreground process is
//! killed (tokio's `kill_on_drop`) and a VM process that the pidfile names, if it is alive and
//! has the pidfile path in its command line, gets SIGKILL: a failed launch leaves no process.
//! A grandchild that fails *before* writing the pidfile exits by itself.
//!
//! The spawned process inherits only stdio and the daemon's descriptors that lack close-on-exec.
//! Everything Rust's standard library and tokio open is close-on-exec; descriptors the daemon
//! itself inherited without it would leak into QEMU (and stay open for the VM's lifetime). This
//! module does not close them, because a caller may want to hand QEMU a descriptor on purpose
//! (e.g. a tap device with `-netdev tap,fd=N`).

use std::ffi::OsString;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::AsyncReadExt;
use tokio::time::Instant;

use crate::process::{self, ProcessIdentity};
use crate::sandbox::spawn::{self, Child, Pipe};

/// How many bytes at the end of QEMU's stderr are kept for errors.
pub const STDERR_TAIL: usize = 4096;

/// How long the pidfile is looked for after the foreground process exited 0.
const PIDFILE_WAIT: Duration = Duration::from_secs(1);

/// Pause between pidfile reads.
const PIDFILE_RETRY: Duration = Duration::from_millis(20);

/// How long stderr is still read after the foreground process exited. The grandchild normally
/// has closed it by then; with `-D` it keeps it open for good, so this must be bounded.
const STDERR_DRAIN: Duration = Duration::from_millis(200);

/// What to start.
#[derive(Debug)]
pub struct LaunchRequest {
    /// The QEMU binary, e.g. `/usr/bin/qemu-system-x86_64`.
    pub binary: PathBuf,
    /// The arguments after the binary. Must include `-daemonize` and `-pidfile` followed by
    /// exactly [`LaunchRequest::pidfile`].
    pub argv: Vec<OsString>,
    /// Absolute path of the pidfile QEMU writes.
    pub pidfile: PathBuf,
    /// Bound on the whole launch, from spawn to an identified VM process.
    pub timeout: Duration,
    /// File descriptors QEMU inherits (tap devices): `fds[i]` becomes fd
    /// [`FIRST_PASSED_FD`]` + i` in QEMU, which the argv names (`-netdev tap,fd=N`). This is how
    /// QEMU uses a tap without CAP_NET_ADMIN.
    pub fds: Vec<OwnedFd>,
    /// RLIMIT_MEMLOCK for QEMU in bytes: VFIO pins all guest RAM, so a VM with passthrough
    /// devices needs at least its memory size.
    pub memlock: Option<u64>,
}

const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process has `cap` in its effective set (from /proc/self/status).
fn has_capability(cap: u32) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|bits| bits & (1u64 << cap) != 0)
}

/// The fd number the first of [`LaunchRequest::fds`] gets in QEMU.
pub use crate::sandbox::spawn::FIRST_PASSED_FD;

/// Why a launch failed. After any of these no process of the launch is left running.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The request is inconsistent: the pidfile is not absolute, or `argv` lacks `-daemonize`
    /// or `-pidfile PIDFILE`. Nothing was started.
    #[error("bad launch request: {0}")]
    BadRequest(String),
    /// The binary could not be executed (missing, not executable, ...), or waiting for it failed.
    #[error("cannot run QEMU: {0}")]
    Spawn(#[source] io::Error),
    /// QEMU exited with an error before the VM was up; its reason is in the stderr tail.
    #[error("QEMU exited with {status}: {stderr_tail}")]
    Exited {
        /// Exit status of the foreground QEMU process.
        status: ExitStatus,
        /// The last bytes of its stderr (lossy UTF-8).
        stderr_tail: String,
    },
    /// QEMU did not finish initializing within the timeout and was killed.
    #[error("QEMU did not start within {after:?}; stderr: {stderr_tail}")]
    Timeout {
        /// The timeout of the request.
        after: Duration,
        /// The last bytes of stderr so far (lossy UTF-8).
        stderr_tail: String,
    },
    /// QEMU reported success but the pidfile is missing, does not hold a pid, or names a
    /// process that is not this launch's QEMU.
    #[error("QEMU pidfile: {0}")]
    Pidfile(String),
    /// The pid from the pidfile could not be looked up in `/proc`.
    #[error("cannot identify the started QEMU: {0}")]
    Identify(#[source] io::Error),
}

impl LaunchError {
    /// QEMU's stderr tail, for the variants that have one.
    pub fn stderr_tail(&self) -> Option<&str> {
        match self {
            LaunchError::Exited { stderr_tail, .. } | LaunchError::Timeout { stderr_tail, .. } => Some(stderr_tail),
            _ => None,
        }
    }
}

/// Starts a daemonized QEMU and returns the identity of the VM process.
///
/// # Errors
/// See [`LaunchError`]; each variant says when it happens. Whatever the error, no process
/// started by this call keeps running.
pub async fn launch(req: &LaunchRequest) -> Result<ProcessIdentity, LaunchError> {
    check_request(req)?;
    match std::fs::remove_file(&req.pidfile) {
        Ok(()) => tracing::debug!(pidfile = %req.pidfile.display(), "removed stale pidfile"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(LaunchError::Pidfile(format!("cannot remove stale {}: {e}", req.pidfile.display())));
        }
    }
    let deadline = Instant::now() + req.timeout;

    if req.fds.len() > spawn::MAX_PASSED_FDS {
        return Err(LaunchError::BadRequest(format!(
            "{} fds to pass; at most {}",
            req.fds.len(),
            spawn::MAX_PASSED_FDS
        )));
    }
    let fds = req.fds.iter().map(OwnedFd::try_clone).collect::<io::Result<Vec<_>>>().map_err(LaunchError::Spawn)?;
    let memlock = req.memlock;
    if let Some(bytes) = memlock {
        let mut cur = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes into the struct we pass.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut cur) } == 0;
        // With a spawner, the spawner has CAP_SYS_RESOURCE (docs/sandbox.md).
        if ok && cur.rlim_max < bytes && !spawn::has_spawner() && !has_capability(CAP_SYS_RESOURCE) {
            tracing::warn!(
                wanted = bytes,
                hard_limit = cur.rlim_max,
                "cannot raise QEMU's RLIMIT_MEMLOCK without CAP_SYS_RESOURCE; VFIO needs CAP_IPC_LOCK then"
            );
        }
    }
    // Raising the hard limit needs CAP_SYS_RESOURCE. Without it (EPERM) the limit stays as it
    // is and QEMU relies on CAP_IPC_LOCK, as a root QEMU has; the daemon logs that above.
    let command =
        spawn::Command::new(&req.binary).args(req.argv.iter().cloned()).capture_stderr().pass_fds(fds).memlock(memlock);
    let mut child = command.spawn().await.map_err(LaunchError::Spawn)?;
    // From here on, any early return (or the caller dropping us) kills what the pidfile names.
    let mut cleanup = KillFromPidfile { pidfile: &req.pidfile, armed: true };
    let mut stderr =
        child.stderr.take().ok_or_else(|| LaunchError::Spawn(io::Error::other("QEMU's stderr was not captured")))?;
    let mut tail = Vec::new();

    let waited = tokio::time::timeout_at(deadline, wait_foreground(&mut child, &mut stderr, &mut tail)).await;
    let status = match waited {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => return Err(LaunchError::Spawn(e)),
        Err(_) => {
            // Kill and reap the foreground process; the guard kills the VM process.
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(1), child.wait()).await;
            drain(&mut stderr, &mut tail).await;
            return Err(LaunchError::Timeout {
                after: req.timeout,
                stderr_tail: process::lossy_tail(&tail, STDERR_TAIL),
            });
        }
    };
    drain(&mut stderr, &mut tail).await;
    let stderr_tail = process::lossy_tail(&tail, STDERR_TAIL);
    if !status.success() {
        return Err(LaunchError::Exited { status, stderr_tail });
    }
    if !stderr_tail.is_empty() {
        tracing::warn!(pidfile = %req.pidfile.display(), stderr = %stderr_tail,
            "QEMU started with messages on stderr");
    }

    let pid = read_pidfile(&req.pidfile, (Instant::now() + PIDFILE_WAIT).min(deadline)).await?;
    let identity = process::identify(pid).map_err(LaunchError::Identify)?;
    if !process::matches(&identity, req.pidfile.as_os_str()) {
        return Err(LaunchError::Pidfile(format!(
            "pid {pid} from {} is not a running QEMU with that pidfile (it exited at once?)",
            req.pidfile.display()
        )));
    }
    cleanup.armed = false;
    Ok(identity)
}

/// Rejects requests that would not daemonize or not write the pidfile we read back.
fn check_request(req: &LaunchRequest) -> Result<(), LaunchError> {
    if !req.pidfile.is_absolute() {
        return Err(LaunchError::BadRequest(format!("pidfile {} is not an absolute path", req.pidfile.display())));
    }
    let is = |arg: &OsString, name: &str| {
        arg.to_str().is_some_and(|a| a.strip_prefix('-') == Some(name) || a.strip_prefix("--") == Some(name))
    };
    if !req.argv.iter().any(|a| is(a, "daemonize")) {
        return Err(LaunchError::BadRequest("argv lacks -daemonize".to_string()));
    }
    let has_pidfile = req.argv.windows(2).any(|w| is(&w[0], "pidfile") && w[1] == req.pidfile.as_os_str());
    if !has_pidfile {
        return Err(LaunchError::BadRequest(format!("argv lacks -pidfile {}", req.pidfile.display())));
    }
    Ok(())
}

/// Waits for the foreground process to exit while collecting its stderr into `tail`.
async fn wait_foreground(child: &mut Child, stderr: &mut Pipe, tail: &mut Vec<u8>) -> io::Result<ExitStatus> {
    let mut buf = [0u8; 4096];
    let mut open = true;
    loop {
        tokio::select! {
            status = child.wait() => return status,
            read = stderr.read(&mut buf), if open => match read {
                Ok(0) => open = false,
                Ok(n) => push_tail(tail, &buf[..n]),
                Err(e) => {
                    tracing::debug!(error = %e, "reading QEMU's stderr failed");
                    open = false;
                }
            },
        }
    }
}

/// Reads what is left on stderr, until end of file or [`STDERR_DRAIN`].
async fn drain(stderr: &mut Pipe, tail: &mut Vec<u8>) {
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(STDERR_DRAIN, async {
        while let Ok(n) = stderr.read(&mut buf).await {
            if n == 0 {
                break;
            }
            push_tail(tail, &buf[..n]);
        }
    })
    .await;
}

/// Appends to `tail`, keeping at most [`STDERR_TAIL`] bytes.
fn push_tail(tail: &mut Vec<u8>, bytes: &[u8]) {
    tail.extend_from_slice(bytes);
    if tail.len() > STDERR_TAIL {
        let excess = tail.len() - STDERR_TAIL;
        tail.drain(..excess);
    }
}

/// Reads the pid from `pidfile`, retrying while it is absent or empty, until `until` (at least
/// one attempt).
async fn read_pidfile(pidfile: &Path, until: Instant) -> Result<i32, LaunchError> {
    loop {
        let problem = match tokio::fs::read_to_string(pidfile).await {
            Ok(text) if !text.trim().is_empty() => {
                return match text.trim().parse::<i32>() {
                    Ok(pid) if pid > 0 => Ok(pid),
                    _ => Err(LaunchError::Pidfile(format!(
                        "{} does not hold a pid: {:?}",
                        pidfile.display(),
                        text.chars().take(40).collect::<String>()
                    ))),
                };
            }
            Ok(_) => format!("{} is empty", pidfile.display()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                format!("QEMU reported success but wrote no {}", pidfile.display())
            }
            Err(e) => {
                return Err(LaunchError::Pidfile(format!("cannot read {}: {e}", pidfile.display())));
            }
        };
        if Instant::now() + PIDFILE_RETRY > until {
            return Err(LaunchError::Pidfile(problem));
        }
        tokio::time::sleep(PIDFILE_RETRY).await;
    }
}

/// On drop, while armed, SIGKILLs the process the pidfile names if it is alive and has the
/// pidfile path on its command line (so a stale or foreign pid is never hit).
struct KillFromPidfile<'a> {
    /// The launch's pidfile.
    pidfile: &'a Path,
    /// Cleared once the launch succeeded.
    armed: bool,
}

impl Drop for KillFromPidfile<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(text) = std::fs::read_to_string(self.pidfile) else {
            return;
        };
        let Ok(pid) = text.trim().parse::<i32>() else {
            return;
        };
        let Ok(identity) = process::identify(pid) else {
            return;
        };
        match process::signal_if_matches(&identity, self.pidfile.as_os_str(), Signal::SIGKILL) {
            Ok(true) => tracing::warn!(pid, pidfile = %self.pidfile.display(),
                "killed the QEMU of a failed launch"),
            Ok(false) => {}
            Err(e) => tracing::error!(pid, error = %e,
                "cannot kill the QEMU of a failed launch"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qemu::qmp::Qmp;
    use std::os::unix::ffi::OsStrExt;

    /// A tempdir with the pidfile and QMP socket paths of one test VM.
    struct Paths {
        _dir: tempfile::TempDir,
        pidfile: PathBuf,
        sock: PathBuf,
    }

    fn paths() -> Paths {
        let dir = tempfile::tempdir().unwrap();
        Paths { pidfile: dir.path().join("qemu.pid"), sock: dir.path().join("qmp.sock"), _dir: dir }
    }

    /// A TCG VM without disks; `extra` goes before `-daemonize`.
    fn request(p: &Paths, extra: &[&str], qmp_wait: bool) -> LaunchRequest {
        let mut argv: Vec<OsString> = ["-accel", "tcg", "-M", "q35", "-m", "64", "-nodefaults", "-display", "none"]
            .iter()
            .map(OsString::from)
            .collect();
        argv.extend(extra.iter().map(OsString::from));
        let mut qmp = OsString::from("unix:");
        qmp.push(&p.sock);
        qmp.push(if qmp_wait { ",server=on,wait=on" } else { ",server=on,wait=off" });
        argv.extend(["-qmp".into(), qmp, "-daemonize".into(), "-pidfile".into(), p.pidfile.clone().into()]);
        LaunchRequest {
            binary: PathBuf::from("/usr/bin/qemu-system-x86_64"),
            argv,
            pidfile: p.pidfile.clone(),
            timeout: Duration::from_secs(20),
            fds: Vec::new(),
            memlock: None,
        }
    }

    /// Live processes with `needle` in one of their arguments.
    fn processes_mentioning(needle: &Path) -> Vec<i32> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(args) = process::cmdline(pid) else {
                continue;
            };
            let hit = args
                .iter()
                .any(|a| a.as_bytes().windows(needle.as_os_str().len()).any(|w| w == needle.as_os_str().as_bytes()));
            if hit && process::liveness(pid).is_alive() {
                found.push(pid);
            }
        }
        found
    }

    /// Waits up to 2 s for no live process to mention `needle`.
    async fn assert_no_process_mentions(needle: &Path) {
        for _ in 0..100 {
            if processes_mentioning(needle).is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("processes left behind: {:?}", processes_mentioning(needle));
    }

    #[tokio::test]
    async fn good_launch_returns_the_live_vm_process() {
        let p = paths();
        // A stale pidfile naming a live process that is not ours to touch.
        std::fs::write(&p.pidfile, format!("{}\n", std::process::id())).unwrap();
        let id = launch(&request(&p, &[], false)).await.unwrap();

        assert_ne!(id.pid, std::process::id() as i32);
        assert!(process::liveness(id.pid).is_alive());
        assert_eq!(process::identify(id.pid).unwrap(), id);
        let args = process::cmdline(id.pid).unwrap();
        assert!(args.iter().any(|a| a == p.pidfile.as_os_str()), "{args:?}");
        assert!(process::matches(&id, p.sock.as_os_str()));
        let recorded: i32 = std::fs::read_to_string(&p.pidfile).unwrap().trim().parse().unwrap();
        assert_eq!(recorded, id.pid);
        // Daemonized: not our child; its parent is whoever adopts orphans.
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", id.pid)).unwrap();
        let ppid: i32 = stat.rsplit(')').next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
        assert_ne!(ppid, std::process::id() as i32);

        let mut qmp = Qmp::connect(&p.sock, Duration::from_secs(10)).await.unwrap();
        assert_eq!(qmp.query_status().await.unwrap(), "running");
        qmp.quit().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), process::wait_exit_of(&id)).await.unwrap().unwrap();
        // QEMU removes its pidfile when it exits normally.
        assert!(!p.pidfile.exists());
    }

    #[tokio::test]
    async fn passed_fds_arrive_in_qemu_at_3_and_up() {
        let p = paths();
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let fa: OwnedFd = std::fs::File::create(&a).unwrap().into();
        let fb: OwnedFd = std::fs::File::create(&b).unwrap().into();
        let mut req = request(&p, &[], false);
        req.fds = vec![fa, fb];
        let id = launch(&req).await.unwrap();
        let link = |n: i32| std::fs::read_link(format!("/proc/{}/fd/{n}", id.pid)).unwrap();
        assert_eq!(link(FIRST_PASSED_FD), a);
        assert_eq!(link(FIRST_PASSED_FD + 1), b);
        let _ = process::signal(id.pid, Signal::SIGKILL);
        tokio::time::timeout(Duration::from_secs(10), process::wait_exit_of(&id)).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn memlock_limit_is_applied_to_qemu() {
        let p = paths();
        let mut req = request(&p, &[], false);
        // Below this machine's hard limit (8 MiB), which cannot be raised here.
        req.memlock = Some(4 * 1024 * 1024);
        let id = launch(&req).await.unwrap();
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", id.pid)).unwrap();
        let line = limits.lines().find(|l| l.starts_with("Max locked memory")).unwrap().to_string();
        let _ = process::signal(id.pid, Signal::SIGKILL);
        tokio::time::timeout(Duration::from_secs(10), process::wait_exit_of(&id)).await.unwrap().unwrap();
        assert!(line.contains("4194304"), "{line}");
    }

    #[tokio::test]
    async fn invalid_machine_fails_in_the_foreground_process() {
        let p = paths();
        let mut req = request(&p, &[], false);
        req.argv[3] = OsString::from("nope");
        std::fs::write(&p.pidfile, "1\n").unwrap();
        let err = launch(&req).await.unwrap_err();
        match &err {
            LaunchError::Exited { status, stderr_tail } => {
                assert_eq!(status.code(), Some(1));
                assert!(stderr_tail.contains("unsupported machine type"), "{stderr_tail}");
            }
            other => panic!("expected Exited, got {other:?}"),
        }
        assert!(err.stderr_tail().unwrap().contains("unsupported"));
        // The stale pidfile was removed (and PID 1 was of course not touched).
        assert!(!p.pidfile.exists());
        assert_no_process_mentions(&p.pidfile).await;
    }

    #[tokio::test]
    async fn missing_kernel_fails_in_the_daemonized_process() {
        // This error is found after the fork: the grandchild reports it on the inherited stderr.
        let p = paths();
        let req = request(&p, &["-kernel", "/nonexistent/vmlinuz"], false);
        match launch(&req).await {
            Err(LaunchError::Exited { stderr_tail, .. }) => {
                assert!(stderr_tail.contains("/nonexistent/vmlinuz"), "{stderr_tail}");
            }
            other => panic!("expected Exited, got {other:?}"),
        }
        assert_no_process_mentions(&p.pidfile).await;
    }

    #[tokio::test]
    async fn timeout_kills_the_half_started_vm() {
        // With wait=on QEMU waits for a QMP client before it finishes initializing: the
        // foreground process never exits, while the daemonized one has written the pidfile.
        let p = paths();
        let mut req = request(&p, &[], true);
        req.timeout = Duration::from_secs(2);
        let started = std::time::Instant::now();
        match launch(&req).await {
            Err(LaunchError::Timeout { after, stderr_tail }) => {
                assert_eq!(after, Duration::from_secs(2));
                assert!(stderr_tail.contains("waiting for connection"), "{stderr_tail}");
            }
            other => panic!("expected Timeout, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(6));
        assert_no_process_mentions(&p.pidfile).await;
    }

    #[tokio::test]
    async fn dropping_the_launch_kills_the_half_started_vm() {
        let p = paths();
        let req = request(&p, &[], true);
        let cut = tokio::time::timeout(Duration::from_secs(2), launch(&req)).await;
        assert!(cut.is_err(), "launch should still be waiting");
        assert_no_process_mentions(&p.pidfile).await;
    }

    #[tokio::test]
    async fn missing_binary_is_a_spawn_error() {
        let p = paths();
        let mut req = request(&p, &[], false);
        req.binary = PathBuf::from("/nonexistent/qemu-system-x86_64");
        match launch(&req).await {
            Err(LaunchError::Spawn(e)) => assert_eq!(e.kind(), io::ErrorKind::NotFound),
            other => panic!("expected Spawn, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn requests_that_would_not_daemonize_are_refused() {
        let p = paths();

        let mut req = request(&p, &[], false);
        req.argv.retain(|a| a != "-daemonize");
        assert!(matches!(launch(&req).await, Err(LaunchError::BadRequest(_))));

        let mut req = request(&p, &[], false);
        req.pidfile = PathBuf::from("/elsewhere/qemu.pid");
        assert!(matches!(launch(&req).await, Err(LaunchError::BadRequest(_))));

        let mut req = request(&p, &[], false);
        req.pidfile = PathBuf::from("qemu.pid");
        assert!(matches!(launch(&req).await, Err(LaunchError::BadRequest(_))));

        let mut req = request(&p, &[], false);
        req.argv = req.argv.into_iter().map(|a| if a == "-daemonize" { "--daemonize".into() } else { a }).collect();
        check_request(&req).unwrap();
    }

    #[test]
    fn tail_keeps_the_last_bytes() {
        let mut tail = Vec::new();
        push_tail(&mut tail, &vec![b'a'; STDERR_TAIL]);
        push_tail(&mut tail, b"end");
        assert_eq!(tail.len(), STDERR_TAIL);
        assert!(tail.ends_with(b"aend"));
    }
}
