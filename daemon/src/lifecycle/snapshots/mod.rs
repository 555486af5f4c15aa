//! `vm.snapshot`, `vm.snapshots`, `vm.revert`, `vm.snapshot_delete` (docs/snapshots.md): a VM's
//! disks kept as they were, and put back.
//!
//! A snapshot is a directory `STATE/snapshots/VM/NAME/` with `snapshot.json` (the spec and the
//! cloud-init instance id then, and per disk how it is kept) and the copies it holds. A qcow2
//! disk is kept inside its own file as a qcow2 internal snapshot tagged `vmhost-NAME-ID`
//! ([`crate::disk::internal_snapshots`]): constant time whatever the disk's size. A raw disk has
//! no internal snapshots and is copied whole (sparse), as is a UEFI VM's variables store. Data
//! disks with `snapshot: false` are left out ([`kept_disks`]). Of a running VM, its own QEMU
//! takes every internal snapshot and starts every copy in one QMP transaction, with the guest's
//! file systems frozen for that instant when its agent can ([`super::live_copy`]); of a stopped
//! VM, an offline QEMU session tags the qcow2 files and the rest is read.
//!
//! The modules, in the order an operation's steps go: [`take`] (the record written and synced
//! into `.NAME.partial` before any tag exists, the tags and copies, the copies sealed, the
//! directory renamed), [`revert`] (stopped VM only: copies taken out and checked, the intent
//! recorded, the internal snapshots loaded, the copies renamed over the disks, the record
//! completed), [`delete`] (the directory renamed `.NAME.deleting` first, the tags deleted, the
//! directory removed), [`recover`] (at start and before each snapshot operation: what a crash
//! left of the first and last, finished).
//!
//! A snapshot, a revert and a delete are operations on the VM ([`super::op::VmOp`], begun with
//! [`Manager::begin_op`]); none records a failure on the VM.

mod delete;
mod recover;
mod revert;
mod take;

pub(crate) use delete::snapshot_delete;
pub(super) use recover::{recover_at_start, recover_vm};
pub(crate) use revert::revert;
pub(crate) use take::snapshot;

use super::copies::VmDisk;
use super::errors::FileError;
use super::held::HeldVm;
use super::Manager;
use crate::api::backup::{BackupDisk, DiskRole};
use crate::api::disks::DiskFormat;
use crate::api::snapshots::Snapshot;
use crate::api::{ApiError, Code, VmSpec};
use crate::state::VmRecord;
use std::path::{Path, PathBuf};

/// Most snapshots a VM keeps.
pub const MAX_SNAPSHOTS: usize = 16;

/// The API step of this module's failures.
const STEP: &str = "snapshot";

/// The copy of a UEFI VM's variables store in a snapshot.
const VARS_COPY: &str = "uefi-vars.fd";

/// The scratch image a revert uses, in the VM's snapshots directory (a dot name: never a
/// snapshot).
const REVERT_AUX: &str = ".revert-aux";

fn failed(message: String) -> ApiError {
    super::provisioning(STEP, message)
}

/// True for a snapshot's name (and a name a move may give a snapshot's directory).
pub(in crate::lifecycle) fn is_snapshot_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

fn check_name(name: &str) -> Result<(), ApiError> {
    if is_snapshot_name(name) {
        Ok(())
    } else {
        Err(ApiError::invalid("snapshot", format!("{name:?}: 1-64 of A-Z a-z 0-9 . _ -, not starting with a dot")))
    }
}

/// A disk's copy in a snapshot: `root.FORMAT` or `NAME.FORMAT`, in the disk's own format (an
/// image VM's overlay copied as an overlay).
fn snapshot_entry(disk: &VmDisk) -> BackupDisk {
    disk.entry(format!("{}.{}", disk.name, disk.format.as_str()), disk.format)
}

/// The tag of snapshot `name` with id `id` in its disks' files.
fn tag_of(name: &str, id: &str) -> String {
    format!("vmhost-{name}-{id}")
}

/// A new snapshot id: 8 random hex digits.
fn new_id() -> Result<String, ApiError> {
    let mut bytes = [0u8; 4];
    getrandom::fill(&mut bytes).map_err(|e| failed(format!("no random bytes for the snapshot's id: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The data disks of `spec` with `snapshot: false`.
fn excluded_of(spec: &VmSpec) -> Vec<String> {
    spec.disks.iter().filter(|d| !d.snapshot).map(|d| d.name.clone()).collect()
}

/// How a snapshot keeps each disk (pure): the disks `excluded` names are left out (data disks
/// only), qcow2 ones are kept inside their files, the rest are copied. Returns (internal,
/// copied).
fn kept_disks<'a>(disks: &'a [VmDisk], excluded: &[String]) -> (Vec<&'a VmDisk>, Vec<&'a VmDisk>) {
    let kept = disks.iter().filter(|d| !(d.role == DiskRole::Data && excluded.contains(&d.name)));
    kept.partition(|d| d.format == DiskFormat::Qcow2)
}

/// The record of a VM whose disks were just put back as they were in `snapshot`: no revert
/// pending; the instance id the snapshot recorded (the root disk's guest booted with it: a
/// snapshot of an earlier root disk, taken before a replace, must not boot as a new instance),
/// the current one when it recorded none; the disks clean only when the snapshot's copy was
/// (`frozen` or `stopped`).
fn complete_revert(r: &mut VmRecord, snapshot: &Snapshot) {
    r.end_revert();
    if let Some(id) = &snapshot.instance_id {
        r.instance_id = Some(id.clone());
    }
    r.unclean_end =
        super::copies::restored_unclean(&format!("reverted to snapshot {:?}", snapshot.name), snapshot.consistency);
}

/// What must be equal for a revert: each disk's name, format and size, and the boot source;
/// the data disks `ignored` names (`snapshot: false` then or now) are not compared.
fn disks_of(spec: &VmSpec, ignored: &[String]) -> (Vec<(String, DiskFormat, u64)>, crate::api::BootSpec) {
    let mut boot = spec.boot.clone();
    boot.cmdline = None;
    let disks = spec
        .disks
        .iter()
        .filter(|d| !ignored.contains(&d.name))
        .map(|d| (d.name.clone(), d.format, d.size_gib))
        .collect();
    (disks, boot)
}

/// Deletes `tags` from the disks of VM `rec` that `internal` names (the disks it has now; a
/// disk dropped since is skipped): by its QEMU when it runs, else in an offline session bounded
/// by `within` (the operation's `timeout_s`).
///
/// # Errors
/// 4001 step `snapshot`.
async fn drop_tags(
    mgr: &Manager,
    rec: &VmRecord,
    names: &[String],
    tags: &[String],
    within: std::time::Duration,
) -> Result<(), ApiError> {
    if names.is_empty() || tags.is_empty() {
        return Ok(());
    }
    let (live, _, disks) = super::copies::copy_sources(mgr, rec, STEP).await?;
    let disks: Vec<&VmDisk> =
        disks.iter().filter(|d| d.format == DiskFormat::Qcow2 && names.contains(&d.name)).collect();
    if live {
        let mut q =
            mgr.qmp(rec.name(), std::time::Duration::from_secs(5)).await.map_err(|e| failed(format!("QMP: {e}")))?;
        for d in disks {
            crate::disk::internal_snapshots::delete_live(&mut q, &d.device, tags)
                .await
                .map_err(|e| failed(format!("deleting the internal snapshots of {}: {e}", d.name)))?;
        }
        return Ok(());
    }
    let files: Vec<PathBuf> = disks.iter().map(|d| d.file.clone()).filter(|f| f.exists()).collect();
    let fds = open_rw(&files)?;
    crate::disk::internal_snapshots::delete(&mgr.disk_tool(), fds, tags, within)
        .await
        .map_err(|e| failed(format!("deleting internal snapshots: {e}")))
}

/// Opens each file read-write for an offline session.
///
/// # Errors
/// 4001 step `snapshot`.
fn open_rw(files: &[PathBuf]) -> Result<Vec<std::os::fd::OwnedFd>, ApiError> {
    let mut fds = Vec::new();
    for f in files {
        // Never through a link: these are the VM's own files, which vmhostd made.
        let file = crate::blocking::run(|| {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(f)
        })
        .map_err(FileError::file(STEP, "open", f))?;
        fds.push(std::os::fd::OwnedFd::from(file));
    }
    Ok(fds)
}

/// Writes `snapshot` as `dir/snapshot.json`, synced with its directory.
///
/// # Errors
/// 4001 step `snapshot`.
fn write_record(dir: &Path, snapshot: &Snapshot) -> Result<(), ApiError> {
    let json = serde_json::to_vec_pretty(snapshot).map_err(|source| FileError::Encode { step: STEP.into(), source })?;
    crate::blocking::run(|| {
        crate::state::atomic::write_atomic(&dir.join(SNAPSHOT_JSON), &json)?;
        std::fs::File::open(dir)?.sync_all()
    })
    .map_err(|e| FileError::file(STEP, "write the record in", dir)(e).into())
}

/// Reads `dir/snapshot.json`; `None` when it is missing or unreadable.
fn read_record(dir: &Path) -> Option<Snapshot> {
    let bytes = std::fs::read(dir.join(SNAPSHOT_JSON)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// 4097 `not_movable`, `details.reason` `internal_snapshots`, when VM `name` has a snapshot
/// kept inside its disks: a live move copies only the disks' current state (`vm.migrate`
/// refuses before anything is made). Like the other refusals of a live move (`passthrough`,
/// `tpm`): something the VM holds, not a busy VM to retry.
///
/// # Errors
/// 4097 as above; also when a snapshot's record cannot be read (fail closed: it may hold
/// internal snapshots), naming the file.
pub(in crate::lifecycle) fn check_no_internal(mgr: &Manager, name: &str) -> Result<(), ApiError> {
    let dir = snapshots_dir(mgr, name);
    let refuse = |message: String| {
        ApiError::new(Code::NotMovable, message).details(serde_json::json!({ "reason": "internal_snapshots" }))
    };
    let held = crate::blocking::run(|| internal_holders(&dir)).map_err(|e| {
        refuse(format!(
            "VM {name:?}: {e}, so a live move cannot tell whether it holds internal snapshots: fix or delete it"
        ))
    })?;
    if held.is_empty() {
        return Ok(());
    }
    Err(refuse(format!(
        "VM {name:?} has snapshots kept inside its qcow2 disks ({}), which a live move cannot carry: move it cold \
         (vm.move) or delete them",
        held.join(", ")
    )))
}

/// The names of the snapshots in `dir` (`STATE/snapshots/VM`) whose record holds an internal
/// snapshot, sorted; none when `dir` does not exist. Unlike [`list_snapshots`], a record that
/// cannot be read or parsed is an error naming it: a caller deciding from it must not pass.
///
/// # Errors
/// The directory or a `snapshot.json` cannot be read or is not a snapshot record.
fn internal_holders(dir: &Path) -> Result<Vec<String>, String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", dir.display())),
    };
    let mut held = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        let Some(snap) = entry.file_name().to_str().filter(|n| is_snapshot_name(n)).map(str::to_string) else {
            continue;
        };
        let file = entry.path().join(SNAPSHOT_JSON);
        let bytes = std::fs::read(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        let record: Snapshot =
            serde_json::from_slice(&bytes).map_err(|e| format!("cannot parse {}: {e}", file.display()))?;
        if !record.internal.is_empty() {
            held.push(snap);
        }
    }
    held.sort();
    Ok(held)
}

/// `STATE/snapshots/VM`.
pub(in crate::lifecycle) fn snapshots_dir(mgr: &Manager, name: &str) -> PathBuf {
    mgr.config.paths.state.join("snapshots").join(name)
}

/// The VM's snapshots, oldest first.
fn list_snapshots(mgr: &Manager, name: &str) -> Result<Vec<Snapshot>, ApiError> {
    let dir = snapshots_dir(mgr, name);
    let mut out: Vec<Snapshot> = crate::blocking::run(|| {
        let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
        entries
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(is_snapshot_name))
            .filter_map(|e| std::fs::read(e.path().join("snapshot.json")).ok())
            .filter_map(|b| serde_json::from_slice::<Snapshot>(&b).ok())
            .collect()
    });
    out.sort_by(|a, b| (&a.created_at, &a.name).cmp(&(&b.created_at, &b.name)));
    Ok(out)
}

/// `vm.snapshots`: the VM's snapshots, oldest first.
///
/// # Errors
/// 4040.
pub(crate) fn snapshots(mgr: &Manager, name: &str) -> Result<Vec<Snapshot>, ApiError> {
    mgr.record(name)?;
    list_snapshots(mgr, name)
}

/// One snapshot's files as a move carries them ([`files_to_move`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::lifecycle) struct SnapshotFile {
    /// The snapshot's name.
    pub snapshot: String,
    /// The file's name in the snapshot's directory (`snapshot.json`, then each disk's copy).
    pub file: String,
    /// Where it is.
    pub path: PathBuf,
    /// Its length.
    pub bytes: u64,
    /// The bytes it occupies (allocated blocks).
    pub allocated: u64,
}

/// The name of a snapshot's record in its directory.
pub(in crate::lifecycle) const SNAPSHOT_JSON: &str = "snapshot.json";

/// Every file of every snapshot of VM `name`, oldest snapshot first, each snapshot's
/// `snapshot.json` before its copies: what a cold move sends so that the snapshots go with the
/// VM. Strict, since the source's copy (with its snapshots) is deleted once the destination
/// has them all: a snapshot directory that is not a whole snapshot (unreadable record, a copy
/// missing) refuses the move rather than being left behind. Interrupted snapshots
/// (`.NAME.partial`) are not snapshots and stay out.
///
/// # Errors
/// 4001 step `snapshot` naming the snapshot that cannot be read whole.
pub(in crate::lifecycle) fn files_to_move(mgr: &Manager, name: &str) -> Result<Vec<SnapshotFile>, ApiError> {
    use std::os::unix::fs::MetadataExt;
    let dir = snapshots_dir(mgr, name);
    crate::blocking::run(|| {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(failed(format!("{}: {e}", dir.display()))),
        };
        let mut snapshots = Vec::new();
        for e in entries.flatten() {
            let Some(snap) = e.file_name().to_str().map(str::to_string) else {
                return Err(failed(format!("{}: a snapshot whose name is not UTF-8", dir.display())));
            };
            if snap.starts_with('.') {
                continue;
            }
            let damaged = |why: String| {
                failed(format!(
                    "snapshot {snap:?} of VM {name:?} is not whole ({why}): delete it or repair it to move the VM"
                ))
            };
            let json =
                std::fs::read(e.path().join(SNAPSHOT_JSON)).map_err(|e| damaged(format!("{SNAPSHOT_JSON}: {e}")))?;
            let s: Snapshot = serde_json::from_slice(&json).map_err(|e| damaged(format!("{SNAPSHOT_JSON}: {e}")))?;
            if s.name != snap || !is_snapshot_name(&snap) {
                return Err(damaged(format!("its record names {:?}", s.name)));
            }
            let mut files = Vec::new();
            let copies = s.disks.iter().map(|d| d.file.as_str()).chain(s.uefi_vars.iter().map(|v| v.file.as_str()));
            for file in std::iter::once(SNAPSHOT_JSON).chain(copies) {
                let path = e.path().join(file);
                let m = std::fs::symlink_metadata(&path).map_err(|e| damaged(format!("{file}: {e}")))?;
                if !m.is_file() {
                    return Err(damaged(format!("{file} is not a file")));
                }
                let allocated = m.blocks().saturating_mul(512).min(m.len());
                files.push(SnapshotFile {
                    snapshot: snap.clone(),
                    file: file.to_string(),
                    path,
                    bytes: m.len(),
                    allocated,
                });
            }
            snapshots.push(((s.created_at, snap.clone()), files));
        }
        snapshots.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(snapshots.into_iter().flat_map(|(_, f)| f).collect())
    })
}

/// `STATE/snapshots/.incoming-VM`: where a cold move's snapshots arrive, each whole snapshot
/// renamed in from its `.NAME.partial`, and renamed as a whole to [`snapshots_dir`] after the
/// commit point. Only the move of VM `name` writes it (one expectation per name), so a give-up
/// removes it whole. Not a VM's directory: VM names never start with a dot.
pub(in crate::lifecycle) fn incoming_dir(mgr: &Manager, name: &str) -> PathBuf {
    mgr.config.paths.state.join("snapshots").join(format!(".incoming-{name}"))
}

/// 4090 when a revert of VM `rec` was interrupted: its disks may be part reverted.
pub(super) fn check_not_reverting(rec: &crate::state::VmRecord) -> Result<(), ApiError> {
    match rec.reverting() {
        Some(s) => Err(ApiError::new(
            Code::Busy,
            format!("a revert of VM {:?} to snapshot {s:?} was interrupted: run vm.revert again", rec.spec.name),
        )
        .field("name")),
        None => Ok(()),
    }
}

impl HeldVm {
    /// Removes every snapshot of the VM: its destroy's, with its data disks
    /// ([`HeldVm::dispose_data_disks`]).
    ///
    /// # Errors
    /// 4001 when the directory cannot be removed.
    pub(super) fn dispose_snapshots(&self) -> Result<(), ApiError> {
        let dir = snapshots_dir(self.mgr(), self.name());
        crate::blocking::run(|| match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        })
        .map_err(|e| FileError::file(STEP, "delete the snapshots in", &dir)(e).into())
    }
}

#[cfg(test)]
pub(in crate::lifecycle) mod tests {
    use super::*;
    use crate::api::snapshots::Consistency;

    #[test]
    fn snapshot_names_are_plain() {
        for ok in ["s1", "before-upgrade", "2026.12.04_a"] {
            assert!(is_snapshot_name(ok), "{ok}");
        }
        for bad in ["", ".x", "a/b", "a b", &"x".repeat(65), "..", "ü"] {
            assert!(!is_snapshot_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_live_move_check_names_internal_holders_and_fails_closed_on_an_unreadable_record() {
        use crate::api::snapshots::{InternalDisk, SnapshotKind};
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("vm");
        assert_eq!(internal_holders(&dir), Ok(Vec::new()), "no snapshots directory");
        let put = |name: &str, snap: &Snapshot| {
            std::fs::create_dir_all(dir.join(name)).unwrap();
            std::fs::write(dir.join(name).join(SNAPSHOT_JSON), serde_json::to_vec(snap).unwrap()).unwrap();
        };
        put("copy", &snapshot(None, None));
        let mut inside = snapshot(None, None);
        inside.internal.push(InternalDisk {
            role: DiskRole::Root,
            name: "root".into(),
            kind: SnapshotKind::Internal,
            tag: "vmhost-b-1".into(),
        });
        put("B", &inside);
        put("A", &inside);
        // A snapshot being taken (dot-named) is not one yet.
        std::fs::create_dir_all(dir.join(".C.partial")).unwrap();
        assert_eq!(internal_holders(&dir), Ok(vec!["A".to_string(), "B".to_string()]));
        // A record that cannot be read may hold internal snapshots: an error naming it.
        std::fs::write(dir.join("copy").join(SNAPSHOT_JSON), b"{").unwrap();
        let e = internal_holders(&dir).unwrap_err();
        assert!(e.contains("cannot parse") && e.contains("copy/snapshot.json"), "{e}");
        std::fs::remove_file(dir.join("copy").join(SNAPSHOT_JSON)).unwrap();
        let e = internal_holders(&dir).unwrap_err();
        assert!(e.contains("cannot read") && e.contains("copy/snapshot.json"), "{e}");
    }

    pub(in crate::lifecycle) fn snapshot(instance_id: Option<&str>, consistency: Option<Consistency>) -> Snapshot {
        Snapshot {
            name: "s1".into(),
            created_at: "2026-12-04T14:22:31Z".into(),
            live: false,
            consistency,
            reason: None,
            frozen: Vec::new(),
            skipped: Vec::new(),
            instance_id: instance_id.map(str::to_string),
            spec: crate::validate::tests::spec("v"),
            disks: Vec::new(),
            id: None,
            internal: Vec::new(),
            excluded: Vec::new(),
            uefi_vars: None,
            tpm: None,
        }
    }

    #[test]
    fn a_revert_puts_back_the_instance_id_the_snapshots_root_disk_booted_with() {
        // Taken under instance X; a replace (A -> B) and another (B -> A) made Z since.
        let mut rec = VmRecord::new(crate::validate::tests::spec("v"));
        rec.instance_id = Some("vmhost-v-z".into());
        rec.start_revert("s1");
        complete_revert(&mut rec, &snapshot(Some("vmhost-v-x"), Some(Consistency::Stopped)));
        assert_eq!((rec.instance_id.as_deref(), rec.reverting()), (Some("vmhost-v-x"), None));
        assert_eq!(rec.unclean_end, None, "a stopped copy is clean");
        // A snapshot from before vmhostd recorded the id keeps the current one.
        complete_revert(&mut rec, &snapshot(None, Some(Consistency::Frozen)));
        assert_eq!(rec.instance_id.as_deref(), Some("vmhost-v-x"));
        // Snapshot JSON without the member still reads; with it, it reads back.
        let mut old = serde_json::to_value(snapshot(None, None)).unwrap_or_default();
        assert!(old.get("instance_id").is_none(), "{old}");
        old["instance_id"] = serde_json::json!("vmhost-v-x");
        let read: Snapshot = serde_json::from_value(old).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(read.instance_id.as_deref(), Some("vmhost-v-x"));
    }

    #[test]
    fn a_revert_to_a_crash_copy_leaves_the_disks_unclean() {
        let mut rec = VmRecord::new(crate::validate::tests::spec("v"));
        complete_revert(&mut rec, &snapshot(None, Some(Consistency::Crash)));
        assert!(rec.unclean_end.as_deref().is_some_and(|r| r.contains("crash-consistent")), "{rec:?}");
        complete_revert(&mut rec, &snapshot(None, None));
        assert!(rec.unclean_end.as_deref().is_some_and(|r| r.contains("does not record")), "{rec:?}");
        complete_revert(&mut rec, &snapshot(None, Some(Consistency::Frozen)));
        assert_eq!(rec.unclean_end, None);
    }

    #[test]
    fn a_revert_needs_the_same_disks_but_not_the_same_kernel_arguments() {
        let mut spec = crate::validate::tests::spec("v");
        spec.disks = vec![crate::validate::tests::data_disk("nsm", 2, DiskFormat::Raw)];
        let mut other = spec.clone();
        other.boot.cmdline = Some("quiet".into());
        other.memory_mib += 64;
        assert_eq!(disks_of(&spec, &[]), disks_of(&other, &[]));
        other.disks[0].size_gib = 3;
        assert_ne!(disks_of(&spec, &[]), disks_of(&other, &[]), "grown since");
        let mut other = spec.clone();
        other.disks[0].format = DiskFormat::Qcow2;
        assert_ne!(disks_of(&spec, &[]), disks_of(&other, &[]));
        let mut other = spec.clone();
        other.disks.clear();
        assert_ne!(disks_of(&spec, &[]), disks_of(&other, &[]));
        // A disk left out of snapshots (then or now) is not compared.
        assert_eq!(disks_of(&spec, &["nsm".to_string()]), disks_of(&other, &["nsm".to_string()]));
    }

    #[test]
    fn qcow2_disks_are_tagged_raw_ones_copied_and_excluded_ones_left_out() {
        let disk = |role, name: &str, format| VmDisk {
            role,
            name: name.into(),
            format,
            file: PathBuf::from(name),
            base: None,
            device: name.into(),
        };
        let disks = vec![
            disk(DiskRole::Root, "root", DiskFormat::Qcow2),
            disk(DiskRole::Data, "nsm", DiskFormat::Raw),
            disk(DiskRole::Data, "logs", DiskFormat::Qcow2),
            disk(DiskRole::Data, "pcap", DiskFormat::Qcow2),
        ];
        let (internal, copied) = kept_disks(&disks, &["pcap".to_string(), "root".to_string()]);
        let names = |l: &[&VmDisk]| l.iter().map(|d| d.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&internal), ["root", "logs"], "the root disk is never left out");
        assert_eq!(names(&copied), ["nsm"]);
        let mut spec = crate::validate::tests::spec("v");
        spec.disks = vec![crate::validate::tests::data_disk("pcap", 1, DiskFormat::Qcow2)];
        assert!(excluded_of(&spec).is_empty());
        spec.disks[0].snapshot = false;
        assert_eq!(excluded_of(&spec), ["pcap"]);
        assert!(tag_of("s1", "0a0b0c0d") == "vmhost-s1-0a0b0c0d");
        let id = new_id().unwrap_or_default();
        assert!(id.len() == 8 && id.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
    }

    #[test]
    fn old_snapshot_records_read_as_copies_only() {
        let mut old = serde_json::to_value(snapshot(None, None)).unwrap_or_default();
        for key in ["id", "internal", "excluded", "uefi_vars"] {
            assert!(old.get(key).is_none(), "{key}: {old}");
        }
        old["disks"] = serde_json::json!([{"role": "data", "name": "logs", "file": "logs.qcow2", "format": "qcow2",
            "virtual_size": 1, "bytes": 1, "sha256": "ab"}]);
        let read: Snapshot = serde_json::from_value(old).unwrap_or_else(|e| panic!("{e}"));
        assert!(read.internal.is_empty() && read.tags().is_empty());
        assert_eq!(read.disks[0].file, "logs.qcow2");
    }
}
