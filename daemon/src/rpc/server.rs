//! The RPC transport: newline-delimited JSON-RPC 2.0 on a Unix stream socket.
//!
//! jsonrpsee's own servers speak HTTP and WebSocket; vmhost speaks one JSON message per line on a
//! Unix socket and gates every connection on the kernel's peer credentials. This module is that
//! transport and nothing more: methods are registered and dispatched by jsonrpsee
//! ([`Methods::raw_json_request`]), access is decided by [`super::auth`].
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
//! 4. the line parser (`handle_line`, with the pure [`request::classify`]): invalid UTF-8 or
//!    JSON is answered with -32700, an array is a batch (over [`limits::MAX_BATCH`]: 1003),
//!    anything else a single request;
//! 5. per request (`Conn::process`): shape check ([`Request::parse`], -32600), read-only check
//!    (1002), guest-agent rate ([`AgentRate`], 1004), subscription slots (1003), then dispatch in
//!    its own task, at most [`MAX_IN_FLIGHT`] at a time per connection and per uid, each holding
//!    its slot until its answer is queued;
//! 6. the write queue and writer task (`write_loop`): answers go out as they complete, followed
//!    by any subscription notifications; the queue is bounded in bytes ([`limits::Budget`]), a
//!    full one makes its senders wait (so the reader stops: back-pressure), and a peer that does
//!    not read for [`WRITE_TIMEOUT`] is dropped;
//! 7. `vm.console` alone on its line (`Conn::console`) is not dispatched: once the client is
//!    attached ([`Consoles::attach`]), reading stops, the answers in flight are written, then the
//!    answer of `vm.console`, and the connection becomes the console's byte stream
//!    ([`crate::console::session`]) until it closes.

use crate::api::{self, ApiError, Code, ConsoleAttached, ConsoleParams};
use crate::console::hub::{Attachment, Peer};
use crate::console::Consoles;
use crate::rpc::agent_rate::AgentRate;
use crate::rpc::auth::{self, AccessPolicy, PeerIdentity, Role};
use crate::rpc::limits::{self, Budget, Registry, SharedThrottle, Slot};
use crate::rpc::request::{self, Line, Request};
use crate::rpc::socket_dir;
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
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, error, info, info_span, warn, Instrument};

pub use super::limits::{MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID, MAX_IN_FLIGHT};

/// Longest accepted request line in bytes, without its `\n` (or `\r\n`).
pub const MAX_LINE: usize = 1024 * 1024;

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
    shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    serve_with(listener, methods, policy, Options::default(), shutdown).await
}

/// Settings of [`serve_with`] that come from the configuration.
#[derive(Debug, Clone)]
pub struct Options {
    /// A connection with no request in flight, no subscription and no complete request line for
    /// this long is closed (`access.idle_timeout_s`).
    pub idle_timeout: Duration,
    /// Serves `vm.console` (without it, `vm.console` is dispatched like any method).
    pub consoles: Option<Arc<Consoles>>,
    /// Answers `vm.list` and `vm.get` from the manager's ready-made JSON views ([`read_view`]),
    /// past the method table: its answers are serialized again and then validated by parsing,
    /// which for 1000 VMs cost more than the rest of the call. Without it, they are dispatched
    /// like any method (same answers).
    pub views: Option<Arc<crate::lifecycle::Manager>>,
}

impl Default for Options {
    fn default() -> Self {
        Options { idle_timeout: limits::DEFAULT_IDLE_TIMEOUT, consoles: None, views: None }
    }
}

/// What every connection of one server shares.
struct Shared {
    methods: Methods,
    policy: Arc<AccessPolicy>,
    options: Options,
    registry: Arc<Registry>,
    /// Refusals at accept (slots) and of peers without a role, logged at most once per
    /// [`limits::REFUSAL_LOG_INTERVAL`] each.
    slot_log: SharedThrottle,
    refusal_log: SharedThrottle,
    /// Guest-agent calls per VM and role.
    agent_calls: Arc<AgentRate>,
}

/// [`serve`] with `options`.
///
/// # Errors
///
/// As [`serve`].
pub async fn serve_with(
    listener: UnixListener,
    methods: Methods,
    policy: Arc<AccessPolicy>,
    options: Options,
    mut shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    let mut connections = JoinSet::new();
    let mut next_conn: u64 = 0;
    let shared = Arc::new(Shared {
        methods,
        policy,
        options,
        registry: Registry::new(),
        slot_log: SharedThrottle::default(),
        refusal_log: SharedThrottle::default(),
        agent_calls: Arc::new(AgentRate::default()),
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
    /// The method table.
    methods: Methods,
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
    /// Guest-agent calls per VM and role, shared by all connections.
    agent_calls: Arc<AgentRate>,
    /// The connection's [`Phase`]; shared with the writer, which holds no `out` sender.
    phase: Arc<watch::Sender<Phase>>,
    /// Who the peer is (for `vm.console`'s writer).
    peer: Peer,
    /// Serves `vm.console`.
    consoles: Option<Arc<Consoles>>,
    /// Serves `vm.list` and `vm.get` from ready-made views.
    views: Option<Arc<crate::lifecycle::Manager>>,
}

/// One line in the write queue, with the bytes of the budget it holds until it is written.
struct Queued {
    line: OutLine,
    _bytes: OwnedSemaphorePermit,
}

/// One line to write (the line end is added when it is written): text of its own, or its own
/// head and tail around a body shared with other answers (the `vm.list` array, 450 KB with
/// 1000 VMs), which is written from where it is instead of being copied per answer.
struct OutLine {
    head: String,
    shared: Option<(Arc<RawValue>, &'static str)>,
}

impl OutLine {
    /// A line of its own text.
    fn own(text: String) -> OutLine {
        OutLine { head: text, shared: None }
    }

    /// The line's length, without its line end.
    fn len(&self) -> usize {
        self.head.len() + self.shared.as_ref().map_or(0, |(body, tail)| body.get().len() + tail.len())
    }

    /// Appends the whole line to `text` (a batch's array).
    fn append_to(&self, text: &mut String) {
        text.push_str(&self.head);
        if let Some((body, tail)) = &self.shared {
            text.push_str(body.get());
            text.push_str(tail);
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
        methods: shared.methods.clone(),
        role,
        out,
        queued: budget.queued,
        subscriptions: budget.subscriptions,
        uid_subscriptions: budget.uid_subscriptions,
        agent_calls: Arc::clone(&shared.agent_calls),
        phase: Arc::clone(&phase),
        peer,
        consoles: shared.options.consoles.clone(),
        views: shared.options.views.clone(),
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
        Line::Single(text) => {
            match conn.console(&text).await {
                Some(Ok(switch)) => return Err(End::Console(Box::new(switch))),
                Some(Err(answer)) => {
                    conn.send(answer).await;
                    return Ok(());
                }
                None => {}
            }
            let permit = permits.acquire().await.ok_or(End::Stopped)?;
            let conn = Arc::clone(conn);
            tokio::spawn(
                async move {
                    let reply = conn.process(&text).await;
                    drop(text);
                    if let Some(response) = reply.response {
                        conn.send(response).await;
                    }
                    drop(permit);
                    if let Some(notifications) = reply.notifications {
                        conn.forward(notifications).await;
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
                let reply = conn.process(element.get()).await;
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
                subscriptions.extend(reply.notifications);
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
    for notifications in subscriptions {
        tokio::spawn(Arc::clone(&conn).forward_owned(notifications).in_current_span());
    }
}

/// The notifications of an open subscription, with the subscription slots it holds.
struct Subscription {
    notifications: mpsc::Receiver<Box<RawValue>>,
    _own: OwnedSemaphorePermit,
    _uid: Option<OwnedSemaphorePermit>,
}

/// The outcome of one request.
struct Reply {
    /// The response object, `None` for a notification.
    response: Option<OutLine>,
    /// Where a subscription's notifications arrive; `None` when nothing can arrive.
    notifications: Option<Subscription>,
}

impl Reply {
    /// A reply with a response and no notifications.
    fn answer(response: impl Into<OutLine>) -> Reply {
        Reply { response: Some(response.into()), notifications: None }
    }

    /// A reply to a notification: nothing.
    fn silent() -> Reply {
        Reply { response: None, notifications: None }
    }

    /// An error reply to `id` (nothing for a notification).
    fn error(id: Option<&RawValue>, err: &ApiError) -> Reply {
        match id {
            Some(id) => Reply::answer(error_line(id, err)),
            None => Reply::silent(),
        }
    }
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

    /// Attaches the client to a console when `text` is a `vm.console` request with an id (and
    /// this server serves consoles): `Some(Ok)` to switch the connection over, `Some(Err)` with
    /// the error line to answer (the connection stays JSON-RPC), `None` for any other request.
    async fn console(&self, text: &str) -> Option<Result<ConsoleSwitch, String>> {
        let consoles = self.consoles.as_ref()?;
        // Most lines are not vm.console: skip the second parse for them. A method name spelled
        // with JSON escapes is not switched (the method table answers it with -32600).
        if !text.contains("\"vm.console\"") {
            return None;
        }
        let request = Request::parse(text).ok()?;
        let id = request.id.filter(|_| request.method == "vm.console")?;
        let params = jsonrpsee::types::Params::new(request.params.map(RawValue::get));
        let params: ConsoleParams = match crate::rpc::methods::parse_params(&params) {
            Ok(p) => p,
            Err(err) => return Some(Err(error_line(id, &err))),
        };
        match consoles.attach(&params, self.role, self.peer).await {
            Ok(attachment) => {
                let result = ConsoleAttached {
                    name: params.name.clone(),
                    read_only: !attachment.member.writer,
                    replay_bytes: attachment.replay.len() as u64,
                };
                let answer = to_line(&serde_json::json!({"jsonrpc": "2.0", "id": id, "result": result}));
                Some(Ok(ConsoleSwitch { answer, attachment, early_input: Vec::new() }))
            }
            Err(err) => {
                info!(vm = %params.name, code = err.code.as_i32(), "console attach refused");
                Some(Err(error_line(id, &err)))
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
            return Reply::error(request.id, &err);
        }
        if let Err(err) = self.agent_calls.check(method, request.params, self.role) {
            debug!(method, "guest-agent call refused by the rate limit");
            return Reply::error(request.id, &err);
        }
        if let (Some(views), Some(id)) = (&self.views, request.id) {
            if let Some(line) = read_view(views, method, request.params, id) {
                return Reply::answer(line);
            }
        }
        let is_subscription = matches!(self.methods.method(method), Some(MethodCallback::Subscription(_)));
        let slots = if is_subscription {
            match self.subscription_slots() {
                Ok(slots) => Some(slots),
                Err(err) => {
                    warn!(method, limit = %err.details["limit"], "subscription refused");
                    return Reply::error(request.id, &err);
                }
            }
        } else {
            None
        };
        // Dispatch our own rewrite of the request (id 0, known members only), so what runs is
        // exactly what was checked; the client's id is put back on the answer below.
        let call = to_line(&Call { jsonrpc: "2.0", id: 0, method, params: request.params });
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
                    return Reply::error(request.id, &err);
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
                let notifications = slots.map(|(own, uid)| Subscription { notifications, _own: own, _uid: uid });
                Reply { response: Some(response_line(id, &answer).into()), notifications }
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

    /// Writes a subscription's notifications until it ends or the connection stops; its
    /// subscription slots are given back then.
    async fn forward(&self, subscription: Subscription) {
        let mut phase = self.phase.subscribe();
        let mut notifications = subscription.notifications;
        loop {
            tokio::select! {
                biased;
                () = phase_reached(&mut phase, Phase::Draining) => break,
                message = notifications.recv() => match message {
                    Some(message) if self.send(message.get().to_owned()).await => {}
                    // Ended, or the connection is gone.
                    _ => break,
                },
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
            if let Some((body, tail)) = &queued.line.shared {
                if !write_out(&mut wr, &buf, &mut dead, &phase).await
                    || !write_out(&mut wr, body.get().as_bytes(), &mut dead, &phase).await
                {
                    return None;
                }
                buf.clear();
                buf.extend_from_slice(tail.as_bytes());
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

/// The answer to `vm.list` or `vm.get` (request `id`, `params`) made of the manager's JSON
/// views, the same the method table would give; `None` for any other method.
fn read_view(
    manager: &crate::lifecycle::Manager,
    method: &str,
    params: Option<&RawValue>,
    id: &RawValue,
) -> Option<OutLine> {
    match method {
        // Like the method table's vm.list, it takes any params.
        "vm.list" => {
            let list = manager.list_json().0;
            Some(OutLine { head: success_head(id, 0), shared: Some((list, "}")) })
        }
        "vm.get" => {
            let params = jsonrpsee::types::Params::new(params.map(RawValue::get));
            let view =
                crate::rpc::methods::parse_params::<api::NameParams>(&params).and_then(|p| manager.get_json(&p.name));
            Some(OutLine::own(match view {
                Ok(view) => success_line(id, view.0.get().len(), |line| line.push_str(view.0.get())),
                Err(err) => error_line(id, &err),
            }))
        }
        _ => None,
    }
}

/// A success line to `id` whose result `write` appends (about `hint` bytes), made in one buffer.
fn success_line(id: &RawValue, hint: usize, write: impl FnOnce(&mut String)) -> String {
    let mut line = success_head(id, hint + 1);
    write(&mut line);
    line.push('}');
    line
}

/// A success to `id` up to its result, with room for `more` bytes after it.
fn success_head(id: &RawValue, more: usize) -> String {
    const HEAD: &str = r#"{"jsonrpc":"2.0","id":"#;
    const RESULT: &str = r#","result":"#;
    let mut line = String::with_capacity(HEAD.len() + id.get().len() + RESULT.len() + more);
    line.push_str(HEAD);
    line.push_str(id.get());
    line.push_str(RESULT);
    line
}

/// How jsonrpsee starts a success for our id 0 (its `Response` serializes `jsonrpc`, `id`,
/// then `result`, and nothing after it).
const SUCCESS_FOR_ID_0: &str = r#"{"jsonrpc":"2.0","id":0,"result":"#;

/// Re-addresses a jsonrpsee response (made for id 0) to the client's `id`.
fn response_line(id: &RawValue, answer: &RawValue) -> String {
    // A success is re-addressed by splicing: parsing a 450 KB `vm.list` again only to copy it
    // cost more than making it. Anything else takes the parse below.
    if let Some(result) = answer.get().strip_prefix(SUCCESS_FOR_ID_0).and_then(|r| r.strip_suffix('}')) {
        return success_line(id, result.len(), |line| line.push_str(result));
    }
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
            OutLine { head: "head:".into(), shared: Some((Arc::clone(&list), "}")) },
            OutLine::own("after".into()),
        ];
        for line in lines {
            let bytes = Arc::clone(&budget).acquire_many_owned(1000).await.unwrap();
            tx.send(Queued { line, _bytes: bytes }).unwrap();
        }
        drop(tx);
        let writer = tokio::spawn(write_loop(wr, rx, phase));
        let expected = format!("small\nhead:{}}}\nafter\n", list.get());
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
        let big = response_line(raw(r#"{"a":[1]}"#), raw(r#"{"jsonrpc":"2.0","id":0,"result":[{"x":"}"},2]}"#));
        assert_eq!(big, r#"{"jsonrpc":"2.0","id":{"a":[1]},"result":[{"x":"}"},2]}"#);
        serde_json::from_str::<serde_json::Value>(&big).unwrap();
        let bad = response_line(raw("1"), raw(r#"{"jsonrpc":"2.0","id":0}"#));
        // The views' answers are made the same way, in one buffer.
        let made = success_line(raw(r#""q""#), 0, |l| l.push_str(r#"[{"a":1},{"b":"}"}]"#));
        assert_eq!(made, r#"{"jsonrpc":"2.0","id":"q","result":[{"a":1},{"b":"}"}]}"#);
        assert!(made.capacity() > made.len(), "no room for the line end");
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
