//! The registry: every VM record, in memory and on disk, and the views readers are served.
//!
//! It exists so that reads never wait for a disk and a slow record write of one VM never holds
//! up another VM. Two kinds of lock, always taken in this order:
//!
//! 1. a VM's **slot** (one mutex per name): held by [`Registry::write`] from the moment it reads
//!    the VM's record until the new one is on disk and committed, so writes of one VM reach the
//!    file in the order they were decided;
//! 2. the **table** (one mutex): in-memory work only, never held across I/O.
//!
//! A write decides its change under the table lock (a condition, an admission against every
//! other VM's holdings) and puts the new record in the table at once, so the next admission
//! counts it; the file is written with only the slot held; a failed write puts the old record
//! back before the slot is released. Readers are served from [`CachedView`]s, rebuilt when a
//! write commits, so they only ever see records that are on disk.
//!
//! A view's liveness comes from the exit watcher ([`Registry::mark_exited`]), not from /proc:
//! only a VM whose process could not be watched is checked in /proc at read time.
//!
//! `vm.list` is one JSON array of every view, made at the first list after any view changed
//! and then served as it is. Its live parts (the agent status each view shows) are brought
//! current by the reader ([`Registry::refresh`]) and the list is then marked checked at the
//! agent hub's change count ([`Registry::mark_list_checked`]); while that count and every view
//! stay the same, [`Registry::checked_list`] serves it without looking at a view. A VM whose
//! QEMU cannot be watched turns that off: its liveness is read from /proc at every list.

use crate::api::{ApiError, VmStatus, VmView};
use crate::config::Config;
use crate::events::EventBus;
use crate::process::ProcessIdentity;
use crate::qemu::argv::VmPaths;
use crate::state::{BrokenRecord, Store, VmRecord};
use serde::ser::{Serialize, Serializer};
use serde_json::value::RawValue;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// The in-memory records: what the lifecycle reads and admits against.
#[derive(Debug, Default)]
pub(super) struct Table {
    /// Every VM's record (a write's new record from the moment it is decided).
    pub vms: BTreeMap<String, VmRecord>,
    /// VMs an operation holds ([`super::OpGuard`]), with the exits queued behind it.
    pub busy: super::busy::BusyFlags,
    /// Record files that could not be read at start.
    pub broken: BTreeMap<String, BrokenRecord>,
    /// Images being deleted: no VM is admitted with one as its boot image meanwhile.
    pub images_going: HashSet<String>,
    /// The committed views.
    views: Views,
    /// The QEMU each VM's exit watcher saw end, until a new record replaces that process.
    exited: HashMap<String, ProcessIdentity>,
    /// VMs whose QEMU could not be watched: their liveness is read from /proc.
    unwatched: HashSet<String>,
    /// Each running VM's monitor NIC states after the last capture sync, by NIC index
    /// ([`Registry::set_capture`]); views show them while the VM runs.
    capture: BTreeMap<String, BTreeMap<usize, String>>,
    /// Each migrating VM's progress so far ([`Registry::set_migration_progress`]); views show
    /// it while the record names the migration.
    migration_progress: HashMap<String, crate::api::migration::MigrationProgress>,
    /// VMs recovery has not settled yet (all of them at start): only these can have a QEMU
    /// whose identity is not recorded ([`super::launch::find_live`]).
    pub unsettled: HashSet<String>,
}

/// The committed views by name, and the `vm.list` answer made of them.
#[derive(Debug, Default)]
struct Views {
    by_name: BTreeMap<String, Arc<CachedView>>,
    /// Every view as one JSON array, made at the first list after a change and then served to
    /// every lister as it is: 1000 views are 450 KB, too much to copy per call.
    list: Option<List>,
}

/// The list answer, and what its live parts were last checked against.
#[derive(Debug)]
struct List {
    json: Arc<RawValue>,
    /// The agent hub's change count when every view in it was last checked against the hub
    /// ([`Registry::checked_list`]); `None` until then.
    checked: Option<u64>,
}

impl Views {
    fn get(&self, name: &str) -> Option<&Arc<CachedView>> {
        self.by_name.get(name)
    }

    fn put(&mut self, name: String, view: Arc<CachedView>) {
        self.by_name.insert(name, view);
        self.list = None;
    }

    fn remove(&mut self, name: &str) {
        if self.by_name.remove(name).is_some() {
            self.list = None;
        }
    }

    /// The list answer as of now.
    fn list(&mut self) -> &mut List {
        let by_name = &self.by_name;
        self.list.get_or_insert_with(|| {
            let views: Vec<&RawValue> = by_name.values().map(|v| &*v.json).collect();
            // Serialized without parsing the 450 KB again (each view is valid JSON already).
            let json = serde_json::value::to_raw_value(&views).unwrap_or_else(|e| {
                tracing::error!(error = %e, "cannot serialize the list of views");
                null()
            });
            List { json: Arc::from(json), checked: None }
        })
    }
}

/// What a write does to a VM's record.
pub(super) enum Change {
    /// Nothing (a condition did not hold).
    Keep,
    /// This record replaces (or creates) the VM's.
    Put(Box<VmRecord>),
    /// The record is deleted.
    Remove,
}

/// One VM's view as last committed: its JSON, and the few fields reads decide on (the view
/// itself is not kept beside its JSON: with 1000 VMs that doubled the memory views take).
#[derive(Debug)]
pub(super) struct CachedView {
    /// The VM's name.
    pub name: String,
    /// The status `json` shows (the exit watcher's verdict applied).
    pub status: VmStatus,
    /// The agent status `json` shows.
    pub agent: crate::api::AgentStatus,
    /// Whether `json` shows the VM running an older spec than its record's.
    pub pending_restart: bool,
    /// The recorded QEMU, to match the exit watcher's report against.
    pub process: Option<ProcessIdentity>,
    /// The view, serialized.
    pub json: Arc<RawValue>,
}

impl CachedView {
    /// `view` shown dead: its QEMU has ended though the record still says running.
    fn dead(view: &mut VmView) {
        view.status = VmStatus::Dead;
        view.pid = None;
        view.pending_restart = false;
    }

    fn of(view: VmView, process: Option<ProcessIdentity>) -> CachedView {
        let json = raw(&view);
        let pending_restart = view.pending_restart;
        CachedView { name: view.name, status: view.status, agent: view.agent, pending_restart, process, json }
    }

    /// The view as a value, read back from its JSON (for the daemon's own callers; clients get
    /// the JSON).
    ///
    /// # Errors
    /// Only if the JSON this registry made does not parse back (a bug), as 5000.
    pub fn view(&self) -> Result<VmView, ApiError> {
        serde_json::from_str(self.json.get())
            .map_err(|e| ApiError::internal(format!("the view of VM {:?} does not read back: {e}", self.name)))
    }
}

/// A view, or the list of them, as JSON: served as it was made.
#[derive(Clone)]
pub struct RawView(pub Arc<RawValue>);

impl Serialize for RawView {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

/// Records, slots and views (see the module doc).
pub(super) struct Registry {
    config: Arc<Config>,
    store: Store,
    events: EventBus,
    table: Mutex<Table>,
    slots: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every change under these locks is a single insert or remove: a panic cannot leave them
    // half-updated, so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Registry {
    /// The registry over `records` (loaded by the caller from `store`).
    pub fn new(
        config: Arc<Config>,
        store: Store,
        events: EventBus,
        records: Vec<VmRecord>,
        broken: Vec<BrokenRecord>,
    ) -> Registry {
        let reg = Registry { config, store, events, table: Mutex::new(Table::default()), slots: Mutex::default() };
        {
            let mut t = reg.table();
            for rec in records {
                let name = rec.spec.name.clone();
                let cached = reg.render(&rec, &t, Default::default());
                t.views.put(name.clone(), Arc::new(cached));
                t.unsettled.insert(name.clone());
                t.vms.insert(name, rec);
            }
            t.broken = broken.into_iter().map(|b| (b.name.clone(), b)).collect();
        }
        reg
    }

    /// The table, for in-memory reads and decisions. Never hold it across I/O.
    pub fn table(&self) -> MutexGuard<'_, Table> {
        lock(&self.table)
    }

    fn slot(&self, name: &str) -> Arc<Mutex<()>> {
        Arc::clone(lock(&self.slots).entry(name.to_string()).or_default())
    }

    /// Changes VM `name`'s record: `decide` sees the table (the current record, the busy flags,
    /// every other VM for admission) and returns the change and a value for the caller; the
    /// new record is written to disk, then committed to the views, and an event is emitted
    /// when the status changed (with `reason`). Returns the value and the new record.
    ///
    /// # Errors
    /// What `decide` refuses with (nothing changed), or a record write error (the old record
    /// is back in the table).
    pub fn write<T>(
        &self,
        name: &str,
        reason: &str,
        decide: impl FnOnce(&mut Table) -> Result<(Change, T), ApiError>,
    ) -> Result<(T, Option<VmRecord>), ApiError> {
        let slot = self.slot(name);
        let result = crate::blocking::run(|| {
            let _slot = lock(&slot);
            let (old, new, value) = {
                let mut t = self.table();
                let (change, value) = decide(&mut t)?;
                match change {
                    Change::Keep => return Ok((value, None, None, false)),
                    Change::Put(rec) => {
                        // Every committed status change, however the record was made (a
                        // replace writes a new one), is one the table allows.
                        if let Some(old) = t.vms.get(name) {
                            crate::state::transition::check(name, old.status, rec.status)?;
                        }
                        (t.vms.insert(name.to_string(), (*rec).clone()), Some(*rec), value)
                    }
                    Change::Remove => (t.vms.remove(name), None, value),
                }
            };
            let written = match new {
                Some(mut rec) => self.store.save(&mut rec).map(|()| Some(rec)),
                None => self.store.remove(name).map(|()| None),
            };
            let mut t = self.table();
            match written {
                Ok(new) => {
                    match &new {
                        Some(rec) => {
                            t.vms.insert(name.to_string(), rec.clone());
                            // Another process (or none): whether it can be watched is for its
                            // own watcher to say.
                            if t.views.get(name).is_some_and(|v| v.process != rec.process) {
                                t.unwatched.remove(name);
                            }
                            if t.exited.get(name).is_some_and(|id| rec.process.as_ref() != Some(id)) {
                                t.exited.remove(name);
                            }
                            let agent = t.views.get(name).map(|v| v.agent.clone()).unwrap_or_default();
                            let cached = self.render(rec, &t, agent);
                            t.views.put(name.to_string(), Arc::new(cached));
                        }
                        None => {
                            t.views.remove(name);
                            t.exited.remove(name);
                            t.unwatched.remove(name);
                        }
                    }
                    let from = old.as_ref().map(|r| r.status);
                    let to = new.as_ref().map(|r| r.status);
                    Ok((value, new, from, from != to))
                }
                Err(e) => {
                    match old {
                        Some(rec) => t.vms.insert(name.to_string(), rec),
                        None => t.vms.remove(name),
                    };
                    Err(super::state_write_error(name, &e))
                }
            }
        });
        let (value, new, from, changed) = match result {
            Ok(r) => r,
            Err(e) => {
                self.forget_slot(name, slot);
                return Err(e);
            }
        };
        if changed {
            self.events.emit(name, from, new.as_ref().map(|r| r.status), reason);
        }
        if new.is_none() {
            self.forget_slot(name, slot);
        }
        Ok((value, new))
    }

    /// Drops the slot of a VM that has no record, unless another writer holds or waits for it.
    fn forget_slot(&self, name: &str, slot: Arc<Mutex<()>>) {
        let mut slots = lock(&self.slots);
        // Ours and the map's: nobody else can be waiting on it.
        if Arc::strong_count(&slot) == 2 && !self.table().vms.contains_key(name) {
            slots.remove(name);
        }
    }

    /// The view of `rec` as recorded, with `agent` and the liveness the table knows.
    fn render(&self, rec: &VmRecord, t: &Table, agent: crate::api::AgentStatus) -> CachedView {
        let name = rec.name();
        let paths = VmPaths::for_vm(&self.config, name);
        let mut view = VmView {
            name: rec.spec.name.clone(),
            spec: rec.spec.clone(),
            desired_state: rec.spec.state,
            status: rec.status,
            pid: rec.process.as_ref().map(|p| p.pid),
            created_at: rec.created_at.clone(),
            updated_at: rec.updated_at.clone(),
            started_at: rec.started_at.clone(),
            last_error: rec.last_error.clone(),
            serial_log: paths.serial_log,
            nics: nic_views(rec, t.capture.get(name)),
            agent,
            pending_restart: rec.running_spec.is_some() && matches!(rec.status, VmStatus::Running | VmStatus::Stopping),
            restarts: rec.restarts,
            last_exit: rec.last_exit.clone(),
            instance_id: rec.instance_id.clone().filter(|_| crate::seed::spec_has_seed(&rec.spec)),
            placement: rec.placement.as_ref().map(crate::api::PlacementView::from),
            migration: rec.migration().map(|m| crate::state::migration::view(m, t.migration_progress.get(name))),
        };
        if rec.status == VmStatus::Running && t.exited.get(name).is_some_and(|id| rec.process.as_ref() == Some(id)) {
            CachedView::dead(&mut view);
        }
        CachedView::of(view, rec.process.clone())
    }

    /// The committed views, by name.
    pub fn views(&self) -> Vec<Arc<CachedView>> {
        self.table().views.by_name.values().cloned().collect()
    }

    /// The list, if no view changed since it was marked checked at agent change count
    /// `agents` ([`Registry::mark_list_checked`]) and no VM's liveness must be read from /proc:
    /// its live parts are then still current.
    pub fn checked_list(&self, agents: u64) -> Option<Arc<RawValue>> {
        let t = self.table();
        let list = t.views.list.as_ref()?;
        (list.checked == Some(agents) && t.unwatched.is_empty()).then(|| Arc::clone(&list.json))
    }

    /// Every committed view as one JSON array, by name (the same text until a view changes),
    /// marked as checked at agent change count `agents`: the caller brought every view's live
    /// parts current after reading that count.
    pub fn mark_list_checked(&self, agents: u64) -> Arc<RawValue> {
        let mut t = self.table();
        let list = t.views.list();
        list.checked = Some(agents);
        Arc::clone(&list.json)
    }

    /// The committed view of `name`.
    pub fn view(&self, name: &str) -> Option<Arc<CachedView>> {
        self.table().views.get(name).cloned()
    }

    /// Whether `name`'s liveness must be read from /proc (its exit is not watched).
    pub fn is_unwatched(&self, name: &str) -> bool {
        self.table().unwatched.contains(name)
    }

    /// Brings `name`'s current view up to `agent` (the agent's status now) and `alive` (what
    /// /proc says of `old`'s process): `old` is the view the caller checked. Returns the view to
    /// serve.
    ///
    /// A write may have committed a newer view since `old` was read (it carries the agent
    /// status of the view before it): `agent` is applied to that one too, or a list checked
    /// at this agent count would keep the stale status until the next agent change; `alive`
    /// only while it records the same process.
    pub fn refresh(
        &self,
        name: &str,
        old: &Arc<CachedView>,
        agent: crate::api::AgentStatus,
        alive: bool,
    ) -> Arc<CachedView> {
        let mut t = self.table();
        let Some(current) = t.views.get(name).cloned() else { return Arc::clone(old) };
        let dies = !alive && current.status == VmStatus::Running && current.process == old.process;
        if current.agent == agent && !dies {
            return current;
        }
        // One view's JSON read back and written again: in memory, microseconds.
        let Ok(mut view) = current.view() else { return current };
        view.agent = agent;
        if dies {
            CachedView::dead(&mut view);
        }
        let fresh = Arc::new(CachedView::of(view, current.process.clone()));
        t.views.put(name.to_string(), Arc::clone(&fresh));
        fresh
    }

    /// Records every VM's monitor NIC states after a capture sync (VM -> NIC index -> state
    /// name) and renders again the views of the VMs whose states changed.
    pub fn set_capture(&self, states: BTreeMap<String, BTreeMap<usize, String>>) {
        let mut t = self.table();
        let mut changed: Vec<String> =
            states.iter().filter(|(vm, s)| t.capture.get(*vm) != Some(*s)).map(|(vm, _)| vm.clone()).collect();
        changed.extend(t.capture.keys().filter(|vm| !states.contains_key(*vm)).cloned());
        t.capture = states;
        for name in changed {
            let (Some(cached), Some(rec)) = (t.views.get(&name).cloned(), t.vms.get(&name).cloned()) else { continue };
            let fresh = self.render(&rec, &t, cached.agent.clone());
            t.views.put(name, Arc::new(fresh));
        }
    }

    /// Records how far `name`'s migration got (`None` once it is over) and renders its view
    /// again: progress changes every second, too often for a record write.
    pub fn set_migration_progress(&self, name: &str, progress: Option<crate::api::migration::MigrationProgress>) {
        let mut t = self.table();
        match progress {
            Some(p) => t.migration_progress.insert(name.to_string(), p),
            None => t.migration_progress.remove(name),
        };
        let (Some(cached), Some(rec)) = (t.views.get(name).cloned(), t.vms.get(name).cloned()) else { return };
        let fresh = self.render(&rec, &t, cached.agent.clone());
        t.views.put(name.to_string(), Arc::new(fresh));
    }

    /// The exit watcher saw `id`, `name`'s QEMU, end: reads show the VM `dead` from now on,
    /// before the lifecycle has settled it.
    pub fn mark_exited(&self, name: &str, id: &ProcessIdentity) {
        let mut t = self.table();
        let Some(cached) = t.views.get(name).cloned() else { return };
        if cached.process.as_ref() != Some(id) {
            return;
        }
        t.exited.insert(name.to_string(), id.clone());
        let Some(rec) = t.vms.get(name).cloned() else { return };
        let fresh = self.render(&rec, &t, cached.agent.clone());
        t.views.put(name.to_string(), Arc::new(fresh));
    }

    /// `name`'s QEMU cannot be watched: reads check /proc for it.
    pub fn mark_unwatched(&self, name: &str) {
        self.table().unwatched.insert(name.to_string());
    }
}

/// A view (or anything serializable) as raw JSON.
/// What each NIC of `rec` was given: vhost-net only while a QEMU runs (the launch records it),
/// the queue pairs of the spec that QEMU runs (`running_spec` while a change waits for a
/// restart).
fn nic_views(rec: &VmRecord, capture: Option<&BTreeMap<usize, String>>) -> Vec<crate::api::NicView> {
    let running = rec.running_spec.as_ref().unwrap_or(&rec.spec);
    rec.nics
        .iter()
        .enumerate()
        .map(|(i, n)| crate::api::NicView {
            mac: n.mac.clone(),
            tap: n.tap.clone(),
            vhost: n.vhost && rec.process.is_some(),
            queues: running.nics.get(i).map_or(1, |nic| nic.queues),
            mode: running.nics.get(i).map(|nic| nic.mode).unwrap_or_default(),
            source: running.nics.get(i).and_then(|nic| nic.source.clone()),
            // A monitor NIC shows the direction it mirrors, `both` when the spec leaves it out.
            direction: running
                .nics
                .get(i)
                .filter(|nic| nic.mode == crate::api::NicMode::Monitor)
                .map(|nic| nic.direction.unwrap_or_default()),
            vlans: running.nics.get(i).map(|nic| nic.vlans.clone()).unwrap_or_default(),
            trunk: running.nics.get(i).is_some_and(|nic| nic.trunk),
            capture: capture.filter(|_| rec.process.is_some()).and_then(|c| c.get(&i).cloned()),
        })
        .collect()
}

fn raw<T: Serialize>(value: &T) -> Arc<RawValue> {
    let text = serde_json::to_string(value).unwrap_or_else(|e| {
        // Views hold only strings, numbers and plain structs: this does not happen.
        tracing::error!(error = %e, "cannot serialize a view");
        "null".to_string()
    });
    Arc::from(RawValue::from_string(text).unwrap_or_else(|_| null()))
}

fn null() -> Box<RawValue> {
    RawValue::NULL.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Code;

    struct Fixture {
        _dir: tempfile::TempDir,
        vms_dir: std::path::PathBuf,
        reg: Registry,
        events: tokio::sync::broadcast::Receiver<crate::api::Event>,
    }

    fn fixture(records: &[(&str, VmStatus)]) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let mut config = crate::validate::tests::config();
        config.paths.state = dir.path().join("state");
        crate::state::dirs::prepare(&config.paths.state).unwrap();
        let store = Store::open(&config.paths.state).unwrap();
        let recs: Vec<VmRecord> = records
            .iter()
            .map(|(name, status)| {
                let mut r = VmRecord::new(crate::validate::tests::spec(name));
                r.status = *status;
                store.save(&mut r).unwrap();
                r
            })
            .collect();
        let events = EventBus::default();
        let rx = events.subscribe();
        let reg = Registry::new(Arc::new(config.clone()), store, events, recs, Vec::new());
        Fixture { vms_dir: config.paths.state.join("vms"), _dir: dir, reg, events: rx }
    }

    fn on_disk(f: &Fixture, name: &str) -> Option<VmRecord> {
        let bytes = std::fs::read(f.vms_dir.join(format!("{name}.json"))).ok()?;
        Some(serde_json::from_slice(&bytes).unwrap())
    }

    fn put(status: VmStatus) -> impl FnOnce(&mut Table) -> Result<(Change, ()), ApiError> {
        move |t| {
            let mut rec = t.vms.get("a").cloned().unwrap_or_else(|| VmRecord::new(crate::validate::tests::spec("a")));
            rec.status = status;
            Ok((Change::Put(Box::new(rec)), ()))
        }
    }

    /// A write that records `name` running `id`.
    fn running(name: &str, id: ProcessIdentity) -> impl FnOnce(&mut Table) -> Result<(Change, ()), ApiError> + '_ {
        move |t| {
            let mut r = t.vms[name].clone();
            r.status = VmStatus::Running;
            r.process = Some(id);
            Ok((Change::Put(Box::new(r)), ()))
        }
    }

    fn served(view: &CachedView) -> serde_json::Value {
        serde_json::from_str(view.json.get()).unwrap()
    }

    #[test]
    fn a_put_is_on_disk_in_the_table_and_in_the_view_with_one_event() {
        let mut f = fixture(&[("a", VmStatus::Stopped)]);
        let (_, new) = f.reg.write("a", "started", put(VmStatus::Running)).unwrap();
        assert_eq!(new.as_ref().map(|r| r.status), Some(VmStatus::Running));
        assert_eq!(on_disk(&f, "a").map(|r| r.status), Some(VmStatus::Running));
        assert_eq!(f.reg.table().vms["a"].status, VmStatus::Running);
        let view = f.reg.view("a").unwrap();
        assert_eq!(view.status, VmStatus::Running);
        assert_eq!(served(&view)["status"], "running");
        // The view shows the record as written (its updated_at too).
        assert_eq!(view.view().unwrap().updated_at, on_disk(&f, "a").unwrap().updated_at);
        let e = f.events.try_recv().unwrap();
        assert_eq!((e.from, e.to, e.reason.as_str()), (Some(VmStatus::Stopped), Some(VmStatus::Running), "started"));
        // A write that keeps the status emits nothing.
        f.reg.write("a", "again", put(VmStatus::Running)).unwrap();
        assert!(f.events.try_recv().is_err());
    }

    #[test]
    fn the_view_shows_the_instance_id_of_a_vm_with_a_seed() {
        let f = fixture(&[("a", VmStatus::Stopped)]);
        let id = "vmhost-a-0123456789abcdef0123456789abcdef";
        let with = |boot: Option<crate::api::BootSpec>, user_data: Option<&str>| {
            f.reg
                .write("a", "x", |t| {
                    let mut rec = t.vms["a"].clone();
                    rec.instance_id = Some(id.into());
                    rec.spec.boot = boot.unwrap_or_else(|| crate::validate::tests::spec("a").boot);
                    rec.spec.user_data = user_data.map(str::to_string);
                    Ok((Change::Put(Box::new(rec)), ()))
                })
                .unwrap();
            served(&f.reg.view("a").unwrap()).get("instance_id").cloned()
        };
        // A direct-kernel VM has a seed only with user_data; an image VM always; boot.disk never.
        let id = Some(serde_json::json!(id));
        assert_eq!(with(None, None), None);
        assert_eq!(with(None, Some("#cloud-config\n")), id);
        let image = crate::api::BootSpec { image: Some("b.qcow2".into()), disk_gib: Some(1), ..Default::default() };
        assert_eq!(with(Some(image), None), id);
        let disk = crate::api::BootSpec { disk: Some("old.qcow2".into()), ..Default::default() };
        assert_eq!(with(Some(disk), Some("#cloud-config\n")), None);
    }

    #[test]
    fn keep_changes_nothing_and_remove_deletes_everywhere() {
        let mut f = fixture(&[("a", VmStatus::Stopped)]);
        let before = std::fs::read(f.vms_dir.join("a.json")).unwrap();
        let (value, new) = f.reg.write("a", "x", |_| Ok((Change::Keep, 7))).unwrap();
        assert_eq!((value, new), (7, None));
        assert_eq!(std::fs::read(f.vms_dir.join("a.json")).unwrap(), before);
        assert!(f.events.try_recv().is_err());

        f.reg.write("a", "destroyed", |_| Ok((Change::Remove, ()))).unwrap();
        assert!(on_disk(&f, "a").is_none());
        assert!(!f.reg.table().vms.contains_key("a"));
        assert!(f.reg.view("a").is_none());
        assert!(f.reg.views().is_empty());
        let e = f.events.try_recv().unwrap();
        assert_eq!((e.from, e.to), (Some(VmStatus::Stopped), None));
        // The slot of a VM without a record is gone too.
        assert!(!lock(&f.reg.slots).contains_key("a"));
    }

    #[test]
    fn a_refusal_changes_nothing() {
        let mut f = fixture(&[("a", VmStatus::Stopped)]);
        let err = f.reg.write("a", "x", |_| Err::<(Change, ()), _>(ApiError::invalid("spec.cpu", "no"))).unwrap_err();
        assert_eq!(err.code, Code::InvalidSpec);
        assert_eq!(f.reg.table().vms["a"].status, VmStatus::Stopped);
        assert_eq!(on_disk(&f, "a").unwrap().status, VmStatus::Stopped);
        assert!(f.events.try_recv().is_err());
    }

    #[test]
    fn a_failed_write_puts_the_old_record_back_and_the_view_never_saw_the_new_one() {
        let mut f = fixture(&[("a", VmStatus::Stopped)]);
        // The records directory replaced by a file: the temp file cannot be made.
        std::fs::remove_dir_all(&f.vms_dir).unwrap();
        std::fs::write(&f.vms_dir, b"").unwrap();
        let err = f.reg.write("a", "x", put(VmStatus::Running)).unwrap_err();
        assert_eq!(err.code, Code::ProvisioningFailed);
        assert_eq!(err.details["step"], "state");
        assert_eq!(f.reg.table().vms["a"].status, VmStatus::Stopped);
        assert_eq!(f.reg.view("a").unwrap().status, VmStatus::Stopped);
        assert!(f.events.try_recv().is_err());
        // A new VM whose record cannot be written is not in the table afterwards.
        let err = f
            .reg
            .write("b", "x", |_| Ok((Change::Put(Box::new(VmRecord::new(crate::validate::tests::spec("b")))), ())));
        assert!(err.is_err());
        assert!(!f.reg.table().vms.contains_key("b"));
        assert!(f.reg.view("b").is_none());
    }

    #[test]
    fn a_held_slot_holds_up_only_its_own_vm() {
        let f = Arc::new(fixture(&[("a", VmStatus::Stopped), ("b", VmStatus::Stopped)]));
        // A writer of A in the middle of its file write holds A's slot: played by holding it here.
        let slot = f.reg.slot("a");
        let held = lock(&slot);
        let (decided_tx, decided_rx) = std::sync::mpsc::channel();
        let writer = {
            let f = Arc::clone(&f);
            std::thread::spawn(move || {
                f.reg
                    .write("a", "x", |t| {
                        decided_tx.send(()).unwrap();
                        put(VmStatus::Running)(t)
                    })
                    .unwrap();
            })
        };
        // Meanwhile B is written and every view is readable.
        f.reg
            .write("b", "x", |t| {
                let mut r = t.vms["b"].clone();
                r.status = VmStatus::Running;
                Ok((Change::Put(Box::new(r)), ()))
            })
            .unwrap();
        assert_eq!(f.reg.view("b").unwrap().status, VmStatus::Running);
        assert_eq!(f.reg.views().len(), 2);
        // The second writer of A decides only once the first is done.
        assert!(decided_rx.try_recv().is_err(), "A's second writer decided while its slot was held");
        drop(held);
        writer.join().unwrap();
        decided_rx.recv().unwrap();
        assert_eq!(f.reg.view("a").unwrap().status, VmStatus::Running);
    }

    #[test]
    fn the_exit_watcher_makes_the_view_dead_until_a_new_process_is_recorded() {
        let f = fixture(&[("a", VmStatus::Stopped)]);
        let id = ProcessIdentity { pid: 42, start_ticks: 7 };
        f.reg.write("a", "x", running("a", id.clone())).unwrap();
        assert_eq!(served(&f.reg.view("a").unwrap())["pid"], 42);
        // Another process's exit (an older QEMU) is not this one's.
        f.reg.mark_exited("a", &ProcessIdentity { pid: 42, start_ticks: 6 });
        assert_eq!(f.reg.view("a").unwrap().status, VmStatus::Running);
        f.reg.mark_exited("a", &id);
        let v = f.reg.view("a").unwrap();
        assert_eq!((v.status, v.view().unwrap().pid), (VmStatus::Dead, None));
        assert_eq!(served(&v)["status"], "dead");
        // The record itself is the lifecycle's to settle: untouched.
        assert_eq!(f.reg.table().vms["a"].status, VmStatus::Running);
        // A record write that keeps the process keeps it dead; a new process is alive.
        f.reg.write("a", "x", running("a", id.clone())).unwrap();
        assert_eq!(f.reg.view("a").unwrap().status, VmStatus::Dead);
        f.reg.write("a", "x", running("a", ProcessIdentity { pid: 43, start_ticks: 9 })).unwrap();
        let v = f.reg.view("a").unwrap();
        assert_eq!((v.status, v.view().unwrap().pid), (VmStatus::Running, Some(43)));
        assert!(f.reg.table().exited.is_empty());
    }

    #[test]
    fn a_refresh_keeps_a_newer_commit_and_applies_the_agent_status_to_it() {
        let f = fixture(&[("a", VmStatus::Running)]);
        let old = f.reg.view("a").unwrap();
        let agent = crate::api::AgentStatus { connected: true, version: Some("1".into()), last_seen: None };
        let fresh = f.reg.refresh("a", &old, agent.clone(), true);
        assert_eq!(served(&fresh)["agent"]["connected"], true);
        assert!(Arc::ptr_eq(&f.reg.view("a").unwrap(), &fresh));
        // Not alive: served dead.
        let dead = f.reg.refresh("a", &fresh, agent.clone(), false);
        assert_eq!(served(&dead)["status"], "dead");
        // The agent status survives a commit.
        let before = f.reg.view("a").unwrap();
        f.reg.write("a", "x", put(VmStatus::Stopped)).unwrap();
        assert_eq!(f.reg.view("a").unwrap().agent, agent);
        // A refresh checked against the view before that commit keeps the commit (its status)
        // and still applies the agent status read now: else a list checked at this agent count
        // would show the stale one until the next agent change.
        let now = crate::api::AgentStatus { connected: false, version: Some("1".into()), last_seen: None };
        f.reg.refresh("a", &before, now.clone(), false);
        let v = f.reg.view("a").unwrap();
        assert_eq!((v.status, &v.agent), (VmStatus::Stopped, &now));
    }

    #[test]
    fn the_list_is_one_array_made_once_per_change() {
        let f = fixture(&[("a", VmStatus::Stopped), ("b", VmStatus::Running)]);
        let names = |list: &RawValue| -> Vec<String> {
            let v: serde_json::Value = serde_json::from_str(list.get()).unwrap();
            v.as_array().unwrap().iter().map(|x| x["name"].as_str().unwrap().to_string()).collect()
        };
        assert!(f.reg.checked_list(0).is_none(), "never checked");
        let first = f.reg.mark_list_checked(0);
        assert_eq!(names(&first), ["a", "b"]);
        assert_eq!(serde_json::from_str::<serde_json::Value>(first.get()).unwrap()[1]["status"], "running");
        // Nothing changed: the same text is served, checked as long as the agents did not change.
        assert!(Arc::ptr_eq(&first, &f.reg.checked_list(0).unwrap()));
        assert!(f.reg.checked_list(1).is_none(), "an agent status changed since");
        assert!(Arc::ptr_eq(&first, &f.reg.mark_list_checked(1)));
        // Each kind of view change makes a new list, unchecked: a commit, a removal, a
        // refresh, an exit.
        let c = VmRecord::new(crate::validate::tests::spec("c"));
        f.reg.write("c", "x", |_| Ok((Change::Put(Box::new(c)), ()))).unwrap();
        assert!(f.reg.checked_list(1).is_none());
        assert_eq!(names(&f.reg.mark_list_checked(1)), ["a", "b", "c"]);
        f.reg.write("c", "x", |_| Ok((Change::Remove, ()))).unwrap();
        assert!(f.reg.checked_list(1).is_none());
        assert_eq!(names(&f.reg.mark_list_checked(1)), ["a", "b"]);
        let old = f.reg.view("a").unwrap();
        let agent = crate::api::AgentStatus { connected: true, version: Some("1".into()), last_seen: None };
        f.reg.refresh("a", &old, agent, true);
        assert!(f.reg.checked_list(1).is_none());
        let refreshed: serde_json::Value = serde_json::from_str(f.reg.mark_list_checked(1).get()).unwrap();
        assert_eq!(refreshed[0]["agent"]["connected"], true);
        let id = ProcessIdentity { pid: 42, start_ticks: 7 };
        f.reg.write("b", "x", running("b", id.clone())).unwrap();
        f.reg.mark_list_checked(1);
        f.reg.mark_exited("b", &id);
        assert!(f.reg.checked_list(1).is_none(), "an exit changes the list");
        let exited: serde_json::Value = serde_json::from_str(f.reg.mark_list_checked(1).get()).unwrap();
        assert_eq!(exited[1]["status"], "dead");
        // A VM whose liveness comes from /proc: every list checks it again ...
        f.reg.mark_unwatched("b");
        f.reg.mark_list_checked(1);
        assert!(f.reg.checked_list(1).is_none());
        // ... until another process is recorded for it.
        f.reg.write("b", "x", running("b", ProcessIdentity { pid: 43, start_ticks: 8 })).unwrap();
        f.reg.mark_list_checked(1);
        assert!(f.reg.checked_list(1).is_some());
    }
}
