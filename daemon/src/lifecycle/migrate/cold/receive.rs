//! The destination of a cold move: `vm.migrate_in` with `mode: cold` admitted the VM and
//! recorded it `incoming` (lifecycle/migrate/incoming.rs, as for a live migration, no NIC and
//! no QEMU made); [`receive`] is its task. It reads the source's `Hello` and `Announce` (every
//! file to come, checked against the admitted spec by [`super::plan::check_announced`] and its
//! room reserved before a byte is written), then each file of the `files` channel into the place
//! a create would give it ([`super::plan::placement`]) under a partial name, renamed once its
//! sha256 matched, and each snapshot's files into a staging directory
//! ([`receive_snapshot_file`]); answers `Ready` when every announced file arrived; on `Commit`
//! records the VM `stopped` with phase `committed` (the commit point: the VM is this host's from
//! this write), puts the snapshots in place ([`place_snapshots`]), answers `Committed`, and
//! starts the VM when its admitted spec says `running` (a `stop: true` move of a running VM).
//!
//! Anything that goes wrong before the commit gives the move up: the source is told (`Abort`
//! with the code: 2003 for a file whose sha256 differs), every file this move could have written
//! is removed ([`remove_received`], and the snapshots' staging directory), then the migration is abandoned as a live one is (the
//! destination's `incoming::abandon`: tombstone, record removed; its caller hands it in as an
//! [`Abandon`], since the incoming side is the one that starts this task). [`recover`] does the
//! same after a restart before the commit.

use super::super::super::held::HeldVm;
use super::super::super::op::VmOp;
use super::super::super::snapshots;
use super::super::super::Manager;
use super::plan::{self, DestinationAction};
use crate::api::{ApiError, Code, DesiredState, VmSpec, VmStatus};
use crate::disk::reserve::Reservation;
use crate::migration::files::FileReceiver;
use crate::migration::{AnnouncedFile, ChannelKind, Control, ControlMsg, Expectation, Hello, Secret};
use crate::qemu::argv::VmPaths;
use crate::state::migration::MigrationPhase;
use crate::state::VmRecord;
use crate::validate::ValidSpec;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

/// How long the source may take from opening the control channel to its `Hello` (a `stop:
/// true` move stops its guest in between).
const HELLO_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the source may take to open the files channel, and between two files.
const FILES_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the source may take to send `Commit` after `Ready`.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(120);

/// The destination's abandon of an incoming migration (`incoming::abandon`), handed in by the
/// code that starts a cold receive or settles one: the held VM and why.
pub(in crate::lifecycle) type Abandon =
    for<'a> fn(&'a HeldVm, &'a str) -> Pin<Box<dyn Future<Output = Result<(), ApiError>> + Send + 'a>>;

/// 4001 step `migrate_in`.
fn failed(message: impl Into<String>) -> ApiError {
    super::super::super::provisioning("migrate_in", message.into())
}

/// The task of one cold receive (module doc). Holds the VM's operation throughout.
pub(in crate::lifecycle) async fn receive(
    mut op: VmOp,
    vm: ValidSpec,
    exp: Expectation,
    secret: Secret,
    timeout_s: u64,
    abandon: Abandon,
) {
    let mut control: Option<Control> = None;
    match until_commit(&mut op, &vm, exp, &secret, timeout_s, &mut control).await {
        Ok(()) => after_commit(&mut op, &vm, control).await,
        Err(e) => {
            tracing::warn!(error = %e.message, "cold move abandoned");
            if let Some(c) = control.as_mut() {
                let abort = ControlMsg::Abort { code: e.code.as_i32(), message: e.message.clone() };
                if let Err(send) = c.send(&abort).await {
                    tracing::info!(error = %send, "the source was not told of the abort");
                }
            }
            let why = format!("cold move abandoned: {}", e.message);
            if let Err(undo) = give_up(op.held(), &vm.spec, &why, abandon).await {
                tracing::error!(error = %undo.message, "abandoning the cold move failed: the record keeps what is left");
            }
        }
    }
}

/// The steps up to and including the commit point. Every error ends the move here.
async fn until_commit(
    op: &mut VmOp,
    vm: &ValidSpec,
    mut exp: Expectation,
    secret: &Secret,
    timeout_s: u64,
    control: &mut Option<Control>,
) -> Result<(), ApiError> {
    let paths = op.paths().clone();
    let channel = next_channel(&mut exp, ChannelKind::Control, Duration::from_secs(timeout_s)).await?;
    let peer = channel.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let c = control.insert(Control::new(channel, secret));
    let hello = match c.recv(HELLO_TIMEOUT).await.map_err(|e| failed(format!("the control channel: {e}")))? {
        ControlMsg::Hello(hello) => *hello,
        ControlMsg::Abort { code, message } => return Err(source_aborted(code, &message)),
        other => return Err(failed(format!("the source's first message was not hello: {other:?}"))),
    };
    check_hello(&vm.spec, &hello)?;
    let announced = match c.recv(FILES_TIMEOUT).await.map_err(|e| failed(format!("the control channel: {e}")))? {
        ControlMsg::Announce { files } => files,
        ControlMsg::Abort { code, message } => return Err(source_aborted(code, &message)),
        other => return Err(failed(format!("expected the announcement of the files, got {other:?}"))),
    };
    // Every file checked against the admitted spec, and its room admitted, before a byte is
    // written.
    let room = plan::check_announced(&vm.spec, &hello.disks, &announced)?;
    op.update("the source connected", |r| {
        super::super::adopt_source(r, peer, &hello);
        if vm.spec.boot.image.is_some() && hello.disks.iter().any(|d| d.device == "virtio0") {
            // Named before it arrives, as a create names it before QEMU writes it.
            r.overlay = Some(paths.overlay.clone());
        }
    })?;
    // A new VM never inherits a stranger's files of its name (a create does the same).
    op.clear_orphan_disks()?;
    crate::blocking::run(|| crate::state::dirs::private_dir(&paths.disk_dir))
        .map_err(|e| failed(format!("{}: {e}", paths.disk_dir.display())))?;
    let staging = prepare_snapshots(op.mgr(), op.name(), room.snapshots > 0)?;
    let _room = reserve_room(op.mgr(), &paths, room)?;
    let stream = next_channel(&mut exp, ChannelKind::Files, FILES_TIMEOUT).await?;
    drop(exp); // nothing more is expected: a late stream of this VM is refused
    let tool = op.mgr().disk_tool();
    let into = Dest { spec: &vm.spec, paths: &paths, hello: &hello, announced: &announced, staging: &staging };
    let got = receive_files(&tool, &into, stream, secret).await?;
    c.send(&ControlMsg::Ready { exports: got }).await.map_err(|e| failed(format!("the control channel: {e}")))?;
    match c.recv(COMMIT_TIMEOUT).await.map_err(|e| failed(format!("the control channel: {e}")))? {
        ControlMsg::Commit => {}
        ControlMsg::Abort { code, message } => return Err(source_aborted(code, &message)),
        other => return Err(failed(format!("expected the commit, got {other:?}"))),
    }
    let root = plan::boot_disk_root(&vm.spec.boot, &hello.disks, &op.mgr().config.paths.import_dir());
    // The commit point: from this write on, the VM is this host's.
    op.update_status("cold move committed: the VM is this host's", VmStatus::Stopped, |r| {
        if let Some(m) = r.migration.as_mut() {
            m.phase = MigrationPhase::Committed;
        }
        if root.is_some() {
            r.root_disk = root;
        }
        r.process = None;
    })?;
    Ok(())
}

/// The source's `Abort` as the reason this side gives the move up.
fn source_aborted(code: i32, message: &str) -> ApiError {
    let message = format!("the source aborted: {message}");
    match Code::from_i32(code) {
        Some(code) => ApiError::new(code, message),
        None => failed(message),
    }
}

/// The next stream of kind `kind` (others before it are out of step: closed).
async fn next_channel(
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
        tracing::warn!(got = ?ch.kind, want = ?kind, "a stream out of step with a cold move: closed");
    }
}

/// The source describes the VM that was admitted: the same spec (its state aside) and a MAC
/// per NIC.
fn check_hello(admitted: &VmSpec, hello: &Hello) -> Result<(), ApiError> {
    if !plan::same_vm(admitted, &hello.spec) {
        return Err(ApiError::invalid("spec", "the source sends another spec than the one admitted here"));
    }
    if hello.macs.len() != admitted.nics.len() {
        return Err(ApiError::invalid(
            "spec",
            format!("the source names {} NIC MACs for {} NICs", hello.macs.len(), admitted.nics.len()),
        ));
    }
    Ok(())
}

/// The snapshots' staging directory of this move ([`super::super::super::snapshots::incoming_dir`]),
/// emptied of what an earlier give-up left, after checking this host holds no snapshot of a VM
/// of that name (the move would mix them, and they are not this move's to remove); made when
/// snapshots are coming (`coming`).
///
/// # Errors
/// 3003 when snapshots of that name are here; 4001 when a directory cannot be read or made.
fn prepare_snapshots(mgr: &Manager, name: &str, coming: bool) -> Result<PathBuf, ApiError> {
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
        match std::fs::remove_dir_all(&staging) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(failed(format!("{}: {e}", staging.display())))
            }
            _ => {}
        }
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
fn reserve_room(mgr: &Manager, paths: &VmPaths, room: plan::Room) -> Result<Vec<Reservation>, ApiError> {
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

/// Where a cold receive puts what arrives.
struct Dest<'a> {
    spec: &'a VmSpec,
    paths: &'a VmPaths,
    hello: &'a Hello,
    announced: &'a [AnnouncedFile],
    /// The snapshots' staging directory.
    staging: &'a Path,
}

/// A snapshot being received: its checked record and the copies still to come.
struct Arriving {
    record: crate::api::snapshots::Snapshot,
    partial: PathBuf,
    left: Vec<String>,
}

/// Reads every file of the `files` channel into its place; returns their wire names. A VM
/// file goes where a create puts it; a snapshot's files into `STAGING/.SNAPSHOT.partial/`,
/// renamed to `STAGING/SNAPSHOT` once its record and every copy arrived checked.
///
/// # Errors
/// 2003 for a file whose bytes do not have the sha256 announced (its partial file removed) or
/// a snapshot copy that is not the one its record names; 2001 on `files` for a file or a length
/// the announcement did not give, or a snapshot record that does not match it; 4001 for a name
/// the spec has no place for, a file sent twice, one missing, or a failed stream or file.
async fn receive_files(
    tool: &crate::disk::Tool,
    into: &Dest<'_>,
    stream: std::net::TcpStream,
    secret: &Secret,
) -> Result<Vec<String>, ApiError> {
    let (spec, paths, hello) = (into.spec, into.paths, into.hello);
    let mut rx = FileReceiver::new(stream, secret);
    let mut got: Vec<String> = Vec::new();
    let mut arriving: Vec<(String, Arriving)> = Vec::new();
    while let Some(header) = rx.next(FILES_TIMEOUT).await.map_err(ApiError::from)? {
        if got.contains(&header.name) {
            return Err(failed(format!("the source sent {:?} twice", header.name)));
        }
        match into.announced.iter().find(|f| f.name == header.name) {
            None => return Err(plan::AnnounceError::Unknown(header.name.clone()).into()),
            Some(f) if f.bytes != header.bytes => {
                let bound = format!("{} were announced", f.bytes);
                return Err(plan::AnnounceError::Size { name: header.name.clone(), bytes: header.bytes, bound }.into());
            }
            Some(_) => {}
        }
        if let Some((snapshot, file)) = plan::snapshot_of(&header.name) {
            let (snapshot, file) = (snapshot.to_string(), file.to_string());
            receive_snapshot_file(tool, into, &mut rx, &header, &snapshot, &file, &mut arriving).await?;
            tracing::info!(file = %header.name, bytes = header.bytes, sha256 = %header.sha256, "received");
            got.push(header.name);
            continue;
        }
        let place = plan::placement(spec, paths, &hello.disks, &header.name)
            .ok_or_else(|| failed(format!("the source sent a file {:?} this VM has no place for", header.name)))?;
        if got.contains(&header.name) {
            return Err(failed(format!("the source sent {:?} twice", header.name)));
        }
        let _ = crate::blocking::run(|| std::fs::remove_file(&place.partial));
        let done = rx.receive(&header, &place.partial).await.map_err(ApiError::from)?;
        let overlay = place.target == paths.overlay;
        let qcow2 = overlay
            || place.target == paths.root_disk(crate::api::DiskFormat::Qcow2)
            || spec
                .disks
                .iter()
                .any(|d| d.format == crate::api::DiskFormat::Qcow2 && paths.data_disk(d) == place.target);
        if qcow2 {
            check_received(tool, &place.partial, overlay).await?;
        }
        crate::blocking::run(|| std::fs::rename(&place.partial, &place.target))
            .map_err(|e| failed(format!("{}: {e}", place.target.display())))?;
        tracing::info!(file = %header.name, bytes = header.bytes, sha256 = %done.sha256, "received");
        got.push(header.name);
    }
    if got.len() != into.announced.len() || !arriving.is_empty() {
        return Err(failed(format!("the source announced {} files and sent {}", into.announced.len(), got.len())));
    }
    Ok(got)
}

/// One file of a snapshot (module doc of [`receive_files`]): its `snapshot.json` first, read
/// back and checked ([`plan::check_snapshot_record`]); then each copy the record names, with
/// the sha256 the record gives, a qcow2 one inspected as a VM's disk is. The snapshot is
/// renamed into the staging directory when its last file arrived.
#[allow(clippy::too_many_arguments)]
async fn receive_snapshot_file(
    tool: &crate::disk::Tool,
    into: &Dest<'_>,
    rx: &mut FileReceiver,
    header: &crate::migration::files::FileHeader,
    snapshot: &str,
    file: &str,
    arriving: &mut Vec<(String, Arriving)>,
) -> Result<(), ApiError> {
    let partial = into.staging.join(format!(".{snapshot}.partial"));
    if file == snapshots::SNAPSHOT_JSON {
        let json = partial.join(file);
        crate::blocking::run(|| {
            let _ = std::fs::remove_dir_all(&partial);
            crate::state::dirs::private_dir(&partial)
        })
        .map_err(|e| failed(format!("{}: {e}", partial.display())))?;
        rx.receive(header, &json).await.map_err(ApiError::from)?;
        let bytes =
            crate::blocking::run(|| std::fs::read(&json)).map_err(|e| failed(format!("{}: {e}", json.display())))?;
        let record = plan::check_snapshot_record(snapshot, &bytes, into.announced)?;
        let left = record.disks.iter().map(|d| d.file.clone()).collect();
        arriving.push((snapshot.to_string(), Arriving { record, partial, left }));
    } else {
        let Some((_, a)) = arriving.iter_mut().find(|(n, _)| n == snapshot) else {
            return Err(plan::AnnounceError::NoRecord(snapshot.to_string()).into());
        };
        let Some(at) = a.left.iter().position(|f| f == file) else {
            return Err(failed(format!("snapshot {snapshot:?}: {file:?} is not one of its copies, or came twice")));
        };
        a.left.swap_remove(at);
        let Some(disk) = a.record.disks.iter().find(|d| d.file == file) else {
            return Err(failed(format!("snapshot {snapshot:?}: {file:?} is not one of its copies")));
        };
        if disk.sha256 != header.sha256 {
            return Err(ApiError::new(
                Code::ChecksumMismatch,
                format!("snapshot {snapshot:?}: {file} is not the copy its record names (sha256)"),
            )
            .field("files"));
        }
        let path = a.partial.join(file);
        rx.receive(header, &path).await.map_err(ApiError::from)?;
        if disk.format == crate::api::DiskFormat::Qcow2 {
            // A root copy of an image VM is an overlay naming its base image, as the VM's own.
            let overlay = disk.role == crate::api::disks::DiskRole::Root && a.record.spec.boot.image.is_some();
            check_received(tool, &path, overlay).await?;
        }
    }
    // Whole: renamed in, as vm.snapshot renames a finished snapshot.
    if let Some(i) = arriving.iter().position(|(n, a)| n == snapshot && a.left.is_empty()) {
        let (name, a) = arriving.swap_remove(i);
        let done = into.staging.join(&name);
        crate::blocking::run(|| {
            std::fs::rename(&a.partial, &done)?;
            std::fs::File::open(into.staging)?.sync_all()
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
async fn check_received(tool: &crate::disk::Tool, path: &std::path::Path, overlay: bool) -> Result<(), ApiError> {
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

/// After the commit point: the source told, and the VM started when its admitted spec says
/// running. Nothing here gives the VM up: a failed start leaves it `failed` as any start does.
async fn after_commit(op: &mut VmOp, vm: &ValidSpec, control: Option<Control>) {
    // Before the source hears of the commit (and deletes its copy): its caller may list them.
    place_snapshots(op.mgr(), op.name());
    if let Some(mut c) = control {
        if let Err(e) = c.send(&ControlMsg::Committed).await {
            // The source asks again (Query) and is answered from the record.
            tracing::warn!(error = %e, "the source was not told of the commit");
        }
    }
    tracing::info!("cold move committed: the VM is this host's");
    if vm.spec.state == DesiredState::Running {
        if let Err(e) = op.start_steps("vm.move: started on the destination").await {
            tracing::error!(error = %e.message, "the moved VM could not be started");
        }
    }
}

/// Removes every file a cold receive of `spec` may have written ([`plan::received_paths`] and
/// the snapshots' staging directory), then abandons the migration as a live one is
/// (tombstone, record removed).
async fn give_up(held: &HeldVm, spec: &VmSpec, why: &str, abandon: Abandon) -> Result<(), ApiError> {
    remove_received(held.paths(), spec)?;
    let staging = snapshots::incoming_dir(held.mgr(), held.name());
    match crate::blocking::run(|| std::fs::remove_dir_all(&staging)) {
        Ok(()) => tracing::info!(dir = %staging.display(), "removed the snapshots of the abandoned cold move"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(failed(format!("removing {}: {e}", staging.display()))),
    }
    abandon(held, why).await
}

/// Removes the files of [`plan::received_paths`] (absent is fine) and the disk directory when
/// empty.
///
/// # Errors
/// 4001 when one cannot be removed.
fn remove_received(paths: &VmPaths, spec: &VmSpec) -> Result<(), ApiError> {
    for path in plan::received_paths(spec, paths) {
        match crate::blocking::run(|| std::fs::remove_file(&path)) {
            Ok(()) => tracing::info!(path = %path.display(), "removed a file of the abandoned cold move"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(failed(format!("removing {}: {e}", path.display()))),
        }
    }
    let _ = crate::blocking::run(|| std::fs::remove_dir(&paths.disk_dir));
    Ok(())
}

/// Recovery of the destination's record of a cold move ([`plan::destination_action`]): before
/// the commit, what arrived goes and the migration is abandoned; after it, the VM is an
/// ordinary one. Returns true when settled here.
///
/// # Errors
/// As [`give_up`].
pub(in crate::lifecycle) async fn recover(held: &HeldVm, rec: &VmRecord, abandon: Abandon) -> Result<bool, ApiError> {
    match plan::destination_action(rec.migration().map(|m| m.phase)) {
        DestinationAction::Ordinary => {
            place_snapshots(held.mgr(), held.name());
            Ok(false)
        }
        DestinationAction::Abandon => {
            tracing::info!(vm = held.name(), "abandoning a cold move a restart interrupted");
            give_up(held, &rec.spec, "cold move abandoned: vmhostd restarted before the commit", abandon).await?;
            Ok(true)
        }
    }
}
