//! One VM's console hub: the daemon's single connection to QEMU's serial socket while clients
//! are attached, fanning the guest's output out to every client and the writer's keystrokes in.
//!
//! QEMU serves one connection on the socket and writes to it without waiting for anyone; when
//! the socket does not take a byte, QEMU's UART waits, and so does the guest. So the hub reads
//! QEMU's output as it comes, always: into the replay [`Ring`] and onto a bounded broadcast
//! channel. A client that falls behind loses the oldest chunks of that channel (and is told how
//! many bytes, [`super::ring::dropped_marker`]); nothing a client does makes the hub wait. Input
//! goes the other way through a small bounded queue, so a guest that does not read its console
//! stalls only the writer that types.
//!
//! Order of use: [`Hub::connect`] (by [`super::Consoles`]) connects and seeds the replay from
//! the serial log's tail, then [`Hub::join`] per client gives an [`Attachment`]; the writer's
//! input goes through [`Member::send_input`]; dropping the last attachment, or QEMU closing the
//! socket (the VM stopped), ends the hub and closes the connection.

use super::ring::{Ring, REPLAY_BYTES};
use crate::api::{ApiError, Code};
use crate::rpc::limits::MAX_CONSOLE_CLIENTS_PER_VM;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{broadcast, mpsc, oneshot, watch};

/// Chunks of output held for clients that have not taken them yet (shared by all of a VM's
/// clients): at most this many reads of [`READ_CHUNK`] bytes.
const OUTPUT_CHUNKS: usize = 64;

/// Largest read from QEMU.
const READ_CHUNK: usize = 4096;

/// Chunks of the writer's input waiting for QEMU to take them.
const INPUT_CHUNKS: usize = 16;

/// A piece of the guest's output and its offset.
#[derive(Debug, Clone)]
pub struct Chunk {
    /// Offset of its first byte ([`Ring::push`]).
    pub start: u64,
    /// The bytes.
    pub bytes: Arc<[u8]>,
}

/// Who is attached: from the socket's peer credentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its uid.
    pub uid: u32,
    /// Its pid (0 when unknown).
    pub pid: i32,
}

/// How a client attaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Only watches; `limited` for read-only peers, who together may hold at most
    /// [`MAX_CONSOLE_CLIENTS_PER_VM`] of a VM's console (admins are not counted, so read-only
    /// peers can never keep them out).
    Watch {
        /// Counted against [`MAX_CONSOLE_CLIENTS_PER_VM`].
        limited: bool,
    },
    /// Types too; `force` takes over from the current writer.
    Write {
        /// Take over from a current writer instead of being refused.
        force: bool,
    },
}

/// The current writer.
#[derive(Debug)]
struct Writer {
    id: u64,
    peer: Peer,
    /// Tells the writer's session it was taken over (with the text to show it).
    kick: Option<oneshot::Sender<String>>,
}

/// What the hub's tasks and its clients share.
#[derive(Debug)]
struct State {
    ring: Ring,
    /// `None` once the hub ended: no new client may join it.
    output: Option<broadcast::Sender<Chunk>>,
    clients: usize,
    /// Read-only peers' clients among them.
    limited: usize,
    next_id: u64,
    writer: Option<Writer>,
}

/// One VM's console hub.
#[derive(Debug)]
pub struct Hub {
    name: String,
    state: Mutex<State>,
    input: mpsc::Sender<Vec<u8>>,
    stop: watch::Sender<bool>,
}

/// One attached client: what it replays first, where its output comes from, and whether it
/// was taken over.
#[derive(Debug)]
pub struct Attachment {
    /// Earlier output (at most [`REPLAY_BYTES`]), to send before anything else.
    pub replay: Vec<u8>,
    /// Offset of the first byte after the replay.
    pub next: u64,
    /// The live output.
    pub output: broadcast::Receiver<Chunk>,
    /// Fires (with the text to show) when a `force` writer takes over; writers only.
    pub kicked: Option<oneshot::Receiver<String>>,
    /// The client's place in the hub; leaving it (drop) detaches.
    pub member: Member,
}

/// A client's place in its hub; dropping it detaches the client.
#[derive(Debug)]
pub struct Member {
    hub: Arc<Hub>,
    id: u64,
    /// Whether this client may type.
    pub writer: bool,
    /// Whether it counts against [`MAX_CONSOLE_CLIENTS_PER_VM`].
    limited: bool,
}

impl Hub {
    /// Connects to QEMU's serial socket `socket`, seeds the replay with the tail of the serial
    /// log `log` (a few bytes the guest printed at the moment of connecting may show twice in
    /// the replay, never in the log: docs/console.md), and starts reading.
    ///
    /// # Errors
    /// The error of connecting to the socket (`NotFound`: no such socket, the VM is not
    /// running or was started without one).
    pub async fn connect(name: &str, socket: &Path, log: &Path) -> io::Result<Arc<Hub>> {
        let stream = UnixStream::connect(socket).await?;
        let log = log.to_path_buf();
        let tail = tokio::task::spawn_blocking(move || log_tail(&log, REPLAY_BYTES)).await.unwrap_or_default();
        let mut ring = Ring::new(REPLAY_BYTES);
        ring.seed(&tail);
        let (output, _) = broadcast::channel(OUTPUT_CHUNKS);
        let (input, input_rx) = mpsc::channel(INPUT_CHUNKS);
        let (stop, _) = watch::channel(false);
        let hub = Arc::new(Hub {
            name: name.to_string(),
            state: Mutex::new(State { ring, output: Some(output), clients: 0, limited: 0, next_id: 1, writer: None }),
            input,
            stop,
        });
        let (rd, wr) = stream.into_split();
        tokio::spawn(Arc::clone(&hub).read_loop(rd));
        tokio::spawn(write_loop(wr, input_rx, hub.stop.subscribe()));
        tracing::debug!(vm = name, "console hub connected");
        Ok(hub)
    }

    /// False once the hub ended (its VM stopped, or its last client left).
    pub fn alive(&self) -> bool {
        self.lock().output.is_some()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent, so a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Attaches a client.
    ///
    /// # Errors
    /// 4090 when another client writes and `force` is not set (`details.writer`: its uid and
    /// pid); 1003 for a read-only peer over [`MAX_CONSOLE_CLIENTS_PER_VM`]; 4091 when the hub
    /// has just ended.
    pub fn join(self: &Arc<Self>, mode: Mode, peer: Peer) -> Result<Attachment, ApiError> {
        let mut st = self.lock();
        let Some(output) = &st.output else {
            return Err(ApiError::new(Code::ConsoleUnavailable, format!("the console of {} just closed", self.name))
                .field("name"));
        };
        let output = output.subscribe();
        let limited = mode == Mode::Watch { limited: true };
        if limited && st.limited >= MAX_CONSOLE_CLIENTS_PER_VM {
            return Err(ApiError::new(
                Code::LimitExceeded,
                format!("too many read-only console clients of {}: at most {MAX_CONSOLE_CLIENTS_PER_VM}", self.name),
            )
            .field("name")
            .details(serde_json::json!({"limit": "console_clients_per_vm", "max": MAX_CONSOLE_CLIENTS_PER_VM})));
        }
        let id = st.next_id;
        let mut kicked = None;
        if let Mode::Write { force } = mode {
            if let Some(current) = &mut st.writer {
                if !force {
                    return Err(ApiError::new(
                        Code::Busy,
                        format!(
                            "the console of {} has a writer (uid {}, pid {}); attach read-only, or take it over with force",
                            self.name, current.peer.uid, current.peer.pid
                        ),
                    )
                    .field("name")
                    .details(serde_json::json!({"writer": {"uid": current.peer.uid, "pid": current.peer.pid}})));
                }
                if let Some(kick) = current.kick.take() {
                    let _ = kick.send(format!(
                        "\r\n[vmhost: console taken over by uid {} (pid {}); detached]\r\n",
                        peer.uid, peer.pid
                    ));
                }
                tracing::info!(vm = %self.name, from_uid = current.peer.uid, to_uid = peer.uid, "console writer taken over");
            }
            let (tx, rx) = oneshot::channel();
            st.writer = Some(Writer { id, peer, kick: Some(tx) });
            kicked = Some(rx);
        }
        st.next_id += 1;
        st.clients += 1;
        st.limited += usize::from(limited);
        let (replay, next) = st.ring.snapshot();
        let writer = kicked.is_some();
        Ok(Attachment { replay, next, output, kicked, member: Member { hub: Arc::clone(self), id, writer, limited } })
    }

    /// Detaches client `id` (`limited`: a read-only peer's); the last one ends the hub.
    fn leave(&self, id: u64, limited: bool) {
        let mut st = self.lock();
        st.clients = st.clients.saturating_sub(1);
        st.limited = st.limited.saturating_sub(usize::from(limited));
        if st.writer.as_ref().is_some_and(|w| w.id == id) {
            st.writer = None;
        }
        if st.clients == 0 {
            st.output = None;
            self.stop.send_replace(true);
            tracing::debug!(vm = %self.name, "last console client left; disconnecting");
        }
    }

    /// Reads QEMU's output until EOF, an error or the hub's end; every read goes to the ring
    /// and to the clients, never waiting for one.
    async fn read_loop(self: Arc<Self>, mut rd: tokio::net::unix::OwnedReadHalf) {
        let mut stop = self.stop.subscribe();
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            let n = tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => break,
                read = rd.read(&mut buf) => match read {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                },
            };
            let mut st = self.lock();
            let start = st.ring.push(&buf[..n]);
            if let Some(output) = &st.output {
                // No receiver is not an error: the chunk is in the ring.
                let _ = output.send(Chunk { start, bytes: Arc::from(&buf[..n]) });
            }
        }
        // Closing the channel ends every client's session (the VM stopped, or none is left).
        self.lock().output = None;
        self.stop.send_replace(true);
        tracing::debug!(vm = %self.name, "console hub ended");
    }
}

/// Writes the writer's input to QEMU until the hub ends.
async fn write_loop(
    mut wr: tokio::net::unix::OwnedWriteHalf,
    mut input: mpsc::Receiver<Vec<u8>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let bytes = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            bytes = input.recv() => match bytes {
                Some(bytes) => bytes,
                None => break,
            },
        };
        let written = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            written = wr.write_all(&bytes) => written,
        };
        if written.is_err() {
            break;
        }
    }
}

impl Member {
    /// Queues keystrokes for the guest, waiting while the queue is full (the guest is not
    /// reading). False when they were dropped: this client is no longer the writer (taken
    /// over, or it never was), or the hub ended.
    pub async fn send_input(&self, bytes: Vec<u8>) -> bool {
        let current = self.writer && self.hub.lock().writer.as_ref().is_some_and(|w| w.id == self.id);
        current && self.hub.input.send(bytes).await.is_ok()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.hub.leave(self.id, self.limited);
    }
}

/// The last `max` bytes of the file at `path` (empty when it cannot be read: the replay is a
/// convenience, the log stays the record). Not following a symlink, as the log capping does not.
fn log_tail(path: &Path, max: usize) -> Vec<u8> {
    let read = || -> io::Result<Vec<u8>> {
        let mut f =
            std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)?;
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(max as u64)))?;
        let mut out = Vec::with_capacity(max);
        f.take(max as u64).read_to_end(&mut out)?;
        Ok(out)
    };
    read().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for QEMU's serial socket: one accepted connection.
    async fn qemu(dir: &Path) -> (std::path::PathBuf, tokio::net::UnixListener) {
        let path = dir.join("con");
        (path.clone(), tokio::net::UnixListener::bind(&path).unwrap())
    }

    #[tokio::test]
    async fn one_writer_force_takes_over_and_watchers_never_type() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("vm.serial.log");
        std::fs::write(&log, b"earlier output\n").unwrap();
        let (path, listener) = qemu(d.path()).await;
        let hub = Hub::connect("vm", &path, &log).await.unwrap();
        let (mut guest, _) = listener.accept().await.unwrap();
        let me = Peer { uid: 0, pid: 1 };
        let mut first = hub.join(Mode::Write { force: false }, me).unwrap();
        assert_eq!(first.replay, b"earlier output\n", "replay starts from the log's tail");
        let err = hub.join(Mode::Write { force: false }, Peer { uid: 7, pid: 2 }).unwrap_err();
        assert_eq!((err.code, err.details["writer"]["pid"].as_i64()), (Code::Busy, Some(1)));
        let watcher = hub.join(Mode::Watch { limited: true }, Peer { uid: 65534, pid: 3 }).unwrap();
        assert!(!watcher.member.send_input(b"never".to_vec()).await);
        assert!(first.member.send_input(b"typed".to_vec()).await);
        let mut got = [0u8; 5];
        guest.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"typed");
        // A forced writer takes over: the first is told, and its keystrokes are dropped.
        let second = hub.join(Mode::Write { force: true }, Peer { uid: 0, pid: 4 }).unwrap();
        let told = first.kicked.take().unwrap().await.unwrap();
        assert!(told.contains("taken over by uid 0 (pid 4)"), "{told}");
        assert!(!first.member.send_input(b"late".to_vec()).await);
        assert!(second.member.send_input(b"mine".to_vec()).await);
        let mut got = [0u8; 4];
        guest.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"mine");
        // Output reaches every client with its offset; the ring serves the next one.
        let mut live = watcher.output.resubscribe();
        guest.write_all(b"hello").await.unwrap();
        let chunk = live.recv().await.unwrap();
        assert_eq!((&*chunk.bytes, chunk.start), (&b"hello"[..], 15));
        let late = hub.join(Mode::Watch { limited: false }, me).unwrap();
        assert_eq!(late.replay, b"earlier output\nhello");
        assert_eq!(late.next, 20);
        // The last client leaving ends the hub and closes QEMU's connection.
        drop((first, second, watcher, late, live));
        assert!(!hub.alive());
        let mut rest = Vec::new();
        guest.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "no keystroke of a watcher or a replaced writer: {rest:?}");
    }

    #[tokio::test]
    async fn read_only_peers_cannot_take_every_place() {
        let d = tempfile::tempdir().unwrap();
        let (path, listener) = qemu(d.path()).await;
        let hub = Hub::connect("vm", &path, &d.path().join("none.log")).await.unwrap();
        let _guest = listener.accept().await.unwrap();
        let ro = Peer { uid: 65534, pid: 9 };
        let mut held: Vec<_> =
            (0..MAX_CONSOLE_CLIENTS_PER_VM).map(|_| hub.join(Mode::Watch { limited: true }, ro).unwrap()).collect();
        let err = hub.join(Mode::Watch { limited: true }, ro).unwrap_err();
        assert_eq!((err.code, err.details["limit"].as_str()), (Code::LimitExceeded, Some("console_clients_per_vm")));
        // Admins are not counted: they watch and write.
        let admin = Peer { uid: 0, pid: 1 };
        let _watch = hub.join(Mode::Watch { limited: false }, admin).unwrap();
        let _write = hub.join(Mode::Write { force: false }, admin).unwrap();
        // A place given back is free again.
        held.pop();
        let _again = hub.join(Mode::Watch { limited: true }, ro).unwrap();
    }

    #[tokio::test]
    async fn a_client_that_never_reads_does_not_hold_the_output() {
        let d = tempfile::tempdir().unwrap();
        let (path, listener) = qemu(d.path()).await;
        let hub = Hub::connect("vm", &path, &d.path().join("none.log")).await.unwrap();
        let (mut guest, _) = listener.accept().await.unwrap();
        let stuck = hub.join(Mode::Watch { limited: false }, Peer { uid: 0, pid: 1 }).unwrap();
        let mut reader = hub.join(Mode::Watch { limited: false }, Peer { uid: 0, pid: 2 }).unwrap();
        assert!(stuck.replay.is_empty());
        // Far more than the channel holds: the guest side never waits.
        let block = vec![b'x'; READ_CHUNK];
        let total = READ_CHUNK * OUTPUT_CHUNKS * 4;
        let mut seen = 0u64;
        let mut lost = 0u64;
        let writer = tokio::spawn(async move {
            for _ in 0..total / READ_CHUNK {
                guest.write_all(&block).await.unwrap();
            }
            guest
        });
        while seen + lost < total as u64 {
            match reader.output.recv().await {
                Ok(c) => {
                    lost += super::super::ring::dropped(seen + lost, c.start);
                    seen += c.bytes.len() as u64;
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("{e}"),
            }
        }
        let _guest = writer.await.unwrap();
        assert_eq!(seen + lost, total as u64);
        drop(stuck);
    }
}
