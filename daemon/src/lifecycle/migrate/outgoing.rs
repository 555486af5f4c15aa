//! The source's side of a live migration: `vm.migrate` sends a running VM to a destination
//! prepared with `vm.migrate_in` (docs/moving.md), and a restart settles one it left unfinished.
//!
//! The guest is this host's until the destination says `Committed`; the record says how far
//! the migration got ([`crate::state::migration`]) before each step that depends on it. Order
//! of `vm.migrate`:
//!
//! 1. refusals before anything ([`check_movable`], the secret), the VM's operation taken;
//! 2. the control channel, then the record `migrating` (phase `sending`), `Hello`,
//!    `Announce` (the VM's snapshot files) and those files over one `files` stream
//!    ([`carry`]), `Ready`;
//! 3. [`send`]: TLS, one mirror per disk until all are ready, then the memory until QEMU
//!    completed (the guest is then paused here), then the mirrors ended (`finish_source`: they
//!    copy what is still dirty, so the destination has every block before the commit);
//! 4. phase `committing`, `Commit`; `Committed` -> phase `committed` and `finish`: the VM
//!    ends here as `vm.destroy` ends it (`VmOp::destroy_steps`, data disks kept as destroy
//!    keeps them);
//! 5. a failure before `Commit` was sent: `give_up` (the guest runs on here); `Commit` sent
//!    but unanswered: `settle` asks the destination and, while it cannot tell, keeps the paused
//!    guest recorded `failed` with a background retry. Those steps, `finish` and a restart's
//!    recovery are one implementation with the cold move's ([`super::source_settle`]).

use super::carry;
use super::progress::{self, Reporter};
use super::source_settle::{self, Side};
use crate::api::migration::{MigrateParams, MigrateResult, MoveMode};
use crate::api::{ApiError, Code, VmStatus};
use crate::lifecycle::op::VmOp;
use crate::lifecycle::Manager;
use crate::migration::{ChannelKind, Control, ControlMsg, Hello, HelloDisk, MigrationError, Secret};
use crate::qemu::migration::{self as qemu_mig, MigDisk, MirrorState};
use crate::state::migration::{MigrationPhase, MigrationRecord, MigrationRole};
use crate::state::VmRecord;
use serde_json::{json, Value};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// QEMU's `downtime-limit` when the call names none (ms).
const DEFAULT_DOWNTIME_MS: u64 = 300;
/// The whole migration's limit when the call names none (s).
const DEFAULT_TIMEOUT_S: u64 = 3600;
/// Longest one QMP command may take.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// How often QEMU is asked how far the mirrors and the memory got.
const POLL: Duration = Duration::from_millis(500);
/// Longest a stream to the destination may take to be made and accepted.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the destination may take from `Hello` to `Ready`: it makes the disks and starts
/// QEMU.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest the destination may take to answer `Commit`.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the source looks for the destination's `Abort` after the snapshots' stream failed.
const ABORT_WAIT: Duration = Duration::from_secs(10);
/// The settle of a live migration run by its own operation: its QEMU is watched.
const LIVE: Side = Side { mode: MoveMode::Live, readopt: false };

/// 4097 `not_movable` with `details.reason`.
pub(super) fn not_movable(reason: &str, message: impl Into<String>) -> ApiError {
    ApiError::new(Code::NotMovable, message).details(json!({ "reason": reason }))
}

/// The refusals of `vm.migrate` that the record decides (pure): a VM that is not running
/// (`status`), one with passthrough devices (`passthrough`: they cannot move live), one
/// running an older spec than its record's (`pending_change`: the destination would get a
/// spec its QEMU does not run).
///
/// # Errors
/// 4097 with the reason.
pub(super) fn check_movable(rec: &VmRecord) -> Result<(), ApiError> {
    if rec.status != VmStatus::Running {
        return Err(not_movable("status", format!("VM {:?} is {}, not running", rec.spec.name, rec.status)));
    }
    if !rec.spec.hardware.is_empty() || !rec.spec.pci.is_empty() {
        return Err(not_movable(
            "passthrough",
            format!("VM {:?} has passthrough devices, which cannot move live: use vm.move", rec.spec.name),
        ));
    }
    if rec.running_spec.is_some() {
        return Err(not_movable(
            "pending_change",
            format!("VM {:?} runs an older spec than its record's: apply or restart first", rec.spec.name),
        ));
    }
    Ok(())
}

/// The call's secret, or 2001 naming `secret`.
fn parse_secret(hex: &str) -> Result<Secret, ApiError> {
    Secret::parse(hex).map_err(|_| ApiError::invalid("secret", "must be the 64 hex digits vm.migrate_in answered"))
}

/// 4001 naming `step`.
fn failed(step: &str, message: impl Into<String>) -> ApiError {
    super::super::provisioning(step, message.into())
}

/// The destination's `Abort`, as the API error it carries.
fn aborted(code: i32, message: &str) -> ApiError {
    let code = Code::from_i32(code).unwrap_or(Code::ProvisioningFailed);
    ApiError::new(code, format!("the destination gave up: {message}")).details(json!({ "step": "destination" }))
}

/// `vm.migrate`.
///
/// # Errors
/// 2001 `secret`; 4040, 4090; 4097 (`status`, `passthrough`, `pending_change`); 4001 step
/// `connect` when the destination cannot be reached (nothing changed); 4001 step `migrate` (or
/// the destination's own code) when the migration failed before the commit (the guest runs on
/// here); 4001 step `commit` when the destination's answer is unknown (the guest is kept paused
/// here, recorded `failed`, until the destination answers).
pub(crate) async fn migrate(mgr: &Arc<Manager>, p: MigrateParams) -> Result<MigrateResult, ApiError> {
    let span = tracing::info_span!("vm.migrate", vm = %p.name, destination = %p.destination);
    async move {
        let secret = parse_secret(&p.secret)?;
        let started = Instant::now();
        let (mut op, rec) = mgr.begin_op(&p.name).await?;
        check_movable(&rec)?;
        // Half-reverted disks must not travel (a running VM has none; the record decides).
        super::super::snapshots::check_not_reverting(&rec)?;
        // Internal snapshots live in the disk files, which a live move does not copy.
        super::super::snapshots::check_no_internal(mgr, &p.name)?;
        if op.find_live(rec.process.as_ref())?.is_none() {
            return Err(not_movable("status", format!("VM {:?} has no running QEMU", p.name)));
        }
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            crate::migration::connect(&p.destination, &p.name, &secret, &ChannelKind::Control),
        )
        .await
        .map_err(|_| failed("connect", format!("{} did not answer in time", p.destination)))?
        .map_err(|e| failed("connect", format!("cannot reach the destination {}: {e}", p.destination)))?;
        let mut control = Control::new(stream, &secret);
        let record = MigrationRecord {
            role: MigrationRole::Outgoing,
            mode: MoveMode::Live,
            peer: p.destination.clone(),
            secret: secret.to_hex(),
            phase: MigrationPhase::Sending,
            since: crate::api::now_rfc3339(),
            stopped: false,
        };
        op.update_status("vm.migrate", VmStatus::Migrating, |r| r.migration = Some(record))?;
        op.crashpoint("migrate:recorded");
        let mut reporter = Reporter::new(mgr, &p.name);
        reporter.phase("preparing");
        let limit = Duration::from_secs(p.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S));
        let sent = match tokio::time::timeout(limit, send(&op, &rec, &p, &secret, &mut control, &mut reporter)).await {
            Ok(sent) => sent,
            Err(_) => Err(failed("migrate", format!("the migration took longer than {} s", limit.as_secs()))),
        };
        let sent = match sent {
            Ok(sent) => sent,
            Err(e) => {
                return Err(source_settle::give_up(&mut op, LIVE, Some(&mut control), e, Some(&mut reporter)).await)
            }
        };
        reporter.phase("committing");
        op.update("vm.migrate: committing", |r| source_settle::set_phase(r, MigrationPhase::Committing))?;
        op.crashpoint("migrate:commit");
        let answer = match control.send(&ControlMsg::Commit).await {
            Ok(()) => control.recv(COMMIT_TIMEOUT).await,
            Err(e) => Err(e),
        };
        match answer {
            Ok(ControlMsg::Committed) => {
                source_settle::finish(&mut op, LIVE, &p.destination, Some(&mut reporter)).await?
            }
            Ok(ControlMsg::Abort { code, message }) => {
                // It did not commit: the guest is this host's.
                return Err(
                    source_settle::give_up(&mut op, LIVE, None, aborted(code, &message), Some(&mut reporter)).await
                );
            }
            other => {
                let why = match other {
                    Ok(msg) => format!("an unexpected answer to the commit: {msg:?}"),
                    Err(e) => format!("no answer to the commit: {e}"),
                };
                tracing::warn!(vm = %p.name, why, "asking the destination what became of the migration");
                source_settle::settle(&mut op, LIVE, &p.destination, &secret, Some(&mut reporter)).await?;
            }
        }
        Ok(MigrateResult {
            name: p.name.clone(),
            destination: p.destination.clone(),
            mode: MoveMode::Live,
            total_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            downtime_ms: sent.downtime_ms,
            ram_bytes: sent.ram_bytes,
            disk_bytes: sent.disk_bytes,
        })
    }
    .instrument(span)
    .await
}

/// What [`send`] sent.
struct Sent {
    downtime_ms: u64,
    ram_bytes: u64,
    disk_bytes: u64,
}

/// A QMP connection to the VM's QEMU for one step.
async fn qmp(mgr: &Manager, name: &str) -> Result<crate::qemu::session::Monitor, ApiError> {
    mgr.qmp(name, QMP_TIMEOUT).await.map_err(|e| failed("migrate", format!("QEMU's monitor: {e}")))
}

/// A QEMU step's error as 4001 step `migrate`.
fn qemu_failed(what: &str) -> impl FnOnce(qemu_mig::MigrationQemuError) -> ApiError + '_ {
    move |e| failed("migrate", format!("{what}: {e}"))
}

/// A control channel's error as 4001 step `migrate`.
fn channel_failed(what: &str) -> impl FnOnce(MigrationError) -> ApiError + '_ {
    move |e| failed("migrate", format!("{what}: {e}"))
}

/// Opens a stream of `kind` to the destination.
async fn open(p: &MigrateParams, secret: &Secret, kind: &ChannelKind) -> Result<std::net::TcpStream, ApiError> {
    match tokio::time::timeout(CONNECT_TIMEOUT, crate::migration::connect(&p.destination, &p.name, secret, kind)).await
    {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(e)) => Err(failed("migrate", format!("the {kind:?} stream: {e}"))),
        Err(_) => Err(failed("migrate", format!("the {kind:?} stream: the destination did not answer in time"))),
    }
}

/// Steps 2-3 of the module doc after the record: `Hello` and `Ready`, the disks, the memory.
/// Returns once QEMU completed (the guest is paused here).
async fn send(
    op: &VmOp,
    rec: &VmRecord,
    p: &MigrateParams,
    secret: &Secret,
    control: &mut Control,
    reporter: &mut Reporter,
) -> Result<Sent, ApiError> {
    let (mgr, name) = (op.mgr(), op.name());
    let mut disks = qemu_mig::disks_of(&rec.spec);
    let blocks = qmp(mgr, name).await?.execute("query-block", None).await;
    let blocks = blocks.map_err(|e| failed("migrate", format!("query-block: {e}")))?;
    let hello = Hello {
        spec: rec.spec.clone(),
        instance_id: rec.instance_id.clone(),
        macs: rec.nics.iter().map(|n| n.mac.clone()).collect(),
        disks: hello_disks(&disks, &blocks).map_err(|m| failed("migrate", m))?,
        machine: Some(
            super::machine::facts(&mut *qmp(mgr, name).await?)
                .await
                .map_err(|e| failed("migrate", format!("the machine's facts: {e}")))?,
        ),
    };
    control.send(&ControlMsg::Hello(Box::new(hello))).await.map_err(channel_failed("Hello"))?;
    // The snapshots go with the VM (its copy here, with them, is deleted once the destination
    // committed, which it does only when every one arrived). They cannot change meanwhile: the
    // VM's operation is held and its record says migrating.
    let snapshots = carry::snapshot_files(mgr, name)?;
    let announced = crate::blocking::run(|| carry::announce(&snapshots)).map_err(|m| failed("migrate", m))?;
    let sent = async {
        control.send(&ControlMsg::Announce { files: announced }).await.map_err(|e| format!("Announce: {e}"))?;
        if !snapshots.is_empty() {
            let bytes = carry::send_files(&p.destination, name, secret, &snapshots).await;
            bytes.map_err(|e| format!("sending the snapshots: {e}"))?;
        }
        Ok::<(), String>(())
    }
    .await;
    if let Err(e) = sent {
        // A destination that refused the Hello or the announcement says why on the control
        // channel before it lets go of it.
        return Err(match control.recv(ABORT_WAIT).await {
            Ok(ControlMsg::Abort { code, message }) => aborted(code, &message),
            _ => failed("migrate", e),
        });
    }
    match control.recv(READY_TIMEOUT).await.map_err(channel_failed("waiting for Ready"))? {
        ControlMsg::Ready { exports } => set_exports(&mut disks, exports).map_err(|m| failed("migrate", m))?,
        ControlMsg::Abort { code, message } => return Err(aborted(code, &message)),
        other => return Err(failed("migrate", format!("the destination sent {other:?} instead of Ready"))),
    }
    // QEMU's TLS key, derived from the secret: QEMU never holds the secret itself.
    let (run_dir, key, user) = (op.paths().run_dir.clone(), secret.tls_psk_hex(), mgr.config.qemu_user);
    let dir = crate::blocking::run(move || qemu_mig::psk_dir(&run_dir, &key, user.as_ref()))
        .map_err(qemu_failed("the TLS key"))?;
    qemu_mig::add_tls(&mut *qmp(mgr, name).await?, dir.as_fd(), qemu_mig::Endpoint::Client)
        .await
        .map_err(qemu_failed("TLS"))?;
    drop(dir);

    reporter.phase("disks");
    for disk in &disks {
        let stream = open(p, secret, &ChannelKind::Disk(disk.export.clone())).await?;
        // QEMU gets its own copy of the descriptor (getfd); ours is closed after.
        qemu_mig::start_mirror(&mut *qmp(mgr, name).await?, disk, stream.as_fd())
            .await
            .map_err(qemu_failed("a disk's mirror"))?;
    }
    loop {
        let mirrors = qemu_mig::mirrors(&mut *qmp(mgr, name).await?).await.map_err(qemu_failed("the mirrors"))?;
        reporter.tick(progress::with_mirrors(reporter.progress().clone(), &mirrors));
        if mirrors_ready(&disks, &mirrors).map_err(|m| failed("migrate", m))? {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    op.crashpoint("migrate:mirroring");

    reporter.phase("memory");
    let ram = open(p, secret, &ChannelKind::Ram).await?;
    let downtime = p.max_downtime_ms.unwrap_or(DEFAULT_DOWNTIME_MS);
    qemu_mig::start_memory(&mut *qmp(mgr, name).await?, ram.as_fd(), downtime, p.bandwidth_mib_s)
        .await
        .map_err(qemu_failed("the memory stream"))?;
    drop(ram);
    op.crashpoint("migrate:memory");
    loop {
        let memory = qemu_mig::progress(&mut *qmp(mgr, name).await?).await.map_err(qemu_failed("the memory stream"))?;
        let mirrors = qemu_mig::mirrors(&mut *qmp(mgr, name).await?).await.map_err(qemu_failed("the mirrors"))?;
        let now = progress::with_memory(progress::with_mirrors(reporter.progress().clone(), &mirrors), &memory);
        reporter.tick(now);
        // A mirror that failed after it was ready would leave the destination short of blocks.
        mirrors_ready(&disks, &mirrors).map_err(|m| failed("migrate", m))?;
        match memory.status.as_str() {
            "completed" => {
                // Before the commit: ending the mirrors copies what the guest dirtied last, so
                // only then does the destination have every block.
                reporter.phase("switching");
                qemu_mig::finish_source(&mut *qmp(mgr, name).await?, &disks)
                    .await
                    .map_err(qemu_failed("ending the mirrors"))?;
                source_settle::remove_tls(op.held());
                return Ok(Sent {
                    downtime_ms: memory.downtime_ms,
                    ram_bytes: memory.transferred,
                    disk_bytes: reporter.progress().disk_done,
                });
            }
            "failed" | "cancelled" | "cancelling" => {
                let why = memory.error.unwrap_or_else(|| memory.status.clone());
                return Err(failed("migrate", format!("QEMU's memory stream: {why}")));
            }
            _ => tokio::time::sleep(POLL).await,
        }
    }
}

/// [`Hello::disks`] for `disks` (pure): each one's virtual size and format from QEMU's
/// `query-block` answer, found by its device (`virtio0`) or its node name (`data-NAME`).
///
/// # Errors
/// A message naming a disk QEMU does not list.
fn hello_disks(disks: &[MigDisk], query_block: &Value) -> Result<Vec<HelloDisk>, String> {
    let blocks = query_block.as_array().map(Vec::as_slice).unwrap_or_default();
    disks
        .iter()
        .map(|d| {
            let inserted = blocks
                .iter()
                .filter_map(|b| Some((b.get("device").and_then(Value::as_str).unwrap_or(""), b.get("inserted")?)))
                .find(|(device, inserted)| {
                    *device == d.device || inserted.get("node-name").and_then(Value::as_str) == Some(d.device.as_str())
                })
                .map(|(_, inserted)| inserted)
                .ok_or_else(|| format!("QEMU lists no disk {:?}", d.device))?;
            let bytes = inserted
                .pointer("/image/virtual-size")
                .and_then(Value::as_u64)
                .ok_or_else(|| format!("QEMU gives no size for disk {:?}", d.device))?;
            let format = inserted.get("drv").and_then(Value::as_str).unwrap_or("raw").to_string();
            Ok(HelloDisk { device: d.device.clone(), bytes, format })
        })
        .collect()
}

/// The destination's export names into `disks` (pure): one per disk, in order.
///
/// # Errors
/// A message when the counts differ.
fn set_exports(disks: &mut [MigDisk], exports: Vec<String>) -> Result<(), String> {
    if exports.len() != disks.len() {
        return Err(format!("the destination exports {} disks, this VM has {}", exports.len(), disks.len()));
    }
    for (disk, export) in disks.iter_mut().zip(exports) {
        disk.export = export;
    }
    Ok(())
}

/// Whether every disk's mirror is ready (pure).
///
/// # Errors
/// A message naming a disk whose mirror job is gone (it failed or was cancelled).
fn mirrors_ready(disks: &[MigDisk], mirrors: &[MirrorState]) -> Result<bool, String> {
    let mut ready = true;
    for disk in disks {
        match mirrors.iter().find(|m| m.device == disk.export) {
            Some(m) if m.concluded => {
                let why = m.error.as_deref().unwrap_or("it ended");
                return Err(format!("the mirror of disk {:?} failed: {why}", disk.device));
            }
            Some(m) => ready &= m.ready,
            None => return Err(format!("the mirror of disk {:?} ended before it was ready", disk.device)),
        }
    }
    Ok(ready)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running() -> VmRecord {
        let mut rec = VmRecord::new(crate::validate::tests::spec("vm-1"));
        rec.status = VmStatus::Running;
        rec
    }

    fn reason(e: ApiError) -> (i32, String) {
        (e.code.as_i32(), e.details["reason"].as_str().unwrap_or_default().to_string())
    }

    #[test]
    fn a_running_vm_without_passthrough_or_pending_change_may_move() {
        assert!(check_movable(&running()).is_ok());
    }

    #[test]
    fn refusals_name_their_reason() {
        for status in [VmStatus::Stopped, VmStatus::Migrating, VmStatus::Failed, VmStatus::Dead, VmStatus::Incoming] {
            let mut rec = running();
            rec.status = status;
            assert_eq!(reason(check_movable(&rec).unwrap_err()), (4097, "status".into()), "{status}");
        }
        let mut rec = running();
        rec.spec.pci = vec![serde_json::from_value(json!("0000:01:00.0")).unwrap()];
        assert_eq!(reason(check_movable(&rec).unwrap_err()), (4097, "passthrough".into()));
        let mut rec = running();
        rec.running_spec = Some(rec.spec.clone());
        assert_eq!(reason(check_movable(&rec).unwrap_err()), (4097, "pending_change".into()));
        // A TPM moves with its VM (QEMU carries swtpm's state in the stream).
        let mut rec = running();
        rec.spec.tpm = true;
        assert!(check_movable(&rec).is_ok());
    }

    #[test]
    fn a_vm_being_moved_is_neither_started_stopped_nor_rebuilt() {
        let mut rec = running();
        assert!(rec.check_not_moving().is_ok());
        let mut m = MigrationRecord {
            role: MigrationRole::Outgoing,
            mode: MoveMode::Live,
            peer: "10.0.0.2:7300".into(),
            secret: "00".repeat(32),
            phase: MigrationPhase::Committing,
            stopped: false,
            since: String::new(),
        };
        rec.migration = Some(m.clone());
        assert_eq!(rec.check_not_moving().unwrap_err().code.as_i32(), 4090);
        // An incoming migration not committed: the guest runs on the source.
        m.role = MigrationRole::Incoming;
        m.phase = MigrationPhase::Sending;
        rec.migration = Some(m.clone());
        assert_eq!(rec.check_not_moving().unwrap_err().code.as_i32(), 4090);
        // A destination keeps its committed incoming migration on a VM that is its own.
        m.phase = MigrationPhase::Committed;
        rec.migration = Some(m);
        assert!(rec.check_not_moving().is_ok());
    }

    #[test]
    fn a_malformed_secret_is_refused_on_its_field() {
        let e = parse_secret("nope").unwrap_err();
        assert_eq!((e.code.as_i32(), e.field.as_deref()), (2001, Some("secret")));
    }

    fn disk(device: &str) -> MigDisk {
        MigDisk { device: device.into(), export: device.into(), top_only: false }
    }

    #[test]
    fn hello_disks_come_from_query_block_by_device_or_node_name() {
        let blocks = json!([
            {"device": "virtio0", "inserted": {"node-name": "#block123", "drv": "qcow2", "image": {"virtual-size": 1000}}},
            {"device": "", "qdev": "x", "inserted": {"node-name": "data-d", "drv": "raw", "image": {"virtual-size": 2000}}},
            {"device": "ide1-cd0"}
        ]);
        let got = hello_disks(&[disk("virtio0"), disk("data-d")], &blocks).unwrap();
        assert_eq!(
            got,
            vec![
                HelloDisk { device: "virtio0".into(), bytes: 1000, format: "qcow2".into() },
                HelloDisk { device: "data-d".into(), bytes: 2000, format: "raw".into() },
            ]
        );
        assert!(hello_disks(&[disk("data-x")], &blocks).unwrap_err().contains("data-x"));
    }

    #[test]
    fn exports_are_taken_in_order_and_must_count_the_disks() {
        let mut disks = vec![disk("virtio0"), disk("data-d")];
        set_exports(&mut disks, vec!["e0".into(), "e1".into()]).unwrap();
        assert_eq!((disks[0].export.as_str(), disks[1].export.as_str()), ("e0", "e1"));
        assert!(set_exports(&mut disks, vec!["e0".into()]).is_err());
    }

    #[test]
    fn mirrors_are_ready_only_all_together_and_a_vanished_one_fails() {
        let disks = [disk("virtio0"), disk("data-d")];
        let m = |device: &str, ready| MirrorState {
            device: device.into(),
            offset: 0,
            len: 1,
            ready,
            concluded: false,
            error: None,
        };
        assert_eq!(mirrors_ready(&disks, &[m("virtio0", true), m("data-d", false)]), Ok(false));
        assert_eq!(mirrors_ready(&disks, &[m("virtio0", true), m("data-d", true)]), Ok(true));
        assert!(mirrors_ready(&disks, &[m("virtio0", true)]).unwrap_err().contains("data-d"));
        let failed = MirrorState { concluded: true, error: Some("Input/output error".into()), ..m("data-d", true) };
        assert!(mirrors_ready(&disks, &[m("virtio0", true), failed]).unwrap_err().contains("Input/output error"));
    }
}
