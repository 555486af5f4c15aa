//! The destination of a cold move: `vm.migrate_in` with `mode: cold` admitted the VM and
//! recorded it `incoming` (lifecycle/migrate/incoming.rs, as for a live migration, no NIC and
//! no QEMU made); [`receive`] is its task. It reads the source's `Hello` and `Announce` (every
//! file to come, checked against the admitted spec by [`super::plan::check_announced`] and its
//! room reserved before a byte is written), then each file of the `files` channel into the place
//! a create would give it ([`super::plan::placement`]) under a partial name, renamed once its
//! sha256 matched, and each snapshot's files into a staging directory
//! ([`carry::receive_snapshot_file`]), and a `tpm` VM's state files beside the disks
//! ([`super::plan::tpm_staged`]); answers `Ready` when every announced file arrived; on `Commit`
//! puts the TPM state in place ([`put_back_tpm`], crash point `move:tpm`), then
//! records the VM `stopped` with phase `committed` (the commit point: the VM is this host's from
//! this write), puts the snapshots in place ([`carry::place_snapshots`]), answers `Committed`, and
//! starts the VM when its admitted spec says `running` (a `stop: true` move of a running VM).
//!
//! Anything that goes wrong before the commit gives the move up: the source is told (`Abort`
//! with the code: 2003 for a file whose sha256 differs), every file this move could have written
//! is removed ([`remove_received`]), then the migration is abandoned as a live one is (the
//! snapshots' staging directory removed and the
//! destination's `incoming::abandon`: tombstone, record removed; its caller hands it in as an
//! [`Abandon`], since the incoming side is the one that starts this task). [`recover`] does the
//! same after a restart before the commit.

use super::super::super::held::HeldVm;
use super::super::super::op::VmOp;
use super::super::carry;
use super::plan::{self, DestinationAction};
use crate::api::{ApiError, Code, DesiredState, VmSpec, VmStatus};
use crate::migration::files::FileReceiver;
use crate::migration::{AnnouncedFile, ChannelKind, Control, ControlMsg, Expectation, Hello, Secret};
use crate::qemu::argv::VmPaths;
use crate::state::migration::MigrationPhase;
use crate::state::VmRecord;
use crate::validate::ValidSpec;
use std::future::Future;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
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
    let channel = carry::next_channel(&mut exp, ChannelKind::Control, Duration::from_secs(timeout_s)).await?;
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
    let staging = carry::prepare_staging(op.mgr(), op.name(), room.snapshots > 0)?;
    let _room = carry::reserve_room(op.mgr(), &paths, room)?;
    let stream = carry::next_channel(&mut exp, ChannelKind::Files, FILES_TIMEOUT).await?;
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
    // Before the commit: the VM never starts here without the TPM it had there, and a failure
    // leaves it the source's.
    put_back_tpm(op, &announced).await?;
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

/// The TPM state that arrived (`tpm:FILE` names of `announced`, kept at [`plan::tpm_staged`])
/// put in the VM's state directory as `qemu.user`'s files ([`crate::tpm::put_back_state`],
/// through the spawner: the daemon cannot write files swtpm would load), then the arrived
/// copies removed; crash point `move:tpm`. Nothing when none came (a `tpm` VM never started has
/// no state yet; its first start makes it).
///
/// # Errors
/// 4001 when a copy cannot be opened or the state cannot be written.
async fn put_back_tpm(op: &VmOp, announced: &[AnnouncedFile]) -> Result<(), ApiError> {
    let paths = op.paths().clone();
    let names: Vec<&str> = announced.iter().filter_map(|f| plan::tpm_of(&f.name)).collect();
    if names.is_empty() {
        return Ok(());
    }
    let mut files = Vec::new();
    for name in &names {
        let staged = plan::tpm_staged(&paths, name);
        let opened = crate::blocking::run(|| {
            std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&staged)
        })
        .map_err(|e| failed(format!("the TPM state that arrived, {}: {e}", staged.display())))?;
        files.push((name.to_string(), std::os::fd::OwnedFd::from(opened)));
    }
    crate::tpm::put_back_state(&paths, files, op.mgr().config.qemu_user)
        .await
        .map_err(|e| failed(format!("putting the TPM state in place: {e}")))?;
    for name in names {
        let staged = plan::tpm_staged(&paths, name);
        // A root-owned copy of the TPM's secrets must not outlive the move: still before the
        // commit, so failing here gives the move up (which removes the staged files too).
        crate::blocking::run(|| std::fs::remove_file(&staged))
            .map_err(|e| failed(format!("removing the TPM state as it arrived, {}: {e}", staged.display())))?;
    }
    tracing::info!("the TPM state that arrived is in place");
    op.crashpoint("move:tpm");
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

/// Where a cold receive puts what arrives.
struct Dest<'a> {
    spec: &'a VmSpec,
    paths: &'a VmPaths,
    hello: &'a Hello,
    announced: &'a [AnnouncedFile],
    /// The snapshots' staging directory.
    staging: &'a Path,
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
    let mut arriving: Vec<(String, carry::Arriving)> = Vec::new();
    while let Some(header) = rx.next(FILES_TIMEOUT).await.map_err(ApiError::from)? {
        carry::check_header(into.announced, &got, &header)?;
        if let Some(state) = plan::tpm_of(&header.name) {
            // The TPM's state: kept as it arrived (the channel checked its sha256) until the
            // commit puts it back ([`put_back_tpm`]).
            let staged = plan::tpm_staged(paths, state);
            let _ = crate::blocking::run(|| std::fs::remove_file(&staged));
            let bound = carry::written_bound(into.announced, &header.name);
            let done = rx.receive_within(&header, &staged, bound).await.map_err(ApiError::from)?;
            tracing::info!(file = %header.name, bytes = done.bytes, sha256 = %done.sha256, "received");
            got.push(header.name);
            continue;
        }
        if let Some((snapshot, file)) = plan::snapshot_of(&header.name) {
            let (snapshot, file) = (snapshot.to_string(), file.to_string());
            let (announced, staging) = (into.announced, into.staging);
            carry::receive_snapshot_file(tool, announced, staging, &mut rx, &header, &snapshot, &file, &mut arriving)
                .await?;
            got.push(header.name);
            continue;
        }
        let place = plan::placement(spec, paths, &hello.disks, &header.name)
            .ok_or_else(|| failed(format!("the source sent a file {:?} this VM has no place for", header.name)))?;
        let _ = crate::blocking::run(|| std::fs::remove_file(&place.partial));
        let bound = carry::written_bound(into.announced, &header.name);
        let done = rx.receive_within(&header, &place.partial, bound).await.map_err(ApiError::from)?;
        let overlay = place.target == paths.overlay;
        let qcow2 = overlay
            || place.target == paths.root_disk(crate::api::DiskFormat::Qcow2)
            || spec
                .disks
                .iter()
                .any(|d| d.format == crate::api::DiskFormat::Qcow2 && paths.data_disk(d) == place.target);
        if qcow2 {
            carry::check_received(tool, &place.partial, overlay).await?;
        }
        // The name durable before `Ready`: on `Committed` the source deletes its copy.
        crate::blocking::run(|| {
            std::fs::rename(&place.partial, &place.target)?;
            match place.target.parent() {
                Some(dir) => std::fs::File::open(dir)?.sync_all(),
                None => Ok(()),
            }
        })
        .map_err(|e| failed(format!("{}: {e}", place.target.display())))?;
        tracing::info!(file = %header.name, bytes = header.bytes, sha256 = %done.sha256, "received");
        got.push(header.name);
    }
    if got.len() != into.announced.len() || !arriving.is_empty() {
        return Err(failed(format!("the source announced {} files and sent {}", into.announced.len(), got.len())));
    }
    Ok(got)
}

/// After the commit point: the source told, and the VM started when its admitted spec says
/// running. Nothing here gives the VM up: a failed start leaves it `failed` as any start does.
async fn after_commit(op: &mut VmOp, vm: &ValidSpec, control: Option<Control>) {
    // Before the source hears of the commit (and deletes its copy): its caller may list them.
    carry::place_snapshots(op.mgr(), op.name());
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

/// Removes every file a cold receive of `spec` may have written ([`plan::received_paths`]),
/// then abandons the migration as a live one is (the snapshots' staging directory,
/// tombstone, record removed).
async fn give_up(held: &HeldVm, spec: &VmSpec, why: &str, abandon: Abandon) -> Result<(), ApiError> {
    remove_received(held.paths(), spec)?;
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
    // The TPM state put back before a commit that did not come (no swtpm runs for a VM not
    // yet this host's).
    crate::blocking::run(|| crate::tpm::remove_state(paths))?;
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
            carry::place_snapshots(held.mgr(), held.name());
            Ok(false)
        }
        DestinationAction::Abandon => {
            tracing::info!(vm = held.name(), "abandoning a cold move a restart interrupted");
            give_up(held, &rec.spec, "cold move abandoned: vmhostd restarted before the commit", abandon).await?;
            Ok(true)
        }
    }
}
