//! QEMU without a guest, run as `qemu.user` on descriptors the daemon opened: the only way
//! vmhostd reads or writes an image file's format (probing a base, creating an overlay, growing
//! one).
//!
//! Why not `qemu-img`: qemu-img 7.2 reopens every file by name, `/proc/self/fd/N` included, so
//! the kernel checks the inode's mode again and `qemu.user` can never open a root-owned 0600
//! overlay or base it was handed. Making the files the user's would let any process of that
//! user (every VM's QEMU) reopen them through `/proc/PID/fd`. QEMU itself takes descriptors into
//! fd sets (`-add-fd`) and opens `/dev/fdset/N` by duplicating them, exactly as the VMs use their
//! disks, so the files stay root 0600 and the image parsers run unprivileged, in QEMU's own
//! seccomp sandbox, under the spawner's Landlock rules.
//!
//! A session is used in this order:
//!
//! 1. [`Session::start`] starts `qemu.binary -machine none` with the monitor on one end of a
//!    socket pair and one fd set per [`Input`]; a [`Input::Probe`] is also opened as a
//!    read-only drive, which makes QEMU probe its format (with its backing file never opened);
//! 2. any of [`Session::probe`], [`Session::create_qcow2`], [`Session::grow_qcow2`], and
//!    [`Session::add_chain`] then [`Session::backup`] (a disk and its backing layers copied
//!    into one flat image);
//! 3. [`Session::finish`] quits QEMU and waits for it. Dropping a session instead kills QEMU.
//!
//! No parameter of a session comes from a guest; image paths appear on QEMU's command line and in
//! QMP only as `/dev/fdset/N` and as the backing path recorded in a new overlay.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::AsyncReadExt;

use super::{BaseInfo, DiskError};
use crate::config::UserIds;
use crate::process::lossy_tail;
use crate::qemu::qmp::{Qmp, QmpError};
use crate::sandbox::spawn::{self, FIRST_PASSED_FD};

/// How many bytes at the end of QEMU's stderr errors keep.
const STDERR_TAIL: usize = 4096;

/// Bound on QEMU's greeting and on each QMP command but a job's wait (the caller bounds a
/// whole operation, [`super::TOOL_TIMEOUT`]).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Which QEMU runs and as whom.
#[derive(Debug, Clone)]
pub struct Tool {
    /// `qemu.binary`.
    pub binary: PathBuf,
    /// `qemu.user`; `None` runs as the daemon's user (no sandbox, tests). Through the spawner
    /// the spawner decides: it runs the QEMU binary as `qemu.user` whatever is asked.
    pub user: Option<UserIds>,
    /// `qemu.sha256`'s pin of `binary` ([`crate::qemu::integrity`]), checked before every run
    /// ([`Session::start`]); `None` without a pin.
    pub pin: Option<Arc<crate::qemu::integrity::Pinned>>,
}

impl Tool {
    /// Checks the binary against its pin: before every run of it, so a binary that is not the
    /// pinned one never works on an image file.
    ///
    /// # Errors
    /// [`DiskError::Pinned`] with the 4002 refusal.
    pub fn verify(&self) -> Result<(), DiskError> {
        match &self.pin {
            Some(pin) => pin.verify().map_err(DiskError::Pinned),
            None => Ok(()),
        }
    }
}

/// One file handed to the session, in the order given to [`Session::start`]: input `i` is fd set
/// `FIRST_PASSED_FD + 1 + i` (fd `FIRST_PASSED_FD` is the monitor).
#[derive(Debug)]
pub enum Input {
    /// A base image opened read-only, which QEMU opens as a drive to probe its format and size.
    Probe(OwnedFd),
    /// An image opened read-write, opened by QEMU only when an operation asks for it.
    Image(OwnedFd),
    /// A layer of a disk opened read-only, opened by QEMU only as part of a chain
    /// ([`Session::add_chain`]).
    Layer(OwnedFd),
}

/// Appends one disk's `layers` (bottom first, each made an input by `as_input`) and then its
/// `target` (read-write) to `inputs`; returns the layers' input numbers with their formats and
/// the target's, which a session's operations name.
pub fn push_disk(
    inputs: &mut Vec<Input>,
    layers: Vec<(OwnedFd, String)>,
    as_input: fn(OwnedFd) -> Input,
    target: OwnedFd,
) -> (Vec<(usize, String)>, usize) {
    let mut numbered = Vec::with_capacity(layers.len());
    for (fd, format) in layers {
        numbered.push((inputs.len(), format));
        inputs.push(as_input(fd));
    }
    inputs.push(Input::Image(target));
    (numbered, inputs.len() - 1)
}

/// A running offline QEMU with its monitor.
pub struct Session {
    /// The QEMU process; killed when dropped before [`Session::finish`].
    child: spawn::Child,
    /// Its monitor.
    qmp: Qmp,
    /// The end of its stderr, filled by a reader task until QEMU exits.
    stderr: Arc<Mutex<Vec<u8>>>,
    /// The reader task.
    reader: tokio::task::JoinHandle<()>,
    /// Nodes already added with `blockdev-add`.
    nodes: Vec<String>,
    /// How long a job waited for by [`Session::run_job`] may run ([`Session::allow`]).
    job_timeout: Duration,
    /// What this session is for, for errors (`info`, `create`, `resize`).
    operation: &'static str,
}

/// The fd set of input `i`.
fn fdset(i: usize) -> usize {
    FIRST_PASSED_FD as usize + 1 + i
}

/// The arguments after the binary for `inputs` (only whether each is a probe matters).
fn argv(probes: &[bool]) -> Vec<String> {
    let mut argv: Vec<String> = [
        "-machine",
        "none",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        "-chardev",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.push(format!("socket,id=qmp,fd={FIRST_PASSED_FD}"));
    argv.extend(["-mon".to_string(), "chardev=qmp,mode=control".to_string()]);
    for (i, probe) in probes.iter().enumerate() {
        let set = fdset(i);
        argv.extend(["-add-fd".to_string(), format!("fd={set},set={set}")]);
        if *probe {
            // No `format=`: QEMU probes, as `qemu-img info` does. `backing: null` keeps a base's
            // own backing file closed. Commas inside an option value are doubled.
            argv.extend([
                "-drive".to_string(),
                format!(
                    "if=none,id=probe{i},readonly=on,file=json:{{\"backing\":null,,\"file\":{{\"driver\":\"file\",,\
                     \"filename\":\"/dev/fdset/{set}\"}}}}"
                ),
            ]);
        }
    }
    argv
}

impl Session {
    /// Starts QEMU on `inputs` for `operation` and negotiates its monitor.
    ///
    /// # Errors
    /// [`DiskError::Pinned`] when the binary is not the one `qemu.sha256` pins (nothing ran);
    /// [`DiskError::Spawn`] if QEMU cannot be started; [`DiskError::Tool`] with QEMU's stderr
    /// when it exits before greeting (e.g. a probed file is not a readable image).
    pub async fn start(tool: &Tool, inputs: Vec<Input>, operation: &'static str) -> Result<Session, DiskError> {
        // Every run without a guest begins here: the pin is checked last before the exec.
        tool.verify()?;
        let spawn_error = |source| DiskError::Spawn { program: tool.binary.clone(), source };
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(spawn_error)?;
        ours.set_nonblocking(true).map_err(spawn_error)?;
        let ours = tokio::net::UnixStream::from_std(ours).map_err(spawn_error)?;
        let probes: Vec<bool> = inputs.iter().map(|i| matches!(i, Input::Probe(_))).collect();
        let mut fds = vec![OwnedFd::from(theirs)];
        fds.extend(inputs.into_iter().map(|i| match i {
            Input::Probe(fd) | Input::Image(fd) | Input::Layer(fd) => fd,
        }));
        let mut child = spawn::Command::new(&tool.binary)
            .args(argv(&probes))
            .user(tool.user)
            .pass_fds(fds)
            .capture_stderr()
            .spawn()
            .await
            .map_err(spawn_error)?;
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let reader = tokio::spawn(read_tail(child.stderr.take(), Arc::clone(&stderr)));
        let greeted = Qmp::over(ours, CALL_TIMEOUT).await;
        match greeted {
            Ok(mut qmp) => {
                qmp.set_timeout(CALL_TIMEOUT);
                Ok(Session { child, qmp, stderr, reader, nodes: Vec::new(), operation, job_timeout: CALL_TIMEOUT })
            }
            Err(e) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                let _ = reader.await;
                let tail = tail_of(&stderr);
                Err(DiskError::Tool { operation, reason: e.to_string(), stderr_tail: tail })
            }
        }
    }

    /// Format and virtual size of probe input `i`, from `query-block`.
    ///
    /// # Errors
    /// [`DiskError::Tool`] if QMP fails; [`DiskError::Output`] if the drive or its fields are
    /// missing from the answer.
    pub async fn probe(&mut self, i: usize) -> Result<BaseInfo, DiskError> {
        image_info(&self.probe_image(i).await?)
    }

    /// QEMU's whole `ImageInfo` of probe input `i` (format, size, backing file name,
    /// format-specific data), from `query-block`.
    ///
    /// # Errors
    /// [`DiskError::Tool`] if QMP fails; [`DiskError::Output`] if the drive is missing from the
    /// answer.
    pub async fn probe_image(&mut self, i: usize) -> Result<Value, DiskError> {
        let blocks = self.call("query-block", None).await?;
        let id = format!("probe{i}");
        blocks
            .as_array()
            .and_then(|all| all.iter().find(|b| b.get("device").and_then(Value::as_str) == Some(id.as_str())))
            .and_then(|b| b.pointer("/inserted/image"))
            .cloned()
            .ok_or_else(|| DiskError::Output(format!("query-block has no image for {id}")))
    }

    /// Writes a qcow2 header of `bytes` virtual size into image input `i` (an empty file),
    /// recording `backing` (absolute path and format) when given; the backing file is not
    /// opened. With `preallocate` every cluster is allocated (`falloc`: reserved, not written).
    ///
    /// # Errors
    /// [`DiskError::Tool`] if QEMU refuses or the creation job fails; [`DiskError::Output`] for
    /// a backing path that is not UTF-8.
    pub async fn create_qcow2(
        &mut self,
        i: usize,
        bytes: u64,
        backing: Option<(&Path, &str)>,
        preallocate: bool,
    ) -> Result<(), DiskError> {
        let file = self.file_node(i).await?;
        let preallocation = if preallocate { "falloc" } else { "off" };
        let mut options = json!({ "driver": "qcow2", "file": file, "size": bytes, "preallocation": preallocation });
        if let Some((path, format)) = backing {
            let path = path
                .to_str()
                .ok_or_else(|| DiskError::Output(format!("backing path {} is not UTF-8", path.display())))?;
            options["backing-file"] = json!(path);
            options["backing-fmt"] = json!(format);
        }
        let job = format!("create{i}");
        self.call("blockdev-create", Some(json!({ "job-id": job, "options": options }))).await?;
        self.wait_job(&job).await
    }

    /// Grows qcow2 image input `i` to `bytes` unless it is already that large; returns whether it
    /// grew. Its backing file is never opened (`backing: null`): the overlay is never smaller
    /// than its base ([`DiskError::TooSmall`]), so nothing of the base shows through the new area.
    ///
    /// # Errors
    /// [`DiskError::Tool`] if QEMU cannot open it as qcow2 or refuses the size.
    pub async fn grow_qcow2(&mut self, i: usize, bytes: u64) -> Result<bool, DiskError> {
        let file = self.file_node(i).await?;
        let node = format!("image{i}");
        let add = json!({ "driver": "qcow2", "node-name": node, "file": file, "backing": null });
        self.call("blockdev-add", Some(add)).await?;
        let nodes = self.call("query-named-block-nodes", Some(json!({ "flat": true }))).await?;
        let image = nodes
            .as_array()
            .and_then(|all| all.iter().find(|n| n.get("node-name").and_then(Value::as_str) == Some(node.as_str())))
            .and_then(|n| n.get("image"))
            .ok_or_else(|| DiskError::Output(format!("query-named-block-nodes has no {node}")))?;
        if image_info(image)?.virtual_size >= bytes {
            return Ok(false);
        }
        self.call("block_resize", Some(json!({ "node-name": node, "size": bytes }))).await?;
        Ok(true)
    }

    /// Opens the layer inputs `layers` (bottom first, each with its format) read-only as one
    /// chain, each layer's backing the one below it whatever its header names (the bottom has
    /// none); returns the top's node name. No backing path recorded in a header is opened.
    ///
    /// # Errors
    /// [`DiskError::Tool`] if QEMU cannot open a layer in its format.
    pub async fn add_chain(&mut self, layers: &[(usize, &str)]) -> Result<String, DiskError> {
        let mut below: Option<String> = None;
        for (i, format) in layers {
            let file = format!("file{i}");
            let add = json!({ "driver": "file", "node-name": file, "filename": format!("/dev/fdset/{}", fdset(*i)),
                              "read-only": true });
            self.call("blockdev-add", Some(add)).await?;
            self.nodes.push(file.clone());
            let node = format!("layer{i}");
            let mut add = json!({ "driver": format, "node-name": node, "file": file, "read-only": true });
            if *format == "qcow2" {
                add["backing"] = below.as_ref().map_or(Value::Null, |b| json!(b));
            }
            self.call("blockdev-add", Some(add)).await?;
            below = Some(node);
        }
        below.ok_or_else(|| DiskError::Output("a chain of no layer".to_string()))
    }

    /// Copies everything node `source` reads (its backing layers flattened in) into image input
    /// `target`, an empty file: a qcow2 of `bytes` virtual size is made there first; a raw
    /// `target` must already be `bytes` long. Zero blocks become holes (raw) or zero clusters
    /// (qcow2). Waits up to `within` for the copy (a QEMU `blockdev-backup` job).
    ///
    /// # Errors
    /// [`DiskError::Tool`] when QEMU refuses or the job fails; [`DiskError::Timeout`] after
    /// `within`.
    pub async fn backup(
        &mut self,
        source: &str,
        target: usize,
        format: &str,
        bytes: u64,
        within: Duration,
    ) -> Result<(), DiskError> {
        let file = if format == "qcow2" {
            self.create_qcow2(target, bytes, None, false).await?;
            self.file_node(target).await?
        } else {
            // Zeros written to a raw file become holes only when its own node may discard.
            let file = format!("file{target}");
            let add = json!({ "driver": "file", "node-name": file, "discard": "unmap",
                              "filename": format!("/dev/fdset/{}", fdset(target)) });
            self.call("blockdev-add", Some(add)).await?;
            self.nodes.push(file.clone());
            file
        };
        let node = format!("target{target}");
        let add = json!({ "driver": format, "node-name": node, "file": file, "discard": "unmap",
                          "detect-zeroes": "unmap" });
        self.call("blockdev-add", Some(add)).await?;
        let job = format!("backup{target}");
        let args = json!({ "job-id": job, "device": source, "target": node, "sync": "full", "auto-dismiss": false });
        self.call("blockdev-backup", Some(args)).await?;
        self.wait_job_within(&job, within).await
    }

    /// Opens image input `i` as a read-write qcow2 node `image{i}` (its backing file never
    /// opened: internal snapshots and bitmaps live in the file itself); returns the node name.
    ///
    /// # Errors
    /// [`DiskError::Tool`] if QEMU cannot open it as qcow2.
    pub async fn open_qcow2(&mut self, i: usize) -> Result<String, DiskError> {
        let file = self.file_node(i).await?;
        let node = format!("image{i}");
        let add = json!({ "driver": "qcow2", "node-name": node, "file": file, "backing": null });
        self.call("blockdev-add", Some(add)).await?;
        self.nodes.push(node.clone());
        Ok(node)
    }

    /// Runs QMP `command` (for [`super::internal_snapshots`]).
    ///
    /// # Errors
    /// [`DiskError::Tool`] with QEMU's answer.
    pub async fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, DiskError> {
        self.call(command, arguments).await
    }

    /// Waits for job `id` to conclude and dismisses it, up to [`CALL_TIMEOUT`] or what
    /// [`Session::allow`] set.
    ///
    /// # Errors
    /// [`DiskError::Tool`] with the job's error.
    pub async fn run_job(&mut self, id: &str) -> Result<(), DiskError> {
        self.wait_job_within(id, self.job_timeout).await
    }

    /// Lets each later QMP call and job of this session run up to `within` (never less than
    /// [`CALL_TIMEOUT`]): an internal snapshot's step on a large disk (refcounts of every
    /// cluster updated, a snapshot's tables written) may take longer than a small call, and
    /// the caller's operation (its `timeout_s`) bounds the whole session anyway.
    pub fn allow(&mut self, within: Duration) {
        let within = within.max(CALL_TIMEOUT);
        self.qmp.set_timeout(within);
        self.job_timeout = within;
    }

    /// Quits QEMU and waits for it; anything added is closed and flushed by QEMU on the way.
    ///
    /// # Errors
    /// [`DiskError::Tool`] if QEMU does not quit cleanly.
    pub async fn finish(mut self) -> Result<(), DiskError> {
        if let Err(e) = self.qmp.quit().await {
            return Err(self.fail(e).await);
        }
        let status = self.child.wait().await;
        let _ = (&mut self.reader).await;
        match status {
            Ok(s) if s.success() => Ok(()),
            Ok(s) => Err(DiskError::Tool {
                operation: self.operation,
                reason: format!("QEMU exited with {s}"),
                stderr_tail: tail_of(&self.stderr),
            }),
            Err(e) => Err(DiskError::Tool {
                operation: self.operation,
                reason: format!("cannot wait for QEMU: {e}"),
                stderr_tail: tail_of(&self.stderr),
            }),
        }
    }

    /// The `file` node over image input `i`, added on first use.
    async fn file_node(&mut self, i: usize) -> Result<String, DiskError> {
        let node = format!("file{i}");
        if !self.nodes.contains(&node) {
            let add = json!({ "driver": "file", "node-name": node, "filename": format!("/dev/fdset/{}", fdset(i)) });
            self.call("blockdev-add", Some(add)).await?;
            self.nodes.push(node.clone());
        }
        Ok(node)
    }

    /// Waits for job `id` to conclude, then dismisses it; its error, if any, is the result.
    async fn wait_job(&mut self, id: &str) -> Result<(), DiskError> {
        self.wait_job_within(id, CALL_TIMEOUT).await
    }

    /// [`Session::wait_job`] for a job that may run up to `within` (a copy of a large disk
    /// sends no event while it runs).
    async fn wait_job_within(&mut self, id: &str, within: Duration) -> Result<(), DiskError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let jobs = self.call("query-jobs", None).await?;
            let job = jobs
                .as_array()
                .and_then(|all| all.iter().find(|j| j.get("id").and_then(Value::as_str) == Some(id)))
                .ok_or_else(|| DiskError::Output(format!("job {id} vanished")))?;
            if job.get("status").and_then(Value::as_str) == Some("concluded") {
                let error = job.get("error").and_then(Value::as_str).map(str::to_string);
                self.call("job-dismiss", Some(json!({ "id": id }))).await?;
                return match error {
                    None => Ok(()),
                    Some(reason) => {
                        Err(DiskError::Tool { operation: self.operation, reason, stderr_tail: tail_of(&self.stderr) })
                    }
                };
            }
            // Each status change is an event: wait for the next one instead of polling.
            let event = self.qmp.next_event();
            match tokio::time::timeout_at(deadline, event).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(self.fail(e).await),
                Err(_) => {
                    let e = QmpError::Timeout { what: format!("job {id}"), after: within };
                    return Err(self.fail(e).await);
                }
            }
        }
    }

    /// Runs a QMP command; a failure becomes [`DiskError::Tool`] with QEMU's stderr.
    async fn call(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, DiskError> {
        match self.qmp.execute(command, arguments).await {
            Ok(v) => Ok(v),
            Err(e) => Err(self.fail(e).await),
        }
    }

    /// The error for `e`. When QEMU closed its monitor it is exiting: its stderr is waited for,
    /// since that is where it says why.
    async fn fail(&mut self, e: QmpError) -> DiskError {
        if matches!(e, QmpError::Closed | QmpError::Io(_)) {
            let _ = tokio::time::timeout(CALL_TIMEOUT, self.child.wait()).await;
            let _ = tokio::time::timeout(CALL_TIMEOUT, &mut self.reader).await;
        }
        let reason = match e {
            QmpError::Command { desc, .. } => desc,
            other => other.to_string(),
        };
        DiskError::Tool { operation: self.operation, reason, stderr_tail: tail_of(&self.stderr) }
    }
}

/// Raw steps for callers that compose their own QMP (incremental backups,
/// [`super::bitmaps`]): a job's wait within a time, an input's `/dev/fdset` path
/// ([`Session::execute`] runs a command).
impl Session {
    /// Waits up to `within` for job `id` to conclude, then dismisses it.
    ///
    /// # Errors
    /// The job's error, a timeout, QMP's errors ([`DiskError::Tool`]).
    pub(crate) async fn wait_job_until(&mut self, id: &str, within: Duration) -> Result<(), DiskError> {
        self.wait_job_within(id, within).await
    }
}

/// The `/dev/fdset/N` path QEMU opens input `i` by.
pub(crate) fn input_path(i: usize) -> String {
    format!("/dev/fdset/{}", fdset(i))
}

/// `format` and `virtual-size` of a QMP `ImageInfo`.
pub(crate) fn image_info(image: &Value) -> Result<BaseInfo, DiskError> {
    let format = image
        .get("format")
        .and_then(Value::as_str)
        .ok_or_else(|| DiskError::Output("image info has no \"format\"".to_string()))?;
    let virtual_size = image
        .get("virtual-size")
        .and_then(Value::as_u64)
        .ok_or_else(|| DiskError::Output("image info has no \"virtual-size\"".to_string()))?;
    Ok(BaseInfo { format: format.to_string(), virtual_size })
}

/// Reads `pipe` to its end, keeping the last [`STDERR_TAIL`] bytes in `tail`.
async fn read_tail(pipe: Option<spawn::Pipe>, tail: Arc<Mutex<Vec<u8>>>) {
    let Some(mut pipe) = pipe else { return };
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = pipe.read(&mut buf).await {
        let Ok(mut t) = tail.lock() else { return };
        t.extend_from_slice(&buf[..n]);
        let excess = t.len().saturating_sub(STDERR_TAIL);
        t.drain(..excess);
    }
}

/// What the reader kept so far, as text.
fn tail_of(tail: &Mutex<Vec<u8>>) -> String {
    tail.lock().map(|t| lossy_tail(&t, STDERR_TAIL)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The real and effective uid of `pid`, from /proc.
    fn uids(pid: i32) -> (u32, u32) {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap();
        let ids: Vec<u32> = line.split_whitespace().map(|n| n.parse().unwrap()).collect();
        (ids[0], ids[1])
    }

    /// QEMU runs as the tool's user and reads a root-only file in a root-only directory through
    /// its descriptor alone: the test runs as root (as CI does) and QEMU as `nobody`.
    #[tokio::test]
    async fn qemu_works_as_its_user_on_descriptors_only() {
        assert!(nix::unistd::Uid::effective().is_root(), "run the unit tests as root");
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![7u8; 1 << 20]).unwrap();
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o600)).unwrap();
        let nobody = UserIds { uid: 65534, gid: 65534 };
        let tool = Tool { binary: "/usr/bin/qemu-system-x86_64".into(), user: Some(nobody), pin: None };
        let fd = OwnedFd::from(std::fs::File::open(&base).unwrap());
        let mut session = Session::start(&tool, vec![Input::Probe(fd)], "probe").await.unwrap();
        assert_eq!(uids(session.child.pid), (65534, 65534));
        let info = session.probe(0).await.unwrap();
        assert_eq!((info.format.as_str(), info.virtual_size), ("raw", 1 << 20));
        session.finish().await.unwrap();
        // By name, the same user gets nothing: the descriptor was the only way in.
        let by_name = std::process::Command::new("/usr/bin/setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/head", "-c1"])
            .arg(&base)
            .output()
            .unwrap();
        assert!(!by_name.status.success(), "{by_name:?}");
    }

    #[test]
    fn the_command_line_names_files_only_by_fd_set() {
        let argv = argv(&[true, false]);
        let joined = argv.join(" ");
        assert!(joined.contains("-chardev socket,id=qmp,fd=3 -mon chardev=qmp,mode=control"), "{joined}");
        assert!(joined.contains("-add-fd fd=4,set=4 -drive if=none,id=probe0,readonly=on,"), "{joined}");
        assert!(joined.contains(r#""backing":null,,"file":{"driver":"file",,"filename":"/dev/fdset/4"}"#), "{joined}");
        assert!(joined.ends_with("-add-fd fd=5,set=5"), "{joined}");
        assert!(joined.contains("spawn=deny"), "{joined}");
        assert!(!joined.contains("format="), "a probe pins no format: {joined}");
    }

    /// A binary that is not the pinned one never runs: [`Session::start`] refuses with the 4002
    /// before the exec. The "QEMU" is a script that leaves a mark when it runs; with its own
    /// sha256 pinned it does run (the mark proves the check, not the script, stopped it).
    #[tokio::test]
    async fn a_binary_that_is_not_the_pinned_one_never_runs() {
        let dir = tempfile::tempdir().unwrap();
        let mark = dir.path().join("ran");
        let binary = dir.path().join("qemu");
        std::fs::write(&binary, format!("#!/bin/sh\ntouch {}\n", mark.display())).unwrap();
        std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
        let sha = crate::qemu::integrity::sha256_of(&mut std::fs::File::open(&binary).unwrap()).unwrap();
        let tool = |pin: &str| Tool {
            binary: binary.clone(),
            user: None,
            pin: Some(std::sync::Arc::new(crate::qemu::integrity::Pinned::new("qemu.sha256", &binary, pin))),
        };
        let input = || Input::Probe(OwnedFd::from(std::fs::File::open("/dev/null").unwrap()));
        match Session::start(&tool(&"0".repeat(64)), vec![input()], "probe").await {
            Err(DiskError::Pinned(e)) => {
                let e = crate::api::ApiError::from(e);
                assert_eq!((e.code, e.field.as_deref()), (crate::api::Code::BinaryMismatch, Some("qemu.sha256")));
                assert_eq!(e.details["found"], sha.as_str());
            }
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("started"),
        }
        assert!(!mark.exists(), "the binary ran");
        // The pinned binary runs (and, not being QEMU, fails to greet).
        assert!(Session::start(&tool(&sha), vec![input()], "probe").await.is_err());
        assert!(mark.exists(), "the pinned binary did not run: the test proves nothing");
    }
}
