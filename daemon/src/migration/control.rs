//! Framed, encrypted and authenticated messages on a migration stream: the control channel
//! ([`Control`]) and the files channel (a cold move's disks, any move's snapshots:
//! [`super::files`], through [`Framed`]).
//!
//! Why a nonce exchange before the first frame: the sequence numbers restart at 0 on every
//! stream, so frames keyed by the secret alone could be replayed from an earlier control
//! channel of the same migration (a recorded `Commit` into a later `Query` channel), or
//! reflected back to their sender. Each side sends 32 fresh random bytes first and each
//! direction's key is derived from the secret and both ([`wire::frame_keys`]), so a frame is
//! valid on one stream, in one direction, at one position only.
//!
//! Why the control channel runs two tasks: a peer that vanished without closing (a host that
//! lost power, a cut path) leaves a half-open TCP connection on which a read waits forever, and
//! the phases between control messages are long (mirroring a disk: minutes of silence). So
//! each side sends a [`ControlMsg::Ping`] whenever it sent nothing for [`KeepAlive::ping`], from
//! a task of its own (whatever the migration's steps are busy with), and a reader task consumes
//! every frame as it comes, dropping pings: a channel on which nothing arrived for
//! [`KeepAlive::idle`] is dead, and [`Control::recv`] says so ([`MigrationError::Timeout`]).
//!
//! Order: [`Control::new`] (or [`Framed::new`]) over an authenticated stream; the first send or
//! receive exchanges the nonces (and starts the control channel's tasks); any failure ends the
//! stream for good; dropping the [`Control`] stops its tasks and closes the stream.

use super::wire::{self, FrameKey, FrameKeys, NONCE_LEN};
use super::{ControlMsg, MigrationError, Secret};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How long one write may take before the stream counts as dead.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// A control channel's interval between keep-alives ([`KeepAlive::ping`]).
pub const PING_INTERVAL: Duration = Duration::from_secs(5);
/// How long a control channel may stay without any frame before it is dead
/// ([`KeepAlive::idle`]): four pings missed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(20);
/// Messages received but not yet asked for ([`Control::recv`]): the protocol has at most a few
/// in flight; a peer sending more waits (TCP's window), it cannot fill memory.
const INBOX: usize = 16;

/// A control channel's keep-alive timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepAlive {
    /// A ping is sent when nothing was sent for this long.
    pub ping: Duration,
    /// The channel is dead when nothing arrived for this long.
    pub idle: Duration,
}

impl Default for KeepAlive {
    fn default() -> Self {
        KeepAlive { ping: PING_INTERVAL, idle: IDLE_TIMEOUT }
    }
}

/// Sends our nonce and reads the peer's, within `timeout`; the stream's keys.
async fn exchange(
    stream: &mut tokio::net::TcpStream,
    secret: &Secret,
    timeout: Duration,
) -> Result<FrameKeys, MigrationError> {
    let mine = super::secret::random_32()?;
    let theirs = tokio::time::timeout(timeout, async {
        stream.write_all(&mine).await?;
        let mut theirs = [0u8; NONCE_LEN];
        stream.read_exact(&mut theirs).await?;
        Ok::<_, std::io::Error>(theirs)
    })
    .await
    .map_err(|_| MigrationError::Timeout("nonce exchange"))?
    .map_err(|e| MigrationError::io("nonce exchange", e))?;
    wire::frame_keys(secret, &mine, &theirs).map_err(MigrationError::Wire)
}

fn to_tokio(stream: std::net::TcpStream) -> Result<tokio::net::TcpStream, MigrationError> {
    stream.set_nonblocking(true).map_err(|e| MigrationError::io("stream", e))?;
    tokio::net::TcpStream::from_std(stream).map_err(|e| MigrationError::io("stream", e))
}

/// Seals `payload` as frame `seq` and writes it whole, within [`WRITE_TIMEOUT`].
async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    key: &FrameKey,
    seq: u64,
    payload: &[u8],
) -> Result<(), MigrationError> {
    let frame = wire::seal(key, seq, payload).map_err(MigrationError::Wire)?;
    tokio::time::timeout(WRITE_TIMEOUT, w.write_all(&frame))
        .await
        .map_err(|_| MigrationError::Timeout("send"))?
        .map_err(|e| MigrationError::io("send", e))
}

/// Reads and opens frame `seq`. An end of stream before its first byte is
/// [`MigrationError::Closed`].
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, key: &FrameKey, seq: u64) -> Result<Vec<u8>, MigrationError> {
    let mut header = [0u8; 4];
    match r.read_exact(&mut header).await {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(MigrationError::Closed),
        res => res.map_err(|e| MigrationError::io("receive", e))?,
    };
    let len = wire::frame_len(header).map_err(MigrationError::Wire)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(|e| MigrationError::io("receive", e))?;
    wire::open_frame(key, seq, header, body).map_err(MigrationError::Wire)
}

/// The framing of one stream used in turn by one task (the files channel): send and receive
/// frames in sequence, no keep-alive.
pub(crate) struct Framed {
    pending: Option<std::net::TcpStream>,
    stream: Option<tokio::net::TcpStream>,
    secret: Secret,
    keys: Option<FrameKeys>,
    sent: u64,
    received: u64,
    broken: bool,
}

impl Framed {
    pub(crate) fn new(stream: std::net::TcpStream, secret: &Secret) -> Framed {
        Framed {
            pending: Some(stream),
            stream: None,
            secret: secret.clone(),
            keys: None,
            sent: 0,
            received: 0,
            broken: false,
        }
    }

    /// The stream's keys, the nonces exchanged within `timeout` the first time.
    async fn ready(&mut self, timeout: Duration) -> Result<FrameKeys, MigrationError> {
        if self.broken {
            return Err(MigrationError::Closed);
        }
        if let Some(std) = self.pending.take() {
            self.stream = Some(to_tokio(std)?);
        }
        if let Some(k) = &self.keys {
            return Ok(k.clone());
        }
        let Some(stream) = self.stream.as_mut() else { return Err(MigrationError::Closed) };
        // Until the exchange completes, a cancelled or failed one leaves the stream ended.
        self.broken = true;
        let keys = exchange(stream, &self.secret, timeout).await?;
        self.keys = Some(keys.clone());
        self.broken = false;
        Ok(keys)
    }

    /// Sends one frame carrying `payload`.
    pub(crate) async fn send(&mut self, payload: &[u8]) -> Result<(), MigrationError> {
        let keys = self.ready(WRITE_TIMEOUT).await?;
        let Some(stream) = self.stream.as_mut() else { return Err(MigrationError::Closed) };
        // Whatever happens below (a failure, a cancelled future), a half-written frame ends it.
        self.broken = true;
        write_frame(stream, &keys.send, self.sent, payload).await?;
        self.sent += 1;
        self.broken = false;
        Ok(())
    }

    /// The next frame's payload, waiting at most `timeout` for it to arrive whole.
    pub(crate) async fn recv(&mut self, timeout: Duration) -> Result<Vec<u8>, MigrationError> {
        let deadline = Instant::now() + timeout;
        let keys = self.ready(timeout).await?;
        let Some(stream) = self.stream.as_mut() else { return Err(MigrationError::Closed) };
        self.broken = true;
        let payload = tokio::time::timeout_at(deadline, read_frame(stream, &keys.receive, self.received))
            .await
            .map_err(|_| MigrationError::Timeout("receive"))??;
        self.received += 1;
        self.broken = false;
        Ok(payload)
    }

    /// Marks the stream unusable (what arrived breaks the protocol above the framing).
    pub(crate) fn break_off(&mut self) {
        self.broken = true;
    }

    /// Closes our direction after the last frame (the peer reads an end of stream).
    pub(crate) async fn shutdown(&mut self) {
        if let Some(s) = self.stream.as_mut() {
            let _ = s.shutdown().await;
        }
    }
}

/// The control channel: messages encrypted and authenticated one by one, kept alive both ways
/// (module doc).
pub struct Control {
    state: State,
    keepalive: KeepAlive,
}

enum State {
    Pending(std::net::TcpStream, Secret),
    Open(Open),
    Ended,
}

/// A control channel after the nonce exchange: its writer (shared with the pinger) and the
/// reader's inbox; dropped, both tasks stop and the stream closes.
struct Open {
    writer: Arc<tokio::sync::Mutex<Writer>>,
    inbox: mpsc::Receiver<Result<ControlMsg, MigrationError>>,
    /// Set when the reader met an error: nothing more is sent.
    ended: Arc<AtomicBool>,
    tasks: [tokio::task::AbortHandle; 2],
}

impl Drop for Open {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

struct Writer {
    half: tokio::net::tcp::OwnedWriteHalf,
    key: FrameKey,
    seq: u64,
    last: Instant,
    /// A write failed or was cancelled half way: the stream is out of step.
    broken: bool,
}

impl Writer {
    async fn send(&mut self, payload: &[u8]) -> Result<(), MigrationError> {
        if self.broken {
            return Err(MigrationError::Closed);
        }
        self.broken = true;
        write_frame(&mut self.half, &self.key, self.seq, payload).await?;
        self.seq += 1;
        self.last = Instant::now();
        self.broken = false;
        Ok(())
    }
}

impl Control {
    /// Over a connected control stream (from [`super::connect`] or an [`super::IncomingChannel`]),
    /// with the default keep-alive.
    pub fn new(stream: std::net::TcpStream, secret: &Secret) -> Control {
        Control::with_keepalive(stream, secret, KeepAlive::default())
    }

    /// As [`Control::new`] with another keep-alive timing (tests: a dead peer found in
    /// milliseconds).
    pub fn with_keepalive(stream: std::net::TcpStream, secret: &Secret, keepalive: KeepAlive) -> Control {
        Control { state: State::Pending(stream, secret.clone()), keepalive }
    }

    /// The open channel, the nonces exchanged within `timeout` the first time.
    async fn open(&mut self, timeout: Duration) -> Result<&mut Open, MigrationError> {
        if let State::Pending(..) = self.state {
            // Taken out first: a failed or cancelled exchange leaves the channel ended.
            let State::Pending(stream, secret) = std::mem::replace(&mut self.state, State::Ended) else {
                return Err(MigrationError::Closed);
            };
            let mut stream = to_tokio(stream)?;
            let keys = exchange(&mut stream, &secret, timeout).await?;
            self.state = State::Open(start(stream, keys, self.keepalive));
        }
        match &mut self.state {
            State::Open(open) => Ok(open),
            _ => Err(MigrationError::Closed),
        }
    }

    /// Sends one message.
    ///
    /// # Errors
    /// When the stream fails, the message is larger than a frame, or an earlier failure ended
    /// the channel.
    pub async fn send(&mut self, msg: &ControlMsg) -> Result<(), MigrationError> {
        let json = serde_json::to_vec(msg).map_err(|e| MigrationError::Protocol(format!("encode: {e}")))?;
        let open = self.open(WRITE_TIMEOUT).await?;
        if open.ended.load(Ordering::SeqCst) {
            return Err(MigrationError::Closed);
        }
        open.writer.lock().await.send(&json).await
    }

    /// The next message (keep-alives are not messages), waiting at most `timeout`; a timeout
    /// leaves the channel usable.
    ///
    /// # Errors
    /// [`MigrationError::Timeout`] when `timeout` passes, or when nothing at all (not even a
    /// keep-alive) arrived for [`KeepAlive::idle`], which ends the channel; when the stream fails
    /// or closes, a message is not authentic or out of sequence, or is not a [`ControlMsg`]
    /// (each ends the channel: later calls answer [`MigrationError::Closed`]).
    pub async fn recv(&mut self, timeout: Duration) -> Result<ControlMsg, MigrationError> {
        let deadline = Instant::now() + timeout;
        let open = self.open(timeout).await?;
        match tokio::time::timeout_at(deadline, open.inbox.recv()).await {
            Err(_) => Err(MigrationError::Timeout("receive")),
            Ok(None) => Err(MigrationError::Closed),
            Ok(Some(r)) => r,
        }
    }
}

/// Splits `stream` and starts the reader and the pinger.
fn start(stream: tokio::net::TcpStream, keys: FrameKeys, keepalive: KeepAlive) -> Open {
    let (read, write) = stream.into_split();
    let writer = Arc::new(tokio::sync::Mutex::new(Writer {
        half: write,
        key: keys.send,
        seq: 0,
        last: Instant::now(),
        broken: false,
    }));
    let ended = Arc::new(AtomicBool::new(false));
    let (tx, inbox) = mpsc::channel(INBOX);
    let reader = tokio::spawn(read_loop(read, keys.receive, keepalive.idle, tx, Arc::clone(&ended)));
    let pinger = tokio::spawn(ping_loop(Arc::clone(&writer), keepalive.ping, Arc::clone(&ended)));
    Open { writer, inbox, ended, tasks: [reader.abort_handle(), pinger.abort_handle()] }
}

/// Reads every frame as it arrives: pings are dropped, messages queued, the first error queued
/// last (the channel ends with it).
async fn read_loop(
    mut read: tokio::net::tcp::OwnedReadHalf,
    key: FrameKey,
    idle: Duration,
    tx: mpsc::Sender<Result<ControlMsg, MigrationError>>,
    ended: Arc<AtomicBool>,
) {
    let mut seq = 0u64;
    loop {
        let frame = match tokio::time::timeout(idle, read_frame(&mut read, &key, seq)).await {
            Err(_) => Err(MigrationError::Timeout("the peer's keep-alive")),
            Ok(r) => r,
        };
        seq += 1;
        let msg = frame.and_then(|payload| {
            serde_json::from_slice::<ControlMsg>(&payload)
                .map_err(|e| MigrationError::Protocol(format!("not a control message: {e}")))
        });
        match msg {
            Ok(ControlMsg::Ping) => {}
            Ok(msg) => {
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                ended.store(true, Ordering::SeqCst);
                let _ = tx.send(Err(e)).await;
                return;
            }
        }
    }
}

/// Sends a ping whenever nothing was sent for `every`, until the channel ends.
async fn ping_loop(writer: Arc<tokio::sync::Mutex<Writer>>, every: Duration, ended: Arc<AtomicBool>) {
    let ping = match serde_json::to_vec(&ControlMsg::Ping) {
        Ok(p) => p,
        Err(_) => return,
    };
    loop {
        let next = writer.lock().await.last + every;
        tokio::time::sleep_until(next).await;
        if ended.load(Ordering::SeqCst) {
            return;
        }
        let mut w = writer.lock().await;
        if w.last.elapsed() >= every && w.send(&ping).await.is_err() {
            // The next send says so; the reader finds the peer gone.
            return;
        }
    }
}
