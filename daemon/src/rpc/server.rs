//! The RPC transport: newline-delimited JSON-RPC 2.0 on a Unix stream socket.
//!
//! vmhost speaks one JSON message per line on a Unix socket and gates every connection on the
//! kernel's peer credentials. This module is that transport: a line is parsed once
//! ([`request::classify`]), the method is looked up in the one dispatcher ([`Dispatcher`], made
//! from [`super::methods::METHODS`]), and its answer is written once, with the client's id, the
//! result's JSON written after the head that carries it. Access is decided by [`super::auth`].
//!
//! Order of use: [`bind`] creates the socket file at start-up, in a directory only the daemon may
//! write ([`socket_dir`]; or [`from_inherited`] takes the one systemd passed), then [`serve`]
//! runs the accept loop until shutdown. Each accepted connection then goes through, in order:
//!
//! 1. a connection slot ([`limits::Registry::admit`]): over a limit it is closed at once;
//! 2. the credential check ([`auth::peer_identity`], [`auth::classify`]), before any byte is
//!    read: a refused peer gets one error line (1001) and is disconnected; a read-only peer also
//!    needs a read-only slot (1003 otherwise). Refusals are logged at most once per interval;
//! 3. the bounded line reader (`read_line`): a line over [`MAX_LINE`] ends the connection, and
//!    an idle connection (nothing in flight, no subscription) is closed after the idle timeout;
//! 4. the line parser (`handle_line`, with the pure [`request::classify`], which parses each
//!    request's envelope in the same pass): invalid UTF-8 or JSON is answered with -32700, an
//!    array is a batch (over [`limits::MAX_BATCH`]: 1003), anything else a single request;
//! 5. per request (`Conn::process`), in its own task, at most [`MAX_IN_FLIGHT`] at a time per
//!    connection and per uid, each holding its slot until its answer is queued: shape (-32600),
//!    method lookup (-32601), read-only check (1002), then the handler, which parses the params
//!    into their type (-32602) and counts guest-agent calls (1004, [`super::agent_rate`]);
//!    a subscription takes its slots first (1003);
//! 6. the write queue and writer task (`write_loop`): answers go out as they complete, followed
//!    by any subscription notifications; the queue is bounded in bytes ([`limits::Budget`]), a
//!    full one makes its senders wait (so the reader stops: back-pressure), and a peer that does
//!    not read for [`WRITE_TIMEOUT`] is dropped;
//! 7. `vm.console` alone on its line, with an id (`Conn::console`), is the one method the
//!    transport runs itself: once the client is attached ([`crate::console::Consoles::attach`]), reading stops,
//!    the answers in flight are written, then the answer of `vm.console`, and the connection
//!    becomes the console's byte stream ([`crate::console::session`]) until it closes.

use crate::api::error::ErrorData;
use crate::api::{ApiError, Code, ConsoleAttached, ConsoleParams};
use crate::console::hub::{Attachment, Peer};
use crate::rpc::auth::{self, AccessPolicy, PeerIdentity, Role};
use crate::rpc::dispatch::{self, Access, Body, Dispatcher, Handler, Sink};
use crate::rpc::limits::{self, Budget, Registry, SharedThrottle, Slot};
use crate::rpc::request::{self, Envelope, Line, Parsed};
use crate::rpc::socket_dir;
use futures_util::FutureExt;
use serde::Serialize;
use serde_json::value::RawValue;
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, error, info, info_span, warn, Instrument};

pub use super::limits::{MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID, MAX_IN_FLIGHT};

/// Longest accepted request line in bytes, without its `\n` (or `\r\n`).
pub const MAX_LINE: usize = 1024 * 1024;

/// Notifications of one call (`vm.exec.output`) queued before the connection's writer takes
/// them: a few chunks, so a streaming call waits on a slow reader instead of buffering.
const CALL_NOTIFICATION_BUFFER: usize = 4;

/// How long one write may wait for the peer to read before the peer is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`serve`] waits, after shutdown, for connections to deliver in-flight answers.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Capacity of the channel between a subscription's task and its connection.
const SUBSCRIPTION_BUFFER: usize = 64;

/// Bodies up to this size are copied into the write buffer (coalesced with other lines);
/// larger ones are written from where they are.
const INLINE_BODY: usize = 16 * 1024;

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
/// Creates the parent directory if needed; refuses a directory that is not root's (or the
/// daemon's user's) or that group or others may write ([`socket_dir`]). An existing socket file
/// is removed only when nobody answers on it (a leftover of a crashed daemon); anything else at
/// `path` is left alone.
/// Must be called from within a Tokio runtime.
///
/// # Errors
///
/// `PermissionDenied` when the directory fails the [`socket_dir`] rule, `AddrInUse` when
/// another process serves `path`, `AlreadyExists` when `path` is not a socket, and any error of
/// creating the directory, binding or changing the mode.
pub fn bind(path: &Path, mode: u32) -> io::Result<UnixListener> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        // 0755 at most (the umask may narrow it): a directory made here passes the check below.
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o755).create(parent)?;
    }
    socket_dir::check(&socket_dir::parent_of(path))?;
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
/// `PermissionDenied` when the socket's directory fails the [`socket_dir`] rule, or when the
/// socket cannot be made non-blocking or registered with the runtime.
pub fn from_inherited(listener: std::os::unix::net::UnixListener) -> io::Result<UnixListener> {
    // An abstract or unnamed socket has no directory to replace it in.
    if let Some(path) = listener.local_addr().ok().as_ref().and_then(|a| a.as_pathname()) {
        socket_dir::check(&socket_dir::parent_of(path))?;
    }
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

/// Accepts connections on `listener` and serves the methods of `dispatcher` on each, until `shutdown` becomes
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
    dispatcher: Arc<Dispatcher>,
    policy: Arc<AccessPolicy>,
    shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    serve_with(listener, dispatcher, policy, Options::default(), shutdown).await
}

/// Settings of [`serve_with`] that come from the configuration.
#[derive(Debug, Clone)]
pub struct Options {
    /// A connection with no request in flight, no subscription and no complete request line for
    /// this long is closed (`access.idle_timeout_s`).
    pub idle_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options { idle_timeout: limits::DEFAULT_IDLE_TIMEOUT }
    }
}

/// What every connection of one server shares.
struct Shared {
    dispatcher: Arc<Dispatcher>,
    policy: Arc<AccessPolicy>,
    options: Options,
    registry: Arc<Registry>,
    /// Refusals at accept (slots) and of peers without a role, logged at most once per
    /// [`limits::REFUSAL_LOG_INTERVAL`] each.
    slot_log: SharedThrottle,
    refusal_log: SharedThrottle,
}

/// [`serve`] with `options`.
///
/// # Errors
///
/// As [`serve`].
pub async fn serve_with(
    listener: UnixListener,
    dispatcher: Arc<Dispatcher>,
    policy: Arc<AccessPolicy>,
    options: Options,
    mut shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    let mut connections = JoinSet::new();
    let mut next_conn: u64 = 0;
    let shared = Arc::new(Shared {
        dispatcher,
        policy,
        options,
        registry: Registry::new(),
        slot_log: SharedThrottle::default(),
        refusal_log: SharedThrottle::default(),
    });
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
                    let slot = match shared.registry.admit(uid) {
                        Ok(slot) => slot,
                        Err(refusal) => {
                            if let Some(suppressed) = shared.slot_log.allow() {
                                warn!(uid, %refusal, suppressed, "closing new connection");
                            }
                            drop(stream);
                            continue;
                        }
                    };
                    next_conn += 1;
                    let conn = connection(stream, next_conn, slot, Arc::clone(&shared), for_connections.clone());
                    connections.spawn(conn);
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

/// Accept errors that mean the listener is unusable, as opposed to a peer or resource problem.
fn is_fatal_accept_error(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EOPNOTSUPP | libc::EFAULT))
}

/// One accepted connection, from credential check to close.
async fn connection(
    stream: UnixStream,
    conn: u64,
    mut slot: Slot,
    shared: Arc<Shared>,
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
        let lookup_policy = Arc::clone(&shared.policy);
        let identity = match tokio::task::spawn_blocking(move || auth::peer_identity(&cred, &lookup_policy)).await {
            Ok(identity) => identity,
            Err(e) => {
                error!(error = %e, "peer lookup failed; closing");
                return;
            }
        };
        match auth::classify(&shared.policy, &identity) {
            None => refuse(stream, &identity, &shared.refusal_log).await,
            Some(role) => {
                if let Err(refusal) = shared.registry.admit_role(&mut slot, role) {
                    if let Some(suppressed) = shared.slot_log.allow() {
                        warn!(%refusal, suppressed, "closing new connection");
                    }
                    let err = ApiError::new(Code::LimitExceeded, refusal.to_string()).details(serde_json::json!({
                        "limit": "readonly_connections",
                        "max": limits::MAX_READONLY_CONNECTIONS,
                    }));
                    say_and_close(stream, &err).await;
                    return;
                }
                let budget = shared.registry.budget(&slot);
                debug!(?role, "peer connected");
                let peer = Peer { uid: identity.uid, pid: cred.pid().unwrap_or(0) };
                run(stream, role, peer, budget, &shared, shutdown).await;
                debug!("peer disconnected");
            }
        }
        drop(slot);
    }
    .instrument(span)
    .await;
}

/// Tells a peer with no role why, then disconnects it.
async fn refuse(stream: UnixStream, identity: &PeerIdentity, log: &SharedThrottle) {
    if let Some(suppressed) = log.allow() {
        warn!(
            supplementary = ?identity.supplementary,
            suppressed,
            "refused peer: neither root nor a member of the admin or read-only group"
        );
    }
    let err = ApiError::new(
        Code::Unauthorized,
        format!(
            "uid {} may not use this socket: it needs root or membership of the admin or \
             read-only group",
            identity.uid
        ),
    );
    say_and_close(stream, &err).await;
}

/// Sends one error line (`id: null`) and closes the connection.
async fn say_and_close(mut stream: UnixStream, err: &ApiError) {
    let mut line = error_line(RawValue::NULL, err);
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
    /// The methods.
    dispatcher: Arc<Dispatcher>,
    /// What the peer may call.
    role: Role,
    /// The write queue; each entry is one complete line holding its share of the byte budget.
    out: mpsc::UnboundedSender<Queued>,
    /// The byte budget of the write queue (the connection's, or its uid's).
    queued: Arc<Semaphore>,
    /// This connection's subscriptions.
    subscriptions: Arc<Semaphore>,
    /// Its uid's subscriptions (`None` for root).
    uid_subscriptions: Option<Arc<Semaphore>>,
    /// The connection's [`Phase`]; shared with the writer, which holds no `out` sender.
    phase: Arc<watch::Sender<Phase>>,
    /// Who the peer is (for `vm.console`'s writer).
    peer: Peer,
}

/// One line in the write queue, with the bytes of the budget it holds until it is written.
struct Queued {
    line: OutLine,
    _bytes: OwnedSemaphorePermit,
}

/// One line to write (the line end is added when it is written): text of its own, or a success
/// made of its head (which carries the client's id), the method's [`Body`] as it was serialized
/// (the `vm.list` array, 450 KB with 1000 VMs, is shared by every answer and written from where
/// it is), and the closing brace.
struct OutLine {
    head: String,
    body: Option<Body>,
}

impl OutLine {
    /// A line of its own text.
    fn own(text: String) -> OutLine {
        OutLine { head: text, body: None }
    }

    /// The success answer to `id`: `body` is its result.
    fn success(id: &RawValue, body: Body) -> OutLine {
        OutLine { head: success_head(id), body: Some(body) }
    }

    /// The line's length, without its line end.
    fn len(&self) -> usize {
        self.head.len() + self.body.as_ref().map_or(0, |body| body.get().len() + SUCCESS_TAIL.len())
    }

    /// Appends the whole line to `text` (a batch's array).
    fn append_to(&self, text: &mut String) {
        text.push_str(&self.head);
        if let Some(body) = &self.body {
            text.push_str(body.get());
            text.push_str(SUCCESS_TAIL);
        }
    }
}

impl From<String> for OutLine {
    fn from(text: String) -> OutLine {
        OutLine::own(text)
    }
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

/// Serves an accepted peer until it disconnects, misbehaves, idles or the server shuts down.
async fn run(
    stream: UnixStream,
    role: Role,
    peer: Peer,
    budget: Budget,
    shared: &Shared,
    mut shutdown: watch::Receiver<bool>,
) {
    let (rd, wr) = stream.into_split();
    let (out, queue) = mpsc::unbounded_channel();
    let phase = Arc::new(watch::channel(Phase::Open).0);
    let writer = tokio::spawn(write_loop(wr, queue, Arc::clone(&phase)).in_current_span());
    let conn = Arc::new(Conn {
        dispatcher: Arc::clone(&shared.dispatcher),
        role,
        out,
        queued: budget.queued,
        subscriptions: budget.subscriptions,
        uid_subscriptions: budget.uid_subscriptions,
        phase: Arc::clone(&phase),
        peer,
    });
    let mut permits = Permits {
        in_flight: budget.in_flight,
        uid_in_flight: budget.uid_in_flight,
        shutdown: &mut shutdown,
        phase: phase.subscribe(),
    };
    let (rd, end) = read_loop(rd, &conn, &mut permits, shared.options.idle_timeout).await;
    advance(&phase, Phase::Draining);
    // The writer ends once every sender is gone, i.e. once the requests in flight have answered.
    drop(conn);
    let wr = match writer.await {
        Ok(Some(wr)) => wr,
        Ok(None) | Err(_) => return,
    };
    debug!(?end, "connection closing");
    if let Ok(stream) = rd.reunite(wr) {
        match end {
            End::Console(switch) => console_stream(stream, *switch, shutdown).await,
            _ => linger_close(stream).await,
        }
    }
}

/// A connection whose client attached to a console: the answer to send once every earlier
/// answer is written, the attachment, and what the client sent after its request.
struct ConsoleSwitch {
    answer: String,
    attachment: Attachment,
    early_input: Vec<u8>,
}

impl std::fmt::Debug for ConsoleSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleSwitch").field("answer", &self.answer).finish_non_exhaustive()
    }
}

/// Sends the answer of `vm.console`, then runs the connection as the console's byte stream.
async fn console_stream(mut stream: UnixStream, switch: ConsoleSwitch, shutdown: watch::Receiver<bool>) {
    let ConsoleSwitch { mut answer, attachment, early_input } = switch;
    answer.push('\n');
    if !matches!(tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(answer.as_bytes())).await, Ok(Ok(()))) {
        return;
    }
    let ending = crate::console::session::run(stream, attachment, early_input, shutdown).await;
    info!(?ending, "console client detached");
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
    /// Nothing in flight, no subscription and no request line for the idle timeout.
    Idle,
    /// The client attached to a console: the connection becomes its byte stream.
    Console(Box<ConsoleSwitch>),
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
async fn read_loop(
    rd: OwnedReadHalf,
    conn: &Arc<Conn>,
    permits: &mut Permits<'_>,
    idle_timeout: Duration,
) -> (OwnedReadHalf, End) {
    let mut reader = BufReader::with_capacity(READ_BUFFER, rd);
    let mut phase = conn.phase.subscribe();
    let end = loop {
        let mut line = Vec::new();
        let frame = {
            // Not cancelled by the idle timer: a partial line must not be lost while the peer
            // is busy (requests in flight or subscriptions open).
            let read = read_line(&mut reader, &mut line);
            tokio::pin!(read);
            loop {
                tokio::select! {
                    biased;
                    () = stopped(permits.shutdown, &mut phase) => break None,
                    frame = &mut read => break Some(frame),
                    () = tokio::time::sleep(idle_timeout) => {
                        if permits.idle() && conn.subscriptions.available_permits() == limits::MAX_SUBSCRIPTIONS_PER_CONNECTION {
                            break Some(Ok(Frame::Idle));
                        }
                    }
                }
            }
        };
        let Some(frame) = frame else { break End::Stopped };
        match frame {
            Err(e) => {
                debug!(error = %e, "read failed");
                break End::ReadError;
            }
            Ok(Frame::Eof) => break End::Eof,
            Ok(Frame::Idle) => {
                info!(timeout = ?idle_timeout, "connection idle; closing it");
                break End::Idle;
            }
            Ok(Frame::TooLong) => {
                warn!(max = MAX_LINE, "request line too long; closing the connection");
                let err = ApiError::new(Code::InvalidRequest, format!("request line longer than {MAX_LINE} bytes"));
                conn.send(error_line(RawValue::NULL, &err)).await;
                break End::TooLong;
            }
            Ok(Frame::Line) => match handle_line(conn, line, permits).await {
                Ok(()) => {}
                Err(End::Console(mut switch)) => {
                    switch.early_input = reader.buffer().to_vec();
                    break End::Console(switch);
                }
                Err(end) => break end,
            },
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
    /// Not from [`read_line`]: the idle timeout passed with nothing in flight.
    Idle,
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

/// The in-flight slots of a connection (and its uid), and what the reader must not miss while
/// it waits for one.
struct Permits<'a> {
    in_flight: Arc<Semaphore>,
    uid_in_flight: Option<Arc<Semaphore>>,
    shutdown: &'a mut watch::Receiver<bool>,
    phase: watch::Receiver<Phase>,
}

/// One request's in-flight slot: the connection's and, for non-root, its uid's. Held until the
/// request's answer is queued, so answers the peer does not read stop further reading.
struct InFlight {
    _own: OwnedSemaphorePermit,
    _uid: Option<OwnedSemaphorePermit>,
}

impl Permits<'_> {
    /// Waits for a free in-flight slot; `None` when the connection stops meanwhile.
    async fn acquire(&mut self) -> Option<InFlight> {
        let own = tokio::select! {
            biased;
            () = stopped(self.shutdown, &mut self.phase) => return None,
            permit = Arc::clone(&self.in_flight).acquire_owned() => permit.ok()?,
        };
        let uid = match &self.uid_in_flight {
            None => None,
            Some(uid) => tokio::select! {
                biased;
                () = stopped(self.shutdown, &mut self.phase) => return None,
                permit = Arc::clone(uid).acquire_owned() => Some(permit.ok()?),
            },
        };
        Some(InFlight { _own: own, _uid: uid })
    }

    /// True when no request of this connection is in flight.
    fn idle(&self) -> bool {
        self.in_flight.available_permits() == MAX_IN_FLIGHT
    }
}

/// Parses one line and starts its requests; `Err` ends the reading: [`End::Stopped`] when the
/// connection stopped meanwhile, [`End::Console`] when it becomes a console stream.
async fn handle_line(conn: &Arc<Conn>, line: Vec<u8>, permits: &mut Permits<'_>) -> Result<(), End> {
    let elements = match request::classify(line) {
        Line::Blank => return Ok(()),
        Line::Error(err) => {
            if err.code == Code::LimitExceeded {
                warn!(message = %err.message, "request line refused");
            }
            conn.send(error_line(RawValue::NULL, &err)).await;
            return Ok(());
        }
        Line::Single(parsed) => {
            let parsed = match conn.console(parsed).await {
                Console::Switch(switch) => return Err(End::Console(Box::new(switch))),
                Console::Refused(answer) => {
                    conn.send(answer).await;
                    return Ok(());
                }
                Console::Other(parsed) => parsed,
            };
            let permit = permits.acquire().await.ok_or(End::Stopped)?;
            let conn = Arc::clone(conn);
            tokio::spawn(
                async move {
                    let reply = conn.process(parsed).await;
                    if let Some(response) = reply.response {
                        conn.send(response).await;
                    }
                    drop(permit);
                    if let Some(subscription) = reply.subscription {
                        conn.forward(subscription).await;
                    }
                }
                .in_current_span(),
            );
            return Ok(());
        }
        Line::Batch(elements) => elements,
    };
    let mut replies = Vec::with_capacity(elements.len());
    for element in elements {
        let permit = permits.acquire().await.ok_or(End::Stopped)?;
        let conn = Arc::clone(conn);
        replies.push(tokio::spawn(
            async move {
                let reply = conn.process(element).await;
                (reply, permit)
            }
            .in_current_span(),
        ));
    }
    tokio::spawn(answer_batch(Arc::clone(conn), replies).in_current_span());
    Ok(())
}

/// Writes one array line with the answers of a batch, in request order, then forwards the
/// notifications of subscriptions the batch opened (after the answer that names them).
///
/// The elements' in-flight slots are held until the array is queued: a batch's answers are
/// memory the peer has not read yet, and a peer that does not read must not get more read.
async fn answer_batch(conn: Arc<Conn>, replies: Vec<JoinHandle<(Reply, InFlight)>>) {
    // Built in place as the answers come in, so no answer is held twice.
    let mut line = String::from("[");
    let mut subscriptions = Vec::new();
    let mut held = Vec::with_capacity(replies.len());
    for reply in replies {
        match reply.await {
            Ok((reply, permit)) => {
                if let Some(response) = reply.response {
                    if line.len() > 1 {
                        line.push(',');
                    }
                    response.append_to(&mut line);
                }
                subscriptions.extend(reply.subscription);
                held.push(permit);
            }
            Err(e) => error!(error = %e, "batch element task failed"),
        }
    }
    // All notifications (no answers) ⇒ nothing is written, as JSON-RPC 2.0 requires.
    if line.len() > 1 {
        line.push(']');
        conn.send(line).await;
    }
    drop(held);
    for subscription in subscriptions {
        tokio::spawn(Arc::clone(&conn).forward_owned(subscription).in_current_span());
    }
}

/// An open subscription as its connection holds it: its notifications, what ends it, and the
/// subscription slots it holds. Dropping it ends the subscription (its task sees the sink close).
struct Subscription {
    id: u64,
    dispatcher: Arc<Dispatcher>,
    notifications: mpsc::Receiver<String>,
    /// Resolves when `events.unsubscribe` names this subscription.
    unsubscribed: oneshot::Receiver<()>,
    _own: OwnedSemaphorePermit,
    _uid: Option<OwnedSemaphorePermit>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.dispatcher.forget(self.id);
    }
}

/// The outcome of one request.
struct Reply {
    /// The response object, `None` for a notification.
    response: Option<OutLine>,
    /// The subscription the request opened, whose notifications follow its answer.
    subscription: Option<Subscription>,
}

impl Reply {
    /// A reply with a response and no notifications.
    fn answer(response: impl Into<OutLine>) -> Reply {
        Reply { response: Some(response.into()), subscription: None }
    }

    /// A reply to a notification: nothing.
    fn silent() -> Reply {
        Reply { response: None, subscription: None }
    }

    /// An error reply to `id` (nothing for a notification).
    fn error(id: Option<&RawValue>, err: &ApiError) -> Reply {
        match id {
            Some(id) => Reply::answer(error_line(id, err)),
            None => Reply::silent(),
        }
    }

    /// A success reply to `id` (nothing for a notification).
    fn success(id: Option<&RawValue>, body: Body) -> Reply {
        match id {
            Some(id) => Reply::answer(OutLine::success(id, body)),
            None => Reply::silent(),
        }
    }
}

/// What [`Conn::console`] made of a single request.
enum Console {
    /// The client is attached: switch the connection over.
    Switch(ConsoleSwitch),
    /// Attaching was refused: the error line to answer (the connection stays JSON-RPC).
    Refused(String),
    /// Not a `vm.console` the transport switches for: dispatch it.
    Other(Parsed),
}

impl Conn {
    /// Queues one line (a `\n` is appended), waiting while the byte budget is spent: the peer
    /// must read before more is queued for it (back-pressure). Returns false when the line
    /// cannot be delivered because the connection is gone.
    async fn send(&self, line: impl Into<OutLine>) -> bool {
        let mut line = line.into();
        // A raw newline in JSON can only be insignificant whitespace (inside strings it is
        // escaped), so replacing it keeps the message intact and the framing safe. A shared
        // body is the registry's compact serde_json output, which has none.
        if line.head.contains('\n') {
            line.head = line.head.replace('\n', " ");
        }
        // A line larger than the whole budget waits for an empty queue.
        let cost = (line.len() + 1).saturating_add(limits::LINE_OVERHEAD).min(limits::MAX_QUEUED_BYTES);
        let cost = u32::try_from(cost).unwrap_or(u32::MAX);
        let mut phase = self.phase.subscribe();
        let bytes = tokio::select! {
            biased;
            () = phase_reached(&mut phase, Phase::Dead) => return false,
            bytes = Arc::clone(&self.queued).acquire_many_owned(cost) => match bytes {
                Ok(bytes) => bytes,
                Err(_) => return false,
            },
        };
        self.out.send(Queued { line, _bytes: bytes }).is_ok()
    }

    /// Attaches the client to a console when `parsed` is a `vm.console` request with an id (the
    /// method the transport runs itself); any other request is handed back.
    async fn console(&self, parsed: Parsed) -> Console {
        let (consoles, envelope) = match &parsed {
            Ok(envelope) if envelope.id.is_some() => match self.dispatcher.get(&envelope.method) {
                Some(dispatch::Entry { handler: Handler::Console(consoles), .. }) => (Arc::clone(consoles), envelope),
                _ => return Console::Other(parsed),
            },
            _ => return Console::Other(parsed),
        };
        let id = envelope.id.as_deref().unwrap_or(RawValue::NULL);
        let params: ConsoleParams = match crate::rpc::methods::parse_params(envelope.params.as_deref()) {
            Ok(p) => p,
            Err(err) => return Console::Refused(error_line(id, &err)),
        };
        match consoles.attach(&params, self.role, self.peer).await {
            Ok(attachment) => {
                let result = ConsoleAttached {
                    read_only: !attachment.member.writer,
                    replay_bytes: attachment.replay.len() as u64,
                    name: params.name,
                };
                let answer = match Body::json(&result) {
                    Ok(body) => {
                        let mut line = String::new();
                        OutLine::success(id, body).append_to(&mut line);
                        line
                    }
                    Err(err) => return Console::Refused(error_line(id, &err)),
                };
                Console::Switch(ConsoleSwitch { answer, attachment, early_input: Vec::new() })
            }
            Err(err) => {
                info!(vm = %params.name, code = err.code.as_i32(), "console attach refused");
                Console::Refused(error_line(id, &err))
            }
        }
    }

    /// Takes a subscription slot of the connection and of its uid.
    ///
    /// # Errors
    /// 1003 naming the limit that is reached.
    fn subscription_slots(&self) -> Result<(OwnedSemaphorePermit, Option<OwnedSemaphorePermit>), ApiError> {
        let refused = |limit: &str, max: usize| {
            ApiError::new(
                Code::LimitExceeded,
                format!("too many subscriptions: at most {max} per {limit}; unsubscribe or close one first"),
            )
            .field("method")
            .details(serde_json::json!({"limit": format!("subscriptions_per_{limit}"), "max": max}))
        };
        let own = Arc::clone(&self.subscriptions)
            .try_acquire_owned()
            .map_err(|_| refused("connection", limits::MAX_SUBSCRIPTIONS_PER_CONNECTION))?;
        let uid = match &self.uid_subscriptions {
            None => None,
            Some(uid) => Some(
                Arc::clone(uid).try_acquire_owned().map_err(|_| refused("uid", limits::MAX_SUBSCRIPTIONS_PER_UID))?,
            ),
        };
        Ok((own, uid))
    }

    /// Checks and runs one request (a single line or a batch element) and makes its answer.
    async fn process(&self, parsed: Parsed) -> Reply {
        let Envelope { id, method, params } = match parsed {
            Ok(envelope) => envelope,
            Err(invalid) => {
                debug!(message = %invalid.message, "invalid request");
                let err = ApiError::new(Code::InvalidRequest, invalid.message);
                return Reply::answer(error_line(&invalid.id, &err));
            }
        };
        let id = id.as_deref();
        let method = method.as_str();
        debug!(method, notification = id.is_none(), "request");
        let Some(entry) = self.dispatcher.get(method) else {
            // For any role: an unknown name is not a method a read-only peer was refused.
            return Reply::error(id, &dispatch::method_not_found());
        };
        if self.role == Role::ReadOnly && entry.access == Access::Write {
            warn!(method, "read-only peer called a mutating method; refused");
            let err = ApiError::new(
                Code::ReadOnly,
                format!("method {method} is not allowed: this peer has read-only access"),
            )
            .field("method");
            return Reply::error(id, &err);
        }
        match &entry.handler {
            Handler::Call(call) | Handler::Notifying(call) => {
                let (caller, notifications) = if matches!(entry.handler, Handler::Notifying(_)) {
                    let (tx, rx) = mpsc::channel(CALL_NOTIFICATION_BUFFER);
                    let notify = dispatch::Notifier::new(tx);
                    (dispatch::Caller { role: self.role, uid: self.peer.uid, notify }, Some(rx))
                } else {
                    (dispatch::Caller::new(self.role, self.peer.uid), None)
                };
                let running = match call(params.as_deref(), caller) {
                    Ok(running) => running,
                    Err(err) => {
                        if err.code == Code::RateLimited {
                            debug!(method, "guest-agent call refused by the rate limit");
                        }
                        return Reply::error(id, &err);
                    }
                };
                drop(params);
                // A panicking method costs one -32603 answer, not the connection.
                let mut running = std::panic::AssertUnwindSafe(running).catch_unwind();
                let outcome = match notifications {
                    None => running.await,
                    Some(mut notifications) => {
                        // The call's notifications are written as they come, all before its
                        // answer (this task queues the answer after them). A connection that is
                        // gone closes the channel, which the call sees as its caller gone.
                        let mut open = true;
                        let outcome = loop {
                            tokio::select! {
                                biased;
                                line = notifications.recv(), if open => match line {
                                    Some(line) => {
                                        if !self.send(line).await {
                                            open = false;
                                            notifications.close();
                                        }
                                    }
                                    None => open = false,
                                },
                                outcome = &mut running => break outcome,
                            }
                        };
                        while let Ok(line) = notifications.try_recv() {
                            self.send(line).await;
                        }
                        outcome
                    }
                };
                match outcome {
                    Ok(Ok(body)) => Reply::success(id, body),
                    Ok(Err(err)) => Reply::error(id, &err),
                    Err(_) => {
                        error!(method, "method panicked");
                        Reply::error(id, &ApiError::internal(format!("method {method} failed unexpectedly")))
                    }
                }
            }
            Handler::Subscribe { notification, open } => {
                // A notification opens nothing: no one could learn the subscription's id.
                let Some(id) = id else { return Reply::silent() };
                let (own, uid) = match self.subscription_slots() {
                    Ok(slots) => slots,
                    Err(err) => {
                        warn!(method, limit = %err.details["limit"], "subscription refused");
                        return Reply::error(Some(id), &err);
                    }
                };
                let (sub, unsubscribed) = self.dispatcher.open();
                let (tx, notifications) = mpsc::channel(SUBSCRIPTION_BUFFER);
                tokio::spawn(open(Sink::new(sub, notification, tx)).in_current_span());
                let subscription = Subscription {
                    id: sub,
                    dispatcher: Arc::clone(&self.dispatcher),
                    notifications,
                    unsubscribed,
                    _own: own,
                    _uid: uid,
                };
                match Body::json(&sub) {
                    Ok(body) => Reply { response: Some(OutLine::success(id, body)), subscription: Some(subscription) },
                    Err(err) => Reply::error(Some(id), &err),
                }
            }
            Handler::Unsubscribe => {
                let ended =
                    dispatch::unsubscribe_id(params.as_deref()).is_some_and(|sub| self.dispatcher.unsubscribe(sub));
                match Body::json(&ended) {
                    Ok(body) => Reply::success(id, body),
                    Err(err) => Reply::error(id, &err),
                }
            }
            Handler::Console(_) => {
                let err = ApiError::new(
                    Code::InvalidRequest,
                    "vm.console must be a request of its own line, with an id (not in a batch, not a notification)",
                );
                Reply::error(id, &err)
            }
        }
    }

    /// Writes a subscription's notifications until it ends, is unsubscribed, or the connection
    /// stops; its subscription slots are given back then.
    async fn forward(&self, mut subscription: Subscription) {
        let mut phase = self.phase.subscribe();
        loop {
            tokio::select! {
                biased;
                () = phase_reached(&mut phase, Phase::Draining) => break,
                _ = &mut subscription.unsubscribed => break,
                message = subscription.notifications.recv() => {
                    // Ended, or the connection is gone.
                    let Some(message) = message else { break };
                    if !self.send(message).await {
                        break;
                    }
                }
            }
        }
    }

    /// [`Conn::forward`] for a spawned task.
    async fn forward_owned(self: Arc<Self>, subscription: Subscription) {
        self.forward(subscription).await;
    }
}

/// Writes queued lines until every sender is gone (returns the write half, all written) or the
/// connection is dropped (returns `None`). A line's budget bytes are given back once written.
///
/// Small lines are coalesced into one write; a shared body is written from where it is.
async fn write_loop(
    mut wr: OwnedWriteHalf,
    mut queue: mpsc::UnboundedReceiver<Queued>,
    phase: Arc<watch::Sender<Phase>>,
) -> Option<OwnedWriteHalf> {
    let mut dead = phase.subscribe();
    let mut buf = Vec::with_capacity(COALESCE);
    let mut written_lines = Vec::new();
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
        let mut next = Some(first);
        while let Some(queued) = next {
            buf.extend_from_slice(queued.line.head.as_bytes());
            if let Some(body) = &queued.line.body {
                let body = body.get().as_bytes();
                if body.len() <= INLINE_BODY {
                    buf.extend_from_slice(body);
                } else {
                    if !write_out(&mut wr, &buf, &mut dead, &phase).await
                        || !write_out(&mut wr, body, &mut dead, &phase).await
                    {
                        return None;
                    }
                    buf.clear();
                }
                buf.extend_from_slice(SUCCESS_TAIL.as_bytes());
            }
            buf.push(b'\n');
            written_lines.push(queued);
            next = if buf.len() < COALESCE { queue.try_recv().ok() } else { None };
        }
        if !write_out(&mut wr, &buf, &mut dead, &phase).await {
            return None;
        }
        written_lines.clear();
        if buf.capacity() > COALESCE * 2 {
            // One large line must not keep its buffer for the connection's life.
            buf = Vec::with_capacity(COALESCE);
        }
    }
}

/// Writes all of `bytes`; false when the connection died meanwhile, the write failed or the
/// peer stopped reading for [`WRITE_TIMEOUT`] (the connection is then marked dead).
async fn write_out(
    wr: &mut OwnedWriteHalf,
    bytes: &[u8],
    dead: &mut watch::Receiver<Phase>,
    phase: &watch::Sender<Phase>,
) -> bool {
    let written = tokio::select! {
        biased;
        () = phase_reached(dead, Phase::Dead) => return false,
        written = tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(bytes)) => written,
    };
    match written {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            debug!(error = %e, "write failed; dropping the connection");
            advance(phase, Phase::Dead);
            false
        }
        Err(_) => {
            warn!(timeout = ?WRITE_TIMEOUT, "peer is not reading; dropping the connection");
            advance(phase, Phase::Dead);
            false
        }
    }
}

/// An error response line; `error` is the JSON-RPC error object.
#[derive(Serialize)]
struct ErrorResponse<'a> {
    jsonrpc: &'static str,
    id: &'a RawValue,
    error: ErrorObject<'a>,
}

/// A JSON-RPC error object: `data` is vmhost's, absent only for -32601 (as it always was).
#[derive(Serialize)]
struct ErrorObject<'a> {
    code: i32,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<ErrorData>,
}

/// How every success line ends, after its result.
const SUCCESS_TAIL: &str = "}";

/// A success to `id` up to its result.
fn success_head(id: &RawValue) -> String {
    const HEAD: &str = r#"{"jsonrpc":"2.0","id":"#;
    const RESULT: &str = r#","result":"#;
    let mut line = String::with_capacity(HEAD.len() + id.get().len() + RESULT.len());
    line.push_str(HEAD);
    line.push_str(id.get());
    line.push_str(RESULT);
    line
}

/// An error response line.
fn error_line(id: &RawValue, err: &ApiError) -> String {
    let data = (err.code != Code::MethodNotFound).then(|| err.data());
    let error = ErrorObject { code: err.code.as_i32(), message: &err.message, data };
    to_line(&ErrorResponse { jsonrpc: "2.0", id, error })
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

    /// Serializations of [`Counted`] so far.
    static SERIALIZED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// A result that counts how often it is serialized.
    struct Counted;

    impl Serialize for Counted {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            SERIALIZED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            s.serialize_str("counted")
        }
    }

    /// `t.count` (read) answers [`Counted`]; `t.add` (write) takes `{a, b}` and answers the sum;
    /// `t.panic` (read) panics.
    fn test_dispatcher() -> Dispatcher {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Add {
            a: u32,
            b: u32,
        }
        let mut d = Dispatcher::new();
        d.add("t.count", Access::Read, Handler::Call(Arc::new(|_, _| Ok(Box::pin(async { Body::json(&Counted) })))))
            .unwrap();
        d.add(
            "t.add",
            Access::Write,
            Handler::Call(Arc::new(|raw, _| {
                let p: Add = crate::rpc::methods::parse_params(raw)?;
                Ok(Box::pin(async move { Body::json(&(p.a + p.b)) }))
            })),
        )
        .unwrap();
        d.add("t.panic", Access::Read, Handler::Call(Arc::new(|_, _| Ok(Box::pin(async { panic!("boom") }))))).unwrap();
        d
    }

    fn test_conn(role: Role) -> Conn {
        let (out, _queue) = mpsc::unbounded_channel();
        Conn {
            dispatcher: Arc::new(test_dispatcher()),
            role,
            out,
            queued: Arc::new(Semaphore::new(1 << 20)),
            subscriptions: Arc::new(Semaphore::new(limits::MAX_SUBSCRIPTIONS_PER_CONNECTION)),
            uid_subscriptions: None,
            phase: Arc::new(watch::channel(Phase::Open).0),
            peer: Peer { uid: 0, pid: 0 },
        }
    }

    /// The answer line `conn` makes for `line` (a single request), `None` for none.
    async fn answer(conn: &Conn, line: &str) -> Option<String> {
        let Line::Single(parsed) = request::classify(line.as_bytes().to_vec()) else { panic!("{line}") };
        conn.process(parsed).await.response.map(|out| {
            let mut text = String::new();
            out.append_to(&mut text);
            text
        })
    }

    #[tokio::test]
    async fn the_dispatcher_answers_each_id_kind_with_that_id_serializing_once() {
        let conn = test_conn(Role::Admin);
        for id in [r#""a \" b""#, "17", "-1.50e3", "null", r#""""#] {
            let before = SERIALIZED.load(std::sync::atomic::Ordering::SeqCst);
            let line = answer(&conn, &format!(r#"{{"jsonrpc":"2.0","method":"t.count","id":{id}}}"#)).await.unwrap();
            assert_eq!(line, format!(r#"{{"jsonrpc":"2.0","id":{id},"result":"counted"}}"#));
            assert_eq!(SERIALIZED.load(std::sync::atomic::Ordering::SeqCst) - before, 1, "serialized once");
        }
        // A notification runs and is not answered.
        let before = SERIALIZED.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(answer(&conn, r#"{"jsonrpc":"2.0","method":"t.count"}"#).await, None);
        assert_eq!(SERIALIZED.load(std::sync::atomic::Ordering::SeqCst) - before, 1);
        let sum = answer(&conn, r#"{"jsonrpc":"2.0","method":"t.add","params":{"a":2,"b":3},"id":[]}"#).await;
        assert!(sum.unwrap().contains("id must be"), "an invalid id is refused");
        let sum = answer(&conn, r#"{"jsonrpc":"2.0","method":"t.add","params":[2,3],"id":"s"}"#).await;
        assert_eq!(sum.unwrap(), r#"{"jsonrpc":"2.0","id":"s","result":5}"#);
    }

    #[tokio::test]
    async fn the_dispatcher_refuses_unknown_methods_bad_params_and_writes_by_readers() {
        let conn = test_conn(Role::Admin);
        let unknown = answer(&conn, r#"{"jsonrpc":"2.0","method":"t.nope","id":1}"#).await.unwrap();
        assert_eq!(unknown, r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32601,"message":"Method not found"}}"#);
        assert_eq!(answer(&conn, r#"{"jsonrpc":"2.0","method":"t.nope"}"#).await, None);
        let error = |line: String| -> serde_json::Value { serde_json::from_str::<serde_json::Value>(&line).unwrap() };
        let wrong = error(
            answer(&conn, r#"{"jsonrpc":"2.0","method":"t.add","params":{"a":"x","b":1},"id":2}"#).await.unwrap(),
        );
        assert_eq!((wrong["id"].as_i64(), wrong["error"]["code"].as_i64()), (Some(2), Some(-32602)));
        assert_eq!(wrong["error"]["data"]["field"], "a");
        let missing = error(answer(&conn, r#"{"jsonrpc":"2.0","method":"t.add","id":3}"#).await.unwrap());
        assert_eq!(
            (missing["error"]["code"].as_i64(), missing["error"]["data"]["field"].as_str()),
            (Some(-32602), Some("a"))
        );
        let panicked = error(answer(&conn, r#"{"jsonrpc":"2.0","method":"t.panic","id":4}"#).await.unwrap());
        assert_eq!(panicked["error"]["code"], -32603);
        assert_eq!(panicked["error"]["message"], "method t.panic failed unexpectedly");
        let reader = test_conn(Role::ReadOnly);
        let refused = error(
            answer(&reader, r#"{"jsonrpc":"2.0","method":"t.add","params":{"a":1,"b":1},"id":5}"#).await.unwrap(),
        );
        assert_eq!(
            (refused["error"]["code"].as_i64(), refused["error"]["data"]["field"].as_str()),
            (Some(1002), Some("method"))
        );
        let unknown = error(answer(&reader, r#"{"jsonrpc":"2.0","method":"t.nope","id":6}"#).await.unwrap());
        assert_eq!(unknown["error"]["code"], -32601, "an unknown method is -32601 for a reader too");
        assert!(answer(&reader, r#"{"jsonrpc":"2.0","method":"t.count","id":7}"#).await.unwrap().contains("counted"));
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
    async fn the_write_loop_frames_own_and_shared_lines_in_order_and_gives_the_budget_back() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (_rd, wr) = a.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        let phase = Arc::new(watch::channel(Phase::Open).0);
        let budget = Arc::new(Semaphore::new(1 << 20));
        let list: Arc<RawValue> =
            Arc::from(RawValue::from_string(format!("[{}]", "1,".repeat(100_000) + "2")).unwrap());
        let lines = [
            OutLine::own("small".into()),
            OutLine { head: "head:".into(), body: Some(Body::Shared(Arc::clone(&list))) },
            OutLine { head: "h2:".into(), body: Some(Body::Own(RawValue::from_string("[1]".into()).unwrap())) },
            OutLine::own("after".into()),
        ];
        for line in lines {
            let bytes = Arc::clone(&budget).acquire_many_owned(1000).await.unwrap();
            tx.send(Queued { line, _bytes: bytes }).unwrap();
        }
        drop(tx);
        let writer = tokio::spawn(write_loop(wr, rx, phase));
        let expected = format!("small\nhead:{}}}\nh2:[1]}}\nafter\n", list.get());
        let mut got = vec![0; expected.len()];
        let mut b = b;
        b.read_exact(&mut got).await.unwrap();
        let wr = writer.await.unwrap();
        assert!(wr.is_some(), "every line written");
        drop(wr);
        assert_eq!(b.read(&mut [0; 16]).await.unwrap(), 0, "nothing after the last line");
        assert!(got == expected.as_bytes(), "the lines as written differ from the lines queued");
        assert_eq!(budget.available_permits(), 1 << 20);
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
    fn an_overlong_batch_is_refused_as_a_whole() {
        let element = r#"{"jsonrpc":"2.0","id":1,"method":"vm.list"}"#;
        let batch = |n: usize| format!("[{}]", vec![element; n].join(",")).into_bytes();
        assert!(matches!(request::classify(batch(limits::MAX_BATCH)), Line::Batch(e) if e.len() == limits::MAX_BATCH));
        match request::classify(batch(limits::MAX_BATCH + 1)) {
            Line::Error(e) => {
                assert_eq!(e.code, Code::LimitExceeded);
                assert_eq!(e.details["limit"], "batch_length");
                assert_eq!(e.details["got"], limits::MAX_BATCH + 1);
            }
            other => panic!("{other:?}"),
        }
        // Elements past the limit are skipped, not trusted: broken JSON there is still -32700.
        let mut broken = batch(limits::MAX_BATCH + 1);
        broken.truncate(broken.len() - 2);
        assert!(matches!(request::classify(broken), Line::Error(e) if e.code == Code::ParseError));
        // A million tiny elements are counted without holding them.
        let tiny = format!("[{}1]", "1,".repeat(500_000)).into_bytes();
        assert!(matches!(request::classify(tiny), Line::Error(e) if e.details["got"] == 500_001));
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
        assert_send(&serve(listener, Arc::new(Dispatcher::new()), Arc::new(AccessPolicy::default()), stopped));
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
