//! `exec`: running one command as root and supervising it until it ends, times out or the host
//! goes away.
//!
//! Order of use: [`validate`] checks the request (nothing runs before it passes), the session
//! reads the announced stdin, then [`run`] spawns the command and supervises it through a
//! [`Link`] (the port, or a test's stand-in) until it is over, and the reply is built from the
//! [`Outcome`].
//!
//! Supervision is one `poll` loop over the port, the command's stdout and stderr and (while
//! there is stdin left) its stdin: output is sent as it comes, at most `max_output` bytes per
//! stream (the rest is read and counted so the command never blocks on a full pipe); a host
//! hang-up kills the command's whole process group at once; so does the timeout (`SIGKILL`,
//! reported as `timed_out`). The command runs in its own session (`setsid`) so that the group
//! is its own and includes whatever it starts, and it inherits no descriptor of the agent's:
//! every descriptor the agent opens is `O_CLOEXEC` (the port, std's pipes and files).
//! After the command exits, its pipes are read until they close or for [`GRACE`], whichever is
//! first: a background process it left holding them does not hold the reply.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vmhost_agent_protocol::exec::{
    ExecParams, ExecReply, OutputStream, MAX_CHUNK, MAX_OUTPUT, MAX_STDIN, MAX_TIMEOUT_S,
};

use crate::protocol::RpcError;

/// The environment every command starts with (the agent's own is not passed on).
pub const BASE_ENV: [(&str, &str); 3] =
    [("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"), ("HOME", "/root"), ("LANG", "C.UTF-8")];

/// Most arguments in an argv.
pub const MAX_ARGS: usize = 256;
/// Longest argument, in bytes.
pub const MAX_ARG: usize = 4096;
/// Most bytes of all arguments together.
pub const MAX_ARGV_TOTAL: usize = 64 * 1024;
/// Most extra environment entries.
pub const MAX_ENV: usize = 64;

/// How long the pipes are still read after the command exited.
pub const GRACE: Duration = Duration::from_millis(200);

/// Longest single wait of the loop: the command's exit is looked for at least this often.
const TICK: Duration = Duration::from_millis(50);

/// A validated `exec` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// The program and its arguments.
    pub argv: Vec<String>,
    /// Extra environment, split at the first `=`.
    pub env: Vec<(String, String)>,
    /// Working directory.
    pub cwd: String,
    /// Seconds before the group is killed.
    pub timeout: Duration,
    /// Bytes per stream sent.
    pub max_output: u64,
}

/// What an `env` entry must be.
const ENV_RULE: &str = "an environment entry is NAME=value, NAME [A-Za-z_][A-Za-z0-9_]*, at most 4096 bytes, no NUL";

/// `name` is a portable environment variable name (`[A-Za-z_][A-Za-z0-9_]*`).
fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Checks an `exec` request against the protocol's limits.
///
/// # Errors
/// 5100 naming the field refused (`argv`, `env[i]`, `cwd`, `stdin_bytes`, `timeout_s`,
/// `max_output`).
pub fn validate(p: &ExecParams) -> Result<Spec, RpcError> {
    if p.argv.is_empty() || p.argv.len() > MAX_ARGS {
        return Err(RpcError::invalid("argv", format!("argv must have 1 to {MAX_ARGS} members")));
    }
    if p.argv[0].is_empty() {
        return Err(RpcError::invalid("argv[0]", "the program name is empty"));
    }
    let mut total = 0;
    for (i, arg) in p.argv.iter().enumerate() {
        if arg.len() > MAX_ARG || arg.contains('\0') {
            return Err(RpcError::invalid(
                &format!("argv[{i}]"),
                format!("an argument is at most {MAX_ARG} bytes, no NUL"),
            ));
        }
        total += arg.len();
    }
    if total > MAX_ARGV_TOTAL {
        return Err(RpcError::invalid("argv", format!("the arguments total more than {MAX_ARGV_TOTAL} bytes")));
    }
    if p.env.len() > MAX_ENV {
        return Err(RpcError::invalid("env", format!("at most {MAX_ENV} environment entries")));
    }
    let mut env = Vec::with_capacity(p.env.len());
    for (i, entry) in p.env.iter().enumerate() {
        match entry.split_once('=') {
            Some((name, value)) if is_env_name(name) && !value.contains('\0') && entry.len() <= MAX_ARG => {
                env.push((name.to_string(), value.to_string()));
            }
            _ => return Err(RpcError::invalid(&format!("env[{i}]"), ENV_RULE)),
        }
    }
    let cwd = p.cwd.clone().unwrap_or_else(|| "/".to_string());
    if !cwd.starts_with('/') || cwd.contains('\0') || cwd.len() > MAX_ARG {
        return Err(RpcError::invalid("cwd", "cwd must be an absolute path"));
    }
    if p.stdin_bytes > MAX_STDIN {
        return Err(RpcError::invalid("stdin_bytes", format!("stdin is at most {MAX_STDIN} bytes")));
    }
    if p.timeout_s == 0 || p.timeout_s > MAX_TIMEOUT_S {
        return Err(RpcError::invalid("timeout_s", format!("timeout_s must be 1 to {MAX_TIMEOUT_S}")));
    }
    if p.max_output > MAX_OUTPUT {
        return Err(RpcError::invalid("max_output", format!("max_output is at most {MAX_OUTPUT}")));
    }
    Ok(Spec {
        argv: p.argv.clone(),
        env,
        cwd,
        timeout: Duration::from_secs(u64::from(p.timeout_s)),
        max_output: p.max_output,
    })
}

/// Where supervision sends output and learns that the host went away.
pub trait Link {
    /// The descriptor to watch for the host's hang-up (`POLLHUP`, or end of file when readable);
    /// `None`: no host to watch.
    fn watch_fd(&self) -> Option<i32>;
    /// The watched descriptor is readable: read what is there; `false` when the host is gone.
    fn readable(&mut self) -> bool;
    /// Sends output of `stream` (at most [`MAX_CHUNK`] bytes).
    ///
    /// # Errors
    /// When it cannot be delivered (the host is gone or does not read): the command is killed.
    fn output(&mut self, stream: OutputStream, data: &[u8]) -> io::Result<()>;
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The exit status when it exited.
    pub exit_code: Option<i32>,
    /// The signal that ended it otherwise.
    pub signal: Option<i32>,
    /// Killed at the timeout.
    pub timed_out: bool,
    /// From spawn to its end.
    pub duration: Duration,
    /// Bytes it wrote to stdout.
    pub stdout_bytes: u64,
    /// Bytes it wrote to stderr.
    pub stderr_bytes: u64,
}

impl Outcome {
    /// The protocol's reply.
    pub fn reply(&self) -> ExecReply {
        ExecReply {
            exit_code: self.exit_code,
            signal: self.signal,
            timed_out: self.timed_out,
            duration_ms: u64::try_from(self.duration.as_millis()).unwrap_or(u64::MAX),
            stdout_bytes: self.stdout_bytes,
            stderr_bytes: self.stderr_bytes,
        }
    }
}

/// Why supervision ended without an outcome.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The command could not be started (no such program, not executable, bad cwd).
    #[error("cannot run {program:?}: {source}")]
    Spawn {
        /// `argv[0]`.
        program: String,
        /// The `execve` (or `chdir`, `setsid`) error.
        source: io::Error,
    },
    /// The host hung up or stopped reading; the command's group was killed.
    #[error("the host went away; the command was killed")]
    HostGone,
    /// Waiting for the command failed.
    #[error("cannot supervise the command: {0}")]
    Wait(io::Error),
}

/// One output pipe being read.
struct Pipe<R> {
    /// The pipe, `None` once it reached end of file (or was given up).
    reader: Option<R>,
    /// Which stream.
    stream: OutputStream,
    /// Bytes read in all.
    total: u64,
    /// Bytes sent.
    sent: u64,
}

/// Puts `fd` into non-blocking mode.
fn nonblocking(fd: i32) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Kills the process group `pgid` (the command and everything it started in its session).
fn kill_group(pgid: u32) {
    if let Ok(pgid) = libc::pid_t::try_from(pgid) {
        // SAFETY: kill(2) with a negative pid signals that group; no memory involved.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
}

/// Kills the command's group and reaps it, whatever ended supervision early.
struct Reaper(Option<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            kill_group(child.id());
            let _ = child.wait();
        }
    }
}

/// Reads what is available from `pipe` (up to [`MAX_CHUNK`]), counts it and sends what fits
/// under `max_output`.
fn drain<R: Read>(pipe: &mut Pipe<R>, max_output: u64, link: &mut dyn Link, buf: &mut [u8]) -> Result<(), RunError> {
    let Some(reader) = pipe.reader.as_mut() else { return Ok(()) };
    match reader.read(buf) {
        Ok(0) => pipe.reader = None,
        Ok(n) => {
            pipe.total += n as u64;
            let room = usize::try_from(max_output.saturating_sub(pipe.sent)).unwrap_or(usize::MAX).min(n);
            if room > 0 {
                link.output(pipe.stream, &buf[..room]).map_err(|_| RunError::HostGone)?;
                pipe.sent += room as u64;
            }
        }
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
        Err(_) => pipe.reader = None,
    }
    Ok(())
}

/// Spawns `spec` with `stdin` and supervises it to its end (see the module documentation).
///
/// # Errors
/// [`RunError::Spawn`] when it cannot start, [`RunError::HostGone`] when the host hung up or
/// stopped reading (the group is killed), [`RunError::Wait`] when waiting failed.
pub fn run(spec: &Spec, stdin: Vec<u8>, link: &mut dyn Link) -> Result<Outcome, RunError> {
    let mut command = Command::new(&spec.argv[0]);
    command
        .args(&spec.argv[1..])
        .env_clear()
        .envs(BASE_ENV)
        .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(Path::new(&spec.cwd))
        .stdin(if stdin.is_empty() { Stdio::null() } else { Stdio::piped() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| if libc::setsid() < 0 { Err(io::Error::last_os_error()) } else { Ok(()) });
    }
    let start = Instant::now();
    let mut child = command.spawn().map_err(|source| RunError::Spawn { program: spec.argv[0].clone(), source })?;
    let pgid = child.id();
    let mut out = Pipe { reader: child.stdout.take(), stream: OutputStream::Stdout, total: 0, sent: 0 };
    let mut err = Pipe { reader: child.stderr.take(), stream: OutputStream::Stderr, total: 0, sent: 0 };
    let mut input = child.stdin.take();
    let mut reaper = Reaper(Some(child));
    for fd in [
        out.reader.as_ref().map(AsRawFd::as_raw_fd),
        err.reader.as_ref().map(AsRawFd::as_raw_fd),
        input.as_ref().map(AsRawFd::as_raw_fd),
    ]
    .into_iter()
    .flatten()
    {
        nonblocking(fd).map_err(RunError::Wait)?;
    }
    let deadline = start + spec.timeout;
    let mut written = 0usize;
    let mut ended: Option<(std::process::ExitStatus, Instant, bool)> = None;
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        let now = Instant::now();
        if ended.is_none() {
            let child = reaper.0.as_mut().ok_or_else(|| RunError::Wait(io::Error::other("no child")))?;
            if let Some(status) = child.try_wait().map_err(RunError::Wait)? {
                ended = Some((status, now, false));
                input = None;
            } else if now >= deadline {
                kill_group(pgid);
                let status = child.wait().map_err(RunError::Wait)?;
                ended = Some((status, Instant::now(), true));
                input = None;
            }
        }
        if let Some((status, at, timed_out)) = ended {
            if (out.reader.is_none() && err.reader.is_none()) || now >= at + GRACE {
                // The command itself is reaped; a background process that kept the pipes open
                // is left to get SIGPIPE when they close here.
                if let Some(child) = reaper.0.as_mut() {
                    let _ = child.try_wait();
                }
                reaper.0 = None;
                return Ok(Outcome {
                    exit_code: status.code(),
                    signal: status.signal(),
                    timed_out,
                    duration: at.saturating_duration_since(start),
                    stdout_bytes: out.total,
                    stderr_bytes: err.total,
                });
            }
        }
        let mut fds = Vec::with_capacity(4);
        let watch = link.watch_fd();
        for (fd, events) in [
            (watch, libc::POLLIN),
            (out.reader.as_ref().map(AsRawFd::as_raw_fd), libc::POLLIN),
            (err.reader.as_ref().map(AsRawFd::as_raw_fd), libc::POLLIN),
            (input.as_ref().map(AsRawFd::as_raw_fd), libc::POLLOUT),
        ] {
            fds.push(libc::pollfd { fd: fd.unwrap_or(-1), events, revents: 0 });
        }
        let wait = match ended {
            Some((_, at, _)) => (at + GRACE).saturating_duration_since(now),
            None => deadline.saturating_duration_since(now),
        }
        .min(TICK);
        let ms = libc::c_int::try_from(wait.as_millis()).unwrap_or(0);
        // SAFETY: `fds` is a valid array of pollfd; negative descriptors are ignored by poll.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(RunError::Wait(e));
        }
        if watch.is_some() {
            let revents = fds[0].revents;
            if revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
                || (revents & libc::POLLIN != 0 && !link.readable())
            {
                return Err(RunError::HostGone);
            }
        }
        if fds[1].revents != 0 {
            drain(&mut out, spec.max_output, link, &mut buf)?;
        }
        if fds[2].revents != 0 {
            drain(&mut err, spec.max_output, link, &mut buf)?;
        }
        if fds[3].revents != 0 {
            if let Some(pipe) = input.as_mut() {
                match pipe.write(&stdin[written..]) {
                    Ok(n) => written += n,
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
                    // EPIPE: the command closed its stdin; the rest is not wanted.
                    Err(_) => written = stdin.len(),
                }
                if written >= stdin.len() {
                    input = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Collects output; no host to watch.
    #[derive(Default)]
    struct Collect {
        stdout: Vec<u8>,
        stderr: Vec<u8>,
        largest: usize,
    }

    impl Link for Collect {
        fn watch_fd(&self) -> Option<i32> {
            None
        }
        fn readable(&mut self) -> bool {
            true
        }
        fn output(&mut self, stream: OutputStream, data: &[u8]) -> io::Result<()> {
            self.largest = self.largest.max(data.len());
            match stream {
                OutputStream::Stdout => self.stdout.extend_from_slice(data),
                OutputStream::Stderr => self.stderr.extend_from_slice(data),
            }
            Ok(())
        }
    }

    fn params(argv: &[&str]) -> ExecParams {
        ExecParams {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: vec![],
            cwd: None,
            stdin_bytes: 0,
            timeout_s: 30,
            max_output: 1 << 20,
        }
    }

    fn sh(script: &str) -> Spec {
        validate(&params(&["/bin/sh", "-c", script])).unwrap_or_else(|e| panic!("{e:?}"))
    }

    fn run_ok(spec: &Spec, stdin: &[u8]) -> (Outcome, Collect) {
        let mut link = Collect::default();
        let outcome = run(spec, stdin.to_vec(), &mut link).unwrap_or_else(|e| panic!("{e}"));
        (outcome, link)
    }

    #[test]
    fn requests_are_validated_field_by_field() {
        let field = |p: ExecParams| {
            validate(&p).err().and_then(|e| e.data).map(|d| d["field"].as_str().unwrap_or("").to_string())
        };
        assert_eq!(field(params(&[])), Some("argv".into()));
        assert_eq!(field(params(&[""])), Some("argv[0]".into()));
        assert_eq!(field(params(&["a", "b\0c"])), Some("argv[1]".into()));
        let many: Vec<&str> = vec!["x"; MAX_ARGS + 1];
        assert_eq!(field(params(&many)), Some("argv".into()));
        let long = "x".repeat(MAX_ARG);
        let total: Vec<&str> = vec![long.as_str(); 17];
        assert_eq!(field(params(&total)), Some("argv".into()));
        for (i, bad) in ["1A=x", "=x", "NOVALUE", "A-B=1", "A=\0"].iter().enumerate() {
            let mut p = params(&["true"]);
            p.env = vec!["OK=1".into(), bad.to_string()];
            assert_eq!(field(p), Some("env[1]".into()), "{i}: {bad}");
        }
        let mut p = params(&["true"]);
        p.cwd = Some("tmp".into());
        assert_eq!(field(p), Some("cwd".into()));
        let mut p = params(&["true"]);
        p.stdin_bytes = MAX_STDIN + 1;
        assert_eq!(field(p), Some("stdin_bytes".into()));
        for t in [0, MAX_TIMEOUT_S + 1] {
            let mut p = params(&["true"]);
            p.timeout_s = t;
            assert_eq!(field(p), Some("timeout_s".into()));
        }
        let mut p = params(&["true"]);
        p.max_output = MAX_OUTPUT + 1;
        assert_eq!(field(p), Some("max_output".into()));
        let mut p = params(&["true"]);
        p.env = vec!["_A1=x=y".into()];
        let spec = validate(&p).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(spec.env, [("_A1".to_string(), "x=y".to_string())]);
        assert_eq!(spec.cwd, "/");
    }

    #[test]
    fn exit_codes_signals_output_env_and_cwd() {
        let (o, out) = run_ok(&sh("echo out; echo err >&2; exit 3"), b"");
        assert_eq!((o.exit_code, o.signal, o.timed_out), (Some(3), None, false));
        assert_eq!((out.stdout.as_slice(), out.stderr.as_slice()), (&b"out\n"[..], &b"err\n"[..]));
        assert_eq!((o.stdout_bytes, o.stderr_bytes), (4, 4));
        let (o, _) = run_ok(&sh("kill -TERM $$"), b"");
        assert_eq!((o.exit_code, o.signal), (None, Some(15)));
        // The base environment only, plus the request's; the cwd.
        let mut p = params(&["/bin/sh", "-c", "echo \"$PATH|$HOME|$LANG|$EXTRA|${CARGO:-unset}\"; pwd"]);
        p.env = vec!["EXTRA=a b".into(), "HOME=/tmp".into()];
        p.cwd = Some("/tmp".into());
        let spec = validate(&p).unwrap_or_else(|e| panic!("{e:?}"));
        let (_, out) = run_ok(&spec, b"");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin|/tmp|C.UTF-8|a b|unset\n/tmp\n"
        );
        // No shell: the argument is one argument.
        let (_, out) = run_ok(&validate(&params(&["echo", "a;b $HOME"])).unwrap_or_else(|e| panic!("{e:?}")), b"");
        assert_eq!(out.stdout, b"a;b $HOME\n");
        // A program that does not exist.
        let mut link = Collect::default();
        let e = run(&validate(&params(&["/nonexistent/x"])).unwrap_or_else(|e| panic!("{e:?}")), vec![], &mut link);
        assert!(matches!(e, Err(RunError::Spawn { .. })), "{e:?}");
    }

    #[test]
    fn stdin_is_fed_and_absent_stdin_is_dev_null() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let (o, out) = run_ok(&sh("cat"), &data);
        assert_eq!(o.exit_code, Some(0));
        assert_eq!(out.stdout, data);
        let (_, out) = run_ok(&sh("wc -c"), b"");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
        // A command that does not read its stdin still ends.
        let (o, _) = run_ok(&sh("exit 0"), &data);
        assert_eq!(o.exit_code, Some(0));
    }

    #[test]
    fn output_beyond_the_cap_is_counted_not_sent() {
        let mut p = params(&["/bin/sh", "-c", "head -c 300000 /dev/zero; head -c 10 /dev/zero >&2"]);
        p.max_output = 100_000;
        let (o, out) = run_ok(&validate(&p).unwrap_or_else(|e| panic!("{e:?}")), b"");
        assert_eq!((o.stdout_bytes, out.stdout.len()), (300_000, 100_000));
        assert_eq!((o.stderr_bytes, out.stderr.len()), (10, 10));
        assert!(out.largest <= MAX_CHUNK);
        p.max_output = 0;
        let (o, out) = run_ok(&validate(&p).unwrap_or_else(|e| panic!("{e:?}")), b"");
        assert_eq!((o.stdout_bytes, out.stdout.len(), o.exit_code), (300_000, 0, Some(0)));
    }

    /// The pid a shell wrote to `file`, once it is there.
    fn read_pid(file: &Path) -> i32 {
        let start = Instant::now();
        loop {
            if let Some(pid) = std::fs::read_to_string(file).ok().and_then(|t| t.trim().parse().ok()) {
                return pid;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "no pid in {}", file.display());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether `pid` is gone (or a zombie nobody reaps yet).
    fn gone(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')),
        }
    }

    #[test]
    fn the_timeout_kills_the_whole_group_including_a_grandchild() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pidfile = dir.path().join("grandchild");
        // The grandchild ignores SIGTERM and holds the pipes; only the group kill ends it.
        let script = format!("sh -c 'trap \"\" TERM; echo $$ > {}; exec sleep 1000' & wait", pidfile.display());
        let mut p = params(&["/bin/sh", "-c", &script]);
        p.timeout_s = 1;
        let (o, _) = run_ok(&validate(&p).unwrap_or_else(|e| panic!("{e:?}")), b"");
        assert_eq!((o.timed_out, o.signal, o.exit_code), (true, Some(9), None));
        assert!(o.duration >= Duration::from_secs(1));
        let grandchild = read_pid(&pidfile);
        let start = Instant::now();
        while !gone(grandchild) {
            assert!(start.elapsed() < Duration::from_secs(10), "grandchild {grandchild} survived");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_background_process_holding_the_pipes_does_not_hold_the_reply() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pidfile = dir.path().join("bg");
        let (o, out) = run_ok(&sh(&format!("sleep 1000 & echo $! > {}; echo done", pidfile.display())), b"");
        assert_eq!((o.exit_code, out.stdout.as_slice()), (Some(0), &b"done\n"[..]));
        let bg = read_pid(&pidfile);
        // SAFETY: kill(2) of a process this test started.
        unsafe { libc::kill(bg, libc::SIGKILL) };
    }

    /// A host hang-up mid-command kills the group; the port end is a socketpair.
    #[test]
    fn a_host_hang_up_kills_the_command() {
        struct Sock(std::os::unix::net::UnixStream);
        impl Link for Sock {
            fn watch_fd(&self) -> Option<i32> {
                Some(self.0.as_raw_fd())
            }
            fn readable(&mut self) -> bool {
                let mut b = [0u8; 64];
                !matches!((&self.0).read(&mut b), Ok(0))
            }
            fn output(&mut self, _: OutputStream, _: &[u8]) -> io::Result<()> {
                Ok(())
            }
        }
        let (ours, host) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        let dir = tempfile::tempdir().expect("tempdir");
        let pidfile = dir.path().join("pid");
        let spec = sh(&format!("echo $$ > {}; exec sleep 1000", pidfile.display()));
        let pidfile2 = pidfile.clone();
        let closer = std::thread::spawn(move || {
            read_pid(&pidfile2);
            drop(host);
        });
        let result = run(&spec, vec![], &mut Sock(ours));
        assert!(matches!(result, Err(RunError::HostGone)), "{result:?}");
        let _ = closer.join();
        assert!(gone(read_pid(&pidfile)));
    }

    #[test]
    fn children_inherit_no_agent_descriptor() {
        // Descriptors the agent opens (std opens them O_CLOEXEC) stay out of the command.
        // High numbers, so that no descriptor of the shell or of ls can be mistaken for them.
        let file = std::fs::File::open("/proc/self/status").expect("open");
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        // SAFETY: F_DUPFD_CLOEXEC duplicates descriptors this test owns.
        let high =
            [file.as_raw_fd(), ours.as_raw_fd()].map(|fd| unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 700) });
        let (_, out) = run_ok(&validate(&params(&["ls", "/proc/self/fd"])).unwrap_or_else(|e| panic!("{e:?}")), b"");
        let fds: Vec<i32> = String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.parse().ok()).collect();
        assert!(fds.contains(&1), "{fds:?}");
        for fd in high {
            assert!(fd >= 700, "dup failed");
            assert!(!fds.contains(&fd), "fd {fd} leaked into the command: {fds:?}");
            // SAFETY: closing the duplicate made above.
            unsafe { libc::close(fd) };
        }
    }
}
