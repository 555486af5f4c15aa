//! Changing a running VM's data disks without a restart: grow, unplug, hot-plug.
//!
//! [`VmOp::change_disks_live`] is the running-VM branch of a reconfigure whose disk change
//! [`crate::plan::live_disk_changes`] can reach live. The record's `running_spec` says what the
//! live QEMU has; it is written before the first step (the change is pending) and after every
//! disk that changed in QEMU, so a crash at any point leaves a record that is right or one step
//! behind, which [`HeldVm::settle_hotplug`] puts right from what QEMU shows. In order:
//!
//! 1. grow: `block_resize` of each larger disk (a preallocated raw disk then gets its new
//!    blocks reserved);
//! 2. unplug each dropped disk ([`crate::qemu::hotplug::detach`]: the guest must release it),
//!    record that QEMU no longer has it, then delete it or keep it (`keep_on_destroy`);
//! 3. hot-plug each new disk: make it (tracked in the record's disk work like a create's,
//!    so a crash before it is attached undoes it), attach it on descriptors
//!    ([`crate::qemu::hotplug::attach`]), record that QEMU has it, end the tracking.
//!
//! A step that fails undoes itself (a disk made for a failed attach is deleted, one taken back
//! is returned) and stops there: what was done before it stays done and recorded, and the rest
//! of the change stays pending (`pending_restart`) until the next start or apply.

use super::held::HeldVm;
use super::op::VmOp;
use crate::api::{ApiError, DataDiskSpec, VmSpec};
use crate::qemu::hotplug::{self, DiskFds, HotplugError};
use crate::qemu::qmp::Qmp;
use serde_json::json;
use std::collections::BTreeSet;
use std::os::unix::fs::OpenOptionsExt;
use std::time::Duration;

/// Bound on each QMP command of a live disk change (a resize or an attach).
const QMP_TIMEOUT: Duration = Duration::from_secs(30);

/// Shortest wait for a guest to release an unplugged disk, whatever `timeout_s` says.
const MIN_RELEASE: Duration = Duration::from_secs(10);

/// How a failed attach left QEMU.
enum HotplugOutcome {
    /// QEMU refused a step: nothing of the disk is in it.
    Refused,
    /// No answer: QEMU may have the disk.
    Unknown,
}

fn failed(disk: &str, what: &'static str, e: impl Into<super::errors::LiveDiskCause>) -> ApiError {
    super::errors::QemuStepError::LiveDisk { disk: disk.into(), what, source: e.into() }.into()
}

/// Whether a QEMU running `running` still lacks part of `spec`: a restart, or a live disk step.
pub(super) fn still_pending(running: &VmSpec, spec: &VmSpec) -> bool {
    crate::plan::restart_needed(running, spec)
        || crate::plan::live_disk_changes(running, spec).is_some_and(|c| !c.is_empty())
}

/// A live disk change that failed: `touched` when QEMU may have changed (a step completed, or
/// an unplug or attach was asked for and not confirmed either way), so the new spec stays
/// recorded with what QEMU has; otherwise nothing changed and the old record can come back.
pub(super) struct LiveFailure {
    /// The error to report.
    pub error: ApiError,
    /// QEMU may have changed.
    pub touched: bool,
}

impl VmOp {
    /// Whether the VM's running QEMU can take `running`'s data disks to `desired`'s
    /// live: the change is one [`crate::plan::live_disk_changes`] allows, there are enough free
    /// root ports for the new disks, and each dropped disk sits behind a root port (a VM
    /// started before disks had ports has them where they cannot be unplugged). No disk change
    /// at all is live.
    ///
    /// # Errors
    /// 4001 when QEMU cannot be asked.
    pub(super) async fn disks_live_capable(&self, running: &VmSpec, desired: &VmSpec) -> Result<bool, ApiError> {
        let mgr = self.mgr();
        let Some(changes) = crate::plan::live_disk_changes(running, desired) else { return Ok(false) };
        if changes.add.is_empty() && changes.remove.is_empty() {
            return Ok(true);
        }
        let mut q = mgr.qmp(self.name(), QMP_TIMEOUT).await.map_err(|e| failed("*", "change", e))?;
        let remove: Vec<&str> = changes.remove.iter().map(|d| d.name.as_str()).collect();
        let pcie = hotplug::is_pcie(&mgr.config.qemu.machine);
        hotplug::can_change(&mut q, pcie, changes.add.len(), &remove).await.map_err(|e| failed("*", "change", e))
    }

    /// Takes the VM's running QEMU from `running`'s data disks to `desired`'s (see the
    /// module doc). `release`: how long a guest may take to let go of an unplugged disk (at
    /// least [`MIN_RELEASE`]). The caller checked [`VmOp::disks_live_capable`].
    ///
    /// # Errors
    /// 4001 step `data_disk` naming the disk whose step failed; the record then says what QEMU
    /// has.
    pub(super) async fn change_disks_live(
        &self,
        running: &VmSpec,
        desired: &VmSpec,
        release: Duration,
    ) -> Result<(), LiveFailure> {
        let (mgr, name) = (self.mgr(), self.name());
        let untouched = |error: ApiError| LiveFailure { error, touched: false };
        let Some(changes) = crate::plan::live_disk_changes(running, desired) else { return Ok(()) };
        if changes.is_empty() {
            return Ok(());
        }
        let paths = self.paths();
        let first =
            changes.grow.first().map(|d| d.0).or(changes.remove.first().copied()).or(changes.add.first().copied());
        let first = first.map(|d| d.name.as_str()).unwrap_or_default();
        let mut q = mgr.qmp(name, QMP_TIMEOUT).await.map_err(|e| untouched(failed(first, "change", e)))?;
        q.set_timeout(QMP_TIMEOUT);
        let mut touched = false;
        let fail = |touched: bool| move |error: ApiError| LiveFailure { error, touched };

        for (disk, old_gib) in &changes.grow {
            let drive = crate::qemu::argv::data_drive(&disk.name);
            // `device` finds a disk attached at start (a drive), `node-name` a hot-plugged one.
            let args = json!({ "device": drive, "node-name": drive, "size": disk.size_gib.saturating_mul(1 << 30) });
            q.execute("block_resize", Some(args)).await.map_err(|e| fail(touched)(failed(&disk.name, "grow", e)))?;
            touched = true;
            self.record_running_disks(|disks| {
                if let Some(d) = disks.iter_mut().find(|d| d.name == disk.name) {
                    d.size_gib = disk.size_gib;
                }
            })
            .map_err(fail(true))?;
            if disk.preallocate && disk.format == crate::api::DiskFormat::Raw {
                crate::disk::data::preallocate_tail(&paths.data_disk(disk), old_gib.saturating_mul(1 << 30))
                    .await
                    .map_err(|e| fail(true)(failed(&disk.name, "grow", e)))?;
            }
        }

        let release = release.max(MIN_RELEASE);
        for disk in &changes.remove {
            let file = paths.data_disk(disk).to_string_lossy().into_owned();
            // Once device_del is sent the guest may let go at any time: touched either way.
            hotplug::detach(&mut q, &disk.name, &file, release)
                .await
                .map_err(|e| fail(true)(failed(&disk.name, "unplug", e)))?;
            touched = true;
            self.crashpoint("hotplug:detached");
            // The file first: a crash before the record is written leaves a record that says
            // QEMU has the disk, which a restart corrects and then finds no file to retire.
            self.held().let_go(&[*disk]).map_err(fail(true))?;
            self.record_running_disks(|disks| disks.retain(|d| d.name != disk.name)).map_err(fail(true))?;
        }

        let pcie = hotplug::is_pcie(&mgr.config.qemu.machine);
        for disk in &changes.add {
            match self.plug(&mut q, disk, pcie).await {
                Ok(()) => {}
                Err((error, HotplugOutcome::Refused)) => {
                    // Only what QEMU does not have is undone: a disk still tracked from an
                    // earlier attach whose answer was lost may be in the guest's hands. When
                    // QEMU cannot say, nothing is deleted.
                    match hotplug::attached(&mut q).await {
                        Ok(devices) => self.held().undo_data_disks_except(&devices),
                        Err(e) => {
                            tracing::error!(vm = name, error = %e, "a refused hot-plug's disk stays: QEMU cannot say what it has")
                        }
                    }
                    return Err(fail(touched)(error));
                }
                // QEMU may have it: the disk stays tracked, and the next apply or a restart
                // finds out (a disk QEMU has is never deleted).
                Err((error, HotplugOutcome::Unknown)) => return Err(fail(true)(error)),
            }
            touched = true;
            self.crashpoint("hotplug:attached");
            let order: Vec<&str> = desired.disks.iter().map(|d| d.name.as_str()).collect();
            self.record_running_disks(|disks| {
                disks.push((*disk).clone());
                disks.sort_by_key(|d| order.iter().position(|n| *n == d.name));
            })
            .map_err(fail(true))?;
            self.held().end_disk_tracking().map_err(fail(true))?;
        }
        Ok(())
    }

    /// Makes (or takes back) `disk`, tracked, and attaches it to QEMU, unless QEMU has it
    /// already (an attach whose answer was lost).
    async fn plug(&self, q: &mut Qmp, disk: &DataDiskSpec, pcie: bool) -> Result<(), (ApiError, HotplugOutcome)> {
        let refused = |e: ApiError| (e, HotplugOutcome::Refused);
        let present = hotplug::attached(q).await.map_err(|e| refused(failed(&disk.name, "hot-plug", e)))?;
        if present.contains(&disk.name) {
            return Ok(());
        }
        self.ensure_data_disk(disk, true).await.map_err(refused)?;
        let file = self.paths().data_disk(disk);
        let open = |write: bool| {
            crate::blocking::run(|| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(write)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(&file)
            })
            .map(std::os::fd::OwnedFd::from)
            .map_err(|e| refused(failed(&disk.name, "open", e)))
        };
        let fds = DiskFds { rw: open(true)?, ro: open(false)? };
        hotplug::attach(q, disk, &fds, pcie).await.map_err(|e| {
            let outcome =
                if matches!(e, HotplugError::Uncertain(_)) { HotplugOutcome::Unknown } else { HotplugOutcome::Refused };
            (failed(&disk.name, "hot-plug", e), outcome)
        })
    }

    /// Changes the data disks recorded as what the VM's QEMU has (`running_spec`, or the spec
    /// when nothing is pending) with `change`; clears `running_spec` once nothing is pending
    /// any more.
    fn record_running_disks(&self, change: impl FnOnce(&mut Vec<DataDiskSpec>)) -> Result<(), ApiError> {
        self.update("data disks changed while running", |r| {
            let mut running = r.running_spec.clone().unwrap_or_else(|| r.spec.clone());
            change(&mut running.disks);
            r.running_spec = still_pending(&running, &r.spec).then_some(running);
        })
        .map(drop)
    }
}

impl HeldVm {
    /// After a daemon restart, for a re-adopted VM: takes what QEMU behind `q` really has as
    /// what the record says it runs. Removes block nodes and fd sets no device uses (a crash
    /// mid-attach), undoes tracked disks that never got a device, and deletes or keeps the
    /// file of a disk QEMU let go of that no spec lists any more (a crash mid-unplug).
    /// Recovery's ([`super::recover`]), before any operation can begin.
    ///
    /// # Errors
    /// 4001 when QEMU cannot be asked, or a file or the record cannot be changed.
    pub(super) async fn settle_hotplug(&self, q: &mut Qmp) -> Result<(), ApiError> {
        let name = self.name();
        let rec = self.record()?;
        let asked = |e: HotplugError| failed("*", "settle", e);
        let devices: BTreeSet<String> = hotplug::attached(q).await.map_err(asked)?;
        hotplug::clear_half_attached(q, &devices).await.map_err(asked)?;
        if rec.tracks_data_disks() {
            tracing::info!(vm = name, "undoing data disks of an interrupted hot-plug");
            self.undo_data_disks_except(&devices);
        }
        let running = rec.running_spec.clone().unwrap_or_else(|| rec.spec.clone());
        let mut actual = running.clone();
        actual.disks.retain(|d| devices.contains(&d.name));
        for d in &rec.spec.disks {
            if devices.contains(&d.name) && !actual.disks.iter().any(|a| a.name == d.name) {
                actual.disks.push(d.clone());
            }
        }
        if actual.disks == running.disks {
            return Ok(());
        }
        tracing::info!(vm = name, "the data disks QEMU has differ from the record: recording QEMU's");
        let gone: Vec<&DataDiskSpec> = running
            .disks
            .iter()
            .filter(|d| !devices.contains(&d.name) && !rec.spec.disks.iter().any(|s| s.name == d.name))
            .collect();
        self.update("data disks settled after a restart", |r| {
            r.running_spec = still_pending(&actual, &r.spec).then_some(actual.clone());
        })?;
        self.let_go(&gone)?;
        Ok(())
    }
}
