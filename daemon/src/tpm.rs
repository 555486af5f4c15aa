//! A VM's TPM 2.0 (`tpm: true`): swtpm, one process per VM, and the TPM's state on disk.
//!
//! Why a module of its own: the TPM is a second process beside a VM's QEMU, with state that
//! must outlive both (the guest's keys, sealed secrets and NV indexes live in it), and it is the
//! one owner of both: the state directory and the swtpm process. docs/images.md ("TPM") has the
//! threat model, docs/sandbox.md swtpm's confinement.
//!
//! The pieces, in the order they are used:
//!
//! 1. [`check`]: before a VM with `tpm` is created or started (2001 on `spec.tpm` when swtpm is
//!    missing), and [`check_item`] for `host.check`;
//! 2. [`prepare_state_dir`] at every launch: `STATE/disks/NAME/tpm`, made at the first one;
//! 3. [`start`] just before QEMU: a socket pair, one end and the state directory handed to
//!    swtpm (started by the spawner as `qemu.user`, in a session of its own like QEMU), the
//!    other end returned for QEMU's `-chardev socket,fd=` ([`crate::qemu::argv`]). swtpm runs
//!    with `--terminate`: it ends when QEMU closes the control channel (QEMU's exit, or the
//!    launch failing and dropping QEMU's end), so it never outlives the VM, and like QEMU it
//!    outlives vmhostd;
//! 4. [`settle`] at daemon start: a recorded swtpm whose QEMU is gone is ended;
//! 5. [`remove_state`] at the destroy.
//!
//! [`state_files`] names the state's files; snapshots and backups copy them with [`read_state`]
//! and a revert or an import puts a copy back with [`put_back_state`], both through the spawner
//! ([`crate::sandbox::spawn::tpm_state_file`], [`crate::sandbox::spawn::tpm_state_place`]).
//!
//! Moves (docs/moving.md, "TPM"): a live one needs nothing of this module beyond [`start`] on
//! the destination: QEMU's `tpm-emulator` backend fetches swtpm's state blobs on the source
//! and hands them to the destination's swtpm in the migration stream, which stores them in its
//! state directory. A cold one carries the files: the source reads them with [`read_state`],
//! the destination puts them back with [`put_back_state`] before its commit.
//!
//! ## Who can reach the state
//!
//! swtpm keeps its state in a directory (`--tpmstate dir=`), writing each file as a temporary
//! file renamed into place, and it `fchmod`s every file it loads: the files must be
//! `qemu.user`'s, and it must be able to create files in the directory. The daemon cannot
//! chown (it keeps no `CAP_CHOWN`, and its seccomp table has no path-based chown), and
//! `qemu.user` cannot walk into `STATE/disks` (root's, 0700). So the directory is root's, mode
//! 0703 (the owner everything; others may create, rename and remove entries by name but not
//! list it), and swtpm gets it as a descriptor, naming it `/proc/self/fd/N`: the kernel follows
//! that link without checking the root-only directories above it. Only a process holding the
//! descriptor (that VM's swtpm) or a path through `STATE/disks/NAME` (root) reaches the state;
//! another VM's QEMU or swtpm (the same user) cannot reach the descriptor either, since each
//! program the spawner starts is in a Landlock domain of its own, which keeps it out of the
//! others' `/proc/PID/fd`. The files swtpm writes are `qemu.user`'s, mode 0600
//! ([`STATE_FILE_MODE`]): the daemon (root without `CAP_DAC_OVERRIDE`) can remove them (it
//! owns the directory) but not read them; swtpm cannot make a directory there, which the daemon
//! could not empty (`mkdir` is refused to every program the spawner starts:
//! `crate::sandbox::child_seccomp`). So a copy is read by the spawner, which raises
//! `CAP_DAC_READ_SEARCH` for the one `openat` of a state file name in the directory descriptor
//! the daemon hands it (`O_NOFOLLOW`, a regular file only), and a copy is put back by a child
//! the spawner forks for it that becomes `qemu.user` first and writes, on the descriptors it was
//! given, a temporary file renamed over the name: the file is `qemu.user`'s without any
//! `CAP_CHOWN`, and the writer can do no more than swtpm itself could.

use std::ffi::OsString;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::api::{ApiError, CheckItem, CheckStatus};
use crate::config::UserIds;
use crate::process::ProcessIdentity;
use crate::qemu::argv::VmPaths;
use crate::sandbox::spawn::{self, FIRST_PASSED_FD};

/// The state directory's name in the VM's disk directory.
pub const STATE_DIR: &str = "tpm";

/// The state directory's permission bits: root everything, others (swtpm as `qemu.user`,
/// through its descriptor) create, rename and remove by name only (module doc).
pub const STATE_DIR_MODE: u32 = 0o703;

/// The permission bits of swtpm's state files (`--tpmstate ...,mode=`, which it sets on each
/// file it loads): its user's alone, as the files it writes get anyway (the spawner starts
/// every program with umask 077).
pub const STATE_FILE_MODE: u32 = 0o600;

/// The files of a TPM 2.0's state that swtpm's directory backend writes: the persistent state
/// (always, once the TPM started), the volatile state (after a suspend) and a saved state
/// (after a migration). `.lock` is swtpm's lock file, not state.
pub const STATE_FILE_NAMES: [&str; 3] = ["tpm2-00.permall", "tpm2-00.volatilestate", "tpm2-00.savestate"];

/// The largest state file put back: swtpm's are a few KiB (its NV memory is 128 KiB at most).
pub const MAX_STATE_FILE_BYTES: u64 = 16 << 20;

/// Why swtpm could not be prepared or started.
#[derive(Debug, thiserror::Error)]
pub enum TpmError {
    /// `qemu.swtpm` is not an executable file (Debian: packages swtpm and swtpm-tools).
    #[error("swtpm {path} is not there or not executable (Debian: apt-get install swtpm swtpm-tools): {reason}")]
    Missing {
        /// `qemu.swtpm`.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The state directory could not be made, opened or given its mode.
    #[error("cannot prepare the TPM state directory {path}: {source}")]
    StateDir {
        /// `STATE/disks/NAME/tpm`.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
    /// The control socket pair or the log could not be made.
    #[error("cannot set up swtpm's control channel or log: {0}")]
    Setup(#[source] io::Error),
    /// swtpm could not be started (through the spawner or in-process).
    #[error("cannot start swtpm: {0}")]
    Spawn(#[source] io::Error),
    /// A copy of the state (in a snapshot or a backup) could not be written, or is missing or
    /// not what its record says (its sha256 or length differ).
    #[error("TPM state copy {path}: {reason}")]
    Copy {
        /// The copy.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The state could not be removed.
    #[error("cannot remove the TPM state {path}: {source}")]
    Remove {
        /// `STATE/disks/NAME/tpm`.
        path: PathBuf,
        /// OS error.
        source: io::Error,
    },
}

impl From<TpmError> for ApiError {
    fn from(e: TpmError) -> ApiError {
        match e {
            TpmError::Missing { .. } => ApiError::invalid("spec.tpm", e.to_string()),
            other => ApiError::new(crate::api::Code::ProvisioningFailed, other.to_string())
                .details(serde_json::json!({ "step": "tpm" })),
        }
    }
}

/// `STATE/disks/NAME/tpm`: the VM's TPM state directory.
pub fn state_dir(paths: &VmPaths) -> PathBuf {
    paths.disk_dir.join(STATE_DIR)
}

/// The files that hold the VM's TPM state now (those of [`STATE_FILE_NAMES`] that exist), for
/// snapshots and backups to copy. Empty when the VM has no TPM state (no `tpm`, or never
/// started with one). Copy them while swtpm does not run (a stopped VM); they are
/// `qemu.user`'s, mode 0600, so the daemon reads them through the spawner (module doc).
pub fn state_files(paths: &VmPaths) -> Vec<PathBuf> {
    let dir = state_dir(paths);
    // Never through a link: a link named like a state file is not state.
    STATE_FILE_NAMES
        .iter()
        .map(|n| dir.join(n))
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_file()))
        .collect()
}

/// Whether `name` is one of [`STATE_FILE_NAMES`]: what a move or a copy's record may name.
pub fn is_state_file_name(name: &str) -> bool {
    STATE_FILE_NAMES.contains(&name)
}

/// Whether a record's TPM entry `f` (a snapshot's, a backup's) names a state file's copy: one
/// of [`STATE_FILE_NAMES`], kept as [`copy_name`] of it (no other file, no path).
pub fn names_a_state_copy(f: &crate::api::snapshots::TpmFile) -> bool {
    is_state_file_name(&f.name) && f.file == copy_name(&f.name)
}

/// Whether `name` is one of [`STATE_FILE_NAMES`]: the only names the state requests open or
/// write, so a request can name nothing else in the directory it is given.
fn check_state_name(name: &str) -> io::Result<()> {
    if is_state_file_name(name) {
        Ok(())
    } else {
        Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a TPM state file name")))
    }
}

/// Opens state file `name` (one of [`STATE_FILE_NAMES`]) in the state directory `dir` for
/// reading, never through a link, and only a regular file. Run where the file can be read: the
/// spawner with `CAP_DAC_READ_SEARCH` raised for this open (the files are `qemu.user`'s,
/// 0600), or a daemon without a spawner.
///
/// # Errors
/// `InvalidInput` for another name or a file that is not regular, the OS error of the open
/// (`ELOOP` for a link, `NotFound` when there is none).
pub fn open_state_file(dir: std::os::fd::BorrowedFd<'_>, name: &str) -> io::Result<OwnedFd> {
    check_state_name(name)?;
    let file = nix::fcntl::openat(
        dir,
        name,
        nix::fcntl::OFlag::O_RDONLY
            | nix::fcntl::OFlag::O_NOFOLLOW
            | nix::fcntl::OFlag::O_CLOEXEC
            | nix::fcntl::OFlag::O_NONBLOCK,
        nix::sys::stat::Mode::empty(),
    )?;
    let meta = nix::sys::stat::fstat(&file)?;
    if meta.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("TPM state {name:?} is not a regular file")));
    }
    Ok(file)
}

/// Writes the bytes of `data` (read from its start) as state file `name` in the state
/// directory `dir`: a temporary file made there (never through a link), written, synced,
/// given to `owner` when one is named (a daemon without a spawner, which may chown), and
/// renamed over `name`, so swtpm finds the old file or the new one whole. The spawner runs it
/// in a short-lived child already running as `qemu.user` ([`write_state_file_as`]), so the
/// file is that user's without `CAP_CHOWN`.
///
/// # Errors
/// `InvalidInput` for another name; the OS error of any step (the temporary file is removed).
pub fn write_state_file(
    dir: std::os::fd::BorrowedFd<'_>,
    name: &str,
    data: std::os::fd::BorrowedFd<'_>,
    owner: Option<UserIds>,
) -> io::Result<()> {
    use nix::fcntl::OFlag;
    use std::io::{Read, Seek, Write};
    check_state_name(name)?;
    // Never a pipe or a device: the spawner waits for the writer, which must not block.
    let meta = nix::sys::stat::fstat(data)?;
    if meta.st_mode & libc::S_IFMT != libc::S_IFREG || meta.st_size as u64 > MAX_STATE_FILE_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a TPM state file's copy must be a regular file of at most {MAX_STATE_FILE_BYTES} bytes"),
        ));
    }
    let dirfd = dir;
    let temp = format!(".{name}.vmhost-restore");
    let _ = nix::unistd::unlinkat(dirfd, temp.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
    let raw = nix::fcntl::openat(
        dirfd,
        temp.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::from_bits_truncate(STATE_FILE_MODE),
    )?;
    let mut out = std::fs::File::from(raw);
    let written = (|| {
        let mut input = std::fs::File::from(data.try_clone_to_owned()?);
        input.seek(io::SeekFrom::Start(0))?;
        let mut bytes = Vec::new();
        input.read_to_end(&mut bytes)?;
        out.write_all(&bytes)?;
        if let Some(u) = owner {
            nix::unistd::fchown(&out, Some(u.uid.into()), Some(u.gid.into()))?;
        }
        nix::sys::stat::fchmod(&out, nix::sys::stat::Mode::from_bits_truncate(STATE_FILE_MODE))?;
        out.sync_all()?;
        nix::fcntl::renameat(dirfd, temp.as_str(), dirfd, name)?;
        nix::unistd::fsync(dirfd)?;
        Ok::<_, io::Error>(())
    })();
    if written.is_err() {
        let _ = nix::unistd::unlinkat(dirfd, temp.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
    }
    written
}

/// [`write_state_file`] in a child process forked for it that first becomes `user` (no
/// supplementary groups): the file it makes is that user's, and it can reach no more than that
/// user may. For a single-threaded process (the spawner), which waits for the child.
///
/// # Errors
/// The fork or the wait failed, or the child's errno (as an `io::Error`).
pub fn write_state_file_as(
    dir: std::os::fd::BorrowedFd<'_>,
    name: &str,
    data: std::os::fd::BorrowedFd<'_>,
    user: UserIds,
) -> io::Result<()> {
    check_state_name(name)?;
    // SAFETY: the caller is single-threaded (module doc of the spawner), so the child may do
    // anything the parent could; it leaves with _exit, running no destructors of the parent's.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => {
            let result = (|| {
                nix::unistd::setgroups(&[])?;
                nix::unistd::setresgid(user.gid.into(), user.gid.into(), user.gid.into())?;
                nix::unistd::setresuid(user.uid.into(), user.uid.into(), user.uid.into())?;
                write_state_file(dir, name, data, None)
            })();
            let code = match result {
                Ok(()) => 0,
                Err(e) => e.raw_os_error().unwrap_or(libc::EIO).clamp(1, 255),
            };
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(code) }
        }
        nix::unistd::ForkResult::Parent { child } => loop {
            match nix::sys::wait::waitpid(child, None) {
                Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => return Ok(()),
                Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => return Err(io::Error::from_raw_os_error(code)),
                Ok(other) => return Err(io::Error::other(format!("the TPM state writer ended: {other:?}"))),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        },
    }
}

/// The VM's state directory opened for the state requests (`O_DIRECTORY | O_NOFOLLOW`), `None`
/// when the VM has none (never started with a TPM).
fn open_existing_state_dir(paths: &VmPaths) -> Result<Option<OwnedFd>, TpmError> {
    let dir = state_dir(paths);
    match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW).open(&dir) {
        Ok(f) => Ok(Some(f.into())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TpmError::StateDir { path: dir, source }),
    }
}

/// Reads the VM's TPM state (a snapshot or a backup keeps it): each of [`STATE_FILE_NAMES`]
/// that exists, by name with its bytes, opened by the spawner ([`crate::sandbox::spawn::tpm_state_file`]).
/// swtpm writes each file whole as a temporary file renamed into place, so a file opened while
/// swtpm runs is one whole version of it (a running VM's copy is crash-consistent, taken just
/// after its disks'). Empty when the VM has no state.
///
/// # Errors
/// [`TpmError::StateDir`] when the directory or a file cannot be opened or read.
pub async fn read_state(paths: &VmPaths) -> Result<Vec<(String, Vec<u8>)>, TpmError> {
    use std::io::Read;
    let Some(dir) = open_existing_state_dir(paths)? else { return Ok(Vec::new()) };
    let failed = |source: io::Error| TpmError::StateDir { path: state_dir(paths), source };
    let mut files = Vec::new();
    for name in STATE_FILE_NAMES {
        let dup = dir.try_clone().map_err(failed)?;
        let fd = match spawn::tpm_state_file(dup, name).await {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(failed(e)),
        };
        let bytes = crate::blocking::run(|| {
            let mut bytes = Vec::new();
            std::fs::File::from(fd).read_to_end(&mut bytes).map(|_| bytes)
        })
        .map_err(failed)?;
        files.push((name.to_string(), bytes));
    }
    Ok(files)
}

/// Puts TPM state back (a revert, an import): each of `files` (a name of [`STATE_FILE_NAMES`]
/// and an open copy of its bytes) written as a file `user` owns ([`write_state_file`], through
/// the spawner), then every other state file removed, so the directory holds exactly that
/// state. The VM's swtpm must not run. The directory is made when missing.
///
/// # Errors
/// [`TpmError::StateDir`].
pub async fn put_back_state(
    paths: &VmPaths,
    files: Vec<(String, OwnedFd)>,
    user: Option<UserIds>,
) -> Result<(), TpmError> {
    let dir = prepare_state_dir(paths)?;
    let failed = |source: io::Error| TpmError::StateDir { path: state_dir(paths), source };
    let mut kept = Vec::new();
    for (name, data) in files {
        let dup = dir.try_clone().map_err(failed)?;
        spawn::tpm_state_place(dup, &name, data, user).await.map_err(failed)?;
        kept.push(name);
    }
    for name in STATE_FILE_NAMES {
        if kept.iter().any(|k| k == name) {
            continue;
        }
        match nix::unistd::unlinkat(&dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(failed(e.into())),
        }
    }
    Ok(())
}

/// The name of a state file's copy in a snapshot's or a backup's directory.
pub fn copy_name(name: &str) -> String {
    format!("tpm-{name}")
}

/// Copies the VM's TPM state ([`read_state`]) into `dir` (a snapshot's or a backup's
/// directory: root's files, 0600, synced) and returns its record; `None` when the VM has no
/// state yet.
///
/// # Errors
/// [`TpmError::StateDir`] (reading), [`TpmError::Copy`] (writing).
pub async fn copy_state_into(paths: &VmPaths, dir: &Path) -> Result<Option<crate::api::snapshots::TpmCopy>, TpmError> {
    use std::io::Write;
    let files = read_state(paths).await?;
    if files.is_empty() {
        return Ok(None);
    }
    let mut record = Vec::new();
    for (name, bytes) in files {
        let file = copy_name(&name);
        let path = dir.join(&file);
        let failed = |e: io::Error| TpmError::Copy { path: path.clone(), reason: e.to_string() };
        crate::blocking::run(|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)?;
            f.write_all(&bytes)?;
            f.sync_all()
        })
        .map_err(failed)?;
        record.push(crate::api::snapshots::TpmFile {
            name,
            file,
            bytes: bytes.len() as u64,
            sha256: crate::agent::exec::files::sha256(&bytes),
        });
    }
    Ok(Some(crate::api::snapshots::TpmCopy { files: record }))
}

/// Opens each file of the copy `copy` in `dir` and checks it against its record (length and
/// sha256), before anything is put back; returns them for [`put_back_state`].
///
/// # Errors
/// [`TpmError::Copy`]: a name that is not a state file's, a copy missing, unreadable or not
/// what was recorded.
pub fn open_checked_copy(
    dir: &Path,
    copy: &crate::api::snapshots::TpmCopy,
) -> Result<Vec<(String, OwnedFd)>, TpmError> {
    use std::io::{Read, Seek};
    let mut out = Vec::new();
    for f in &copy.files {
        let path = dir.join(&f.file);
        let bad = |reason: String| TpmError::Copy { path: path.clone(), reason };
        if !names_a_state_copy(f) {
            return Err(bad(format!("{:?} is not a TPM state file's copy", f.file)));
        }
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| bad(e.to_string()))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(|e| bad(e.to_string()))?;
        let sha = crate::agent::exec::files::sha256(&bytes);
        if bytes.len() as u64 != f.bytes || sha != f.sha256 {
            return Err(bad(format!(
                "{} bytes, sha256 {sha}; recorded {} bytes, sha256 {}",
                bytes.len(),
                f.bytes,
                f.sha256
            )));
        }
        file.rewind().map_err(|e| bad(e.to_string()))?;
        out.push((f.name.clone(), file.into()));
    }
    Ok(out)
}

/// Whether `swtpm` is an executable regular file.
///
/// # Errors
/// [`TpmError::Missing`] saying why not.
pub fn check(swtpm: &Path) -> Result<(), TpmError> {
    use std::os::unix::fs::PermissionsExt;
    let missing = |reason: String| TpmError::Missing { path: swtpm.to_path_buf(), reason };
    let meta = std::fs::metadata(swtpm).map_err(|e| missing(e.to_string()))?;
    if !meta.is_file() {
        return Err(missing("not a regular file".into()));
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err(missing("not executable".into()));
    }
    Ok(())
}

/// `host.check` item `tpm`: swtpm there and runnable (`swtpm --version`, run as it runs for a
/// VM). Without it only VMs with `tpm` cannot start: the item fails only when one of
/// `tpm_vms` (by name) has it, and is otherwise `ok` with what is wrong.
pub async fn check_item(swtpm: &Path, tpm_vms: &[String]) -> CheckItem {
    let item = |status, detail: String| CheckItem { name: "tpm".into(), status, detail };
    let problem = match check(swtpm) {
        Err(e) => (CheckStatus::Missing, e.to_string()),
        Ok(()) => {
            let run = spawn::Command::version_probe(swtpm).output();
            match tokio::time::timeout(std::time::Duration::from_secs(10), run).await {
                Ok(Ok(out)) if out.status.success() => {
                    let text = String::from_utf8_lossy(&out.stdout);
                    let version = text.lines().next().unwrap_or("").trim().to_string();
                    return item(CheckStatus::Ok, format!("{}: {version}", swtpm.display()));
                }
                Ok(Ok(out)) => {
                    (CheckStatus::Error, format!("{} --version exited with {}", swtpm.display(), out.status))
                }
                Ok(Err(e)) => (CheckStatus::Error, format!("cannot run {}: {e}", swtpm.display())),
                Err(_) => (CheckStatus::Error, format!("{} --version did not finish within 10 s", swtpm.display())),
            }
        }
    };
    if tpm_vms.is_empty() {
        return item(CheckStatus::Ok, format!("needed only for tpm: true, which no VM uses: {}", problem.1));
    }
    item(problem.0, format!("{}; tpm: true is used by {}", problem.1, tpm_vms.join(", ")))
}

/// Makes the VM's state directory unless it exists (its parent, the disk directory, private as
/// always) and gives it [`STATE_DIR_MODE`]; returns it opened (read-only, `O_DIRECTORY | O_NOFOLLOW`), for swtpm.
///
/// # Errors
/// [`TpmError::StateDir`].
pub fn prepare_state_dir(paths: &VmPaths) -> Result<OwnedFd, TpmError> {
    let dir = state_dir(paths);
    let failed = |source: io::Error| TpmError::StateDir { path: dir.clone(), source };
    crate::state::dirs::private_dir(&paths.disk_dir).map_err(failed)?;
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(failed(e)),
    }
    // Never through a link: the mode is set on what was opened, and that is what swtpm gets.
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(&dir)
        .map_err(failed)?;
    nix::sys::stat::fchmod(std::os::fd::AsFd::as_fd(&handle), nix::sys::stat::Mode::from_bits_truncate(STATE_DIR_MODE))
        .map_err(|e| failed(e.into()))?;
    Ok(handle.into())
}

/// swtpm's arguments: a TPM 2.0 whose control channel is the connected socket at fd `ctrl`
/// (QEMU sends its data channel over it), its state in the directory at fd `state`, ending when
/// the control channel closes.
pub fn swtpm_args(ctrl: i32, state: i32) -> Vec<OsString> {
    [
        "socket".to_string(),
        "--tpm2".into(),
        "--ctrl".into(),
        format!("type=unixio,clientfd={ctrl}"),
        "--tpmstate".into(),
        format!("dir=/proc/self/fd/{state},mode=0{STATE_FILE_MODE:o}"),
        "--terminate".into(),
    ]
    .into_iter()
    .map(OsString::from)
    .collect()
}

/// A started swtpm.
#[derive(Debug)]
pub struct Started {
    /// Its process, to record.
    pub identity: ProcessIdentity,
    /// QEMU's end of the control channel ([`crate::qemu::argv::PassedFd::TpmCtrl`]).
    pub qemu_end: OwnedFd,
}

/// Starts the VM's swtpm: the state directory prepared ([`prepare_state_dir`]), a socket pair
/// made, swtpm started as `user` (the spawner runs it as `qemu.user` whatever is asked) with one
/// end and the directory, its stderr appended to `log` (QEMU's log: swtpm's complaints are
/// read where QEMU's are). Returns its identity and QEMU's end. swtpm waits for QEMU on the
/// channel; when QEMU's end is closed without QEMU (a failed launch drops it), swtpm ends.
///
/// # Errors
/// [`TpmError::StateDir`], [`TpmError::Setup`], [`TpmError::Spawn`].
pub async fn start(swtpm: &Path, user: Option<UserIds>, paths: &VmPaths, log: &Path) -> Result<Started, TpmError> {
    let state = prepare_state_dir(paths)?;
    let (ours, theirs) = nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::Stream,
        None,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| TpmError::Setup(e.into()))?;
    let log = std::fs::OpenOptions::new().append(true).create(true).mode(0o600).open(log).map_err(TpmError::Setup)?;
    let command = spawn::Command::new(swtpm)
        .args(swtpm_args(FIRST_PASSED_FD, FIRST_PASSED_FD + 1))
        .stderr_to(log.into())
        .pass_fds(vec![theirs, state])
        .user(user);
    let child = command.spawn().await.map_err(TpmError::Spawn)?;
    let identity = crate::process::identify(child.pid).map_err(TpmError::Spawn)?;
    // Its life is tied to QEMU's through the channel, not to this handle.
    child.detach();
    Ok(Started { identity, qemu_end: ours })
}

/// At daemon start, for a VM whose record names swtpm `recorded`: when its QEMU no longer runs
/// (`qemu_alive` false) and that very process (pid and start time) still does, it is killed:
/// a swtpm ends with its QEMU by itself, so one left is stray and would hold the state's lock.
/// Returns whether it killed one.
pub fn settle(vm: &str, recorded: Option<&ProcessIdentity>, qemu_alive: bool) -> bool {
    let Some(id) = recorded else { return false };
    if qemu_alive || crate::process::identify(id.pid).ok().as_ref() != Some(id) {
        return false;
    }
    if !crate::process::liveness(id.pid).is_alive() {
        return false;
    }
    tracing::warn!(vm, pid = id.pid, "ending a swtpm whose QEMU is gone");
    crate::process::signal(id.pid, nix::sys::signal::Signal::SIGKILL).unwrap_or(false)
}

/// Ends the VM's swtpm `recorded` once its QEMU is gone (a teardown), and waits (at most
/// [`STOP_WAIT`]) until it has: it ends by itself when QEMU closes the channel, but the state
/// directory must not be removed under a swtpm still writing it. Nothing when that process no
/// longer runs.
pub async fn stop(vm: &str, recorded: Option<&ProcessIdentity>) {
    let Some(id) = recorded else { return };
    if crate::process::identify(id.pid).ok().as_ref() != Some(id) {
        return;
    }
    if let Err(e) = crate::process::signal(id.pid, nix::sys::signal::Signal::SIGKILL) {
        tracing::warn!(vm, pid = id.pid, error = %e, "cannot end swtpm");
    }
    if tokio::time::timeout(STOP_WAIT, crate::process::wait_exit_of(id)).await.is_err() {
        tracing::warn!(vm, pid = id.pid, "swtpm did not end within {STOP_WAIT:?}");
    }
}

/// How long [`stop`] waits for swtpm to end.
pub const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Removes the VM's TPM state (the destroy): the directory and everything in it.
///
/// # Errors
/// [`TpmError::Remove`] when it exists and cannot be removed.
pub fn remove_state(paths: &VmPaths) -> Result<(), TpmError> {
    let dir = state_dir(paths);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {
            tracing::info!(path = %dir.display(), "removed the TPM state");
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(TpmError::Remove { path: dir, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn paths(dir: &Path) -> VmPaths {
        let mut c = crate::validate::tests::config();
        c.paths.state = dir.to_path_buf();
        VmPaths::for_vm(&c, "t1")
    }

    #[test]
    fn swtpm_gets_its_channel_and_state_as_descriptors_and_ends_with_the_channel() {
        let args: Vec<String> = swtpm_args(3, 4).into_iter().map(|a| a.into_string().unwrap()).collect();
        assert_eq!(
            args,
            [
                "socket",
                "--tpm2",
                "--ctrl",
                "type=unixio,clientfd=3",
                "--tpmstate",
                "dir=/proc/self/fd/4,mode=0600",
                "--terminate"
            ]
        );
    }

    #[test]
    fn the_state_directory_is_made_once_with_its_mode_and_named_files_are_listed() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let p = paths(d.path());
        assert!(state_files(&p).is_empty());
        let fd = prepare_state_dir(&p).unwrap();
        let dir = state_dir(&p);
        assert_eq!(dir, p.disk_dir.join("tpm"));
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, STATE_DIR_MODE);
        assert_eq!(std::fs::metadata(&p.disk_dir).unwrap().mode() & 0o7777, 0o700);
        assert_eq!(std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap(), dir);
        std::fs::write(dir.join("tpm2-00.permall"), b"state").unwrap();
        std::fs::write(dir.join(".lock"), b"").unwrap();
        // A second launch keeps what is there and puts the mode back.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        prepare_state_dir(&p).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, STATE_DIR_MODE);
        assert_eq!(state_files(&p), [dir.join("tpm2-00.permall")]);
        remove_state(&p).unwrap();
        assert!(!dir.exists());
        remove_state(&p).unwrap();
    }

    #[test]
    fn a_link_in_place_of_the_state_directory_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = paths(d.path());
        std::fs::create_dir_all(&p.disk_dir).unwrap();
        std::os::unix::fs::symlink("/tmp", state_dir(&p)).unwrap();
        assert!(matches!(prepare_state_dir(&p), Err(TpmError::StateDir { .. })));
    }

    #[test]
    fn state_files_are_read_and_written_by_name_in_the_directory_never_through_links() {
        use std::os::fd::AsFd;
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let p = paths(d.path());
        let dir = prepare_state_dir(&p).unwrap();
        let state = state_dir(&p);
        // A link named like a state file is neither listed nor opened.
        std::os::unix::fs::symlink("/etc/hostname", state.join("tpm2-00.permall")).unwrap();
        assert!(state_files(&p).is_empty());
        assert_eq!(open_state_file(dir.as_fd(), "tpm2-00.permall").unwrap_err().raw_os_error(), Some(libc::ELOOP));
        // Only the state's names.
        assert_eq!(open_state_file(dir.as_fd(), "../x").unwrap_err().kind(), io::ErrorKind::InvalidInput);
        let src = d.path().join("copy");
        std::fs::write(&src, b"persistent").unwrap();
        let data = std::fs::File::open(&src).unwrap();
        assert_eq!(
            write_state_file(dir.as_fd(), ".lock", data.as_fd(), None).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        // Written over the link (renamed over it, not through it), with the state's mode and the
        // owner asked for.
        let owner = UserIds { uid: 4321, gid: 4322 };
        write_state_file(dir.as_fd(), "tpm2-00.permall", data.as_fd(), Some(owner)).unwrap();
        let m = std::fs::symlink_metadata(state.join("tpm2-00.permall")).unwrap();
        assert!(m.is_file());
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (4321, 4322, STATE_FILE_MODE));
        assert_eq!(state_files(&p), [state.join("tpm2-00.permall")]);
        let mut read = String::new();
        std::io::Read::read_to_string(
            &mut std::fs::File::from(open_state_file(dir.as_fd(), "tpm2-00.permall").unwrap()),
            &mut read,
        )
        .unwrap();
        assert_eq!(read, "persistent");
        // A child as another user writes a file that user owns.
        write_state_file_as(dir.as_fd(), "tpm2-00.volatilestate", data.as_fd(), owner).unwrap();
        let m = std::fs::metadata(state.join("tpm2-00.volatilestate")).unwrap();
        assert_eq!((m.uid(), m.gid()), (4321, 4322));
        assert!(std::fs::read_dir(&state)
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().contains("restore")));
    }

    #[tokio::test]
    async fn a_copy_is_taken_checked_and_put_back_and_a_changed_copy_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = paths(d.path());
        let snap = d.path().join("snap");
        std::fs::create_dir(&snap).unwrap();
        assert_eq!(copy_state_into(&p, &snap).await.unwrap(), None, "no state yet");
        prepare_state_dir(&p).unwrap();
        let state = state_dir(&p);
        std::fs::write(state.join("tpm2-00.permall"), b"v1").unwrap();
        let copy = copy_state_into(&p, &snap).await.unwrap().unwrap();
        assert_eq!(copy.files.len(), 1);
        assert_eq!(copy.files[0].file, "tpm-tpm2-00.permall");
        assert_eq!(copy.files[0].bytes, 2);
        std::fs::write(state.join("tpm2-00.permall"), b"v2 longer").unwrap();
        std::fs::write(state.join("tpm2-00.volatilestate"), b"later").unwrap();
        let files = open_checked_copy(&snap, &copy).unwrap();
        put_back_state(&p, files, None).await.unwrap();
        assert_eq!(std::fs::read(state.join("tpm2-00.permall")).unwrap(), b"v1");
        assert!(!state.join("tpm2-00.volatilestate").exists(), "state the copy has not is removed");
        std::fs::write(snap.join("tpm-tpm2-00.permall"), b"v3").unwrap();
        assert!(matches!(open_checked_copy(&snap, &copy), Err(TpmError::Copy { .. })));
        let mut odd = copy.clone();
        odd.files[0].file = "../x".into();
        assert!(matches!(open_checked_copy(&snap, &odd), Err(TpmError::Copy { .. })));
    }

    #[test]
    fn a_missing_swtpm_is_a_2001_on_spec_tpm() {
        let e: ApiError = check(Path::new("/nonexistent/swtpm")).unwrap_err().into();
        assert_eq!(e.code.as_i32(), 2001);
        assert_eq!(e.field.as_deref(), Some("spec.tpm"));
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("swtpm");
        std::fs::write(&file, b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        assert!(check(&file).is_err(), "not executable");
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        assert!(check(&file).is_ok());
        assert!(check(d.path()).is_err(), "a directory");
    }

    #[test]
    fn settle_leaves_alone_what_is_not_a_stray_swtpm() {
        assert!(!settle("t1", None, false));
        let me = crate::process::identify(std::process::id() as i32).unwrap();
        // Its QEMU runs: kept.
        assert!(!settle("t1", Some(&me), true));
        // Another process now has the pid: never signalled.
        let other = ProcessIdentity { pid: me.pid, start_ticks: me.start_ticks + 1 };
        assert!(!settle("t1", Some(&other), false));
    }

    #[tokio::test]
    async fn stop_ends_the_recorded_process_and_waits_for_it() {
        let mut child = std::process::Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let id = crate::process::identify(child.id() as i32).unwrap();
        // Reaped here, as the spawner reaps a real swtpm, so the wait sees it gone.
        let reaper = std::thread::spawn(move || child.wait().unwrap());
        stop("t1", Some(&id)).await;
        assert!(!reaper.join().unwrap().success());
        // Gone, or never recorded: nothing to do.
        stop("t1", Some(&id)).await;
        stop("t1", None).await;
    }

    #[tokio::test]
    async fn a_stray_swtpm_is_ended() {
        let mut child = std::process::Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let id = crate::process::identify(child.id() as i32).unwrap();
        assert!(settle("t1", Some(&id), false));
        let status = child.wait().unwrap();
        assert!(!status.success());
    }
}
