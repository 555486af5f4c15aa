//! Identity, liveness, exit watching and signalling of the VM processes.
//!
//! QEMU runs in the foreground as a child of the spawner, which does not wait for it to end
//! ([`crate::qemu::launch`]), and outlives a daemon restart as an orphan: the daemon must not
//! trust a bare pid, which the kernel reuses. This module is the one place that turns a pid into
//! facts:
//!
//! 1. right after a launch, [`identify`] records a [`ProcessIdentity`] (pid plus start time);
//! 2. whenever the daemon (or a restarted daemon) looks at a recorded VM,
//!    [`crate::qemu::identity`] says whether that very process still runs and is the VM's QEMU
//!    (not a process that merely carries its marker), and [`liveness`] tells alive, zombie and
//!    gone apart;
//! 3. [`wait_exit`] (or [`wait_exit_of`] for a recorded identity) resolves when the process exits,
//!    through a pidfd, which works for processes that are not our children;
//! 4. [`signal`] (and [`crate::qemu::identity::signal_if_qemu`]) deliver stop and kill signals.
//!
//! It also shapes the stderr tails that errors about failed child programs carry (QEMU).
//!
//! A zombie counts as dead everywhere: an orphaned QEMU that exited lingers as a zombie until the
//! init process reaps it (on these machines only about every 1.5 s), and it will never run again.
//!
//! Every function that reads `/proc` has an `_in` variant taking the proc root, so the parsing can
//! be tested on fabricated files.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{openat, OFlag};
use nix::sys::signal::Signal;
use nix::sys::stat::Mode;
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The real proc file system, used by the functions without an `_in` suffix.
pub const PROC_ROOT: &str = "/proc";

/// A process as the kernel knows it: pid plus start time, which together never repeat.
///
/// The pid alone is not an identity: after the process exits the kernel hands the number to a new
/// process. `start_ticks` (field 22 of `/proc/PID/stat`, clock ticks since boot) tells the two apart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessIdentity {
    /// Process id.
    pub pid: i32,
    /// Start time in clock ticks after boot (`/proc/PID/stat` field 22).
    pub start_ticks: u64,
}

/// Whether a pid names a running process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// The process exists and has not exited.
    Alive,
    /// The process has exited but its parent has not reaped it yet (state `Z` or `X`): dead.
    Zombie,
    /// No process has this pid.
    Gone,
}

impl Liveness {
    /// True only for [`Liveness::Alive`]: a zombie is dead.
    pub fn is_alive(self) -> bool {
        self == Liveness::Alive
    }
}

/// The two fields of `/proc/PID/stat` this module needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    /// Field 3, the one-letter state.
    pub(crate) state: char,
    /// Field 4, the parent's pid.
    pub(crate) ppid: i32,
    /// Field 22, start time in clock ticks.
    pub(crate) start_ticks: u64,
}

/// Parses `/proc/PID/stat`. The second field (comm) is in parentheses and may itself contain
/// spaces and `)`, so the fixed fields are taken from after the *last* `)`.
fn parse_stat(text: &str) -> io::Result<Stat> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("bad stat: {what}"));
    let close = text.rfind(')').ok_or_else(|| bad("no ')' after comm"))?;
    // Fields after comm start with field 3 (state): field N is at index N - 3.
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    let state = rest.first().and_then(|s| s.chars().next()).ok_or_else(|| bad("no state field"))?;
    let ppid = rest.get(4 - 3).and_then(|s| s.parse::<i32>().ok()).ok_or_else(|| bad("no parent pid"))?;
    let start_ticks = rest
        .get(22 - 3)
        .ok_or_else(|| bad("fewer than 22 fields"))?
        .parse::<u64>()
        .map_err(|_| bad("start time is not a number"))?;
    Ok(Stat { state, ppid, start_ticks })
}

/// Opens `proc_root/PID` as a directory. Files read through this descriptor belong to that very
/// process: if it exits and the pid is reused, reads fail with `ESRCH` instead of describing the
/// newcomer.
pub(crate) fn open_pid_dir(proc_root: &Path, pid: i32) -> io::Result<OwnedFd> {
    if pid <= 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    let dir = File::open(proc_root.join(pid.to_string()))?;
    Ok(OwnedFd::from(dir))
}

/// Reads a whole file below an open `/proc/PID` directory.
pub(crate) fn read_at(dir: &OwnedFd, name: &str) -> io::Result<Vec<u8>> {
    let fd = openat(dir, name, OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())?;
    let mut out = Vec::new();
    File::from(fd).read_to_end(&mut out)?;
    Ok(out)
}

pub(crate) fn read_stat_at(dir: &OwnedFd) -> io::Result<Stat> {
    let bytes = read_at(dir, "stat")?;
    parse_stat(&String::from_utf8_lossy(&bytes))
}

/// True for the errors that mean "no such process" when reading `/proc/PID/...`.
pub(crate) fn is_gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

/// [`liveness`] with an explicit proc root.
pub fn liveness_in(proc_root: &Path, pid: i32) -> Liveness {
    let stat = open_pid_dir(proc_root, pid).and_then(|dir| read_stat_at(&dir));
    match stat {
        Ok(Stat { state: 'Z' | 'X' | 'x', .. }) => Liveness::Zombie,
        Ok(_) => Liveness::Alive,
        Err(e) if is_gone(&e) => Liveness::Gone,
        Err(e) => {
            // The directory exists but its stat cannot be read or parsed. Declaring such a
            // process dead could get a second QEMU started on the same disk, so stay on the
            // safe side.
            tracing::warn!(pid, error = %e, "cannot read process state; assuming alive");
            Liveness::Alive
        }
    }
}

/// Whether `pid` is alive, a zombie or gone, from the state letter in `/proc/PID/stat`.
///
/// A pid of zero or less is [`Liveness::Gone`]. If `/proc/PID` exists but its `stat` cannot be
/// read or parsed (which the kernel never produces), the answer is the conservative
/// [`Liveness::Alive`].
pub fn liveness(pid: i32) -> Liveness {
    liveness_in(Path::new(PROC_ROOT), pid)
}

/// [`identify`] with an explicit proc root.
///
/// # Errors
/// As [`identify`].
pub fn identify_in(proc_root: &Path, pid: i32) -> io::Result<ProcessIdentity> {
    let dir = open_pid_dir(proc_root, pid)?;
    let stat = read_stat_at(&dir)?;
    Ok(ProcessIdentity { pid, start_ticks: stat.start_ticks })
}

/// The identity of the process `pid` now. A zombie still has an identity.
///
/// # Errors
/// `NotFound` (or `ESRCH`) when there is no such process, `InvalidData` when its stat file
/// cannot be parsed.
pub fn identify(pid: i32) -> io::Result<ProcessIdentity> {
    identify_in(Path::new(PROC_ROOT), pid)
}

/// Splits the contents of `/proc/PID/cmdline` into arguments.
pub(crate) fn split_cmdline(bytes: &[u8]) -> Vec<OsString> {
    let bytes = bytes.strip_suffix(b"\0").unwrap_or(bytes);
    if bytes.is_empty() {
        return Vec::new();
    }
    bytes.split(|b| *b == 0).map(|arg| OsString::from_vec(arg.to_vec())).collect()
}

/// [`cmdline`] with an explicit proc root.
///
/// # Errors
/// As [`cmdline`].
pub fn cmdline_in(proc_root: &Path, pid: i32) -> io::Result<Vec<OsString>> {
    let dir = open_pid_dir(proc_root, pid)?;
    Ok(split_cmdline(&read_at(&dir, "cmdline")?))
}

/// The argument vector of `pid` (`/proc/PID/cmdline`, NUL-separated). Empty for a zombie and
/// for kernel threads.
///
/// # Errors
/// `NotFound` (or `ESRCH`) when there is no such process.
pub fn cmdline(pid: i32) -> io::Result<Vec<OsString>> {
    cmdline_in(Path::new(PROC_ROOT), pid)
}

/// `pidfd_open(2)`: `Ok(None)` when there is no process `pid` (`ESRCH`).
pub(crate) fn pidfd_open(pid: i32) -> io::Result<Option<OwnedFd>> {
    if pid <= 0 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; no memory is
    // shared with the kernel.
    let ret = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if ret < 0 {
        let err = io::Error::last_os_error();
        return if err.raw_os_error() == Some(libc::ESRCH) { Ok(None) } else { Err(err) };
    }
    let fd = i32::try_from(ret).map_err(|_| io::Error::other("pidfd_open returned a bad fd"))?;
    // SAFETY: the kernel just returned this descriptor and nothing else owns it. pidfds are
    // always close-on-exec.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Waits until the process behind a pidfd has exited (become a zombie or been reaped).
async fn wait_pidfd(fd: OwnedFd) -> io::Result<()> {
    // SAFETY: the OwnedFd is moved into the AsyncFd, which keeps it open, and its as_raw_fd
    // always returns that same descriptor.
    let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
    // A pidfd turns readable once the process has exited, and stays so.
    let _ready = fd.readable().await?;
    Ok(())
}

/// Resolves when process `pid` has exited; at once if it is already a zombie or gone.
///
/// Works for any process, not only children: a pidfd becomes readable when the process exits,
/// before anyone reaps it, so a zombie counts as exited. Nothing is reaped here. If the pid may
/// have been reused since it was recorded, use [`wait_exit_of`].
///
/// # Errors
/// An error from `pidfd_open(2)` other than `ESRCH` (e.g. `EINVAL` for a pid of zero or less,
/// `EMFILE`), or from registering the pidfd with the tokio reactor.
pub async fn wait_exit(pid: i32) -> io::Result<()> {
    match pidfd_open(pid)? {
        Some(fd) => wait_pidfd(fd).await,
        None => Ok(()),
    }
}

/// Resolves when the recorded process `expected` has exited, even if its pid has been reused.
///
/// The pidfd is opened first and the start time checked afterwards: if they agree, the pidfd is
/// known to refer to `expected`; if not, `expected` had already exited and this returns at once.
///
/// # Errors
/// As [`wait_exit`].
pub async fn wait_exit_of(expected: &ProcessIdentity) -> io::Result<()> {
    let Some(fd) = pidfd_open(expected.pid)? else {
        return Ok(());
    };
    match identify(expected.pid) {
        Ok(now) if now.start_ticks == expected.start_ticks => wait_pidfd(fd).await,
        Ok(_) => Ok(()),
        Err(e) if is_gone(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Sends `sig` to `pid`. Returns `Ok(true)` when it was delivered and `Ok(false)` when there was
/// no such process (`ESRCH`): for stop and kill paths "already gone" is success, and the bool
/// lets the caller log it. A zombie accepts signals (and ignores them): `Ok(true)`.
///
/// The pid is used as is; to be safe against pid reuse use
/// [`crate::qemu::identity::signal_if_qemu`].
///
/// # Errors
/// `InvalidInput` for a pid of zero or less (which `kill(2)` would apply to a whole process
/// group), or the error of `kill(2)`, e.g. `EPERM`.
pub fn signal(pid: i32, sig: Signal) -> io::Result<bool> {
    if pid <= 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("refusing to signal pid {pid}")));
    }
    match nix::sys::signal::kill(Pid::from_raw(pid), sig) {
        Ok(()) => Ok(true),
        Err(Errno::ESRCH) => Ok(false),
        Err(e) => Err(io::Error::from(e)),
    }
}

/// The last `max` bytes of a process's output as text (lossy UTF-8, without a split character
/// at the start, trailing whitespace trimmed): the "stderr tail" that errors carry.
pub(crate) fn lossy_tail(bytes: &[u8], max: usize) -> String {
    let mut start = bytes.len().saturating_sub(max);
    // Skip UTF-8 continuation bytes so the tail does not begin with half a character.
    while start < bytes.len() && start > 0 && (bytes[start] & 0xC0) == 0x80 {
        start += 1;
    }
    String::from_utf8_lossy(&bytes[start..]).trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};
    use std::time::Duration;

    /// A stat line as the kernel writes it, with the given comm, state and start time.
    fn stat_line(pid: i32, comm: &str, state: char, start: u64) -> String {
        // Fields 4..=21 are filler; field 22 is the start time; a few more follow.
        let filler: Vec<String> = (4..=21).map(|n| n.to_string()).collect();
        format!("{pid} ({comm}) {state} {} {start} 1440600064 8662 18446744073709551615\n", filler.join(" "))
    }

    /// A fake proc root with one process.
    fn fake_proc(pid: i32, stat: &str, cmdline: &[u8]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(pid.to_string());
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("stat"), stat).unwrap();
        std::fs::write(dir.join("cmdline"), cmdline).unwrap();
        root
    }

    #[test]
    fn parse_stat_takes_fields_after_the_last_paren() {
        let line = stat_line(42, "evil) S 1 2 3 (x", 'S', 987654);
        let st = parse_stat(&line).unwrap();
        assert_eq!(st.state, 'S');
        assert_eq!(st.start_ticks, 987654);
        // Real line from a QEMU, for good measure.
        let real = "15849 (qemu-system-x86) S 1 15847 15847 0 -1 138412480 3274 0 0 0 2 1 0 0 20 0 4 0 72445 1440600064 8662 18446744073709551615 94443918057472";
        assert_eq!(parse_stat(real).unwrap().start_ticks, 72445);
    }

    #[test]
    fn parse_stat_rejects_garbage() {
        assert!(parse_stat("").is_err());
        assert!(parse_stat("12 (x) S 1 2").is_err());
        assert!(parse_stat("12 x S").is_err());
        let line = stat_line(1, "a", 'S', 5).replace(" 5 ", " five ");
        assert!(parse_stat(&line).is_err());
    }

    #[test]
    fn fabricated_process_identity_liveness_and_cmdline() {
        let stat = stat_line(77, "qemu (vm) ) x", 'S', 4242);
        let root = fake_proc(77, &stat, b"qemu-system-x86_64\0-qmp\0unix:/run/vm/a.qmp,server=on\0");
        let p = root.path();
        assert_eq!(identify_in(p, 77).unwrap(), ProcessIdentity { pid: 77, start_ticks: 4242 });
        assert_eq!(liveness_in(p, 77), Liveness::Alive);
        assert_eq!(liveness_in(p, 78), Liveness::Gone);
        assert_eq!(liveness_in(p, 0), Liveness::Gone);
        assert_eq!(liveness_in(p, -1), Liveness::Gone);
        assert_eq!(
            cmdline_in(p, 77).unwrap(),
            vec![
                OsString::from("qemu-system-x86_64"),
                OsString::from("-qmp"),
                OsString::from("unix:/run/vm/a.qmp,server=on"),
            ]
        );
        assert!(identify_in(p, 78).unwrap_err().kind() == io::ErrorKind::NotFound);
    }

    #[test]
    fn fabricated_zombie_is_not_alive() {
        for state in ['Z', 'X'] {
            let root = fake_proc(9, &stat_line(9, "qemu", state, 10), b"qemu\0/m\0");
            assert_eq!(liveness_in(root.path(), 9), Liveness::Zombie);
        }
    }

    #[test]
    fn unparsable_stat_is_alive_but_has_no_identity() {
        let root = fake_proc(5, "5 garbage", b"qemu\0/m\0");
        assert_eq!(liveness_in(root.path(), 5), Liveness::Alive);
        assert!(identify_in(root.path(), 5).is_err());
    }

    #[test]
    fn cmdline_split_handles_empty_and_trailing_nul() {
        assert!(split_cmdline(b"").is_empty());
        assert_eq!(split_cmdline(b"a\0\0b\0"), vec!["a", "", "b"]);
        assert_eq!(split_cmdline(b"a b"), vec!["a b"]);
    }

    #[test]
    fn current_process_identity_is_stable() {
        let me = std::process::id() as i32;
        let a = identify(me).unwrap();
        let b = identify(me).unwrap();
        assert_eq!(a, b);
        assert_eq!(liveness(me), Liveness::Alive);
        assert!(!cmdline(me).unwrap().is_empty());
    }

    #[test]
    fn real_child_is_alive_then_zombie_then_gone() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        let id = identify(pid).unwrap();
        assert_eq!(liveness(pid), Liveness::Alive);
        // Right after exec the kernel may not have set up the new argv yet: it reads as empty.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while cmdline(pid).unwrap().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(cmdline(pid).unwrap(), vec!["sleep", "30"]);
        assert_eq!(identify(pid).unwrap(), id);

        assert!(signal(pid, Signal::SIGKILL).unwrap());
        // Not reaped yet: a zombie, which is dead.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while liveness(pid) == Liveness::Alive && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(liveness(pid), Liveness::Zombie);
        child.wait().unwrap();
        assert_eq!(liveness(pid), Liveness::Gone);
        assert!(!signal(pid, Signal::SIGKILL).unwrap());
    }

    #[test]
    fn signal_refuses_group_pids() {
        assert!(signal(0, Signal::SIGTERM).is_err());
        assert!(signal(-1, Signal::SIGTERM).is_err());
    }

    #[tokio::test]
    async fn wait_exit_waits_for_a_child_and_counts_a_zombie_as_exited() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        let waiting = tokio::time::timeout(Duration::from_millis(300), wait_exit(pid)).await;
        assert!(waiting.is_err(), "wait_exit returned while the process runs");

        let watcher = tokio::spawn(wait_exit(pid));
        assert!(signal(pid, Signal::SIGKILL).unwrap());
        tokio::time::timeout(Duration::from_secs(5), watcher)
            .await
            .expect("wait_exit did not resolve after SIGKILL")
            .unwrap()
            .unwrap();
        // Resolved before anyone reaped the child.
        assert_eq!(liveness(pid), Liveness::Zombie);
        // And a second wait on the zombie resolves at once.
        tokio::time::timeout(Duration::from_secs(1), wait_exit(pid)).await.unwrap().unwrap();
        child.wait().unwrap();
    }

    #[tokio::test]
    async fn wait_exit_of_an_already_gone_process_is_immediate() {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let id = identify(pid).unwrap();
        child.wait().unwrap();
        tokio::time::timeout(Duration::from_secs(1), wait_exit(pid)).await.unwrap().unwrap();
        tokio::time::timeout(Duration::from_secs(1), wait_exit_of(&id)).await.unwrap().unwrap();
        assert!(wait_exit(0).await.is_err());
    }

    #[tokio::test]
    async fn wait_exit_of_a_reused_pid_is_immediate() {
        // Our own pid with a start time that is not ours: the recorded process is gone, and
        // the one holding the pid now must not be waited for.
        let me = identify(std::process::id() as i32).unwrap();
        let stale = ProcessIdentity { pid: me.pid, start_ticks: me.start_ticks + 1 };
        tokio::time::timeout(Duration::from_secs(1), wait_exit_of(&stale)).await.unwrap().unwrap();
    }

    /// Pids whose command line is exactly `args`.
    fn find_by_cmdline(args: &[&str]) -> Vec<i32> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir(PROC_ROOT).unwrap().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if cmdline(pid).is_ok_and(|c| c == args) {
                found.push(pid);
            }
        }
        found
    }

    #[tokio::test]
    async fn wait_exit_and_signal_work_on_a_process_that_is_not_our_child() {
        // `setsid --fork` starts `sleep` in a grandchild and exits: the sleep is orphaned and
        // reparented, like a daemonized QEMU. A unique duration finds it in /proc.
        let unique = format!("30.{}", std::process::id());
        let status = Command::new("setsid").args(["--fork", "sleep", &unique]).stdin(Stdio::null()).status().unwrap();
        assert!(status.success());
        let mut pids = Vec::new();
        for _ in 0..200 {
            pids = find_by_cmdline(&["sleep", &unique]);
            if !pids.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(pids.len(), 1, "orphaned sleep not found");
        let pid = pids[0];
        let id = identify(pid).unwrap();

        let waiting = tokio::time::timeout(Duration::from_millis(300), wait_exit_of(&id)).await;
        assert!(waiting.is_err(), "wait_exit_of returned while the process runs");

        let watcher = tokio::spawn(async move { wait_exit(pid).await });
        assert!(signal(pid, Signal::SIGKILL).unwrap());
        tokio::time::timeout(Duration::from_secs(5), watcher)
            .await
            .expect("wait_exit did not resolve for a non-child")
            .unwrap()
            .unwrap();
        assert!(!liveness(pid).is_alive());
    }

    #[test]
    fn lossy_tail_keeps_the_end_and_whole_characters() {
        assert_eq!(lossy_tail(b"hello world\n", 6), "world");
        assert_eq!(lossy_tail(b"abc", 10), "abc");
        // "é" is two bytes; cutting into it must not produce a replacement character.
        let s = "xé-end".as_bytes();
        assert_eq!(lossy_tail(s, 5), "-end");
        assert_eq!(lossy_tail(b"", 5), "");
    }
}
