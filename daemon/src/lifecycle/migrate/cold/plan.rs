//! The rules of a cold move that need no host, kept apart from the steps that act on them so
//! each is unit-tested on its own: which statuses may move ([`admit`]), which files a VM's move
//! carries and under which wire names ([`source_files`]; a TPM's state files as
//! [`tpm_wire_name`], kept at [`tpm_staged`] until the commit), where the destination puts each of
//! them ([`placement`]) and which paths it removes when it gives a move up ([`received_paths`]),
//! and what a restart does with a cold move's record on the destination
//! ([`destination_action`]; the source's is the live migration's rule,
//! `source_outcome::decide`).
//!
//! Order of use: [`admit`] first in `vm.move`; [`source_files`] to build `Hello` and the files
//! channel; [`placement`] for each file header the destination reads; [`received_paths`] when
//! the destination abandons; the two recovery decisions once per cold record at daemon start.

use crate::api::{BootSpec, DataDiskSpec, DiskFormat, VmSpec, VmStatus};
use crate::migration::HelloDisk;
use crate::qemu::argv::VmPaths;
use crate::state::migration::MigrationPhase;
use std::path::{Path, PathBuf};

/// The wire name of the boot disk's file (an image VM's overlay, a `boot.disk` VM's root disk).
pub(crate) const BOOT: &str = "boot";
/// The wire name of a UEFI VM's variables store.
pub(crate) const UEFI_VARS: &str = "uefi-vars";
/// The prefix of a data disk's wire name (`data:NAME`).
const DATA: &str = "data:";
/// The prefix of a TPM state file's wire name (`tpm:tpm2-00.permall`, a name of
/// [`crate::tpm::STATE_FILE_NAMES`]).
const TPM: &str = "tpm:";

/// The wire name of the VM's TPM state file `name` (one of [`crate::tpm::STATE_FILE_NAMES`]).
pub(crate) fn tpm_wire_name(name: &str) -> String {
    format!("{TPM}{name}")
}

/// A TPM state file's wire name as its state file name; `None` for any other name, and for a
/// name after the prefix that is not one of [`crate::tpm::STATE_FILE_NAMES`].
pub(crate) fn tpm_of(name: &str) -> Option<&str> {
    name.strip_prefix(TPM).filter(|n| crate::tpm::is_state_file_name(n))
}

/// Where the destination keeps TPM state file `name` as it arrived, until it puts it back in
/// the VM's state directory at the commit: `STATE/disks/NAME/tpm-FILE.moving` (root's; no disk
/// file ends so).
pub(crate) fn tpm_staged(paths: &VmPaths, name: &str) -> PathBuf {
    paths.disk_dir.join(format!("{}.moving", crate::tpm::copy_name(name)))
}

/// Why a VM may not be moved now ([`admit`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// 4097 reason `status`: neither stopped, nor running with `stop`.
    #[error("VM is {0:?}: only a stopped VM moves (or a running one with stop: true)")]
    Status(VmStatus),
}

/// Whether a VM in `status` (`live`: its QEMU found running) may move, and whether the move
/// stops it first (`Ok(true)`).
///
/// # Errors
/// [`Refusal::Status`] for any other status, and for a running VM without `stop`.
pub(crate) fn admit(status: VmStatus, live: bool, stop: bool) -> Result<bool, Refusal> {
    match (status, live) {
        (VmStatus::Stopped | VmStatus::Dead, false) => Ok(false),
        (VmStatus::Running, true) if stop => Ok(true),
        _ => Err(Refusal::Status(status)),
    }
}

/// One file a move sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SourceFile {
    /// Its wire name ([`BOOT`], `data:NAME`, [`UEFI_VARS`]).
    pub name: String,
    /// Where it is on the source.
    pub path: PathBuf,
    /// What `Hello` says of it.
    pub hello: HelloDisk,
}

/// The files a stopped VM's move carries, in order, from its record: the boot disk's own file
/// (an image VM's overlay, or a `boot.disk` VM's root disk of `root_format`), each data disk,
/// the UEFI variables store. Only those `exists` says are there: a disk never made yet (a VM
/// created stopped, a data disk added while stopped) is made at its first start on the
/// destination, as here. Never the seed (rebuilt at every start) nor a base image (the
/// destination has its own copy under the same name). `bytes` is the file's length, or for a
/// `boot.disk` root disk the size it was imported with (`root_bytes`), which the destination
/// records.
pub(crate) fn source_files(
    spec: &VmSpec,
    paths: &VmPaths,
    root: Option<(DiskFormat, u64)>,
    exists: impl Fn(&Path) -> Option<u64>,
) -> Vec<SourceFile> {
    let mut out = Vec::new();
    let mut push = |name: String, device: &str, path: PathBuf, format: &str, bytes: Option<u64>| {
        if let Some(len) = exists(&path) {
            let bytes = bytes.unwrap_or(len);
            out.push(SourceFile {
                name,
                path,
                hello: HelloDisk { device: device.to_string(), bytes, format: format.to_string() },
            });
        }
    };
    if spec.boot.image.is_some() {
        push(BOOT.into(), "virtio0", paths.overlay.clone(), "qcow2", None);
    } else if let Some((format, imported)) = root.filter(|_| spec.boot.disk.is_some()) {
        push(BOOT.into(), "virtio0", paths.root_disk(format), format.as_str(), Some(imported));
    }
    for d in &spec.disks {
        push(format!("{DATA}{}", d.name), &format!("data-{}", d.name), paths.data_disk(d), d.format.as_str(), None);
    }
    push(UEFI_VARS.into(), "uefi-vars", paths.uefi_vars(), "raw", None);
    out
}

/// The prefix of a snapshot file's wire name (`snapshot:SNAPSHOT/FILE`).
const SNAPSHOT: &str = "snapshot:";
/// Largest `snapshot.json` a destination reads (a spec and a few copies' entries).
const SNAPSHOT_JSON_MAX: u64 = 1 << 20;
/// Largest UEFI variables store a destination takes (OVMF's are 128-540 KiB).
const UEFI_VARS_MAX: u64 = 64 << 20;
const GIB: u64 = 1 << 30;

/// The wire name of file `file` of snapshot `snapshot`.
pub(crate) fn snapshot_wire_name(snapshot: &str, file: &str) -> String {
    format!("{SNAPSHOT}{snapshot}/{file}")
}

/// A snapshot file's wire name as (snapshot, file), both plain names (a snapshot's name rule;
/// a single path component that cannot escape or hide); `None` for any other name.
pub(crate) fn snapshot_of(name: &str) -> Option<(&str, &str)> {
    let (snapshot, file) = name.strip_prefix(SNAPSHOT)?.split_once('/')?;
    let ok = super::super::super::snapshots::is_snapshot_name(snapshot)
        && crate::validate::is_plain_file_name(file)
        && file.len() <= 128;
    ok.then_some((snapshot, file))
}

/// The most a qcow2 file of a disk of `virtual_size` bytes may hold: the disk's bytes plus its
/// metadata (tables and refcounts, well under 1/64 of the disk) and a fixed margin.
pub(crate) fn qcow2_bound(virtual_size: u64) -> u64 {
    virtual_size.saturating_add(virtual_size / 64).saturating_add(64 << 20)
}

/// What length an announced file may have ([`check_announced`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bound {
    /// Exactly this (a raw data disk: its size).
    Exactly(u64),
    /// At most this.
    AtMost(u64),
    /// What the file system has room for (an image VM's overlay, whose size follows its base
    /// image; a snapshot's copy, checked against its record when that arrives).
    Room,
}

impl Bound {
    fn admits(self, bytes: u64) -> bool {
        match self {
            Bound::Exactly(n) => bytes == n,
            Bound::AtMost(n) => bytes <= n,
            Bound::Room => true,
        }
    }
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bound::Exactly(n) => write!(f, "its spec makes it exactly {n} bytes"),
            Bound::AtMost(n) => write!(f, "its spec allows at most {n} bytes"),
            Bound::Room => write!(f, "unbounded"),
        }
    }
}

/// The length a VM file `name` of a move of `spec` may have, from the admitted spec (and for a
/// `boot.disk` root disk the virtual size `Hello` gives): a raw data disk exactly its size, a
/// qcow2 one at most [`qcow2_bound`] of it; a root disk at most its virtual size (raw) or that
/// bound (qcow2); the UEFI variables store at most [`UEFI_VARS_MAX`]; an overlay
/// [`Bound::Room`]. `None` for a name the spec has no place for.
pub(crate) fn disk_bound(spec: &VmSpec, hello: &[HelloDisk], name: &str) -> Option<Bound> {
    match name {
        BOOT if spec.boot.image.is_some() => Some(Bound::Room),
        BOOT if spec.boot.disk.is_some() => {
            let imported = hello.iter().find(|d| d.device == "virtio0")?.bytes;
            let size = imported.max(spec.boot.disk_gib.unwrap_or(0).saturating_mul(GIB));
            match boot_format(hello)? {
                DiskFormat::Raw => Some(Bound::AtMost(size)),
                DiskFormat::Qcow2 => Some(Bound::AtMost(qcow2_bound(size))),
            }
        }
        UEFI_VARS if spec.boot.firmware == crate::api::Firmware::Uefi => Some(Bound::AtMost(UEFI_VARS_MAX)),
        _ => {
            let disk = spec.disks.iter().find(|d| Some(d.name.as_str()) == name.strip_prefix(DATA))?;
            let size = disk.size_gib.saturating_mul(GIB);
            match disk.format {
                DiskFormat::Raw => Some(Bound::Exactly(size)),
                DiskFormat::Qcow2 => Some(Bound::AtMost(qcow2_bound(size))),
            }
        }
    }
}

/// Why a cold move's announcement ([`crate::migration::ControlMsg::Announce`]) or a received
/// snapshot record is refused before (or instead of) being written. 2001 on `files`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AnnounceError {
    /// A name the admitted spec has no place for (nor a snapshot file's name).
    #[error("the source announces a file {0:?} this VM has no place for")]
    Unknown(String),
    /// The same name twice.
    #[error("the source announces {0:?} twice")]
    Twice(String),
    /// The disk files announced are not the disks `Hello` names.
    #[error("the source announces {files} disk files for the {disks} disks its hello names")]
    Disks {
        /// Disk files announced.
        files: usize,
        /// Disks in `Hello`.
        disks: usize,
    },
    /// A length the spec (or the snapshot's record) does not allow.
    #[error("{name}: {bytes} bytes, but {bound}")]
    Size {
        /// The wire name.
        name: String,
        /// The length announced.
        bytes: u64,
        /// What was allowed.
        bound: String,
    },
    /// A snapshot's files announced before (or without) its `snapshot.json`.
    #[error("snapshot {0:?}: its files must follow its snapshot.json")]
    NoRecord(String),
    /// More files than the disks and the most snapshots a VM keeps make.
    #[error("{0} files announced: more than this VM's disks and snapshots can be")]
    TooManyFiles(usize),
    /// More snapshots than a VM keeps.
    #[error("{0} snapshots: a VM keeps at most {max}", max = super::super::super::snapshots::MAX_SNAPSHOTS)]
    TooMany(usize),
    /// A received `snapshot.json` that is not the record of the snapshot it came as.
    #[error("snapshot {snapshot:?}: its snapshot.json {why}")]
    Record {
        /// The snapshot (its wire name).
        snapshot: String,
        /// What is wrong.
        why: String,
    },
}

impl From<AnnounceError> for crate::api::ApiError {
    fn from(e: AnnounceError) -> crate::api::ApiError {
        crate::api::ApiError::invalid("files", e.to_string())
    }
}

/// Bytes a move will write on the destination, for its space admission: the VM's disks (in its
/// disk directory) and the snapshots (under the state directory), each what the files occupy
/// on the source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Room {
    /// The disks'.
    pub disks: u64,
    /// The snapshots'.
    pub snapshots: u64,
}

/// Checks a cold move's announcement against the admitted `spec` and `hello` before anything
/// is written (pure): every name known and once, the disk files exactly `Hello`'s disks, each
/// length within its [`disk_bound`], TPM state files ([`tpm_of`]) only for a `tpm` VM and each
/// at most [`crate::tpm::MAX_STATE_FILE_BYTES`], each snapshot's `snapshot.json` first and at
/// most [`SNAPSHOT_JSON_MAX`], at most `MAX_SNAPSHOTS` snapshots. Returns the room to admit.
///
/// # Errors
/// [`AnnounceError`] naming the first file at fault.
pub(crate) fn check_announced(
    spec: &VmSpec,
    hello: &[HelloDisk],
    files: &[crate::migration::AnnouncedFile],
) -> Result<Room, AnnounceError> {
    use super::super::super::snapshots::MAX_SNAPSHOTS;
    // Bounded before the loop: each snapshot is its record, at most a copy per disk (the root,
    // the data disks, the variables store: Hello's disks) and the TPM's files; the VM's own TPM
    // files besides its disks; and a peer's list is read once.
    let tpm = crate::tpm::STATE_FILE_NAMES.len();
    let per_snapshot = hello.len().saturating_add(2).saturating_add(tpm);
    let most = hello.len().saturating_add(tpm).saturating_add(MAX_SNAPSHOTS.saturating_mul(per_snapshot));
    if files.len() > most {
        return Err(AnnounceError::TooManyFiles(files.len()));
    }
    let mut room = Room::default();
    let mut seen: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let mut snapshots: Vec<&str> = Vec::new();
    let mut disks = 0;
    for f in files {
        if !seen.insert(f.name.as_str()) {
            return Err(AnnounceError::Twice(f.name.clone()));
        }
        let occupies = f.allocated.min(f.bytes);
        let bound = if let Some((snapshot, file)) = snapshot_of(&f.name) {
            if file == super::super::super::snapshots::SNAPSHOT_JSON {
                if snapshots.contains(&snapshot) {
                    return Err(AnnounceError::Twice(f.name.clone()));
                }
                snapshots.push(snapshot);
            } else if !snapshots.contains(&snapshot) {
                return Err(AnnounceError::NoRecord(snapshot.to_string()));
            }
            room.snapshots = room.snapshots.saturating_add(occupies);
            if file == super::super::super::snapshots::SNAPSHOT_JSON {
                Bound::AtMost(SNAPSHOT_JSON_MAX)
            } else {
                Bound::Room
            }
        } else if let Some(_state) = tpm_of(&f.name) {
            if !spec.tpm {
                return Err(AnnounceError::Unknown(f.name.clone()));
            }
            room.disks = room.disks.saturating_add(occupies);
            Bound::AtMost(crate::tpm::MAX_STATE_FILE_BYTES)
        } else {
            let bound = disk_bound(spec, hello, &f.name).ok_or_else(|| AnnounceError::Unknown(f.name.clone()))?;
            disks += 1;
            room.disks = room.disks.saturating_add(occupies);
            bound
        };
        if !bound.admits(f.bytes) {
            return Err(AnnounceError::Size { name: f.name.clone(), bytes: f.bytes, bound: bound.to_string() });
        }
    }
    if disks != hello.len() {
        return Err(AnnounceError::Disks { files: disks, disks: hello.len() });
    }
    if snapshots.len() > MAX_SNAPSHOTS {
        return Err(AnnounceError::TooMany(snapshots.len()));
    }
    Ok(room)
}

/// A received `snapshot.json` of snapshot `snapshot` (its wire name), checked against the
/// announcement (pure): the closed [`crate::api::snapshots::Snapshot`] type, its own name the
/// wire's, each copy named as a snapshot names it (`root.FORMAT`, `DISK.FORMAT`) and announced
/// with the length the record gives, a raw copy as long as its disk, a qcow2 one within
/// [`qcow2_bound`] (when the record gives the disk's size: a live copy's), and no other file
/// announced for it. The destination names the snapshot's
/// directory and files from this record, never a path from the wire.
///
/// # Errors
/// [`AnnounceError::Record`] saying what is wrong.
pub(crate) fn check_snapshot_record(
    snapshot: &str,
    json: &[u8],
    files: &[crate::migration::AnnouncedFile],
) -> Result<crate::api::snapshots::Snapshot, AnnounceError> {
    let bad = |why: String| AnnounceError::Record { snapshot: snapshot.to_string(), why };
    let s: crate::api::snapshots::Snapshot =
        serde_json::from_slice(json).map_err(|e| bad(format!("is not a snapshot's record: {e}")))?;
    if s.name != snapshot {
        return Err(bad(format!("names the snapshot {:?}", s.name)));
    }
    let mut expected = vec![super::super::super::snapshots::SNAPSHOT_JSON.to_string()];
    for d in &s.disks {
        let named = match d.role {
            crate::api::disks::DiskRole::Root => d.name == "root",
            crate::api::disks::DiskRole::Data => crate::validate::is_valid_disk_name(&d.name),
        };
        if !named || d.file != format!("{}.{}", d.name, d.format.as_str()) {
            return Err(bad(format!("names the copy {:?} of disk {:?}", d.file, d.name)));
        }
        let wire = snapshot_wire_name(snapshot, &d.file);
        let announced = files.iter().find(|f| f.name == wire).map(|f| f.bytes);
        if announced != Some(d.bytes) {
            return Err(bad(format!("gives {} {} bytes; {announced:?} were announced", d.file, d.bytes)));
        }
        // A stopped VM's copies record no virtual size (0): the announcement and the room bound
        // them then.
        let fits = match d.format {
            _ if d.virtual_size == 0 => true,
            DiskFormat::Raw => d.bytes == d.virtual_size,
            DiskFormat::Qcow2 => d.bytes <= qcow2_bound(d.virtual_size),
        };
        if !fits {
            return Err(bad(format!("gives {} {} bytes for a disk of {}", d.file, d.bytes, d.virtual_size)));
        }
        if expected.contains(&d.file) {
            return Err(bad(format!("names {} twice", d.file)));
        }
        expected.push(d.file.clone());
    }
    if let Some(v) = &s.uefi_vars {
        // The variables store's copy: always this name, as long as the record says.
        if v.file != "uefi-vars.fd" || v.bytes > UEFI_VARS_MAX {
            return Err(bad(format!("names the variables store's copy {:?}", v.file)));
        }
        let announced = files.iter().find(|f| f.name == snapshot_wire_name(snapshot, &v.file)).map(|f| f.bytes);
        if announced != Some(v.bytes) {
            return Err(bad(format!("gives {} {} bytes; {announced:?} were announced", v.file, v.bytes)));
        }
        expected.push(v.file.clone());
    }
    for t in s.tpm.iter().flat_map(|t| &t.files) {
        // A TPM state file's copy: a state file's name, its copy named after it, small.
        if !crate::tpm::names_a_state_copy(t)
            || t.bytes > crate::tpm::MAX_STATE_FILE_BYTES
            || expected.contains(&t.file)
        {
            return Err(bad(format!("names the TPM state's copy {:?} of {:?} ({} bytes)", t.file, t.name, t.bytes)));
        }
        let announced = files.iter().find(|f| f.name == snapshot_wire_name(snapshot, &t.file)).map(|f| f.bytes);
        if announced != Some(t.bytes) {
            return Err(bad(format!("gives {} {} bytes; {announced:?} were announced", t.file, t.bytes)));
        }
        expected.push(t.file.clone());
    }
    let prefix = snapshot_wire_name(snapshot, "");
    let mut announced: Vec<&str> = files.iter().filter_map(|f| f.name.strip_prefix(prefix.as_str())).collect();
    announced.sort_unstable();
    let mut want: Vec<&str> = expected.iter().map(String::as_str).collect();
    want.sort_unstable();
    if announced != want {
        return Err(bad(format!("names the files {want:?}; {announced:?} were announced")));
    }
    Ok(s)
}

/// Where the destination writes a received file and renames it once checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placement {
    /// The file as a create would have it.
    pub target: PathBuf,
    /// Where its bytes arrive first (removed on a failure; renamed to `target` when checked).
    pub partial: PathBuf,
}

fn partial_of(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".partial");
    PathBuf::from(p)
}

/// The format `Hello` gave the boot disk (`virtio0`), for a `boot.disk` VM's root disk.
fn boot_format(hello: &[HelloDisk]) -> Option<DiskFormat> {
    match hello.iter().find(|d| d.device == "virtio0")?.format.as_str() {
        "qcow2" => Some(DiskFormat::Qcow2),
        "raw" => Some(DiskFormat::Raw),
        _ => None,
    }
}

/// Where file `name` of a move of `spec` goes on the destination (paths from the admitted spec,
/// never from the wire): an image VM's overlay where a create makes it, a `boot.disk` VM's root
/// disk where a create moves the import to, data disks and the UEFI variables store where
/// data_disks.rs and a first start put them. `None` for a name the spec has no place for.
pub(crate) fn placement(spec: &VmSpec, paths: &VmPaths, hello: &[HelloDisk], name: &str) -> Option<Placement> {
    let target = match name {
        BOOT if spec.boot.image.is_some() => paths.overlay.clone(),
        BOOT if spec.boot.disk.is_some() => paths.root_disk(boot_format(hello)?),
        UEFI_VARS if spec.boot.firmware == crate::api::Firmware::Uefi => paths.uefi_vars(),
        _ => {
            let disk = name.strip_prefix(DATA)?;
            paths.data_disk(spec.disks.iter().find(|d| d.name == disk)?)
        }
    };
    let partial = if target == paths.overlay {
        super::super::super::teardown::partial_overlay(paths)
    } else if spec.disks.iter().any(|d| paths.data_disk(d) == target) {
        let d: &DataDiskSpec = spec.disks.iter().find(|d| paths.data_disk(d) == target)?;
        paths.partial_data_disk(d)
    } else if target == paths.uefi_vars() {
        paths.partial_uefi_vars()
    } else {
        partial_of(&target)
    };
    Some(Placement { target, partial })
}

/// Every path a cold receive of `spec` may have written (both forms of a root disk, each with
/// its partial; the TPM state files as they arrived, [`tpm_staged`]): what the destination
/// removes when it gives the move up. The name was free and its disk directory cleared before
/// anything arrived, so each is this move's. (The TPM state directory, put back from those
/// before the commit, is removed with `crate::tpm::remove_state`.)
pub(crate) fn received_paths(spec: &VmSpec, paths: &VmPaths) -> Vec<PathBuf> {
    let mut out = vec![paths.overlay.clone(), super::super::super::teardown::partial_overlay(paths)];
    if spec.boot.disk.is_some() {
        for f in [DiskFormat::Qcow2, DiskFormat::Raw] {
            out.push(paths.root_disk(f));
            out.push(partial_of(&paths.root_disk(f)));
        }
    }
    for d in &spec.disks {
        out.push(paths.data_disk(d));
        out.push(paths.partial_data_disk(d));
    }
    out.push(paths.uefi_vars());
    out.push(paths.partial_uefi_vars());
    if spec.tpm {
        out.extend(crate::tpm::STATE_FILE_NAMES.iter().map(|n| tpm_staged(paths, n)));
    }
    out
}

/// The admitted spec and the source's `Hello` spec describe the same VM (`state` aside: a
/// desired state, which the orchestrator's spec gives and a stop changes).
pub(crate) fn same_vm(admitted: &VmSpec, theirs: &VmSpec) -> bool {
    let mut theirs = theirs.clone();
    theirs.state = admitted.state;
    &theirs == admitted
}

/// The root disk a destination records for a `boot.disk` VM it received: the format and the
/// imported size the source sent; `source` is where a create would have imported it from (a
/// destroy deletes a root disk whose import completed, so it is never moved back there).
pub(crate) fn boot_disk_root(
    boot: &BootSpec,
    hello: &[HelloDisk],
    import_dir: &Path,
) -> Option<crate::state::RootDisk> {
    let file = boot.disk.as_ref()?;
    let bytes = hello.iter().find(|d| d.device == "virtio0")?.bytes;
    Some(crate::state::RootDisk {
        format: boot_format(hello)?,
        imported_bytes: bytes,
        source: import_dir.join(file),
        source_mode: 0o600,
    })
}

/// What a restart does with the destination's record of a cold move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DestinationAction {
    /// Before the commit: the files received go, then the migration is abandoned as a live
    /// one is (tombstone, record removed).
    Abandon,
    /// Committed: an ordinary stopped (or since started) VM.
    Ordinary,
}

/// The destination's decision (pure): only the commit point (phase `committed`, written with
/// status `stopped`) makes the VM this host's.
pub(crate) fn destination_action(phase: Option<MigrationPhase>) -> DestinationAction {
    match phase {
        Some(MigrationPhase::Committed) => DestinationAction::Ordinary,
        _ => DestinationAction::Abandon,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn config() -> crate::config::Config {
        crate::validate::tests::config()
    }

    fn data(name: &str, format: DiskFormat) -> DataDiskSpec {
        DataDiskSpec {
            name: name.into(),
            size_gib: 1,
            format,
            preallocate: false,
            cache: Default::default(),
            aio: None,
            keep_on_destroy: false,
            snapshot: true,
        }
    }

    fn image_spec() -> VmSpec {
        let mut spec = crate::validate::tests::spec("vm-1");
        spec.boot = BootSpec { image: Some("debian.qcow2".into()), ..Default::default() };
        spec.disks = vec![data("logs", DiskFormat::Raw), data("db", DiskFormat::Qcow2)];
        spec
    }

    #[test]
    fn only_a_stopped_vm_moves_or_a_running_one_told_to_stop() {
        assert_eq!(admit(VmStatus::Stopped, false, false), Ok(false));
        assert_eq!(admit(VmStatus::Stopped, false, true), Ok(false), "nothing to stop");
        assert_eq!(admit(VmStatus::Dead, false, false), Ok(false));
        assert_eq!(admit(VmStatus::Running, true, true), Ok(true));
        assert_eq!(admit(VmStatus::Running, true, false), Err(Refusal::Status(VmStatus::Running)));
        for s in [VmStatus::Failed, VmStatus::Creating, VmStatus::Migrating, VmStatus::Incoming, VmStatus::Stopping] {
            assert!(admit(s, false, true).is_err(), "{s:?}");
        }
        // A record saying stopped while a QEMU runs is not a stopped VM.
        assert!(admit(VmStatus::Stopped, true, true).is_err());
    }

    #[test]
    fn an_image_vm_sends_its_overlay_and_existing_disks_and_each_lands_where_a_create_puts_it() {
        let cfg = config();
        let spec = image_spec();
        let paths = VmPaths::for_vm(&cfg, "vm-1");
        let sizes: BTreeMap<PathBuf, u64> =
            [(paths.overlay.clone(), 7), (paths.data_disk(&spec.disks[0]), 9)].into_iter().collect();
        let files = source_files(&spec, &paths, None, |p| sizes.get(p).copied());
        let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["boot", "data:logs"], "db was never made: not sent");
        assert_eq!(files[0].hello, HelloDisk { device: "virtio0".into(), bytes: 7, format: "qcow2".into() });
        assert_eq!(files[1].hello.device, "data-logs");
        let hello: Vec<HelloDisk> = files.iter().map(|f| f.hello.clone()).collect();
        for f in &files {
            let p = placement(&spec, &paths, &hello, &f.name).unwrap();
            assert_eq!(p.target, f.path, "{}: the same place as on the source", f.name);
            assert_ne!(p.partial, p.target);
            assert!(received_paths(&spec, &paths).contains(&p.target));
            assert!(received_paths(&spec, &paths).contains(&p.partial));
        }
        assert_eq!(placement(&spec, &paths, &hello, "data:db").unwrap().target, paths.data_disk(&spec.disks[1]));
        for unknown in ["data:nope", "uefi-vars", "../etc/passwd", "data:../x", ""] {
            assert_eq!(placement(&spec, &paths, &hello, unknown), None, "{unknown:?}");
        }
    }

    #[test]
    fn a_boot_disk_vm_sends_its_root_disk_with_its_imported_size() {
        let cfg = config();
        let mut spec = image_spec();
        spec.boot = BootSpec { disk: Some("d.qcow2".into()), disk_gib: Some(4), ..Default::default() };
        spec.boot.firmware = crate::api::Firmware::Uefi;
        let paths = VmPaths::for_vm(&cfg, "vm-1");
        let root = paths.root_disk(DiskFormat::Raw);
        let present = [root.clone(), paths.uefi_vars()];
        let files = source_files(&spec, &paths, Some((DiskFormat::Raw, 1234)), |p| {
            present.contains(&p.to_path_buf()).then_some(5)
        });
        let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["boot", "uefi-vars"]);
        assert_eq!(files[0].hello, HelloDisk { device: "virtio0".into(), bytes: 1234, format: "raw".into() });
        let hello: Vec<HelloDisk> = files.iter().map(|f| f.hello.clone()).collect();
        assert_eq!(placement(&spec, &paths, &hello, BOOT).unwrap().target, root);
        assert_eq!(placement(&spec, &paths, &hello, UEFI_VARS).unwrap().target, paths.uefi_vars());
        let r = boot_disk_root(&spec.boot, &hello, Path::new("/imp")).unwrap();
        assert_eq!((r.format, r.imported_bytes, r.source), (DiskFormat::Raw, 1234, PathBuf::from("/imp/d.qcow2")));
        // A kernel-booted VM has no boot file at all.
        let mut kernel = image_spec();
        kernel.boot = BootSpec { kernel: Some("k".into()), ..Default::default() };
        let everything = |_: &Path| Some(1);
        assert!(source_files(&kernel, &paths, None, everything).iter().all(|f| f.name != BOOT));
        assert_eq!(placement(&kernel, &paths, &hello, BOOT), None);
    }

    #[test]
    fn the_state_alone_may_differ_between_the_admitted_spec_and_hello() {
        let a = image_spec();
        let mut b = a.clone();
        b.state = crate::api::DesiredState::Stopped;
        assert!(same_vm(&a, &b));
        b.memory_mib += 1;
        assert!(!same_vm(&a, &b));
    }

    /// What the source of [`image_spec`]'s VM says of its disks.
    fn image_hello() -> Vec<HelloDisk> {
        vec![
            HelloDisk { device: "virtio0".into(), bytes: 5 << 20, format: "qcow2".into() },
            HelloDisk { device: "data-logs".into(), bytes: GIB, format: "raw".into() },
            HelloDisk { device: "data-db".into(), bytes: 7 << 20, format: "qcow2".into() },
        ]
    }

    fn file(name: &str, bytes: u64) -> crate::migration::AnnouncedFile {
        crate::migration::AnnouncedFile { name: name.into(), bytes, allocated: bytes / 2 }
    }

    #[test]
    fn snapshot_wire_names_are_plain_names_or_nothing() {
        assert_eq!(snapshot_wire_name("s1", "snapshot.json"), "snapshot:s1/snapshot.json");
        assert_eq!(snapshot_of("snapshot:s1/snapshot.json"), Some(("s1", "snapshot.json")));
        assert_eq!(snapshot_of("snapshot:before-up.1/data.raw"), Some(("before-up.1", "data.raw")));
        for bad in [
            "snapshot:../x/snapshot.json",
            "snapshot:s1/../../etc/passwd",
            "snapshot:s1/a/b",
            "snapshot:.s1.partial/snapshot.json",
            "snapshot:s1/.hidden",
            "snapshot:s1/",
            "snapshot:/snapshot.json",
            "snapshot:s1",
            "data:x",
            "boot",
        ] {
            assert_eq!(snapshot_of(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn announced_files_are_checked_against_the_spec_before_anything_is_written() {
        let spec = image_spec(); // raw data disk logs 1 GiB, qcow2 db 1 GiB, an image overlay
        let hello = image_hello();
        let files = vec![
            file("boot", 5 << 20),
            file("data:logs", GIB),
            file("data:db", 7 << 20),
            file("snapshot:s1/snapshot.json", 2000),
            file("snapshot:s1/logs.raw", GIB),
            file("snapshot:s2/snapshot.json", 2000),
        ];
        let room = check_announced(&spec, &hello, &files).expect("a whole announcement");
        assert_eq!(room, Room { disks: (5 << 20) / 2 + GIB / 2 + (7 << 20) / 2, snapshots: 1000 + GIB / 2 + 1000 });
        // allocated is never counted above the length
        let mut more = files.clone();
        more[0].allocated = u64::MAX;
        assert_eq!(check_announced(&spec, &hello, &more).expect("ok").disks, (5 << 20) + GIB / 2 + (7 << 20) / 2);

        let refused = |f: &[crate::migration::AnnouncedFile]| check_announced(&spec, &hello, f).unwrap_err();
        let mut raw_size = files.clone();
        raw_size[1].bytes = GIB + 1;
        assert!(matches!(refused(&raw_size), AnnounceError::Size { name, .. } if name == "data:logs"));
        raw_size[1].bytes = GIB - 4096;
        assert!(matches!(refused(&raw_size), AnnounceError::Size { .. }), "a raw disk is exactly its size");
        let mut qcow = files.clone();
        qcow[2].bytes = qcow2_bound(GIB) + 1;
        assert!(matches!(refused(&qcow), AnnounceError::Size { name, .. } if name == "data:db"));
        let mut unknown = files.clone();
        unknown.push(file("data:../../etc/shadow", 1));
        assert_eq!(refused(&unknown), AnnounceError::Unknown("data:../../etc/shadow".into()));
        let mut twice = files.clone();
        twice.push(file("data:logs", GIB));
        assert_eq!(refused(&twice), AnnounceError::Twice("data:logs".into()));
        let mut missing = files.clone();
        missing.remove(2);
        assert_eq!(refused(&missing), AnnounceError::Disks { files: 2, disks: 3 });
        let mut no_record = files.clone();
        no_record.swap(3, 4);
        assert_eq!(refused(&no_record), AnnounceError::NoRecord("s1".into()));
        let mut big_record = files.clone();
        big_record[3].bytes = SNAPSHOT_JSON_MAX + 1;
        assert!(matches!(refused(&big_record), AnnounceError::Size { .. }));
        let mut many = files.clone();
        for i in 0..super::super::super::super::snapshots::MAX_SNAPSHOTS {
            many.push(file(&format!("snapshot:n{i}/snapshot.json"), 10));
        }
        assert!(matches!(refused(&many), AnnounceError::TooMany(_)));
        let flood: Vec<_> = (0..100_000).map(|i| file(&format!("snapshot:f{i}/snapshot.json"), 10)).collect();
        assert_eq!(refused(&flood), AnnounceError::TooManyFiles(100_000), "refused before the loop");
        let e: crate::api::ApiError = AnnounceError::Twice("x".into()).into();
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("files")));
    }

    #[test]
    fn a_boot_disk_and_uefi_vars_are_bounded_by_the_spec_and_hello() {
        let mut spec = image_spec();
        spec.disks.clear();
        spec.boot = BootSpec { disk: Some("d.raw".into()), disk_gib: Some(2), ..Default::default() };
        spec.boot.firmware = crate::api::Firmware::Uefi;
        let hello = vec![HelloDisk { device: "virtio0".into(), bytes: 3 * GIB, format: "raw".into() }];
        assert_eq!(disk_bound(&spec, &hello, BOOT), Some(Bound::AtMost(3 * GIB)), "imported larger than disk_gib");
        spec.boot.disk_gib = Some(4);
        assert_eq!(disk_bound(&spec, &hello, BOOT), Some(Bound::AtMost(4 * GIB)), "grown since");
        assert_eq!(disk_bound(&spec, &hello, UEFI_VARS), Some(Bound::AtMost(UEFI_VARS_MAX)));
        let q = vec![HelloDisk { device: "virtio0".into(), bytes: GIB, format: "qcow2".into() }];
        assert_eq!(disk_bound(&spec, &q, BOOT), Some(Bound::AtMost(qcow2_bound(4 * GIB))));
        spec.boot.firmware = crate::api::Firmware::Bios;
        assert_eq!(disk_bound(&spec, &hello, UEFI_VARS), None, "no variables store without UEFI");
        assert_eq!(disk_bound(&image_spec(), &hello, BOOT), Some(Bound::Room), "an overlay follows its base");
    }

    fn record(name: &str) -> (crate::api::snapshots::Snapshot, Vec<crate::migration::AnnouncedFile>) {
        use crate::api::disks::{BackupDisk, DiskRole};
        let disk = |role, name: &str, format: DiskFormat, bytes, virtual_size| BackupDisk {
            role,
            name: name.into(),
            file: format!("{name}.{}", format.as_str()),
            format,
            virtual_size,
            bytes,
            sha256: "ab".repeat(32),
        };
        let s = crate::api::snapshots::Snapshot {
            name: name.into(),
            created_at: "2026-12-06T05:00:00Z".into(),
            live: false,
            consistency: None,
            reason: None,
            frozen: Vec::new(),
            skipped: Vec::new(),
            instance_id: None,
            spec: image_spec(),
            disks: vec![
                disk(DiskRole::Root, "root", DiskFormat::Qcow2, 3 << 20, 2 * GIB),
                disk(DiskRole::Data, "logs", DiskFormat::Raw, GIB, GIB),
            ],
            id: None,
            internal: Vec::new(),
            excluded: Vec::new(),
            uefi_vars: None,
            tpm: None,
        };
        let files = vec![
            file(&format!("snapshot:{name}/snapshot.json"), 100),
            file(&format!("snapshot:{name}/root.qcow2"), 3 << 20),
            file(&format!("snapshot:{name}/logs.raw"), GIB),
        ];
        (s, files)
    }

    #[test]
    fn a_received_snapshot_record_must_be_the_announced_snapshot() {
        let (s, files) = record("s1");
        let json = |s: &crate::api::snapshots::Snapshot| serde_json::to_vec(s).unwrap();
        assert_eq!(check_snapshot_record("s1", &json(&s), &files), Ok(s.clone()));
        let refused = |s: &crate::api::snapshots::Snapshot, f: &[crate::migration::AnnouncedFile]| {
            check_snapshot_record("s1", &json(s), f).unwrap_err()
        };
        // Another snapshot's record, or not a record at all (the type is closed).
        let (other, _) = record("s2");
        assert!(matches!(refused(&other, &files), AnnounceError::Record { why, .. } if why.contains("\"s2\"")));
        let mut extra = serde_json::to_value(&s).unwrap();
        extra["path"] = serde_json::json!("/etc");
        assert!(check_snapshot_record("s1", &serde_json::to_vec(&extra).unwrap(), &files).is_err());
        assert!(check_snapshot_record("s1", b"{", &files).is_err());
        // A UEFI VM's variables store's copy: announced with the record's length, or refused.
        let mut uefi = s.clone();
        uefi.uefi_vars = Some(crate::api::snapshots::VarsCopy {
            file: "uefi-vars.fd".into(),
            bytes: 540_672,
            sha256: "cd".repeat(32),
        });
        assert!(matches!(refused(&uefi, &files), AnnounceError::Record { .. }), "not announced");
        let mut with_vars = files.clone();
        with_vars.push(file("snapshot:s1/uefi-vars.fd", 540_672));
        assert_eq!(check_snapshot_record("s1", &json(&uefi), &with_vars), Ok(uefi.clone()));
        let mut renamed = uefi.clone();
        renamed.uefi_vars.as_mut().unwrap().file = "../x".into();
        assert!(matches!(refused(&renamed, &with_vars), AnnounceError::Record { .. }));
        // A copy named as a path, or not as its disk.
        for bad in ["../../x", "logs.qcow2", "other.raw", ".logs.raw"] {
            let mut t = s.clone();
            t.disks[1].file = bad.into();
            assert!(matches!(refused(&t, &files), AnnounceError::Record { .. }), "{bad}");
        }
        let mut t = s.clone();
        t.disks[1].name = "../x".into();
        t.disks[1].file = "../x.raw".into();
        assert!(matches!(refused(&t, &files), AnnounceError::Record { .. }));
        // Lengths: the announcement's, a raw copy its disk's, a qcow2 within the bound.
        let mut t = s.clone();
        t.disks[1].bytes = GIB - 1;
        assert!(matches!(refused(&t, &files), AnnounceError::Record { .. }));
        let mut f = files.clone();
        f[1].bytes = qcow2_bound(2 * GIB) + 1;
        let mut t = s.clone();
        t.disks[0].bytes = f[1].bytes;
        assert!(matches!(refused(&t, &f), AnnounceError::Record { .. }));
        // A stopped VM's copy records no virtual size: its length is the announcement's.
        let mut t = s.clone();
        t.disks[1].virtual_size = 0;
        assert_eq!(check_snapshot_record("s1", &json(&t), &files), Ok(t.clone()));
        // Every announced file of the snapshot is one the record names, and none is missing.
        let mut f = files.clone();
        f.push(file("snapshot:s1/evil.raw", 1));
        assert!(matches!(refused(&s, &f), AnnounceError::Record { .. }));
        let mut f = files.clone();
        f.pop();
        assert!(matches!(refused(&s, &f), AnnounceError::Record { .. }));
        // Another snapshot's files are not this one's business.
        let mut f = files.clone();
        f.push(file("snapshot:s10/snapshot.json", 1));
        assert_eq!(check_snapshot_record("s1", &json(&s), &f), Ok(s));
    }

    #[test]
    fn tpm_wire_names_are_the_state_files_names_or_nothing() {
        assert_eq!(tpm_wire_name("tpm2-00.permall"), "tpm:tpm2-00.permall");
        for n in crate::tpm::STATE_FILE_NAMES {
            assert_eq!(tpm_of(&tpm_wire_name(n)), Some(n));
        }
        for bad in ["tpm:.lock", "tpm:../tpm2-00.permall", "tpm:", "tpm:tpm2-00.permall/x", "tpm2-00.permall", "data:x"]
        {
            assert_eq!(tpm_of(bad), None, "{bad:?}");
        }
        // Where they wait for the commit: the VM's disk directory, never a disk's name, and
        // removed when the move is given up.
        let cfg = config();
        let paths = VmPaths::for_vm(&cfg, "vm-1");
        let staged = tpm_staged(&paths, "tpm2-00.permall");
        assert_eq!(staged, paths.disk_dir.join("tpm-tpm2-00.permall.moving"));
        let mut spec = image_spec();
        assert!(!received_paths(&spec, &paths).contains(&staged));
        spec.tpm = true;
        assert!(received_paths(&spec, &paths).contains(&staged));
        assert_eq!(placement(&spec, &paths, &[], "tpm:tpm2-00.permall"), None, "not a disk's place");
    }

    #[test]
    fn tpm_state_files_are_announced_only_for_a_tpm_vm_and_bounded() {
        let mut spec = image_spec();
        spec.tpm = true;
        let hello = image_hello();
        let files = vec![
            file("boot", 5 << 20),
            file("data:logs", GIB),
            file("data:db", 7 << 20),
            file("tpm:tpm2-00.permall", 8000),
            file("tpm:tpm2-00.volatilestate", 2000),
        ];
        let room = check_announced(&spec, &hello, &files).expect("a TPM VM's state files");
        assert_eq!(room.disks, (5 << 20) / 2 + GIB / 2 + (7 << 20) / 2 + 4000 + 1000, "counted with the disks");
        let refused =
            |spec: &VmSpec, f: &[crate::migration::AnnouncedFile]| check_announced(spec, &hello, f).unwrap_err();
        // Not for a VM without a TPM.
        assert_eq!(refused(&image_spec(), &files), AnnounceError::Unknown("tpm:tpm2-00.permall".into()));
        // Only the state's names, once, each bounded.
        let mut other = files.clone();
        other.push(file("tpm:.lock", 1));
        assert_eq!(refused(&spec, &other), AnnounceError::Unknown("tpm:.lock".into()));
        let mut twice = files.clone();
        twice.push(file("tpm:tpm2-00.permall", 8000));
        assert_eq!(refused(&spec, &twice), AnnounceError::Twice("tpm:tpm2-00.permall".into()));
        let mut big = files.clone();
        big[3].bytes = crate::tpm::MAX_STATE_FILE_BYTES + 1;
        assert!(matches!(refused(&spec, &big), AnnounceError::Size { name, .. } if name == "tpm:tpm2-00.permall"));
        // They are not disks: Hello's disks must still all come.
        let mut no_disk = files.clone();
        no_disk.remove(1);
        assert_eq!(refused(&spec, &no_disk), AnnounceError::Disks { files: 2, disks: 3 });
    }

    #[test]
    fn a_snapshot_record_names_its_tpm_copies_as_announced() {
        let (mut s, mut files) = record("s1");
        s.tpm = Some(crate::api::snapshots::TpmCopy {
            files: vec![crate::api::snapshots::TpmFile {
                name: "tpm2-00.permall".into(),
                file: "tpm-tpm2-00.permall".into(),
                bytes: 9000,
                sha256: "ef".repeat(32),
            }],
        });
        let json = |s: &crate::api::snapshots::Snapshot| serde_json::to_vec(s).unwrap();
        assert!(
            matches!(check_snapshot_record("s1", &json(&s), &files), Err(AnnounceError::Record { .. })),
            "not announced"
        );
        files.push(file("snapshot:s1/tpm-tpm2-00.permall", 9000));
        assert_eq!(check_snapshot_record("s1", &json(&s), &files), Ok(s.clone()));
        let mut t = s.clone();
        t.tpm.as_mut().unwrap().files[0].bytes = 9001;
        assert!(matches!(check_snapshot_record("s1", &json(&t), &files), Err(AnnounceError::Record { .. })), "length");
        for (name, copy) in [(".lock", "tpm-.lock"), ("tpm2-00.permall", "../x"), ("tpm2-00.permall", "logs.raw")] {
            let mut t = s.clone();
            t.tpm.as_mut().unwrap().files[0].name = name.into();
            t.tpm.as_mut().unwrap().files[0].file = copy.into();
            assert!(
                matches!(check_snapshot_record("s1", &json(&t), &files), Err(AnnounceError::Record { .. })),
                "{copy}"
            );
        }
        let mut big = s.clone();
        big.tpm.as_mut().unwrap().files[0].bytes = crate::tpm::MAX_STATE_FILE_BYTES + 1;
        let mut f = files.clone();
        f.last_mut().unwrap().bytes = crate::tpm::MAX_STATE_FILE_BYTES + 1;
        assert!(matches!(check_snapshot_record("s1", &json(&big), &f), Err(AnnounceError::Record { .. })));
    }

    #[test]
    fn the_destination_keeps_the_vm_only_from_the_commit_point() {
        assert_eq!(destination_action(Some(MigrationPhase::Committed)), DestinationAction::Ordinary);
        assert_eq!(destination_action(Some(MigrationPhase::Sending)), DestinationAction::Abandon);
        assert_eq!(destination_action(None), DestinationAction::Abandon);
    }
}
