//! The QEMU processes of this host's VMs: the one owner of starting, finding, checking and
//! killing them.
//!
//! A VM's QEMU is known by its [`ProcessIdentity`] (pid and start time) and recognised by what
//! [`identity`] checks (its marker, user, executable, parent). Everything here works from a
//! VM's paths and recorded identity and touches no record: the lifecycle decides what to record
//! around each call.
//!
//! Order for one QEMU: [`Processes::find`] (never start a VM twice), [`Processes::spawn`],
//! [`Processes::verify_status`], and at the end [`Processes::kill`].

use super::errors::QemuStepError;
use crate::api::ApiError;
use crate::config::Config;
use crate::process::{self, ProcessIdentity};
use crate::qemu::argv::VmPaths;
use crate::qemu::identity::{self, QemuCheck};
use crate::qemu::integrity::Integrity;
use crate::qemu::launch::{launch, LaunchRequest, Launched};
use crate::qemu::qmp::Qmp;
use std::sync::Arc;
use std::time::Duration;

/// How long QMP may take to answer right after launch.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a SIGKILLed QEMU may take to exit.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Where [`Processes::find`] looks for a QEMU of the VM that is not the recorded one.
#[derive(Debug, Clone, Copy)]
pub(super) enum Search<'a> {
    /// Nowhere: only the recorded process counts.
    None,
    /// Among the processes recovery's one scan of /proc found carrying the VM's marker.
    Index(&'a identity::MarkerIndex),
    /// In a scan of /proc now.
    Proc,
}

/// Starts, finds, checks and kills the VMs' QEMUs (see the module doc).
#[derive(Debug)]
pub(super) struct Processes {
    config: Arc<Config>,
    /// The binary's pinned sha256 (`qemu.sha256`), checked before each spawn.
    integrity: Integrity,
}

impl Processes {
    pub fn new(config: Arc<Config>) -> Processes {
        let integrity = Integrity::of(&config);
        Processes { config, integrity }
    }

    /// What the config pins the QEMU binary to, and what it is now.
    pub fn integrity(&self) -> &Integrity {
        &self.integrity
    }

    /// What this VM's QEMU must be ([`identity`]): its marker, `qemu.user`'s uid (the daemon's
    /// own when QEMU runs as root), `qemu.binary`, and the process that starts QEMUs now.
    ///
    /// # Errors
    /// The spawner cannot be read in /proc.
    pub fn check(&self, paths: &VmPaths) -> std::io::Result<QemuCheck> {
        Ok(QemuCheck {
            marker: paths.cmdline_marker().into(),
            uid: self.config.qemu_user.map_or_else(|| nix::unistd::geteuid().as_raw(), |u| u.uid),
            binary: self.config.qemu.binary.clone(),
            spawner: identity::spawner()?,
        })
    }

    /// The live QEMU of the VM at `paths`, if any: the `recorded` identity while it still runs,
    /// or else a process with the VM's marker, found as `search` says: in recovery's one scan,
    /// by a scan of /proc (for the moments a QEMU may run unrecorded: recovery, just before or
    /// after a launch), or not at all.
    ///
    /// # Errors
    /// 4001 when /proc cannot be read (e.g. out of file descriptors): whether QEMU runs is then
    /// unknown, and acting as if it did not could start the VM twice.
    pub fn find(
        &self,
        paths: &VmPaths,
        recorded: Option<&ProcessIdentity>,
        search: Search<'_>,
    ) -> Result<Option<ProcessIdentity>, ApiError> {
        if recorded.is_none() && matches!(search, Search::None) {
            return Ok(None);
        }
        let check = self.check(paths).map_err(unknown_liveness)?;
        if let Some(id) = recorded {
            if identity::verify(id, &check).map_err(unknown_liveness)?.is_ok() {
                return Ok(Some(id.clone()));
            }
        }
        match search {
            Search::None => Ok(None),
            Search::Index(index) => index.find(&check),
            // Every process's command line: a scan of all of /proc.
            Search::Proc => crate::blocking::run(|| identity::find(&check)),
        }
        .map_err(unknown_liveness)
    }

    /// Starts QEMU as `request` says and returns its identity and the QMP connection it greeted
    /// on, once it runs. Dropping `request` afterwards closes our copies of the descriptors it
    /// handed over.
    ///
    /// # Errors
    /// 4002 when the binary is not the one `qemu.sha256` pins; 4001 step `qemu` with the tail
    /// of QEMU's log.
    pub async fn spawn(&self, request: &LaunchRequest) -> Result<Launched, ApiError> {
        // Checked here too, not only when the operation began: the last moment before the exec.
        self.integrity.verify_qemu()?;
        Ok(launch(request).await.map_err(QemuStepError::Start)?)
    }

    /// Checks over `qmp`, the connection a just-launched QEMU greeted on ([`Launched::qmp`]),
    /// that it reports status `expected`: `running` for a guest it runs, `inmigrate` for a
    /// migration's destination waiting for the source's state.
    ///
    /// # Errors
    /// 4001 step `qemu_verify` when QMP does not answer or reports another status.
    pub async fn verify_status(&self, mut qmp: Qmp, expected: &str) -> Result<(), ApiError> {
        qmp.set_timeout(QMP_TIMEOUT);
        match qmp.query_status().await {
            Ok(status) if status == expected => Ok(()),
            Ok(status) => Err(QemuStepError::VerifyStatus(status).into()),
            Err(e) => Err(QemuStepError::VerifyQmp(e).into()),
        }
    }

    /// Sends SIGKILL to VM `name`'s QEMU `id` (only if it still is that QEMU) and waits
    /// (bounded) for it to exit.
    ///
    /// # Errors
    /// 4001 when the process may still run afterwards: the caller must then keep the record's
    /// process and run dir, or the VM could later be started a second time.
    pub async fn kill(&self, name: &str, id: &ProcessIdentity) -> Result<(), ApiError> {
        let sig = nix::sys::signal::Signal::SIGKILL;
        let check = self.check(&VmPaths::for_vm(&self.config, name));
        match &check {
            Ok(check) => {
                if let Err(e) = identity::signal_if_qemu(id, check, sig) {
                    tracing::warn!(vm = name, pid = id.pid, error = %e, "cannot signal QEMU");
                }
            }
            Err(e) => tracing::warn!(vm = name, pid = id.pid, error = %e, "cannot signal QEMU"),
        }
        match tokio::time::timeout(KILL_WAIT, process::wait_exit_of(id)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) if check.as_ref().is_ok_and(|c| !identity::is_qemu(id, c)) => {
                tracing::debug!(vm = name, error = %e, "exit watch failed but the process is gone");
                Ok(())
            }
            outcome => {
                let source = match outcome {
                    Ok(Err(e)) => Some(e),
                    _ => None,
                };
                let e = QemuStepError::MayStillRun { pid: id.pid, source, after: KILL_WAIT };
                tracing::error!(vm = name, pid = id.pid, "{e}");
                Err(e.into())
            }
        }
    }
}

fn unknown_liveness(e: std::io::Error) -> ApiError {
    QemuStepError::Liveness(e).into()
}
