//! seccomp: the syscalls the daemon makes, as data.
//!
//! [`ALLOWED`] is the daemon's whole syscall table (x86_64), one entry per syscall with the
//! reason. Everything else is refused with EPERM (`seccomp = "enforce"`, the default) or allowed
//! and logged by the kernel (`seccomp = "log"`, SECCOMP_RET_LOG: `audit: type=1326 ... syscall=N`
//! in the kernel log), the mode for finding what a new code path needs. The filter is installed
//! on the daemon only: it runs no program itself (the spawner does, see [`super::spawn`]), so
//! `execve`, `ptrace`, `mount`, module loading, `bpf`, `setns`, `unshare`, namespaces and
//! credential changes are all absent from the table.
//!
//! The table was built by running every end-to-end test with `seccomp = "log"` and reading the
//! kernel log (docs/sandbox.md says how to redo that), starting from what std, tokio, glibc's
//! name service and the daemon's own code call.

use crate::config::SeccompMode;
use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};
use std::collections::BTreeMap;

/// One allowed syscall.
#[derive(Debug, Clone, Copy)]
pub struct Syscall {
    /// Its name.
    pub name: &'static str,
    /// Its number on x86_64.
    pub nr: i64,
    /// Who needs it.
    pub why: &'static str,
}

macro_rules! sys {
    ($name:ident, $why:expr) => {
        Syscall { name: stringify!($name), nr: libc::$name as i64, why: $why }
    };
}

const IO: &str = "file and socket I/O";
const FS: &str = "state records, overlays' metadata, run dir, sysfs, /proc";
const MEM: &str = "memory allocation";
const THREAD: &str = "tokio's worker and blocking threads";
const SIG: &str = "signal handling (SIGTERM, SIGINT)";
const TIME: &str = "timers and timeouts";
const EPOLL: &str = "tokio's event loop";
const SOCK: &str = "the API socket, QMP and agent sockets, netlink, the spawner";
const PROC: &str = "watching and signalling QEMU processes";
const ID: &str = "credentials for access checks and logs";

/// The daemon's syscalls.
pub const ALLOWED: &[Syscall] = &[
    sys!(SYS_read, IO),
    sys!(SYS_write, IO),
    sys!(SYS_readv, IO),
    sys!(SYS_writev, IO),
    sys!(SYS_pread64, IO),
    sys!(SYS_pwrite64, IO),
    sys!(SYS_lseek, IO),
    sys!(SYS_close, IO),
    sys!(SYS_close_range, IO),
    sys!(SYS_ioctl, "tap devices (TUNSETIFF), FIONBIO, terminal checks"),
    sys!(SYS_fcntl, IO),
    sys!(SYS_dup, IO),
    sys!(SYS_dup2, IO),
    sys!(SYS_dup3, IO),
    sys!(SYS_pipe2, "pipes for a child's stdout and stderr (sent to the spawner)"),
    sys!(SYS_flock, "the state directory's lock"),
    sys!(SYS_fsync, "atomic record writes"),
    sys!(SYS_fdatasync, "atomic record writes"),
    sys!(SYS_ftruncate, FS),
    sys!(SYS_fallocate, "capping VM logs: FALLOC_FL_COLLAPSE_RANGE drops their oldest part (logcap)"),
    sys!(SYS_sendfile, "copying files"),
    sys!(SYS_copy_file_range, "copying files"),
    sys!(SYS_open, FS),
    sys!(SYS_openat, FS),
    sys!(SYS_stat, FS),
    sys!(SYS_fstat, FS),
    sys!(SYS_lstat, FS),
    sys!(SYS_newfstatat, FS),
    sys!(SYS_statx, FS),
    sys!(SYS_statfs, FS),
    sys!(SYS_fstatfs, FS),
    sys!(SYS_access, FS),
    sys!(SYS_faccessat, FS),
    sys!(SYS_faccessat2, FS),
    sys!(SYS_getdents64, FS),
    sys!(SYS_readlink, FS),
    sys!(SYS_readlinkat, FS),
    sys!(SYS_getcwd, FS),
    sys!(SYS_mkdir, FS),
    sys!(SYS_mkdirat, FS),
    sys!(SYS_rmdir, FS),
    sys!(SYS_unlink, FS),
    sys!(SYS_unlinkat, FS),
    sys!(SYS_rename, FS),
    sys!(SYS_renameat, FS),
    sys!(SYS_renameat2, FS),
    sys!(SYS_chmod, "the API socket's mode; a VFIO group device's mode for QEMU"),
    sys!(SYS_fchmod, "the API socket's mode"),
    sys!(SYS_fchmodat, "the API socket's mode; a VFIO group device's mode for QEMU"),
    sys!(SYS_fchownat, "a VFIO group device to the group of qemu.user"),
    sys!(SYS_utimensat, FS),
    sys!(SYS_mmap, MEM),
    sys!(SYS_munmap, MEM),
    sys!(SYS_mprotect, MEM),
    sys!(SYS_mremap, MEM),
    sys!(SYS_madvise, MEM),
    sys!(SYS_brk, MEM),
    sys!(SYS_clone, THREAD),
    sys!(SYS_clone3, THREAD),
    sys!(SYS_futex, THREAD),
    sys!(SYS_set_robust_list, THREAD),
    sys!(SYS_rseq, THREAD),
    sys!(SYS_set_tid_address, THREAD),
    sys!(SYS_sched_yield, THREAD),
    sys!(SYS_sched_getaffinity, "tokio sizes its thread pool"),
    sys!(SYS_gettid, THREAD),
    sys!(SYS_prctl, "thread names (PR_SET_NAME)"),
    sys!(SYS_exit, THREAD),
    sys!(SYS_exit_group, "exit"),
    sys!(SYS_membarrier, THREAD),
    sys!(SYS_rt_sigaction, SIG),
    sys!(SYS_rt_sigprocmask, SIG),
    sys!(SYS_rt_sigreturn, SIG),
    sys!(SYS_sigaltstack, "Rust's stack overflow handler"),
    sys!(SYS_tgkill, SIG),
    sys!(SYS_restart_syscall, SIG),
    sys!(SYS_nanosleep, TIME),
    sys!(SYS_clock_nanosleep, TIME),
    sys!(SYS_clock_gettime, TIME),
    sys!(SYS_gettimeofday, TIME),
    sys!(SYS_epoll_create1, EPOLL),
    sys!(SYS_epoll_ctl, EPOLL),
    sys!(SYS_epoll_wait, EPOLL),
    sys!(SYS_epoll_pwait, EPOLL),
    sys!(SYS_epoll_pwait2, EPOLL),
    sys!(SYS_eventfd2, EPOLL),
    sys!(SYS_poll, "blocking waits"),
    sys!(SYS_ppoll, "blocking waits"),
    sys!(SYS_socket, SOCK),
    sys!(SYS_socketpair, SOCK),
    sys!(SYS_bind, SOCK),
    sys!(SYS_listen, SOCK),
    sys!(SYS_accept, SOCK),
    sys!(SYS_accept4, SOCK),
    sys!(SYS_connect, SOCK),
    sys!(SYS_shutdown, SOCK),
    sys!(SYS_getsockname, SOCK),
    sys!(SYS_getpeername, SOCK),
    sys!(SYS_getsockopt, "SO_PEERCRED of API peers"),
    sys!(SYS_setsockopt, SOCK),
    sys!(SYS_sendto, SOCK),
    sys!(SYS_recvfrom, SOCK),
    sys!(SYS_sendmsg, SOCK),
    sys!(SYS_recvmsg, SOCK),
    sys!(SYS_sendmmsg, SOCK),
    sys!(SYS_recvmmsg, SOCK),
    sys!(SYS_kill, PROC),
    sys!(SYS_pidfd_open, PROC),
    sys!(SYS_pidfd_send_signal, PROC),
    sys!(SYS_waitid, PROC),
    sys!(SYS_wait4, PROC),
    sys!(SYS_getpid, ID),
    sys!(SYS_getppid, ID),
    sys!(SYS_getuid, ID),
    sys!(SYS_geteuid, ID),
    sys!(SYS_getgid, ID),
    sys!(SYS_getegid, ID),
    sys!(SYS_getresuid, ID),
    sys!(SYS_getresgid, ID),
    sys!(SYS_getgroups, ID),
    sys!(SYS_capget, "reading its own capabilities for host.check"),
    sys!(SYS_getrandom, "hash map seeds, MAC addresses"),
    sys!(SYS_uname, "glibc"),
    sys!(SYS_sysinfo, "glibc"),
    sys!(SYS_getrlimit, "resource limits"),
    sys!(SYS_prlimit64, "resource limits"),
    sys!(SYS_getpriority, "glibc"),
];

/// Syscalls that must never be in the table: if one is needed, the design has changed.
pub const NEVER: &[(&str, i64)] = &[
    ("execve", libc::SYS_execve),
    ("execveat", libc::SYS_execveat),
    ("ptrace", libc::SYS_ptrace),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("bpf", libc::SYS_bpf),
    ("setns", libc::SYS_setns),
    ("unshare", libc::SYS_unshare),
    ("setuid", libc::SYS_setuid),
    ("setgid", libc::SYS_setgid),
    ("capset", libc::SYS_capset),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("kexec_load", libc::SYS_kexec_load),
    ("reboot", libc::SYS_reboot),
    ("chroot", libc::SYS_chroot),
    ("pivot_root", libc::SYS_pivot_root),
];

/// seccomp errors.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// The filter could not be compiled.
    #[error("seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    /// The kernel refused the filter.
    #[error("cannot install the seccomp filter: {0}")]
    Install(#[from] seccompiler::Error),
}

/// Compiles the daemon's filter for `mode`.
///
/// # Errors
/// [`SeccompError::Build`] (a duplicate or invalid entry).
pub fn build(mode: SeccompMode) -> Result<BpfProgram, SeccompError> {
    let rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> = ALLOWED.iter().map(|s| (s.nr, Vec::new())).collect();
    let mismatch = match mode {
        SeccompMode::Enforce => SeccompAction::Errno(libc::EPERM as u32),
        SeccompMode::Log => SeccompAction::Log,
    };
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)?;
    Ok(filter.try_into()?)
}

/// Installs the filter on the calling thread (before other threads exist: the whole process,
/// and every thread it creates later).
///
/// # Errors
/// [`SeccompError`] when it cannot be built or installed.
pub fn apply(mode: SeccompMode) -> Result<usize, SeccompError> {
    let program = build(mode)?;
    seccompiler::apply_filter(&program)?;
    Ok(ALLOWED.len())
}

/// The `Seccomp:` line of /proc/self/status: 0 off, 1 strict, 2 filter.
pub fn status_of_self() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("Seccomp:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn table_has_no_duplicates_and_no_forbidden_calls() {
        let mut seen = HashSet::new();
        for s in ALLOWED {
            assert!(seen.insert(s.nr), "{} listed twice", s.name);
            assert!(s.name.starts_with("SYS_"), "{}", s.name);
            assert!(!s.why.is_empty());
        }
        for (name, nr) in NEVER {
            assert!(!seen.contains(nr), "{name} must not be allowed");
        }
    }

    #[test]
    fn both_modes_compile() {
        assert!(!build(SeccompMode::Enforce).unwrap().is_empty());
        assert!(!build(SeccompMode::Log).unwrap().is_empty());
    }

    #[test]
    fn enforce_refuses_what_is_not_listed() {
        // In a forked child, so the test process keeps no filter. Built before the fork: the
        // child of a multi-threaded process must not allocate.
        let program = build(SeccompMode::Enforce).unwrap();
        // SAFETY: the child only makes raw syscalls and _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: plain prctl.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
            let code = if seccompiler::apply_filter(&program).is_err() {
                3
            } else {
                // SAFETY: chroot of "/" is harmless, and must fail with EPERM here.
                let r = unsafe { libc::chroot(c"/".as_ptr()) };
                // SAFETY: reading errno right after the call.
                let errno = unsafe { *libc::__errno_location() };
                // SAFETY: getpid is allowed.
                let ok = unsafe { libc::getpid() } > 0;
                if r == -1 && errno == libc::EPERM && ok {
                    0
                } else {
                    4
                }
            };
            // SAFETY: leave the forked child without running destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "child died: {status}");
        assert_eq!(libc::WEXITSTATUS(status), 0);
    }
}
