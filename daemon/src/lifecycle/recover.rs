//! Daemon restarts: re-adopt the VMs that kept running and settle interrupted operations
//! (watching each VM's exit is [`super::exits`]).
//!
//! [`Manager::recover_all`] runs once from `Manager::open`, before the socket is served. What
//! a record says is checked against /proc (pid, start time, command line, user and executable,
//! see [`crate::qemu::identity`]); the kernel's view wins.
//!
//! Order: [`Recovery::scan`] reads /proc once for the processes carrying any VM's marker
//! ([`identity::MarkerIndex`]); then [`Recovery::run`] settles up to [`RECOVER_AT_ONCE`] VMs at
//! once, each against that index (a recorded QEMU that still runs is verified directly) and
//! each through a [`HeldVm`]: nothing else can hold a VM before the daemon serves, so the
//! steps recovery shares with operations (undo, release, disposal) are the held VM's. A VM
//! settled without error leaves the registry's `unsettled` set: from then on only a launch
//! searches /proc for its QEMU. A settled VM's placement is checked last but one, before its
//! devices: a live QEMU's threads against the record ([`HeldVm::check_pins`]), a gone one's
//! released.

use super::held::HeldVm;
use super::processes::Search;
use super::teardown::Devices;
use super::Manager;
use crate::api::{ApiError, Code, VmStatus};
use crate::qemu::identity;
use crate::qemu::qmp::Qmp;
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;

/// How many VMs recovery settles at once: each may wait for its QMP monitor (up to 5 s) or
/// give devices back.
const RECOVER_AT_ONCE: usize = 16;

impl Manager {
    /// Settles every record against what runs (see the module doc).
    pub(super) async fn recover_all(self: &Arc<Self>) {
        if let Some(recovery) = Recovery::scan(self) {
            recovery.run().await;
        }
    }
}

/// One recovery: the daemon's manager and the one /proc index every VM is settled against.
struct Recovery<'m> {
    mgr: &'m Arc<Manager>,
    index: identity::MarkerIndex,
}

impl<'m> Recovery<'m> {
    /// Scans /proc once for every recorded VM's marker. `None` when /proc cannot be read:
    /// nothing can be settled then, so each record stays as it is (and unsettled, so later
    /// operations search /proc themselves).
    fn scan(mgr: &'m Arc<Manager>) -> Option<Recovery<'m>> {
        let markers: Vec<std::ffi::OsString> =
            mgr.lock().vms.keys().map(|n| std::ffi::OsString::from(mgr.paths(n).cmdline_marker())).collect();
        match crate::blocking::run(|| identity::MarkerIndex::scan(&markers)) {
            Ok(index) => Some(Recovery { mgr, index }),
            Err(e) => {
                tracing::error!(error = %e, "cannot read /proc: no VM record is settled");
                None
            }
        }
    }

    /// Settles every VM, [`RECOVER_AT_ONCE`] at a time.
    async fn run(&self) {
        let names: Vec<String> = self.mgr.lock().vms.keys().cloned().collect();
        futures_util::stream::iter(names)
            .for_each_concurrent(RECOVER_AT_ONCE, |name| async move {
                // Recovery runs before the daemon serves: nothing else holds the VM.
                let held = HeldVm::new(self.mgr, &name);
                match self.recover(&held).await {
                    Ok(()) => {
                        self.mgr.lock().unsettled.remove(&name);
                    }
                    Err(e) => tracing::error!(vm = %name, error = %e, "cannot settle the VM's record"),
                }
            })
            .await;
    }

    /// Where recovery looks for a VM's unrecorded QEMU: its one scan.
    fn search(&self) -> Search<'_> {
        Search::Index(&self.index)
    }

    /// Settles the VM, then gives its passthrough devices back if no QEMU of it runs.
    async fn recover(&self, held: &HeldVm) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr, held.name());
        self.settle(held).await?;
        // A re-adopted QEMU's threads are checked against its placement (re-pinned where they
        // differ); a VM without a live QEMU holds none.
        if let Ok(rec) = held.record() {
            if rec.placement.is_some() {
                match mgr.processes.find(held.paths(), rec.process.as_ref(), self.search())? {
                    Some(id) => held.check_pins(id.pid),
                    None => held.release_placement(),
                }
            }
        }
        // Devices of a VM without a live QEMU go back to their host drivers.
        let rec = held.record();
        if let Ok(rec) = rec {
            if rec.vfio.is_empty() {
                return Ok(());
            }
            let live = mgr.processes.find(held.paths(), rec.process.as_ref(), self.search())?;
            if live.is_none() {
                tracing::info!(
                    vm = name,
                    devices = rec.vfio.len(),
                    "restoring passthrough devices of a VM that is not running"
                );
                held.release_passthrough().await?;
            }
        }
        Ok(())
    }

    /// Brings the VM's record in line with what runs: a live QEMU is re-adopted (or killed
    /// when the record says it was being stopped, destroyed or created), a gone one settles
    /// the record.
    async fn settle(&self, held: &HeldVm) -> Result<(), ApiError> {
        let (mgr, name) = (self.mgr, held.name());
        let rec = held.record()?;
        let paths = held.paths();
        // If /proc cannot be read the record is left exactly as it is: guessing could start a
        // VM twice or delete a live VM's sockets.
        let live = mgr.processes.find(paths, rec.process.as_ref(), self.search())?;
        // A migration's side settles by its own rules (lifecycle/migrate).
        // (false: what is left is settled as for any VM below.)
        let migrating = rec.migration().is_some() || matches!(rec.status, VmStatus::Migrating | VmStatus::Incoming);
        if migrating && super::migrate::settle(mgr, held, &rec, live.clone()).await? {
            return Ok(());
        }
        // The VM's swtpm ends with its QEMU; one whose QEMU is gone is stray (crate::tpm).
        if live.is_none() {
            crate::tpm::settle(name, rec.tpm_process.as_ref(), false);
        }
        match (live, rec.status) {
            (Some(id), VmStatus::Destroying) => {
                tracing::info!(vm = name, "finishing an interrupted destroy");
                mgr.processes.kill(name, &id).await?;
                // Gone before its state is removed.
                crate::tpm::stop(name, rec.tpm_process.as_ref()).await;
                finish_destroy(held).await
            }
            (Some(id), VmStatus::Stopping) => {
                tracing::info!(vm = name, "finishing an interrupted stop");
                mgr.processes.kill(name, &id).await?;
                held.clean_run_dir();
                held.update_status("stop completed after vmhostd restart", VmStatus::Stopped, |r| {
                    r.process = None;
                    r.unclean_end =
                        Some(super::ops::killed_by("a stop interrupted by a vmhostd restart", "finished after it"));
                })?;
                Ok(())
            }
            (Some(id), VmStatus::Creating) => {
                // The create never reached `running`: undo it rather than adopt a half-made VM.
                tracing::info!(vm = name, "undoing an interrupted create");
                mgr.processes.kill(name, &id).await?;
                settle_without_process(held, VmStatus::Creating)
            }
            (Some(id), _) => readopt(held, id, &rec).await,
            (None, VmStatus::Destroying) => finish_destroy(held).await,
            (None, status) => settle_without_process(held, status),
        }
    }
}

/// Settles a record whose QEMU is gone, as recovery finds it (`status`: what the record said).
/// A migration's source whose QEMU went settles here too ([`super::migrate`]).
///
/// # Errors
/// The record cannot be written.
pub(super) fn settle_without_process(held: &HeldVm, status: VmStatus) -> Result<(), ApiError> {
    let paths = held.paths();
    held.clean_run_dir();
    let _ = crate::disk::remove_overlay(&super::teardown::partial_overlay(paths));
    let settle = match status {
        VmStatus::Running => Some((VmStatus::Dead, "QEMU exited while vmhostd was not running", false)),
        VmStatus::Stopping => Some((VmStatus::Stopped, "stop completed while vmhostd was not running", false)),
        VmStatus::Starting => Some((VmStatus::Failed, "start interrupted by a vmhostd restart", false)),
        VmStatus::Creating => Some((VmStatus::Failed, "create interrupted by a vmhostd restart", true)),
        VmStatus::Stopped | VmStatus::Failed | VmStatus::Dead | VmStatus::Destroying => None,
        // Settled by lifecycle/migrate before this is reached.
        VmStatus::Migrating | VmStatus::Incoming => None,
    };
    let Some((to, why, undo_create)) = settle else { return Ok(()) };
    if undo_create {
        let _ = crate::disk::remove_overlay(&paths.overlay);
        let _ = crate::blocking::run(|| std::fs::remove_file(&paths.seed));
        held.undo_data_disks();
    }
    match status {
        // A create or start interrupted while it imported a root disk gives it back.
        VmStatus::Creating | VmStatus::Starting => held.undo_root_disk(),
        // It ran on it: the import is done.
        _ => held.end_root_disk_import()?,
    }
    let record_error = to != VmStatus::Stopped;
    held.update_status(why, to, |r| {
        r.process = None;
        if undo_create {
            r.reserved = false;
            r.overlay = None;
        }
        if record_error {
            r.last_error =
                Some(crate::api::LastError { code: Code::ProvisioningFailed.as_i32(), message: why.to_string() });
        }
        if status == VmStatus::Running {
            r.unclean_end = Some(format!("the VM's QEMU ended without a clean power-off vmhostd saw ({why})"));
        }
        if matches!(status, VmStatus::Running | VmStatus::Stopping) {
            // Disks a hot-plug cut short still tracks were in reach of a QEMU that ran:
            // its guest may have written them, so they are the VM's now, not an undo's.
            r.end_disk_tracking();
        }
    })?;
    Ok(())
}

/// Completes a destroy a restart interrupted, as `vm.destroy` would have: also how a
/// migration's source ends the VM when recovery finds the destination committed.
///
/// # Errors
/// A step of the teardown fails (the record keeps what still exists).
pub(super) async fn finish_destroy(held: &HeldVm) -> Result<(), ApiError> {
    held.release_host_side(Devices::Release).await?;
    held.remove_run_files()?;
    let spec = held.record()?.spec;
    held.dispose_root_disk()?;
    held.dispose_data_disks(&spec)?;
    held.mgr().forget(held.name(), "destroyed (completed after restart)")
}

/// Re-adopts `id`, the VM's QEMU found running: QMP must answer, but a VM whose monitor is
/// wedged is still running and is not killed for it. `rec` is the record recovery found. Also
/// how a migration's source takes its guest back after a restart ([`super::migrate`]).
///
/// # Errors
/// The record cannot be written.
pub(super) async fn readopt(
    held: &HeldVm,
    id: crate::process::ProcessIdentity,
    rec: &crate::state::VmRecord,
) -> Result<(), ApiError> {
    let name = held.name();
    match Qmp::connect(&held.paths().qmp, Duration::from_secs(5)).await {
        Ok(mut q) => {
            match q.query_status().await {
                Ok(s) => tracing::info!(vm = name, pid = id.pid, status = %s, "re-adopted running VM"),
                Err(e) => tracing::warn!(vm = name, error = %e, "re-adopted VM; QMP query failed"),
            }
            // A disk change cut short: the record takes what QEMU has.
            if let Err(e) = held.settle_hotplug(&mut q).await {
                tracing::warn!(vm = name, error = %e, "re-adopted VM; its data disks were not checked");
            }
        }
        Err(e) => tracing::warn!(vm = name, error = %e, "re-adopted VM; QMP unreachable"),
    }
    let started_at = rec.started_at.clone();
    held.mark_running(id, "re-adopted after daemon restart")?;
    // It runs on its imported disk: the import is done.
    held.end_root_disk_import()?;
    if started_at.is_some() {
        held.update("re-adopted", |r| r.started_at = started_at)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::bind::Binding;
    use crate::pci::fake::{addr, FakeDevice, FakeSysfs};
    use crate::process::ProcessIdentity;
    use crate::qemu::argv::VmPaths;
    use crate::state::{Store, VmRecord};
    use std::collections::BTreeMap;
    use std::os::unix::process::CommandExt;
    use std::sync::Mutex;

    const NIC: &str = "0000:00:05.0";

    /// A `sleep` whose argv[0] is `marker`, killed on drop.
    struct Fake(std::process::Child);

    impl Drop for Fake {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A manager over the state directory of `config`, with the fake `sysfs`, as `Manager::open`
    /// makes it but without recovering yet.
    fn manager(config: crate::config::Config, store: Store, sysfs: &Arc<FakeSysfs>) -> Arc<Manager> {
        let config = Arc::new(config);
        let (records, _) = store.load_all().unwrap();
        let events = crate::events::EventBus::default();
        Arc::new(Manager {
            config: config.clone(),
            registry: super::super::Registry::new(config.clone(), store, events.clone(), records, Vec::new()),
            events,
            _state_lock: super::super::lock_state_dir(&config.paths.state).unwrap(),
            net: crate::net::host::HostNet::connect().unwrap(),
            capture: crate::net::capture::Capture::new(&config.paths.state, &config.paths.run),
            capture_states: tokio::sync::Mutex::default(),
            net_states: Mutex::new(BTreeMap::new()),
            pci: Arc::new(crate::pci::Pci::new(Box::new(Arc::clone(sysfs)))),
            processes: super::super::processes::Processes::new(config.clone()),
            agents: Arc::default(),
            exec_slots: Default::default(),
            stats_monitors: Default::default(),
            qmp_sessions: Arc::default(),
            images: crate::images::Store::open(&config).unwrap(),
            image_probes: Mutex::default(),
            reservations: crate::disk::reserve::Ledger::default(),
            topology: super::super::topology::HostTopology::open(crate::pci::sysfs::SYSFS_ROOT, &config),
            backups: crate::backup::Backups::open(&config),
            migrations: crate::migration::Migrations::new(&config.migration),
            unsettled: Default::default(),
        })
    }

    /// A test config whose state and run directories are made under `dir`.
    fn config_in(dir: &std::path::Path) -> crate::config::Config {
        let mut config = crate::validate::tests::config();
        config.paths.state = dir.join("state");
        config.paths.run = dir.join("run");
        crate::state::dirs::prepare(&config.paths.state).unwrap();
        std::fs::create_dir_all(&config.paths.run).unwrap();
        config
    }

    /// A VM that was running while a hot-plug had made disk `x` (tracked, not yet attached)
    /// when vmhostd died, and whose QEMU died too: recovery records it dead and `x` as the VM's
    /// (its guest may have written it), so no later undo deletes it and the record holds no
    /// intent. Before, the tracking stayed on the dead record until the next start ended it.
    #[tokio::test]
    async fn recovery_makes_the_disks_of_a_hotplug_whose_qemu_died_the_vms() {
        let dir = tempfile::tempdir().unwrap();
        let config = config_in(dir.path());
        let store = Store::open(&config.paths.state).unwrap();
        let mut spec = crate::validate::tests::spec("vm-2");
        spec.disks = vec![serde_json::from_value(serde_json::json!({ "name": "x", "size_gib": 1 })).unwrap()];
        let mut rec = VmRecord::new(spec.clone());
        rec.status = VmStatus::Running;
        rec.process = Some(ProcessIdentity { pid: i32::MAX - 5, start_ticks: 1 });
        rec.track_new_disk("x").unwrap();
        store.save(&mut rec).unwrap();
        let file = VmPaths::for_vm(&config, "vm-2").data_disk(&spec.disks[0]);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, b"written by the guest").unwrap();

        let mgr = manager(config, store, &Arc::new(FakeSysfs::new()));
        mgr.recover_all().await;

        let rec = mgr.record("vm-2").unwrap();
        assert_eq!((rec.status, &rec.intent), (VmStatus::Dead, &None));
        HeldVm::new(&mgr, "vm-2").undo_data_disks();
        assert_eq!(std::fs::read(&file).unwrap(), b"written by the guest");
    }

    /// The recovery a restarted daemon runs, on a record of a VM that was running with a device
    /// passed through, whose QEMU died while no daemon ran, while a process that is not QEMU
    /// carries the VM's marker (started by this test process, which plays the spawner here, as
    /// root, which plays qemu.user: only its executable gives it away). The device goes back to
    /// its driver and the VM is dead. Before the identity check, recovery took the fake for the
    /// VM's QEMU, re-adopted it and kept the device on vfio-pci.
    #[tokio::test]
    async fn recovery_gives_passthrough_devices_back_despite_a_fake_qemu() {
        let dir = tempfile::tempdir().unwrap();
        let config = config_in(dir.path());

        let sysfs = Arc::new(FakeSysfs::new());
        sysfs.add_driver("e1000e", &[(0x8086, 0x10d3)]).add_driver(crate::pci::VFIO_PCI, &[]);
        sysfs.add_device(FakeDevice::endpoint(NIC, 0x8086, 0x10d3, 0x020000, 7).driver(crate::pci::VFIO_PCI));

        let store = Store::open(&config.paths.state).unwrap();
        let mut rec = VmRecord::new(crate::validate::tests::spec("vm-1"));
        rec.status = VmStatus::Running;
        // A QEMU that has exited: no process has this start time.
        rec.process = Some(ProcessIdentity { pid: i32::MAX - 3, start_ticks: 1 });
        rec.vfio = vec![Binding { address: addr(NIC), original_driver: Some("e1000e".into()), node_before: None }];
        store.save(&mut rec).unwrap();

        let marker = VmPaths::for_vm(&config, "vm-1").cmdline_marker();
        let fake = Fake(std::process::Command::new("/usr/bin/sleep").arg0(&marker).arg("30").spawn().unwrap());
        let pid = fake.0.id() as i32;
        for _ in 0..500 {
            if crate::process::cmdline(pid).is_ok_and(|c| c.len() == 2) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }

        let mgr = manager(config, store, &sysfs);
        mgr.recover_all().await;

        let rec = mgr.record("vm-1").unwrap();
        assert_eq!(rec.status, VmStatus::Dead, "the fake was re-adopted");
        assert_eq!(rec.process, None);
        assert!(rec.vfio.is_empty(), "the device is still recorded as passed through");
        assert_eq!(sysfs.driver_of(NIC).as_deref(), Some("e1000e"), "the device is back with its driver");
        assert!(crate::process::liveness(pid).is_alive(), "the fake was signalled");
    }
}
