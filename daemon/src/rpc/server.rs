//! The RPC transport: newline-delimited JSON-RPC 2.0 on a Unix stream socket.
//!
//! jsonrpsee's own servers speak HTTP and WebSocket; vmhost speaks one JSON message per line on a
//! Unix socket and gates every connection on the kernel's peer credentials. This module is that
//! transport and nothing more: methods are registered and dispatched by jsonrpsee
//! ([`Methods::raw_json_request`]), access is decided by [`super::auth`].
//!
//! Order of use: [`bind`] creates the socket file at start-up (or [`from_inherited`] takes the one
//! systemd passed), then [`serve`] runs the accept loop until shutdown. Each accepted connection then goes through, in order:
//!
//! 1. the credential check ([`auth::peer_identity`], [`auth::classify`]), before any byte is
//!    read: a refused peer gets one error line (1001) and is disconnected;
//! 2. the bounded line reader (`read_line`): a line over [`MAX_LINE`] ends the connection;
//! 3. the line parser (`handle_line`, with the pure [`request::classify`]): invalid UTF-8 or
//!    JSON is answered with -32700, an array is a batch, anything else a single request;
//! 4. per request (`Conn::process`): shape check ([`Request::parse`], -32600), read-only check (1002), then dispatch
//!    in its own task, at most [`MAX_IN_FLIGHT`] at a time per connection;
//! 5. the write queue and writer task (`write_loop`): answers go out as they complete, followed
//!    by any subscription notifications; a peer that stops reading is dropped.

use crate::api::{self, ApiError, Code};
use crate::rpc::auth::{self, AccessPolicy, PeerIdentity, Role};
use crate::rpc::request::{self, Line, Request};
use jsonrpsee::{MethodCallback, Methods};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, error, info, info_span, warn, Instrument};

/// Most connections open at once; further ones are closed at accept. Together with
/// [`MAX_CONNECTIONS_PER_UID`] this keeps any one local user from exhausting the daemon's file
/// descriptors (which would also blind it to its own VM processes in /proc).
pub const MAX_CONNECTIONS: usize = 512;

/// Most connections one non-root uid may hold.
pub const MAX_CONNECTIONS_PER_UID: usize = 64;

/// Longest accepted request line in bytes, without its `\n` (or `\r\n`).
pub const MAX_LINE: usize = 1024 * 1024;

/// Requests of one connection dispatched at once. Further requests wait: the connection is not
/// read until one finishes, which pushes back on the client through the socket buffer.
pub const MAX_IN_FLIGHT: usize = 64;

/// Lines (responses, batch responses, notifications) queued for one connection. Well above
/// [`MAX_IN_FLIGHT`], so only a peer that does not read fills it; it is then disconnected.
pub const WRITE_QUEUE: usize = 1024;

/// How long one write may wait for the peer to read before the peer is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`serve`] waits, after shutdown, for connections to deliver in-flight answers.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Capacity of the channel between a jsonrpsee subscription and its connection.
const SUBSCRIPTION_BUFFER: usize = 64;

/// How long a subscription handler may take to accept or reject its subscription.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Read buffer per connection.
const READ_BUFFER: usize = 64 * 1024;

/// Queued lines are written together up to this many bytes, so bursts cost one syscall.
const COALESCE: usize = 64 * 1024;

/// When closing, how long and how much of the peer's further input is read and discarded.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 4 * 1024 * 1024;

/// Creates the listening socket at `path` with permission bits `mode` (e.g. `0o666`; the
/// credential check, not the mode, is the access gate).
///
/// Creates the parent directory if needed. An existing socket file is removed only when
/// nobody answers on it (a leftover of a crashed daemon); anything else at `path` is left alone.
/// Must be called from within a Tokio runtime.
///
/// # Errors
///
/// `AddrInUse` when another process serves `path`, `AlreadyExists` when `path` is not a socket,
/// and any error of creating the directory, binding or changing the mode.
pub fn bind(path: &Path, mode: u32) -> io::Result<UnixListener> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    remove_stale_socket(path)?;
    // Created with its mode (no chmod afterwards: the daemon's seccomp table has none).
    let listener = crate::sandbox::socket::bind(path, mode)?;
    listener.set_nonblocking(true)?;
    UnixListener::from_std(listener)
}

/// Serves on a listening socket the service manager created and passed in (socket activation,
/// see [`super::activation`]) instead of [`bind`]ing one. Its path, mode and owner are the
/// manager's (`vmhostd.socket`); the caller must not remove the socket file at exit, since the
/// manager keeps listening on it. Must be called from within a Tokio runtime.
///
/// # Errors
///
/// When the socket cannot be made non-blocking or registered with the runtime.
pub fn from_inherited(listener: std::os::unix::net::UnixListener) -> io::Result<UnixListener> {
    listener.set_nonblocking(true)?;
    UnixListener::from_std(listener)
}

/// Removes `path` if it is a socket nobody listens on.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket; not removing it", path.display()),
        ));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(ErrorKind::AddrInUse, format!("another process is serving {}", path.display()))),
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound) => {
            info!(path = %path.display(), "removing stale socket");
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        }
        Err(e) => Err(e),
    }
}

/// Accepts connections on `listener` and serves `methods` on each, until `shutdown` becomes
/// true (or its sender is dropped).
///
/// Each connection is its own task: a slow, hostile or broken client affects only itself. On
/// shutdown, accepting stops, open connections stop reading and deliver the answers of requests
/// already in flight, and `serve` returns once they are closed or after [`SHUTDOWN_GRACE`].
/// Dispatched requests are never cancelled by a disconnect (a half-done VM operation is worse
/// than a lost answer); after the grace period they only lose their connection. The socket file
/// is not removed: that is the caller's, as [`bind`] was.
///
/// # Errors
///
/// Only when the listener itself is unusable (`accept` fails with `EBADF`, `EINVAL`,
/// `ENOTSOCK`, ...). Transient accept errors such as `EMFILE` are logged and retried.
pub async fn serve(
    listener: UnixListener,
    methods: Methods,
    policy: Arc<AccessPolicy>,
    mut shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    let mut connections = JoinSet::new();
    let mut next_conn: u64 = 0;
    let per_uid: Arc<std::sync::Mutex<std::collections::HashMap<u32, usize>>> = Arc::default();
    // Handed to each connection; `shutdown` itself is borrowed by the select below.
    let for_connections = shutdown.clone();
    let result = loop {
        tokio::select! {
            biased;
            () = shutdown_requested(&mut shutdown) => break Ok(()),
            Some(done) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = done {
                    error!(error = %e, "connection task failed");
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let uid = stream.peer_cred().map(|c| c.uid()).unwrap_or(u32::MAX);
                    let held = {
                        let mut counts = per_uid.lock().unwrap_or_else(|p| p.into_inner());
                        let n = counts.entry(uid).or_insert(0);
                        *n += 1;
                        *n
                    };
                    let over_uid = uid != 0 && held > MAX_CONNECTIONS_PER_UID;
                    if connections.len() >= MAX_CONNECTIONS || over_uid {
                        warn!(uid, open = connections.len(), "connection limit reached; closing new connection");
                        release_uid(&per_uid, uid);
                        drop(stream);
                        continue;
                    }
                    next_conn += 1;
                    let conn = connection(stream, next_conn, methods.clone(), Arc::clone(&policy), for_connections.clone());
                    let counts = Arc::clone(&per_uid);
                    connections.spawn(async move {
                        conn.await;
                        release_uid(&counts, uid);
                    });
                }
                Err(e) if is_fatal_accept_error(&e) => break Err(e),
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning on a full fd table.
                    warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    };
    drop(listener);
    if !connections.is_empty() {
        info!(open = connections.len(), "RPC server stopping; letting connections finish");
    }
    let drained =
        tokio::time::timeout(SHUTDOWN_GRACE, async { while connections.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        warn!(left = connections.len(), "connections still open after the grace period; dropping them");
        connections.shutdown().await;
    }
    result
}

fn release_uid(counts: &std::sync::Mutex<std::collections::HashMap<u32, usize>>, uid: u32) {
    let mut counts = counts.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(n) = counts.get_mut(&uid) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(&uid);
        }
    }
}

/// Accept errors that mean the listener is unusable, as opposed to a peer or resource problem.
fn is_fatal_accept_error(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EOPNOTSUPP | libc::EFAULT))
}

/// One accepted connection, from credential check to close.
async fn connection(
    stream: UnixStream,
    conn: u64,
    methods: Methods,
    policy: Arc<AccessPolicy>,
    shutdown: watch::Receiver<bool>,
) {
    let cred = match stream.peer_cred() {
        Ok(cred) => cred,
        Err(e) => {
            warn!(conn, error = %e, "cannot read peer credentials; closing");
            return;
        }
    };
    let span = info_span!("rpc_conn", conn, uid = cred.uid(), gid = cred.gid(), pid = cred.pid().unwrap_or(0));
    async move {
        // The lookups read /proc and may query NSS (LDAP, ...): keep them off the reactor.
        let lookup_policy = Arc::clone(&policy);
        let identity = match tokio::task::spawn_blocking(move || auth::peer_identity(&cred, &lookup_policy)).await {
            Ok(identity) => identity,
            Err(e) => {
                error!(error = %e, "peer lookup failed; closing");
                return;
            }
        };
        match auth::classify(&policy, &identity) {
            None => refuse(stream, &identity).await,
            Some(role) => {
                info!(?role, "peer connected");
                run(stream, role, methods, shutdown).await;
                info!("peer disconnected");
            }
        }
    }
    .instrument(span)
    .await;
}

/// Tells a peer with no role why, then disconnects it.
async fn refuse(mut stream: UnixStream, identity: &PeerIdentity) {
    warn!(
        supplementary = ?identity.supplementary,
        "refused peer: neither root nor a member of the admin or read-only group"
    );
    let err = ApiError::new(
        Code::Unauthorized,
        format!(
            "uid {} may not use this socket: it needs root or membership of the admin or \
             read-only group",
            identity.uid
        ),
    );
    let mut line = error_line(RawValue::NULL, &err);
    line.push('\n');
    if let Ok(Ok(())) = tokio::time::timeout(LINGER, stream.write_all(line.as_bytes())).await {
        linger_close(stream).await;
    }
}

/// Closes a connection so the peer reads everything we sent and then EOF.
///
/// Closing a Unix socket that still holds unread input makes the peer's next read fail with
/// `ECONNRESET` instead of returning EOF. So: half-close (the peer sees EOF after our last line),
/// then read and discard what the peer still sends, bounded in time and bytes, then close.
async fn linger_close(mut stream: UnixStream) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let mut scratch = vec![0u8; 8192];
    let mut discarded = 0usize;
    let _ = tokio::time::timeout(LINGER, async {
        while discarded <= LINGER_BYTES {
            match stream.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(n) => discarded += n,
            }
        }
    })
    .await;
}

/// How far a connection is in its life; it only moves forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// Reading requests and forwarding notifications.
    Open,
    /// No more reading or notifications; answers of requests in flight are still written.
    Draining,
    /// Dropped at once: the peer does not read, or writing failed.
    Dead,
}

/// What the tasks of one connection share.
struct Conn {
    /// The method table.
    methods: Methods,
    /// What the peer may call.
    role: Role,
    /// The write queue; each entry is one complete line.
    out: mpsc::Sender<String>,
    /// The connection's [`Phase`]; shared with the writer, which holds no `out` sender.
    phase: Arc<watch::Sender<Phase>>,
}

/// Moves `phase` forward to `to` (never back).
fn advance(phase: &watch::Sender<Phase>, to: Phase) {
    phase.send_if_modified(|p| {
        let moved = *p < to;
        if moved {
            *p = to;
        }
        moved
    });
}

/// Serves an accepted peer until it disconnects, misbehaves or the server shuts down.
async fn run(stream: UnixStream, role: Role, methods: Methods, mut shutdown: watch::Receiver<bool>) {
    let (rd, wr) = stream.into_split();
    let (out, queue) = mpsc::channel(WRITE_QUEUE);
    let phase = Arc::new(watch::channel(Phase::Open).0);
    let writer = tokio::spawn(write_loop(wr, queue, Arc::clone(&phase)).in_current_span());
    let conn = Arc::new(Conn { methods, role, out, phase: Arc::clone(&phase) });
    let (rd, end) = read_loop(rd, &conn, &mut shutdown).await;
    advance(&phase, Phase::Draining);
    // The writer ends once every sender is gone, i.e. once the requests in flight have answered.
    drop(conn);
    let wr = match writer.await {
        Ok(Some(wr)) => wr,
        Ok(None) | Err(_) => return,
    };
    debug!(?end, "connection closing");
    if let Ok(stream) = rd.reunite(wr) {
        linger_close(stream).await;
    }
}

/// Why the reader stopped.
#[derive(Debug)]
enum End {
    /// The peer closed its side.
    Eof,
    /// A line exceeded [`MAX_LINE`].
    TooLong,
    /// Server shutdown, or the connection was dropped.
    Stopped,
    /// The socket failed.
    ReadError,
}

/// Resolves once `*shutdown` is true or its sender is gone (which counts as shutdown).
///
/// The watch guard is dropped inside, so `select!`s using this keep their futures `Send`.
async fn shutdown_requested(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Resolves once the connection's phase is `at_least` or later (or every sender is gone).
async fn phase_reached(phase: &mut watch::Receiver<Phase>, at_least: Phase) {
    let _ = phase.wait_for(|p| *p >= at_least).await;
}

/// Resolves when the server shuts down or the connection stops being [`Phase::Open`].
async fn stopped(shutdown: &mut watch::Receiver<bool>, phase: &mut watch::Receiver<Phase>) {
    tokio::select! {
        () = shutdown_requested(shutdown) => {}
        () = phase_reached(phase, Phase::Draining) => {}
    }
}

/// Reads and dispatches lines until the connection ends; returns the read half and why.
async fn read_loop(rd: OwnedReadHalf, conn: &Arc<Conn>, shutdown: &mut watch::Receiver<bool>) -> (OwnedReadHalf, End) {
    let mut reader = BufReader::with_capacity(READ_BUFFER, rd);
    let mut phase = conn.phase.subscribe();
    let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let end = loop {
        let mut line = Vec::new();
        let frame = tokio::select! {
            biased;
            _ = stopped(shutdown, &mut phase) => break End::Stopped,
            frame = read_line(&mut reader, &mut line) => frame,
        };
        match frame {
            Err(e) => {
                debug!(error = %e, "read failed");
                break End::ReadError;
            }
            Ok(Frame::Eof) => break End::Eof,
            Ok(Frame::TooLong) => {
                warn!(max = MAX_LINE, "request line too long; closing the connection");
                let err = ApiError::new(Code::InvalidRequest, format!("request line longer than {MAX_LINE} bytes"));
                conn.send(error_line(RawValue::NULL, &err));
                break End::TooLong;
            }
            Ok(Frame::Line) => {
                let mut permits = Permits { in_flight: &in_flight, shutdown, phase: &mut phase };
                if handle_line(conn, line, &mut permits).await.is_none() {
                    break End::Stopped;
                }
            }
        }
    };
    (reader.into_inner(), end)
}

/// What [`read_line`] found.
#[derive(Debug, PartialEq, Eq)]
enum Frame {
    /// A complete line (without `\n` or `\r\n`) is in the buffer; also an unterminated last line.
    Line,
    /// The peer closed its side and no partial line is pending.
    Eof,
    /// The line exceeds [`MAX_LINE`]; reading stopped at the limit, the rest is unread.
    TooLong,
}

/// Reads one line into `line`, never holding more than [`MAX_LINE`] + 1 bytes of it.
///
/// Not cancellation-safe across calls (a partial line is lost), which is fine: it is only
/// cancelled when the connection stops.
async fn read_line<R: AsyncBufRead + Unpin>(reader: &mut R, line: &mut Vec<u8>) -> io::Result<Frame> {
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            if line.is_empty() {
                return Ok(Frame::Eof);
            }
            return Ok(finish_line(line));
        }
        let newline = available.iter().position(|b| *b == b'\n');
        let chunk = &available[..newline.unwrap_or(available.len())];
        // The +1 leaves room for the '\r' of a CRLF ending, which does not count.
        if line.len() + chunk.len() > MAX_LINE + 1 {
            return Ok(Frame::TooLong);
        }
        line.extend_from_slice(chunk);
        let used = newline.map_or(chunk.len(), |i| i + 1);
        reader.consume(used);
        if newline.is_some() {
            return Ok(finish_line(line));
        }
    }
}

/// Strips a trailing `\r` and applies the length limit to a complete line.
fn finish_line(line: &mut Vec<u8>) -> Frame {
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    if line.len() > MAX_LINE {
        Frame::TooLong
    } else {
        Frame::Line
    }
}

/// What the reader needs to wait for an in-flight slot without missing a stop.
struct Permits<'a> {
    in_flight: &'a Arc<Semaphore>,
    shutdown: &'a mut watch::Receiver<bool>,
    phase: &'a mut watch::Receiver<Phase>,
}

impl Permits<'_> {
    /// Waits for a free in-flight slot; `None` when the connection stops meanwhile.
    async fn acquire(&mut self) -> Option<OwnedSemaphorePermit> {
        tokio::select! {
            biased;
            _ = stopped(self.shutdown, self.phase) => None,
            permit = Arc::clone(self.in_flight).acquire_owned() => permit.ok(),
        }
    }
}

/// Parses one line and starts its requests; `None` when the connection stopped meanwhile.
async fn handle_line(conn: &Arc<Conn>, line: Vec<u8>, permits: &mut Permits<'_>) -> Option<()> {
    let elements = match request::classify(line) {
        Line::Blank => return Some(()),
        Line::Error(err) => {
            conn.send(error_line(RawValue::NULL, &err));
            return Some(());
        }
        Line::Single(text) => {
            let permit = permits.acquire().await?;
            let conn = Arc::clone(conn);
            tokio::spawn(
                async move {
                    let reply = conn.process(&text).await;
                    drop(permit);
                    if let Some(response) = reply.response {
                        conn.send(response);
                    }
                    if let Some(notifications) = reply.notifications {
                        conn.forward(notifications).await;
                    }
                }
                .in_current_span(),
            );
            return Some(());
        }
        Line::Batch(elements) => elements,
    };
    let mut replies = Vec::with_capacity(elements.len());
    for element in elements {
        let permit = permits.acquire().await?;
        let conn = Arc::clone(conn);
        replies.push(tokio::spawn(
            async move {
                let reply = conn.process(element.get()).await;
                drop(permit);
                reply
            }
            .in_current_span(),
        ));
    }
    tokio::spawn(answer_batch(Arc::clone(conn), replies).in_current_span());
    Some(())
}

/// Writes one array line with the answers of a batch, in request order, then forwards the
/// notifications of subscriptions the batch opened (after the answer that names them).
async fn answer_batch(conn: Arc<Conn>, replies: Vec<JoinHandle<Reply>>) {
    let mut responses = Vec::with_capacity(replies.len());
    let mut subscriptions = Vec::new();
    for reply in replies {
        match reply.await {
            Ok(reply) => {
                responses.extend(reply.response);
                subscriptions.extend(reply.notifications);
            }
            Err(e) => error!(error = %e, "batch element task failed"),
        }
    }
    // All notifications (no answers) ⇒ nothing is written, as JSON-RPC 2.0 requires.
    if !responses.is_empty() {
        conn.send(format!("[{}]", responses.join(",")));
    }
    for notifications in subscriptions {
        tokio::spawn(Arc::clone(&conn).forward_owned(notifications).in_current_span());
    }
}

/// The outcome of one request.
struct Reply {
    /// The response object, `None` for a notification.
    response: Option<String>,
    /// Where a subscription's notifications arrive; `None` when nothing can arrive.
    notifications: Option<mpsc::Receiver<Box<RawValue>>>,
}

impl Reply {
    /// A reply with a response and no notifications.
    fn answer(response: String) -> Reply {
        Reply { response: Some(response), notifications: None }
    }

    /// A reply to a notification: nothing.
    fn silent() -> Reply {
        Reply { response: None, notifications: None }
    }
}

impl Conn {
    /// Queues one line (a `\n` is appended). Returns false when the line cannot be delivered:
    /// the connection is gone, or the queue is full and the connection is dropped for it.
    fn send(&self, mut line: String) -> bool {
        // A raw newline in JSON can only be insignificant whitespace (inside strings it is
        // escaped), so replacing it keeps the message intact and the framing safe.
        if line.contains('\n') {
            line = line.replace('\n', " ");
        }
        line.push('\n');
        match self.out.try_send(line) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                warn!(queue = WRITE_QUEUE, "peer is not reading its answers; dropping the connection");
                advance(&self.phase, Phase::Dead);
                false
            }
            Err(TrySendError::Closed(_)) => false,
        }
    }

    /// Checks and dispatches one request (a single line or a batch element; valid JSON).
    async fn process(&self, text: &str) -> Reply {
        let request = match Request::parse(text) {
            Ok(request) => request,
            Err(invalid) => {
                debug!(message = %invalid.message, "invalid request");
                let err = ApiError::new(Code::InvalidRequest, invalid.message);
                return Reply::answer(error_line(invalid.id, &err));
            }
        };
        let method = request.method.as_str();
        debug!(method, notification = request.id.is_none(), "request");
        // Unknown methods go through to jsonrpsee, which answers -32601 for any role.
        if self.role == Role::ReadOnly && !api::is_read_method(method) && self.methods.method(method).is_some() {
            warn!(method, "read-only peer called a mutating method; refused");
            let err = ApiError::new(
                Code::ReadOnly,
                format!("method {method} is not allowed: this peer has read-only access"),
            )
            .field("method");
            return match request.id {
                Some(id) => Reply::answer(error_line(id, &err)),
                None => Reply::silent(),
            };
        }
        // Dispatch our own rewrite of the request (id 0, known members only), so what runs is
        // exactly what was checked; the client's id is put back on the answer below.
        let call = to_line(&Call { jsonrpc: "2.0", id: 0, method, params: request.params });
        let is_subscription = matches!(self.methods.method(method), Some(MethodCallback::Subscription(_)));
        let methods = self.methods.clone();
        // Its own task, so a panicking method costs one -32603 answer, not the connection.
        let mut task = tokio::spawn(async move { methods.raw_json_request(&call, SUBSCRIPTION_BUFFER).await });
        let dispatched = if is_subscription {
            // jsonrpsee's direct-call path waits forever when a subscription handler drops its
            // pending sink without accepting or rejecting it; bound that wait.
            match tokio::time::timeout(SUBSCRIBE_TIMEOUT, &mut task).await {
                Ok(dispatched) => dispatched,
                Err(_) => {
                    task.abort();
                    error!(method, "subscription neither accepted nor rejected in time");
                    let err = ApiError::internal(format!("method {method} did not answer"));
                    return match request.id {
                        Some(id) => Reply::answer(error_line(id, &err)),
                        None => Reply::silent(),
                    };
                }
            }
        } else {
            task.await
        };
        let Some(id) = request.id else {
            // Notification: no answer; dropping the receiver ends any subscription it opened.
            return Reply::silent();
        };
        match dispatched {
            Ok(Ok((answer, notifications))) => {
                Reply { response: Some(response_line(id, &answer)), notifications: Some(notifications) }
            }
            Ok(Err(e)) => {
                error!(method, error = %e, "jsonrpsee rejected a rewritten request");
                Reply::answer(error_line(id, &ApiError::internal("request could not be dispatched")))
            }
            Err(e) => {
                error!(method, error = %e, "method task failed");
                let err = ApiError::internal(format!("method {method} failed unexpectedly"));
                Reply::answer(error_line(id, &err))
            }
        }
    }

    /// Writes a subscription's notifications until it ends or the connection stops.
    async fn forward(&self, mut notifications: mpsc::Receiver<Box<RawValue>>) {
        let mut phase = self.phase.subscribe();
        loop {
            tokio::select! {
                biased;
                () = phase_reached(&mut phase, Phase::Draining) => break,
                message = notifications.recv() => match message {
                    Some(message) if self.send(message.get().to_owned()) => {}
                    // Ended (plain methods end at once), or the connection is gone.
                    _ => break,
                },
            }
        }
    }

    /// [`Conn::forward`] for a spawned task.
    async fn forward_owned(self: Arc<Self>, notifications: mpsc::Receiver<Box<RawValue>>) {
        self.forward(notifications).await;
    }
}

/// Writes queued lines until every sender is gone (returns the write half, all written) or the
/// connection is dropped (returns `None`).
async fn write_loop(
    mut wr: OwnedWriteHalf,
    mut queue: mpsc::Receiver<String>,
    phase: Arc<watch::Sender<Phase>>,
) -> Option<OwnedWriteHalf> {
    let mut dead = phase.subscribe();
    let mut buf = Vec::with_capacity(COALESCE);
    loop {
        let first = tokio::select! {
            biased;
            () = phase_reached(&mut dead, Phase::Dead) => return None,
            line = queue.recv() => line,
        };
        let Some(first) = first else {
            return Some(wr);
        };
        buf.clear();
        buf.extend_from_slice(first.as_bytes());
        while buf.len() < COALESCE {
            match queue.try_recv() {
                Ok(line) => buf.extend_from_slice(line.as_bytes()),
                Err(_) => break,
            }
        }
        let written = tokio::select! {
            biased;
            () = phase_reached(&mut dead, Phase::Dead) => return None,
            written = tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(&buf)) => written,
        };
        match written {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                debug!(error = %e, "write failed; dropping the connection");
                advance(&phase, Phase::Dead);
                return None;
            }
            Err(_) => {
                warn!(timeout = ?WRITE_TIMEOUT, "peer is not reading; dropping the connection");
                advance(&phase, Phase::Dead);
                return None;
            }
        }
    }
}

/// The request handed to jsonrpsee.
#[derive(Serialize)]
struct Call<'a> {
    jsonrpc: &'static str,
    id: u8,
    method: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    params: Option<&'a RawValue>,
}

/// A response line; `error` is a JSON-RPC error object.
#[derive(Serialize)]
struct Response<'a, E: Serialize> {
    jsonrpc: &'static str,
    id: &'a RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<E>,
}

/// The parts of a jsonrpsee response we keep.
#[derive(Deserialize)]
struct Answer<'a> {
    /// Present (even when `null`) on success.
    #[serde(borrow, default, deserialize_with = "present")]
    result: Option<&'a RawValue>,
    /// Present on failure.
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
}

/// Deserializes a member that is present as `Some`, even when it is `null`.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// Re-addresses a jsonrpsee response (made for id 0) to the client's `id`.
fn response_line(id: &RawValue, answer: &RawValue) -> String {
    match serde_json::from_str::<Answer<'_>>(answer.get()) {
        Ok(Answer { error: Some(error), .. }) => {
            to_line(&Response { jsonrpc: "2.0", id, result: None, error: Some(error) })
        }
        Ok(Answer { result: Some(result), .. }) => {
            to_line(&Response::<()> { jsonrpc: "2.0", id, result: Some(result), error: None })
        }
        _ => {
            error!(answer = answer.get(), "jsonrpsee answered neither result nor error");
            error_line(id, &ApiError::internal("malformed method response"))
        }
    }
}

/// An error response line.
fn error_line(id: &RawValue, err: &ApiError) -> String {
    to_line(&Response { jsonrpc: "2.0", id, result: None, error: Some(err.to_json()) })
}

/// Serializes a message; our messages always serialize, the fallback only avoids a panic.
fn to_line<T: Serialize>(message: &T) -> String {
    serde_json::to_string(message).unwrap_or_else(|e| {
        error!(error = %e, "cannot serialize a message");
        r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"internal error"}}"#.into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn raw(text: &str) -> &RawValue {
        serde_json::from_str(text).unwrap()
    }

    async fn frames(input: &[u8]) -> Vec<(Frame, Vec<u8>)> {
        // A tiny buffer so lines span several fill_buf calls.
        let mut reader = tokio::io::BufReader::with_capacity(7, input);
        let mut out = Vec::new();
        loop {
            let mut line = Vec::new();
            let frame = read_line(&mut reader, &mut line).await.unwrap();
            let stop = frame != Frame::Line;
            out.push((frame, line));
            if stop {
                return out;
            }
        }
    }

    #[tokio::test]
    async fn reads_lf_crlf_and_unterminated_lines() {
        let got = frames(b"{\"a\":1}\r\n\n[1,2]\nlast").await;
        let lines: Vec<&[u8]> = got.iter().map(|(_, l)| l.as_slice()).collect();
        assert_eq!(lines, vec![&b"{\"a\":1}"[..], b"", b"[1,2]", b"last", b""]);
        assert_eq!(got.last().map(|(f, _)| f), Some(&Frame::Eof));
    }

    #[tokio::test]
    async fn enforces_the_line_limit() {
        let mut exact = vec![b'x'; MAX_LINE];
        exact.extend_from_slice(b"\r\n");
        assert_eq!(frames(&exact).await[0].0, Frame::Line);
        let mut over = vec![b'x'; MAX_LINE + 1];
        over.push(b'\n');
        let got = frames(&over).await;
        assert_eq!(got[0].0, Frame::TooLong);
        assert!(got[0].1.len() <= MAX_LINE + 1);
        let endless = vec![b'x'; MAX_LINE * 2];
        assert_eq!(frames(&endless).await[0].0, Frame::TooLong);
    }

    #[test]
    fn parses_valid_requests() {
        let r = Request::parse(r#"{"jsonrpc":"2.0","id":"a","method":"vm.get","params":{"name":"x"}}"#).ok().unwrap();
        assert_eq!(r.id.map(RawValue::get), Some(r#""a""#));
        assert_eq!(r.method, "vm.get");
        assert_eq!(r.params.map(RawValue::get), Some(r#"{"name":"x"}"#));
        let n = Request::parse(r#"{"jsonrpc":"2.0","method":"vm.list"}"#).ok().unwrap();
        assert!(n.id.is_none() && n.params.is_none());
        let null_id = Request::parse(r#"{"jsonrpc":"2.0","method":"m","id":null}"#).ok().unwrap();
        assert_eq!(null_id.id.map(RawValue::get), Some("null"));
        let negative = Request::parse(r#"{"jsonrpc":"2.0","method":"m","id":-1.5}"#).ok().unwrap();
        assert_eq!(negative.id.map(RawValue::get), Some("-1.5"));
    }

    #[test]
    fn rejects_malformed_requests_keeping_a_valid_id() {
        let cases = [
            (r#"1"#, "null"),
            (r#"[1]"#, "null"),
            (r#"{"jsonrpc":"2.0","method":"m","id":{}}"#, "null"),
            (r#"{"jsonrpc":"2.0","method":"m","id":true}"#, "null"),
            (r#"{"jsonrpc":"1.0","method":"m","id":7}"#, "7"),
            (r#"{"method":"m","id":7}"#, "7"),
            (r#"{"jsonrpc":"2.0","id":"x"}"#, r#""x""#),
            (r#"{"jsonrpc":"2.0","method":5,"id":7}"#, "7"),
            (r#"{"jsonrpc":"2.0","method":"m","params":3,"id":7}"#, "7"),
            (r#"{"jsonrpc":"2.0","method":"m","extra":1,"id":7}"#, "7"),
        ];
        for (text, id) in cases {
            match Request::parse(text) {
                Ok(_) => panic!("{text} accepted"),
                Err(invalid) => assert_eq!(invalid.id.get(), id, "{text}: {}", invalid.message),
            }
        }
    }

    #[test]
    fn readdresses_jsonrpsee_answers() {
        let ok = response_line(raw("17"), raw(r#"{"jsonrpc":"2.0","id":0,"result":null}"#));
        assert_eq!(ok, r#"{"jsonrpc":"2.0","id":17,"result":null}"#);
        let err = response_line(
            raw(r#""x""#),
            raw(r#"{"jsonrpc":"2.0","id":0,"error":{"code":-32601,"message":"Method not found"}}"#),
        );
        assert_eq!(err, r#"{"jsonrpc":"2.0","id":"x","error":{"code":-32601,"message":"Method not found"}}"#);
        let bad = response_line(raw("1"), raw(r#"{"jsonrpc":"2.0","id":0}"#));
        assert!(bad.contains("-32603"), "{bad}");
    }

    #[test]
    fn serve_can_be_spawned() {
        // The daemon spawns `serve` on a multi-threaded runtime: its future must be Send.
        fn assert_send<T: Send>(_: &T) {}
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _guard = rt.enter();
        let dir = tempfile::tempdir().unwrap();
        let listener = bind(&dir.path().join("s"), 0o600).unwrap();
        let (_stop, stopped) = watch::channel(false);
        let methods = Methods::from(jsonrpsee::RpcModule::new(()));
        assert_send(&serve(listener, methods, Arc::new(AccessPolicy::default()), stopped));
    }

    #[test]
    fn bind_refuses_live_sockets_and_non_sockets() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _guard = rt.enter();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/dir/vmhost.sock");
        let listener = bind(&path, 0o660).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660);
        assert_eq!(bind(&path, 0o660).unwrap_err().kind(), ErrorKind::AddrInUse);
        // A leftover socket that nobody serves is replaced.
        drop(listener);
        assert!(path.exists());
        let again = bind(&path, 0o666).unwrap();
        drop(again);
        let file = dir.path().join("plain");
        std::fs::write(&file, b"keep me").unwrap();
        assert_eq!(bind(&file, 0o666).unwrap_err().kind(), ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    }
}
