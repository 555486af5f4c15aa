//! Running programs: QEMU, modprobe and their `--version` probes.
//!
//! A sandboxed daemon cannot run them itself: its seccomp filter has no `execve`, and whatever it
//! started would inherit its filter, its Landlock domain and its capability bounding set. So when
//! the sandbox is on, [`super::enter`] forks a **spawner** before it confines the daemon. The
//! spawner is a small single-threaded process with its own, different confinement (its own
//! capabilities, see [`super::caps`], and its own Landlock domain, see [`super::landlock`]; no
//! seccomp filter, so QEMU is not bound to the daemon's syscall table). Every program it starts
//! but the image download gets a small filter of its own, [`super::child_seccomp`]: no IP
//! socket, whatever the kernel's Landlock and the unit's address families allow. It does one thing: on a
//! request over a `SOCK_SEQPACKET` socket pair it starts one of the programs it was configured to
//! allow, with the descriptors the daemon sent along (`SCM_RIGHTS`), and reports the pid (with a
//! pidfd) and later the exit status on a per-request reply socket.
//!
//! [`Command`] and [`Child`] are the daemon's side and behave like tokio's: a captured stdout or
//! stderr is an async pipe, [`Child::wait`] returns the exit status, the child is killed when the
//! [`Child`] is dropped before it was waited for. Without a spawner (`sandbox = "off"`, and unit
//! tests) the same types start the program in-process with tokio.
//!
//! The spawner only runs programs on its allowlist (the configured `qemu.binary`, and `modprobe
//! vfio-pci` when passthrough is configured), with an empty environment except `PATH`, stdin on
//! `/dev/null` (curl alone gets its config there: [`Command::stdin_data`], checked with its
//! arguments). The QEMU binary always runs as `qemu.user`, whether it boots a VM or works on
//! an image file without a guest ([`crate::disk::offline_qemu`]). It also opens boot files, probes `/dev/kvm` as QEMU's user, and hands VFIO group nodes to
//! QEMU's group and back ([`vfio_node`]).
//!
//! The control socket is driven asynchronously ([`Control`]): a full socket makes the sending
//! task wait on the reactor, never a runtime thread.
//!
//! **Every program starts in a session (and process group) of its own** (`setsid()` between
//! fork and exec, through the spawner and without one), so a signal meant for the daemon's
//! process group or terminal never reaches it: Ctrl-C on a vmhostd started from a shell, a
//! `kill -- -PGID` of its group, or the hang-up of its terminal end the daemon (and its spawner)
//! but no VM, and the next daemon adopts every QEMU as it was (docs/lifecycle.md). Only the
//! daemon decides when something it started dies: [`Child::start_kill`] and the kill on drop
//! signal one process (its pidfd or pid), never a group. This holds for the short-lived programs
//! too (QEMU writing an overlay without a guest, modprobe, the `--version` probes), for one rule
//! rather than a list of exceptions: a Ctrl-C meant for the daemon must not half-kill a QEMU
//! creating an overlay or a `modprobe` loading a module either. A daemon that dies while one runs leaves it
//! to finish by itself, as a `kill -9` of the daemon's pid always did, and a restart settles the
//! interrupted operation from its record. None of them has a controlling terminal (stdin is
//! `/dev/null`), so a new session costs nothing.

use std::ffi::OsString;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};

use tokio::io::Interest;

use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
};
use serde::{Deserialize, Serialize};

pub use crate::config::UserIds;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The fd number the first passed descriptor gets in the child.
pub const FIRST_PASSED_FD: i32 = 3;

/// At most this many descriptors are passed to one child.
pub const MAX_PASSED_FDS: usize = 64;

/// Largest request the spawner reads (argv as JSON).
const MAX_REQUEST: usize = 256 * 1024;

/// Most bytes of [`Command::stdin_data`]: what a pipe always holds (one page, even for a user
/// over the kernel's pipe-buffer limits), so writing it never blocks.
pub const MAX_STDIN: usize = 4096;

/// `PATH` of every program the spawner starts.
const CHILD_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// The modprobe binaries the spawner may run (`modprobe vfio-pci` only).
pub const MODPROBE: [&str; 2] = ["/usr/sbin/modprobe", "/sbin/modprobe"];

/// An async pipe from a child's stdout or stderr.
pub type Pipe = Box<dyn AsyncRead + Unpin + Send>;

/// The daemon's connection to its spawner, once [`super::enter`] forked one.
static SPAWNER: OnceLock<Control> = OnceLock::new();

/// The daemon's end of the control socket, non-blocking.
///
/// Requests are sent with a non-blocking `sendmsg`; when the socket is full (the spawner is busy
/// copying a boot file, or stalled) the sending task waits for writability on the runtime's
/// reactor instead of blocking its worker thread, so a stalled spawner delays only the tasks
/// that need it. No lock is needed: on a `SOCK_SEQPACKET` socket each `sendmsg` is one whole
/// record, so concurrent senders never interleave. (The alternative, a blocking `sendmsg` on
/// `spawn_blocking` behind a tokio mutex, would still let every waiting request pin one thread
/// of the blocking pool for as long as the spawner stalls; readiness pins none.)
#[derive(Debug)]
pub(crate) struct Control {
    fd: OwnedFd,
}

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

    /// Gives the program `data` on stdin (at most [`MAX_STDIN`] bytes), then end-of-file: for
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

    /// Descriptors the child inherits: `fds[i]` becomes fd [`FIRST_PASSED_FD`]` + i`.
    pub fn pass_fds(mut self, fds: Vec<OwnedFd>) -> Command {
        self.fds = fds;
        self
    }

    /// RLIMIT_MEMLOCK (soft and hard) of the child, in bytes.
    pub fn memlock(mut self, bytes: Option<u64>) -> Command {
        self.memlock = bytes;
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
        match SPAWNER.get() {
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
    SPAWNER.get().is_some()
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

/// Moves `fds` to 3, 4, ... in a freshly forked child. Runs between fork and exec, so it only
/// uses async-signal-safe calls (fcntl, dup2) and allocates nothing.
fn place_fds(fds: &[RawFd]) -> io::Result<()> {
    // First lift every fd above the target range, so no dup2 clobbers a source not yet moved.
    let mut lifted = [0 as RawFd; MAX_PASSED_FDS];
    for (i, fd) in fds.iter().enumerate().take(MAX_PASSED_FDS) {
        // SAFETY: fcntl on an fd we own in this child; F_DUPFD_CLOEXEC creates a new fd.
        let high = unsafe { libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 1000) };
        if high < 0 {
            return Err(io::Error::last_os_error());
        }
        lifted[i] = high;
    }
    for (i, high) in lifted.iter().take(fds.len()).enumerate() {
        let target = FIRST_PASSED_FD + i as i32;
        // SAFETY: dup2 onto a fixed number; the new fd has FD_CLOEXEC clear, so the child keeps it.
        if unsafe { libc::dup2(*high, target) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Becomes `user` between fork and exec: exactly `groups` as supplementary groups (none, or
/// the one [`crate::qemu::kvm::qemu_groups`] allows), its gid, its uid, and a umask that keeps
/// whatever it creates private. Needs CAP_SETGID and CAP_SETUID (the spawner has them). The
/// capabilities do not survive the exec: the securebits set with them (docs/sandbox.md) give a
/// non-setuid program none, and without a spawner a uid change from 0 clears them. Only
/// async-signal-safe calls.
pub(crate) fn become_user(user: UserIds, groups: &[u32]) -> io::Result<()> {
    // SAFETY: setgroups with a valid array of its length, setgid, setuid and umask take plain
    // integers.
    unsafe {
        if libc::setgroups(groups.len(), groups.as_ptr()) != 0
            || libc::setgid(user.gid) != 0
            || libc::setuid(user.uid) != 0
        {
            return Err(io::Error::last_os_error());
        }
        libc::umask(0o077);
    }
    Ok(())
}

/// Makes the freshly forked child the leader of a new session and process group (its pid is
/// both ids), without a controlling terminal: signals to the daemon's group or terminal do not
/// reach it (module doc). Needs no privilege, so it comes first. Async-signal-safe.
fn new_session() -> io::Result<()> {
    // SAFETY: setsid takes no arguments; a forked child is never a group leader, so it succeeds.
    if unsafe { libc::setsid() } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What every started program gets between fork and exec, whether the spawner or the daemon
/// starts it: its own session, then its memlock limit, then its user.
struct ChildSetup {
    memlock: Option<u64>,
    user: Option<UserIds>,
    /// Computed before the fork (it reads /dev/kvm and the group database).
    groups: Vec<u32>,
}

impl ChildSetup {
    /// `kvm`: the user keeps the group owning `/dev/kvm` ([`crate::qemu::kvm::qemu_groups`]).
    fn new(memlock: Option<u64>, user: Option<UserIds>, kvm: bool) -> ChildSetup {
        let groups = match user {
            Some(u) if kvm => crate::qemu::kvm::qemu_groups(u),
            _ => Vec::new(),
        };
        ChildSetup { memlock, user, groups }
    }

    /// Runs in the forked child: only async-signal-safe calls, no allocation.
    fn apply(&self) -> io::Result<()> {
        // Its own session and process group, whatever the program (module doc).
        new_session()?;
        // The limit before the user change: raising it needs CAP_SYS_RESOURCE, which the uid
        // change drops.
        if let Some(bytes) = self.memlock {
            set_memlock(bytes)?;
        }
        if let Some(u) = self.user {
            become_user(u, &self.groups)?;
        }
        Ok(())
    }
}

/// Sets RLIMIT_MEMLOCK between fork and exec. Raising the hard limit needs CAP_SYS_RESOURCE;
/// without it (EPERM) the limit stays and QEMU relies on CAP_IPC_LOCK.
fn set_memlock(bytes: u64) -> io::Result<()> {
    let lim = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
    // SAFETY: setrlimit with a valid struct; async-signal-safe.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EPERM) {
            return Err(err);
        }
    }
    Ok(())
}

/// A pipe already holding `data` and closed for writing: the read end, for a child's stdin.
/// Non-blocking writes of at most [`MAX_STDIN`] bytes into a new pipe: never a wait.
fn stdin_pipe(data: &str) -> io::Result<OwnedFd> {
    if data.len() > MAX_STDIN {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("more than {MAX_STDIN} bytes for stdin")));
    }
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)?;
    let mut file = std::fs::File::from(w);
    io::Write::write_all(&mut file, data.as_bytes())?;
    drop(file);
    // The child reads it blocking, as any stdin.
    nix::fcntl::fcntl(&r, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()))?;
    Ok(r)
}

/// The child's stdin: `data` in a pipe, or `/dev/null`.
fn stdin_of(data: Option<&str>) -> io::Result<Stdio> {
    Ok(match data {
        Some(d) => Stdio::from(stdin_pipe(d)?),
        None => Stdio::null(),
    })
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
    let setup = ChildSetup::new(cmd.memlock, cmd.user, cmd.kvm);
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

/// A request to the spawner. The reply socket always travels first among the descriptors.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    /// Start a program ([`RunRequest`]).
    Run(RunRequest),
    /// Open a kernel or initrd ([`crate::qemu::boot_files`]) and, with `copy`, send back its
    /// sealed copy (from the spawner's [`crate::qemu::boot_files::CopyCache`]); without, only
    /// whether it can be opened.
    BootFile {
        /// The file a spec names.
        path: String,
        /// Copy it (a launch) or only open it (the check before anything starts).
        copy: bool,
    },
    /// Whether QEMU's user, with the groups QEMU gets, can open `/dev/kvm`.
    KvmAccess,
    /// Give the VFIO group node `/dev/vfio/GROUP` group `gid` and permission bits `mode`
    /// (within [`VFIO_NODE_MODES`]); the reply's `node` is what it had before.
    VfioNode {
        /// The IOMMU group number (the spawner makes the path itself).
        group: u32,
        /// The node's new group.
        gid: u32,
        /// The node's new permission bits.
        mode: u32,
    },
}

/// The most a VFIO group node may be opened up to: read and write for its owner and group,
/// never for others.
pub const VFIO_NODE_MODES: u32 = 0o660;

/// A VFIO group node's group and permission bits: what [`vfio_node`] found before it changed
/// them, recorded (with intent, before the change) so they can be put back on release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAccess {
    /// The IOMMU group number: the node is `/dev/vfio/GROUP`.
    pub group: u32,
    /// Its group id.
    pub gid: u32,
    /// Its permission bits.
    pub mode: u32,
}

/// Sets group and mode of `/dev/vfio/GROUP`, in whichever process may (the spawner, or the
/// daemon without one): only a character device, by a path made from the number, with at most
/// [`VFIO_NODE_MODES`]. Returns what it had before.
fn set_vfio_node(group: u32, gid: u32, mode: u32) -> io::Result<NodeAccess> {
    set_node(&crate::pci::bind::vfio_group_dev(group), group, gid, mode)
}

/// [`set_vfio_node`] on `node` (a test's node in a temporary directory).
fn set_node(node: &Path, group: u32, gid: u32, mode: u32) -> io::Result<NodeAccess> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    if mode & !VFIO_NODE_MODES != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("mode {mode:o} opens a VFIO group node beyond {VFIO_NODE_MODES:o}"),
        ));
    }
    let meta = std::fs::symlink_metadata(node)?;
    if !meta.file_type().is_char_device() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not a device node", node.display())));
    }
    let before = NodeAccess { group, gid: meta.gid(), mode: meta.mode() & 0o7777 };
    std::os::unix::fs::lchown(node, None, Some(gid))?;
    std::fs::set_permissions(node, std::fs::Permissions::from_mode(mode))?;
    Ok(before)
}

/// Gives `/dev/vfio/GROUP` group `gid` and mode `mode` (at most [`VFIO_NODE_MODES`]), through
/// the spawner when there is one: the daemon's seccomp table has no path-based chmod or chown.
/// Returns the node's group and mode before.
///
/// # Errors
/// `NotFound` when the node does not exist, `PermissionDenied` for a mode beyond
/// [`VFIO_NODE_MODES`], `InvalidInput` when it is not a device node, the OS error of the
/// change, or the spawner is gone.
pub async fn vfio_node(group: u32, gid: u32, mode: u32) -> io::Result<NodeAccess> {
    let Some(control) = SPAWNER.get() else {
        return tokio::task::spawn_blocking(move || set_vfio_node(group, gid, mode)).await.map_err(io::Error::other)?;
    };
    let reply = send_request(control, &Request::VfioNode { group, gid, mode }, Vec::new()).await?;
    let (answer, _) = next_message(&reply, &mut Vec::new()).await?;
    if let Some(e) = reply_error(&answer) {
        return Err(e);
    }
    answer.node.ok_or_else(|| io::Error::other("spawner reply without node"))
}

/// Start a program. After the reply socket come stdout's write end (if `stdout`), stderr's (if
/// `stderr`), then `nfds` passed fds.
#[derive(Debug, Serialize, Deserialize)]
struct RunRequest {
    program: String,
    args: Vec<String>,
    /// What the program reads on stdin ([`Command::stdin_data`]); `/dev/null` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stdin: Option<String>,
    stdout: bool,
    stderr: bool,
    nfds: usize,
    memlock: Option<u64>,
}

/// A line on a reply socket. For `run`: first `pid` (with a pidfd attached) or `error`, then
/// `status`. For `boot_file`: `ok` (with the copy attached when asked) or `error`. For
/// `kvm_access`: `access` or `error`.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Reply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ok: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    access: Option<crate::qemu::kvm::Access>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    node: Option<NodeAccess>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pid: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    errno: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<i32>,
}

fn utf8(what: &str, s: &std::ffi::OsStr) -> io::Result<String> {
    s.to_str()
        .map(str::to_string)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{what} is not UTF-8: {s:?}")))
}

fn pipe_pair() -> io::Result<(Pipe, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let receiver = tokio::net::unix::pipe::Receiver::from_owned_fd(r)?;
    Ok((Box::new(receiver), w))
}

impl Control {
    /// Takes over the daemon's end of a control socket pair and makes it non-blocking.
    ///
    /// # Errors
    /// fcntl failed.
    pub(crate) fn new(fd: OwnedFd) -> io::Result<Control> {
        let flags = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GETFL)?;
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(flags))?;
        Ok(Control { fd })
    }

    /// Sends one record (`payload` with `fds`), waiting on the reactor while the socket is full.
    async fn send(&self, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let cmsgs = [ControlMessage::ScmRights(fds)];
        loop {
            match sendmsg::<()>(
                self.fd.as_raw_fd(),
                &[IoSlice::new(payload)],
                &cmsgs,
                MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                None,
            ) {
                Ok(_) => return Ok(()),
                Err(nix::errno::Errno::EAGAIN) => self.writable().await?,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(io::Error::new(io::ErrorKind::BrokenPipe, format!("the spawner process is gone: {e}")))
                }
            }
        }
    }

    /// Waits until the socket has room. A duplicate descriptor is registered for the wait, so
    /// any number of tasks (and runtimes) may wait at once: the same descriptor cannot be added
    /// to one epoll twice, a duplicate is a new entry. Edge-triggered registration reports a
    /// socket that became writable before it was registered, so no wake-up is lost.
    async fn writable(&self) -> io::Result<()> {
        let dup = self.fd.try_clone()?;
        // SAFETY: `dup` is an open descriptor we own; the AsyncFd owns it until the wait ends.
        let fd = unsafe { AsyncFd::register_with_interest(dup, Interest::WRITABLE) }?;
        let _ready = fd.writable().await?;
        Ok(())
    }
}

/// Sends `req` with `fds` after a new reply socket, and returns our end of that socket.
async fn send_request(control: &Control, req: &Request, fds: Vec<OwnedFd>) -> io::Result<AsyncFd<OwnedFd>> {
    let payload = serde_json::to_vec(req).map_err(io::Error::other)?;
    if payload.len() > MAX_REQUEST {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "command line too long for the spawner"));
    }
    let (mine, theirs) =
        socketpair(AddressFamily::Unix, SockType::Stream, None, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK)?;
    let send: Vec<OwnedFd> = std::iter::once(theirs).chain(fds).collect();
    let raw: Vec<RawFd> = send.iter().map(AsRawFd::as_raw_fd).collect();
    control.send(&payload, &raw).await?;
    drop(send);
    // SAFETY: `mine` is an open socket we own; the AsyncFd owns it from here on.
    unsafe { AsyncFd::register(mine) }.map_err(io::Error::from)
}

/// The error a reply carries, if any.
fn reply_error(reply: &Reply) -> Option<io::Error> {
    let error = reply.error.clone()?;
    Some(match reply.errno {
        Some(n) => io::Error::new(io::Error::from_raw_os_error(n).kind(), error),
        None => io::Error::other(error),
    })
}

/// The daemon's own copies when it has no spawner.
static LOCAL_COPIES: Mutex<crate::qemu::boot_files::CopyCache> = Mutex::new(crate::qemu::boot_files::CopyCache::new());

/// Opens a kernel or initrd ([`crate::qemu::boot_files`]): through the spawner, which may read
/// where the daemon's Landlock rules do not reach, or in-process without one. With `copy`
/// returns the sealed copy QEMU gets; without, only checks that it opens.
///
/// # Errors
/// As [`crate::qemu::boot_files::open_under`] and [`crate::qemu::boot_files::sealed_copy`]
/// (their kinds are kept across the spawner), or the spawner is gone. `boot_dirs` is
/// `paths.boot` for the in-process open; the spawner has its own copy ([`Allowlist`]).
pub async fn boot_file(boot_dirs: &[PathBuf], path: &Path, copy: bool) -> io::Result<Option<OwnedFd>> {
    use crate::qemu::boot_files;
    let Some(control) = SPAWNER.get() else {
        let path = path.to_path_buf();
        let dirs = boot_dirs.to_vec();
        return tokio::task::spawn_blocking(move || {
            let file = boot_files::open_under(&dirs, &path)?;
            if !copy {
                return Ok(None);
            }
            let mut cache = LOCAL_COPIES.lock().map_err(|_| io::Error::other("copy cache lock poisoned"))?;
            cache.copy(file, &path).map(Some)
        })
        .await
        .map_err(io::Error::other)?;
    };
    let req = Request::BootFile { path: utf8("path", path.as_os_str())?, copy };
    let reply = send_request(control, &req, Vec::new()).await?;
    let (answer, mut fds) = next_message(&reply, &mut Vec::new()).await?;
    if let Some(e) = reply_error(&answer) {
        return Err(e);
    }
    match (copy, fds.pop()) {
        (true, None) => Err(io::Error::other("the spawner sent no copy")),
        (_, fd) => Ok(fd.filter(|_| copy)),
    }
}

/// Whether `qemu.user` (`user`; `None`: QEMU runs as the daemon's user), with the groups QEMU
/// gets under `accel = "kvm"`, can open `/dev/kvm`: asked of the spawner, which starts QEMU,
/// or probed in-process without one.
///
/// # Errors
/// The probe could not run, or the spawner is gone.
pub async fn kvm_access(user: Option<UserIds>) -> io::Result<crate::qemu::kvm::Access> {
    let Some(control) = SPAWNER.get() else {
        return tokio::task::spawn_blocking(move || crate::qemu::kvm::probe_as_qemu(user))
            .await
            .map_err(io::Error::other)?;
    };
    let reply = send_request(control, &Request::KvmAccess, Vec::new()).await?;
    let (answer, _) = next_message(&reply, &mut Vec::new()).await?;
    if let Some(e) = reply_error(&answer) {
        return Err(e);
    }
    answer.access.ok_or_else(|| io::Error::other("spawner reply without access"))
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

/// Reads the next reply line (and any descriptors sent with it).
async fn next_message(sock: &AsyncFd<OwnedFd>, buf: &mut Vec<u8>) -> io::Result<(Reply, Vec<OwnedFd>)> {
    let mut fds = Vec::new();
    loop {
        if let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let reply: Reply = serde_json::from_slice(&line).map_err(io::Error::other)?;
            return Ok((reply, fds));
        }
        let mut guard = sock.readable().await?;
        match guard.try_io(|s| recv_with_fds(s.get_ref().as_fd().as_raw_fd(), MsgFlags::MSG_DONTWAIT)) {
            Ok(Ok((bytes, got))) => {
                if bytes.is_empty() {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the spawner closed the reply"));
                }
                buf.extend_from_slice(&bytes);
                fds.extend(got);
            }
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
}

/// One recvmsg: the bytes and the descriptors (close-on-exec) that came with them.
fn recv_with_fds(fd: RawFd, flags: MsgFlags) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut data = vec![0u8; MAX_REQUEST];
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_PASSED_FDS + 4]);
    let mut iov = [IoSliceMut::new(&mut data)];
    let msg = recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), flags | MsgFlags::MSG_CMSG_CLOEXEC).map_err(|e| {
        if e == nix::errno::Errno::EAGAIN {
            io::Error::from(io::ErrorKind::WouldBlock)
        } else {
            io::Error::from(e)
        }
    })?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(list) = c {
            // SAFETY: the kernel just installed these descriptors in this process for us.
            fds.extend(list.into_iter().map(|raw| unsafe { OwnedFd::from_raw_fd(raw) }));
        }
    }
    let n = msg.bytes;
    data.truncate(n);
    Ok((data, fds))
}

/// What the spawner may start, and as whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowlist {
    /// Exact program paths.
    pub programs: Vec<PathBuf>,
    /// modprobe may run, with exactly `vfio-pci` as its argument (passthrough configured).
    pub modprobe: bool,
    /// Programs that always run as another user (the QEMU binary as `qemu.user`), whatever
    /// the request says.
    pub run_as: Vec<(PathBuf, UserIds)>,
    /// `accel = "kvm"`: a program run as another user keeps the group owning `/dev/kvm` when
    /// that user is a member ([`crate::qemu::kvm::qemu_groups`]).
    pub kvm: bool,
    /// VFIO group nodes may be handed to QEMU's group ([`vfio_node`]): passthrough configured.
    pub vfio_nodes: bool,
    /// `paths.boot`: the only directories a kernel or initrd is opened beneath
    /// ([`crate::qemu::boot_files::open_under`]), whatever path the daemon asks for.
    pub boot_dirs: Vec<PathBuf>,
    /// `images.curl`: may run with the arguments and the config on stdin that
    /// [`crate::images::download`] makes, and is the only program that may connect to a TCP
    /// port.
    pub fetch: Option<PathBuf>,
}

impl Allowlist {
    /// The user `program` runs as: its `run_as` entry, else the spawner's own.
    pub fn user_for(&self, program: &Path) -> Option<UserIds> {
        self.run_as.iter().find(|(p, _)| p == program).map(|(_, u)| *u)
    }

    /// Whether `program` is the image download (`images.curl`): the one program that keeps IP
    /// sockets and the spawner's TCP ports ([`super::child_seccomp`]).
    pub fn is_download(&self, program: &Path) -> bool {
        self.fetch.as_deref() == Some(program)
    }

    /// Whether `program ARGS` may run (a `run` request) with `stdin` (none: `/dev/null`); only
    /// curl reads anything on stdin.
    pub fn permits(&self, program: &Path, args: &[String], stdin: Option<&str>) -> bool {
        if MODPROBE.iter().any(|m| Path::new(m) == program) {
            return stdin.is_none() && self.modprobe && args == ["vfio-pci"];
        }
        if self.fetch.as_deref() == Some(program) {
            return crate::images::download::permits(args, stdin);
        }
        stdin.is_none() && self.programs.iter().any(|p| p == program)
    }
}

/// Creates the daemon↔spawner socket pair: `(daemon end, spawner end)`.
///
/// # Errors
/// socketpair failed.
pub(crate) fn control_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?)
}

/// Makes `control` the daemon's way to start programs (called once, in the daemon).
///
/// # Errors
/// The socket cannot be made non-blocking.
pub(crate) fn install(control: OwnedFd) -> io::Result<()> {
    let _ = SPAWNER.set(Control::new(control)?);
    Ok(())
}

struct Running {
    child: std::process::Child,
    pidfd: Option<OwnedFd>,
    reply: OwnedFd,
}

fn send_reply(sock: &OwnedFd, reply: &Reply, fd: Option<&OwnedFd>) {
    let mut line = serde_json::to_vec(reply).unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    let raw: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
    let cmsgs: Vec<ControlMessage> = if raw.is_empty() { Vec::new() } else { vec![ControlMessage::ScmRights(&raw)] };
    // The reply socket is non-blocking and holds at most two short lines: a failure means the
    // daemon side is gone, and then nobody is waiting for the answer.
    let _ = sendmsg::<()>(sock.as_raw_fd(), &[IoSlice::new(&line)], &cmsgs, MsgFlags::MSG_NOSIGNAL, None);
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open returns a new fd or -1.
    let ret = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    let fd = i32::try_from(ret).ok().filter(|f| *f >= 0)?;
    // SAFETY: the kernel just returned this new descriptor; we own it.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The spawner's loop: serve requests on `control` until the daemon closes it, then exit.
/// Runs in the forked spawner process, which is single-threaded.
pub(crate) fn serve(control: OwnedFd, allow: &Allowlist, ambient_sys_module: bool) -> ! {
    let nested = super::landlock::child_domain();
    let no_ip = super::child_seccomp::program();
    let mut running: Vec<Running> = Vec::new();
    let mut copies = crate::qemu::boot_files::CopyCache::default();
    loop {
        let mut pfds: Vec<libc::pollfd> =
            vec![libc::pollfd { fd: control.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        for r in &running {
            let fd = r.pidfd.as_ref().map_or(-1, AsRawFd::as_raw_fd);
            pfds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
        }
        // Without pidfds (old kernels) poll with a timeout and try_wait everything.
        let timeout = if running.iter().any(|r| r.pidfd.is_none()) { 50 } else { -1 };
        // SAFETY: pfds is a valid array of pollfd of the given length.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            std::process::exit(1);
        }
        // Reap what exited. Backwards, so swap_remove only moves entries already looked at and
        // `pfds[i + 1]` stays the entry of `running[i]`.
        for i in (0..running.len()).rev() {
            let ready = pfds[i + 1].revents != 0 || running[i].pidfd.is_none();
            if ready {
                if let Ok(Some(status)) = running[i].child.try_wait() {
                    let r = running.swap_remove(i);
                    send_reply(&r.reply, &Reply { status: Some(status.into_raw()), ..Reply::default() }, None);
                }
            }
        }
        if pfds[0].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) == 0 {
            continue;
        }
        let (bytes, mut fds) = match recv_with_fds(control.as_raw_fd(), MsgFlags::empty()) {
            Ok(got) => got,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            // More descriptors than a request may carry (MSG_CTRUNC): the kernel closed the
            // surplus; drop the request, keep serving.
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => continue,
            Err(_) => std::process::exit(0),
        };
        if bytes.is_empty() && fds.is_empty() {
            // The daemon closed its end: it is gone. Programs still running are left alone,
            // like a daemon that was killed leaves them.
            std::process::exit(0);
        }
        if fds.is_empty() {
            continue;
        }
        let reply = fds.remove(0);
        let failed = |e: io::Error| Reply { error: Some(e.to_string()), errno: e.raw_os_error(), ..Reply::default() };
        let req = match serde_json::from_slice::<Request>(&bytes) {
            Ok(req) => req,
            Err(e) => {
                send_reply(&reply, &failed(io::Error::new(io::ErrorKind::InvalidInput, e)), None);
                continue;
            }
        };
        match req {
            Request::Run(run) => match start(run, fds, allow, ambient_sys_module, nested.as_ref(), &no_ip) {
                Ok(child) => {
                    let pidfd = pidfd_open(child.id());
                    let pid = i32::try_from(child.id()).unwrap_or(0);
                    send_reply(&reply, &Reply { pid: Some(pid), ..Reply::default() }, pidfd.as_ref());
                    running.push(Running { child, pidfd, reply });
                }
                Err(e) => send_reply(&reply, &failed(e), None),
            },
            Request::BootFile { path, copy } => {
                match serve_boot_file(&mut copies, &allow.boot_dirs, Path::new(&path), copy) {
                    Ok(fd) => send_reply(&reply, &Reply { ok: Some(true), ..Reply::default() }, fd.as_ref()),
                    Err(e) => send_reply(&reply, &failed(e), None),
                }
            }
            Request::KvmAccess => {
                let user = allow.run_as.first().map(|(_, u)| *u);
                match crate::qemu::kvm::probe_as_qemu(user) {
                    Ok(access) => {
                        send_reply(&reply, &Reply { access: Some(access), ..Reply::default() }, None);
                    }
                    Err(e) => send_reply(&reply, &failed(e), None),
                }
            }
            Request::VfioNode { group, gid, mode } => {
                let changed = if allow.vfio_nodes {
                    super::caps::with_effective(::caps::Capability::CAP_CHOWN, || set_vfio_node(group, gid, mode))
                } else {
                    Err(io::Error::new(io::ErrorKind::PermissionDenied, "no passthrough configured"))
                };
                match changed {
                    Ok(node) => send_reply(&reply, &Reply { node: Some(node), ..Reply::default() }, None),
                    Err(e) => send_reply(&reply, &failed(e), None),
                }
            }
        }
    }
}

/// Opens (and with `copy`, copies) a boot file in the spawner. Opening is the one thing done
/// with CAP_DAC_READ_SEARCH raised, so a file root can read boots wherever it lives
/// ([`super::caps::SPAWNER`]); the copy reads the open descriptor.
fn serve_boot_file(
    copies: &mut crate::qemu::boot_files::CopyCache,
    boot_dirs: &[PathBuf],
    path: &Path,
    copy: bool,
) -> io::Result<Option<OwnedFd>> {
    use crate::qemu::boot_files;
    let file = super::caps::with_effective(::caps::Capability::CAP_DAC_READ_SEARCH, || {
        boot_files::open_under(boot_dirs, path)
    })?;
    if copy {
        copies.copy(file, path).map(Some)
    } else {
        Ok(None)
    }
}

/// Checks and starts one request in the spawner. `nested` is the Landlock layer of every program but curl (no TCP, no reach into curl)
/// ([`super::landlock::child_domain`]), `no_ip` the seccomp program without IP sockets
/// ([`super::child_seccomp`]): every program gets both but the image download (curl).
fn start(
    req: RunRequest,
    fds: Vec<OwnedFd>,
    allow: &Allowlist,
    ambient_sys_module: bool,
    nested: Option<&OwnedFd>,
    no_ip: &[super::child_seccomp::Instruction],
) -> io::Result<std::process::Child> {
    let program = PathBuf::from(&req.program);
    if !allow.permits(&program, &req.args, req.stdin.as_deref()) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("the spawner does not run {} with these arguments (not on its allowlist)", program.display()),
        ));
    }
    // Only curl keeps the TCP ports the spawner's domain allows, and IP sockets at all.
    let download = allow.is_download(&program);
    let nested = nested.filter(|_| !download).map(AsRawFd::as_raw_fd);
    let no_ip = (!download).then(|| no_ip.to_vec());
    launch(req, fds, allow, ambient_sys_module, nested, no_ip)
}

/// Starts an allowed request: its descriptors in place, its session, limits and user, then
/// `no_ip` (the child seccomp filter, last: nothing after it but the exec).
fn launch(
    req: RunRequest,
    mut fds: Vec<OwnedFd>,
    allow: &Allowlist,
    ambient_sys_module: bool,
    nested: Option<RawFd>,
    no_ip: Option<Vec<super::child_seccomp::Instruction>>,
) -> io::Result<std::process::Child> {
    let want = usize::from(req.stdout) + usize::from(req.stderr) + req.nfds;
    if fds.len() != want || req.nfds > MAX_PASSED_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "descriptor count does not match the request"));
    }
    let program = PathBuf::from(&req.program);
    let passed = fds.split_off(usize::from(req.stdout) + usize::from(req.stderr));
    let mut stdio = fds.into_iter();
    let mut command = std::process::Command::new(&program);
    command.args(&req.args).env_clear().env("PATH", CHILD_PATH).stdin(stdin_of(req.stdin.as_deref())?);
    command.stdout(if req.stdout { stdio.next().map_or_else(Stdio::null, Stdio::from) } else { Stdio::null() });
    command.stderr(if req.stderr { stdio.next().map_or_else(Stdio::null, Stdio::from) } else { Stdio::null() });
    let raw: Vec<RawFd> = passed.iter().map(AsRawFd::as_raw_fd).collect();
    let setup = ChildSetup::new(req.memlock, allow.user_for(&program), allow.kvm);
    let raise_module = ambient_sys_module && MODPROBE.iter().any(|m| Path::new(m) == program);
    // SAFETY: only async-signal-safe calls (setsid, setrlimit, setgroups, setgid, setuid, umask,
    // prctl, landlock_restrict_self, fcntl, dup2, seccomp), no allocation: the filter's program
    // was built before the fork.
    unsafe {
        command.pre_exec(move || {
            setup.apply()?;
            if let Some(ruleset) = nested {
                // Landlock needs no_new_privs; the spawner's own domain set it, unless that failed.
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                    || libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            if raise_module {
                // modprobe gets CAP_SYS_MODULE as an ambient capability; nothing else gets any.
                let cap = libc::c_ulong::from(super::caps::CAP_SYS_MODULE);
                if libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong, cap, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            place_fds(&raw)?;
            match &no_ip {
                Some(program) => super::child_seccomp::install(program),
                None => Ok(()),
            }
        });
    }
    let child = command.spawn();
    drop(passed);
    child
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowlist_is_exact() {
        let a = Allowlist {
            programs: vec!["/usr/bin/qemu-system-x86_64".into()],
            modprobe: true,
            run_as: vec![],
            kvm: false,
            vfio_nodes: false,
            boot_dirs: vec![],
            fetch: None,
        };
        assert!(a.permits(Path::new("/usr/bin/qemu-system-x86_64"), &["-version".into()], None));
        assert!(!a.permits(Path::new("/usr/bin/qemu-img2"), &[], None));
        assert!(!a.permits(Path::new("/bin/sh"), &["-c".into(), "id".into()], None));
        assert!(a.permits(Path::new("/usr/sbin/modprobe"), &["vfio-pci".into()], None));
        assert!(!a.permits(Path::new("/usr/sbin/modprobe"), &["evil".into()], None));
        assert!(!a.permits(Path::new("/usr/sbin/modprobe"), &["-r".into(), "vfio-pci".into()], None));
        let no_pci = Allowlist { modprobe: false, ..a.clone() };
        assert!(!no_pci.permits(Path::new("/sbin/modprobe"), &["vfio-pci".into()], None));
        // qemu-img is not a program the daemon needs (image work is QEMU's, as qemu.user).
        assert!(!a.permits(Path::new("/usr/bin/qemu-img"), &["info".into()], None));
        // Only curl reads a config on stdin.
        assert!(!a.permits(Path::new("/usr/bin/qemu-system-x86_64"), &["-version".into()], Some("x")));
        assert!(!a.permits(Path::new("/usr/sbin/modprobe"), &["vfio-pci".into()], Some("")));
    }

    #[test]
    fn a_stalled_spawner_blocks_no_runtime_thread() {
        const REQUESTS: usize = 5000;
        let (daemon_end, spawner_end) = control_pair().unwrap();
        let control = std::sync::Arc::new(Control::new(daemon_end).unwrap());
        let probe = control.fd.try_clone().unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let runtime = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let sender = {
                    let (c, sent) = (control.clone(), sent.clone());
                    tokio::spawn(async move {
                        for _ in 0..REQUESTS {
                            send_request(&c, &Request::KvmAccess, Vec::new()).await?;
                            sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        io::Result::Ok(())
                    })
                };
                // This task runs on the same single thread: it gets here again only if the
                // sender yields when the socket is full.
                loop {
                    tokio::task::yield_now().await;
                    let full = matches!(
                        sendmsg::<()>(probe.as_raw_fd(), &[IoSlice::new(b"")], &[], MsgFlags::MSG_DONTWAIT, None),
                        Err(nix::errno::Errno::EAGAIN)
                    );
                    if full && sent.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                        break;
                    }
                }
                if sender.is_finished() {
                    panic!("the sender did not wait for room: {:?}", sender.await);
                }
                // The spawner wakes up and drains: every request arrives, whole.
                let drain = std::thread::spawn(move || {
                    let mut got = 0;
                    while got < REQUESTS {
                        let (bytes, fds) = recv_with_fds(spawner_end.as_raw_fd(), MsgFlags::empty()).unwrap();
                        if bytes.is_empty() {
                            continue; // the probe's empty records
                        }
                        assert!(serde_json::from_slice::<Request>(&bytes).is_ok());
                        assert_eq!(fds.len(), 1, "the reply socket");
                        got += 1;
                    }
                });
                sender.await.unwrap().unwrap();
                drain.join().unwrap();
            });
            let _ = done_tx.send(());
        });
        // A deadlock guard, not a timing assertion: with a blocking send the runtime never ends.
        if done_rx.recv_timeout(std::time::Duration::from_secs(120)).is_err() {
            panic!("the runtime's only thread is blocked by the stalled spawner");
        }
        runtime.join().unwrap();
    }

    #[test]
    fn a_vfio_node_is_handed_over_and_put_back_within_its_limits() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("7");
        let c = std::ffi::CString::new(node.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mknod with a valid path (the tests run as root); /dev/null's numbers.
        assert_eq!(unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3)) }, 0);
        let before = set_node(&node, 7, 4321, 0o660).unwrap();
        assert_eq!(before, NodeAccess { group: 7, gid: 0, mode: 0o600 });
        let meta = std::fs::metadata(&node).unwrap();
        assert_eq!((meta.gid(), meta.mode() & 0o7777), (4321, 0o660));
        // Release puts back what was recorded.
        assert_eq!(set_node(&node, 7, before.gid, before.mode).unwrap().mode, 0o660);
        let meta = std::fs::metadata(&node).unwrap();
        assert_eq!((meta.gid(), meta.mode() & 0o7777), (0, 0o600));
        // Never for others, never setuid or executable; never a regular file.
        for mode in [0o666, 0o4660, 0o770] {
            assert_eq!(set_node(&node, 7, 0, mode).unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        }
        let file = dir.path().join("8");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(set_node(&file, 8, 0, 0o660).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(std::fs::metadata(&node).unwrap().mode() & 0o7777, 0o600);
    }

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

    /// Process group and session of `pid` (fields 5 and 6 of /proc/PID/stat; `self` works).
    fn pgrp_and_session(pid: &str) -> (i32, i32) {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // The command name (field 2) may hold spaces; the fields after it do not.
        let rest: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        (rest[2].parse().unwrap(), rest[3].parse().unwrap())
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

    /// An allowlist of `/bin/sleep` alone.
    fn sleep_only() -> Allowlist {
        Allowlist {
            programs: vec!["/bin/sleep".into()],
            modprobe: false,
            run_as: vec![],
            kvm: false,
            vfio_nodes: false,
            boot_dirs: vec![],
            fetch: None,
        }
    }

    #[test]
    fn spawner_children_get_their_own_session_and_group() {
        // The spawner's `start`, called in this process (no spawner fork needed to check it).
        let allow = sleep_only();
        let req = RunRequest {
            program: "/bin/sleep".into(),
            args: vec!["30".into()],
            stdin: None,
            stdout: false,
            stderr: false,
            nfds: 0,
            memlock: None,
        };
        let no_ip = crate::sandbox::child_seccomp::program();
        let mut child = start(req, Vec::new(), &allow, false, None, &no_ip).unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        assert_eq!(pgrp_and_session(&pid.to_string()), (pid, pid), "its own process group and session");
        assert_ne!(pgrp_and_session("self"), (pid, pid));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// The `Seccomp:` line of /proc/PID/status (0 none, 2 a filter).
    fn seccomp_mode(pid: u32) -> String {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status.lines().find_map(|l| l.strip_prefix("Seccomp:")).map(|v| v.trim().to_string()).unwrap_or_default()
    }

    #[test]
    fn every_spawner_child_but_the_download_runs_under_the_no_ip_filter() {
        let sleep = |allow: &Allowlist, args: Vec<String>| {
            let req = RunRequest {
                program: "/bin/sleep".into(),
                args,
                stdout: false,
                stderr: false,
                nfds: 0,
                memlock: None,
                stdin: None,
            };
            start(req, Vec::new(), allow, false, None, &crate::sandbox::child_seccomp::program()).unwrap()
        };
        let allow = sleep_only();
        assert_eq!(seccomp_mode(std::process::id()), "0", "the test process itself has no filter");
        let mut child = sleep(&allow, vec!["30".into()]);
        assert_eq!(seccomp_mode(child.id()), "2", "a program gets the filter");
        child.kill().unwrap();
        child.wait().unwrap();
        // The download: curl is recognised by its path, and started without the filter.
        let curl = Allowlist { programs: vec![], fetch: Some("/usr/bin/curl".into()), ..allow.clone() };
        assert!(curl.is_download(Path::new("/usr/bin/curl")));
        assert!(!curl.is_download(Path::new("/bin/sleep")) && !allow.is_download(Path::new("/usr/bin/curl")));
        let req = RunRequest {
            program: "/bin/sleep".into(),
            args: vec!["30".into()],
            stdout: false,
            stderr: false,
            nfds: 0,
            memlock: None,
            stdin: None,
        };
        let mut child = launch(req, Vec::new(), &allow, false, None, None).unwrap();
        assert_eq!(seccomp_mode(child.id()), "0", "the download keeps its IP sockets");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
