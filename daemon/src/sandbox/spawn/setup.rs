//! What every started program gets between fork and exec, whichever process forks it (the
//! spawner, or the daemon without one): its own session, its CPU affinity, its memlock limit,
//! its user and groups, its stdin, and the passed descriptors in place at [`FIRST_PASSED_FD`]
//! and up.
//!
//! The lowest layer of the spawner: it knows nothing of the wire or of who asks. Everything
//! here after the fork is async-signal-safe and allocates nothing; what needs the group
//! database or a pipe is prepared before the fork. Used in this order: [`stdin_of`] and
//! [`ChildSetup::new`] before the fork, then [`ChildSetup::apply`] and [`place_fds`] in the
//! child. [`become_user`] is shared with the `/dev/kvm` probe ([`crate::qemu::kvm`]), which forks
//! a child of its own.

use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::process::Stdio;

use crate::config::UserIds;

/// The fd number the first passed descriptor gets in the child.
pub const FIRST_PASSED_FD: i32 = 3;

/// At most this many descriptors are passed to one child: a VM's multiqueue NICs bring one tap
/// and one vhost-net descriptor per queue ([`crate::nic::MAX_VM_QUEUES`] in all, 181 descriptors
/// at most with every other a VM can have); one request's descriptors travel in one message, and
/// the kernel takes at most 253 there (`SCM_MAX_FD`).
pub const MAX_PASSED_FDS: usize = 200;

/// Most bytes of [`Command::stdin_data`]: what a pipe always holds (one page, even for a user
/// over the kernel's pipe-buffer limits), so writing it never blocks.
pub const MAX_STDIN: usize = 4096;

/// `PATH` of every program the spawner starts.
pub(super) const CHILD_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// Moves `fds` to 3, 4, ... in a freshly forked child. Runs between fork and exec, so it only
/// uses async-signal-safe calls (fcntl, dup2) and allocates nothing.
pub(super) fn place_fds(fds: &[RawFd]) -> io::Result<()> {
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
/// starts it: its own session, then its CPU affinity, then its memlock limit, then its user.
pub(super) struct ChildSetup {
    /// The CPUs the program (and every thread it makes) may run on ([`cpu_mask`]); `None`
    /// inherits the forking process's.
    affinity: Option<nix::sched::CpuSet>,
    memlock: Option<u64>,
    user: Option<UserIds>,
    /// Computed before the fork (it reads /dev/kvm and the group database).
    groups: Vec<u32>,
}

impl ChildSetup {
    /// `groups`: the supplementary groups `user` keeps ([`super::client::groups_for`]), looked
    /// up by the caller, since that reads `/dev/kvm` and the group database.
    pub(super) fn new(memlock: Option<u64>, user: Option<UserIds>, groups: Vec<u32>) -> ChildSetup {
        ChildSetup { affinity: None, memlock, user, groups }
    }

    /// Runs the program on `mask`'s CPUs only ([`cpu_mask`]): set by the child on itself before
    /// the exec, so every thread the program ever makes starts there (QEMU's vCPU threads are
    /// pinned one by one later; its other threads stay on this set).
    pub(super) fn with_affinity(mut self, mask: Option<nix::sched::CpuSet>) -> ChildSetup {
        self.affinity = mask;
        self
    }

    /// Runs in the forked child: only async-signal-safe calls, no allocation.
    pub(super) fn apply(&self) -> io::Result<()> {
        // Its own session and process group, whatever the program (module doc).
        new_session()?;
        // A task may always narrow its own affinity, before or after the user change; before
        // keeps it beside the other process-wide settings.
        if let Some(mask) = &self.affinity {
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), mask).map_err(io::Error::from)?;
        }
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

/// The kernel's affinity mask for `cpus`, built before the fork (the child only installs it).
///
/// # Errors
/// A CPU number beyond what a `cpu_set_t` holds (`InvalidInput`).
pub(super) fn cpu_mask(cpus: &[u32]) -> io::Result<nix::sched::CpuSet> {
    crate::placement::cpuset::kernel_mask(cpus.iter().copied())
        .map_err(|cpu| io::Error::new(io::ErrorKind::InvalidInput, format!("CPU {cpu} is beyond the affinity mask")))
}

/// The child's stdin: `data` in a pipe, or `/dev/null`.
pub(super) fn stdin_of(data: Option<&str>) -> io::Result<Stdio> {
    Ok(match data {
        Some(d) => Stdio::from(stdin_pipe(d)?),
        None => Stdio::null(),
    })
}
