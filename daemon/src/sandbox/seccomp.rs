//! seccomp: the syscalls the daemon makes, as data.
//!
//! [`ALLOWED`] is the daemon's whole syscall table (x86_64), one entry per syscall with the
//! reason. Everything else is refused with EPERM (`seccomp = "enforce"`, the default) or allowed
//! and logged by the kernel (`seccomp = "log"`, SECCOMP_RET_LOG: `audit: type=1326 ... syscall=N`
//! in the kernel log), the mode for finding what a new code path needs. The filter is installed
//! on the daemon only: it runs no program itself (the spawner does, see [`super::spawn`]), so
//! `execve`, `ptrace`, `mount`, module loading, `bpf`, `setns`, namespaces and credential
//! changes are all absent from the table.
//!
//! Three calls are allowed only with some arguments ([`ARG_RULES`]), because their other uses
//! would undo the sandbox: `clone` only with the flags of a new thread (no new namespace, no
//! fork), `unshare` only with `CLONE_FS` (a thread's own umask, for the API socket's mode, see
//! [`super::socket`]), and `clone3`, whose flags sit in a struct a filter cannot read, is
//! answered `ENOSYS` (by instructions put before the table, [`build`]), so glibc falls back to
//! `clone`. No path-based `chmod`, `fchmodat` or `fchownat`: a compromised daemon cannot open up
//! a device node by name; the VFIO group nodes QEMU needs are changed by the spawner
//! ([`super::spawn::vfio_node`]).
//!
//! The table was built by running every end-to-end test with `seccomp = "log"` and reading the
//! kernel log (docs/sandbox.md says how to redo that), starting from what std, tokio, glibc's
//! name service and the daemon's own code call.

use crate::config::SeccompMode;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};
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
    sys!(SYS_fchmod, "files the daemon opened itself (a descriptor, never a path)"),
    sys!(SYS_umask, "the API socket's mode, in a thread with its own umask"),
    sys!(SYS_utimensat, FS),
    sys!(SYS_mmap, MEM),
    sys!(SYS_munmap, MEM),
    sys!(SYS_mprotect, MEM),
    sys!(SYS_mremap, MEM),
    sys!(SYS_madvise, MEM),
    sys!(SYS_brk, MEM),
    sys!(SYS_clone, "tokio's worker and blocking threads (thread flags only, ARG_RULES)"),
    sys!(SYS_unshare, "CLONE_FS only (ARG_RULES): a thread's own umask for the API socket"),
    sys!(SYS_futex, THREAD),
    sys!(SYS_set_robust_list, THREAD),
    sys!(SYS_rseq, THREAD),
    sys!(SYS_set_tid_address, THREAD),
    sys!(SYS_sched_yield, THREAD),
    sys!(SYS_sched_getaffinity, "tokio sizes its thread pool"),
    sys!(SYS_sched_setaffinity, "pinning QEMU's threads to a VM's placement (placement::pin)"),
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
    sys!(SYS_getsockopt, "SO_PEERCRED of API peers, SO_ERROR of a migration stream's connect"),
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
    ("clone3", libc::SYS_clone3),
    ("chmod", libc::SYS_chmod),
    ("fchmodat", libc::SYS_fchmodat),
    ("fchmodat2", 452),
    ("chown", libc::SYS_chown),
    ("lchown", libc::SYS_lchown),
    ("fchownat", libc::SYS_fchownat),
    ("setuid", libc::SYS_setuid),
    ("setgid", libc::SYS_setgid),
    ("capset", libc::SYS_capset),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("kexec_load", libc::SYS_kexec_load),
    ("reboot", libc::SYS_reboot),
    ("chroot", libc::SYS_chroot),
    ("pivot_root", libc::SYS_pivot_root),
];

/// The flags glibc's `pthread_create` passes to `clone` (its fallback when `clone3` says
/// ENOSYS): a thread sharing everything, and nothing else.
pub const THREAD_FLAGS: u64 = (libc::CLONE_VM
    | libc::CLONE_FS
    | libc::CLONE_FILES
    | libc::CLONE_SIGHAND
    | libc::CLONE_THREAD
    | libc::CLONE_SYSVSEM
    | libc::CLONE_SETTLS
    | libc::CLONE_PARENT_SETTID
    | libc::CLONE_CHILD_CLEARTID) as u64;

/// What a `clone` must include to be a thread (not a fork sharing some things).
const THREAD_REQUIRED: u64 = (libc::CLONE_VM | libc::CLONE_SIGHAND | libc::CLONE_THREAD) as u64;

/// Syscalls of [`ALLOWED`] that are allowed only with these arguments: (syscall, argument 0
/// masked with the mask, must equal the value), every condition of an entry must hold.
pub const ARG_RULES: &[(i64, &[(u64, u64)])] = &[
    // No flag outside the thread flags (no CLONE_NEW*, no CLONE_VFORK or exit signal), and the
    // ones that make it a thread.
    (libc::SYS_clone, &[(!THREAD_FLAGS, 0), (THREAD_REQUIRED, THREAD_REQUIRED)]),
    // Exactly CLONE_FS: a private umask and cwd, no namespace.
    (libc::SYS_unshare, &[(u64::MAX, libc::CLONE_FS as u64)]),
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
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = ALLOWED.iter().map(|s| (s.nr, Vec::new())).collect();
    for (nr, conditions) in ARG_RULES {
        let conditions = conditions
            .iter()
            .map(|(mask, value)| {
                SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(*mask), *value)
            })
            .collect::<Result<Vec<_>, _>>()?;
        rules.insert(*nr, vec![SeccompRule::new(conditions)?]);
    }
    let mismatch = match mode {
        SeccompMode::Enforce => SeccompAction::Errno(libc::EPERM as u32),
        SeccompMode::Log => SeccompAction::Log,
    };
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)?;
    let table: BpfProgram = filter.try_into()?;
    let mut program = clone3_enosys();
    program.extend(table);
    Ok(program)
}

/// Instructions run before the table: on x86_64, `clone3` returns ENOSYS (in both modes, so
/// glibc always takes its `clone` fallback, whose flags the table checks). Anything else falls
/// through to the table, which starts over with its own architecture check.
fn clone3_enosys() -> BpfProgram {
    use seccompiler::sock_filter;
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    // Offsets in struct seccomp_data: nr at 0, arch at 4.
    // AUDIT_ARCH_X86_64: EM_X86_64 (62) | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE.
    let arch: u32 = 0xC000_003E;
    vec![
        sock_filter { code: LD_W_ABS, jt: 0, jf: 0, k: 4 },
        sock_filter { code: JEQ_K, jt: 0, jf: 3, k: arch },
        sock_filter { code: LD_W_ABS, jt: 0, jf: 0, k: 0 },
        sock_filter { code: JEQ_K, jt: 0, jf: 1, k: libc::SYS_clone3 as u32 },
        sock_filter { code: RET_K, jt: 0, jf: 0, k: libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32 },
    ]
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

    /// Makes [`filtered_process_probe`] run: the directory holding the device node it tries.
    const PROBE_VAR: &str = "VMHOST_TEST_SECCOMP_PROBE_DIR";

    /// The daemon's filter, put on a fresh process (this test binary run again for
    /// [`filtered_process_probe`]): no new namespace, no path-based chmod or chown of a device
    /// node, and threads (a tokio runtime) still work.
    #[test]
    fn the_filter_refuses_namespaces_and_device_chmod_but_runs_threads() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("null");
        let c = std::ffi::CString::new(node.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mknod with a valid path; /dev/null's numbers.
        let made = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3)) };
        assert_eq!(made, 0, "mknod (the tests run as root): {}", std::io::Error::last_os_error());
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "sandbox::seccomp::tests::filtered_process_probe", "--ignored", "--nocapture"])
            .env(PROBE_VAR, dir.path())
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{text}");
        assert!(text.contains("seccomp-probe: done"), "the probe did not run:\n{text}");
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&node).unwrap();
        assert_eq!((meta.mode() & 0o7777, meta.uid(), meta.gid()), (0o600, 0, 0), "the node is unchanged");
    }

    fn errno_of(ret: libc::c_long) -> i32 {
        if ret == -1 {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
        } else {
            0
        }
    }

    #[test]
    #[ignore = "run in a child process by the_filter_refuses_namespaces_and_device_chmod_but_runs_threads"]
    fn filtered_process_probe() {
        let Some(dir) = std::env::var_os(PROBE_VAR) else { return };
        let node = std::path::Path::new(&dir).join("null");
        let c = std::ffi::CString::new(node.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: plain prctl.
        assert_eq!(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }, 0);
        // The filter binds this thread and every thread it creates from here on.
        apply(SeccompMode::Enforce).unwrap();
        let eperm = libc::EPERM;
        // SAFETY (all raw calls below): syscalls with plain integer or valid pointer arguments;
        // any that unexpectedly succeeds in creating a process exits that process at once.
        unsafe {
            for flags in
                [libc::CLONE_NEWNS, libc::CLONE_NEWUSER, libc::CLONE_NEWNET, libc::CLONE_FS | libc::CLONE_NEWNS]
            {
                assert_eq!(errno_of(libc::unshare(flags).into()), eperm, "unshare({flags:#x})");
            }
            assert_eq!(errno_of(libc::setns(0, 0).into()), eperm, "setns");
            // A fork, and a clone into a new user namespace: refused.
            for flags in [libc::SIGCHLD, libc::CLONE_NEWUSER | libc::SIGCHLD, THREAD_FLAGS as i32 | libc::CLONE_NEWNS] {
                let r = libc::syscall(libc::SYS_clone, flags as libc::c_ulong, 0usize, 0usize, 0usize, 0usize);
                if r == 0 {
                    libc::_exit(0);
                }
                assert_eq!(errno_of(r), eperm, "clone({flags:#x})");
            }
            // clone3: ENOSYS, whatever its struct says.
            let mut args = [0u64; 11];
            args[0] = libc::CLONE_NEWUSER as u64;
            let r = libc::syscall(libc::SYS_clone3, args.as_mut_ptr(), std::mem::size_of_val(&args));
            if r == 0 {
                libc::_exit(0);
            }
            assert_eq!(errno_of(r), libc::ENOSYS, "clone3");
            assert_eq!(errno_of(libc::chmod(c.as_ptr(), 0o666).into()), eperm, "chmod");
            assert_eq!(errno_of(libc::fchmodat(libc::AT_FDCWD, c.as_ptr(), 0o666, 0).into()), eperm, "fchmodat");
            assert_eq!(errno_of(libc::chown(c.as_ptr(), 0, 1).into()), eperm, "chown");
            assert_eq!(errno_of(libc::fchownat(libc::AT_FDCWD, c.as_ptr(), 0, 1, 0).into()), eperm, "fchownat");
            assert_eq!(errno_of(libc::syscall(452, libc::AT_FDCWD, c.as_ptr(), 0o666, 0)), eperm, "fchmodat2");
        }
        // Threads: std's, and a multi-threaded tokio runtime with its blocking pool.
        assert_eq!(std::thread::spawn(|| 7).join().unwrap(), 7);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let got = rt.block_on(async {
            let a = tokio::spawn(async { 1 }).await.unwrap();
            let b = tokio::task::spawn_blocking(|| 2).await.unwrap();
            a + b
        });
        assert_eq!(got, 3);
        // The one allowed unshare, in a thread of its own (what the API socket's bind does).
        let fs = std::thread::spawn(|| {
            // SAFETY: unshare with a flag.
            errno_of(unsafe { libc::unshare(libc::CLONE_FS) }.into())
        });
        assert_eq!(fs.join().unwrap(), 0, "unshare(CLONE_FS)");
        println!("seccomp-probe: done");
    }
}
