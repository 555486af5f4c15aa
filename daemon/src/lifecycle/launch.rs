//! The steps that bring one VM's QEMU up and take it down, each with its undo.
//!
//! Order on the way up: boot files checked ([`check_launch_files`], before the
//! operation takes the VM's flag), overlay ([`VmOp::make_overlay`]), data disks
//! ([`super::data_disks`]), then [`VmOp::launch`]: run dir, devices bound ([`super::vfio`]),
//! seed, a UEFI VM's variables store ([`VmOp::ensure_uefi_vars`]), taps, QEMU launched and its
//! identity recorded at once, QMP verified (the process itself is [`super::processes`]'s).
//! Each of these steps is a method of the operation ([`VmOp`]) and pushes its own undo.
//! Teardown (`Processes::kill`, then [`super::teardown`]) is what rollback, stop and destroy
//! share.

use super::errors::{FileError, LaunchFileError};
use super::held::HeldVm;
use super::op::VmOp;
use super::processes::Search;
use super::teardown::partial_overlay;
use super::undo::Step;
use super::{provisioning, Manager};
use crate::api::{ApiError, Firmware, VmStatus};
use crate::disk::OverlayError;
use crate::process::ProcessIdentity;
use crate::qemu::argv::{build_argv, launch_fds, PassedFd};
use crate::qemu::launch::LaunchRequest;
use crate::seed::SeedError;
use crate::validate::{BootSource, ValidSpec};
use std::os::unix::fs::DirBuilderExt;
use std::sync::Arc;
use std::time::Duration;

/// What [`VmOp::open_passed_fds`] opened.
struct PassedFds {
    /// In [`launch_fds`] order.
    fds: Vec<std::os::fd::OwnedFd>,
    /// The base image's format ([`crate::disk::base_info`]), empty for a direct-kernel VM.
    base_format: String,
}

/// Opens (with `copy`: copies, see [`crate::qemu::boot_files`]) the kernel or initrd that spec
/// field `field` names. Whatever stops it is the spec's problem: 2001 naming the field.
async fn boot_file(
    dirs: &[std::path::PathBuf],
    field: &'static str,
    path: &std::path::Path,
    copy: bool,
) -> Result<Option<std::os::fd::OwnedFd>, ApiError> {
    crate::sandbox::spawn::boot_file(dirs, path, copy)
        .await
        .map_err(|source| LaunchFileError::BootFile { field, path: path.to_path_buf(), source }.into())
}

/// Checks the files a launch of `vm` needs before anything is made: the QEMU binary is the
/// one `qemu.sha256` pins (QEMU also works the VM's image files), the files the spec
/// names exist and, for a kernel and initrd, vmhostd can open them, for a UEFI VM
/// vmhostd can open the `[firmware]` files, and for a VM with `tpm` swtpm is there. Nothing is read yet: the launch copies them.
/// Runs without an operation too: a create, a replace and a reconfigure check before they
/// take the VM's flag (a refusal then leaves nothing to undo), and reconcile's plan checks
/// with no operation at all.
///
/// # Errors
/// 4002 on `qemu.sha256` for another binary; 2001 naming the field of a missing or
/// unreadable file (`spec.boot.firmware` for the firmware, with `details.path`; `spec.tpm`
/// when swtpm is missing).
pub(super) async fn check_launch_files(mgr: &Manager, vm: &ValidSpec) -> Result<(), ApiError> {
    mgr.processes.integrity().verify_qemu()?;
    if vm.spec.tpm {
        // Like the firmware: the host's program, the spec's choice (2001 on spec.tpm).
        crate::blocking::run(|| crate::tpm::check(&mgr.config.qemu.swtpm))?;
    }
    if vm.spec.boot.firmware == Firmware::Uefi {
        // The host's files, but the spec's choice: refused like a missing image, before
        // anything is made (a BIOS VM never needs them).
        let pair = crate::qemu::firmware::Pair::of(&mgr.config.firmware, vm.spec.boot.secure_boot);
        crate::blocking::run(|| crate::qemu::firmware::check_pair(pair)).map_err(LaunchFileError::Firmware)?;
    }
    match &vm.boot {
        BootSource::Image { image, .. } => {
            let p = mgr.config.paths.images.join(image);
            if !p.is_file() {
                return Err(ApiError::invalid(
                    "spec.boot.image",
                    format!("no image {image:?} in {}", mgr.config.paths.images.display()),
                ));
            }
        }
        BootSource::Kernel { kernel, initrd, .. } => {
            let dirs = mgr.config.paths.boot_dirs();
            boot_file(&dirs, "spec.boot.kernel", kernel, false).await?;
            if let Some(i) = initrd {
                boot_file(&dirs, "spec.boot.initrd", i, false).await?;
            }
        }
        // The file is in the import directory only until the create moves it: a create
        // checks it ([`super::root_disk::inspect_import`]), later operations use the moved file.
        BootSource::Disk { .. } => {}
    }
    Ok(())
}

/// One vhost-net descriptor per queue of each of `vm`'s NICs, or `None` (logged) when
/// `/dev/vhost-net` cannot be opened: the VM then runs virtio-net in QEMU's userspace. All its
/// NICs or none, so one VM never mixes the two.
fn open_vhost(name: &str, vm: &ValidSpec, accel: crate::config::Accel) -> Option<Vec<Vec<std::os::fd::OwnedFd>>> {
    if vm.spec.nics.is_empty() {
        return None;
    }
    // Under TCG QEMU would take the descriptors and fall back on userspace at the guest's
    // driver start: not tried, so the view never says vhost when the guest does not get it.
    if let Some(why) = crate::net::vhost::accel_refusal(accel) {
        tracing::info!(vm = name, reason = %why, "NICs without vhost-net: virtio-net runs in QEMU's userspace");
        return None;
    }
    let queues: Vec<u8> = vm.spec.nics.iter().map(|n| n.queues).collect();
    match crate::blocking::run(|| crate::net::vhost::open_for_nics(&queues)) {
        Ok(fds) => Some(fds),
        Err(e) => {
            tracing::info!(vm = name, error = %e, "NICs without vhost-net: virtio-net runs in QEMU's userspace");
            None
        }
    }
}

/// The live QEMU of VM `name`, if any: the recorded identity while it still runs. Only for a
/// VM that recovery has not settled (a QEMU may have started just before a crash, before its
/// identity was recorded) is /proc searched for its marker: after a settled recovery, every
/// QEMU of a VM is recorded, so the search would only cost a /proc scan per call. Runs
/// without an operation too: `vm.apply` of an unchanged spec looks before it starts or
/// stops the VM as an operation of its own ([`VmOp::find_live`] is the operation's).
///
/// # Errors
/// 4001 when /proc cannot be read (e.g. out of file descriptors): whether QEMU runs is then
/// unknown, and acting as if it did not could start the VM twice.
pub(super) fn find_live(
    mgr: &Manager,
    name: &str,
    recorded: Option<&ProcessIdentity>,
) -> Result<Option<ProcessIdentity>, ApiError> {
    let search = if mgr.lock().unsettled.contains(name) { Search::Proc } else { Search::None };
    mgr.processes.find(&mgr.paths(name), recorded, search)
}

impl HeldVm {
    /// Marks the VM running on `id` after a successful launch and starts watching its process
    /// and its agent. A create or start, and recovery re-adopting a VM whose QEMU kept running.
    ///
    /// # Errors
    /// The record cannot be written.
    pub(super) fn mark_running(&self, id: ProcessIdentity, reason: &str) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr(), self.name());
        let now = crate::api::now_rfc3339();
        let pid = id.clone();
        self.update_status(reason, VmStatus::Running, |r| {
            r.process = Some(pid);
            r.started_at = Some(now);
            r.last_error = None;
            r.qemu_started();
        })?;
        mgr.watch(name, id);
        super::agent::watch_agent(mgr, name);
        Ok(())
    }
}

impl VmOp {
    /// The VM's live QEMU, if any ([`find_live`]): `recorded` while it still runs.
    ///
    /// # Errors
    /// 4001 when /proc cannot be read.
    pub fn find_live(&self, recorded: Option<&ProcessIdentity>) -> Result<Option<ProcessIdentity>, ApiError> {
        find_live(self.mgr(), self.name(), recorded)
    }

    /// Removes an overlay (or a half-made one) without a record: the orphan of an earlier
    /// crash, which a new VM never inherits.
    ///
    /// # Errors
    /// 4001 when one cannot be removed.
    pub(super) fn remove_stale_overlays(&self) -> Result<(), ApiError> {
        for stale in [self.paths().overlay.clone(), partial_overlay(self.paths())] {
            if stale.exists() {
                tracing::warn!(vm = self.name(), path = %stale.display(), "removing an orphaned overlay");
                crate::disk::remove_overlay(&stale).map_err(OverlayError::RemoveOrphan)?;
            }
        }
        Ok(())
    }

    /// The overlay step ([`VmOp::ensure_overlay`]): an overlay it made is removed again on
    /// failure when the failure releases the VM (a create, a start that reserved it again).
    /// When it fails, the record stops naming the overlay it could not make.
    ///
    /// # Errors
    /// 4001 step `disk` when the overlay cannot be made or put in place; the record cannot be
    /// written.
    pub(super) async fn make_overlay(&mut self, vm: &ValidSpec) -> Result<(), ApiError> {
        match self.ensure_overlay(vm).await {
            Ok(made) => {
                if made && self.releases() {
                    self.push(Step::Overlay);
                }
                Ok(())
            }
            Err(e) => {
                // The partial overlay is gone; the record must stop naming it.
                let _ = self.update("rollback", |r| r.overlay = None);
                Err(e)
            }
        }
    }

    /// Makes the overlay of an image-booted VM unless it exists. Returns true when it made one.
    /// The record names the overlay before QEMU writes it, into a temp file that is renamed into
    /// place, so a crash leaves neither an orphan nor a half-made overlay.
    async fn ensure_overlay(&self, vm: &ValidSpec) -> Result<bool, ApiError> {
        let BootSource::Image { image, disk_gib } = &vm.boot else { return Ok(false) };
        let (mgr, paths) = (self.mgr(), self.paths());
        if crate::blocking::run(|| paths.overlay.exists()) {
            return Ok(false);
        }
        let overlay = paths.overlay.clone();
        self.update("overlay", |r| r.overlay = Some(overlay))?;
        let base = mgr.config.paths.images.join(image);
        let partial = partial_overlay(paths);
        let _ = crate::disk::remove_overlay(&partial);
        crate::disk::create_overlay(&mgr.disk_tool(), &base, &partial, *disk_gib)
            .await
            .map_err(OverlayError::Create)?;
        crate::blocking::run(|| std::fs::rename(&partial, &paths.overlay)).map_err(|e| {
            let _ = crate::disk::remove_overlay(&partial);
            OverlayError::Place(e)
        })?;
        Ok(true)
    }

    /// Removes the VM's overlay (and seed) as part of a rollback ([`Step::Overlay`]).
    pub(super) fn undo_overlay(&self) {
        let paths = self.paths();
        let _ = crate::blocking::run(|| std::fs::remove_file(&paths.seed));
        if let Err(e) = crate::disk::remove_overlay(&paths.overlay) {
            tracing::error!(vm = self.name(), error = %e, "rollback: cannot remove the overlay");
        }
        let _ = self.update("rollback", |r| r.overlay = None);
    }

    /// The launch step: launches QEMU for `vm`, records its identity, and checks over QMP that
    /// it runs. Each thing it makes (run dir, devices, process) is pushed as it is made, so a
    /// failure leaves no process behind once the operation fails. The caller sets the final
    /// status. `during` is the status recorded while QEMU starts: `creating` for a create (so a
    /// crash in this step is undone as a create), `starting` otherwise.
    ///
    /// # Errors
    /// 4001 naming the step that failed (`run_dir`, `qemu_files`, a device, the taps, QEMU's
    /// start or QMP check); 2001 when a kernel or initrd can no longer be read; the record
    /// cannot be written.
    pub(super) async fn launch(&mut self, vm: &ValidSpec, during: VmStatus) -> Result<ProcessIdentity, ApiError> {
        self.launch_as(vm, during, false).await
    }

    /// [`VmOp::launch`], or with `incoming` a migration's destination: QEMU starts paused,
    /// waiting for the source's state (`-incoming defer -S`), and is checked to say so
    /// (`inmigrate`) instead of `running` ([`super::migrate::incoming`]).
    ///
    /// # Errors
    /// As [`VmOp::launch`].
    pub(super) async fn launch_as(
        &mut self,
        vm: &ValidSpec,
        during: VmStatus,
        incoming: bool,
    ) -> Result<ProcessIdentity, ApiError> {
        let mgr = Arc::clone(self.mgr());
        let paths = self.paths();
        if let Some(id) = mgr.processes.find(paths, None, Search::Proc)? {
            // Never start a VM twice: a QEMU of this VM is already up (e.g. launched just before a
            // daemon crash); adopt it.
            tracing::warn!(vm = %self.name(), pid = id.pid, "found a live QEMU for this VM; adopting it");
            self.update("adopted", |r| {
                r.process = Some(id.clone());
                r.qemu_started();
            })?;
            return Ok(id);
        }
        self.held().clean_run_dir();
        crate::blocking::run(|| std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&paths.run_dir))
            .map_err(FileError::file("run_dir", "create", &paths.run_dir))?;
        self.push(Step::HostSide);
        // The placement is decided and recorded in the same write (docs/lifecycle.md).
        let marked = self.held().mark_start("launching QEMU", during, &vm.spec, |r| {
            r.last_error = None;
            // The new QEMU runs the recorded spec: nothing is pending any more.
            r.running_spec = None;
        })?;
        self.crashpoint("launch:recorded");
        if marked.placement.is_some() {
            self.crashpoint("placement:recorded");
        }
        // A failed bind restores what it changed itself.
        self.bind_passthrough(&vm.spec).await?;
        self.push(Step::Devices);
        self.crashpoint("launch:bound");
        self.start_process(vm, incoming).await
    }

    /// Seed, taps, QEMU, QMP check: the steps of the launch after the devices are bound
    /// (`incoming`: [`VmOp::launch_as`]).
    async fn start_process(&mut self, vm: &ValidSpec, incoming: bool) -> Result<ProcessIdentity, ApiError> {
        let mgr = Arc::clone(self.mgr());
        let name = self.name().to_string();
        let paths = self.paths().clone();
        let rec = self.record()?;
        let mut allocs = rec.nics;
        self.hand_vfio_groups_to_qemu().await?;
        if crate::seed::has_seed(vm) {
            // Every record has one (made at create and replace, adopted at start for older
            // records); its absence is a daemon fault, never a reason to make a new instance.
            let instance_id = rec.instance_id.ok_or_else(|| SeedError::NoInstanceId { vm: name.clone() })?;
            let files = crate::seed::render(&vm.spec, &allocs, &instance_id);
            // Built and fsynced off the runtime worker: 20 launches at once must not stall it.
            crate::blocking::run(|| crate::seed::write_seed(&paths.seed, &files))?;
        } else {
            // A kernel VM whose user_data was dropped: its old seed (and the text in it) goes.
            let _ = crate::blocking::run(|| std::fs::remove_file(&paths.seed));
        }
        self.ensure_uefi_vars(vm)?;
        // vhost-net where /dev/vhost-net opens (one descriptor per queue), else virtio-net in
        // QEMU's userspace: the VM starts either way, and its record says which it got.
        let vhost = open_vhost(&name, vm, mgr.config.qemu.accel);
        for a in &mut allocs {
            a.vhost = vhost.is_some();
        }
        // Taps first (network owner), then QEMU, which gets their fds. Dropping the fds on any
        // failure below removes the taps: they are not persistent.
        let fds = mgr.net.attach_nics(&mgr.config, &name, &vm.spec.nics, &allocs).await?;
        self.crashpoint("launch:taps");
        self.attach_capture(vm).await?;
        let tpm = self.start_tpm(vm).await?;
        let opened = self.open_passed_fds(vm, &allocs, fds, vhost.unwrap_or_default(), tpm).await?;
        let argv = build_argv(vm, &mgr.config, &paths, &allocs, &opened.base_format, rec.placement.as_ref());
        let request = LaunchRequest {
            binary: mgr.config.qemu.binary.clone(),
            argv,
            qmp: paths.qmp.clone(),
            log: paths.qemu_log.clone(),
            timeout: Duration::from_secs(mgr.config.qemu.launch_timeout_s),
            fds: opened.fds,
            memlock: super::vfio::memlock_for(&mgr, &vm.spec),
            user: mgr.config.qemu_user,
            kvm: mgr.config.qemu.accel == crate::config::Accel::Kvm,
            affinity: super::placement::spawn_affinity(rec.placement.as_ref()),
            incoming,
        };
        let launched = mgr.processes.spawn(&request).await;
        // QEMU holds its own copies now; ours must go so the taps die with QEMU and a client
        // of a dead QEMU's sockets is refused rather than queued.
        drop(request);
        let crate::qemu::launch::Launched { identity: id, mut qmp } = launched?;
        // Killed on failure from here on, also when its identity cannot be recorded.
        self.push(Step::Process(id.clone()));
        self.crashpoint("launch:spawned");
        // From here its disks are not known to be clean until it powers off cleanly.
        self.update("launched", |r| {
            r.process = Some(id.clone());
            r.qemu_started();
            for (n, a) in r.nics.iter_mut().zip(&allocs) {
                n.vhost = a.vhost;
            }
        })?;
        self.crashpoint("launch:launched");
        self.held().pin_vcpus(id.pid, &mut qmp).await?;
        let expected = if incoming { "inmigrate" } else { "running" };
        mgr.processes.verify_status(qmp, expected).await?;
        Ok(id)
    }

    /// A VM with `tpm`: ends the last QEMU's swtpm if it still runs ([`crate::tpm::stop`]),
    /// starts its swtpm ([`crate::tpm::start`]) and records it, then crash point `launch:tpm`; returns QEMU's end of its control channel. No undo of its own: swtpm
    /// ends when that end closes, with QEMU or when a failed launch drops it.
    ///
    /// # Errors
    /// 4001 step `tpm` when swtpm or its state directory cannot be set up; the record cannot
    /// be written.
    async fn start_tpm(&mut self, vm: &ValidSpec) -> Result<Option<std::os::fd::OwnedFd>, ApiError> {
        if !vm.spec.tpm {
            return Ok(None);
        }
        let (mgr, paths) = (Arc::clone(self.mgr()), self.paths().clone());
        // No QEMU of the VM runs here (launch_as looked), so a recorded swtpm still alive is
        // the last QEMU's, a moment from ending (a restart kills QEMU and starts again at
        // once): it must be gone, and its lock on the state with it, before the next starts.
        let previous = self.record()?.tpm_process;
        crate::tpm::stop(self.name(), previous.as_ref()).await;
        let started = crate::tpm::start(&mgr.config.qemu.swtpm, mgr.config.qemu_user, &paths, &paths.qemu_log).await?;
        let id = started.identity.clone();
        self.update("tpm", |r| r.tpm_process = Some(id))?;
        self.crashpoint("launch:tpm");
        Ok(Some(started.qemu_end))
    }

    /// Mirrors the sources of the VM's monitor NICs into their taps (which exist now: the
    /// launch holds their descriptors), with its undo entry, then crash point `launch:capture`.
    ///
    /// # Errors
    /// 3001 naming `spec.nics[i].source` when a source is gone; 4001 (step `capture`) when a
    /// mirror could not be made ([`super::capture::start_failure`]).
    async fn attach_capture(&mut self, vm: &ValidSpec) -> Result<(), ApiError> {
        if vm.spec.monitor_nics().next().is_none() {
            return Ok(());
        }
        self.push(Step::Capture);
        let report = super::capture::sync(self.mgr()).await;
        self.crashpoint("launch:capture");
        super::capture::start_failure(self.name(), &report)
    }

    /// Gives a UEFI VM its own variables store, a copy of `firmware.uefi_vars` (with
    /// `boot.secure_boot`, `firmware.uefi_secure_vars`), unless it has one that pairs with the
    /// code it runs ([`crate::qemu::firmware::ensure_store`]: one of the other kind is set aside
    /// and the one set aside for this kind comes back): the store is the guest's (boot entries,
    /// settings) and outlives restarts, until the destroy ([`HeldVm::remove_run_files`]). A BIOS
    /// VM keeps a store it had (going back to UEFI finds its settings). Nothing is recorded: the
    /// path follows from the name, the kind from the content, and every path that forgets a
    /// record removes it first.
    ///
    /// # Errors
    /// 4001 step `firmware` when the directory or the copy cannot be made (nothing is left).
    fn ensure_uefi_vars(&self, vm: &ValidSpec) -> Result<(), ApiError> {
        if vm.spec.boot.firmware != Firmware::Uefi {
            return Ok(());
        }
        let (mgr, paths) = (self.mgr(), self.paths());
        let vars = paths.uefi_vars();
        let pair = crate::qemu::firmware::Pair::of(&mgr.config.firmware, vm.spec.boot.secure_boot);
        let outcome = crate::blocking::run(|| {
            crate::state::dirs::private_dir(&paths.disk_dir)?;
            crate::qemu::firmware::ensure_store(
                pair,
                &mgr.config.firmware.uefi_secure_vars,
                &vars,
                &paths.partial_uefi_vars(),
            )
        })
        .map_err(|source| LaunchFileError::CopyVars {
            from: pair.vars.to_path_buf(),
            to: vars.clone(),
            source,
        })?;
        if outcome != crate::qemu::firmware::StoreOutcome::Kept {
            tracing::info!(vm = self.name(), secure_boot = pair.secure, outcome = ?outcome, "UEFI variables store");
        }
        Ok(())
    }

    /// Opens what QEMU is handed instead of paths, in [`launch_fds`] order: the QMP, agent and
    /// serial console sockets and the exec ports' (bound here, in the run dir only the daemon can enter), the serial log, the taps
    /// (`taps`, already open), for an image-booted VM the overlay (read-write and read-only),
    /// its base image and the seed, for a direct-kernel VM the sealed copies of its kernel and
    /// initrd (copied here when this file version has no copy yet) and, with `user_data`, the
    /// seed, for a `boot.disk` VM its
    /// root disk (read-write and read-only), the data disks (read-write and read-only), and for
    /// a UEFI VM the firmware code (read-only) and its variables store (read-write and
    /// read-only).
    /// Then each NIC's further tap queues and its vhost-net descriptors (`vhost`, already
    /// open), and last a `tpm` VM's end of swtpm's control channel (`tpm`, made by
    /// [`VmOp::start_tpm`]).
    /// Also returns the base image's format (a `boot.disk` VM: its root disk's).
    ///
    /// # Errors
    /// 4001 with step `qemu_files` when a file cannot be opened or a socket bound; 2001 naming
    /// the field when the kernel or initrd can no longer be read.
    async fn open_passed_fds(
        &self,
        vm: &ValidSpec,
        allocs: &[crate::nic::NicAlloc],
        taps: Vec<Vec<std::os::fd::OwnedFd>>,
        vhost: Vec<Vec<std::os::fd::OwnedFd>>,
        mut tpm: Option<std::os::fd::OwnedFd>,
    ) -> Result<PassedFds, ApiError> {
        let (mgr, paths) = (self.mgr(), self.paths());
        use std::fs::OpenOptions;
        use std::os::fd::OwnedFd;
        use std::os::unix::fs::OpenOptionsExt;
        let failed = |what: &std::path::Path, source: std::io::Error| -> ApiError {
            LaunchFileError::OpenForQemu { path: what.to_path_buf(), source }.into()
        };
        let listen = |path: &std::path::Path| -> Result<OwnedFd, ApiError> {
            crate::blocking::run(|| {
                let _ = std::fs::remove_file(path);
                std::os::unix::net::UnixListener::bind(path)
            })
            .map(OwnedFd::from)
            .map_err(|e| failed(path, e))
        };
        let read_only = |path: &std::path::Path| -> Result<OwnedFd, ApiError> {
            crate::blocking::run(|| std::fs::File::open(path)).map(OwnedFd::from).map_err(|e| failed(path, e))
        };
        let read_write = |path: &std::path::Path| -> Result<OwnedFd, ApiError> {
            crate::blocking::run(|| OpenOptions::new().read(true).write(true).open(path))
                .map(OwnedFd::from)
                .map_err(|e| failed(path, e))
        };
        // Each NIC's descriptors by queue, taken as the layout names them.
        let mut taps: Vec<Vec<Option<OwnedFd>>> = taps.into_iter().map(|q| q.into_iter().map(Some).collect()).collect();
        let mut vhost: Vec<Vec<Option<OwnedFd>>> =
            vhost.into_iter().map(|q| q.into_iter().map(Some).collect()).collect();
        let take = |set: &mut Vec<Vec<Option<OwnedFd>>>, what: &str, i: usize, q: usize| {
            set.get_mut(i)
                .and_then(|queues| queues.get_mut(q))
                .and_then(Option::take)
                .ok_or_else(|| provisioning("qemu_files", format!("no {what} for queue {q} of NIC {i}")))
        };
        let mut fds = Vec::new();
        let mut base_format = String::new();
        let base = match &vm.boot {
            BootSource::Image { image, .. } => Some(mgr.config.paths.images.join(image)),
            BootSource::Kernel { .. } | BootSource::Disk { .. } => None,
        };
        // A boot.disk VM's root disk, in the format recorded at import (never probed again).
        let root = match &vm.boot {
            BootSource::Disk { .. } => {
                let format =
                    self.record()?.root_disk.map(|r| r.format).ok_or_else(|| {
                        provisioning("qemu_files", "the record names no imported root disk".to_string())
                    })?;
                base_format = format.as_str().to_string();
                Some(paths.root_disk(format))
            }
            _ => None,
        };
        for which in launch_fds(vm, allocs) {
            let fd = match which {
                PassedFd::Qmp => listen(&paths.qmp)?,
                PassedFd::Agent => listen(&paths.agent)?,
                PassedFd::QmpEvents => listen(&paths.qmp_events)?,
                PassedFd::Console => listen(&paths.console)?,
                PassedFd::QmpStats => listen(&paths.qmp_stats)?,
                PassedFd::SerialLog => crate::blocking::run(|| {
                    OpenOptions::new().append(true).create(true).mode(0o600).open(&paths.serial_log)
                })
                .map(OwnedFd::from)
                .map_err(|e| failed(&paths.serial_log, e))?,
                PassedFd::Tap(i) => take(&mut taps, "tap", i, 0)?,
                PassedFd::TapQueue(i, q) => take(&mut taps, "tap", i, q)?,
                PassedFd::Vhost(i, q) => take(&mut vhost, "vhost-net descriptor", i, q)?,
                PassedFd::TpmCtrl => {
                    tpm.take().ok_or_else(|| provisioning("qemu_files", "no TPM control channel".to_string()))?
                }
                PassedFd::OverlayRw => read_write(&paths.overlay)?,
                PassedFd::OverlayRo => read_only(&paths.overlay)?,
                PassedFd::Base => {
                    let Some(base) = &base else { continue };
                    let info = crate::disk::base_info(&mgr.disk_tool(), base).await.map_err(OverlayError::Base)?;
                    base_format = info.format;
                    read_only(base)?
                }
                PassedFd::Seed => read_only(&paths.seed)?,
                PassedFd::DataDisk(i) => {
                    let Some(disk) = vm.spec.disks.get(i) else { continue };
                    read_write(&paths.data_disk(disk))?
                }
                PassedFd::DataDiskRo(i) => {
                    let Some(disk) = vm.spec.disks.get(i) else { continue };
                    read_only(&paths.data_disk(disk))?
                }
                PassedFd::RootDisk => {
                    let Some(root) = &root else { continue };
                    read_write(root)?
                }
                PassedFd::RootDiskRo => {
                    let Some(root) = &root else { continue };
                    read_only(root)?
                }
                PassedFd::UefiCode => {
                    read_only(crate::qemu::firmware::Pair::of(&mgr.config.firmware, vm.spec.boot.secure_boot).code)?
                }
                PassedFd::UefiVars => read_write(&paths.uefi_vars())?,
                PassedFd::UefiVarsRo => read_only(&paths.uefi_vars())?,
                PassedFd::Exec(i) => {
                    let Some(socket) = paths.exec.get(i) else { continue };
                    listen(socket)?
                }
                PassedFd::Kernel | PassedFd::Initrd => {
                    let BootSource::Kernel { kernel, initrd, .. } = &vm.boot else { continue };
                    let (field, path) = match (which, initrd) {
                        (PassedFd::Initrd, Some(i)) => ("spec.boot.initrd", i),
                        (PassedFd::Initrd, None) => continue,
                        _ => ("spec.boot.kernel", kernel),
                    };
                    let copied = boot_file(&mgr.config.paths.boot_dirs(), field, path, true).await?;
                    copied.ok_or_else(|| provisioning("qemu_files", format!("no copy of {}", path.display())))?
                }
            };
            fds.push(fd);
        }
        Ok(PassedFds { fds, base_format })
    }
}
