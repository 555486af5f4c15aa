//! The destination of a live migration (`vm.migrate_in`, docs/moving.md): this host admits the
//! VM as a create would, waits for the source, makes the VM's disks and a paused QEMU that
//! takes the source's disks and memory, and commits only when the source asks, after QEMU says
//! the memory arrived. Until that commit the guest is the source's: anything that goes wrong
//! here gives up the migration ([`abandon`]) and removes everything this host made, leaving a
//! tombstone ([`tombstone`]) so that a source that asks later is told to keep its guest.
//!
//! Order: [`migrate_in`] refuses what cannot move ([`decide::refuse_unmovable`]), admits the
//! spec (the create's admission, [`Manager::reserve_op`]), records `incoming` and answers;
//! [`receive`], a task holding the VM's operation, then waits for the source's control
//! channel and `Hello`, makes the disks and launches QEMU with the create's steps
//! ([`VmOp::make_overlay`], a `boot.disk` VM's empty root disk ([`root::make_root_disk`]),
//! [`VmOp::make_data_disks`], [`VmOp::launch_as`]), prepares QEMU's
//! side ([`crate::qemu::migration`]), answers `Ready`, relays the disk streams and hands QEMU
//! the memory stream ([`serve_channels`]), and on `Commit` writes the commit point into the
//! record, resumes the guest and answers `Committed`. [`recover`] settles an incoming record
//! after a restart ([`decide::recover_action`]).

mod decide;
mod errors;
mod root;
mod tombstone;

use super::super::held::HeldVm;
use super::super::op::VmOp;
use super::super::teardown::Devices;
use super::super::Manager;
use super::carry;
use crate::api::migration::{MigrateInParams, MigrateInResult, MoveMode};
use crate::api::{ApiError, DesiredState, VmStatus};
use crate::migration::{ChannelKind, Control, ControlMsg, Expectation, Secret};
use crate::process::ProcessIdentity;
use crate::qemu::migration as qemu_mig;
use crate::qemu::qmp::Qmp;
use crate::state::migration::{MigrationPhase, MigrationRecord, MigrationRole};
use crate::state::VmRecord;
use crate::validate::{validate_spec, ValidSpec};
use decide::{QemuSeen, RecoverAction};
use errors::IncomingError;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// Longest the source may take from opening the control channel to its `Hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest the source may take to open the `files` stream of the snapshots, and between two
/// of its chunks.
const FILES_TIMEOUT: Duration = Duration::from_secs(120);

/// Longest the source may stay silent between `Ready` and `Commit`: its own limit (`vm.migrate`
/// `timeout_s`, default 3600 s) with room to send its `Abort`.
const SERVE_TIMEOUT: Duration = Duration::from_secs(3600 + 120);

/// How long to wait for QEMU's QMP monitor.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);

/// QEMU's NBD server's listening socket in the VM's run dir (the relay connects to it).
const NBD_SOCKET: &str = "migration-nbd.sock";

/// How long a commit waits for QEMU here to finish loading the stream the source completed.
const COMMIT_LOAD_WAIT: Duration = Duration::from_secs(10);

/// `vm.migrate_in`: admits `p.spec` as a create would, records it `incoming` and answers where
/// and with what secret the source sends it; the rest runs in a task ([`receive`]).
///
/// # Errors
/// 3001 `migration.listen` without a migration port; 4097 `passthrough` and 2001
/// `spec.nics[i].mac` for what cannot migrate live; 3003 when a VM of the name or data
/// disks kept for it exist; as `vm.create`'s admission (2001/3001/3002/3003/4002). Nothing is
/// made or recorded for any of these.
pub(crate) async fn migrate_in(mgr: &Arc<Manager>, p: MigrateInParams) -> Result<MigrateInResult, ApiError> {
    let span = tracing::info_span!("vm.migrate_in", vm = %p.spec.name);
    async move {
        let address = mgr.migrations.address().ok_or(IncomingError::NoPort)?;
        decide::refuse_unmovable(&p.spec, p.mode)?;
        let spec = decide::admitted_spec(&p.spec, p.mode);
        let name = spec.name.clone();
        let vm = validate_spec(&spec, &mgr.config)?;
        refuse_taken_name(mgr, &name)?;
        // The create's admission, in the create's order: files, disk space, capture sources,
        // placement; then capacity and conflicts with the record write (reserve_op).
        super::super::launch::check_launch_files(mgr, &vm).await?;
        super::super::data_disks::admit_disk_space(mgr, None, &vm.spec)?;
        super::super::capture::check_sources(mgr, &vm.spec).await?;
        super::super::placement::check(mgr, &vm.spec)?;
        let secret = Secret::generate().map_err(ApiError::from)?;
        // Registered before the record: a second migration of the name is refused here, with
        // nothing recorded.
        let expectation = mgr.migrations.expect(&name, &secret).map_err(ApiError::from)?;
        let record = MigrationRecord {
            role: MigrationRole::Incoming,
            mode: p.mode,
            peer: String::new(),
            secret: secret.to_hex(),
            phase: MigrationPhase::Sending,
            since: crate::api::now_rfc3339(),
            stopped: false,
        };
        let op = mgr.reserve_incoming_op(&vm.spec, record)?;
        op.crashpoint("migrate_in:recorded");
        let timeout_s = mgr.migrations.prepare_timeout().as_secs();
        if p.mode == MoveMode::Cold {
            // The cold receive (lifecycle/migrate/cold.rs): the same admission and record, then
            // files instead of a paused QEMU.
            let abandon: super::cold::Abandon = |h, why| Box::pin(abandon(h, why));
            let task = super::cold::receive(op, vm, expectation, secret.clone(), timeout_s, abandon);
            tokio::spawn(task.instrument(tracing::Span::current()));
        } else {
            let task = receive(op, vm, expectation, secret.clone(), timeout_s);
            tokio::spawn(task.instrument(tracing::Span::current()));
        }
        Ok(MigrateInResult { name, address, secret: secret.to_hex(), expires_in_s: timeout_s })
    }
    .instrument(span)
    .await
}

/// 3003 when a VM named `name` exists here or data disks kept from one are on this host (a
/// create would take them back; a migration must never overwrite them).
fn refuse_taken_name(mgr: &Manager, name: &str) -> Result<(), IncomingError> {
    if mgr.record(name).is_ok() {
        return Err(IncomingError::Exists(name.to_string()));
    }
    let kept: Vec<String> =
        super::super::data_disks::kept_disks(mgr).into_iter().filter(|k| k.vm == name).map(|k| k.name).collect();
    if !kept.is_empty() {
        return Err(IncomingError::KeptDisks { vm: name.to_string(), disks: kept });
    }
    Ok(())
}

/// What the steps before the commit hand to the steps after it.
struct Committed {
    /// The VM's QEMU.
    id: ProcessIdentity,
    /// Its QMP connection (shared with the channel task until the commit).
    qmp: Arc<tokio::sync::Mutex<Qmp>>,
}

/// Aborts the task it holds when dropped: the channel task lives only as long as the
/// migration's steps.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The task of one incoming migration: until the commit ([`until_commit`]), any failure gives
/// the migration up ([`abandon`]) and tells the source why; after it, the guest is this host's
/// ([`after_commit`]). Holds the VM's operation (its busy flag) throughout.
async fn receive(mut op: VmOp, vm: ValidSpec, exp: Expectation, secret: Secret, timeout_s: u64) {
    let mut control: Option<Control> = None;
    match until_commit(&mut op, &vm, exp, &secret, timeout_s, &mut control).await {
        Ok(done) => after_commit(&op, done, control).await,
        Err(e) => {
            tracing::warn!(error = %e.message, "incoming migration abandoned");
            if let Some(c) = control.as_mut() {
                let abort = ControlMsg::Abort { code: e.code.as_i32(), message: e.message.clone() };
                if let Err(send) = c.send(&abort).await {
                    tracing::info!(error = %send, "the source was not told of the abort");
                }
            }
            if let Err(undo) = abandon(op.held(), &format!("incoming migration abandoned: {}", e.message)).await {
                tracing::error!(error = %undo, "abandoning the incoming migration failed: the record keeps what is left");
            }
        }
    }
}

/// The steps up to and including the commit point (module doc). Every error is the
/// migration's end: the caller abandons it.
async fn until_commit(
    op: &mut VmOp,
    vm: &ValidSpec,
    mut exp: Expectation,
    secret: &Secret,
    timeout_s: u64,
    control: &mut Option<Control>,
) -> Result<Committed, ApiError> {
    let mgr = Arc::clone(op.mgr());
    let paths = op.paths().clone();
    // The source's control channel first: it says what to make.
    let channel = loop {
        let ch = exp.next(Duration::from_secs(timeout_s)).await.ok_or(IncomingError::PrepareTimeout(timeout_s))?;
        if ch.kind == ChannelKind::Control {
            break ch;
        }
        // Nothing can use a stream before Ready: the source is out of step.
        tracing::warn!(kind = ?ch.kind, "a stream before the control channel: closed");
    };
    let peer = channel.stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let c = control.insert(Control::new(channel.stream, secret));
    let hello = match c.recv(HELLO_TIMEOUT).await.map_err(|e| IncomingError::Control(e.to_string()))? {
        ControlMsg::Hello(hello) => *hello,
        ControlMsg::Abort { code, message } => return Err(IncomingError::SourceAborted { code, message }.into()),
        _ => return Err(IncomingError::NoHello.into()),
    };
    let disks = qemu_mig::disks_of(&vm.spec);
    let devices: Vec<String> = disks.iter().map(|d| d.device.clone()).collect();
    let macs: Vec<String> = op.record()?.nics.iter().map(|n| n.mac.clone()).collect();
    decide::check_hello(&vm.spec, &macs, &devices, &hello)?;
    if vm.spec.boot.firmware == crate::api::Firmware::Uefi {
        // The template this VM's store is made from here (the secure one with Secure Boot).
        let template =
            crate::qemu::firmware::Pair::of(&mgr.config.firmware, vm.spec.boot.secure_boot).vars.to_path_buf();
        let bytes = crate::blocking::run(|| std::fs::metadata(&template).map(|m| m.len()))
            .map_err(|source| IncomingError::Io { what: "reading the UEFI variables template's size", source })?;
        decide::check_uefi_vars(&hello, bytes)?;
    }
    // The snapshots come after the Hello (snapshot files only: the disks travel as QEMU's
    // mirrors), checked and their room admitted before a byte is written.
    let announced = match c.recv(HELLO_TIMEOUT).await.map_err(|e| IncomingError::Control(e.to_string()))? {
        ControlMsg::Announce { files } => files,
        ControlMsg::Abort { code, message } => return Err(IncomingError::SourceAborted { code, message }.into()),
        _ => return Err(IncomingError::Control("expected the announcement of the snapshots".into()).into()),
    };
    let snapshot_bytes = carry::check_live_announcement(&vm.spec, &announced).map_err(ApiError::from)?;
    op.update("the source connected", |r| super::adopt_source(r, peer, &hello))?;
    // Checked even when none come: the VM must not inherit another's snapshots of its name.
    let staging = carry::prepare_staging(op.mgr(), op.name(), !announced.is_empty())?;
    if !announced.is_empty() {
        receive_snapshots(op, &mut exp, secret, &announced, &staging, snapshot_bytes).await?;
    }
    // The create's disk steps, then its launch with QEMU waiting for the incoming state.
    op.remove_stale_overlays()?;
    op.clear_orphan_disks()?;
    op.make_overlay(vm).await?;
    root::make_root_disk(op, &vm.spec, &hello).await?;
    op.make_data_disks(&vm.spec, true).await?;
    let id = op.launch_as(vm, VmStatus::Incoming, true).await?;
    op.crashpoint("migrate_in:launched");
    let mut qmp = Qmp::connect(&paths.qmp, QMP_TIMEOUT)
        .await
        .map_err(qemu_mig::MigrationQemuError::Qmp)
        .map_err(IncomingError::Qemu)?;
    check_machine(&mut qmp, &hello).await?;
    let qmp = Arc::new(tokio::sync::Mutex::new(qmp));
    let nbd = paths.run_dir.join(NBD_SOCKET);
    prepare_qemu(&mgr, &paths.run_dir, &nbd, secret, &disks, &qmp).await?;
    let exports = disks.iter().map(|d| d.export.clone()).collect();
    c.send(&ControlMsg::Ready { exports }).await.map_err(|e| IncomingError::Control(e.to_string()))?;
    let channels =
        AbortOnDrop(tokio::spawn(serve_channels(exp, Arc::clone(&qmp), nbd).instrument(tracing::Span::current())));
    loop {
        match c.recv(SERVE_TIMEOUT).await.map_err(|e| IncomingError::Control(e.to_string()))? {
            ControlMsg::Commit => break,
            ControlMsg::Abort { code, message } => return Err(IncomingError::SourceAborted { code, message }.into()),
            other => tracing::warn!(message = ?other, "an unexpected control message: ignored"),
        }
    }
    drop(channels);
    // The source commits once its QEMU says `completed`; ours may still be loading the last
    // of the device state for a moment: wait for it (a failed or cancelled stream ends it).
    let deadline = tokio::time::Instant::now() + COMMIT_LOAD_WAIT;
    loop {
        let status = {
            let mut q = qmp.lock().await;
            qemu_mig::incoming_status(&mut q).await.map_err(IncomingError::Qemu)?
        };
        match status.status.as_str() {
            "completed" => break,
            "active" | "setup" | "device" if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            _ => return Err(IncomingError::NotCompleted(status.status).into()),
        }
    }
    op.crashpoint("migrate_in:commit");
    // The commit point: from this write on, the guest is this host's.
    op.update_status("committed: the guest runs here", VmStatus::Running, |r| {
        if let Some(m) = r.migration.as_mut() {
            m.phase = MigrationPhase::Committed;
        }
    })?;
    op.crashpoint("migrate_in:committed");
    Ok(Committed { id, qmp })
}

/// The snapshots the source announced, over one `files` stream into the staging directory
/// `staging` ([`carry`]); placed as the VM's after the commit ([`after_commit`], or recovery).
///
/// # Errors
/// 3002 when they do not fit; as [`carry::receive_snapshots`].
async fn receive_snapshots(
    op: &VmOp,
    exp: &mut Expectation,
    secret: &Secret,
    announced: &[crate::migration::AnnouncedFile],
    staging: &Path,
    bytes: u64,
) -> Result<(), ApiError> {
    let (mgr, paths) = (op.mgr(), op.paths());
    let _room = carry::reserve_room(mgr, paths, super::cold::plan::Room { disks: 0, snapshots: bytes })?;
    let stream = carry::next_channel(exp, ChannelKind::Files, FILES_TIMEOUT).await?;
    let tool = mgr.disk_tool();
    let got = carry::receive_snapshots(&tool, announced, staging, stream, secret, FILES_TIMEOUT).await?;
    tracing::info!(files = got.len(), bytes, "the VM's snapshots arrived");
    Ok(())
}

/// QEMU's side of the destination: the TLS credentials keyed from the secret, the NBD server on
/// a listening socket in the run dir (the relay connects to it), every disk exported.
async fn prepare_qemu(
    mgr: &Manager,
    run_dir: &Path,
    nbd: &Path,
    secret: &Secret,
    disks: &[qemu_mig::MigDisk],
    qmp: &tokio::sync::Mutex<Qmp>,
) -> Result<(), IncomingError> {
    let mut q = qmp.lock().await;
    let key = secret.tls_psk_hex();
    let user = mgr.config.qemu_user;
    let dir = crate::blocking::run(|| qemu_mig::psk_dir(run_dir, &key, user.as_ref()))?;
    qemu_mig::add_tls(&mut q, dir.as_fd(), qemu_mig::Endpoint::Server).await?;
    let listener = crate::blocking::run(|| {
        let _ = std::fs::remove_file(nbd);
        std::os::unix::net::UnixListener::bind(nbd)
    })
    .map_err(|source| IncomingError::Io { what: "binding the NBD socket", source })?;
    // QEMU gets its own copy of the listener (getfd); ours closes when this returns.
    qemu_mig::start_nbd_server(&mut q, listener.as_fd()).await?;
    qemu_mig::export_disks(&mut q, disks).await?;
    Ok(())
}

/// Whether this host's QEMU, up and waiting, gives the guest the machine the source's runs
/// ([`super::machine`]); before `Ready`, so nothing of the guest has moved when it refuses.
async fn check_machine(qmp: &mut Qmp, hello: &crate::migration::Hello) -> Result<(), ApiError> {
    let Some(source) = &hello.machine else {
        tracing::warn!("the source did not say which machine its guest runs on: not compared");
        return Ok(());
    };
    let here =
        super::machine::facts(qmp).await.map_err(qemu_mig::MigrationQemuError::Qmp).map_err(IncomingError::Qemu)?;
    super::machine::check(source, &here).map_err(|m| IncomingError::Machine(m).into())
}

/// The source's streams after `Ready`: each disk's relayed to QEMU's NBD server (its TLS runs
/// end to end through the relay), the memory stream handed to QEMU. Runs until the migration's
/// steps drop it ([`AbortOnDrop`]); dropping it drops the expectation too.
async fn serve_channels(mut exp: Expectation, qmp: Arc<tokio::sync::Mutex<Qmp>>, nbd: PathBuf) {
    loop {
        let Some(ch) = exp.next(SERVE_TIMEOUT).await else { return };
        match ch.kind {
            ChannelKind::Disk(export) => {
                let nbd = nbd.clone();
                tokio::spawn(
                    async move {
                        match crate::migration::relay(ch.stream, &nbd).await {
                            Ok(r) => {
                                tracing::info!(export, to_qemu = r.to_qemu, to_peer = r.to_peer, "disk stream ended")
                            }
                            Err(e) => tracing::warn!(export, error = %e, "disk stream failed"),
                        }
                    }
                    .instrument(tracing::Span::current()),
                );
            }
            ChannelKind::Ram => {
                let mut q = qmp.lock().await;
                // QEMU holds its own copy of the stream from here; ours closes at the end of
                // this arm. A failure shows at the commit (the state never completes).
                if let Err(e) = qemu_mig::start_incoming(&mut q, ch.stream.as_fd()).await {
                    tracing::warn!(error = %e, "QEMU refused the memory stream");
                }
            }
            kind => tracing::warn!(kind = ?kind, "an unexpected stream during a live migration: closed"),
        }
    }
}

/// After the commit point: QEMU's migration side ended, the guest resumed, the VM watched as
/// any running VM (exit watcher, agent), and the source told. Nothing here gives the guest up:
/// a failure is logged and recorded, and the VM stays this host's.
async fn after_commit(op: &VmOp, done: Committed, control: Option<Control>) {
    let Committed { id, qmp } = done;
    {
        let mut q = qmp.lock().await;
        if let Err(e) = qemu_mig::finish_incoming(&mut q).await {
            tracing::warn!(error = %e, "the NBD server was not stopped");
        }
        if let Err(e) = qemu_mig::resume(&mut q).await {
            // The record says running; the guest stays paused until an operator acts.
            tracing::error!(error = %e, "the migrated guest could not be resumed");
        }
    }
    drop(qmp);
    let run_dir = op.paths().run_dir.clone();
    if let Err(e) = crate::blocking::run(|| qemu_mig::remove_psk_dir(&run_dir)) {
        tracing::warn!(error = %e, "the migration's TLS key directory stays");
    }
    let _ = crate::blocking::run(|| std::fs::remove_file(run_dir.join(NBD_SOCKET)));
    let held = op.held();
    if let Err(e) = held.mark_running(id, "vm.migrate_in committed") {
        tracing::error!(error = %e, "the migrated VM's running state was not recorded");
    }
    // What the steps made is the VM's now.
    if let Err(e) = held.end_root_disk_import().and_then(|()| held.end_disk_tracking()) {
        tracing::error!(error = %e, "the migrated VM's disks were not recorded as its own");
    }
    // Before the source hears of the commit (and deletes its copy).
    carry::place_snapshots(op.mgr(), op.name());
    if let Some(mut c) = control {
        if let Err(e) = c.send(&ControlMsg::Committed).await {
            // The source asks again (Query) and is answered from the record.
            tracing::warn!(error = %e, "the source was not told of the commit");
        }
    }
    tracing::info!("incoming migration committed: the guest runs here");
}

/// Gives up the incoming migration of the held VM (before its commit): its QEMU killed, a
/// tombstone written, the record `destroying`, then what the migration made removed in reverse
/// (run dir, taps and agent; overlay, UEFI variables and seed; the data disks and the root
/// disk it made), and the record removed. The operation's task and recovery share it; each step is idempotent, so an
/// abandon a crash interrupted is finished by the next.
///
/// # Errors
/// 4001 when QEMU cannot be ended, the tombstone cannot be written or a file cannot be removed:
/// the record then says `failed` and keeps what still exists (a restart tries again).
pub(in crate::lifecycle) async fn abandon(held: &HeldVm, why: &str) -> Result<(), ApiError> {
    let result = abandon_steps(held, why).await;
    if let Err(e) = &result {
        let le = super::super::last_error(e);
        if let Err(save) = held.update_status("abandon failed", VmStatus::Failed, |r| r.last_error = Some(le)) {
            tracing::error!(error = %save, "cannot record the failed abandon");
        }
    }
    result
}

async fn abandon_steps(held: &HeldVm, why: &str) -> Result<(), ApiError> {
    let (mgr, name) = (held.mgr(), held.name());
    let rec = held.record()?;
    if let Some(id) = super::super::launch::find_live(mgr, name, rec.process.as_ref())? {
        mgr.processes.kill(name, &id).await?;
    }
    // Its swtpm ends with QEMU, and must be gone before its state directory is removed.
    crate::tpm::stop(name, rec.tpm_process.as_ref()).await;
    // The tombstone before the record goes: a source's Query is answered at every moment.
    if let Some(m) = rec.migration() {
        tombstone::write(&mgr.config.paths.state, name, &m.secret)
            .map_err(|source| IncomingError::Io { what: "writing the migration's tombstone", source })?;
    }
    held.update_status(why, VmStatus::Destroying, |r| {
        r.process = None;
        r.spec.state = DesiredState::Stopped;
    })?;
    held.release_host_side(Devices::Release).await?;
    held.remove_run_files()?;
    // Snapshots that arrived for a move that did not commit (live or cold).
    carry::remove_staging(mgr, name)?;
    // Only disks this migration made: a name with kept disks was refused before anything.
    held.undo_data_disks();
    // A received root disk is this host's own file, never an import to give back: deleted.
    held.dispose_root_disk()?;
    mgr.forget(name, "incoming migration abandoned")
}

/// Recovery of an incoming record after a vmhostd restart ([`decide::recover_action`]):
/// before the commit the migration is abandoned ([`abandon`]); a committed guest whose QEMU is
/// still paused is resumed. Returns true when the VM is settled, false when recovery goes on
/// as for any VM (re-adopting a live QEMU, recording a dead one).
///
/// # Errors
/// As [`abandon`].
pub(in crate::lifecycle) async fn recover(
    _mgr: &Arc<Manager>,
    held: &HeldVm,
    rec: &VmRecord,
    live: Option<ProcessIdentity>,
) -> Result<bool, ApiError> {
    let mut qmp = None;
    let seen = match &live {
        None => QemuSeen::Gone,
        Some(_) => match Qmp::connect(&held.paths().qmp, QMP_TIMEOUT).await {
            Ok(mut q) => {
                let status = q.query_status().await.ok();
                qmp = Some(q);
                QemuSeen::Running(status)
            }
            Err(e) => {
                tracing::warn!(vm = held.name(), error = %e, "QMP unreachable while settling an incoming migration");
                QemuSeen::Running(None)
            }
        },
    };
    match decide::recover_action(rec.status, rec.migration(), &seen) {
        RecoverAction::Abandon => {
            drop(qmp);
            tracing::info!(vm = held.name(), "abandoning an incoming migration a restart interrupted");
            abandon(held, "incoming migration abandoned: vmhostd restarted before the commit").await?;
            Ok(true)
        }
        RecoverAction::ResumeThenOrdinary => {
            if let Some(q) = qmp.as_mut() {
                // Idempotent: the NBD server may already be stopped.
                let _ = qemu_mig::finish_incoming(q).await;
                match qemu_mig::resume(q).await {
                    Ok(()) => tracing::info!(vm = held.name(), "resumed a migrated guest left paused by a restart"),
                    Err(e) => tracing::error!(vm = held.name(), error = %e, "a migrated guest could not be resumed"),
                }
            }
            let _ = crate::blocking::run(|| qemu_mig::remove_psk_dir(&held.paths().run_dir));
            // A crash may fall between the commit write and the snapshots' rename.
            carry::place_snapshots(held.mgr(), held.name());
            Ok(false)
        }
        RecoverAction::Ordinary => {
            if rec.migration().is_some_and(|m| m.phase == MigrationPhase::Committed) {
                carry::place_snapshots(held.mgr(), held.name());
            }
            Ok(false)
        }
    }
}
