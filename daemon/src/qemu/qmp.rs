//! A small asynchronous client for the QEMU Machine Protocol (QMP) over a Unix socket.
//!
//! The daemon talks to each running VM through the QMP socket it passed on QEMU's command line:
//! to see that the VM runs, to ask the guest to power down, and to make QEMU quit. Use it in this
//! order:
//!
//! 1. [`Qmp::connect`] connects (retrying while QEMU has not created the socket yet), reads the
//!    greeting and leaves negotiation mode with `qmp_capabilities` ([`Qmp::over`] does the same
//!    on a socket pair's end, for a QEMU run only to work on image files, [`crate::disk`]);
//! 2. [`Qmp::execute`] runs any command, or the helpers [`Qmp::query_status`],
//!    [`Qmp::system_powerdown`] and [`Qmp::quit`];
//! 3. asynchronous events that arrive meanwhile (`SHUTDOWN`, `POWERDOWN`, ...) are kept and can be
//!    drained with [`Qmp::take_events`].
//!
//! QMP is line-delimited JSON. QEMU is trusted, but every line is still bounded ([`MAX_LINE`]) and
//! every call is bounded in time ([`Qmp::timeout`]). A QEMU monitor serves one client at a time:
//! a second connection to the same socket gets no greeting until the first one closes, so its
//! `connect` ends in [`QmpError::Timeout`].

use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::time::Instant;

/// Default bound on one command's round trip.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest line accepted from QEMU, in bytes (without the newline).
pub const MAX_LINE: usize = 1 << 20;

/// How many asynchronous events are kept; older ones are dropped.
pub const MAX_EVENTS: usize = 64;

/// Pause between connection attempts while the socket is not there yet.
const CONNECT_RETRY: Duration = Duration::from_millis(50);

/// Everything that can go wrong talking QMP.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be connected to before the deadline (the last attempt's error).
    #[error("cannot connect to QMP socket {}: {source}", .path.display())]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// Why the last attempt failed.
        #[source]
        source: io::Error,
    },
    /// QEMU did not answer in time; the connection may be out of step and should be dropped.
    #[error("QMP {what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The bound that expired.
        after: Duration,
    },
    /// Reading or writing the socket failed.
    #[error("QMP I/O error: {0}")]
    Io(#[from] io::Error),
    /// QEMU sent something that is not the expected QMP (bad JSON, an overlong line, a message
    /// of unknown shape), or the connection is unusable after an interrupted write.
    #[error("QMP protocol error: {0}")]
    Protocol(String),
    /// QEMU ran the command and answered with an error.
    #[error("QMP command failed: {class}: {desc}")]
    Command {
        /// QMP error class, e.g. `CommandNotFound`, `GenericError`.
        class: String,
        /// Human-readable description from QEMU.
        desc: String,
    },
    /// QEMU closed the connection (end of file, reset or broken pipe).
    #[error("QMP connection closed by QEMU")]
    Closed,
}

/// One QMP connection, past capabilities negotiation.
#[derive(Debug)]
pub struct Qmp {
    /// Buffered read side.
    reader: BufReader<OwnedReadHalf>,
    /// Write side.
    writer: OwnedWriteHalf,
    /// A line being read. Kept here rather than on the stack so that a read cut short by a
    /// timeout resumes where it stopped instead of losing the bytes already read.
    line: Vec<u8>,
    /// Id of the next command.
    next_id: u64,
    /// Bound on each call.
    timeout: Duration,
    /// The last [`MAX_EVENTS`] asynchronous events, oldest first.
    events: VecDeque<Value>,
    /// QEMU's greeting (`{"QMP": {"version": ..., "capabilities": ...}}`).
    greeting: Value,
    /// Set while a command is being written and left set if the write did not finish, or after
    /// an overlong line: the stream is then out of step and every call fails.
    broken: bool,
}

impl Qmp {
    /// Connects to the QMP socket at `path`, reads the greeting and sends `qmp_capabilities`, all
    /// within `timeout`. While the socket does not exist or refuses connections (QEMU still
    /// starting), it retries until the deadline. The per-call timeout starts at
    /// [`DEFAULT_TIMEOUT`].
    ///
    /// # Errors
    /// [`QmpError::Connect`] if no connection was made before the deadline or the error is not
    /// one to retry; [`QmpError::Timeout`] if the greeting or negotiation did not finish in time
    /// (e.g. another client holds the monitor); [`QmpError::Protocol`] if the peer does not
    /// greet like QMP; any error of the `qmp_capabilities` command.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let deadline = Instant::now() + timeout;
        let stream = connect_retrying(path, deadline).await?;
        Qmp::greet(stream, &path.display().to_string(), deadline, timeout).await
    }

    /// Like [`Qmp::connect`], on a stream already connected to QEMU's monitor (one end of a
    /// socket pair whose other end QEMU inherited): reads the greeting and negotiates, within
    /// `timeout`.
    ///
    /// # Errors
    /// As [`Qmp::connect`], except [`QmpError::Connect`]; [`QmpError::Closed`] if QEMU exited
    /// before greeting.
    pub async fn over(stream: UnixStream, timeout: Duration) -> Result<Qmp, QmpError> {
        Qmp::greet(stream, "an inherited socket", Instant::now() + timeout, timeout).await
    }

    /// Reads the greeting on `stream` and negotiates before `deadline`; `what` names the
    /// socket in a timeout error.
    async fn greet(stream: UnixStream, what: &str, deadline: Instant, timeout: Duration) -> Result<Qmp, QmpError> {
        let (read, write) = stream.into_split();
        let mut qmp = Qmp {
            reader: BufReader::new(read),
            writer: write,
            line: Vec::new(),
            next_id: 1,
            timeout: DEFAULT_TIMEOUT,
            events: VecDeque::new(),
            greeting: Value::Null,
            broken: false,
        };
        match tokio::time::timeout_at(deadline, qmp.handshake()).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(QmpError::Timeout { what: format!("greeting on {what}"), after: timeout });
            }
        }
        Ok(qmp)
    }

    /// Reads the greeting and leaves capabilities negotiation mode.
    async fn handshake(&mut self) -> Result<(), QmpError> {
        let greeting = self.read_message().await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("expected a QMP greeting, got {}", excerpt(&greeting))));
        }
        self.greeting = greeting;
        let id = self.send("qmp_capabilities", None).await?;
        self.wait_reply(id).await?;
        Ok(())
    }

    /// QEMU's greeting, with its version and capabilities.
    pub fn greeting(&self) -> &Value {
        &self.greeting
    }

    /// Whether the stream is out of step (a write cut short, an overlong line): every call on
    /// this connection fails from now on.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// The bound on each call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes the bound on each call.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Removes and returns the events received so far (at most [`MAX_EVENTS`], oldest first).
    pub fn take_events(&mut self) -> Vec<Value> {
        self.events.drain(..).collect()
    }

    /// Runs `command` with optional `arguments` and returns its `return` value. Events that
    /// arrive before the reply are kept (see [`Qmp::take_events`]); replies to earlier commands
    /// that timed out are skipped.
    ///
    /// # Errors
    /// [`QmpError::Command`] when QEMU answers with an error, [`QmpError::Timeout`] when no
    /// reply came within [`Qmp::timeout`], [`QmpError::Closed`] on end of file,
    /// [`QmpError::Io`] and [`QmpError::Protocol`] as documented on the variants.
    pub async fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let timeout = self.timeout;
        let call = async {
            let id = self.send(command, arguments).await?;
            self.wait_reply(id).await
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(QmpError::Timeout { what: format!("command {command:?}"), after: timeout }),
        }
    }

    /// The VM's run state from `query-status`: `running`, `paused`, `shutdown`, `prelaunch`, ...
    ///
    /// # Errors
    /// As [`Qmp::execute`], and [`QmpError::Protocol`] if the reply has no `status` string.
    pub async fn query_status(&mut self) -> Result<String, QmpError> {
        let reply = self.execute("query-status", None).await?;
        reply
            .get("status")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| QmpError::Protocol(format!("query-status without status: {}", excerpt(&reply))))
    }

    /// Presses the virtual power button (ACPI). Only a guest that handles ACPI shuts down; QEMU
    /// then exits (unless started with `-no-shutdown`). The caller must still bound the wait and
    /// kill if the guest ignores it.
    ///
    /// # Errors
    /// As [`Qmp::execute`].
    pub async fn system_powerdown(&mut self) -> Result<(), QmpError> {
        self.execute("system_powerdown", None).await.map(drop)
    }

    /// Waits, without a time limit, for the next asynchronous event (kept ones first) and
    /// returns it. For a monitor used only to listen (the VM's event monitor).
    ///
    /// # Errors
    /// [`QmpError::Closed`] once QEMU is gone; [`QmpError::Io`] and [`QmpError::Protocol`] as
    /// documented on the variants.
    pub async fn next_event(&mut self) -> Result<Value, QmpError> {
        if let Some(e) = self.events.pop_front() {
            return Ok(e);
        }
        loop {
            let msg = self.read_message().await?;
            if msg.get("event").is_some() {
                return Ok(msg);
            }
        }
    }

    /// Runs `command` like [`Qmp::execute`], handing QEMU `fd` with the command's bytes
    /// (`SCM_RIGHTS`). QEMU keeps one received descriptor for the next command that takes one
    /// (`add-fd`, `getfd`), so commands that take a descriptor are sent one at a time.
    ///
    /// # Errors
    /// As [`Qmp::execute`].
    pub async fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        let timeout = self.timeout;
        let call = async {
            let id = self.send_with_fd(command, arguments, fd).await?;
            self.wait_reply(id).await
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(QmpError::Timeout { what: format!("command {command:?}"), after: timeout }),
        }
    }

    /// Adds `fd` to QEMU's fd set `fdset` (a new set when `None`) with `opaque` as its
    /// description; returns the set's id. QEMU opens `/dev/fdset/ID` by picking a descriptor of
    /// the set whose access mode matches.
    ///
    /// # Errors
    /// As [`Qmp::execute`], and [`QmpError::Protocol`] if the reply has no `fdset-id`.
    pub async fn add_fd(
        &mut self,
        fd: std::os::fd::BorrowedFd<'_>,
        fdset: Option<u64>,
        opaque: &str,
    ) -> Result<u64, QmpError> {
        let mut args = serde_json::json!({ "opaque": opaque });
        if let Some(id) = fdset {
            args["fdset-id"] = Value::from(id);
        }
        let reply = self.execute_with_fd("add-fd", Some(args), fd).await?;
        reply
            .get("fdset-id")
            .and_then(Value::as_u64)
            .ok_or_else(|| QmpError::Protocol(format!("add-fd without fdset-id: {}", excerpt(&reply))))
    }

    /// Waits up to `timeout` for an event `matches` accepts (kept events first); other events
    /// are kept. Returns `None` when none came in time.
    ///
    /// # Errors
    /// [`QmpError::Closed`] once QEMU is gone; [`QmpError::Io`] and [`QmpError::Protocol`] as
    /// documented on the variants.
    pub async fn wait_event(
        &mut self,
        matches: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Result<Option<Value>, QmpError> {
        if let Some(i) = self.events.iter().position(&matches) {
            return Ok(self.events.remove(i));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let msg = match tokio::time::timeout_at(deadline, self.read_message()).await {
                Ok(msg) => msg?,
                Err(_) => return Ok(None),
            };
            if msg.get("event").is_none() {
                continue; // a late reply to a command that timed out
            }
            if matches(&msg) {
                return Ok(Some(msg));
            }
            if self.events.len() == MAX_EVENTS {
                self.events.pop_front();
            }
            self.events.push_back(msg);
        }
    }

    /// Grows the block device `device` (the VM's disk is `virtio0`, see
    /// [`crate::qemu::argv`]) to `bytes` while the guest runs; the guest sees the new size.
    ///
    /// # Errors
    /// As [`Qmp::execute`] (QEMU refuses a size below the current one).
    pub async fn block_resize(&mut self, device: &str, bytes: u64) -> Result<(), QmpError> {
        let args = serde_json::json!({ "device": device, "size": bytes });
        self.execute("block_resize", Some(args)).await.map(drop)
    }

    /// The host thread of each vCPU (`query-cpus-fast`), by vCPU index.
    ///
    /// # Errors
    /// As [`Qmp::execute`], and [`QmpError::Protocol`] if the reply is not a list of CPUs.
    pub async fn vcpu_threads(&mut self) -> Result<Vec<VcpuThread>, QmpError> {
        let reply = self.execute("query-cpus-fast", None).await?;
        serde_json::from_value(reply).map_err(|e| QmpError::Protocol(format!("query-cpus-fast: {e}")))
    }

    /// The I/O counters of every block device the guest sees (`query-blockstats`).
    ///
    /// # Errors
    /// As [`Qmp::execute`], and [`QmpError::Protocol`] if the reply is not a list of devices.
    pub async fn blockstats(&mut self) -> Result<Vec<BlockStats>, QmpError> {
        let reply = self.execute("query-blockstats", None).await?;
        serde_json::from_value(reply).map_err(|e| QmpError::Protocol(format!("query-blockstats: {e}")))
    }

    /// Makes QEMU exit at once (no guest shutdown). QEMU may close the socket before or after
    /// its reply; end of file (or a reset) after the command was sent counts as success. The
    /// process may still be exiting when this returns: wait for it with
    /// [`crate::process::wait_exit_of`].
    ///
    /// # Errors
    /// As [`Qmp::execute`], except that [`QmpError::Closed`] after sending is success.
    pub async fn quit(&mut self) -> Result<(), QmpError> {
        let timeout = self.timeout;
        let call = async {
            let id = self.send("quit", None).await?;
            match self.wait_reply(id).await {
                Ok(_) | Err(QmpError::Closed) => Ok(()),
                Err(e) => Err(e),
            }
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(QmpError::Timeout { what: "command \"quit\"".to_string(), after: timeout }),
        }
    }

    /// Writes one command and returns its id.
    async fn send(&mut self, command: &str, arguments: Option<Value>) -> Result<u64, QmpError> {
        let (id, bytes) = self.encode(command, arguments)?;
        // If this future is dropped mid-write (timeout), half a command may be on the wire.
        self.broken = true;
        self.writer.write_all(&bytes).await.map_err(io_error)?;
        self.broken = false;
        Ok(id)
    }

    /// The next command's id and its line, unless the connection is out of step.
    fn encode(&mut self, command: &str, arguments: Option<Value>) -> Result<(u64, Vec<u8>), QmpError> {
        if self.broken {
            return Err(QmpError::Protocol(
                "connection out of step after an interrupted write or an overlong line; \
                 reconnect"
                    .to_string(),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = Map::new();
        msg.insert("execute".to_string(), Value::from(command));
        if let Some(arguments) = arguments {
            msg.insert("arguments".to_string(), arguments);
        }
        msg.insert("id".to_string(), Value::from(id));
        let mut bytes = serde_json::to_vec(&Value::Object(msg))
            .map_err(|e| QmpError::Protocol(format!("cannot encode command: {e}")))?;
        bytes.push(b'\n');
        Ok((id, bytes))
    }

    /// Writes one command with `fd` attached to its bytes and returns its id.
    async fn send_with_fd(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<u64, QmpError> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        use std::os::fd::AsRawFd;
        let (id, bytes) = self.encode(command, arguments)?;
        self.broken = true;
        let raw = [fd.as_raw_fd()];
        let stream: &UnixStream = self.writer.as_ref();
        // The descriptor travels with the first bytes; the rest of the line follows as usual.
        let sent = loop {
            stream.writable().await.map_err(io_error)?;
            let attempt = stream.try_io(tokio::io::Interest::WRITABLE, || {
                sendmsg::<()>(
                    stream.as_raw_fd(),
                    &[io::IoSlice::new(&bytes)],
                    &[ControlMessage::ScmRights(&raw)],
                    MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                    None,
                )
                .map_err(io::Error::from)
            });
            match attempt {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(io_error(e)),
            }
        };
        if let Some(rest) = bytes.get(sent..).filter(|r| !r.is_empty()) {
            self.writer.write_all(rest).await.map_err(io_error)?;
        }
        self.broken = false;
        Ok(id)
    }

    /// Reads until the reply to command `id`, keeping events and skipping stale replies.
    async fn wait_reply(&mut self, id: u64) -> Result<Value, QmpError> {
        loop {
            let msg = self.read_message().await?;
            let Value::Object(mut obj) = msg else {
                return Err(QmpError::Protocol(format!("expected a JSON object, got {}", excerpt(&msg))));
            };
            if obj.contains_key("event") {
                if self.events.len() == MAX_EVENTS {
                    self.events.pop_front();
                }
                self.events.push_back(Value::Object(obj));
                continue;
            }
            if !obj.contains_key("return") && !obj.contains_key("error") {
                return Err(QmpError::Protocol(format!("unexpected message {}", excerpt(&Value::Object(obj)))));
            }
            match obj.get("id").map(Value::as_u64) {
                Some(Some(n)) if n == id => {}
                Some(Some(n)) if n < id => {
                    tracing::debug!(id = n, "skipping reply to a command that timed out");
                    continue;
                }
                // QEMU answers without an id only when it could not parse the request far
                // enough to read it; the only request in flight is ours.
                None if obj.contains_key("error") => {}
                _ => {
                    return Err(QmpError::Protocol(format!(
                        "reply with unexpected id to command {id}: {}",
                        excerpt(&Value::Object(obj))
                    )));
                }
            }
            if let Some(value) = obj.remove("return") {
                return Ok(value);
            }
            let error = obj.remove("error").unwrap_or(Value::Null);
            let field = |name: &str| error.get(name).and_then(Value::as_str).unwrap_or_default().to_string();
            return Err(QmpError::Command { class: field("class"), desc: field("desc") });
        }
    }

    /// Reads one non-empty line and parses it as JSON.
    async fn read_message(&mut self) -> Result<Value, QmpError> {
        loop {
            let line = self.read_line().await?;
            let text = line.trim_ascii();
            if text.is_empty() {
                continue;
            }
            return serde_json::from_slice(text).map_err(|e| {
                QmpError::Protocol(format!(
                    "bad JSON from QEMU ({e}): {}",
                    String::from_utf8_lossy(&text[..text.len().min(200)])
                ))
            });
        }
    }

    /// Reads one line of at most [`MAX_LINE`] bytes. Resumable: if the future is dropped,
    /// the bytes read so far stay in `self.line`.
    async fn read_line(&mut self) -> Result<Vec<u8>, QmpError> {
        loop {
            let room = (MAX_LINE + 1).saturating_sub(self.line.len()) as u64;
            let n = (&mut self.reader).take(room).read_until(b'\n', &mut self.line).await.map_err(io_error)?;
            if self.line.last() == Some(&b'\n') {
                return Ok(std::mem::take(&mut self.line));
            }
            if self.line.len() > MAX_LINE {
                self.line.clear();
                self.broken = true;
                return Err(QmpError::Protocol(format!("line longer than {MAX_LINE} bytes")));
            }
            if n == 0 {
                return Err(QmpError::Closed);
            }
        }
    }
}

/// One vCPU and the host thread that runs it, from `query-cpus-fast`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct VcpuThread {
    /// The vCPU's index.
    #[serde(rename = "cpu-index")]
    pub index: u32,
    /// The host thread id (`/proc/PID/task/TID`).
    #[serde(rename = "thread-id")]
    pub thread_id: i32,
}

/// One block device's counters, from `query-blockstats` (the fields vmhost reports).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct BlockStats {
    /// The drive's name (`virtio0`, ...); empty for a device without a legacy drive name.
    #[serde(default)]
    pub device: String,
    /// The root node's name: a hot-plugged data disk has no drive name but node `data-NAME`.
    #[serde(default, rename = "node-name")]
    pub node_name: String,
    /// The counters.
    pub stats: BlockCounters,
}

/// Cumulative I/O of one block device since QEMU started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
pub struct BlockCounters {
    /// Bytes read.
    pub rd_bytes: u64,
    /// Bytes written.
    pub wr_bytes: u64,
    /// Read requests.
    pub rd_operations: u64,
    /// Write requests.
    pub wr_operations: u64,
}

/// Connects to `path`, retrying while it is absent or refuses connections, until `deadline`.
async fn connect_retrying(path: &Path, deadline: Instant) -> Result<UnixStream, QmpError> {
    let fail = |source| QmpError::Connect { path: path.to_path_buf(), source };
    loop {
        let err = match tokio::time::timeout_at(deadline, UnixStream::connect(path)).await {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(e)) => e,
            Err(_) => {
                return Err(fail(io::Error::new(io::ErrorKind::TimedOut, "connection attempt timed out")));
            }
        };
        let retry = matches!(err.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused);
        if !retry || Instant::now() + CONNECT_RETRY >= deadline {
            return Err(fail(err));
        }
        tokio::time::sleep(CONNECT_RETRY).await;
    }
}

/// Maps a socket error, treating "the peer hung up" as [`QmpError::Closed`].
fn io_error(e: io::Error) -> QmpError {
    match e.kind() {
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => QmpError::Closed,
        _ => QmpError::Io(e),
    }
}

/// A short rendering of a message for error texts.
fn excerpt(v: &Value) -> String {
    let mut s = v.to_string();
    if s.len() > 200 {
        let mut cut = 200;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process;
    use crate::qemu::identity;
    use nix::sys::signal::Signal;
    use serde_json::json;
    use tokio::net::UnixListener;

    const GREETING: &str = r#"{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, "capabilities": ["oob"]}}"#;

    /// Server side of a fake QMP connection.
    struct Peer {
        lines: tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
        out: OwnedWriteHalf,
    }

    impl Peer {
        async fn send(&mut self, line: &str) {
            self.out.write_all(line.as_bytes()).await.unwrap();
            self.out.write_all(b"\n").await.unwrap();
        }

        /// Reads a command, checks its name, returns its id.
        async fn expect(&mut self, command: &str) -> Value {
            let line = self.lines.next_line().await.unwrap().unwrap();
            let v: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(v["execute"], command, "{line}");
            v
        }

        /// Greets and completes negotiation, with an event in between.
        async fn handshake(&mut self) {
            self.send(GREETING).await;
            let cmd = self.expect("qmp_capabilities").await;
            assert!(cmd.get("arguments").is_none());
            self.send(
                r#"{"event": "NIC_RX_FILTER_CHANGED", "data": {}, "timestamp": {"seconds": 1, "microseconds": 2}}"#,
            )
            .await;
            self.send(&json!({"return": {}, "id": cmd["id"]}).to_string()).await;
        }
    }

    /// A listening socket in a temp dir, and a task running `script` on the first connection.
    fn fake_qmp<F, Fut>(script: F) -> (tempfile::TempDir, PathBuf, tokio::task::JoinHandle<()>)
    where
        F: FnOnce(Peer) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let task = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let (r, w) = stream.into_split();
            script(Peer { lines: BufReader::new(r).lines(), out: w }).await;
        });
        (dir, path, task)
    }

    #[tokio::test]
    async fn execute_skips_events_and_stale_replies_and_maps_errors() {
        let (_dir, path, server) = fake_qmp(|mut peer| async move {
            peer.handshake().await;

            let cmd = peer.expect("query-status").await;
            let id = cmd["id"].as_u64().unwrap();
            peer.send(&json!({"return": {"status": "stale"}, "id": id - 1}).to_string()).await;
            peer.send(r#"{"event": "SHUTDOWN", "data": {"guest": true, "reason": "guest-shutdown"}, "timestamp": {"seconds": 3, "microseconds": 4}}"#).await;
            peer.send(r#"{"event": "STOP", "timestamp": {"seconds": 3, "microseconds": 5}}"#).await;
            peer.send(&json!({"return": {"status": "running", "running": true}, "id": id}).to_string()).await;

            let cmd = peer.expect("device_del").await;
            assert_eq!(cmd["arguments"], json!({"id": "nic0"}));
            peer.send(
                &json!({"error": {"class": "DeviceNotFound", "desc": "Device 'nic0' not found"}, "id": cmd["id"]})
                    .to_string(),
            )
            .await;

            peer.expect("quit").await;
            // QEMU may close without replying.
        });
        let mut qmp = Qmp::connect(&path, Duration::from_secs(5)).await.unwrap();
        assert_eq!(qmp.greeting()["QMP"]["version"]["qemu"]["major"], 7);
        assert_eq!(qmp.query_status().await.unwrap(), "running");
        let events: Vec<String> = qmp.take_events().iter().map(|e| e["event"].as_str().unwrap().to_string()).collect();
        assert_eq!(events, ["NIC_RX_FILTER_CHANGED", "SHUTDOWN", "STOP"]);
        assert!(qmp.take_events().is_empty());

        match qmp.execute("device_del", Some(json!({"id": "nic0"}))).await {
            Err(QmpError::Command { class, desc }) => {
                assert_eq!(class, "DeviceNotFound");
                assert!(desc.contains("nic0"));
            }
            other => panic!("expected a command error, got {other:?}"),
        }
        qmp.quit().await.unwrap();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_silent_peer_times_out_and_eof_is_closed() {
        let (_dir, path, server) = fake_qmp(|mut peer| async move {
            peer.handshake().await;
            peer.expect("query-status").await;
            // No answer; then hang up after the client gave up.
            tokio::time::sleep(Duration::from_millis(400)).await;
        });
        let mut qmp = Qmp::connect(&path, Duration::from_secs(5)).await.unwrap();
        qmp.set_timeout(Duration::from_millis(200));
        match qmp.query_status().await {
            Err(QmpError::Timeout { after, .. }) => assert_eq!(after, Duration::from_millis(200)),
            other => panic!("expected a timeout, got {other:?}"),
        }
        server.await.unwrap();
        qmp.set_timeout(Duration::from_secs(5));
        assert!(matches!(qmp.execute("query-status", None).await, Err(QmpError::Closed)));
    }

    #[tokio::test]
    async fn an_overlong_line_is_a_protocol_error() {
        let (_dir, path, server) = fake_qmp(|mut peer| async move {
            peer.handshake().await;
            peer.expect("query-status").await;
            let big = format!(r#"{{"event": "X", "data": "{}"}}"#, "a".repeat(MAX_LINE));
            // The client stops reading; ignore the resulting write error.
            let _ = peer.out.write_all(big.as_bytes()).await;
        });
        let mut qmp = Qmp::connect(&path, Duration::from_secs(5)).await.unwrap();
        match qmp.query_status().await {
            Err(QmpError::Protocol(msg)) => assert!(msg.contains("longer"), "{msg}"),
            other => panic!("expected a protocol error, got {other:?}"),
        }
        // The connection is out of step from now on.
        assert!(matches!(qmp.query_status().await, Err(QmpError::Protocol(_))));
        drop(qmp);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_peer_that_is_not_qmp_is_rejected() {
        let (_dir, path, server) = fake_qmp(|mut peer| async move {
            peer.send(r#"{"hello": "world"}"#).await;
        });
        match Qmp::connect(&path, Duration::from_secs(5)).await {
            Err(QmpError::Protocol(msg)) => assert!(msg.contains("greeting"), "{msg}"),
            other => panic!("expected a protocol error, got {other:?}"),
        }
        server.await.unwrap();
    }

    #[tokio::test]
    async fn connect_retries_until_the_socket_appears_then_gives_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("late.sock");

        // No socket at all: Connect with the last error, after about the timeout.
        let started = std::time::Instant::now();
        match Qmp::connect(&path, Duration::from_millis(300)).await {
            Err(QmpError::Connect { source, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::NotFound)
            }
            other => panic!("expected a connect error, got {other:?}"),
        }
        assert!(started.elapsed() >= Duration::from_millis(200));

        // The socket appears 300 ms after the client started trying.
        let late = path.clone();
        let server = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let listener = UnixListener::bind(&late).unwrap();
            let (stream, _) = listener.accept().await.unwrap();
            let (r, w) = stream.into_split();
            let mut peer = Peer { lines: BufReader::new(r).lines(), out: w };
            peer.handshake().await;
        });
        let qmp = Qmp::connect(&path, Duration::from_secs(5)).await.unwrap();
        assert!(qmp.greeting().get("QMP").is_some());
        server.await.unwrap();
    }

    /// A daemonized QEMU for a test; SIGKILLed on drop if the test did not stop it.
    struct TestQemu {
        _dir: tempfile::TempDir,
        sock: PathBuf,
        id: process::ProcessIdentity,
    }

    impl TestQemu {
        fn start() -> TestQemu {
            let dir = tempfile::tempdir().unwrap();
            let sock = dir.path().join("qmp.sock");
            let pidfile = dir.path().join("qemu.pid");
            let mut qmp_arg = std::ffi::OsString::from("unix:");
            qmp_arg.push(&sock);
            qmp_arg.push(",server=on,wait=off");
            let out = std::process::Command::new("qemu-system-x86_64")
                .args(["-accel", "tcg", "-M", "q35", "-m", "64", "-nodefaults"])
                .args(["-display", "none", "-qmp"])
                .arg(&qmp_arg)
                .arg("-daemonize")
                .arg("-pidfile")
                .arg(&pidfile)
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap();
            assert!(out.status.success(), "qemu failed: {}", String::from_utf8_lossy(&out.stderr));
            let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
            let id = process::identify(pid).unwrap();
            TestQemu { _dir: dir, sock, id }
        }

        /// What identifies it: an orphan (`-daemonize`) of this uid running the QEMU binary.
        fn check(&self) -> identity::QemuCheck {
            identity::tests::orphan_check(self.sock.as_os_str(), "/usr/bin/qemu-system-x86_64")
        }
    }

    impl Drop for TestQemu {
        fn drop(&mut self) {
            let _ = identity::signal_if_qemu(&self.id, &self.check(), Signal::SIGKILL);
        }
    }

    #[tokio::test]
    async fn real_qemu_status_unknown_command_and_quit() {
        let vm = TestQemu::start();
        assert!(identity::is_qemu(&vm.id, &vm.check()));
        let mut qmp = Qmp::connect(&vm.sock, Duration::from_secs(10)).await.unwrap();
        assert_eq!(qmp.greeting()["QMP"]["version"]["qemu"]["major"], 7);
        assert_eq!(qmp.query_status().await.unwrap(), "running");

        match qmp.execute("no-such-command", None).await {
            Err(QmpError::Command { class, desc }) => {
                assert_eq!(class, "CommandNotFound");
                assert!(desc.contains("no-such-command"), "{desc}");
            }
            other => panic!("expected CommandNotFound, got {other:?}"),
        }
        // Bad arguments to a real command are a command error too, and the connection stays
        // usable.
        match qmp.execute("query-status", Some(json!({"bogus": 1}))).await {
            Err(QmpError::Command { class, .. }) => assert_eq!(class, "GenericError"),
            other => panic!("expected GenericError, got {other:?}"),
        }
        assert_eq!(qmp.query_status().await.unwrap(), "running");

        // A second client gets no greeting while this one is connected.
        assert!(matches!(Qmp::connect(&vm.sock, Duration::from_millis(500)).await, Err(QmpError::Timeout { .. })));

        qmp.quit().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), process::wait_exit_of(&vm.id))
            .await
            .expect("QEMU did not exit after quit")
            .unwrap();
        assert!(!identity::is_qemu(&vm.id, &vm.check()));
        // The socket is gone with the process.
        assert!(Qmp::connect(&vm.sock, Duration::from_millis(200)).await.is_err());
    }

    #[tokio::test]
    async fn real_qemu_powerdown_without_acpi_guest_keeps_running() {
        let vm = TestQemu::start();
        let mut qmp = Qmp::connect(&vm.sock, Duration::from_secs(10)).await.unwrap();
        // SeaBIOS with no OS does not act on the ACPI power button: the command succeeds and
        // the VM keeps running, which is why a stop must fall back to killing.
        qmp.system_powerdown().await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(qmp.query_status().await.unwrap(), "running");
        assert!(identity::is_qemu(&vm.id, &vm.check()));
        let events: Vec<Value> = qmp.take_events();
        assert!(events.iter().any(|e| e["event"] == "POWERDOWN"), "{events:?}");
        // Kill, and see it exit through the pidfd although it is not our child.
        assert!(identity::signal_if_qemu(&vm.id, &vm.check(), Signal::SIGKILL).unwrap());
        tokio::time::timeout(Duration::from_secs(10), process::wait_exit_of(&vm.id))
            .await
            .expect("QEMU did not exit after SIGKILL")
            .unwrap();
        assert!(!process::liveness(vm.id.pid).is_alive());
        drop(vm);
    }
}
