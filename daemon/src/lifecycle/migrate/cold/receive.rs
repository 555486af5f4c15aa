//! The destination of a cold move: `vm.migrate_in` with `mode: cold` admitted the VM and
//! recorded it `incoming` (lifecycle/migrate/incoming.rs, as for a live migration, no NIC and
//! no QEMU made); [`receive`] is its task. It reads the source's `Hello`, then each file of the
//! `files` channel into the place a create would give it ([`super::plan::placement`]) under a
//! partial name, renamed once its sha256 matched; answers `Ready` when every announced file
//! arrived; on `Commit` records the VM `stopped` with phase `committed` (the commit point: the
//! VM is this host's from this write), answers `Committed`, and starts the VM when its admitted
//! spec says `running` (a `stop: true` move of a running VM).
//!
//! Anything that goes wrong before the commit gives the move up: the source is told (`Abort`
//! with the code: 2003 for a file whose sha256 differs), every file this move could have written
//! is removed ([`remove_received`]), then the migration is abandoned as a live one is (the
//! destination's `incoming::abandon`: tombstone, record removed; its caller hands it in as an
//! [`Abandon`], since the incoming side is the one that starts this task). [`recover`] does the
//! same after a restart before the commit.

use super::super::super::held::HeldVm;
use super::super::super::op::VmOp;
use super::plan::{self, DestinationAction};
use crate::api::{ApiError, Code, DesiredState, VmSpec, VmStatus};
use crate::migration::files::FileReceiver;
use crate::migration::{ChannelKind, Control, ControlMsg, Expectation, Hello, Secret};
use crate::qemu::argv::VmPaths;
use crate::state::migration::MigrationPhase;
use crate::state::VmRecord;
use crate::validate::ValidSpec;
use std::future::Future;
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
    let stream = next_channel(&mut exp, ChannelKind::Files, FILES_TIMEOUT).await?;
    drop(exp); // nothing more is expected: a late stream of this VM is refused
    let tool = op.mgr().disk_tool();
    let got = receive_files(&tool, &vm.spec, &paths, &hello, stream, secret).await?;
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

/// Reads every file of the `files` channel into its place; returns their wire names.
///
/// # Errors
/// 2003 for a file whose bytes do not have the sha256 announced (its partial file removed);
/// 4001 for a name the spec has no place for, a file sent twice, one `Hello` did not announce
/// or one missing, or a failed stream or file.
async fn receive_files(
    tool: &crate::disk::Tool,
    spec: &VmSpec,
    paths: &VmPaths,
    hello: &Hello,
    stream: std::net::TcpStream,
    secret: &Secret,
) -> Result<Vec<String>, ApiError> {
    let mut rx = FileReceiver::new(stream, secret);
    let mut got: Vec<String> = Vec::new();
    while let Some(header) = rx.next(FILES_TIMEOUT).await.map_err(ApiError::from)? {
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
    if got.len() != hello.disks.len() {
        return Err(failed(format!("the source announced {} files and sent {}", hello.disks.len(), got.len())));
    }
    Ok(got)
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
/// then abandons the migration as a live one is (tombstone, record removed).
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
        DestinationAction::Ordinary => Ok(false),
        DestinationAction::Abandon => {
            tracing::info!(vm = held.name(), "abandoning a cold move a restart interrupted");
            give_up(held, &rec.spec, "cold move abandoned: vmhostd restarted before the commit", abandon).await?;
            Ok(true)
        }
    }
}
