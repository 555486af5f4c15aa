//! Commands and files in a running guest (`vm.exec`, `vm.file_push`, `vm.file_pull`). The
//! daemon's own housekeeping on the same ports (the clock, shutdown, SSH keys) is
//! [`super::housekeeping`].
//!
//! Order of one call: its params' limits (`check`, -32602), the VM (4040), the opt-in
//! ([`allowed`]: `[agent] allow_exec`, then the spec's `guest_exec`; 4095 with
//! `details.reason`), that it runs (5001), a free slot (4096), then the exchange on that slot's
//! port ([`crate::agent::exec`]). Whatever the outcome, one audit line (target
//! `vmhost::audit`: the peer's uid, the VM, argv or path, sizes, sha256, how it ended, the
//! slot; never content, stdin or environment values) and one event carrying a
//! [`GuestAction`]. No busy flag is taken: these calls change nothing the daemon records, and
//! a VM operation (a stop) may run meanwhile; the guest ending the session ends the call.

use super::Manager;
use crate::agent::exec::files::{self, PushContent, PushRequest};
use crate::agent::exec::session::{ExecError, OutputChunk, Session};
use crate::agent::exec::slots::SlotGuard;
use crate::api::exec::{
    encode_output, ExecParams, ExecResult, FilePullParams, FilePullResult, FilePushParams, FilePushResult, GuestAction,
    GuestActionKind,
};
use crate::api::{ApiError, Code, VmStatus};
use crate::state::VmRecord;
use serde_json::json;
use tokio::sync::mpsc;

/// The audit log's tracing target.
pub const AUDIT_TARGET: &str = "vmhost::audit";

/// The VM's record when exec, push and pull may run in it now.
///
/// # Errors
/// 4040; 4095 (`details.reason`: `"host"` when `[agent] allow_exec` is false, `"spec"` when the
/// spec says `guest_exec: false`); 5001 when it does not run.
fn allowed(mgr: &Manager, name: &str) -> Result<VmRecord, ApiError> {
    let rec = mgr.record(name)?;
    if !mgr.config.agent.allow_exec {
        return Err(ApiError::new(
            Code::ExecDisabled,
            format!(
                "commands and file transfers in guests are off on this host: [agent] allow_exec is false in {}",
                mgr.config.file.display()
            ),
        )
        .field("name")
        .details(json!({"reason": "host"})));
    }
    if !rec.spec.guest_exec {
        return Err(ApiError::new(
            Code::ExecDisabled,
            format!("VM {name:?} does not allow commands and file transfers: its spec has guest_exec: false"),
        )
        .field("name")
        .details(json!({"reason": "spec"})));
    }
    running(name, &rec)?;
    Ok(rec)
}

/// 5001 unless `rec` says running.
fn running(name: &str, rec: &VmRecord) -> Result<(), ApiError> {
    if rec.status != VmStatus::Running {
        return Err(ApiError::new(
            Code::AgentNotConnected,
            format!("VM {name:?} is not running (it is {}): its exec server cannot be reached", rec.status.as_str()),
        )
        .field("name"));
    }
    Ok(())
}

/// A free exec slot of `name`.
fn take_slot(mgr: &Manager, name: &str) -> Result<SlotGuard, ApiError> {
    mgr.exec_slots.try_acquire(name).map_err(|e| ExecError::Busy(e).into())
}

/// `vm.exec`: runs `p.argv` in the guest. Output is collected (at most `max_output` per
/// stream), or sent to `forward` as it arrives when the caller streams it.
///
/// # Errors
/// -32602 naming the field, 4040, 4095, 5001, 4096, 5002 (no answer within `timeout_s` + 10 s),
/// 4001 with `details.agent_error` (the guest refused: no such program, a bad cwd).
pub(crate) async fn exec(
    mgr: &Manager,
    p: ExecParams,
    peer_uid: u32,
    forward: Option<mpsc::Sender<OutputChunk>>,
) -> Result<ExecResult, ApiError> {
    let stdin = p.check()?;
    let rec = allowed(mgr, &p.name)?;
    let guard = take_slot(mgr, &p.name)?;
    let slot = guard.slot();
    let params = vmhost_agent_protocol::exec::ExecParams {
        argv: p.argv.clone(),
        env: p.env.clone(),
        cwd: p.cwd.clone(),
        stdin_bytes: stdin.len() as u64,
        timeout_s: p.timeout_s,
        max_output: p.max_output,
    };
    let sockets = mgr.paths(&p.name).exec;
    let outcome = match Session::open(&sockets, guard, "exec").await {
        Ok(session) => session.exec(&params, &stdin, forward).await,
        Err(e) => Err(e),
    };
    let env = p.env_names();
    let mut action = GuestAction { argv: Some(p.argv.clone()), ..GuestAction::new(GuestActionKind::Exec, peer_uid) };
    match outcome {
        Ok(out) => {
            let r = &out.reply;
            tracing::info!(target: AUDIT_TARGET, peer_uid, vm = %p.name, action = "exec", argv = ?p.argv, env = ?env,
                cwd = ?p.cwd, stdin_bytes = stdin.len(), slot, exit_code = ?r.exit_code, signal = ?r.signal,
                timed_out = r.timed_out, stdout_bytes = r.stdout_bytes, stderr_bytes = r.stderr_bytes,
                duration_ms = r.duration_ms, "guest exec");
            (action.exit_code, action.signal, action.timed_out) = (r.exit_code, r.signal, Some(r.timed_out));
            mgr.events.emit_guest(&p.name, Some(rec.status), "guest exec", action);
            Ok(ExecResult {
                exit_code: r.exit_code,
                signal: r.signal,
                timed_out: r.timed_out,
                duration_ms: r.duration_ms,
                stdout: encode_output(&out.stdout, p.encoding),
                stderr: encode_output(&out.stderr, p.encoding),
                stdout_bytes: r.stdout_bytes,
                stderr_bytes: r.stderr_bytes,
                stdout_truncated: out.stdout_truncated(),
                stderr_truncated: out.stderr_truncated(),
                encoding: p.encoding,
                slot: out.slot,
            })
        }
        Err(e) => {
            tracing::info!(target: AUDIT_TARGET, peer_uid, vm = %p.name, action = "exec", argv = ?p.argv, env = ?env,
                cwd = ?p.cwd, stdin_bytes = stdin.len(), slot, error = %e, "guest exec failed");
            mgr.events.emit_guest(&p.name, Some(rec.status), format!("guest exec failed: {e}"), action);
            Err(e.into())
        }
    }
}

/// `vm.file_push`: writes a file in the guest, atomically (the guest renames a checked
/// temporary file into place).
///
/// # Errors
/// -32602 naming the field (also a `source` that is not beneath `[agent] files_dir`, or too
/// large), 4040, 4095, 5001, 4096, 5002, 2003 (the content is not what `sha256` says), 4001
/// with `details.agent_error` (the guest refused: a missing directory without `mkdir`, an
/// unknown owner).
pub(crate) async fn file_push(mgr: &Manager, p: FilePushParams, peer_uid: u32) -> Result<FilePushResult, ApiError> {
    let inline = p.check()?;
    let rec = allowed(mgr, &p.name)?;
    let content = match (inline, &p.source) {
        (Some(bytes), _) => PushContent::Bytes(bytes),
        (None, Some(rel)) => {
            let agent = &mgr.config.agent;
            let max = agent.max_file_mib.saturating_mul(1 << 20);
            crate::blocking::run(|| files::open_source(agent.files_dir.as_deref(), rel, max))?
        }
        (None, None) => return Err(ApiError::new(Code::InvalidParams, "give content or source").field("content")),
    };
    let guard = take_slot(mgr, &p.name)?;
    let slot = guard.slot();
    let request = PushRequest {
        path: p.path.clone(),
        mode: p.mode,
        owner: p.owner.clone(),
        sha256: p.sha256.clone(),
        mkdir: p.mkdir,
    };
    let sockets = mgr.paths(&p.name).exec;
    let outcome = match Session::open(&sockets, guard, "file.push").await {
        Ok(mut session) => files::push(&mut session, &request, content).await,
        Err(e) => Err(e),
    };
    let mut action =
        GuestAction { path: Some(p.path.clone()), ..GuestAction::new(GuestActionKind::FilePush, peer_uid) };
    match outcome {
        Ok(reply) => {
            tracing::info!(target: AUDIT_TARGET, peer_uid, vm = %p.name, action = "file_push", path = %p.path,
                source = ?p.source, mode = format!("{:o}", p.mode), owner = ?p.owner, size = reply.size,
                sha256 = %reply.sha256, slot, "guest file push");
            action.sha256 = Some(reply.sha256.clone());
            mgr.events.emit_guest(&p.name, Some(rec.status), "guest file push", action);
            Ok(FilePushResult { path: p.path, size: reply.size, sha256: reply.sha256 })
        }
        Err(e) => {
            tracing::info!(target: AUDIT_TARGET, peer_uid, vm = %p.name, action = "file_push", path = %p.path,
                source = ?p.source, slot, error = %e, "guest file push failed");
            mgr.events.emit_guest(&p.name, Some(rec.status), format!("guest file push failed: {e}"), action);
            Err(e.into())
        }
    }
}

/// `vm.file_pull`: reads a file of at most `max_bytes` from the guest; its sha256 is computed
/// here and must be the guest's.
///
/// # Errors
/// -32602 naming the field, 4040, 4095, 5001, 4096, 5002, 2003 (what arrived is not what the
/// guest said it sent), 4001 with `details.agent_error` (no such file, larger than
/// `max_bytes`, not a regular file).
pub(crate) async fn file_pull(mgr: &Manager, p: FilePullParams, peer_uid: u32) -> Result<FilePullResult, ApiError> {
    p.check()?;
    let rec = allowed(mgr, &p.name)?;
    let guard = take_slot(mgr, &p.name)?;
    let slot = guard.slot();
    let sockets = mgr.paths(&p.name).exec;
    let outcome = match Session::open(&sockets, guard, "file.pull").await {
        Ok(mut session) => files::pull(&mut session, &p.path, p.max_bytes).await,
        Err(e) => Err(e),
    };
    let mut action =
        GuestAction { path: Some(p.path.clone()), ..GuestAction::new(GuestActionKind::FilePull, peer_uid) };
    match outcome {
        Ok((reply, data)) => {
            tracing::info!(target: AUDIT_TARGET, peer_uid, vm = %p.name, action = "file_pull", path = %p.path,
                size = reply.size, sha256 = %reply.sha256, slot, "guest file pull");
            action.sha256 = Some(reply.sha256.clone());
            mgr.events.emit_guest(&p.name, Some(rec.status), "guest file pull", action);
            Ok(FilePullResult {
                path: p.path,
                size: reply.size,
                sha256: reply.sha256,
                mode: reply.mode,
                content: crate::agent::exec::base64::encode(&data),
            })
        }
        Err(e) => {
            tracing::info!(target: AUDIT_TARGET, peer_uid, vm = %p.name, action = "file_pull", path = %p.path,
                slot, error = %e, "guest file pull failed");
            mgr.events.emit_guest(&p.name, Some(rec.status), format!("guest file pull failed: {e}"), action);
            Err(e.into())
        }
    }
}
