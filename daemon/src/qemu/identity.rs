//! Is this process the QEMU of this VM? The answer the daemon acts on before it records,
//! re-adopts or signals a process.
//!
//! A pid and start time identify one process, and a VM's QEMU carries the VM's marker in its
//! command line ([`crate::qemu::argv::VmPaths::cmdline_marker`]). Neither proves the process is
//! the VM's QEMU: any local user can run `sleep 1000 opaque=STATE/logs/NAME.serial.log`, and a
//! daemon that believed the marker would record that process as the VM (`running`, no guest) and,
//! on recovery, skip giving its passthrough devices back. So a process counts as the VM's QEMU
//! only when all of this holds ([`judge`], a pure function of [`Facts`]):
//!
//! - it is alive (not a zombie) and one of its arguments contains the VM's marker;
//! - its real and effective uid are `qemu.user`'s (the daemon's own when QEMU runs as root);
//! - if it started at or after the current spawner (the process that starts QEMUs now,
//!   [`crate::sandbox::spawn`], or the daemon itself without a sandbox), its parent is that
//!   spawner: the spawner runs `qemu.binary` and nothing else as `qemu.user`, and a process a user
//!   started themselves has another parent. Its executable, when it can be read, must also be
//!   `qemu.binary`;
//! - if it started before the current spawner (a QEMU a previous daemon started, now an orphan
//!   whose parent is init or a subreaper), its executable must be `qemu.binary`: the same file
//!   (device and inode), or a file that was at the binary's path and has since been replaced
//!   (`/proc/PID/exe` reads `PATH (deleted)`), so that VMs keep running across a QEMU package
//!   upgrade and a daemon restart. An executable that cannot be known is not `qemu.binary`.
//!
//! Reading `/proc/PID/exe` of another user's process needs ptrace access, which the sandboxed
//! daemon does not have (no `CAP_SYS_PTRACE`, and Landlock confines ptrace to the caller's own
//! domain). So [`remember_executables`] reads the executables of `qemu.user`'s processes once,
//! before the sandbox is entered (`vmhostd`'s `main`): the QEMUs that survived the last daemon
//! are all among them. A process started later cannot be such an orphan, and for it the parent
//! check applies.
//!
//! In order: [`remember_executables`] at start-up; then [`find`] (a process with the VM's marker,
//! before a launch and in recovery), [`verify`] (a recorded identity, whenever a record is read)
//! and [`signal_if_qemu`] (stop, kill). Every `/proc` reader has an `_in` variant taking the proc
//! root and the remembered executables, so it can be tested on fabricated files.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nix::sys::signal::Signal;

use crate::process::{self, is_gone, open_pid_dir, read_at, read_stat_at, split_cmdline, ProcessIdentity};

/// What a process must be to count as the QEMU of one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuCheck {
    /// The VM's marker ([`crate::qemu::argv::VmPaths::cmdline_marker`]); empty matches nothing.
    pub marker: OsString,
    /// The uid QEMU runs as: `qemu.user`'s, or the daemon's when QEMU runs as the daemon's user.
    pub uid: u32,
    /// `qemu.binary`.
    pub binary: PathBuf,
    /// The process that starts QEMUs now: the spawner, or the daemon without one ([`spawner`]).
    pub spawner: ProcessIdentity,
}

/// The file a process executes: `/proc/PID/exe` followed (device, inode) and read (its text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Executable {
    /// Device of the executed file.
    pub dev: u64,
    /// Inode of the executed file.
    pub ino: u64,
    /// The link's text: the file's path, with ` (deleted)` appended once it was unlinked.
    pub link: OsString,
}

/// `qemu.binary` as it is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binary {
    /// Device and inode of the file at the path, if it exists.
    pub file: Option<(u64, u64)>,
    /// The path with symlinks resolved (as `/proc/PID/exe` shows it), or as configured when it
    /// cannot be resolved.
    pub path: PathBuf,
}

impl Binary {
    /// Looks `path` up now.
    pub fn of(path: &Path) -> Binary {
        let file = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        Binary { file, path }
    }

    /// True when `exe` is this binary: the same file, or a file that was at its path and has
    /// since been replaced or removed (a package upgrade renames a new file over the old one).
    pub fn is(&self, exe: &Executable) -> bool {
        if self.file == Some((exe.dev, exe.ino)) {
            return true;
        }
        let mut deleted = self.path.as_os_str().to_os_string();
        deleted.push(" (deleted)");
        exe.link == deleted
    }
}

/// What `/proc` says about one process, all read through one `/proc/PID` descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// Its state letter (`/proc/PID/stat` field 3).
    pub state: char,
    /// Its start time in clock ticks (field 22).
    pub start_ticks: u64,
    /// Its parent's pid (field 4).
    pub ppid: i32,
    /// The parent's start time, if the parent could be read: tells the spawner from a process
    /// that got the spawner's pid after it died.
    pub parent_start_ticks: Option<u64>,
    /// Real uid (`/proc/PID/status`, `Uid:` first field).
    pub ruid: u32,
    /// Effective uid (second field).
    pub euid: u32,
    /// Whether one of its arguments contains the marker.
    pub has_marker: bool,
    /// Its executable, read now or remembered from start-up; `None` when neither is known.
    pub exe: Option<Executable>,
}

/// Why a process is not the VM's QEMU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotQemu {
    /// It has exited (a zombie).
    #[error("it has exited")]
    Dead,
    /// None of its arguments contains the VM's marker.
    #[error("its command line lacks the VM's marker")]
    NoMarker,
    /// It runs as another user.
    #[error("it runs as uid {ruid} (effective {euid}), not as qemu.user (uid {expected})")]
    User {
        /// Its real uid.
        ruid: u32,
        /// Its effective uid.
        euid: u32,
        /// `qemu.user`'s uid.
        expected: u32,
    },
    /// It started after the spawner but the spawner did not start it.
    #[error("it started after vmhostd's spawner (pid {spawner}) but its parent is pid {ppid}")]
    Parent {
        /// Its parent's pid.
        ppid: i32,
        /// The spawner's pid.
        spawner: i32,
    },
    /// Its executable is another file.
    #[error("it executes {link:?}, not qemu.binary")]
    Executable {
        /// `/proc/PID/exe`'s text.
        link: OsString,
    },
    /// It started before the spawner and its executable cannot be known.
    #[error("it started before vmhostd and its executable cannot be read")]
    UnknownExecutable,
}

/// Whether `facts` describe the QEMU that `check` asks for; `binary` is `check.binary` looked up
/// ([`Binary::of`]). Pure: the rules are in the module doc.
///
/// # Errors
/// [`NotQemu`]: the first rule the process breaks.
pub fn judge(facts: &Facts, check: &QemuCheck, binary: &Binary) -> Result<(), NotQemu> {
    if matches!(facts.state, 'Z' | 'X' | 'x') {
        return Err(NotQemu::Dead);
    }
    if !facts.has_marker {
        return Err(NotQemu::NoMarker);
    }
    if facts.ruid != check.uid || facts.euid != check.uid {
        return Err(NotQemu::User { ruid: facts.ruid, euid: facts.euid, expected: check.uid });
    }
    let exe_is_binary = |exe: &Executable| {
        if binary.is(exe) {
            Ok(())
        } else {
            Err(NotQemu::Executable { link: exe.link.clone() })
        }
    };
    if facts.start_ticks >= check.spawner.start_ticks {
        // Started while this spawner runs: only the spawner can have started the VM's QEMU.
        let parent_is_spawner =
            facts.ppid == check.spawner.pid && facts.parent_start_ticks == Some(check.spawner.start_ticks);
        if !parent_is_spawner {
            return Err(NotQemu::Parent { ppid: facts.ppid, spawner: check.spawner.pid });
        }
        // The spawner runs qemu.binary and nothing else as qemu.user: an executable that cannot
        // be read (the sandboxed daemon cannot) is vouched for by the parent.
        return facts.exe.as_ref().map_or(Ok(()), exe_is_binary);
    }
    match &facts.exe {
        Some(exe) => exe_is_binary(exe),
        None => Err(NotQemu::UnknownExecutable),
    }
}

/// Executables of processes, by (pid, start time), read before the sandbox ([`remember_executables`]).
pub type Remembered = HashMap<(i32, u64), Executable>;

static REMEMBERED: OnceLock<Remembered> = OnceLock::new();

fn remembered() -> &'static Remembered {
    REMEMBERED.get_or_init(HashMap::new)
}

/// Reads `/proc/PID/exe` below an open `/proc/PID` directory. `Ok(None)` when the process has
/// no executable (a kernel thread), has exited, or its executable may not be read (another
/// user's process, without ptrace access).
fn read_executable(dir: &OwnedFd) -> io::Result<Option<Executable>> {
    let meta = nix::sys::stat::fstatat(dir, "exe", nix::fcntl::AtFlags::empty());
    let link = nix::fcntl::readlinkat(dir, "exe");
    match (meta, link) {
        (Ok(st), Ok(link)) => Ok(Some(Executable { dev: st.st_dev, ino: st.st_ino, link })),
        (Err(e), _) | (_, Err(e)) => match e {
            // ESRCH: it exited meanwhile; its other facts say so (or it is judged as it was).
            nix::errno::Errno::EACCES
            | nix::errno::Errno::EPERM
            | nix::errno::Errno::ENOENT
            | nix::errno::Errno::ESRCH => Ok(None),
            e => Err(io::Error::from(e)),
        },
    }
}

/// Real and effective uid from `/proc/PID/status`.
fn parse_uids(status: &[u8]) -> io::Result<(u32, u32)> {
    let text = String::from_utf8_lossy(status);
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "bad status: no Uid line");
    let line = text.lines().find_map(|l| l.strip_prefix("Uid:")).ok_or_else(bad)?;
    let mut ids = line.split_whitespace().map(str::parse::<u32>);
    match (ids.next(), ids.next()) {
        (Some(Ok(r)), Some(Ok(e))) => Ok((r, e)),
        _ => Err(bad()),
    }
}

/// [`remember_executables`] with an explicit proc root; returns what it found.
///
/// # Errors
/// `proc_root` cannot be listed.
pub fn remember_executables_in(proc_root: &Path, uid: u32) -> io::Result<Remembered> {
    let mut found = Remembered::new();
    for entry in std::fs::read_dir(proc_root)? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        let Ok(dir) = open_pid_dir(proc_root, pid) else { continue };
        let owned = read_at(&dir, "status").and_then(|s| parse_uids(&s)).is_ok_and(|(r, e)| r == uid && e == uid);
        if !owned {
            continue;
        }
        if let (Ok(stat), Ok(Some(exe))) = (read_stat_at(&dir), read_executable(&dir)) {
            found.insert((pid, stat.start_ticks), exe);
        }
    }
    Ok(found)
}

/// Remembers the executable of every process running as `user` (`qemu.user`), for [`judge`] to
/// know the executables of QEMUs that outlived the previous daemon. Call once, before the
/// sandbox, from a thread that may still change its file-system ids; later calls do nothing.
///
/// Reading another user's `/proc/PID/exe` is a ptrace check: root passes it only with
/// `CAP_SYS_PTRACE`, which the packaged unit does not grant. A caller whose file-system uid and
/// gid are the target's own passes it without any capability, so this thread takes `user`'s
/// (`setfsuid`/`setfsgid` change only the calling thread, and need only `CAP_SETUID`/
/// `CAP_SETGID`) for the scan and takes its own back after it.
///
/// # Errors
/// `/proc` cannot be listed; nothing is remembered then, and no orphaned QEMU is re-adopted.
pub fn remember_executables(user: crate::config::UserIds) -> io::Result<usize> {
    let found = {
        let _as_user = FsIds::become_(user);
        remember_executables_in(Path::new(process::PROC_ROOT), user.uid)
    }?;
    let n = found.len();
    let _ = REMEMBERED.set(found);
    Ok(n)
}

/// This thread's file-system ids switched to a user's until dropped.
struct FsIds {
    uid: nix::unistd::Uid,
    gid: nix::unistd::Gid,
}

impl FsIds {
    fn become_(user: crate::config::UserIds) -> FsIds {
        // The previous ids are returned; without CAP_SETUID/CAP_SETGID the call changes nothing
        // and the scan simply reads less (the same as before the switch existed).
        let gid = nix::unistd::setfsgid(nix::unistd::Gid::from_raw(user.gid));
        let uid = nix::unistd::setfsuid(nix::unistd::Uid::from_raw(user.uid));
        FsIds { uid, gid }
    }
}

impl Drop for FsIds {
    fn drop(&mut self) {
        nix::unistd::setfsuid(self.uid);
        nix::unistd::setfsgid(self.gid);
    }
}

static SPAWNER: OnceLock<ProcessIdentity> = OnceLock::new();

/// The process that starts QEMUs now: the sandbox's spawner, or this process without one.
///
/// # Errors
/// That process cannot be read in `/proc`.
pub fn spawner() -> io::Result<ProcessIdentity> {
    if let Some(id) = SPAWNER.get() {
        return Ok(id.clone());
    }
    let pid =
        crate::sandbox::state().spawner_pid.unwrap_or_else(|| i32::try_from(std::process::id()).unwrap_or(i32::MAX));
    let id = process::identify(pid)?;
    Ok(SPAWNER.get_or_init(|| id).clone())
}

/// Reads [`Facts`] of the process behind `dir`. `Ok(None)` when it is gone.
fn read_facts(
    proc_root: &Path,
    dir: &OwnedFd,
    pid: i32,
    marker: &OsStr,
    known: &Remembered,
) -> io::Result<Option<Facts>> {
    let Some(stat) = gone_is_none(read_stat_at(dir))? else { return Ok(None) };
    let Some(args) = gone_is_none(read_at(dir, "cmdline"))? else { return Ok(None) };
    let Some(status) = gone_is_none(read_at(dir, "status"))? else { return Ok(None) };
    let (ruid, euid) = parse_uids(&status)?;
    let has_marker = carries_marker(&args, marker);
    let exe = match read_executable(dir)? {
        Some(exe) => Some(exe),
        None => known.get(&(pid, stat.start_ticks)).cloned(),
    };
    // The parent's start time, read after the child's stat: if the parent exited and its pid
    // was reused in between, the start time tells.
    let parent_start_ticks =
        open_pid_dir(proc_root, stat.ppid).and_then(|d| read_stat_at(&d)).ok().map(|s| s.start_ticks);
    Ok(Some(Facts {
        state: stat.state,
        start_ticks: stat.start_ticks,
        ppid: stat.ppid,
        parent_start_ticks,
        ruid,
        euid,
        has_marker,
        exe,
    }))
}

/// `Ok(None)` for the errors that mean the process is gone.
fn gone_is_none<T>(r: io::Result<T>) -> io::Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if is_gone(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether one of the arguments in `cmdline` (a /proc/PID/cmdline) contains `marker`.
fn carries_marker(cmdline: &[u8], marker: &OsStr) -> bool {
    split_cmdline(cmdline).iter().any(|a| contains_bytes(a.as_bytes(), marker.as_bytes()))
}

/// True when `haystack` contains `needle` as a byte string.
fn contains_bytes(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// [`verify`] with an explicit proc root and remembered executables.
///
/// # Errors
/// As [`verify`].
pub fn verify_in(
    proc_root: &Path,
    known: &Remembered,
    expected: &ProcessIdentity,
    check: &QemuCheck,
) -> io::Result<Result<(), NotQemu>> {
    let dir = match open_pid_dir(proc_root, expected.pid) {
        Ok(d) => d,
        Err(e) if is_gone(&e) => return Ok(Err(NotQemu::Dead)),
        Err(e) => return Err(e),
    };
    let Some(facts) = read_facts(proc_root, &dir, expected.pid, &check.marker, known)? else {
        return Ok(Err(NotQemu::Dead));
    };
    if facts.start_ticks != expected.start_ticks {
        // The pid now belongs to another process: the recorded one has exited.
        return Ok(Err(NotQemu::Dead));
    }
    Ok(judge(&facts, check, &Binary::of(&check.binary)))
}

/// Whether the recorded process `expected` still runs and is the QEMU `check` asks for
/// (`Ok(Err(why))` when not).
///
/// A daemon short of file descriptors must not conclude that a running VM is gone: it would
/// clean up after a live QEMU and could start the VM a second time; hence the outer error.
///
/// # Errors
/// Reading /proc failed for a reason other than the process being gone (e.g. EMFILE): the
/// answer is unknown, and the caller must not act as if the process were dead.
pub fn verify(expected: &ProcessIdentity, check: &QemuCheck) -> io::Result<Result<(), NotQemu>> {
    verify_in(Path::new(process::PROC_ROOT), remembered(), expected, check)
}

/// True only if [`verify`] says the recorded process is the QEMU `check` asks for; an unreadable
/// /proc counts as "no".
pub fn is_qemu(expected: &ProcessIdentity, check: &QemuCheck) -> bool {
    matches!(verify(expected, check), Ok(Ok(())))
}

/// [`find`] with an explicit proc root and remembered executables.
///
/// # Errors
/// As [`find`].
pub fn find_in(proc_root: &Path, known: &Remembered, check: &QemuCheck) -> io::Result<Option<ProcessIdentity>> {
    if check.marker.is_empty() {
        return Ok(None);
    }
    let binary = Binary::of(&check.binary);
    for entry in std::fs::read_dir(proc_root)? {
        let entry = entry?;
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if let Some(id) = judge_pid(proc_root, pid, known, check, &binary)? {
            return Ok(Some(id));
        }
    }
    Ok(None)
}

/// Judges process `pid` if its command line carries `check`'s marker: its identity when it is
/// the QEMU `check` asks for, `None` when it is not (a warning says why), has gone or is hidden.
fn judge_pid(
    proc_root: &Path,
    pid: i32,
    known: &Remembered,
    check: &QemuCheck,
    binary: &Binary,
) -> io::Result<Option<ProcessIdentity>> {
    // Processes hidden from us (hidepid) cannot be a QEMU we started: skip them.
    let skip = |e: &io::Error| is_gone(e) || e.kind() == io::ErrorKind::PermissionDenied;
    let dir = match open_pid_dir(proc_root, pid) {
        Ok(d) => d,
        Err(e) if skip(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    // The command line first: most processes are not about this VM at all.
    match read_at(&dir, "cmdline") {
        Ok(args) if carries_marker(&args, &check.marker) => {}
        Ok(_) => return Ok(None),
        Err(e) if skip(&e) => return Ok(None),
        Err(e) => return Err(e),
    }
    let facts = match read_facts(proc_root, &dir, pid, &check.marker, known) {
        Ok(Some(f)) => f,
        Ok(None) => return Ok(None),
        Err(e) if skip(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    match judge(&facts, check, binary) {
        Ok(()) => Ok(Some(ProcessIdentity { pid, start_ticks: facts.start_ticks })),
        Err(NotQemu::Dead) => Ok(None),
        Err(why) => {
            tracing::warn!(pid, marker = %check.marker.to_string_lossy(), reason = %why,
                "ignoring a process that carries a VM's marker but is not its QEMU");
            Ok(None)
        }
    }
}

/// The processes whose command line carries each of a set of markers, from one pass over
/// /proc: how recovery looks for every VM's QEMU at once instead of scanning /proc per VM.
/// A process found here is only a candidate: [`MarkerIndex::find`] judges it as [`find`] does.
#[derive(Debug, Default)]
pub struct MarkerIndex {
    by_marker: HashMap<OsString, Vec<i32>>,
}

impl MarkerIndex {
    /// Scans /proc once for `markers`.
    ///
    /// # Errors
    /// /proc could not be listed, or a command line could not be read for a reason other than
    /// the process being gone or hidden.
    pub fn scan(markers: &[OsString]) -> io::Result<MarkerIndex> {
        MarkerIndex::scan_in(Path::new(process::PROC_ROOT), markers)
    }

    /// [`MarkerIndex::scan`] under `proc_root`.
    ///
    /// # Errors
    /// As [`MarkerIndex::scan`].
    pub fn scan_in(proc_root: &Path, markers: &[OsString]) -> io::Result<MarkerIndex> {
        let mut index = MarkerIndex::default();
        let wanted: Vec<&[u8]> = markers.iter().filter(|m| !m.is_empty()).map(|m| m.as_bytes()).collect();
        if wanted.is_empty() {
            return Ok(index);
        }
        // Every occurrence of every marker in one pass over each argument, overlaps included, as
        // `find`'s substring test would see them.
        let matcher = aho_corasick::AhoCorasick::new(&wanted).map_err(io::Error::other)?;
        for entry in std::fs::read_dir(proc_root)? {
            let entry = entry?;
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
            let args = match std::fs::read(proc_root.join(pid.to_string()).join("cmdline")) {
                Ok(a) => a,
                Err(e) if is_gone(&e) || e.kind() == io::ErrorKind::PermissionDenied => continue,
                Err(e) => return Err(e),
            };
            let mut hits: Vec<usize> = split_cmdline(&args)
                .iter()
                .flat_map(|a| matcher.find_overlapping_iter(a.as_bytes()).map(|m| m.pattern().as_usize()))
                .collect();
            hits.sort_unstable();
            hits.dedup();
            for hit in hits {
                let marker = OsStr::from_bytes(wanted[hit]).to_os_string();
                index.by_marker.entry(marker).or_default().push(pid);
            }
        }
        Ok(index)
    }

    /// The live QEMU `check` asks for among the processes that carried its marker at the scan.
    ///
    /// # Errors
    /// As [`find`].
    pub fn find(&self, check: &QemuCheck) -> io::Result<Option<ProcessIdentity>> {
        self.find_in(Path::new(process::PROC_ROOT), remembered(), check)
    }

    /// [`MarkerIndex::find`] with an explicit proc root and remembered executables.
    ///
    /// # Errors
    /// As [`find`].
    pub fn find_in(
        &self,
        proc_root: &Path,
        known: &Remembered,
        check: &QemuCheck,
    ) -> io::Result<Option<ProcessIdentity>> {
        let Some(pids) = self.by_marker.get(&check.marker) else { return Ok(None) };
        let binary = Binary::of(&check.binary);
        for &pid in pids {
            // Judged on what /proc says now: it may have exited or exec'd since the scan.
            if let Some(id) = judge_pid(proc_root, pid, known, check, &binary)? {
                return Ok(Some(id));
            }
        }
        Ok(None)
    }
}

/// The live QEMU that `check` asks for, found by its marker: how the daemon finds a VM's QEMU
/// that started just before a crash, before its identity was recorded. A process that carries
/// the marker but breaks a rule of [`judge`] is logged (a warning) and ignored.
///
/// # Errors
/// /proc could not be listed or a process's files could not be read for a reason other than
/// it being gone: whether the VM runs is then unknown.
pub fn find(check: &QemuCheck) -> io::Result<Option<ProcessIdentity>> {
    find_in(Path::new(process::PROC_ROOT), remembered(), check)
}

/// Sends `sig` to the recorded process only if it still is the QEMU `check` asks for ([`verify`]).
/// Returns whether the signal was sent. The check and the signal go through one pidfd
/// (`pidfd_send_signal(2)`), so a pid reused between them cannot receive it.
///
/// # Errors
/// An error from `pidfd_open(2)` or `pidfd_send_signal(2)` other than "no such process".
pub fn signal_if_qemu(expected: &ProcessIdentity, check: &QemuCheck, sig: Signal) -> io::Result<bool> {
    let Some(fd) = process::pidfd_open(expected.pid)? else {
        return Ok(false);
    };
    if !is_qemu(expected, check) {
        return Ok(false);
    }
    // SAFETY: pidfd_send_signal takes a descriptor we own, a signal number, a null siginfo
    // pointer (meaning "as kill(2)") and flags 0.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            sig as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if ret < 0 {
        let err = io::Error::last_os_error();
        return if err.raw_os_error() == Some(libc::ESRCH) { Ok(false) } else { Err(err) };
    }
    Ok(true)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    use std::time::Duration;

    /// A check for a process this test process started (it plays the spawner).
    pub(crate) fn child_check(marker: &OsStr, binary: &str) -> QemuCheck {
        QemuCheck {
            marker: marker.to_os_string(),
            uid: nix::unistd::geteuid().as_raw(),
            binary: binary.into(),
            spawner: process::identify(std::process::id() as i32).unwrap(),
        }
    }

    /// A check for an orphan of this uid: the "spawner" started after every process, so every
    /// process is judged by its executable (which root reads).
    pub(crate) fn orphan_check(marker: &OsStr, binary: &str) -> QemuCheck {
        QemuCheck { spawner: ProcessIdentity { pid: i32::MAX, start_ticks: u64::MAX }, ..child_check(marker, binary) }
    }

    const QEMU: &str = "/usr/bin/qemu-system-x86_64";

    fn check() -> QemuCheck {
        QemuCheck {
            marker: "opaque=/s/logs/a.serial.log".into(),
            uid: 990,
            binary: QEMU.into(),
            spawner: ProcessIdentity { pid: 500, start_ticks: 1000 },
        }
    }

    fn binary() -> Binary {
        Binary { file: Some((8, 42)), path: QEMU.into() }
    }

    fn exe(dev: u64, ino: u64, link: &str) -> Option<Executable> {
        Some(Executable { dev, ino, link: link.into() })
    }

    /// The spawner's QEMU as the sandboxed daemon sees it (its executable unreadable).
    fn good_child() -> Facts {
        Facts {
            state: 'S',
            start_ticks: 2000,
            ppid: 500,
            parent_start_ticks: Some(1000),
            ruid: 990,
            euid: 990,
            has_marker: true,
            exe: None,
        }
    }

    /// A QEMU a previous daemon started, now an orphan of init.
    fn good_orphan() -> Facts {
        Facts { start_ticks: 10, ppid: 1, parent_start_ticks: Some(0), exe: exe(8, 42, QEMU), ..good_child() }
    }

    #[test]
    fn judge_accepts_the_spawners_qemu_and_an_orphaned_qemu() {
        let (c, b) = (check(), binary());
        assert_eq!(judge(&good_child(), &c, &b), Ok(()));
        assert_eq!(judge(&Facts { exe: exe(8, 42, QEMU), ..good_child() }, &c, &b), Ok(()));
        assert_eq!(judge(&good_orphan(), &c, &b), Ok(()));
        // Started in the spawner's clock tick, by the spawner.
        assert_eq!(judge(&Facts { start_ticks: 1000, ..good_child() }, &c, &b), Ok(()));
        // A QEMU package upgrade replaced the binary while the VM ran.
        let upgraded = Facts { exe: exe(8, 41, &format!("{QEMU} (deleted)")), ..good_orphan() };
        assert_eq!(judge(&upgraded, &c, &b), Ok(()));
        let gone_binary = Binary { file: None, path: QEMU.into() };
        assert_eq!(judge(&upgraded, &c, &gone_binary), Ok(()));
    }

    #[test]
    fn judge_refuses_another_user_parent_or_executable() {
        let (c, b) = (check(), binary());
        let refused = |f: Facts| judge(&f, &c, &b).unwrap_err();
        assert_eq!(refused(Facts { state: 'Z', ..good_child() }), NotQemu::Dead);
        assert_eq!(refused(Facts { has_marker: false, ..good_child() }), NotQemu::NoMarker);
        // Any user running `sleep 1000 opaque=...`, before or after the daemon started.
        assert!(matches!(refused(Facts { ruid: 1000, euid: 1000, ..good_child() }), NotQemu::User { ruid: 1000, .. }));
        assert!(matches!(refused(Facts { ruid: 1000, euid: 1000, ..good_orphan() }), NotQemu::User { .. }));
        // Real or effective uid alone is not enough.
        assert!(matches!(refused(Facts { ruid: 1000, ..good_child() }), NotQemu::User { .. }));
        assert!(matches!(refused(Facts { euid: 0, ..good_child() }), NotQemu::User { .. }));
        // qemu.user itself running something after the daemon started: not the spawner's child.
        assert_eq!(refused(Facts { ppid: 4321, ..good_child() }), NotQemu::Parent { ppid: 4321, spawner: 500 });
        // The spawner's pid, reused by another process after the spawner died.
        assert!(matches!(refused(Facts { parent_start_ticks: Some(3000), ..good_child() }), NotQemu::Parent { .. }));
        assert!(matches!(refused(Facts { parent_start_ticks: None, ..good_child() }), NotQemu::Parent { .. }));
        // A readable executable must be the binary, for a child of the spawner too.
        let sleep = exe(8, 77, "/usr/bin/sleep");
        assert!(matches!(refused(Facts { exe: sleep.clone(), ..good_child() }), NotQemu::Executable { .. }));
        // qemu.user running something before the daemon started: judged by its executable.
        assert!(matches!(refused(Facts { exe: sleep, ..good_orphan() }), NotQemu::Executable { .. }));
        assert_eq!(refused(Facts { exe: None, ..good_orphan() }), NotQemu::UnknownExecutable);
        // Only a deleted file at the binary's own path counts as the binary.
        let elsewhere = exe(8, 41, "/tmp/usr/bin/qemu-system-x86_64 (deleted)");
        assert!(matches!(refused(Facts { exe: elsewhere, ..good_orphan() }), NotQemu::Executable { .. }));
        let suffixed = exe(8, 41, &format!("{QEMU}x (deleted)"));
        assert!(matches!(refused(Facts { exe: suffixed, ..good_orphan() }), NotQemu::Executable { .. }));
    }

    #[test]
    fn uids_are_parsed_from_status() {
        assert_eq!(parse_uids(b"Name:\tqemu\nUid:\t990\t991\t990\t990\nGid:\t1\t1\t1\t1\n").unwrap(), (990, 991));
        assert!(parse_uids(b"Name:\tqemu\n").is_err());
        assert!(parse_uids(b"Uid:\tx\t1\n").is_err());
    }

    /// One fabricated process.
    struct Fake<'a> {
        pid: i32,
        ppid: i32,
        start: u64,
        state: char,
        uid: u32,
        cmdline: &'a [u8],
        /// The target of its `exe` link; `None`: no link (reads as unknown).
        exe: Option<&'a Path>,
    }

    fn add(root: &Path, f: &Fake) {
        let dir = root.join(f.pid.to_string());
        std::fs::create_dir(&dir).unwrap();
        let filler: Vec<String> = (5..=21).map(|n| n.to_string()).collect();
        let stat = format!("{} (x) {} {} {} {} 1 2 3\n", f.pid, f.state, f.ppid, filler.join(" "), f.start);
        std::fs::write(dir.join("stat"), stat).unwrap();
        std::fs::write(dir.join("cmdline"), f.cmdline).unwrap();
        std::fs::write(dir.join("status"), format!("Name:\tx\nUid:\t{0}\t{0}\t{0}\t{0}\n", f.uid)).unwrap();
        if let Some(target) = f.exe {
            std::os::unix::fs::symlink(target, dir.join("exe")).unwrap();
        }
    }

    #[test]
    fn find_and_verify_on_a_fabricated_proc() {
        let root = tempfile::tempdir().unwrap();
        let bin = root.path().join("qemu-system-x86_64");
        let other = root.path().join("sleep");
        std::fs::write(&bin, b"qemu").unwrap();
        std::fs::write(&other, b"sleep").unwrap();
        let p = root.path();
        let spawner = ProcessIdentity { pid: 500, start_ticks: 1000 };
        add(p, &Fake { pid: 500, ppid: 1, start: 1000, state: 'S', uid: 0, cmdline: b"vmhostd\0", exe: None });
        let c = |name: &str| QemuCheck {
            marker: format!("opaque=/s/logs/{name}.serial.log").into(),
            uid: 990,
            binary: bin.clone(),
            spawner: spawner.clone(),
        };
        let marker = |name: &str| format!("sleep\01000\0opaque=/s/logs/{name}.serial.log\0").into_bytes();
        // vm-a: a fake by another user first, then the real QEMU.
        let a = marker("a");
        add(p, &Fake { pid: 40, ppid: 1, start: 1200, state: 'S', uid: 1000, cmdline: &a, exe: Some(&other) });
        add(p, &Fake { pid: 41, ppid: 500, start: 1300, state: 'S', uid: 990, cmdline: &a, exe: Some(&bin) });
        // vm-b: only a fake by qemu.user itself, started after the spawner (and not by it).
        let b = marker("b");
        add(p, &Fake { pid: 42, ppid: 1, start: 1400, state: 'S', uid: 990, cmdline: &b, exe: Some(&bin) });
        // vm-c: a fake by qemu.user started before the daemon, another executable.
        let cc = marker("c");
        add(p, &Fake { pid: 43, ppid: 1, start: 900, state: 'S', uid: 990, cmdline: &cc, exe: Some(&other) });
        // vm-d: a QEMU of the previous daemon, executable remembered, not readable now.
        let d = marker("d");
        add(p, &Fake { pid: 44, ppid: 1, start: 800, state: 'S', uid: 990, cmdline: &d, exe: None });
        // vm-e: the same without a remembered executable; vm-f: a zombie QEMU.
        let e = marker("e");
        add(p, &Fake { pid: 45, ppid: 1, start: 700, state: 'S', uid: 990, cmdline: &e, exe: None });
        let f = marker("f");
        add(p, &Fake { pid: 46, ppid: 500, start: 1500, state: 'Z', uid: 990, cmdline: &f, exe: Some(&bin) });
        std::fs::write(p.join("self"), b"not a pid").unwrap();

        let meta = std::fs::metadata(&bin).unwrap();
        let known: Remembered =
            [((44, 800), Executable { dev: meta.dev(), ino: meta.ino(), link: bin.clone().into() })]
                .into_iter()
                .collect();
        let find = |name: &str| find_in(p, &known, &c(name)).unwrap().map(|id| id.pid);
        assert_eq!(find("a"), Some(41));
        assert_eq!(find("b"), None);
        assert_eq!(find("c"), None);
        assert_eq!(find("d"), Some(44));
        assert_eq!(find("e"), None);
        assert_eq!(find("f"), None);
        assert_eq!(find("z"), None);
        assert_eq!(find_in(p, &known, &QemuCheck { marker: OsString::new(), ..c("a") }).unwrap(), None);
        assert!(find_in(&p.join("absent"), &known, &c("a")).is_err());

        // One scan for every VM finds what a scan per VM finds.
        let g = b"qemu\0-x\0opaque=/s/logs/g.serial.log,opaque=/s/logs/h.serial.log\0".to_vec();
        add(p, &Fake { pid: 47, ppid: 500, start: 1600, state: 'S', uid: 990, cmdline: &g, exe: Some(&bin) });
        let names = ["a", "b", "c", "d", "e", "f", "g", "h", "z"];
        let markers: Vec<OsString> = names.iter().map(|n| c(n).marker).chain([OsString::new()]).collect();
        let index = MarkerIndex::scan_in(p, &markers).unwrap();
        for name in names {
            let scanned = index.find_in(p, &known, &c(name)).unwrap().map(|id| id.pid);
            assert_eq!(scanned, find(name), "{name}");
        }
        assert_eq!(index.find_in(p, &known, &c("g")).unwrap().map(|id| id.pid), Some(47));
        assert_eq!(index.find_in(p, &known, &c("h")).unwrap().map(|id| id.pid), Some(47), "overlapping markers");
        let mut a_pids = index.by_marker[&c("a").marker].clone();
        a_pids.sort_unstable();
        assert_eq!(a_pids, [40, 41]);
        assert!(!index.by_marker.contains_key(&c("z").marker));
        // A process that exits after the scan is not found.
        std::fs::remove_dir_all(p.join("47")).unwrap();
        assert_eq!(index.find_in(p, &known, &c("g")).unwrap(), None);
        assert!(MarkerIndex::scan_in(&p.join("absent"), &markers).is_err());
        assert!(MarkerIndex::scan_in(&p.join("absent"), &[]).unwrap().by_marker.is_empty());

        let id = |pid, start_ticks| ProcessIdentity { pid, start_ticks };
        assert_eq!(verify_in(p, &known, &id(41, 1300), &c("a")).unwrap(), Ok(()));
        assert!(matches!(verify_in(p, &known, &id(40, 1200), &c("a")).unwrap(), Err(NotQemu::User { .. })));
        assert_eq!(verify_in(p, &known, &id(41, 1301), &c("a")).unwrap(), Err(NotQemu::Dead), "pid reused");
        assert_eq!(verify_in(p, &known, &id(41, 1300), &c("b")).unwrap(), Err(NotQemu::NoMarker));
        assert_eq!(verify_in(p, &known, &id(99, 1), &c("a")).unwrap(), Err(NotQemu::Dead), "gone");
        // A proc that cannot be read is an error, not a "no".
        let bad = tempfile::tempdir().unwrap();
        std::fs::write(bad.path().join("41"), b"not a directory").unwrap();
        assert!(verify_in(bad.path(), &known, &id(41, 1300), &c("a")).is_err());
    }

    /// Waits until `pid` has exec'd (its command line is not empty).
    fn wait_exec(pid: i32) {
        for _ in 0..500 {
            if process::cmdline(pid).is_ok_and(|c| c.len() > 1 && c[1] == "30") {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("{pid} never exec'd");
    }

    #[test]
    fn a_real_child_is_judged_by_user_and_executable() {
        let marker = format!("opaque=/t/{}.serial.log", std::process::id());
        let mut child = Command::new("sleep").arg0(&marker).arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        wait_exec(pid);
        let id = process::identify(pid).unwrap();
        let m = OsStr::new(&marker);
        assert!(is_qemu(&id, &child_check(m, "/usr/bin/sleep")));
        // Same process, but qemu.binary is QEMU: its executable tells.
        assert!(matches!(verify(&id, &child_check(m, QEMU)).unwrap(), Err(NotQemu::Executable { .. })));
        let other_user = QemuCheck { uid: 4242, ..child_check(m, "/usr/bin/sleep") };
        assert!(matches!(verify(&id, &other_user).unwrap(), Err(NotQemu::User { .. })));
        assert!(!signal_if_qemu(&id, &other_user, Signal::SIGKILL).unwrap());
        assert!(process::liveness(pid).is_alive());
        assert!(signal_if_qemu(&id, &child_check(m, "/usr/bin/sleep"), Signal::SIGKILL).unwrap());
        child.wait().unwrap();
        assert!(!is_qemu(&id, &child_check(m, "/usr/bin/sleep")));
    }

    #[tokio::test]
    async fn an_orphan_is_judged_by_its_executable_and_signalled_once() {
        // `setsid --fork`: the sleep is orphaned and reparented, like a QEMU after a daemon
        // restart. Its argv[0] is the marker (sleep takes no other argument).
        let marker = format!("opaque=/t/orphan-{}.serial.log", std::process::id());
        let status = Command::new("setsid")
            .arg0("setsid")
            .args(["--fork", "bash", "-c", "exec -a \"$0\" sleep 30", &marker])
            .stdin(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        let m = OsStr::new(&marker);
        let mut found = None;
        for _ in 0..500 {
            found =
                find_in(Path::new(process::PROC_ROOT), &Remembered::new(), &orphan_check(m, "/usr/bin/sleep")).unwrap();
            if found.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let id = found.expect("orphaned sleep not found");
        // Started after this test process (the "spawner") but not by it.
        assert!(matches!(verify(&id, &child_check(m, "/usr/bin/sleep")).unwrap(), Err(NotQemu::Parent { .. })));
        assert!(!signal_if_qemu(&id, &child_check(m, "/usr/bin/sleep"), Signal::SIGKILL).unwrap());
        assert!(!signal_if_qemu(&id, &orphan_check(m, QEMU), Signal::SIGKILL).unwrap());
        assert!(signal_if_qemu(&id, &orphan_check(m, "/usr/bin/sleep"), Signal::SIGKILL).unwrap());
        tokio::time::timeout(Duration::from_secs(5), process::wait_exit_of(&id)).await.unwrap().unwrap();
        // Dead (zombie or reaped): a second signal is not sent.
        assert!(!signal_if_qemu(&id, &orphan_check(m, "/usr/bin/sleep"), Signal::SIGKILL).unwrap());
    }

    #[test]
    fn remembered_executables_are_those_of_the_user() {
        let marker = format!("opaque=/t/remember-{}.serial.log", std::process::id());
        let mut child = Command::new("sleep").arg0(&marker).arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        wait_exec(pid);
        let id = process::identify(pid).unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let known = remember_executables_in(Path::new(process::PROC_ROOT), me).unwrap();
        let sleep = std::fs::metadata("/usr/bin/sleep").unwrap();
        let exe = known.get(&(pid, id.start_ticks)).expect("child remembered");
        assert_eq!((exe.dev, exe.ino), (sleep.dev(), sleep.ino()));
        let nobody = remember_executables_in(Path::new(process::PROC_ROOT), 4242).unwrap();
        assert!(!nobody.contains_key(&(pid, id.start_ticks)));
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
