//! Starting a VM's QEMU and knowing when it is up.
//!
//! QEMU runs in the foreground (no `-daemonize`: QEMU's own seccomp filter with `spawn=deny`
//! forbids the fork that needs), as a child of the spawner ([`crate::sandbox::spawn`]), or of
//! the daemon without one. It never depends on its parent: when the daemon stops, the spawner
//! exits and QEMU runs on as an orphan, which a restarted daemon re-adopts by its recorded
//! identity ([`crate::process`]).
//!
//! [`launch`] therefore:
//!
//! 1. opens QEMU's log (its stderr, appended) and remembers where this launch's output starts;
//! 2. spawns QEMU with the descriptors of the request (sockets, files, taps), its memlock
//!    limit and its user;
//! 3. identifies the process at once ([`process::identify`]): the spawner has not reaped it
//!    yet, so the pid cannot have been reused;
//! 4. waits, bounded by the request's timeout, for the first of: the QMP greeting on the QMP
//!    socket (QEMU greets only from its main loop, after the machine is built: it is up), or
//!    QEMU's exit (the reason is in the log, returned as the stderr tail).
//!
//! On every failure path, including the caller dropping the future, QEMU is killed (the
//! spawn handle's drop): a failed launch leaves no process. On success the handle is detached
//! and the caller gets the greeted connection ([`Launched::qmp`]): its checks go over it at once
//! instead of waiting for QEMU to notice this one closed and accept another.

use std::ffi::OsString;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::UserIds;
use crate::process::{self, ProcessIdentity};
use crate::qemu::qmp::Qmp;
use crate::sandbox::spawn;

/// How many bytes at the end of QEMU's stderr are kept for errors.
pub const STDERR_TAIL: usize = 4096;

/// How long QEMU may take to exit once its QMP socket said it is gone.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// What to start.
#[derive(Debug)]
pub struct LaunchRequest {
    /// The QEMU binary, e.g. `/usr/bin/qemu-system-x86_64`.
    pub binary: PathBuf,
    /// The arguments after the binary. Must not include `-daemonize`.
    pub argv: Vec<OsString>,
    /// The QMP socket the daemon bound and passed among [`LaunchRequest::fds`]: connecting to it
    /// is how the launch learns that QEMU is up.
    pub qmp: PathBuf,
    /// QEMU's log file: its stderr, appended across launches.
    pub log: PathBuf,
    /// Bound on the whole launch, from spawn to the QMP greeting.
    pub timeout: Duration,
    /// File descriptors QEMU inherits: `fds[i]` becomes fd [`FIRST_PASSED_FD`]` + i` in QEMU,
    /// which the argv names. This is how QEMU uses taps, sockets and disk images without
    /// privileges or access to their paths.
    pub fds: Vec<OwnedFd>,
    /// RLIMIT_MEMLOCK for QEMU in bytes: VFIO pins all guest RAM, so a VM with passthrough
    /// devices needs at least its memory size.
    pub memlock: Option<u64>,
    /// The user QEMU runs as (`qemu.user`); `None`: the daemon's.
    pub user: Option<UserIds>,
    /// `accel = "kvm"`: QEMU keeps the group owning `/dev/kvm` ([`crate::qemu::kvm`]).
    pub kvm: bool,
    /// The CPUs QEMU (every thread it makes) starts on, set before the exec; empty: the
    /// spawner's ([`crate::lifecycle`]'s placement decides).
    pub affinity: crate::placement::CpuSet,
    /// A migration's destination: QEMU starts paused and waits for the incoming state
    /// ([`crate::qemu::argv::INCOMING_ARGS`] after [`LaunchRequest::argv`]); the QMP greeting
    /// still says it is up, but its status is `inmigrate`, not `running`
    /// ([`crate::qemu::migration`] drives it from there).
    pub incoming: bool,
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
    /// The request is inconsistent (`-daemonize` in the argv, too many descriptors). Nothing
    /// was started.
    #[error("bad launch request: {0}")]
    BadRequest(String),
    /// The binary could not be executed (missing, not executable, ...), the log could not be
    /// opened, or waiting for QEMU failed.
    #[error("cannot run QEMU: {0}")]
    Spawn(#[source] io::Error),
    /// QEMU exited before it was up; its reason is in the stderr tail.
    #[error("QEMU exited with {status}: {stderr_tail}")]
    Exited {
        /// QEMU's exit status.
        status: ExitStatus,
        /// The last bytes of its stderr during this launch (lossy UTF-8).
        stderr_tail: String,
    },
    /// QEMU did not greet on QMP within the timeout and was killed.
    #[error("QEMU did not start within {after:?}; stderr: {stderr_tail}")]
    Timeout {
        /// The timeout of the request.
        after: Duration,
        /// The last bytes of stderr so far (lossy UTF-8).
        stderr_tail: String,
    },
    /// QEMU closed its QMP socket without greeting and did not exit, or answered with
    /// something that is not QMP; it was killed.
    #[error("QEMU's QMP socket failed: {message}; stderr: {stderr_tail}")]
    Qmp {
        /// What went wrong on the socket.
        message: String,
        /// The last bytes of stderr (lossy UTF-8).
        stderr_tail: String,
    },
    /// The started process could not be looked up in `/proc`.
    #[error("cannot identify the started QEMU: {0}")]
    Identify(#[source] io::Error),
}

impl LaunchError {
    /// QEMU's stderr tail, for the variants that have one.
    pub fn stderr_tail(&self) -> Option<&str> {
        match self {
            LaunchError::Exited { stderr_tail, .. }
            | LaunchError::Timeout { stderr_tail, .. }
            | LaunchError::Qmp { stderr_tail, .. } => Some(stderr_tail),
            _ => None,
        }
    }
}

/// A QEMU that greeted on QMP.
#[derive(Debug)]
pub struct Launched {
    /// Its process.
    pub identity: ProcessIdentity,
    /// The connection it greeted on, past negotiation, on [`LaunchRequest::qmp`]: QEMU serves
    /// one client at a time there, so this one is the caller's until dropped.
    pub qmp: Qmp,
}

/// Starts QEMU and returns its process and QMP connection once it greets on QMP.
///
/// # Errors
/// See [`LaunchError`]; each variant says when it happens. Whatever the error, no process
/// started by this call keeps running.
pub async fn launch(req: &LaunchRequest) -> Result<Launched, LaunchError> {
    check_request(req)?;
    crate::crashpoint::reached("qemu:spawn");
    let deadline = Instant::now() + req.timeout;
    let log = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(&req.log)
        .map_err(|e| LaunchError::Spawn(io::Error::new(e.kind(), format!("{}: {e}", req.log.display()))))?;
    let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
    let tail = || stderr_tail(&req.log, log_start);

    let fds = req.fds.iter().map(OwnedFd::try_clone).collect::<io::Result<Vec<_>>>().map_err(LaunchError::Spawn)?;
    warn_if_memlock_stays_low(req.memlock);
    let command = spawn::Command::new(&req.binary)
        .args(full_argv(req))
        .stderr_to(log.into())
        .pass_fds(fds)
        .memlock(req.memlock)
        .affinity(&req.affinity)
        .user(req.user)
        .keep_kvm_group(req.kvm);
    // From here on, any early return (or the caller dropping us) kills QEMU (the handle's drop).
    let mut child = command.spawn().await.map_err(LaunchError::Spawn)?;
    crate::crashpoint::reached("qemu:spawned");
    let identity = match process::identify(child.pid) {
        Ok(id) => id,
        Err(e) => {
            // Gone already: its exit status and log say why.
            return match tokio::time::timeout(EXIT_WAIT, child.wait()).await {
                Ok(Ok(status)) => Err(LaunchError::Exited { status, stderr_tail: tail() }),
                _ => Err(LaunchError::Identify(e)),
            };
        }
    };

    let remaining = deadline.saturating_duration_since(Instant::now());
    let greeted = tokio::select! {
        qmp = Qmp::connect(&req.qmp, remaining) => Some(qmp),
        status = child.wait() => {
            return match status {
                Ok(status) => Err(LaunchError::Exited { status, stderr_tail: tail() }),
                Err(e) => Err(LaunchError::Spawn(e)),
            };
        }
        () = tokio::time::sleep_until(deadline) => None,
    };
    match greeted {
        Some(Ok(qmp)) => {
            crate::crashpoint::reached("qemu:greeted");
            child.detach();
            Ok(Launched { identity, qmp })
        }
        Some(Err(e)) => {
            // The socket closed or broke: QEMU is most likely exiting; its status is the better
            // error. If it does not exit, it is killed (drop).
            match tokio::time::timeout(EXIT_WAIT, child.wait()).await {
                Ok(Ok(status)) => Err(LaunchError::Exited { status, stderr_tail: tail() }),
                _ if Instant::now() >= deadline => {
                    Err(LaunchError::Timeout { after: req.timeout, stderr_tail: tail() })
                }
                _ => Err(LaunchError::Qmp { message: e.to_string(), stderr_tail: tail() }),
            }
        }
        None => {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(EXIT_WAIT, child.wait()).await;
            Err(LaunchError::Timeout { after: req.timeout, stderr_tail: tail() })
        }
    }
}

/// The request's argv with the destination's options appended when it is one.
fn full_argv(req: &LaunchRequest) -> Vec<OsString> {
    let extra: &[&str] = if req.incoming { &crate::qemu::argv::INCOMING_ARGS } else { &[] };
    req.argv.iter().cloned().chain(extra.iter().map(OsString::from)).collect()
}

/// Rejects requests QEMU would fork for (`-daemonize` is forbidden by its seccomp filter and
/// would hide its exit from the spawner) or with too many descriptors.
fn check_request(req: &LaunchRequest) -> Result<(), LaunchError> {
    let is = |arg: &OsString, name: &str| {
        arg.to_str().is_some_and(|a| a.strip_prefix('-') == Some(name) || a.strip_prefix("--") == Some(name))
    };
    if req.argv.iter().any(|a| is(a, "daemonize")) {
        return Err(LaunchError::BadRequest("argv has -daemonize; QEMU runs in the foreground".to_string()));
    }
    if req.fds.len() > spawn::MAX_PASSED_FDS {
        return Err(LaunchError::BadRequest(format!(
            "{} fds to pass; at most {}",
            req.fds.len(),
            spawn::MAX_PASSED_FDS
        )));
    }
    Ok(())
}

/// Logs when QEMU's RLIMIT_MEMLOCK cannot be raised to what VFIO needs.
fn warn_if_memlock_stays_low(memlock: Option<u64>) {
    let Some(bytes) = memlock else { return };
    let mut cur = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut cur) } == 0;
    // With a spawner, the spawner has CAP_SYS_RESOURCE (docs/sandbox.md).
    if ok && cur.rlim_max < bytes && !spawn::has_spawner() && !has_capability(CAP_SYS_RESOURCE) {
        tracing::warn!(
            wanted = bytes,
            hard_limit = cur.rlim_max,
            "cannot raise QEMU's RLIMIT_MEMLOCK without CAP_SYS_RESOURCE; VFIO may fail to pin guest memory"
        );
    }
}

/// The last [`STDERR_TAIL`] bytes QEMU wrote to `log` after offset `start` (lossy UTF-8).
fn stderr_tail(log: &Path, start: u64) -> String {
    let read = || -> io::Result<Vec<u8>> {
        let mut f = std::fs::File::open(log)?;
        let len = f.metadata()?.len();
        // A log shorter than where this launch began was trimmed since (crate::logcap): its
        // offsets moved, so the tail is all there is.
        let start = if start > len { 0 } else { start };
        let from = start.max(len.saturating_sub(STDERR_TAIL as u64));
        f.seek(SeekFrom::Start(from))?;
        let mut bytes = Vec::new();
        f.take(STDERR_TAIL as u64).read_to_end(&mut bytes)?;
        Ok(bytes)
    };
    match read() {
        Ok(bytes) => process::lossy_tail(&bytes, STDERR_TAIL),
        Err(e) => format!("(cannot read {}: {e})", log.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::Signal;
    use std::os::unix::net::UnixListener;

    /// A tempdir with the QMP socket and log of one test VM.
    struct Paths {
        dir: tempfile::TempDir,
        sock: PathBuf,
        log: PathBuf,
        /// Unique text in the argv (`-name guest=...`), to find the process.
        name: String,
    }

    fn paths() -> Paths {
        let dir = tempfile::tempdir().unwrap();
        let name = format!("lt{}", dir.path().file_name().unwrap().to_string_lossy().replace('.', ""));
        Paths { sock: dir.path().join("qmp.sock"), log: dir.path().join("qemu.log"), dir, name }
    }

    /// A TCG VM without disks, its QMP socket passed as fd 3; `extra` goes last.
    fn request(p: &Paths, extra: &[&str]) -> LaunchRequest {
        let _ = std::fs::remove_file(&p.sock);
        let listener: OwnedFd = UnixListener::bind(&p.sock).unwrap().into();
        let mut argv: Vec<OsString> = ["-accel", "tcg", "-M", "q35", "-m", "64", "-nodefaults", "-display", "none"]
            .iter()
            .map(OsString::from)
            .collect();
        argv.extend(["-name".into(), OsString::from(format!("guest={}", p.name))]);
        argv.extend(
            ["-chardev", "socket,id=qmp,fd=3,server=on,wait=off", "-mon", "chardev=qmp,mode=control"]
                .map(OsString::from),
        );
        argv.extend(extra.iter().map(OsString::from));
        LaunchRequest {
            binary: PathBuf::from("/usr/bin/qemu-system-x86_64"),
            argv,
            qmp: p.sock.clone(),
            log: p.log.clone(),
            timeout: Duration::from_secs(20),
            fds: vec![listener],
            memlock: None,
            user: None,
            kvm: false,
            affinity: Default::default(),
            incoming: false,
        }
    }

    /// Live processes with `needle` in one of their arguments.
    fn processes_mentioning(needle: &str) -> Vec<i32> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(args) = process::cmdline(pid) else {
                continue;
            };
            let hit = args.iter().any(|a| a.to_string_lossy().contains(needle));
            if hit && process::liveness(pid).is_alive() {
                found.push(pid);
            }
        }
        found
    }

    /// Waits up to 2 s for no live process to mention `needle`.
    async fn assert_no_process_mentions(needle: &str) {
        for _ in 0..100 {
            if processes_mentioning(needle).is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("processes left behind: {:?}", processes_mentioning(needle));
    }

    async fn kill(id: &ProcessIdentity) {
        let _ = process::signal(id.pid, Signal::SIGKILL);
        tokio::time::timeout(Duration::from_secs(10), process::wait_exit_of(id)).await.unwrap().unwrap();
    }

    #[test]
    fn the_stderr_tail_survives_a_log_trimmed_since_the_launch_began() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("qemu.log");
        std::fs::write(&log, "earlier launches\nthis launch: it failed\n").unwrap();
        assert_eq!(stderr_tail(&log, 17), "this launch: it failed");
        // logcap dropped the log's oldest part: the offset where this launch began is past its end.
        std::fs::write(&log, "it failed\n").unwrap();
        assert_eq!(stderr_tail(&log, 17), "it failed");
    }

    #[tokio::test]
    async fn good_launch_returns_the_live_vm_process_once_qmp_greets() {
        let p = paths();
        let req = request(&p, &[]);
        let Launched { identity: id, qmp: mut greeted } = launch(&req).await.unwrap();
        drop(req);
        // The connection QEMU greeted on is the caller's: it answers on it at once.
        assert_eq!(greeted.query_status().await.unwrap(), "running");
        drop(greeted);

        assert_ne!(id.pid, std::process::id() as i32);
        assert!(process::liveness(id.pid).is_alive());
        assert_eq!(process::identify(id.pid).unwrap(), id);
        assert!(crate::qemu::identity::is_qemu(
            &id,
            &crate::qemu::identity::tests::child_check(std::ffi::OsStr::new(&p.name), "/usr/bin/qemu-system-x86_64")
        ));
        let args = process::cmdline(id.pid).unwrap();
        assert!(!args.iter().any(|a| a == "-daemonize"), "{args:?}");

        // Up means QMP answers at once, on the socket the caller bound, also on a new connection.
        let mut qmp = Qmp::connect(&p.sock, Duration::from_secs(2)).await.unwrap();
        assert_eq!(qmp.query_status().await.unwrap(), "running");
        qmp.quit().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), process::wait_exit_of(&id)).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn an_incoming_launch_waits_paused_for_the_migration() {
        let p = paths();
        let mut req = request(&p, &[]);
        req.incoming = true;
        let Launched { identity: id, mut qmp } = launch(&req).await.unwrap();
        drop(req);
        // Up (greeted) but not running: it waits for migrate-incoming and then stays paused.
        assert_eq!(qmp.query_status().await.unwrap(), "inmigrate");
        let args = process::cmdline(id.pid).unwrap();
        let tail: Vec<&str> = args[args.len() - 3..].iter().map(|a| a.to_str().unwrap_or("")).collect();
        assert_eq!(tail, crate::qemu::argv::INCOMING_ARGS);
        qmp.quit().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), process::wait_exit_of(&id)).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn passed_fds_arrive_in_qemu_at_3_and_up() {
        let p = paths();
        let (a, b) = (p.dir.path().join("a"), p.dir.path().join("b"));
        let fa: OwnedFd = std::fs::File::create(&a).unwrap().into();
        let fb: OwnedFd = std::fs::File::create(&b).unwrap().into();
        let mut req = request(&p, &[]);
        req.fds.extend([fa, fb]);
        let id = launch(&req).await.unwrap().identity;
        let link = |n: i32| std::fs::read_link(format!("/proc/{}/fd/{n}", id.pid)).unwrap();
        assert!(link(FIRST_PASSED_FD).to_string_lossy().starts_with("socket:"));
        assert_eq!(link(FIRST_PASSED_FD + 1), a);
        assert_eq!(link(FIRST_PASSED_FD + 2), b);
        // stderr is the log file.
        assert_eq!(link(2), p.log);
        kill(&id).await;
    }

    #[tokio::test]
    async fn memlock_limit_is_applied_to_qemu() {
        let p = paths();
        let mut req = request(&p, &[]);
        // Below this machine's hard limit (8 MiB), which cannot be raised here.
        req.memlock = Some(4 * 1024 * 1024);
        let id = launch(&req).await.unwrap().identity;
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", id.pid)).unwrap();
        let line = limits.lines().find(|l| l.starts_with("Max locked memory")).unwrap().to_string();
        kill(&id).await;
        assert!(line.contains("4194304"), "{line}");
    }

    #[tokio::test]
    async fn qemu_runs_as_the_given_user_with_no_groups_and_no_capabilities() {
        let p = paths();
        let mut req = request(&p, &[]);
        req.user = Some(UserIds { uid: 65534, gid: 65534 });
        let id = launch(&req).await.unwrap().identity;
        let status = std::fs::read_to_string(format!("/proc/{}/status", id.pid)).unwrap();
        kill(&id).await;
        let field = |name: &str| {
            status.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.split_whitespace().collect::<Vec<_>>()).unwrap()
        };
        assert_eq!(field("Uid:"), ["65534"; 4], "{status}");
        assert_eq!(field("Gid:"), ["65534"; 4], "{status}");
        assert!(field("Groups:").is_empty(), "{status}");
        assert_eq!(field("CapEff:"), ["0000000000000000"], "{status}");
        assert_eq!(field("CapPrm:"), ["0000000000000000"], "{status}");
    }

    #[tokio::test]
    async fn invalid_machine_fails_with_this_launchs_stderr() {
        let p = paths();
        std::fs::write(&p.log, "output of an earlier launch\n").unwrap();
        let mut req = request(&p, &[]);
        req.argv[3] = OsString::from("nope");
        let err = launch(&req).await.unwrap_err();
        match &err {
            LaunchError::Exited { status, stderr_tail } => {
                assert_eq!(status.code(), Some(1));
                assert!(stderr_tail.contains("unsupported machine type"), "{stderr_tail}");
                assert!(!stderr_tail.contains("earlier launch"), "{stderr_tail}");
            }
            other => panic!("expected Exited, got {other:?}"),
        }
        assert!(err.stderr_tail().unwrap().contains("unsupported"));
        // The log keeps both.
        let log = std::fs::read_to_string(&p.log).unwrap();
        assert!(log.starts_with("output of an earlier launch\n") && log.contains("unsupported"), "{log}");
        assert_no_process_mentions(&p.name).await;
    }

    #[tokio::test]
    async fn missing_kernel_fails_with_the_reason() {
        let p = paths();
        let req = request(&p, &["-kernel", "/nonexistent/vmlinuz"]);
        match launch(&req).await {
            Err(LaunchError::Exited { stderr_tail, .. }) => {
                assert!(stderr_tail.contains("/nonexistent/vmlinuz"), "{stderr_tail}");
            }
            other => panic!("expected Exited, got {other:?}"),
        }
        assert_no_process_mentions(&p.name).await;
    }

    /// With `wait=on` QEMU waits for a client on that socket before it builds the machine, so
    /// it never greets on QMP.
    fn stuck_request(p: &Paths) -> LaunchRequest {
        let wait_sock = p.dir.path().join("wait.sock");
        let mut req = request(p, &["-chardev", "socket,id=stuck,fd=4,server=on,wait=on"]);
        req.fds.push(UnixListener::bind(wait_sock).unwrap().into());
        req
    }

    #[tokio::test]
    async fn timeout_kills_the_half_started_vm() {
        let p = paths();
        let mut req = stuck_request(&p);
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
        assert_no_process_mentions(&p.name).await;
    }

    #[tokio::test]
    async fn dropping_the_launch_kills_the_half_started_vm() {
        let p = paths();
        let req = stuck_request(&p);
        let cut = tokio::time::timeout(Duration::from_secs(2), launch(&req)).await;
        assert!(cut.is_err(), "launch should still be waiting");
        assert_no_process_mentions(&p.name).await;
    }

    #[tokio::test]
    async fn missing_binary_is_a_spawn_error() {
        let p = paths();
        let mut req = request(&p, &[]);
        req.binary = PathBuf::from("/nonexistent/qemu-system-x86_64");
        match launch(&req).await {
            Err(LaunchError::Spawn(e)) => assert_eq!(e.kind(), io::ErrorKind::NotFound),
            other => panic!("expected Spawn, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn daemonize_is_refused() {
        let p = paths();
        for flag in ["-daemonize", "--daemonize"] {
            let mut req = request(&p, &[]);
            req.argv.push(flag.into());
            assert!(matches!(launch(&req).await, Err(LaunchError::BadRequest(_))));
        }
        assert!(!p.log.exists(), "nothing was started");
    }
}
