//! What a move carries besides the VM's disks, shared by the cold move ([`super::cold`]) and the
//! live migration ([`super::outgoing`], [`super::incoming`]): the VM's snapshots, and the
//! `files` channel's two ends as both use them. One place, so the two kinds of move cannot
//! drift in what they accept.
//!
//! Source, in order: [`snapshot_files`] (every snapshot's `snapshot.json` then its copies and
//! its TPM state's copies, oldest snapshot first), [`announce`] (their lengths and occupied bytes, for
//! `ControlMsg::Announce`), [`send_files`] over one `files` stream.
//!
//! Destination, in order: the announcement checked (`cold::plan::check_announced`, or
//! [`check_live_announcement`] for a live one, which carries snapshots only);
//! [`prepare_staging`] (refuses a host already holding snapshots of that name; empties what an
//! earlier give-up left); [`reserve_room`]; [`next_channel`] for the `files` stream; each
//! snapshot file through [`receive_snapshot_file`] into the staging directory
//! (`STATE/snapshots/.incoming-VM/`, a snapshot renamed in whole once its record and every copy
//! arrived checked); after the commit write, [`place_snapshots`] (also run by recovery of a
//! committed record, since a crash may fall between the two); an abandon removes the staging
//! directory ([`remove_staging`]).

use super::super::snapshots;
use super::super::Manager;
use super::cold::plan;
use crate::api::{ApiError, Code, VmSpec};
use crate::disk::reserve::Reservation;
use crate::migration::files::{FileHeader, FileReceiver, FileSender};
use crate::migration::{AnnouncedFile, ChannelKind, Expectation, MigrationError, Secret};
use crate::qemu::argv::VmPaths;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// 4001 step `migrate_in` (the destination's steps).
fn failed(message: impl Into<String>) -> ApiError {
    super::super::provisioning("migrate_in", message.into())
}

/// Every snapshot file of VM `name` as `(wire name, path)`, in the order they are sent: each
/// snapshot's files ([`snapshots::files_to_move`]), then the copies of the TPM state its record
/// names ([`tpm_copies`]).
///
/// # Errors
/// As [`snapshots::files_to_move`] (a snapshot that is not whole refuses the move).
pub(super) fn snapshot_files(mgr: &Manager, name: &str) -> Result<Vec<(String, PathBuf)>, ApiError> {
    let files = snapshots::files_to_move(mgr, name)?;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let record = (f.file == snapshots::SNAPSHOT_JSON).then(|| f.path.clone());
        out.push((plan::snapshot_wire_name(&f.snapshot, &f.file), f.path));
        if let Some(json) = record {
            let copies = crate::blocking::run(|| tpm_copies(&json))?;
            out.extend(copies.into_iter().map(|(file, path)| (plan::snapshot_wire_name(&f.snapshot, &file), path)));
        }
    }
    Ok(out)
}

/// The TPM state copies (`tpm-FILE`, each a regular file beside it) the snapshot record at
/// `json` names, as `(file, path)`: a `tpm: true` VM's snapshot keeps its TPM state beside its
/// disks' copies, and the destination's revert puts it back from them.
///
/// # Errors
/// 4001 when the record cannot be read, or names a copy that is not a state file's or is not
/// there.
fn tpm_copies(json: &Path) -> Result<Vec<(String, PathBuf)>, ApiError> {
    let damaged =
        |why: String| failed(format!("{}: {why}: delete the snapshot or repair it to move the VM", json.display()));
    let bytes = std::fs::read(json).map_err(|e| damaged(e.to_string()))?;
    let s: crate::api::snapshots::Snapshot = serde_json::from_slice(&bytes).map_err(|e| damaged(e.to_string()))?;
    let Some(dir) = json.parent() else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for t in s.tpm.iter().flat_map(|t| &t.files) {
        if !crate::tpm::names_a_state_copy(t) {
            return Err(damaged(format!("{:?} is not a TPM state file's copy", t.file)));
        }
        let path = dir.join(&t.file);
        let regular = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file());
        if !regular {
            return Err(damaged(format!("the TPM state's copy {} is not there", t.file)));
        }
        out.push((t.file.clone(), path));
    }
    Ok(out)
}

/// What `ControlMsg::Announce` says of each file to send (`(wire name, path)`): its length
/// and the bytes it occupies.
///
/// # Errors
/// A file that cannot be read (named).
pub(super) fn announce(files: &[(String, PathBuf)]) -> Result<Vec<AnnouncedFile>, String> {
    files
        .iter()
        .map(|(name, path)| {
            let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let bytes = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len();
            let allocated = data_bytes(&file, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
            Ok(AnnouncedFile { name: name.clone(), bytes, allocated })
        })
        .collect()
}

/// The bytes of `file` (`len` long) in its data extents (`SEEK_DATA`/`SEEK_HOLE`): at most
/// what the receiver writes of it, which leaves holes and zero blocks out. Not the blocks it
/// occupies here: a compressing file system (ZFS, btrfs) counts fewer than the receiver
/// writes. A file system that does not know holes reports one extent, the whole file.
fn data_bytes(file: &std::fs::File, len: u64) -> Result<u64, nix::Error> {
    use nix::unistd::{lseek, Whence};
    let (mut at, mut data) = (0i64, 0u64);
    let end = i64::try_from(len).unwrap_or(i64::MAX);
    while at < end {
        let start = match lseek(file, at, Whence::SeekData) {
            Ok(start) => start,
            Err(nix::Error::ENXIO) => break, // only a hole from `at` to the end
            Err(e) => return Err(e),
        };
        let stop = lseek(file, start, Whence::SeekHole)?.min(end);
        data += u64::try_from(stop - start).unwrap_or(0);
        at = stop;
    }
    Ok(data)
}

/// Sends `files` (`(wire name, path)`) over one `files` stream to `destination` for VM `vm`;
/// returns the bytes sent.
///
/// # Errors
/// When the stream cannot be opened, a file cannot be read, or the stream fails.
pub(super) async fn send_files(
    destination: &str,
    vm: &str,
    secret: &Secret,
    files: &[(String, PathBuf)],
) -> Result<u64, MigrationError> {
    let stream = crate::migration::connect(destination, vm, secret, &ChannelKind::Files).await?;
    let mut tx = FileSender::new(stream, secret);
    let mut bytes = 0;
    for (name, path) in files {
        let done = tx.send(name, path).await?;
        tracing::info!(file = %name, bytes = done.bytes, sha256 = %done.sha256, "sent");
        bytes += done.bytes;
    }
    tx.finish().await?;
    Ok(bytes)
}

/// A live migration's announcement (pure): snapshot files only (the disks travel as QEMU's
/// mirrors), checked as a cold move's snapshot part is. Returns the bytes they occupy.
///
/// # Errors
/// [`plan::AnnounceError`] (2001 on `files`) naming the first file at fault.
pub(super) fn check_live_announcement(spec: &VmSpec, files: &[AnnouncedFile]) -> Result<u64, plan::AnnounceError> {
    if let Some(f) = files.iter().find(|f| plan::snapshot_of(&f.name).is_none()) {
        return Err(plan::AnnounceError::Unknown(f.name.clone()));
    }
    // With no disk file announced and no disk in the list, only the snapshot rules apply.
    plan::check_announced(spec, &[], files).map(|room| room.snapshots)
}

/// The next stream of kind `kind` (others before it are out of step: closed).
///
/// # Errors
/// 4001 when none comes within `timeout`.
pub(super) async fn next_channel(
    exp: &mut Expectation,
    kind: ChannelKind,
    timeout: Duration,
) -> Result<std::net::TcpStream, ApiError> {
    loop {
        let ch = exp
            .next(timeout)
            .await
            .ok_or_else(|| failed(format!("no {kind:?} stream from the source within {} s", timeout.as_secs())))?;
        if ch.kind == kind {
            return Ok(ch.stream);
        }
        tracing::warn!(got = ?ch.kind, want = ?kind, "a stream out of step with the move: closed");
    }
}

/// The snapshots' staging directory of this move ([`snapshots::incoming_dir`]), emptied of what
/// an earlier give-up left empty, after checking this host holds no snapshot of a VM of that
/// name (the move would mix them, and they are not this move's to remove), staged or placed;
/// made when snapshots are coming (`coming`).
///
/// # Errors
/// 3003 when snapshots of that name are here (placed or staged); 4001 when a directory cannot
/// be read or made.
pub(super) fn prepare_staging(mgr: &Manager, name: &str, coming: bool) -> Result<PathBuf, ApiError> {
    let (dir, staging) = (snapshots::snapshots_dir(mgr, name), snapshots::incoming_dir(mgr, name));
    crate::blocking::run(|| {
        let held = std::fs::read_dir(&dir).map(|mut e| e.next().is_some()).unwrap_or(false);
        if held {
            return Err(ApiError::new(
                Code::HardwareInUse,
                format!("{} holds snapshots of another VM of this name: remove them first", dir.display()),
            )
            .field("spec.name"));
        }
        let _ = std::fs::remove_dir(&dir);
        // Every give-up removes its own staging directory before it forgets the record, so one
        // left holding something is a committed move's whose snapshots could not be put in
        // place: their only copy, the source's is gone. Not this move's to remove.
        let staged = std::fs::read_dir(&staging).map(|mut e| e.next().is_some()).unwrap_or(false);
        if staged {
            return Err(ApiError::new(
                Code::HardwareInUse,
                format!(
                    "{} holds snapshots an earlier move of this name brought and could not put in place: \
                     move them into {} or remove them first",
                    staging.display(),
                    dir.display()
                ),
            )
            .field("spec.name"));
        }
        let _ = std::fs::remove_dir(&staging);
        if coming {
            crate::state::dirs::private_dir(&staging).map_err(|e| failed(format!("{}: {e}", staging.display())))?;
        }
        Ok(staging.clone())
    })
}

/// Reserves the room the announced files take: the disks' in the VM's disk directory, the
/// snapshots' under the state directory (as a snapshot reserves its copies' room), against the
/// free space (`statvfs`) less what other copies hold.
///
/// # Errors
/// 3002 naming `files` (`resource: disk_bytes`) when they do not fit; 4001 when the free space
/// cannot be read.
pub(super) fn reserve_room(mgr: &Manager, paths: &VmPaths, room: plan::Room) -> Result<Vec<Reservation>, ApiError> {
    use crate::disk::space::{refusal, PREALLOCATE_PERCENT};
    let mut held = Vec::new();
    let state = mgr.config.paths.state.clone();
    for (dir, bytes, what) in
        [(&paths.disk_dir, room.disks, "the moved disks"), (&state, room.snapshots, "the moved snapshots")]
    {
        if bytes > 0 {
            let r = crate::blocking::run(|| mgr.reservations.reserve(dir, bytes, PREALLOCATE_PERCENT))
                .map_err(|e| refusal(e, dir, what, "files", "disk_bytes"))?;
            held.push(r);
        }
    }
    Ok(held)
}

/// A header of the `files` channel checked against the announcement and what already came
/// (`got`).
///
/// # Errors
/// 4001 for a file sent twice; 2001 on `files` for one not announced or of another length.
pub(super) fn check_header(announced: &[AnnouncedFile], got: &[String], header: &FileHeader) -> Result<(), ApiError> {
    if got.contains(&header.name) {
        return Err(failed(format!("the source sent {:?} twice", header.name)));
    }
    match announced.iter().find(|f| f.name == header.name) {
        None => Err(plan::AnnounceError::Unknown(header.name.clone()).into()),
        Some(f) if f.bytes != header.bytes => {
            let bound = format!("{} were announced", f.bytes);
            Err(plan::AnnounceError::Size { name: header.name.clone(), bytes: header.bytes, bound }.into())
        }
        Some(_) => Ok(()),
    }
}

/// The most data bytes file `name` may write on this host: what its source announced it
/// takes there (what was reserved), plus one chunk for the difference of block sizes.
pub(super) fn written_bound(announced: &[AnnouncedFile], name: &str) -> u64 {
    let f = announced.iter().find(|f| f.name == name);
    f.map_or(0, |f| f.allocated.min(f.bytes)).saturating_add(crate::migration::files::CHUNK as u64)
}

/// A snapshot being received: its checked record and the copies still to come.
pub(super) struct Arriving {
    record: crate::api::snapshots::Snapshot,
    partial: PathBuf,
    left: Vec<String>,
}

/// Reads a live migration's `files` stream: every announced file a snapshot's, each into the
/// staging directory ([`receive_snapshot_file`]). Returns their wire names.
///
/// # Errors
/// As [`check_header`] and [`receive_snapshot_file`]; 4001 when a file announced did not come.
pub(super) async fn receive_snapshots(
    tool: &crate::disk::Tool,
    announced: &[AnnouncedFile],
    staging: &Path,
    stream: std::net::TcpStream,
    secret: &Secret,
    idle: Duration,
) -> Result<Vec<String>, ApiError> {
    let mut rx = FileReceiver::new(stream, secret);
    let mut got: Vec<String> = Vec::new();
    let mut arriving: Vec<(String, Arriving)> = Vec::new();
    while let Some(header) = rx.next(idle).await.map_err(ApiError::from)? {
        check_header(announced, &got, &header)?;
        let (snapshot, file) = plan::snapshot_of(&header.name)
            .map(|(s, f)| (s.to_string(), f.to_string()))
            .ok_or_else(|| plan::AnnounceError::Unknown(header.name.clone()))?;
        receive_snapshot_file(tool, announced, staging, &mut rx, &header, &snapshot, &file, &mut arriving).await?;
        got.push(header.name);
    }
    if got.len() != announced.len() || !arriving.is_empty() {
        return Err(failed(format!("the source announced {} files and sent {}", announced.len(), got.len())));
    }
    Ok(got)
}

/// One file of a snapshot: its `snapshot.json` first, read back and checked
/// ([`plan::check_snapshot_record`]); then each copy the record names, which must have the
/// sha256 the record gives, a qcow2 one inspected as a VM's disk is ([`check_received`]). The
/// snapshot is renamed from `STAGING/.SNAPSHOT.partial/` to `STAGING/SNAPSHOT` when its last
/// file arrived.
///
/// # Errors
/// 2003 for a copy that is not the one its record names; 2001 on `files` for a record that
/// does not match the announcement; 4001 for a copy the record does not name, or a failed
/// stream or file.
#[allow(clippy::too_many_arguments)]
pub(super) async fn receive_snapshot_file(
    tool: &crate::disk::Tool,
    announced: &[AnnouncedFile],
    staging: &Path,
    rx: &mut FileReceiver,
    header: &FileHeader,
    snapshot: &str,
    file: &str,
    arriving: &mut Vec<(String, Arriving)>,
) -> Result<(), ApiError> {
    let partial = staging.join(format!(".{snapshot}.partial"));
    if file == snapshots::SNAPSHOT_JSON {
        let json = partial.join(file);
        crate::blocking::run(|| {
            let _ = std::fs::remove_dir_all(&partial);
            crate::state::dirs::private_dir(&partial)
        })
        .map_err(|e| failed(format!("{}: {e}", partial.display())))?;
        let done =
            rx.receive_within(header, &json, written_bound(announced, &header.name)).await.map_err(ApiError::from)?;
        let bytes =
            crate::blocking::run(|| std::fs::read(&json)).map_err(|e| failed(format!("{}: {e}", json.display())))?;
        let record = plan::check_snapshot_record(snapshot, &bytes, announced)?;
        let left = record.disks.iter().map(|d| d.file.clone()).chain(record.uefi_vars.iter().map(|v| v.file.clone()));
        let left = left.chain(record.tpm.iter().flat_map(|t| t.files.iter().map(|f| f.file.clone()))).collect();
        arriving.push((snapshot.to_string(), Arriving { record, partial, left }));
        tracing::info!(file = %header.name, bytes = done.bytes, sha256 = %done.sha256, "received");
    } else {
        let Some((_, a)) = arriving.iter_mut().find(|(n, _)| n == snapshot) else {
            return Err(plan::AnnounceError::NoRecord(snapshot.to_string()).into());
        };
        let Some(at) = a.left.iter().position(|f| f == file) else {
            return Err(failed(format!("snapshot {snapshot:?}: {file:?} is not one of its copies, or came twice")));
        };
        a.left.swap_remove(at);
        // A copy of a disk, of a UEFI VM's variables store or of a TPM state file (raw bytes,
        // no image to inspect).
        let disk = a.record.disks.iter().find(|d| d.file == file);
        let tpm = a.record.tpm.iter().flat_map(|t| &t.files).find(|t| t.file == file);
        let sha256 = match (disk, &a.record.uefi_vars, tpm) {
            (Some(d), _, _) => d.sha256.clone(),
            (None, Some(v), _) if v.file == file => v.sha256.clone(),
            (None, _, Some(t)) => t.sha256.clone(),
            _ => return Err(failed(format!("snapshot {snapshot:?}: {file:?} is not one of its copies"))),
        };
        let path = a.partial.join(file);
        let done =
            rx.receive_within(header, &path, written_bound(announced, &header.name)).await.map_err(ApiError::from)?;
        // The channel's trailer vouches for the bytes sent; the record says which bytes the
        // snapshot took: a copy changed on the source since is not this snapshot's.
        if sha256 != done.sha256 {
            let _ = crate::blocking::run(|| std::fs::remove_file(&path));
            return Err(ApiError::new(
                Code::ChecksumMismatch,
                format!("snapshot {snapshot:?}: {file} is not the copy its record names (sha256)"),
            )
            .field("files"));
        }
        if let Some(disk) = disk.filter(|d| d.format == crate::api::DiskFormat::Qcow2) {
            // A root copy of an image VM is an overlay naming its base image, as the VM's own.
            let overlay = disk.role == crate::api::disks::DiskRole::Root && a.record.spec.boot.image.is_some();
            check_received(tool, &path, overlay).await?;
        }
        tracing::info!(file = %header.name, bytes = done.bytes, sha256 = %done.sha256, "received");
    }
    // Whole: renamed in, as vm.snapshot renames a finished snapshot.
    if let Some(i) = arriving.iter().position(|(n, a)| n == snapshot && a.left.is_empty()) {
        let (name, a) = arriving.swap_remove(i);
        let done = staging.join(&name);
        crate::blocking::run(|| {
            // Its files' names durable before the directory takes its final name.
            std::fs::File::open(&a.partial)?.sync_all()?;
            std::fs::rename(&a.partial, &done)?;
            std::fs::File::open(staging)?.sync_all()
        })
        .map_err(|e| failed(format!("{}: {e}", done.display())))?;
    }
    Ok(())
}

/// After the commit point: the snapshots that arrived become the VM's (the staging directory
/// renamed to `STATE/snapshots/VM`). Also run by recovery for a committed record, since a
/// crash may fall between the commit and this rename. Nothing to do when none came.
pub(in crate::lifecycle) fn place_snapshots(mgr: &Manager, name: &str) {
    let (dir, staging) = (snapshots::snapshots_dir(mgr, name), snapshots::incoming_dir(mgr, name));
    let placed = crate::blocking::run(|| {
        if !staging.exists() {
            return Ok(false);
        }
        let _ = std::fs::remove_dir(&dir); // an empty one left by a destroy
        std::fs::rename(&staging, &dir)?;
        if let Some(parent) = dir.parent() {
            std::fs::File::open(parent)?.sync_all()?;
        }
        Ok::<bool, std::io::Error>(true)
    });
    match placed {
        Ok(true) => tracing::info!(vm = name, "the moved snapshots are the VM's"),
        Ok(false) => {}
        Err(e) => tracing::error!(
            vm = name,
            staging = %staging.display(),
            error = %e,
            "the moved snapshots could not be put in place: they stay where they arrived until the next start"
        ),
    }
}

/// Removes the snapshots' staging directory of an abandoned move of VM `name` (absent is fine).
///
/// # Errors
/// 4001 when it cannot be removed.
pub(super) fn remove_staging(mgr: &Manager, name: &str) -> Result<(), ApiError> {
    let staging = snapshots::incoming_dir(mgr, name);
    match crate::blocking::run(|| std::fs::remove_dir_all(&staging)) {
        Ok(()) => {
            tracing::info!(dir = %staging.display(), "removed the snapshots of the abandoned move");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(failed(format!("removing {}: {e}", staging.display()))),
    }
}

/// A received qcow2 disk is untrusted input, as an import is: QEMU opens the backing file and
/// the external data file its header names (as `qemu.user`), and a `boot.disk` root disk is
/// opened without a backing override. Only an image VM's overlay (`overlay`) may name a
/// backing file (its base image, which the launch replaces with this host's own image); no
/// file may keep its data in another one. Inspected by QEMU as `qemu.user`
/// ([`crate::disk::import::inspect`]), never parsed as root. (A raw disk is opened as raw
/// whatever its bytes hold: its guest may well have written a qcow2 header into it.)
///
/// # Errors
/// 4001 naming the file when it is not qcow2, names another file, or QEMU cannot read it.
pub(super) async fn check_received(tool: &crate::disk::Tool, path: &Path, overlay: bool) -> Result<(), ApiError> {
    let opened = path.to_path_buf();
    let file = crate::blocking::run(move || std::fs::File::open(&opened))
        .map_err(|e| failed(format!("{}: {e}", path.display())))?;
    let info = crate::disk::import::inspect(tool, std::os::fd::OwnedFd::from(file))
        .await
        .map_err(|e| failed(format!("{} is not a disk image QEMU reads: {e}", path.display())))?;
    if info.format != "qcow2" {
        return Err(failed(format!(
            "{} is {:?}, not the qcow2 its spec declares: refused",
            path.display(),
            info.format
        )));
    }
    if let (Some(backing), false) = (&info.backing, overlay) {
        return Err(failed(format!("{} names the backing file {backing:?}: refused", path.display())));
    }
    if let Some(data) = &info.data_file {
        return Err(failed(format!("{} keeps its data in the external file {data:?}: refused", path.display())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn data_bytes_counts_the_data_extents_not_the_holes() {
        use std::io::{Seek, SeekFrom, Write};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let mut f = std::fs::File::create(&path).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        f.set_len(4 << 20).unwrap();
        f.sync_all().unwrap();
        let data = super::data_bytes(&std::fs::File::open(&path).unwrap(), 4 << 20).unwrap();
        // A file system without holes would say 4 MiB; this test's (tmpfs or ext4) has them.
        assert!((4096..1 << 20).contains(&data), "{data}");
        let empty = dir.path().join("empty");
        std::fs::File::create(&empty).unwrap();
        assert_eq!(super::data_bytes(&std::fs::File::open(&empty).unwrap(), 0).unwrap(), 0);
    }

    use super::*;

    fn file(name: &str, bytes: u64) -> AnnouncedFile {
        AnnouncedFile { name: name.into(), bytes, allocated: bytes }
    }

    #[test]
    fn a_live_announcement_carries_snapshots_only() {
        let spec = crate::validate::tests::spec("vm-1");
        let snaps = [file("snapshot:s1/snapshot.json", 500), file("snapshot:s1/root.qcow2", 1 << 20)];
        assert_eq!(check_live_announcement(&spec, &snaps), Ok(500 + (1 << 20)));
        assert_eq!(check_live_announcement(&spec, &[]), Ok(0));
        // The disks travel as QEMU's mirrors: a disk file is not this channel's.
        let with_disk = [file("boot", 10), snaps[0].clone()];
        assert_eq!(check_live_announcement(&spec, &with_disk), Err(plan::AnnounceError::Unknown("boot".into())));
        // The snapshot rules hold as in a cold move: the record first.
        let copy_first = [snaps[1].clone(), snaps[0].clone()];
        assert_eq!(check_live_announcement(&spec, &copy_first), Err(plan::AnnounceError::NoRecord("s1".into())));
        let twice = [snaps[0].clone(), snaps[0].clone()];
        assert!(matches!(check_live_announcement(&spec, &twice), Err(plan::AnnounceError::Twice(_))));
    }

    #[test]
    fn a_snapshots_tpm_copies_are_sent_by_their_records_names_only() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join(snapshots::SNAPSHOT_JSON);
        let mut s = snapshots::tests::snapshot(None, None);
        let write =
            |s: &crate::api::snapshots::Snapshot| std::fs::write(&json, serde_json::to_vec(s).unwrap()).unwrap();
        write(&s);
        assert_eq!(tpm_copies(&json).unwrap(), Vec::new(), "no TPM copy");
        let file = |name: &str, copy: &str| crate::api::snapshots::TpmFile {
            name: name.into(),
            file: copy.into(),
            bytes: 5,
            sha256: "ab".repeat(32),
        };
        s.tpm = Some(crate::api::snapshots::TpmCopy { files: vec![file("tpm2-00.permall", "tpm-tpm2-00.permall")] });
        write(&s);
        assert_eq!(tpm_copies(&json).unwrap_err().code.as_i32(), 4001, "the copy is not there");
        std::fs::write(dir.path().join("tpm-tpm2-00.permall"), b"state").unwrap();
        assert_eq!(
            tpm_copies(&json).unwrap(),
            [("tpm-tpm2-00.permall".to_string(), dir.path().join("tpm-tpm2-00.permall"))]
        );
        // A record naming another file (a path, another name) is not sent from.
        for (name, copy) in [("tpm2-00.permall", "../../etc/shadow"), (".lock", "tpm-.lock"), ("tpm2-00.permall", "x")]
        {
            s.tpm = Some(crate::api::snapshots::TpmCopy { files: vec![file(name, copy)] });
            write(&s);
            assert!(tpm_copies(&json).is_err(), "{copy}");
        }
        // A link in place of the copy is not one.
        std::fs::remove_file(dir.path().join("tpm-tpm2-00.permall")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("tpm-tpm2-00.permall")).unwrap();
        s.tpm = Some(crate::api::snapshots::TpmCopy { files: vec![file("tpm2-00.permall", "tpm-tpm2-00.permall")] });
        write(&s);
        assert!(tpm_copies(&json).is_err());
    }

    #[test]
    fn a_header_must_be_announced_once_with_its_length() {
        let announced = [file("snapshot:s1/snapshot.json", 500)];
        let h = |name: &str, bytes| FileHeader { name: name.into(), bytes };
        assert!(check_header(&announced, &[], &h("snapshot:s1/snapshot.json", 500)).is_ok());
        let e = check_header(&announced, &[], &h("snapshot:s1/snapshot.json", 501)).unwrap_err();
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("files")));
        let e = check_header(&announced, &[], &h("snapshot:s2/snapshot.json", 500)).unwrap_err();
        assert_eq!(e.code.as_i32(), 2001);
        let e = check_header(&announced, &["snapshot:s1/snapshot.json".into()], &h("snapshot:s1/snapshot.json", 500))
            .unwrap_err();
        assert_eq!(e.code.as_i32(), 4001);
    }
}
