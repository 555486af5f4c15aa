//! The daemon's side of running a program: [`Command`] and [`Child`].
//!
//! They behave like tokio's: a captured stdout or stderr is an async pipe, [`Child::wait`]
//! returns the exit status, the child is killed when the [`Child`] is dropped before it was
//! waited for. [`Command::spawn`] sends a `run` request to the spawner when there is one
//! ([`super::wire`]), and otherwise starts the program in-process with tokio, with the same
//! between-fork-and-exec setup ([`super::setup`]). Owners (images, pci, qemu, disk) build on
//! this file alone; the spawner's other requests are in [`super::requests`].

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::setup::{cpu_mask, place_fds, stdin_of, ChildSetup, CHILD_PATH, MAX_PASSED_FDS};
use super::wire::{next_message, reply_error, send_request, spawner, utf8, Control, Request, RunRequest};
use crate::config::UserIds;
use crate::placement::CpuSet;

/// An async pipe from a child's stdout or stderr.
pub type Pipe = Box<dyn AsyncRead + Unpin + Send>;

/// What to run.
#[derive(Debug)]
pub struct Command {
    program: PathBuf,
    args: Vec<OsString>,
    stdin: Option<String>,
    stdout: bool,
    stderr: bool,
    stderr_file: Option<OwnedFd>,
    fds: Vec<OwnedFd>,
    memlock: Option<u64>,
    user: Option<UserIds>,
    kvm: bool,
    affinity: Option<Vec<u32>>,
}

impl Command {
    /// `binary --version`.
    pub fn version_probe(binary: &Path) -> Command {
        Command::new(binary).args(["--version"])
    }

    /// `program` with no arguments, stdin, stdout and stderr on `/dev/null`.
    pub fn new(program: impl Into<PathBuf>) -> Command {
        Command {
            program: program.into(),
            args: Vec::new(),
            stdin: None,
            stdout: false,
            stderr: false,
            stderr_file: None,
            fds: Vec::new(),
            memlock: None,
            user: None,
            kvm: false,
            affinity: None,
        }
    }

    /// Appends arguments.
    pub fn args<I, S>(mut self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Gives the program `data` on stdin (at most [`super::MAX_STDIN`] bytes), then end-of-file: for
    /// what must not be in argv, where every process can read it (a URL's token to curl).
    /// Through the spawner the data travels in the request, so the spawner's allowlist sees it.
    pub fn stdin_data(mut self, data: String) -> Command {
        self.stdin = Some(data);
        self
    }

    /// Captures stdout in [`Child::stdout`].
    pub fn capture_stdout(mut self) -> Command {
        self.stdout = true;
        self
    }

    /// Captures stderr in [`Child::stderr`].
    pub fn capture_stderr(mut self) -> Command {
        self.stderr = true;
        self
    }

    /// Sends stderr to `file` (e.g. a log opened for appending) instead of a pipe: for a
    /// program that outlives the daemon's interest in its output, like QEMU.
    pub fn stderr_to(mut self, file: OwnedFd) -> Command {
        self.stderr = false;
        self.stderr_file = Some(file);
        self
    }

    /// Runs the program as `user` (no supplementary groups, see [`Command::keep_kvm_group`]),
    /// when not `None`. Through the spawner this is not the daemon's choice: the spawner runs
    /// the QEMU binary as the configured user whatever is asked, and everything else as itself.
    pub fn user(mut self, user: Option<UserIds>) -> Command {
        self.user = user;
        self
    }

    /// With a `user`, keeps the group owning `/dev/kvm` when that user is a member of it
    /// ([`crate::qemu::kvm::qemu_groups`]): for QEMU with `accel = "kvm"`. Through the
    /// spawner its own config decides, not this flag.
    pub fn keep_kvm_group(mut self, kvm: bool) -> Command {
        self.kvm = kvm;
        self
    }

    /// Descriptors the child inherits: `fds[i]` becomes fd [`super::FIRST_PASSED_FD`]` + i`.
    pub fn pass_fds(mut self, fds: Vec<OwnedFd>) -> Command {
        self.fds = fds;
        self
    }

    /// RLIMIT_MEMLOCK (soft and hard) of the child, in bytes.
    pub fn memlock(mut self, bytes: Option<u64>) -> Command {
        self.memlock = bytes;
        self
    }

    /// Runs the program on `cpus` only: the child sets its own affinity before the exec, so
    /// every thread it makes starts there (QEMU of a placed VM, docs/lifecycle.md). An empty
    /// set leaves the affinity as it is.
    pub fn affinity(mut self, cpus: &CpuSet) -> Command {
        self.affinity = (!cpus.is_empty()).then(|| cpus.iter().collect());
        self
    }

    /// Starts the program (through the spawner when there is one).
    ///
    /// # Errors
    /// The program cannot be started (missing, not executable, not on the spawner's allowlist:
    /// `PermissionDenied`), too many fds, or the spawner is gone.
    pub async fn spawn(self) -> io::Result<Child> {
        if self.fds.len() > MAX_PASSED_FDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} fds to pass; at most {MAX_PASSED_FDS}", self.fds.len()),
            ));
        }
        match spawner() {
            Some(control) => spawn_remote(control, self).await,
            None => spawn_local(self),
        }
    }

    /// Runs the program with stdout and stderr captured and waits for it.
    ///
    /// # Errors
    /// As [`Command::spawn`], or reading its output or waiting failed.
    pub async fn output(self) -> io::Result<std::process::Output> {
        let mut child = self.capture_stdout().capture_stderr().spawn().await?;
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let (mut so, mut se) = (child.stdout.take(), child.stderr.take());
        let read_out = async {
            match so.as_mut() {
                Some(p) => p.read_to_end(&mut out).await.map(|_| ()),
                None => Ok(()),
            }
        };
        let read_err = async {
            match se.as_mut() {
                Some(p) => p.read_to_end(&mut err).await.map(|_| ()),
                None => Ok(()),
            }
        };
        let (a, b, status) = tokio::join!(read_out, read_err, child.wait());
        a?;
        b?;
        Ok(std::process::Output { status: status?, stdout: out, stderr: err })
    }
}

/// True when programs are started by a spawner process.
pub fn has_spawner() -> bool {
    spawner().is_some()
}

/// A started program. Killed (SIGKILL) when dropped before [`Child::wait`] returned, unless
/// it was [detached](Child::detach).
pub struct Child {
    /// Its pid.
    pub pid: i32,
    /// Its stdout, when captured.
    pub stdout: Option<Pipe>,
    /// Its stderr, when captured.
    pub stderr: Option<Pipe>,
    inner: Inner,
    detached: bool,
}

impl std::fmt::Debug for Child {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Child").field("pid", &self.pid).finish_non_exhaustive()
    }
}

enum Inner {
    Local(tokio::process::Child),
    Remote(Remote),
}

struct Remote {
    reply: AsyncFd<OwnedFd>,
    buf: Vec<u8>,
    pidfd: Option<OwnedFd>,
    status: Option<ExitStatus>,
}

impl Child {
    /// Waits for the program to exit.
    ///
    /// # Errors
    /// Waiting failed, or the spawner went away before reporting the exit.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        match &mut self.inner {
            Inner::Local(c) => c.wait().await,
            Inner::Remote(r) => {
                if let Some(s) = r.status {
                    return Ok(s);
                }
                loop {
                    let (msg, _) = next_message(&r.reply, &mut r.buf).await?;
                    if let Some(raw) = msg.status {
                        let status = ExitStatus::from_raw(raw);
                        r.status = Some(status);
                        return Ok(status);
                    }
                }
            }
        }
    }

    /// Lets the program run on after this handle is dropped (a VM's QEMU once it is up). Its
    /// parent (the spawner, or the daemon without one) still reaps it when it exits.
    pub fn detach(mut self) {
        self.detached = true;
    }

    /// Sends SIGKILL (nothing when it already exited).
    ///
    /// # Errors
    /// The signal could not be sent.
    pub fn start_kill(&mut self) -> io::Result<()> {
        match &mut self.inner {
            Inner::Local(c) => match c.start_kill() {
                Err(e) if e.kind() == io::ErrorKind::InvalidInput => Ok(()),
                other => other,
            },
            Inner::Remote(r) => {
                if r.status.is_some() {
                    return Ok(());
                }
                kill_remote(self.pid, r.pidfd.as_ref())
            }
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.detached {
            return;
        }
        match &mut self.inner {
            Inner::Remote(r) => {
                if r.status.is_none() {
                    let _ = kill_remote(self.pid, r.pidfd.as_ref());
                }
            }
            // tokio reaps a dropped child in the background.
            Inner::Local(c) => {
                let _ = c.start_kill();
            }
        }
    }
}

fn kill_remote(pid: i32, pidfd: Option<&OwnedFd>) -> io::Result<()> {
    let ret = match pidfd {
        // SAFETY: pidfd_send_signal with a pidfd we own, no siginfo.
        Some(fd) => unsafe {
            libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), libc::SIGKILL, std::ptr::null::<u8>(), 0)
        },
        // SAFETY: plain kill(2); only without a pidfd (kernels before 5.3).
        None => libc::c_long::from(unsafe { libc::kill(pid, libc::SIGKILL) }),
    };
    if ret == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ESRCH) {
        Ok(())
    } else {
        Err(e)
    }
}

fn spawn_local(cmd: Command) -> io::Result<Child> {
    let mut command = tokio::process::Command::new(&cmd.program);
    let piped = |on: bool| if on { Stdio::piped() } else { Stdio::null() };
    // The same empty environment as the spawner gives: nothing of the daemon's reaches a child
    // (an `https_proxy` would send curl's pinned download through a proxy that resolves the
    // name itself).
    command.env_clear().env("PATH", CHILD_PATH);
    command.args(&cmd.args).stdin(stdin_of(cmd.stdin.as_deref())?).stdout(piped(cmd.stdout)).stderr(piped(cmd.stderr));
    if let Some(file) = cmd.stderr_file {
        command.stderr(Stdio::from(file));
    }
    let raw_fds: Vec<RawFd> = cmd.fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mask = cmd.affinity.as_deref().map(cpu_mask).transpose()?;
    let setup = ChildSetup::new(cmd.memlock, cmd.user, groups_for(cmd.user, cmd.kvm)).with_affinity(mask);
    // SAFETY: ChildSetup::apply and place_fds only call async-signal-safe functions and do not
    // allocate.
    unsafe {
        command.pre_exec(move || {
            setup.apply()?;
            place_fds(&raw_fds)
        });
    }
    let mut child = command.spawn()?;
    drop(cmd.fds);
    let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    let stdout = child.stdout.take().map(|p| Box::new(p) as Pipe);
    let stderr = child.stderr.take().map(|p| Box::new(p) as Pipe);
    Ok(Child { pid, stdout, stderr, inner: Inner::Local(child), detached: false })
}

fn pipe_pair() -> io::Result<(Pipe, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let receiver = tokio::net::unix::pipe::Receiver::from_owned_fd(r)?;
    Ok((Box::new(receiver), w))
}

async fn spawn_remote(control: &Control, cmd: Command) -> io::Result<Child> {
    let req = Request::Run(RunRequest {
        program: utf8("program", cmd.program.as_os_str())?,
        args: cmd.args.iter().map(|a| utf8("argument", a)).collect::<io::Result<_>>()?,
        stdin: cmd.stdin,
        stdout: cmd.stdout,
        stderr: cmd.stderr || cmd.stderr_file.is_some(),
        nfds: cmd.fds.len(),
        memlock: cmd.memlock,
        affinity: cmd.affinity,
    });
    let mut send: Vec<OwnedFd> = Vec::new();
    let (mut stdout, mut stderr) = (None, None);
    if cmd.stdout {
        let (r, w) = pipe_pair()?;
        stdout = Some(r);
        send.push(w);
    }
    if let Some(file) = cmd.stderr_file {
        send.push(file);
    } else if cmd.stderr {
        let (r, w) = pipe_pair()?;
        stderr = Some(r);
        send.push(w);
    }
    send.extend(cmd.fds);
    let reply = send_request(control, &req, send).await?;
    let mut buf = Vec::new();
    let (first, mut fds) = next_message(&reply, &mut buf).await?;
    if let Some(e) = reply_error(&first) {
        return Err(e);
    }
    let pid = first.pid.ok_or_else(|| io::Error::other("spawner reply without pid"))?;
    let pidfd = fds.pop();
    Ok(Child { pid, stdout, stderr, inner: Inner::Remote(Remote { reply, buf, pidfd, status: None }), detached: false })
}

/// The supplementary groups a program run as `user` keeps: the group owning `/dev/kvm` when
/// `kvm` (QEMU with `accel = "kvm"`) and the user is a member of it
/// ([`crate::qemu::kvm::qemu_groups`]), else none. Read before the fork.
pub(super) fn groups_for(user: Option<UserIds>, kvm: bool) -> Vec<u32> {
    match user {
        Some(u) if kvm => crate::qemu::kvm::qemu_groups(u),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::spawn::{cpus_allowed, pgrp_and_session};

    #[tokio::test]
    async fn local_output_and_kill_on_drop() {
        let out = Command::new("/bin/sh").args(["-c", "echo out; echo err >&2; exit 3"]).output().await.unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        let child = Command::new("/bin/sleep").args(["30"]).spawn().await.unwrap();
        let pid = child.pid;
        drop(child);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(stat.is_empty() || stat.contains(") Z"), "{stat}");
    }

    #[tokio::test]
    async fn a_child_runs_on_the_cpus_asked_for() {
        let ours = cpus_allowed(i32::try_from(std::process::id()).unwrap());
        // The last CPU this process may use: a set different from ours on any machine with two.
        let last: u32 = ours.rsplit([',', '-']).next().unwrap().parse().unwrap();
        let mut child =
            Command::new("/bin/sleep").args(["30"]).affinity(&CpuSet::from_cpus([last])).spawn().await.unwrap();
        assert_eq!(cpus_allowed(child.pid), last.to_string());
        child.start_kill().unwrap();
        child.wait().await.unwrap();
        // No set (or an empty one): the parent's.
        let mut child = Command::new("/bin/sleep").args(["30"]).affinity(&CpuSet::default()).spawn().await.unwrap();
        assert_eq!(cpus_allowed(child.pid), ours);
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }

    #[tokio::test]
    async fn local_children_get_their_own_session_and_group() {
        let ours = pgrp_and_session("self");
        let mut child = Command::new("/bin/sleep").args(["30"]).spawn().await.unwrap();
        let pid = child.pid;
        assert!(pid > 0);
        // pre_exec ran before the exec, so the ids are final by the time spawn returned.
        assert_eq!(pgrp_and_session(&pid.to_string()), (pid, pid), "its own process group and session");
        assert_ne!(ours.0, pid);
        assert_ne!(ours.1, pid);
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }
}
