//! The migration port's listener: accepts TCP streams, runs the opening exchange of
//! [`super::wire`] on each (bounded in time and size), and hands each authenticated stream to
//! the [`Expectation`] of its VM; a `control` stream for a VM nobody expects is a source
//! asking what became of a migration, answered here from [`Outcomes`].
//!
//! Order: [`Shared::expect`] registers (destination), [`serve`] accepts, [`handshake`]
//! authenticates each stream and delivers it, [`Expectation::next`] yields it, dropping the
//! [`Expectation`] unregisters.

use super::wire::{self, NONCE_LEN};
use super::{ChannelKind, Control, ControlMsg, IncomingChannel, MigrationError, Outcomes, Secret};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// How long a client has for the whole opening exchange.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Opening exchanges at once: more wait in the kernel's backlog (a flood cannot make the
/// daemon hold unbounded sockets and tasks).
const MAX_HANDSHAKES: usize = 32;
/// How long a querying source has to send its `Query`.
const QUERY_TIMEOUT: Duration = Duration::from_secs(30);
/// Authenticated streams queued for an expectation before the next ones wait.
const QUEUE: usize = 16;

/// The expectations, shared by the listener and the [`Expectation`]s.
#[derive(Default)]
pub(super) struct Shared {
    expected: Mutex<HashMap<String, Slot>>,
    next_id: std::sync::atomic::AtomicU64,
}

struct Slot {
    id: u64,
    secret: Secret,
    tx: mpsc::Sender<IncomingChannel>,
    /// Channels of which only one may be open: `control`, `ram`.
    opened: Vec<ChannelKind>,
}

impl Shared {
    pub(super) fn expect(self: &Arc<Self>, vm: &str, secret: &Secret) -> Result<Expectation, MigrationError> {
        let mut map = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        if map.contains_key(vm) {
            return Err(MigrationError::AlreadyExpected(vm.to_string()));
        }
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(QUEUE);
        map.insert(vm.to_string(), Slot { id, secret: secret.clone(), tx, opened: Vec::new() });
        Ok(Expectation { vm: vm.to_string(), id, rx, shared: Arc::clone(self) })
    }

    fn secret_of(&self, vm: &str) -> Option<Secret> {
        let map = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        map.get(vm).map(|s| s.secret.clone())
    }

    /// Claims `kind` for `vm` (refused when it is a second `control` or `ram`) and gives the
    /// sender to deliver to; `None` when the VM is no longer expected.
    fn claim(&self, vm: &str, kind: &ChannelKind) -> Result<mpsc::Sender<IncomingChannel>, &'static str> {
        let mut map = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = map.get_mut(vm) else { return Err("no longer expected") };
        if matches!(kind, ChannelKind::Control | ChannelKind::Ram) {
            if slot.opened.contains(kind) {
                return Err("a second channel of that kind");
            }
            slot.opened.push(kind.clone());
        }
        Ok(slot.tx.clone())
    }
}

/// The streams of one expected incoming migration; dropped, the VM is no longer expected.
pub struct Expectation {
    vm: String,
    id: u64,
    rx: mpsc::Receiver<IncomingChannel>,
    shared: Arc<Shared>,
}

impl Expectation {
    /// The next authenticated stream, or `None` when `timeout` passes first.
    pub async fn next(&mut self, timeout: Duration) -> Option<IncomingChannel> {
        tokio::time::timeout(timeout, self.rx.recv()).await.ok().flatten()
    }
}

impl Drop for Expectation {
    fn drop(&mut self) {
        let mut map = self.shared.expected.lock().unwrap_or_else(|e| e.into_inner());
        if map.get(&self.vm).is_some_and(|s| s.id == self.id) {
            map.remove(&self.vm);
        }
    }
}

/// Accepts streams on `listener` until the daemon ends.
pub(super) async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>, outcomes: Arc<dyn Outcomes>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    loop {
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else { return };
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning on the error.
                tracing::warn!(error = %e, "migration port: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (shared, outcomes) = (Arc::clone(&shared), Arc::clone(&outcomes));
        tokio::spawn(async move {
            let done = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(stream, peer, &shared, &*outcomes)).await;
            drop(permit);
            match done {
                Err(_) => {
                    tracing::warn!(%peer, reason = "opening exchange timed out", "migration port: refused a stream")
                }
                Ok(Ok(Delivered::Query(vm, secret, stream))) => {
                    answer_query(&vm, &secret, stream, peer, outcomes).await
                }
                Ok(Ok(Delivered::Channel)) => {}
                Ok(Err((vm, reason))) => {
                    tracing::warn!(%peer, vm = vm.as_deref().unwrap_or("?"), reason, "migration port: refused a stream")
                }
            }
        });
    }
}

enum Delivered {
    Channel,
    Query(String, Secret, tokio::net::TcpStream),
}

type Refusal = (Option<String>, String);

/// The opening exchange of one stream; on success it was handed to its expectation (or is a
/// query to answer).
async fn handshake(
    mut stream: tokio::net::TcpStream,
    _peer: SocketAddr,
    shared: &Shared,
    outcomes: &dyn Outcomes,
) -> Result<Delivered, Refusal> {
    let nonce: [u8; NONCE_LEN] = super::secret::random_32().map_err(|e| (None, e.to_string()))?;
    let mut hello = wire::GREETING.to_vec();
    hello.extend_from_slice(&nonce);
    stream.write_all(&hello).await.map_err(|e| (None, format!("write: {e}")))?;
    let line = read_line(&mut stream).await.map_err(|e| (None, e))?;
    let open = match wire::parse_open(&line) {
        Ok(o) => o,
        Err(e) => {
            let _ = stream.write_all(wire::REFUSED).await;
            return Err((None, e.to_string()));
        }
    };
    let vm = Some(open.vm.clone());
    let refuse = |reason: &str| (vm.clone(), reason.to_string());
    // The expected migration's secret first; a control stream proven with the secret of one
    // this host answers for (its record's, or a tombstone's: an earlier migration of the name)
    // is a source's query.
    let expecting = shared.secret_of(&open.vm);
    let (secret, expected) = match expecting {
        Some(s) if wire::verify_proof(&s, &nonce, &open) => (s, true),
        _ if open.channel == ChannelKind::Control => {
            match outcomes.outcomes(&open.vm).into_iter().find(|(s, _)| wire::verify_proof(s, &nonce, &open)) {
                Some((s, _)) => (s, false),
                None => {
                    let _ = stream.write_all(wire::REFUSED).await;
                    return Err(refuse(if expecting.is_some() { "wrong proof" } else { "unknown VM or wrong proof" }));
                }
            }
        }
        Some(_) => {
            let _ = stream.write_all(wire::REFUSED).await;
            return Err(refuse("wrong proof"));
        }
        None => {
            let _ = stream.write_all(wire::REFUSED).await;
            return Err(refuse("unknown VM"));
        }
    };
    if !expected {
        stream.write_all(wire::OK).await.map_err(|e| refuse(&format!("write: {e}")))?;
        return Ok(Delivered::Query(open.vm, secret, stream));
    }
    let tx = match shared.claim(&open.vm, &open.channel) {
        Ok(tx) => tx,
        Err(reason) => {
            let _ = stream.write_all(wire::REFUSED).await;
            return Err(refuse(reason));
        }
    };
    stream.write_all(wire::OK).await.map_err(|e| refuse(&format!("write: {e}")))?;
    let stream = into_blocking(stream).map_err(|e| refuse(&e.to_string()))?;
    tracing::info!(vm = %open.vm, channel = %open.channel.as_wire(), "migration port: accepted a stream");
    tx.send(IncomingChannel { kind: open.channel, stream }).await.map_err(|_| refuse("no longer expected"))?;
    Ok(Delivered::Channel)
}

/// Reads the opening line, at most [`wire::MAX_OPEN_LINE`] bytes, without its `\n`.
async fn read_line<S: AsyncReadExt + Unpin>(stream: &mut S) -> Result<Vec<u8>, String> {
    let mut line = Vec::with_capacity(256);
    let mut byte = [0u8; 1];
    // Byte by byte: nothing after the `\n` may be consumed here (it belongs to the channel).
    loop {
        let n = stream.read(&mut byte).await.map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("closed during the opening exchange".into());
        }
        if byte[0] == b'\n' {
            return Ok(line);
        }
        if line.len() + 1 >= wire::MAX_OPEN_LINE {
            return Err("opening line too long".into());
        }
        line.push(byte[0]);
    }
}

/// Answers a source's `Query` for a VM this host does not expect, with the record's outcome.
async fn answer_query(
    vm: &str,
    secret: &Secret,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    outcomes: Arc<dyn Outcomes>,
) {
    let Ok(stream) = into_blocking(stream) else { return };
    let mut control = Control::new(stream, secret);
    match control.recv(QUERY_TIMEOUT).await {
        Ok(ControlMsg::Query) => {}
        Ok(other) => {
            tracing::warn!(%peer, vm, msg = ?std::mem::discriminant(&other), "migration port: expected a query");
            return;
        }
        Err(e) => {
            tracing::warn!(%peer, vm, error = %e, "migration port: query failed");
            return;
        }
    }
    // Read again: the answer is the record's now, not when the stream opened.
    // Nothing known any more (or another migration's secret): close unanswered, as for an
    // unknown VM; the source keeps asking rather than act on a guess.
    let outcome = match outcomes.outcomes(vm).into_iter().find(|(s, _)| s == secret) {
        Some((_, o)) => o,
        None => return,
    };
    if let Err(e) = control.send(&ControlMsg::Outcome { outcome }).await {
        tracing::warn!(%peer, vm, error = %e, "migration port: cannot answer a query");
    } else {
        tracing::info!(%peer, vm, ?outcome, "migration port: answered a query");
    }
}

/// The std stream in blocking mode, as [`IncomingChannel`] promises.
pub(super) fn into_blocking(stream: tokio::net::TcpStream) -> std::io::Result<std::net::TcpStream> {
    let std = stream.into_std()?;
    std.set_nonblocking(false)?;
    Ok(std)
}
