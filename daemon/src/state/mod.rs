//! Persistent VM records: the daemon's memory across its own restarts.
//!
//! One JSON file per VM under `STATE/vms/`, replaced atomically ([`atomic`]). The lifecycle writes
//! a record *before* it touches the host (intent first), so after a crash every host resource
//! that might exist is named by a record and can be found and cleaned up: what the operation in
//! progress must finish or undo is the record's one [`Intent`] ([`intent`]). On disk a record is
//! the layout every release wrote ([`file`]). [`Store::load_all`] runs once at start; unreadable
//! files are reported and left in place, never overwritten.

pub mod atomic;
pub mod dirs;
mod file;
pub mod intent;
pub mod migration;
pub mod transition;

pub use intent::{DiskWork, Intent, IntentError};

use crate::api::{LastError, VmSpec, VmStatus};
use crate::nic::NicAlloc;
use crate::process::ProcessIdentity;
use serde::{Deserialize, Serialize};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Version of the record format, bumped on incompatible change.
pub const RECORD_VERSION: u32 = 1;

/// [`VmRecord::unclean_end`] while a QEMU runs, and after it ended in a way vmhostd did not see.
pub const QEMU_RUNNING: &str = "the VM's QEMU was started and vmhostd did not see it end with a clean power-off";

/// What the daemon remembers about one VM. Stored as [`file::RecordFile`], today's layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "file::RecordFile", into = "file::RecordFile")]
pub struct VmRecord {
    /// Record format version.
    pub version: u32,
    /// The declared spec (its `state` is the desired state).
    pub spec: VmSpec,
    /// Observed status as last recorded. Changed only through [`VmRecord::set_status`] (the
    /// registry checks every committed change against [`transition::EDGES`] too).
    pub status: VmStatus,
    /// Whether the VM's CPU, memory and hardware are held (false after a failed create).
    pub reserved: bool,
    /// Whether this daemon made the VM's overlay disk (so destroy removes it).
    pub overlay: Option<PathBuf>,
    /// The QEMU process while one exists.
    pub process: Option<ProcessIdentity>,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339.
    pub updated_at: String,
    /// RFC 3339, last QEMU start.
    pub started_at: Option<String>,
    /// Last failure.
    pub last_error: Option<LastError>,
    /// MAC and tap name of each NIC, kept for the VM's life.
    pub nics: Vec<NicAlloc>,
    /// PCI functions moved to vfio-pci for this VM, with their original drivers; written before
    /// the first sysfs change and cleared once they are given back. Not an operation's log:
    /// held for as long as the devices are bound (the whole run of the VM's QEMU), read by
    /// admission (conflicts), the sandbox and recovery (given back when no QEMU runs).
    pub vfio: Vec<crate::pci::bind::Binding>,
    /// The spec the running QEMU was started with, when `spec` was changed since without a
    /// restart (`vm.apply` with `restart: false`): the VM holds what both ask for until its
    /// next start, which applies `spec` and clears this. Not an operation's log: a change
    /// pending across operations, until a start applies it.
    pub running_spec: Option<VmSpec>,
    /// Restarts made by the restart policy, over the VM's life.
    pub restarts: u32,
    /// Unix times of the unexpected exits in the current 10-minute window (the policy's count).
    pub failures: Vec<u64>,
    /// Why QEMU last ended without vmhostd asking.
    pub last_exit: Option<String>,
    /// The root disk a `boot.disk` import moved in, named before the move; kept for the VM's
    /// life. Not an operation's log: whether its import is still in progress is
    /// [`VmRecord::intent`]'s ([`DiskWork::importing_root`]).
    pub root_disk: Option<RootDisk>,
    /// The operation in progress, as far as a crash must know it: what it must finish or undo
    /// ([`intent`]: who starts and ends each). `None` when nothing is in progress.
    pub intent: Option<Intent>,
    /// The cloud-init instance id its seed carries ([`crate::seed`]): made with each new root
    /// disk (a create, a replace), kept through every other change. `None` only in a record
    /// written before ids were recorded, until [`VmRecord::adopt_instance_id`] gives it one.
    pub instance_id: Option<String>,
    /// Why the VM's disks may be as a power cut leaves them, when they may: set when a QEMU of
    /// the VM starts ([`VmRecord::qemu_started`]), replaced by the cause when it ends any way but
    /// a clean power-off (killed by a stop or a replace, crashed, ended while vmhostd was not
    /// running), cleared by a clean power-off (the guest's own, or the one a stop asked for) and
    /// by a revert to a snapshot that is not crash-consistent. While set, a copy of the stopped
    /// VM is `crash` with this as its reason, not `stopped`.
    pub unclean_end: Option<String>,
    /// Where the VM's QEMU runs ([`crate::placement`]): set under the allocation lock in the
    /// same write that marks a start (before the host is touched), cleared when the QEMU is
    /// gone. A stopped VM holds none.
    pub placement: Option<crate::placement::Placement>,
    /// The migration this VM is part of, on this host's side ([`migration`]): set before
    /// either side touches the host for it, cleared when this side is done with it.
    pub migration: Option<migration::MigrationRecord>,
    /// The VM's swtpm ([`crate::tpm`]), recorded when it starts, before QEMU; it ends with
    /// QEMU. Only ever acted on while that very process (pid and start time) lives.
    pub tpm_process: Option<ProcessIdentity>,
}

/// A `boot.disk` VM's root disk: `STATE/disks/NAME/root.FORMAT`, moved in from the import
/// directory (docs/storage.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootDisk {
    /// Its format, as probed at import and pinned from then on.
    pub format: crate::api::DiskFormat,
    /// Its virtual size when it was imported, in bytes (a later `disk_gib` may not be below).
    pub imported_bytes: u64,
    /// Where it came from (`paths.import/FILE`): an undone import moves it back there.
    pub source: PathBuf,
    /// Its permission bits there, given back when it goes back.
    pub source_mode: u32,
}

impl VmRecord {
    /// A new record for `spec` in status `creating`, holding its resources.
    pub fn new(spec: VmSpec) -> VmRecord {
        let now = crate::api::now_rfc3339();
        VmRecord {
            version: RECORD_VERSION,
            spec,
            status: VmStatus::Creating,
            reserved: true,
            overlay: None,
            process: None,
            created_at: now.clone(),
            updated_at: now,
            started_at: None,
            last_error: None,
            nics: Vec::new(),
            vfio: Vec::new(),
            running_spec: None,
            restarts: 0,
            failures: Vec::new(),
            last_exit: None,
            root_disk: None,
            intent: None,
            instance_id: None,
            unclean_end: None,
            placement: None,
            migration: None,
            tpm_process: None,
        }
    }

    /// A QEMU of the VM was started: from now until it ends with a clean power-off its disks
    /// are not known to be clean ([`VmRecord::unclean_end`]); a cause already recorded (an
    /// earlier unclean end the disks still carry) is kept.
    pub fn qemu_started(&mut self) {
        if self.unclean_end.is_none() {
            self.unclean_end = Some(QEMU_RUNNING.to_string());
        }
    }

    /// For a record written before instance ids were recorded: gives it, once, the id its
    /// guest last booted with ([`crate::seed::adopted_instance_id`]: the one in its seed at
    /// `seed`, else the digest of the spec it was last started with, `running_spec` if set),
    /// so an upgrade does not make cloud-init see a new instance. Returns whether it set one.
    pub fn adopt_instance_id(&mut self, seed: &Path) -> bool {
        if self.instance_id.is_some() {
            return false;
        }
        let booted = self.running_spec.as_ref().unwrap_or(&self.spec);
        self.instance_id = Some(crate::seed::adopted_instance_id(seed, booted));
        true
    }

    /// Moves the record to status `to` if [`transition::EDGES`] allows it from the current one
    /// (keeping the status always is); a refusal is logged at error and changes nothing.
    ///
    /// # Errors
    /// [`transition::TransitionError`] when the change is not allowed.
    pub fn set_status(&mut self, to: VmStatus) -> Result<(), transition::TransitionError> {
        transition::check(&self.spec.name, self.status, to)?;
        self.status = to;
        Ok(())
    }

    /// The VM's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }
}

/// A record file that could not be read: reported by `host.check`, and its name stays taken.
#[derive(Debug, Clone)]
pub struct BrokenRecord {
    /// The file.
    pub path: PathBuf,
    /// The VM name taken from the file name.
    pub name: String,
    /// Why it could not be loaded.
    pub error: String,
}

/// The record directory.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    /// Opens (creating if needed, mode 0700, see [`dirs`]) `STATE/vms`.
    ///
    /// # Errors
    /// The directory cannot be created or made private.
    pub fn open(state_dir: &Path) -> io::Result<Store> {
        let dir = state_dir.join("vms");
        dirs::private_dir(&dir)?;
        Ok(Store { dir })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    /// Loads every record, sorted by name.
    ///
    /// # Errors
    /// The directory cannot be listed. Individual bad files become [`BrokenRecord`]s.
    pub fn load_all(&self) -> io::Result<(Vec<VmRecord>, Vec<BrokenRecord>)> {
        let mut good = Vec::new();
        let mut broken = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            let Some(name) = file.strip_suffix(".json") else { continue };
            if name.starts_with('.') {
                continue; // a temp file left by a crash mid-write
            }
            let parsed = fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<VmRecord>(&b).map_err(|e| e.to_string()))
                .and_then(|r| if r.name() == name { Ok(r) } else { Err(format!("record names VM {:?}", r.name())) });
            match parsed {
                Ok(r) => good.push(r),
                Err(error) => broken.push(BrokenRecord { path: path.clone(), name: name.to_string(), error }),
            }
        }
        good.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        Ok((good, broken))
    }

    /// Writes `record` atomically, stamping `updated_at`.
    ///
    /// # Errors
    /// I/O errors; the previous record is then intact.
    pub fn save(&self, record: &mut VmRecord) -> io::Result<()> {
        record.updated_at = crate::api::now_rfc3339();
        let data = serde_json::to_vec_pretty(record).map_err(io::Error::other)?;
        atomic::write_atomic(&self.path(record.name()), &data)
    }

    /// Removes the record of `name`.
    ///
    /// # Errors
    /// I/O errors other than "absent".
    pub fn remove(&self, name: &str) -> io::Result<()> {
        atomic::remove_durable(&self.path(name)).map(|_| ())
    }
}

#[cfg(test)]
mod compat;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::tests::spec;

    #[test]
    fn save_load_remove() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        let mut b = VmRecord::new(spec("b"));
        let mut a = VmRecord::new(spec("a"));
        a.process = Some(ProcessIdentity { pid: 42, start_ticks: 7 });
        s.save(&mut b).unwrap();
        s.save(&mut a).unwrap();
        let (recs, broken) = s.load_all().unwrap();
        assert!(broken.is_empty());
        assert_eq!(recs, vec![a, b]);
        s.remove("a").unwrap();
        assert_eq!(s.load_all().unwrap().0.len(), 1);
    }

    #[test]
    fn unreadable_records_are_reported_and_kept() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(d.path()).unwrap();
        let vms = d.path().join("vms");
        fs::write(vms.join("bad.json"), b"{not json").unwrap();
        let mut other = VmRecord::new(spec("other"));
        s.save(&mut other).unwrap();
        fs::copy(vms.join("other.json"), vms.join("renamed.json")).unwrap();
        fs::write(vms.join(".x.json.tmp.1"), b"partial").unwrap();
        let (recs, broken) = s.load_all().unwrap();
        assert_eq!(recs.len(), 1);
        let mut names: Vec<_> = broken.iter().map(|b| b.name.as_str()).collect();
        names.sort();
        assert_eq!(names, vec!["bad", "renamed"]);
        assert!(vms.join("bad.json").exists(), "a broken record is never deleted");
    }

    #[test]
    fn a_record_without_instance_id_adopts_the_one_its_guest_last_booted_with() {
        let d = tempfile::tempdir().unwrap();
        let no_seed = d.path().join("none.img");
        // As an older vmhost wrote it: no instance_id member.
        let mut rec = VmRecord::new(spec("a"));
        let text = serde_json::to_string(&rec).unwrap();
        assert!(!text.contains("instance_id"), "{text}");
        let mut old: VmRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(old.instance_id, None);
        // Stopped since (desired state stopped): the digest of the spec as it was launched.
        old.spec.state = crate::api::DesiredState::Stopped;
        assert!(old.adopt_instance_id(&no_seed));
        assert_eq!(old.instance_id.as_deref(), Some(crate::seed::legacy_instance_id(&spec("a")).as_str()));
        assert!(!old.adopt_instance_id(&no_seed), "once");
        // A change recorded without a restart: the running spec is what the guest booted.
        let mut pending = rec.clone();
        pending.spec.memory_mib = 4096;
        pending.running_spec = Some(spec("a"));
        assert!(pending.adopt_instance_id(&no_seed));
        assert_eq!(pending.instance_id, Some(crate::seed::legacy_instance_id(&spec("a"))));
        // A recorded id is kept as it is, and saved.
        rec.instance_id = Some("vmhost-a-00ff".into());
        assert!(!rec.adopt_instance_id(&no_seed));
        let s = Store::open(d.path()).unwrap();
        s.save(&mut rec).unwrap();
        assert_eq!(s.load_all().unwrap().0[0].instance_id.as_deref(), Some("vmhost-a-00ff"));
    }
}
