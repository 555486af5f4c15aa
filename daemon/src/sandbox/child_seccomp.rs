//! The seccomp filter of every program the spawner starts except the image download: no IP
//! socket (docs/sandbox.md, docs/security.md).
//!
//! Why it exists: the packaged unit allows `AF_INET AF_INET6` for every process in it, because
//! curl fetches images for `image.import` from inside it; systemd's `RestrictAddressFamilies=`
//! cannot tell curl from QEMU. Landlock's TCP rule ([`super::landlock::child_domain`]) keeps QEMU
//! from connecting over TCP only where the kernel has Landlock's network rights (6.7 and later;
//! not Debian 12's 6.1), and no Landlock version covers UDP. So a QEMU that a guest took over
//! could reach the network on any kernel (QMP `chardev-add` of a `udp` backend simply worked).
//! This filter closes that, on every kernel with seccomp: `socket` and `socketpair` are refused
//! with `EAFNOSUPPORT` for every family but `AF_UNIX` (QEMU's monitor, agent and console are
//! Unix sockets, its taps are descriptors vmhostd hands it). We chose a filter per child over a
//! download unit of its own: the spawner already starts curl with its own rules, and a second
//! unit would need its own socket protocol to the daemon.
//!
//! Besides, the ways a program could get an IP socket without `socket`:
//! - `io_uring_setup` is `ENOSYS`: an io_uring can create sockets (`IORING_OP_SOCKET`) without
//!   the syscall the filter reads, and QEMU 7.2 sets one up for its event loop at start. Refused,
//!   QEMU polls with ppoll/epoll, as on a kernel without io_uring (VM disks never use
//!   `aio=io_uring`).
//! - `pidfd_getfd`, `ptrace`, `process_vm_readv` and `process_vm_writev` are `EPERM`: curl runs
//!   as the same user as QEMU, and these would let QEMU take curl's socket or its memory.
//! - x32 system calls (numbers with bit 30 set) are `ENOSYS`, and calls of a foreign
//!   architecture (i386 through `int 0x80`) kill the process: the filter's numbers are x86_64's.
//!
//! - `mkdir` and `mkdirat` are `EPERM`: swtpm writes its state in a directory that is root's,
//!   mode 0703 (`crate::tpm`): a directory it made there would be `qemu.user`'s, 0700, and the
//!   daemon (no `CAP_DAC_OVERRIDE`) could not empty it, so the VM's destroy would fail. No
//!   program the spawner starts makes a directory (QEMU has no 9p or virtiofs share here).
//!
//! Everything else is allowed: this is a deny list on top of QEMU's own `-sandbox` (which stacks
//! with it; the kernel applies the strictest answer) and the unit's `SystemCallFilter=`. It does
//! not follow the daemon's `seccomp` setting: `log` exists to find calls missing from the
//! daemon's allow list, and nothing a child legitimately does is refused here, so there is nothing
//! to find; a logging variant would only reopen the hole. It is in force whenever the spawner is
//! (`sandbox` other than `off`).
//!
//! The program is built once when the spawner starts ([`program`]) and installed between fork
//! and exec ([`install`]: `prctl(PR_SET_NO_NEW_PRIVS)`, then `seccomp(SECCOMP_SET_MODE_FILTER)`;
//! async-signal-safe, no allocation).

use std::io;

/// One BPF instruction (`struct sock_filter`).
pub type Instruction = libc::sock_filter;

/// AUDIT_ARCH_X86_64: EM_X86_64 (62) | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE.
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;

/// The x32 ABI's marker bit in a system call number.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Offsets in `struct seccomp_data`: nr, arch, the low 32 bits of args[0] (little endian).
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARG0_LOW: u32 = 16;

/// Calls answered `EPERM`: ways to take another process's socket or memory.
pub const BORROWING: [(&str, i64); 4] = [
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
];

/// Calls answered `EPERM`: making a directory (the module doc says why).
pub const MAKING_DIRECTORIES: [(&str, i64); 2] = [("mkdir", libc::SYS_mkdir), ("mkdirat", libc::SYS_mkdirat)];

/// Every call answered `EPERM`, in the program's order.
fn refused() -> impl Iterator<Item = &'static (&'static str, i64)> {
    BORROWING.iter().chain(MAKING_DIRECTORIES.iter())
}

const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const JSET_K: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

fn stmt(code: u16, k: u32) -> Instruction {
    Instruction { code, jt: 0, jf: 0, k }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> Instruction {
    Instruction { code, jt, jf, k }
}

fn errno(e: i32) -> u32 {
    libc::SECCOMP_RET_ERRNO | e as u32
}

/// The filter's program (x86_64). Layout, so the jump offsets below can be checked by eye:
///
/// ```text
///  0  ld arch;  jeq x86_64 ? 2 : kill
///  2  kill
///  3  ld nr;    jset x32 bit ? ENOSYS : 5
///  5  jeq socket ? domain : next;  jeq socketpair ? domain : next
///     jeq io_uring_setup ? ENOSYS : next;  jeq each BORROWING, MAKING_DIRECTORIES ? EPERM : next
///     allow
///     ENOSYS;  EPERM
///     domain: ld args[0];  jeq AF_UNIX ? allow : EAFNOSUPPORT
/// ```
pub fn program() -> Vec<Instruction> {
    // Tails, in this order after the checks: allow, ENOSYS, EPERM, then the domain check.
    let checks = 2 + 1 + refused().count(); // socket, socketpair, io_uring_setup, the EPERM ones
    let mut p = vec![
        stmt(LD_W_ABS, ARCH),
        jump(JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(RET_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(LD_W_ABS, NR),
    ];
    // Distances from the instruction after a jump at check index `i` (0-based) to each tail.
    // After the checks come: allow (at +checks - i - 1 from the next one), then ENOSYS, EPERM,
    // and the domain check (2 instructions).
    let to_allow = |i: usize| (checks - i - 1) as u8;
    let to_enosys = |i: usize| to_allow(i) + 1;
    let to_eperm = |i: usize| to_allow(i) + 2;
    let to_domain = |i: usize| to_allow(i) + 3;
    // The x32 check sits just before check 0: one more instruction to jump over.
    p.push(jump(JSET_K, X32_SYSCALL_BIT, to_enosys(0) + 1, 0));
    p.push(jump(JEQ_K, libc::SYS_socket as u32, to_domain(0), 0));
    p.push(jump(JEQ_K, libc::SYS_socketpair as u32, to_domain(1), 0));
    p.push(jump(JEQ_K, libc::SYS_io_uring_setup as u32, to_enosys(2), 0));
    for (i, (_, nr)) in refused().enumerate() {
        p.push(jump(JEQ_K, *nr as u32, to_eperm(3 + i), 0));
    }
    p.push(stmt(RET_K, libc::SECCOMP_RET_ALLOW));
    p.push(stmt(RET_K, errno(libc::ENOSYS)));
    p.push(stmt(RET_K, errno(libc::EPERM)));
    p.push(stmt(LD_W_ABS, ARG0_LOW));
    p.push(jump(JEQ_K, libc::AF_UNIX as u32, 0, 1));
    p.push(stmt(RET_K, libc::SECCOMP_RET_ALLOW));
    p.push(stmt(RET_K, errno(libc::EAFNOSUPPORT)));
    p
}

/// Installs `program` on the calling process, for good: sets no_new_privs (a filter without
/// CAP_SYS_ADMIN needs it), then the filter. Runs between fork and exec: only the two raw calls,
/// no allocation.
///
/// # Errors
/// The OS error of `prctl` or `seccomp`.
pub fn install(program: &[Instruction]) -> io::Result<()> {
    let len = u16::try_from(program.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let fprog = libc::sock_fprog { len, filter: program.as_ptr().cast_mut() };
    // SAFETY: prctl with integer arguments; seccomp with a valid sock_fprog that outlives the call
    // (the kernel copies the program).
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            || libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, 0, &fprog as *const libc::sock_fprog)
                != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernel would answer, by running `program` on one call: a small interpreter of
    /// exactly the instructions [`program`] uses.
    fn run(program: &[Instruction], arch: u32, nr: u32, arg0: u32) -> u32 {
        let mut pc = 0usize;
        let mut acc = 0u32;
        loop {
            let i = program[pc];
            pc += 1;
            match i.code {
                LD_W_ABS => {
                    acc = match i.k {
                        NR => nr,
                        ARCH => arch,
                        ARG0_LOW => arg0,
                        other => panic!("load of offset {other}"),
                    }
                }
                JEQ_K => pc += usize::from(if acc == i.k { i.jt } else { i.jf }),
                JSET_K => pc += usize::from(if acc & i.k != 0 { i.jt } else { i.jf }),
                RET_K => return i.k,
                other => panic!("instruction {other:#x}"),
            }
        }
    }

    #[test]
    fn every_call_and_family_gets_the_rule_s_answer() {
        let p = program();
        let x86 = AUDIT_ARCH_X86_64;
        for nr in 0..600u32 {
            for domain in 0..64u32 {
                let got = run(&p, x86, nr, domain);
                let n = i64::from(nr);
                let want = if n == libc::SYS_socket || n == libc::SYS_socketpair {
                    if domain == libc::AF_UNIX as u32 {
                        libc::SECCOMP_RET_ALLOW
                    } else {
                        errno(libc::EAFNOSUPPORT)
                    }
                } else if n == libc::SYS_io_uring_setup {
                    errno(libc::ENOSYS)
                } else if refused().any(|(_, b)| *b == n) {
                    errno(libc::EPERM)
                } else {
                    libc::SECCOMP_RET_ALLOW
                };
                assert_eq!(got, want, "nr {nr} domain {domain}");
            }
        }
        // Only the low 32 bits of the family count, as for the kernel's `int family`.
        assert_eq!(run(&p, x86, libc::SYS_socket as u32, libc::AF_INET as u32), errno(libc::EAFNOSUPPORT));
        // x32 numbers, whatever they are, and foreign architectures.
        for nr in [X32_SYSCALL_BIT, X32_SYSCALL_BIT | libc::SYS_socket as u32, X32_SYSCALL_BIT | 1] {
            assert_eq!(run(&p, x86, nr, libc::AF_UNIX as u32), errno(libc::ENOSYS));
        }
        assert_eq!(run(&p, 0x4000_0003, 102, 2), libc::SECCOMP_RET_KILL_PROCESS, "i386 socketcall");
    }

    /// The errno a call left (0 when it succeeded), read right after the call.
    fn errno_of(ret: libc::c_long) -> i32 {
        if ret < 0 {
            io::Error::last_os_error().raw_os_error().unwrap_or(-1)
        } else {
            0
        }
    }

    /// What the filtered child found: 0 when every expectation held, else the number of the
    /// first that did not (1-based).
    fn probe_in_filtered_child() -> i32 {
        let mut pair = [-1i32; 2];
        // SAFETY (all calls): plain syscalls with integer arguments or a valid 2-int array.
        let checks: [(i32, i32); 12] = unsafe {
            [
                (errno_of(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0).into()), libc::EAFNOSUPPORT),
                (errno_of(libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0).into()), libc::EAFNOSUPPORT),
                (errno_of(libc::socket(libc::AF_INET6, libc::SOCK_DGRAM, 0).into()), libc::EAFNOSUPPORT),
                (errno_of(libc::socket(libc::AF_NETLINK, libc::SOCK_RAW, 0).into()), libc::EAFNOSUPPORT),
                (
                    errno_of(libc::socketpair(libc::AF_INET, libc::SOCK_STREAM, 0, pair.as_mut_ptr()).into()),
                    libc::EAFNOSUPPORT,
                ),
                (errno_of(libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0).into()), 0),
                (errno_of(libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, pair.as_mut_ptr()).into()), 0),
                (errno_of(libc::syscall(libc::SYS_io_uring_setup, 1u32, std::ptr::null_mut::<u8>())), libc::ENOSYS),
                (errno_of(libc::syscall(libc::SYS_pidfd_getfd, 0, 0, 0)), libc::EPERM),
                // Unfiltered, these fail with ENOENT (no such parent): the filter answers first.
                (
                    errno_of(libc::mkdirat(libc::AT_FDCWD, c"/vmhost-no-such-parent/probe".as_ptr(), 0o700).into()),
                    libc::EPERM,
                ),
                (errno_of(libc::mkdir(c"/vmhost-no-such-parent/probe".as_ptr(), 0o700).into()), libc::EPERM),
                (errno_of(libc::getpid().into()), 0),
            ]
        };
        for (i, (got, want)) in checks.into_iter().enumerate() {
            if got != want {
                return i as i32 + 1;
            }
        }
        0
    }

    #[test]
    fn the_kernel_refuses_ip_sockets_and_allows_unix_ones_under_the_filter() {
        // Built before the fork: the child of a multi-threaded test process must not allocate.
        let p = program();
        // Without the filter the same calls work here (the test would prove nothing otherwise).
        // SAFETY: plain socket calls.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
            assert!(fd >= 0, "{}", io::Error::last_os_error());
            libc::close(fd);
        }
        // SAFETY: the child makes raw syscalls only and _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = match install(&p) {
                Err(_) => 0xff,
                Ok(()) => probe_in_filtered_child(),
            };
            // SAFETY: leave the forked child without running destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "the child died: {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "the number of the failed expectation (0xff: install failed)");
    }
}
