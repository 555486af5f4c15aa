//! Changing an existing VM in place: every field but `boot.image`, never a disk deleted.
//!
//! `vm.apply` (and `host.reconcile`'s `reconfigure` entries) come here once
//! [`crate::plan::classify`] has said the change keeps the disk. In order:
//!
//! 1. check the new spec's files (2001) and take the VM's busy flag;
//! 2. admit the new spec in place of the VM's own holdings (3002/3003; new disk bytes against
//!    the state file system's free space, 3002), and check its
//!    passthrough devices (3004/3005) when it is to run. A refusal returns here: nothing was
//!    recorded, a running VM keeps running exactly as it was;
//! 3. record the new spec (intent). For a running VM the record also keeps the spec its QEMU
//!    runs (`running_spec`), so after a crash from here on the VM shows `pending_restart`
//!    and holds what both specs ask for until its next start;
//! 4. by case:
//!    - not running: grow the disk offline ([`crate::disk::grow_overlay`]); start it if it is desired
//!      running;
//!    - running and now desired stopped: stop it (ACPI, `timeout_s`, kill), grow offline;
//!    - running, only disk changes ([`crate::plan::live_disk_changes`]): larger disks grow live
//!      (QMP `block_resize`), dropped ones are unplugged and new ones hot-plugged
//!      ([`super::hotplug`]), no restart;
//!    - running, `restart: false`: the same live disk steps; the next start applies the rest;
//!    - running, restart: stop (ACPI, `timeout_s`, kill), grow offline, start with the new
//!      spec. If that start fails, the old spec (with the grown disk size) is recorded again
//!      and started, and the error says so.
//!
//! The overlay is never removed or recreated here: its inode and every byte survive.

use super::op::VmOp;
use super::Manager;
use crate::api::{ApiError, Code, DesiredState, Mutation, VmSpec};
use crate::qemu::argv::DISK_DRIVE;
use crate::validate::ValidSpec;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// How long a live disk grow may take over QMP.
const RESIZE_TIMEOUT: Duration = Duration::from_secs(30);

/// Changes VM `vm.spec.name` in place to `vm` (`fields` differ; `restart`: a running VM
/// restarts for it, else the change waits for its next start except disk changes, which
/// are live; `allow_restart`: the caller's `restart`, which lets a disk change this QEMU
/// cannot take live restart it instead). See the module doc for the order.
///
/// # Errors
/// 2001 (files), 4002 (the QEMU binary is not the pinned one; checked for every change,
/// also one that starts nothing), 3002/3003/3004/3005 (admission, devices) with nothing
/// changed; 4090 when
/// the VM is busy; 4001 when a host step fails, after the rollback described above.
pub(super) async fn reconfigure(
    mgr: &Arc<Manager>,
    vm: ValidSpec,
    fields: Vec<String>,
    restart: bool,
    allow_restart: bool,
    timeout_s: u64,
) -> Result<Mutation, ApiError> {
    let name = vm.spec.name.clone();
    let span = tracing::info_span!("vm.reconfigure", vm = %name, fields = %fields.join(","));
    async move {
        super::launch::check_launch_files(mgr, &vm).await?;
        let (mut op, current) = mgr.begin_op(&name).await?;
        current.check_not_moving()?;
        op.reconfigure_steps(&vm, restart, allow_restart, timeout_s).await?;
        Ok(Mutation::new(true, Some(mgr.get(&name)?)))
    }
    .instrument(span)
    .await
}

impl VmOp {
    /// The steps of a reconfigure once the flag is held (module doc, from step 2).
    ///
    /// # Errors
    /// As [`reconfigure`].
    async fn reconfigure_steps(
        &mut self,
        vm: &ValidSpec,
        restart: bool,
        allow_restart: bool,
        timeout_s: u64,
    ) -> Result<(), ApiError> {
        let mgr = Arc::clone(self.mgr());
        let old = self.record()?;
        // Its disks may be part reverted: a change (a disk grown or dropped) would make the
        // revert that must finish first impossible.
        super::snapshots::check_not_reverting(&old)?;
        super::data_disks::admit_disk_space(&mgr, Some(&old.spec), &vm.spec)?;
        let live = self.find_live(old.process.as_ref())?;
        if vm.spec.state == DesiredState::Running && (!vm.spec.hardware.is_empty() || !vm.spec.pci.is_empty()) {
            // Capacity and conflicts first, then the kernel's view of the devices; the record
            // swap below admits again under the lock.
            {
                let t = mgr.lock();
                mgr.admit_locked(&t, &vm.spec, &old.nics)?;
            }
            super::vfio::check_passthrough(&mgr, &vm.spec).await?;
        }
        let grow_to = grown_disk(&old.spec, &vm.spec);
        let Some(id) = live else {
            self.swap_in_place(&vm.spec, None)?;
            self.crashpoint("reconfigure:recorded");
            self.grow_offline(&vm.spec, grow_to).await?;
            self.retire_dropped_disks(&old, &vm.spec)?;
            if vm.spec.state == DesiredState::Running {
                self.start_steps("reconfigure").await?;
            }
            return Ok(());
        };
        if vm.spec.state == DesiredState::Stopped {
            // Changed and to be stopped: a stop, not a restart, whatever `restart` says.
            self.swap_in_place(&vm.spec, None)?;
            self.crashpoint("reconfigure:recorded");
            self.shut_down(&id, "reconfigure: stopping", None, timeout_s, super::housekeeping::PowerOff::Acpi).await?;
            self.grow_offline(&vm.spec, grow_to).await?;
            return self.retire_dropped_disks(&old, &vm.spec);
        }
        // What the live QEMU runs: the recorded spec, or an older one a change is pending over.
        let running = old.running_spec.clone().unwrap_or_else(|| old.spec.clone());
        let live_disks = !restart && self.disks_live_capable(&running, &vm.spec).await?;
        if !restart && !live_disks && !allow_restart {
            // A disk change this QEMU cannot take live (no free root port, a disk on a bus
            // that cannot unplug) and no restart allowed: it waits for the next start.
            self.swap_in_place(&vm.spec, Some(running.clone()))?;
            self.crashpoint("reconfigure:recorded");
            return Ok(());
        }
        if live_disks {
            // The running QEMU keeps its spec; pending is what differs from that, not from the
            // last recorded one (a disk-only change leaves an earlier change pending). Disks
            // change live (grow, unplug, hot-plug), each step recorded as QEMU takes it.
            let pending = super::hotplug::still_pending(&running, &vm.spec);
            self.swap_in_place(&vm.spec, pending.then_some(running.clone()))?;
            self.crashpoint("reconfigure:recorded");
            let release = Duration::from_secs(timeout_s);
            let live = async {
                if let Some(gib) = grow_to {
                    self.grow_live(gib).await.map_err(|error| super::hotplug::LiveFailure { error, touched: false })?;
                }
                self.change_disks_live(&running, &vm.spec, release).await.map_err(|mut f| {
                    f.touched |= grow_to.is_some();
                    f
                })
            };
            if let Err(f) = live.await {
                // Nothing changed in QEMU: the old record again. Else the record says what
                // QEMU has, and the rest stays pending.
                if !f.touched {
                    self.swap_in_place(&old.spec, old.running_spec.clone())?;
                }
                return Err(f.error);
            }
            return Ok(());
        }
        self.swap_in_place(&vm.spec, Some(running.clone()))?;
        self.crashpoint("reconfigure:recorded");
        self.shut_down(&id, "reconfigure: stopping", None, timeout_s, super::housekeeping::PowerOff::Acpi).await?;
        self.crashpoint("reconfigure:stopped");
        // A rollback restores what ran, with the largest disk size any of the specs had (the
        // overlay is never shrunk).
        let disk = [running.boot.disk_gib, old.spec.boot.disk_gib].into_iter().flatten().max();
        if let Err(e) = self.grow_offline(&vm.spec, grow_to).await {
            return Err(self.roll_back(&running, disk, e).await);
        }
        match self.start_steps("reconfigure").await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.roll_back(&running, disk.max(grow_to), e).await),
        }
    }

    /// After a failed restart with the new spec: records `previous` (the spec that ran) again,
    /// with `disk_gib` the size the overlay has now (a disk is never shrunk), and starts the VM
    /// with it. Returns the error to report: `cause`, saying whether the old spec runs again.
    async fn roll_back(&mut self, previous: &VmSpec, disk_gib: Option<u64>, cause: ApiError) -> ApiError {
        let name = previous.name.as_str();
        let mut spec = previous.clone();
        if spec.boot.disk_gib.is_some() && disk_gib.is_some() {
            spec.boot.disk_gib = disk_gib;
        }
        tracing::warn!(vm = name, error = %cause, "reconfigure failed; starting the VM with its previous spec");
        let restored = async {
            self.swap_in_place(&spec, None)?;
            self.start_steps("reconfigure rolled back").await
        }
        .await;
        let (message, rolled_back) = match &restored {
            Ok(_) => (format!("reconfigure failed: {}; the VM runs again with its previous spec", cause.message), true),
            Err(again) => (
                format!(
                    "reconfigure failed: {}; starting it again with its previous spec failed too: {}",
                    cause.message, again.message
                ),
                false,
            ),
        };
        ApiError::new(Code::ProvisioningFailed, message).details(json!({
            "step": "reconfigure",
            "rolled_back": rolled_back,
            "cause": cause.to_json(),
        }))
    }

    /// Records `spec` for the VM in place of its current one, admitted (capacity, conflicts,
    /// NICs keeping their MACs and taps) against every other VM under the allocation lock, the
    /// VM's own holdings counted as released. `running` is the spec its live QEMU still runs,
    /// if that differs. Status, process, overlay and device bindings are kept.
    ///
    /// # Errors
    /// 3002/3003 from admission (nothing written), or the record cannot be written.
    fn swap_in_place(&self, spec: &VmSpec, running: Option<VmSpec>) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr(), self.name());
        mgr.registry.write(name, "vm.apply in place", |t| {
            let old = t.vms.get(name).cloned().ok_or_else(|| ApiError::not_found(name))?;
            let mut rec = old.clone();
            rec.nics = mgr.admit_locked(t, spec, &old.nics)?;
            rec.spec = spec.clone();
            rec.running_spec = running;
            rec.reserved = rec.reserved || spec.state == DesiredState::Running;
            Ok((super::registry::Change::Put(Box::new(rec)), ()))
        })?;
        Ok(())
    }

    /// Drops the data disks neither `spec` nor what the VM runs lists, after a change to a VM
    /// whose QEMU is not running (a running one drops them once its new spec runs, in the
    /// start).
    fn retire_dropped_disks(&self, old: &crate::state::VmRecord, spec: &VmSpec) -> Result<(), ApiError> {
        for previous in std::iter::once(&old.spec).chain(old.running_spec.as_ref()) {
            self.retire_data_disks(previous, spec)?;
        }
        Ok(())
    }

    /// Grows the data disks of the stopped VM to their sizes in `spec`, and its overlay to
    /// `gib` (nothing when `None` or there is no overlay).
    async fn grow_offline(&self, spec: &VmSpec, gib: Option<u64>) -> Result<(), ApiError> {
        let mgr = self.mgr();
        self.grow_data_disks(spec).await?;
        let Some(gib) = gib else { return Ok(()) };
        if spec.boot.disk.is_some() {
            return self.grow_root_disk(gib).await;
        }
        let overlay = &self.paths().overlay;
        if !overlay.exists() {
            return Ok(());
        }
        crate::disk::grow_overlay(&mgr.disk_tool(), overlay, gib)
            .await
            .map_err(|source| crate::disk::GrowError { gib, source })?;
        Ok(())
    }

    /// Grows the running VM's disk to `gib` over QMP; the guest sees the new size at once.
    async fn grow_live(&self, gib: u64) -> Result<(), ApiError> {
        let grown = async {
            let mut q = self.mgr().qmp(self.name(), RESIZE_TIMEOUT).await?;
            q.block_resize(DISK_DRIVE, gib.saturating_mul(1 << 30)).await
        }
        .await;
        Ok(grown.map_err(|source| super::errors::QemuStepError::GrowLive { gib, source })?)
    }
}

/// The new disk size when `desired` grows an image-booted VM's disk, or an imported root
/// disk (which may get its first `disk_gib`; `vm.apply` checked it is not below the disk's size).
fn grown_disk(current: &VmSpec, desired: &VmSpec) -> Option<u64> {
    match (current.boot.disk_gib, desired.boot.disk_gib) {
        (Some(old), Some(new)) if new > old => Some(new),
        (None, Some(new)) if desired.boot.disk.is_some() => Some(new),
        _ => None,
    }
}
