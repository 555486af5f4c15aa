//! One session on one exec port: connect, synchronise, one request, its bulk bytes both ways,
//! its final reply; then the port is let go.
//!
//! Order: take a slot ([`super::slots::ExecSlots::try_acquire`]), [`Session::open`] it (connect
//! to `RUN/NAME/execN`, `sync` and `hello` exactly as on the agent port, through
//! [`AgentConn::connect`], and check that `hello` lists the method), then one of [`call`] (one
//! request with typed params, one typed reply: `time.set`, `guest.shutdown`, `ssh.authorize`),
//! [`Session::exec`], or [`super::files`]'s push and pull. Dropping the session hangs up, which
//! makes the guest kill a command still running; dropping its [`SlotGuard`] frees the slot.
//!
//! The guest is hostile, as on the agent port: lines are cut by [`LineReader`] (at most
//! [`crate::agent::frame::MAX_FRAME`] bytes), the final reply is matched by id with
//! [`match_reply`] into a closed type, unrelated lines cost the [`SkipBudget`], every
//! notification's bytes are checked against what was asked for (a guest that sends more output
//! than `max_output`, or more file than `max_bytes`, ends the session), and every exchange has
//! one deadline. What a call keeps is bounded: the output asked for plus one frame.

use super::base64;
use super::slots::{ExecSlots, SlotGuard, SlotsBusy};
use crate::agent::conn::AgentConn;
use crate::agent::error::AgentError;
use crate::agent::frame::{match_reply, LineReader, SkipBudget};
use crate::guest_text::GuestText;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use vmhost_agent_protocol::exec::{Chunk, ExecParams, ExecReply, OutputStream, MAX_CHUNK};

/// Bound on connecting, `sync` and `hello`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long past a command's own timeout the guest has for its final reply (it kills the
/// command at the timeout, then reports).
pub const REPLY_GRACE: Duration = Duration::from_secs(10);

/// Why an exec-port call failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// All exec slots of the VM are in use.
    #[error(transparent)]
    Busy(#[from] SlotsBusy),
    /// The VM's QEMU has no exec port sockets: a vmhostd before issue 29 started it.
    #[error("the VM has no exec ports (its QEMU was started by an older vmhostd): restart the VM to get exec ports")]
    NoPorts,
    /// Nothing usable answered `sync`/`hello` on the port: no exec server runs in the guest
    /// (or the VM's QEMU is gone).
    #[error("no exec server answered on exec port {slot} (is vmhost-agent --exec running in the guest?): {source}")]
    NoServer {
        /// The slot whose port was tried.
        slot: usize,
        /// What went wrong.
        #[source]
        source: AgentError,
    },
    /// The exec server answered `hello` without the method (an older agent).
    #[error("the guest's exec server does not serve {0}")]
    NotServed(String),
    /// No final reply within the exchange's bound.
    #[error("the guest's exec server did not answer {method} within {after:?}")]
    Timeout {
        /// The request.
        method: String,
        /// The bound.
        after: Duration,
    },
    /// The session broke or the guest sent something that is not the protocol.
    #[error("exec session failed: {0}")]
    Session(AgentError),
    /// The exec server answered with a JSON-RPC error; its message is the guest's.
    #[error("the guest refused {method}: {} (code {code})", GuestText(.message))]
    Refused {
        /// The request.
        method: String,
        /// The guest's code (`-32602`, `5100`, `-32603`, ...).
        code: i64,
        /// The guest's message (at most 512 characters).
        message: String,
        /// The guest's data.
        data: Value,
    },
    /// Bytes do not have the sha256 they should (a request's, or the one the guest claims).
    #[error("{what}: sha256 {found} is not the expected {expected}")]
    Checksum {
        /// Whose bytes.
        what: &'static str,
        /// The sha256 they should have.
        expected: String,
        /// The sha256 they have.
        found: String,
        /// How many bytes were hashed.
        bytes: u64,
    },
    /// The caller stopped listening to streamed output (its connection is gone).
    #[error("the caller went away")]
    CallerGone,
    /// A host file to send could not be read.
    #[error("cannot read {path}: {source}")]
    Source {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl ExecError {
    fn from_agent(method: &str, e: AgentError) -> ExecError {
        match e {
            AgentError::Remote { code, message, data } => {
                ExecError::Refused { method: method.to_string(), code, message, data }
            }
            other => ExecError::Session(other),
        }
    }
}

/// Bytes a request sends after it, as [`Chunk`] lines.
pub enum Body<'a> {
    /// Nothing.
    Empty,
    /// Bytes in memory.
    Bytes(&'a [u8]),
    /// Exactly `size` bytes of a file, from its current offset.
    File {
        /// The file (the name is only for messages).
        file: &'a mut tokio::fs::File,
        /// Where it is, for messages.
        path: &'a Path,
        /// Bytes to send.
        size: u64,
    },
}

/// A piece of output as it arrived, for a caller that streams it on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputChunk {
    /// Which stream.
    pub stream: OutputStream,
    /// The bytes.
    pub data: Vec<u8>,
}

/// What the notifications of one request brought: kept in memory up to `keep` bytes per
/// stream, or passed on to `forward`.
struct Received {
    /// The notification method expected (`exec.output` or `file.data`).
    method: &'static str,
    /// Bytes per stream the guest may send ([`ExecParams::max_output`], or `max_bytes`).
    limit: u64,
    /// Where output goes instead of memory.
    forward: Option<mpsc::Sender<OutputChunk>>,
    /// Kept bytes per stream (`file.data`'s are stdout's).
    kept: [Vec<u8>; 2],
    /// Bytes received per stream.
    got: [u64; 2],
}

/// A notification line of the guest.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Notification {
    #[allow(dead_code)]
    jsonrpc: String,
    method: String,
    params: Chunk,
}

impl Received {
    fn new(method: &'static str, limit: u64, forward: Option<mpsc::Sender<OutputChunk>>) -> Received {
        Received { method, limit, forward, kept: [Vec::new(), Vec::new()], got: [0, 0] }
    }

    /// Takes `line` when it is a notification of request `id`; false when it is not one.
    async fn take(&mut self, line: &[u8], id: u64) -> Result<bool, ExecError> {
        let Ok(note) = serde_json::from_slice::<Notification>(line) else { return Ok(false) };
        if note.method != self.method || note.params.id != Some(id) {
            return Ok(false);
        }
        let protocol = |m: String| ExecError::Session(AgentError::Protocol(m));
        let stream = match (self.method, note.params.stream) {
            ("exec.output", Some(s)) => s,
            ("file.data", None) => OutputStream::Stdout,
            _ => return Err(protocol(format!("{} with a wrong stream member", self.method))),
        };
        let data = base64::decode(&note.params.data).map_err(|e| protocol(format!("{}: {e}", self.method)))?;
        if data.len() > MAX_CHUNK {
            return Err(protocol(format!("a chunk of {} bytes (at most {MAX_CHUNK})", data.len())));
        }
        let i = usize::from(stream == OutputStream::Stderr);
        self.got[i] = self.got[i].saturating_add(data.len() as u64);
        if self.got[i] > self.limit {
            return Err(protocol(format!("more than the {} bytes asked for ({})", self.limit, self.method)));
        }
        match &self.forward {
            Some(tx) => tx.send(OutputChunk { stream, data }).await.map_err(|_| ExecError::CallerGone)?,
            None => self.kept[i].extend_from_slice(&data),
        }
        Ok(true)
    }
}

/// An open session on one exec port, holding its slot.
#[derive(Debug)]
pub struct Session {
    stream: UnixStream,
    reader: LineReader,
    next_id: u64,
    method: String,
    slot: SlotGuard,
}

impl Session {
    /// Connects to the port of `slot` (`sockets[slot]`), synchronises, and checks that the
    /// exec server serves `method`.
    ///
    /// # Errors
    /// [`ExecError::NoPorts`] when the port's socket does not exist, [`ExecError::NoServer`]
    /// when nothing answers `sync`/`hello` properly within [`CONNECT_TIMEOUT`],
    /// [`ExecError::NotServed`] when `hello` does not list `method`.
    pub async fn open(sockets: &[PathBuf], slot: SlotGuard, method: &str) -> Result<Session, ExecError> {
        let socket = sockets.get(slot.slot()).ok_or(ExecError::NoPorts)?;
        let conn = AgentConn::connect(socket, CONNECT_TIMEOUT).await.map_err(|e| match e {
            AgentError::Connect(io) if io.kind() == std::io::ErrorKind::NotFound => ExecError::NoPorts,
            source => ExecError::NoServer { slot: slot.slot(), source },
        })?;
        if !conn.hello.capabilities.iter().any(|c| c == method) {
            return Err(ExecError::NotServed(method.to_string()));
        }
        let (stream, reader, next_id) = conn.into_parts();
        Ok(Session { stream, reader, next_id, method: method.to_string(), slot })
    }

    /// The slot this session holds.
    pub fn slot(&self) -> usize {
        self.slot.slot()
    }

    /// Sends the request with `params`, then `body` while reading the notifications into
    /// `received`, until the final reply; all within `bound`.
    async fn exchange<R: DeserializeOwned>(
        &mut self,
        params: Value,
        body: Body<'_>,
        received: &mut Received,
        bound: Duration,
    ) -> Result<R, ExecError> {
        let id = self.next_id;
        self.next_id += 1;
        let method = self.method.clone();
        let request = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let (mut rd, mut wr) = self.stream.split();
        let reader = &mut self.reader;
        // Written while the replies are read: a guest that answers as it reads must never
        // wait on a host that only writes.
        let write = async {
            write_line(&mut wr, &request.to_string()).await?;
            write_body(&mut wr, body).await
        };
        let read = async {
            let mut budget = SkipBudget::new();
            let want = json!(id);
            loop {
                let line = read_line(&mut rd, reader).await.map_err(ExecError::Session)?;
                if let Some(outcome) = match_reply::<R>(&line, &want) {
                    return outcome.map_err(|e| ExecError::from_agent(&method, e));
                }
                if !received.take(&line, id).await? {
                    budget.skip(&line).map_err(ExecError::Session)?;
                }
            }
        };
        match tokio::time::timeout(bound, async { tokio::try_join!(write, read) }).await {
            Ok(Ok(((), reply))) => Ok(reply),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ExecError::Timeout { method: self.method.clone(), after: bound }),
        }
    }

    /// One request with typed params and one typed reply, no bulk bytes.
    ///
    /// # Errors
    /// [`ExecError::Timeout`] past `bound`, [`ExecError::Refused`] when the guest answers with
    /// an error, [`ExecError::Session`] when the session breaks or the reply does not fit `R`.
    pub async fn request<P: Serialize, R: DeserializeOwned>(
        &mut self,
        params: &P,
        bound: Duration,
    ) -> Result<R, ExecError> {
        let params =
            serde_json::to_value(params).map_err(|e| ExecError::Session(AgentError::Protocol(e.to_string())))?;
        let mut none = Received::new("", 0, None);
        self.exchange(params, Body::Empty, &mut none, bound).await
    }

    /// Runs a command: `params.stdin_bytes` must be `stdin.len()`. Output is kept in memory
    /// (at most `max_output` per stream), or sent to `forward` as it arrives (then the outcome's
    /// output is empty). The bound is the command's timeout plus [`REPLY_GRACE`].
    ///
    /// # Errors
    /// As [`Session::request`]; [`ExecError::CallerGone`] when `forward` is closed (the
    /// session is then dropped, which kills the command in the guest).
    pub async fn exec(
        mut self,
        params: &ExecParams,
        stdin: &[u8],
        forward: Option<mpsc::Sender<OutputChunk>>,
    ) -> Result<ExecOutcome, ExecError> {
        let bound = Duration::from_secs(u64::from(params.timeout_s)) + REPLY_GRACE;
        let mut received = Received::new("exec.output", params.max_output, forward);
        let value =
            serde_json::to_value(params).map_err(|e| ExecError::Session(AgentError::Protocol(e.to_string())))?;
        let reply: ExecReply = self.exchange(value, Body::Bytes(stdin), &mut received, bound).await?;
        let [stdout, stderr] = std::mem::take(&mut received.kept);
        Ok(ExecOutcome { reply, stdout, stderr, received: received.got, slot: self.slot() })
    }

    /// Sends a request with a body (`file.push`).
    pub(super) async fn send_with_body<P: Serialize, R: DeserializeOwned>(
        &mut self,
        params: &P,
        body: Body<'_>,
        bound: Duration,
    ) -> Result<R, ExecError> {
        let params =
            serde_json::to_value(params).map_err(|e| ExecError::Session(AgentError::Protocol(e.to_string())))?;
        let mut none = Received::new("", 0, None);
        self.exchange(params, body, &mut none, bound).await
    }

    /// Sends a request whose reply comes after `file.data` notifications of at most `limit`
    /// bytes in all (`file.pull`); returns the reply and the bytes.
    pub(super) async fn receive_file<P: Serialize, R: DeserializeOwned>(
        &mut self,
        params: &P,
        limit: u64,
        bound: Duration,
    ) -> Result<(R, Vec<u8>), ExecError> {
        let params =
            serde_json::to_value(params).map_err(|e| ExecError::Session(AgentError::Protocol(e.to_string())))?;
        let mut received = Received::new("file.data", limit, None);
        let reply = self.exchange(params, Body::Empty, &mut received, bound).await?;
        let [data, _] = std::mem::take(&mut received.kept);
        Ok((reply, data))
    }
}

/// What [`Session::exec`] brought back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutcome {
    /// The guest's final reply.
    pub reply: ExecReply,
    /// Standard output kept (empty when streamed).
    pub stdout: Vec<u8>,
    /// Standard error kept (empty when streamed).
    pub stderr: Vec<u8>,
    /// Bytes received per stream (stdout, stderr), kept or streamed.
    pub received: [u64; 2],
    /// The slot it ran on.
    pub slot: usize,
}

impl ExecOutcome {
    /// Whether stdout was cut: the command wrote more than was received.
    pub fn stdout_truncated(&self) -> bool {
        self.reply.stdout_bytes > self.received[0]
    }

    /// Whether stderr was cut.
    pub fn stderr_truncated(&self) -> bool {
        self.reply.stderr_bytes > self.received[1]
    }
}

/// One request with typed params and one typed reply on a free exec slot of `vm` (whose port
/// sockets are `sockets`): the call `time.set`, `guest.shutdown` and `ssh.authorize` use.
/// Returns the reply and the slot it used.
///
/// # Errors
/// [`ExecError::Busy`] when all slots of `vm` are in use; otherwise as [`Session::open`] and
/// [`Session::request`] (`bound` is the reply's deadline after the session is open).
pub async fn call<P: Serialize, R: DeserializeOwned>(
    slots: &ExecSlots,
    vm: &str,
    sockets: &[PathBuf],
    method: &str,
    params: &P,
    bound: Duration,
) -> Result<(R, usize), ExecError> {
    let guard = slots.try_acquire(vm)?;
    let mut session = Session::open(sockets, guard, method).await?;
    let reply = session.request(params, bound).await?;
    Ok((reply, session.slot()))
}

/// Writes `text` and a newline.
async fn write_line<W: AsyncWrite + Unpin>(wr: &mut W, text: &str) -> Result<(), ExecError> {
    let mut bytes = Vec::with_capacity(text.len() + 1);
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(b'\n');
    wr.write_all(&bytes).await.map_err(|e| ExecError::Session(AgentError::Closed(e.to_string())))
}

/// Writes one [`Chunk`] line of at most [`MAX_CHUNK`] bytes.
async fn write_chunk<W: AsyncWrite + Unpin>(wr: &mut W, data: &[u8]) -> Result<(), ExecError> {
    let chunk = Chunk { id: None, stream: None, data: base64::encode(data) };
    let line = serde_json::to_string(&chunk).map_err(|e| ExecError::Session(AgentError::Protocol(e.to_string())))?;
    write_line(wr, &line).await
}

/// Writes `body` as chunk lines: exactly its announced bytes.
async fn write_body<W: AsyncWrite + Unpin>(wr: &mut W, body: Body<'_>) -> Result<(), ExecError> {
    match body {
        Body::Empty => Ok(()),
        Body::Bytes(bytes) => {
            for piece in bytes.chunks(MAX_CHUNK) {
                write_chunk(wr, piece).await?;
            }
            Ok(())
        }
        Body::File { file, path, size } => {
            let mut left = size;
            let mut buf = vec![0u8; MAX_CHUNK];
            while left > 0 {
                let want = usize::try_from(left.min(MAX_CHUNK as u64)).unwrap_or(MAX_CHUNK);
                let piece = buf.get_mut(..want).unwrap_or_default();
                read_exact(file, piece)
                    .await
                    .map_err(|source| ExecError::Source { path: path.to_path_buf(), source })?;
                write_chunk(wr, piece).await?;
                left -= want as u64;
            }
            Ok(())
        }
    }
}

/// Fills `buf`; a file that ends first changed since it was measured.
async fn read_exact<R: AsyncRead + Unpin>(file: &mut R, buf: &mut [u8]) -> std::io::Result<()> {
    file.read_exact(buf).await.map(drop).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            std::io::Error::new(e.kind(), "the file became shorter while it was sent")
        } else {
            e
        }
    })
}

/// One line without its newline, cut by `reader` (a longer line than a frame ends the session).
async fn read_line<R: AsyncRead + Unpin>(rd: &mut R, reader: &mut LineReader) -> Result<Vec<u8>, AgentError> {
    loop {
        if let Some(line) = reader.next_line()? {
            return Ok(line);
        }
        let mut chunk = [0u8; 8192];
        let n = rd.read(&mut chunk).await.map_err(|e| AgentError::Closed(e.to_string()))?;
        if n == 0 {
            return Err(AgentError::Closed("EOF".into()));
        }
        reader.push(&chunk[..n]);
    }
}
