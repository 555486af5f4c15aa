//! The operation in progress on a VM, as its record remembers it: what that operation must
//! finish or undo if vmhostd dies before it ends.
//!
//! A record holds at most one ([`VmRecord::intent`]): operations on a VM are serialised by its
//! busy flag, so one Option says everything a crash can leave. Each intent is written before the
//! operation touches the host and ended when the operation completes or has been undone, always
//! through the methods here, in this order:
//!
//! 1. started: [`VmRecord::track_new_disk`], [`VmRecord::track_reclaimed_disk`],
//!    [`VmRecord::start_root_import`] (each one also extends the disk work begun before it), or
//!    [`VmRecord::start_revert`];
//! 2. read by an undo, by recovery and by the checks of the next operation:
//!    [`VmRecord::disk_work`], [`VmRecord::reverting`], [`VmRecord::importing_root`];
//! 3. ended: [`VmRecord::end_disk_tracking`], [`VmRecord::end_root_import`] (or
//!    [`VmRecord::drop_root_disk`] when the disk went back), [`VmRecord::end_revert`].
//!
//! On disk an intent is still today's loose fields (`new_disks`, `reclaimed_disks`,
//! `root_disk.importing`, `reverting`): [`super::file`] converts, so records written by every
//! release load and are written back as they were.

use super::{RootDisk, VmRecord};

/// What an unfinished operation leaves for whoever comes next: the undo of that operation,
/// recovery after a restart, or the next operation on the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Intent {
    /// A create, a replace, a start or a hot-plug is making the VM's disks. Begun by the first
    /// disk it names, ended when that operation succeeds or is undone. After a crash, recovery
    /// undoes it for a create or start that never ran ([`DiskWork`] says exactly what), settles
    /// it against what a re-adopted QEMU has (a hot-plug), and ends it when the VM's QEMU ran
    /// and is gone (the disks are the VM's: its guest may have written them).
    Disks(DiskWork),
    /// `vm.revert` began replacing the VM's disks and has not finished: the disks may be part
    /// old, part reverted, so the VM is not started, replaced, reconfigured, snapshotted or
    /// backed up, nor that snapshot deleted, until a revert completes. Begun by
    /// [`VmRecord::start_revert`] once every copy is checked, ended by [`VmRecord::end_revert`]
    /// once every disk is replaced. Recovery leaves it on purpose: only the operator's next
    /// revert knows which snapshot the disks should be.
    Revert {
        /// The snapshot whose disks are being put back.
        snapshot: String,
        /// The root disk's import was never completed nor given back when the revert began (a
        /// failed create whose give-back failed): the file is still the operator's, so a
        /// destroy gives it back, and the disk work comes back when the revert ends.
        root_import: bool,
    },
}

/// The disks an operation in progress made, took back or moved in: exactly what its undo
/// deletes, returns or gives back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskWork {
    /// Data disks it made, each named before its file is: the undo deletes exactly these.
    pub new: Vec<String>,
    /// Data disks it took back from `kept-disks`, each named before it is moved: the undo
    /// moves exactly these back.
    pub reclaimed: Vec<String>,
    /// The root disk ([`VmRecord::root_disk`]) was moved in from the import directory by this
    /// operation, named before the move: the undo (or a destroy) moves it back there.
    pub importing_root: bool,
}

impl DiskWork {
    /// Whether it names no data disk.
    fn no_data_disks(&self) -> bool {
        self.new.is_empty() && self.reclaimed.is_empty()
    }
}

/// Why an intent could not be recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntentError {
    /// Disk work was asked to begin while a revert is unfinished. Every operation that makes
    /// disks refuses such a VM first (4090), so this is a bug; the revert is kept.
    #[error("a revert to snapshot {0:?} is unfinished: no disk work may begin")]
    Reverting(String),
}

impl VmRecord {
    /// The disk work of the operation in progress, if that is what it is.
    pub fn disk_work(&self) -> Option<&DiskWork> {
        match &self.intent {
            Some(Intent::Disks(w)) => Some(w),
            _ => None,
        }
    }

    /// The snapshot an unfinished revert is putting back.
    pub fn reverting(&self) -> Option<&str> {
        match &self.intent {
            Some(Intent::Revert { snapshot, .. }) => Some(snapshot),
            _ => None,
        }
    }

    /// Whether the root disk's import is unfinished: undone (or destroyed) it goes back to the
    /// import directory instead of being deleted.
    pub fn importing_root(&self) -> bool {
        match &self.intent {
            Some(Intent::Disks(w)) => w.importing_root,
            Some(Intent::Revert { root_import, .. }) => *root_import,
            None => false,
        }
    }

    /// Whether data disks are tracked (made or taken back by an operation not ended).
    pub fn tracks_data_disks(&self) -> bool {
        self.disk_work().is_some_and(|w| !w.no_data_disks())
    }

    /// The disk work in progress, begun here when there is none.
    fn disk_work_mut(&mut self) -> Result<&mut DiskWork, IntentError> {
        let intent = self.intent.get_or_insert_with(|| Intent::Disks(DiskWork::default()));
        match intent {
            Intent::Disks(w) => Ok(w),
            Intent::Revert { snapshot, .. } => Err(IntentError::Reverting(snapshot.clone())),
        }
    }

    /// Names data disk `disk` as made by the operation in progress, before its file is made.
    ///
    /// # Errors
    /// [`IntentError::Reverting`]: nothing is recorded.
    pub fn track_new_disk(&mut self, disk: &str) -> Result<(), IntentError> {
        self.disk_work_mut()?.new.push(disk.to_string());
        Ok(())
    }

    /// Names data disk `disk` as taken back from `kept-disks` by the operation in progress,
    /// before it is moved.
    ///
    /// # Errors
    /// [`IntentError::Reverting`]: nothing is recorded.
    pub fn track_reclaimed_disk(&mut self, disk: &str) -> Result<(), IntentError> {
        self.disk_work_mut()?.reclaimed.push(disk.to_string());
        Ok(())
    }

    /// Names `root` as the VM's root disk, moved in by the operation in progress, before the
    /// move.
    ///
    /// # Errors
    /// [`IntentError::Reverting`]: nothing is recorded.
    pub fn start_root_import(&mut self, root: RootDisk) -> Result<(), IntentError> {
        self.disk_work_mut()?.importing_root = true;
        self.root_disk = Some(root);
        Ok(())
    }

    /// The data disks tracked are the VM's: the operation that made them has ended (made or
    /// undone), or it was cut short while a QEMU may have had them. Returns whether any were
    /// tracked. An unfinished root import stays.
    pub fn end_disk_tracking(&mut self) -> bool {
        let Some(Intent::Disks(w)) = &mut self.intent else { return false };
        let had = !w.no_data_disks();
        w.new.clear();
        w.reclaimed.clear();
        self.tidy();
        had
    }

    /// The operation that moved the root disk in has succeeded: it is the VM's. Returns whether
    /// an import was unfinished.
    pub fn end_root_import(&mut self) -> bool {
        let had = self.importing_root();
        match &mut self.intent {
            Some(Intent::Disks(w)) => w.importing_root = false,
            Some(Intent::Revert { root_import, .. }) => *root_import = false,
            None => {}
        }
        self.tidy();
        had
    }

    /// The root disk is no longer the VM's (given back or deleted): the record stops naming it,
    /// and an import of it is over.
    pub fn drop_root_disk(&mut self) {
        self.end_root_import();
        self.root_disk = None;
    }

    /// A revert to `snapshot` begins replacing the VM's disks. Data disks still tracked are
    /// leftovers of an operation a QEMU's end cut short (every operation that tracks disks
    /// ends its tracking or is refused while one runs): they are the VM's now, as the next
    /// start would make them. An unfinished root import is kept.
    pub fn start_revert(&mut self, snapshot: &str) {
        if self.tracks_data_disks() {
            tracing::info!(vm = self.name(), "data disks still tracked from an earlier operation are the VM's");
        }
        let root_import = self.importing_root();
        self.intent = Some(Intent::Revert { snapshot: snapshot.to_string(), root_import });
    }

    /// The revert has replaced every disk. An unfinished root import it kept comes back as the
    /// disk work it was.
    pub fn end_revert(&mut self) {
        if let Some(Intent::Revert { root_import, .. }) = self.intent {
            self.intent = root_import.then(|| Intent::Disks(DiskWork { importing_root: true, ..DiskWork::default() }));
        }
    }

    /// No intent rather than an empty one: a record with nothing in progress says so.
    fn tidy(&mut self) {
        if matches!(&self.intent, Some(Intent::Disks(w)) if w.no_data_disks() && !w.importing_root) {
            self.intent = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::tests::spec;

    fn root() -> RootDisk {
        RootDisk {
            format: crate::api::DiskFormat::Qcow2,
            imported_bytes: 1 << 30,
            source: "/var/lib/vmhost/import/d.qcow2".into(),
            source_mode: 0o640,
        }
    }

    #[test]
    fn disk_work_begins_with_its_first_disk_and_ends_when_nothing_is_left() {
        let mut r = VmRecord::new(spec("v"));
        assert_eq!(r.intent, None);
        r.start_root_import(root()).unwrap();
        r.track_reclaimed_disk("kept").unwrap();
        r.track_new_disk("data").unwrap();
        let work = DiskWork { new: vec!["data".into()], reclaimed: vec!["kept".into()], importing_root: true };
        assert_eq!(r.disk_work(), Some(&work));
        assert!(r.tracks_data_disks() && r.importing_root());
        // The data disks end first (make_data_disks ends leftovers of a start that imports).
        assert!(r.end_disk_tracking());
        assert!(!r.end_disk_tracking());
        assert_eq!(r.intent, Some(Intent::Disks(DiskWork { importing_root: true, ..DiskWork::default() })));
        assert!(r.end_root_import());
        assert_eq!(r.intent, None);
        assert!(r.root_disk.is_some(), "an import that succeeded leaves the disk the VM's");
        r.start_root_import(root()).unwrap();
        r.drop_root_disk();
        assert_eq!((r.intent, r.root_disk), (None, None));
    }

    #[test]
    fn a_revert_takes_leftover_disks_as_the_vms_and_keeps_an_unfinished_import() {
        let mut r = VmRecord::new(spec("v"));
        r.track_new_disk("extra").unwrap();
        r.start_revert("s1");
        assert_eq!(r.intent, Some(Intent::Revert { snapshot: "s1".into(), root_import: false }));
        assert_eq!(r.track_new_disk("x"), Err(IntentError::Reverting("s1".into())));
        assert_eq!(r.start_root_import(root()), Err(IntentError::Reverting("s1".into())));
        assert_eq!(r.reverting(), Some("s1"), "a refused disk step leaves the revert");
        r.end_revert();
        assert_eq!(r.intent, None);

        r.start_root_import(root()).unwrap();
        r.start_revert("s1");
        r.start_revert("s2"); // run again, to another snapshot
        assert_eq!((r.reverting(), r.importing_root()), (Some("s2"), true));
        r.end_revert();
        assert_eq!(r.intent, Some(Intent::Disks(DiskWork { importing_root: true, ..DiskWork::default() })));
    }
}
