//! The lifecycle manager: the only code that coordinates several host resources.
//!
//! It owns the VM records ([`registry`]: the table, each VM's record file, the views readers
//! are served) and the per-VM busy flags. Every mutating operation follows the same order:
//!
//! 1. validate (pure, [`crate::validate`]), then check files the spec names;
//! 2. take the VM's busy flag ([`OpGuard`]; a second operation gets 4090) and, for a new VM,
//!    admit it under the table lock ([`crate::capacity`]) and write its record (intent; the
//!    table lock is not held for the write, see [`registry`]);
//! 3. touch the host in dependency order: overlay disk ([`crate::disk`]) or imported root disk
//!    ([`root_disk`]), data disks
//!    ([`data_disks`]), run dir, QEMU ([`crate::qemu`]), with the record saved before each step
//!    that creates something;
//! 4. on failure undo the completed steps in reverse ([`undo`]) and record `failed` with the error.
//!
//! Submodules: [`ops`] (create/start/stop/destroy/apply), [`reconfigure`] (`vm.apply` of a
//! changed VM, in place, disks kept), [`launch`] (QEMU start and teardown steps), [`data_disks`]
//! (data disks made, grown, kept, taken back), [`recover`]
//! (re-adoption at daemon start), [`exits`] (exit watching, the restart policy), [`autostart`] (VMs desired running, started at
//! daemon start), [`shutdown`] (`host.shutdown_vms`), [`reconcile`] (`host.reconcile`), [`stats`] (`vm.stats`,
//! `host.stats`), [`images`] (the image store with the VMs that use each image), [`backup`]
//! (`vm.export`, `vm.import`), [`copies`] (what snapshots and backups share), [`snapshots`] (`vm.snapshot`, `vm.revert`, ...), [`teardown`] (what every path that ends a QEMU gives back, in one order),
//! [`undo`] (the undo stack a create or start pushes its steps onto, unwound on failure),
//! [`held`] (one VM its caller holds exclusively: the steps an operation shares with the exit
//! cleanup and recovery),
//! [`registry`] (records, their files and the views readers are served), [`processes`] (the
//! QEMU processes: started, found, checked, killed).

pub(crate) mod agent;
pub mod autostart;
pub(crate) mod backup;
mod busy;
mod capture;
mod copies;
pub(crate) mod data_disks;
pub(crate) mod errors;
pub(crate) mod exec;
mod exits;
mod held;
mod hotplug;
pub(crate) mod housekeeping;
pub(crate) mod images;
mod launch;
mod live_copy;
pub(crate) mod migrate;
mod op;
pub(crate) mod ops;
mod placement;
mod processes;
pub(crate) mod reconcile;
mod reconfigure;
mod recover;
mod registry;
mod root_disk;
pub(crate) mod shutdown;
pub(crate) mod snapshots;
pub(crate) mod stats;
mod teardown;
mod topology;
mod undo;
pub(crate) mod vfio;

use crate::api::{ApiError, Code, HostInfo, LastError, VmSpec, VmStatus, VmView, API_VERSION};
use crate::capacity::{self, Holding};
use crate::config::Config;
use crate::events::EventBus;
use crate::net::host::{HostNet, NetworkState};
use crate::nic::{NicAlloc, NicHolding};
use crate::qemu::argv::VmPaths;
use crate::state::{BrokenRecord, Store, VmRecord};
use registry::{Change, Registry, Table};
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

pub use registry::RawView;

/// Daemon version reported by `host.info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The host-wide state every operation shares: the VM registry, the hubs (agent sessions, stats
/// monitors, QMP sessions), the config and the host's resources (networks, PCI devices, images,
/// backups, disk reservations). Its methods are this state's accessors and what must happen under
/// its table lock; a request's entry point is a function of its module taking the manager
/// ([`ops::create`], [`snapshots::snapshot`], ...), one VM's steps are [`op::VmOp`] methods,
/// and what an operation shares with recovery and the exit cleanup is [`held`].
pub struct Manager {
    config: Arc<Config>,
    events: EventBus,
    /// Every VM's record and view ([`registry`]).
    registry: Registry,
    /// Held for the daemon's life: a second vmhostd on the same state dir must not touch it.
    _state_lock: nix::fcntl::Flock<std::fs::File>,
    /// Host networking (bridges, taps), the owner of every link vmhostd makes.
    net: HostNet,
    /// The mirrors of monitor NICs' sources ([`capture`]), next to the taps they feed.
    capture: crate::net::capture::Capture,
    /// Each monitor's state after the last sync, diffed for events ([`capture::sync`]) and shown
    /// by `host.info`.
    capture_states: tokio::sync::Mutex<capture::States>,
    /// What the last network check found, by network name.
    net_states: Mutex<BTreeMap<String, NetworkState>>,
    /// PCI devices through sysfs, the owner of vfio-pci bindings.
    pci: Arc<crate::pci::Pci>,
    /// The VMs' QEMU processes: started, found, checked and killed ([`processes`]).
    processes: processes::Processes,
    /// Guest agent sessions, one per running VM.
    agents: Arc<crate::agent::supervisor::AgentHub>,
    /// Each VM's exec slots ([`exec`]): which of its exec ports a call holds.
    exec_slots: crate::agent::exec::slots::ExecSlots,
    /// `vm.stats`' connections to each running QEMU's stats monitor.
    stats_monitors: crate::stats::sampler::Samplers,
    /// Each running QEMU's kept QMP session (its event monitor), lent to operations.
    qmp_sessions: Arc<crate::qemu::session::Sessions>,
    /// The image files and their recorded sha256s ([`images`]).
    images: crate::images::Store,
    /// `paths.backups` ([`backup`]).
    backups: crate::backup::Backups,
    /// What QEMU read of images without a record, by name, with the file version it read.
    image_probes: Mutex<ImageProbes>,
    /// Disk space held by running imports, snapshots and exports ([`crate::disk::reserve`]).
    reservations: crate::disk::reserve::Ledger,
    /// The host's NUMA nodes, CPUs and hugepage pools ([`topology`]), for placement.
    topology: topology::HostTopology,
    /// The migration port ([`crate::migration`]): its listener and the VMs it expects.
    migrations: crate::migration::Migrations,
    /// Moves whose outcome is unknown, asked about in the background ([`migrate::Unsettled`]).
    unsettled: migrate::Unsettled,
}

/// Format and virtual size of unrecorded images, by name, with the file version read.
type ImageProbes = std::collections::HashMap<String, (crate::qemu::boot_files::Version, (Option<String>, Option<u64>))>;

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager").field("state", &self.config.paths.state).finish_non_exhaustive()
    }
}

/// Takes the exclusive lock on `STATE/vmhostd.lock`.
fn lock_state_dir(state: &std::path::Path) -> Result<nix::fcntl::Flock<std::fs::File>, String> {
    let path = state.join("vmhostd.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
        format!("{} is locked ({errno}): another vmhostd runs on this state directory", path.display())
    })
}

/// Holds a VM's busy flag for the length of one operation.
pub(crate) struct OpGuard {
    mgr: Arc<Manager>,
    name: String,
}

impl Drop for OpGuard {
    /// Gives the flag back and has the exits that arrived meanwhile handled at once
    /// ([`busy`]): the operation is over, so the exit handler decides again on the record the
    /// operation left (its own kill of QEMU no longer matches it, and is ignored).
    fn drop(&mut self) {
        let queued = self.mgr.lock().busy.release(&self.name);
        if queued.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Operations run on the runtime; without one, reads and the next operation see
            // the dead QEMU, as for an unwatched VM.
            tracing::error!(vm = %self.name, "an exit queued behind an operation is left unhandled: no runtime");
            return;
        };
        let mgr = Arc::clone(&self.mgr);
        let name = self.name.clone();
        runtime.spawn(async move {
            for exit in queued {
                mgr.on_exit(&name, &exit.id, exit.cause).await;
            }
        });
    }
}

impl Manager {
    /// Opens the state dir, loads the records and re-adopts running VMs (see [`recover`]).
    ///
    /// # Errors
    /// A message when the state or run directories cannot be created or listed.
    pub async fn open(config: Arc<Config>, events: EventBus) -> Result<Arc<Manager>, String> {
        for dir in [config.paths.state.clone(), config.paths.run.clone()] {
            std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        // The subdirectories name the VMs: 0700 (crate::state::dirs).
        for dir in crate::state::dirs::prepare(&config.paths.state)? {
            tracing::warn!(dir = %dir.display(), "tightened a state directory to mode 0700");
        }
        // Before anything is read or settled: a second daemon must not "recover" the first one's
        // operations in progress.
        let state_lock = lock_state_dir(&config.paths.state)?;
        let store = Store::open(&config.paths.state)
            .map_err(|e| format!("cannot open {}: {e}", config.paths.state.join("vms").display()))?;
        let (mut records, broken) =
            store.load_all().map_err(|e| format!("cannot read {}: {e}", config.paths.state.display()))?;
        for b in &broken {
            tracing::error!(path = %b.path.display(), error = %b.error, "unreadable VM record left in place");
        }
        adopt_instance_ids(&config, &store, &mut records);
        let registry = Registry::new(Arc::clone(&config), store, events.clone(), records, broken);
        let net = HostNet::connect().map_err(|e| format!("cannot open netlink: {e}"))?;
        let processes = processes::Processes::new(Arc::clone(&config));
        let images = crate::images::Store::open(&config)?;
        let config_for_backups = Arc::clone(&config);
        let mgr = Arc::new(Manager {
            config,
            events,
            registry,
            _state_lock: state_lock,
            net,
            capture: crate::net::capture::Capture::new(&config_for_backups.paths.state, &config_for_backups.paths.run),
            capture_states: tokio::sync::Mutex::default(),
            net_states: Mutex::new(BTreeMap::new()),
            pci: Arc::new(crate::pci::Pci::real()),
            processes,
            agents: Arc::default(),
            exec_slots: Default::default(),
            stats_monitors: Default::default(),
            qmp_sessions: Arc::default(),
            images,
            image_probes: Mutex::default(),
            reservations: crate::disk::reserve::Ledger::default(),
            topology: topology::HostTopology::open(crate::pci::sysfs::SYSFS_ROOT, &config_for_backups),
            backups: crate::backup::Backups::open(&config_for_backups),
            migrations: crate::migration::Migrations::new(&config_for_backups.migration),
            unsettled: Default::default(),
        });
        mgr.processes.integrity().log_at_start();
        mgr.recover_all().await;
        snapshots::recover_at_start(&mgr).await;
        backup::recover_imports_at_start(&mgr).await;
        mgr.refresh_networks().await;
        let live: HashSet<String> =
            mgr.lock().vms.values().filter(|r| r.status == VmStatus::Running).map(|r| r.spec.name.clone()).collect();
        let removed = mgr.net.remove_orphans(&live).await;
        if !removed.is_empty() {
            tracing::info!(links = ?removed, "removed orphaned links");
        }
        // Records settled: the mirrors follow them (stale ones of any boot go), then follow
        // the links.
        let watch = capture::open_watch();
        capture::sync(&mgr).await;
        capture::spawn_watcher(&mgr, watch);
        Ok(mgr)
    }

    /// Makes the configured networks usable and remembers what was found.
    pub async fn refresh_networks(&self) {
        let states = self.net.ensure_networks(&self.config).await;
        let mut map = self.net_states.lock().unwrap_or_else(|p| p.into_inner());
        *map = states.into_iter().map(|s| (s.name.clone(), s)).collect();
    }

    /// Network states for `host.check`.
    pub fn network_states(&self) -> Vec<NetworkState> {
        self.net_states.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    /// The host networking owner.
    pub fn host_net(&self) -> &HostNet {
        &self.net
    }

    /// The QEMU binary's pinned sha256 and what it is now ([`crate::qemu::integrity`]).
    pub fn binary_integrity(&self) -> &crate::qemu::integrity::Integrity {
        self.processes.integrity()
    }

    /// The config the manager runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The event bus.
    pub fn events(&self) -> &EventBus {
        &self.events
    }

    /// Binds the migration port (when `[migration] listen` is set) and serves it in the
    /// background; called once at start, after recovery settled the records the listener
    /// answers queries from.
    ///
    /// # Errors
    /// A message when the port cannot be bound (the daemon then refuses to start).
    pub fn start_migration_port(self: &Arc<Self>) -> Result<(), String> {
        if self.config.migration.listen.is_none() {
            return Ok(());
        }
        self.migrations.bind().map_err(|e| e.to_string())?;
        // The destination's records and tombstones answer (lifecycle/migrate/incoming).
        let outcomes = self.migration_outcomes();
        let mgr = Arc::clone(self);
        tokio::spawn(async move {
            if let Err(e) = mgr.migrations.serve(outcomes).await {
                tracing::error!(error = %e, "migration port stopped");
            }
        });
        Ok(())
    }

    /// The in-memory table ([`registry`]): never hold it across I/O.
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.registry.table()
    }

    fn paths(&self, name: &str) -> VmPaths {
        VmPaths::for_vm(&self.config, name)
    }

    /// A QMP connection to VM `name`'s QEMU for one operation: its kept session, or else a
    /// connection of its own made within `timeout` ([`crate::qemu::session`]).
    ///
    /// # Errors
    /// No connection could be made.
    async fn qmp(
        &self,
        name: &str,
        timeout: std::time::Duration,
    ) -> Result<crate::qemu::session::Monitor, crate::qemu::qmp::QmpError> {
        self.qmp_sessions.connect(name, &self.paths(name).qmp, timeout).await
    }

    /// The QEMU that works on image files: `qemu.binary` as `qemu.user` ([`crate::disk`]), with
    /// its `qemu.sha256` pin, checked before each of its runs (4002: wrap its errors in an
    /// owner's or a [`errors::DiskStepError`], whose mapping keeps a pin refusal 4002).
    fn disk_tool(&self) -> crate::disk::Tool {
        crate::disk::Tool {
            binary: self.config.qemu.binary.clone(),
            user: self.config.qemu_user,
            pin: self.processes.integrity().qemu_pin(),
        }
    }

    /// Takes the busy flag of an existing VM; while the exit watcher cleans up after its QEMU,
    /// waits for that first (up to [`busy::CLEANUP_WAIT`]). Returns the record as it was when
    /// the flag was taken.
    ///
    /// # Errors
    /// 4040 when there is no such VM, 4090 when another operation holds it (or the cleanup
    /// outlasts the wait).
    async fn begin(self: &Arc<Self>, name: &str) -> Result<(OpGuard, VmRecord), ApiError> {
        let deadline = tokio::time::Instant::now() + busy::CLEANUP_WAIT;
        loop {
            let released = {
                let mut t = self.lock();
                let rec = t.vms.get(name).cloned().ok_or_else(|| ApiError::not_found(name))?;
                match t.busy.take(name, busy::Holder::Operation) {
                    busy::Take::Taken => return Ok((OpGuard { mgr: self.clone(), name: name.to_string() }, rec)),
                    busy::Take::Busy => return Err(busy(name)),
                    busy::Take::AfterCleanup(released) => released,
                }
            };
            if !busy::wait_for_release(released, deadline).await {
                return Err(busy(name));
            }
        }
    }

    /// Admits `spec` as a new VM: capacity, conflicts, record written (with a new instance id:
    /// a new root disk), busy flag taken.
    fn reserve_new(
        self: &Arc<Self>,
        spec: &VmSpec,
        incoming: Option<crate::state::migration::MigrationRecord>,
    ) -> Result<OpGuard, ApiError> {
        let name = &spec.name;
        let instance_id = new_instance_id(name)?;
        let (guard, ()) = self.write_and_hold(name, "vm.create", busy::Holder::Operation, |t| {
            if t.vms.contains_key(name) {
                return Err(ApiError::invalid("spec.name", format!("a VM named {name:?} already exists")));
            }
            if let Some(b) = t.broken.get(name) {
                return Err(ApiError::internal(format!(
                    "the record {} of a VM with this name is unreadable ({}); repair or remove it first",
                    b.path.display(),
                    b.error
                )));
            }
            if t.busy.contains(name) {
                return Err(busy(name));
            }
            let mut rec = VmRecord::new(spec.clone());
            rec.nics = self.admit_locked(t, spec, &[])?;
            rec.instance_id = Some(instance_id);
            if let Some(m) = incoming {
                // A migration's destination: `incoming` from its first write, so that no
                // crash or failure leaves a record a start or autostart would boot while the
                // guest runs on the source.
                rec.set_status(VmStatus::Incoming)?;
                rec.migration = Some(m);
            }
            Ok((Change::Put(Box::new(rec)), ()))
        })?;
        guard.ok_or_else(|| ApiError::internal(format!("the record of VM {name:?} was written without its busy flag")))
    }

    /// [`Registry::write`] that also takes VM `name`'s busy flag, in the same step, when `decide`
    /// puts a record (`decide` checks the flag is free): for what no operation may interleave
    /// with, a create's reservation and an exit's record with its cleanup. The returned guard
    /// holds the flag (`None` when nothing was put); a failed write gives it back.
    ///
    /// # Errors
    /// As [`Registry::write`].
    fn write_and_hold<T>(
        self: &Arc<Self>,
        name: &str,
        reason: &str,
        holder: busy::Holder,
        decide: impl FnOnce(&mut Table) -> Result<(Change, T), ApiError>,
    ) -> Result<(Option<OpGuard>, T), ApiError> {
        let took = std::cell::Cell::new(false);
        let written = self.registry.write(name, reason, |t| {
            let (change, value) = decide(t)?;
            if matches!(change, Change::Put(_)) {
                took.set(matches!(t.busy.take(name, holder), busy::Take::Taken));
            }
            Ok((change, value))
        });
        // Dropped on an error: the flag goes back.
        let guard = took.get().then(|| OpGuard { mgr: Arc::clone(self), name: name.to_string() });
        written.map(|(value, _)| (guard, value))
    }

    /// The specs VM `r` holds by: its own and, while its QEMU runs another (a change waiting
    /// for a restart, also while it is stopped for it), that one: devices, CPUs, memory and
    /// addresses of both (CPUs and memory counted at the larger of the two, [`capacity::Used`]).
    fn holding_specs(r: &VmRecord) -> Vec<&VmSpec> {
        let live = matches!(r.status, VmStatus::Running | VmStatus::Stopping);
        std::iter::once(&r.spec).chain(r.running_spec.as_ref().filter(|_| live)).collect()
    }

    /// Capacity, hardware and NIC admission of `spec` against every other VM that holds
    /// resources; returns its NIC allocations (keeping `previous` where still free).
    fn admit_locked(&self, t: &Table, spec: &VmSpec, previous: &[NicAlloc]) -> Result<Vec<NicAlloc>, ApiError> {
        images::check_image_staying(self, t, spec)?;
        let held: Vec<&VmRecord> = t.vms.values().filter(|r| r.reserved && r.spec.name != spec.name).collect();
        // A VM changed without a restart holds what its live QEMU was started with too.
        let specs = Self::holding_specs;
        let holdings: Vec<Holding<'_>> =
            held.iter().flat_map(|r| specs(r).into_iter().map(|spec| Holding { name: &r.spec.name, spec })).collect();
        capacity::admit(&self.config.hardware, &holdings, spec)?;
        let nic_holdings: Vec<NicHolding<'_>> = held
            .iter()
            .flat_map(|r| specs(r).into_iter().map(|spec| NicHolding { vm: &r.spec.name, spec, allocs: &r.nics }))
            .collect();
        crate::nic::allocate(spec, &self.config, &nic_holdings, previous)
    }

    /// Admission of a new VM without reserving anything (a refusal before slower checks).
    fn precheck_admission(&self, spec: &VmSpec) -> Result<(), ApiError> {
        let t = self.lock();
        if t.vms.contains_key(&spec.name) {
            return Err(ApiError::invalid("spec.name", format!("a VM named {:?} already exists", spec.name)));
        }
        self.admit_locked(&t, spec, &[]).map(|_| ())
    }

    /// Like [`Manager::update`], but only when `condition` holds for the current record (and
    /// the VM's busy flag), checked under the same lock. Returns the new record when the change
    /// was made, `None` when the VM is absent or the condition failed.
    fn update_if(
        &self,
        name: &str,
        reason: &str,
        condition: impl FnOnce(&VmRecord, bool) -> bool,
        change: impl FnOnce(&mut VmRecord),
    ) -> Result<Option<VmRecord>, ApiError> {
        let (_, new) = self.registry.write(name, reason, |t| {
            let Some(old) = t.vms.get(name) else { return Ok((Change::Keep, ())) };
            if !condition(old, t.busy.contains(name)) {
                return Ok((Change::Keep, ()));
            }
            let mut rec = old.clone();
            change(&mut rec);
            Ok((Change::Put(Box::new(rec)), ()))
        })?;
        Ok(new)
    }

    /// Applies `change` to the record of `name`, saves it, and emits an event when the status
    /// changed. The in-memory record is only replaced once the file is written.
    fn update(&self, name: &str, reason: &str, change: impl FnOnce(&mut VmRecord)) -> Result<VmRecord, ApiError> {
        self.update_if(name, reason, |_, _| true, change)?.ok_or_else(|| ApiError::not_found(name))
    }

    /// [`Manager::update`] that also moves the record to status `to`, checked against the
    /// transition table ([`crate::state::transition`]) before `change` runs.
    ///
    /// # Errors
    /// As [`Manager::update`]; 5000 when the table refuses the change (a bug: nothing is written).
    fn update_status(
        &self,
        name: &str,
        reason: &str,
        to: VmStatus,
        change: impl FnOnce(&mut VmRecord),
    ) -> Result<VmRecord, ApiError> {
        let (_, new) = self.registry.write(name, reason, |t| {
            let Some(old) = t.vms.get(name) else { return Ok((Change::Keep, ())) };
            let mut rec = old.clone();
            rec.set_status(to)?;
            change(&mut rec);
            Ok((Change::Put(Box::new(rec)), ()))
        })?;
        new.ok_or_else(|| ApiError::not_found(name))
    }

    /// A step boundary the fault tests may crash the daemon at ([`crate::crashpoint`]).
    fn crashpoint(&self, step: &str) {
        crate::crashpoint::hit(&self.config.paths.run, step);
    }

    /// Deletes the record of `name` for good.
    fn forget(&self, name: &str, reason: &str) -> Result<(), ApiError> {
        self.registry.write(name, reason, |_| Ok((Change::Remove, ())))?;
        Ok(())
    }

    fn record(&self, name: &str) -> Result<VmRecord, ApiError> {
        self.lock().vms.get(name).cloned().ok_or_else(|| ApiError::not_found(name))
    }

    /// A committed view with its live parts current: the agent's session, and for a VM whose
    /// exit is not watched, whether its QEMU is still in /proc.
    fn serve(&self, cached: Arc<registry::CachedView>) -> Arc<registry::CachedView> {
        let name = cached.name.as_str();
        let agent = self.agents.status(name);
        let alive = cached.status != VmStatus::Running || !self.registry.is_unwatched(name) || {
            // An unreadable /proc is not proof of death: keep what the record says.
            cached.process.as_ref().is_some_and(|p| match self.processes.check(&self.paths(name)) {
                Ok(check) => crate::qemu::identity::verify(p, &check).map_or(true, |v| v.is_ok()),
                Err(_) => true,
            })
        };
        if alive && agent == cached.agent {
            return cached;
        }
        self.registry.refresh(name, &cached, agent, alive)
    }

    /// `vm.list`: every VM, by name.
    pub fn list(&self) -> Vec<VmView> {
        self.registry.views().into_iter().filter_map(|c| self.serve(c).view().ok()).collect()
    }

    /// What a reconcile plans against: each VM's spec, and its status as readers see it.
    fn current_vms(&self) -> BTreeMap<String, crate::plan::CurrentVm> {
        let views: Vec<_> = self.registry.views().into_iter().map(|c| self.serve(c)).collect();
        let t = self.lock();
        views
            .iter()
            .filter_map(|v| {
                let rec = t.vms.get(&v.name)?;
                let current = crate::plan::CurrentVm {
                    spec: rec.spec.clone(),
                    status: v.status,
                    pending_restart: v.pending_restart,
                    placement: rec.placement.clone(),
                };
                Some((v.name.clone(), current))
            })
            .collect()
    }

    /// `vm.list` as served: every VM's view, by name, as JSON made when its record changed.
    pub fn list_json(&self) -> RawView {
        // The live parts of every view are brought current (which changes the list only when
        // one of them changed), unless nothing they depend on changed since the last list.
        let agents = self.agents.changes();
        if let Some(list) = self.registry.checked_list(agents) {
            return RawView(list);
        }
        for cached in self.registry.views() {
            self.serve(cached);
        }
        RawView(self.registry.mark_list_checked(agents))
    }

    /// `vm.get`.
    ///
    /// # Errors
    /// 4040 when there is no such VM.
    pub fn get(&self, name: &str) -> Result<VmView, ApiError> {
        let cached = self.registry.view(name).ok_or_else(|| ApiError::not_found(name))?;
        self.serve(cached).view()
    }

    /// `vm.get` as served (see [`Manager::list_json`]).
    ///
    /// # Errors
    /// 4040 when there is no such VM.
    pub fn get_json(&self, name: &str) -> Result<RawView, ApiError> {
        let cached = self.registry.view(name).ok_or_else(|| ApiError::not_found(name))?;
        Ok(RawView(Arc::clone(&self.serve(cached).json)))
    }

    /// `host.info`.
    pub fn host_info(&self) -> HostInfo {
        let kept_disks = data_disks::kept_disks(self);
        let space = crate::disk::space::FsSpace::of(&self.config.paths.state).ok();
        // What the records hold, under the table lock (in-memory only) ...
        let topo = self.topology.now();
        let vm_cpus = self.config.hardware.vm_cpus.as_ref();
        let (provisioned_bytes, cpu, memory_mib, mut hardware, vm_count, networks, cpu_use, numa) = {
            let t = self.lock();
            let provisioned: u64 =
                t.vms.values().map(|r| crate::disk::space::provisioned(&r.spec) + root_disk::root_disk_bytes(r)).sum();
            let held: Vec<Holding<'_>> = t
                .vms
                .values()
                .filter(|r| r.reserved)
                .flat_map(|r| Self::holding_specs(r).into_iter().map(|spec| Holding { name: &r.spec.name, spec }))
                .collect();
            let (cpu, memory_mib, hardware) = capacity::usage(&self.config.hardware, &held);
            let placed = topology::held(t.vms.values());
            let devices: Vec<(String, Option<u32>)> = self
                .config
                .hardware
                .model
                .iter()
                .map(|(_, _, addr)| {
                    (addr.to_string(), crate::placement::topology::pci_node(self.topology.sys_root(), addr))
                })
                .collect();
            let numa = topology::node_infos(&topo, vm_cpus, &placed, &devices);
            let cpus = topology::cpu_info(&topo, vm_cpus, &placed);
            (provisioned, cpu, memory_mib, hardware, t.vms.len(), self.network_info(&t), cpus, numa)
        };
        // ... then what the kernel says about each device right now (sysfs reads, no writes).
        for item in &mut hardware {
            if let Ok(addr) = crate::hardware::PciAddress::parse(&item.pci) {
                item.present = self.pci.exists(addr);
                item.driver = self.pci.driver(addr).ok().flatten();
                item.iommu_group = self.pci.iommu_group(addr).ok().flatten();
            }
        }
        let storage = crate::api::StorageInfo {
            total_bytes: space.map_or(0, |s| s.total),
            free_bytes: space.map_or(0, |s| s.free),
            provisioned_bytes,
            overcommit: self.config.storage.overcommit_percent as f64 / 100.0,
        };
        HostInfo {
            version: VERSION.to_string(),
            api_version: API_VERSION,
            accel: self.config.qemu.accel.as_str().to_string(),
            cpu,
            memory_mib,
            hardware,
            vm_count,
            networks,
            kept_disks,
            storage,
            numa,
            cpus: cpu_use,
            // Asks netlink: filled in by the caller, off this blocking read ([`Manager::capture_info`]).
            capture: Vec::new(),
        }
    }

    /// `host.info` `capture`: every `[capture] interfaces` entry as the kernel shows it now,
    /// with the monitors of live VMs on it and their states after the last sync.
    pub async fn capture_info(&self) -> Vec<crate::api::CaptureInfo> {
        capture::info(self).await
    }

    /// `host.check` item `capture`: every configured capture interface exists.
    pub async fn capture_check(&self) -> crate::api::CheckItem {
        capture::check_item(&capture::info(self).await)
    }

    fn network_info(&self, t: &Table) -> Vec<crate::api::NetworkInfo> {
        let states = self.network_states();
        self.config
            .networks
            .values()
            .map(|n| {
                let state = states.iter().find(|s| s.name == n.name);
                let nics = t
                    .vms
                    .values()
                    .flat_map(|r| {
                        r.spec.nics.iter().zip(&r.nics).enumerate().filter(|(_, (spec, _))| spec.network == n.name).map(
                            |(i, (spec, alloc))| crate::api::NetworkNic {
                                vm: r.spec.name.clone(),
                                nic: i,
                                mac: alloc.mac.clone(),
                                tap: alloc.tap.clone(),
                                vlan: spec.vlan,
                                address: match &spec.ipv4 {
                                    Some(crate::api::Ipv4Spec::Static { address, .. }) => Some(address.clone()),
                                    _ => None,
                                },
                            },
                        )
                    })
                    .collect();
                crate::api::NetworkInfo {
                    name: n.name.clone(),
                    bridge: n.bridge.clone(),
                    created: n.create,
                    vlan_filtering: n.vlan_filtering,
                    trunk: n.trunk.clone(),
                    uplink: n.uplink.clone(),
                    subnet: n.subnet.map(|s| s.to_string()),
                    ready: state.is_some_and(|s| s.ready),
                    detail: state.map(|s| s.detail.clone()).unwrap_or_default(),
                    nics,
                }
            })
            .collect()
    }

    /// The VMs whose spec asks for UEFI firmware, by name, for `host.check`.
    pub fn uefi_vms(&self) -> Vec<String> {
        let t = self.lock();
        t.vms
            .values()
            .filter(|r| r.spec.boot.firmware == crate::api::Firmware::Uefi)
            .map(|r| r.spec.name.clone())
            .collect()
    }

    /// The VMs whose spec asks for a TPM, for `host.check` ([`crate::tpm::check_item`]).
    pub fn tpm_vms(&self) -> Vec<String> {
        self.lock().vms.values().filter(|r| r.spec.tpm).map(|r| r.spec.name.clone()).collect()
    }

    /// The VMs whose spec asks for Secure Boot, by name, for `host.check`.
    pub fn secure_boot_vms(&self) -> Vec<String> {
        let t = self.lock();
        t.vms.values().filter(|r| r.spec.boot.secure_boot).map(|r| r.spec.name.clone()).collect()
    }

    /// Records that could not be loaded, for `host.check`.
    pub fn broken_records(&self) -> Vec<BrokenRecord> {
        self.lock().broken.values().cloned().collect()
    }
}

/// A new cloud-init instance id for VM `name` ([`crate::seed::new_instance_id`]), made before
/// its record is written.
///
/// # Errors
/// 4001 with step `instance_id` when `/dev/urandom` cannot be read; nothing was changed.
fn new_instance_id(name: &str) -> Result<String, ApiError> {
    crate::blocking::run(|| crate::seed::new_instance_id(name)).map_err(ApiError::from)
}

/// Gives each record written before instance ids were recorded the id its guest last booted
/// with ([`VmRecord::adopt_instance_id`]) and saves it. A record that cannot be saved keeps the
/// id in memory; its next write saves it, and until then a restart computes the same id again
/// (nothing it is computed from can change without a write).
fn adopt_instance_ids(config: &Config, store: &Store, records: &mut [VmRecord]) {
    for rec in records.iter_mut() {
        let seed = VmPaths::for_vm(config, rec.name()).seed;
        if !rec.adopt_instance_id(&seed) {
            continue;
        }
        let id = rec.instance_id.clone().unwrap_or_default();
        match store.save(rec) {
            Ok(()) => tracing::info!(vm = %rec.name(), instance_id = %id, "recorded the VM's cloud-init instance id"),
            Err(e) => tracing::warn!(
                vm = %rec.name(), instance_id = %id, error = %e,
                "cannot record the VM's cloud-init instance id yet; its next record write will"
            ),
        }
    }
}

/// 4001 naming the `step` that failed.
fn provisioning(step: &str, message: String) -> ApiError {
    ApiError::new(Code::ProvisioningFailed, message).details(serde_json::json!({ "step": step }))
}

fn busy(name: &str) -> ApiError {
    ApiError::new(Code::Busy, format!("another operation on VM {name:?} is in progress")).field("name")
}

fn state_write_error(name: &str, e: &std::io::Error) -> ApiError {
    ApiError::new(Code::ProvisioningFailed, format!("cannot write the record of VM {name:?}: {e}"))
        .details(serde_json::json!({"step": "state"}))
}

fn last_error(e: &ApiError) -> LastError {
    LastError { code: e.code.as_i32(), message: e.message.clone() }
}
