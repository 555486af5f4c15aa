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
//! [`state_files`] names the state's files for snapshots and backups.
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
//! owns the directory) but not read them; a copy must be read by the spawner (which raises
//! `CAP_DAC_READ_SEARCH` to open boot files), and putting a copy back must leave a file
//! `qemu.user` owns, which only the spawner can make.

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
    STATE_FILE_NAMES.iter().map(|n| dir.join(n)).filter(|p| p.is_file()).collect()
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

/// Why a VM with `tpm` is not moved to another host (`vm.move`, `vm.migrate`: 4097 reason
/// `tpm`), `None` for one without: its state would have to arrive as files `qemu.user` owns
/// (module doc), which a move does not make yet, and a guest that met a new TPM there would
/// lose what it sealed to this one.
pub fn move_refusal(spec: &crate::api::VmSpec) -> Option<String> {
    spec.tpm.then(|| {
        format!(
            "VM {:?} has a TPM (tpm: true), whose state vmhost does not move to another host yet; \
             a guest would meet a new TPM there and lose what it sealed to this one",
            spec.name
        )
    })
}

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
