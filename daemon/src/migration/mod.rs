//! The migration port: the one TCP port through which vmhostds send each other VMs
//! (docs/moving.md). Owner of every migration stream on this host.
//!
//! Order of use:
//!
//! 1. [`Migrations::new`] at daemon start from `[migration]`, [`Migrations::bind`] right after
//!    (a port that cannot be bound stops the start), [`Migrations::serve`] after recovery (the
//!    listener answers [`ControlMsg::Query`] from records via [`Outcomes`]);
//! 2. destination: [`Migrations::expect`] for a VM being received, then its [`Expectation`]
//!    yields each authenticated [`IncomingChannel`]; dropping it stops expecting; `disk:X`
//!    streams go to QEMU through [`relay()`], a cold move's through [`files`];
//! 3. source: [`connect`] one stream per channel; [`Control`] frames the control channel,
//!    [`files::FileSender`] the files channel.
//!
//! The wire itself (pure) is [`wire`]; the secret and its derived keys [`secret`].

mod control;
pub mod files;
mod listener;
pub mod relay;
pub mod secret;
pub mod wire;

pub use control::{Control, KeepAlive, IDLE_TIMEOUT, PING_INTERVAL};
pub use listener::Expectation;
pub use relay::{relay, Relayed};
pub use secret::Secret;

use crate::api::{ApiError, Code};
use crate::config::MigrationConfig;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long a source waits to connect and for the destination's opening exchange.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a migration stream could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The port is not configured (`[migration] listen`).
    #[error("this vmhostd has no migration port ([migration] listen is not set)")]
    NotConfigured,
    /// The port could not be bound.
    #[error("cannot listen on the migration port {addr}: {source}")]
    Bind {
        /// `[migration] listen`.
        addr: std::net::SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
    /// A socket or file operation failed.
    #[error("{step}: {source}")]
    Io {
        /// What was being done.
        step: &'static str,
        /// OS error.
        source: std::io::Error,
    },
    /// The peer did not answer in time.
    #[error("{0}: timed out")]
    Timeout(&'static str),
    /// The destination refused the stream (wrong secret, unknown VM, or a second channel).
    #[error("the destination refused the stream (wrong secret, VM not expected there, or a channel already open)")]
    Refused,
    /// The peer's bytes are not the wire.
    #[error("{0}")]
    Wire(wire::WireError),
    /// The peer broke the protocol otherwise (not a migration port, an unexpected message).
    #[error("protocol: {0}")]
    Protocol(String),
    /// The stream closed (or an earlier failure ended the channel).
    #[error("the stream closed")]
    Closed,
    /// A secret is not 64 hex digits.
    #[error("the secret is not 64 hex digits")]
    BadSecret,
    /// The kernel's random source failed.
    #[error("random source: {0}")]
    Random(String),
    /// This VM is already expected (a second `vm.migrate_in` of the same name).
    #[error("VM {0} is already being received")]
    AlreadyExpected(String),
    /// A received file does not have the sha256 its header announced (it was removed).
    #[error("file {name}: sha256 {found} of {bytes} bytes, expected {expected}")]
    ChecksumMismatch {
        /// The file's name on the wire.
        name: String,
        /// The announced sha256.
        expected: String,
        /// What arrived.
        found: String,
        /// Its length.
        bytes: u64,
    },
    /// A frame of the `files` channel is not authentic (changed on the way, or not from the
    /// source): the file being received was removed.
    #[error("file {name}: {reason}: its bytes were changed on the way")]
    FileNotAuthentic {
        /// The file's name on the wire (`files channel` between two files).
        name: String,
        /// What the framing found.
        reason: String,
    },
}

impl MigrationError {
    /// A framing error of the `files` channel as the file's: bytes changed on the way are a
    /// file that did not arrive as sent (2003), as a wrong sha256 is.
    pub(crate) fn of_file(self, name: &str) -> MigrationError {
        match self {
            MigrationError::Wire(w) => {
                MigrationError::FileNotAuthentic { name: name.to_string(), reason: w.to_string() }
            }
            e => e,
        }
    }

    pub(crate) fn io(step: &'static str, source: std::io::Error) -> MigrationError {
        MigrationError::Io { step, source }
    }

    /// The API code this error maps to.
    pub fn code(&self) -> Code {
        match self {
            MigrationError::NotConfigured => Code::NotInModel,
            MigrationError::BadSecret => Code::InvalidSpec,
            MigrationError::AlreadyExpected(_) => Code::HardwareInUse,
            MigrationError::ChecksumMismatch { .. } | MigrationError::FileNotAuthentic { .. } => Code::ChecksumMismatch,
            _ => Code::ProvisioningFailed,
        }
    }
}

impl From<MigrationError> for ApiError {
    fn from(e: MigrationError) -> ApiError {
        let code = e.code();
        let err = ApiError::new(code, e.to_string());
        match e {
            MigrationError::NotConfigured => {
                ApiError::new(code, "this host has no migration port").field("migration.listen")
            }
            MigrationError::BadSecret => err.field("secret"),
            MigrationError::ChecksumMismatch { expected, found, bytes, .. } => {
                err.details(serde_json::json!({"expected": expected, "found": found, "bytes": bytes}))
            }
            MigrationError::FileNotAuthentic { name, .. } => {
                err.details(serde_json::json!({"file": name, "reason": "not_authentic"}))
            }
            _ => err,
        }
    }
}

/// What a stream of a migration carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelKind {
    /// The daemons' control messages ([`Control`]).
    Control,
    /// One disk's NBD stream (the export name).
    Disk(String),
    /// QEMU's memory stream.
    Ram,
    /// Files: a cold move's disks and snapshots, a live migration's snapshots.
    Files,
}

/// An authenticated stream a source opened to this host.
#[derive(Debug)]
pub struct IncomingChannel {
    /// What it carries.
    pub kind: ChannelKind,
    /// The connected socket (blocking mode; convert as needed).
    pub stream: TcpStream,
}

/// Control messages between the two daemons of one migration.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum ControlMsg {
    /// Source to destination, first: what the destination needs to launch an identical QEMU.
    Hello(Box<Hello>),
    /// Destination: QEMU is waiting; these exports take the disks.
    Ready {
        /// NBD export names, one per disk, in `Hello::disks` order.
        exports: Vec<String>,
    },
    /// Source: the memory stream completed; commit.
    Commit,
    /// Destination: committed, the guest runs here.
    Committed,
    /// Either side: give up (code and message say why).
    Abort {
        /// Stable API code.
        code: i32,
        /// Why.
        message: String,
    },
    /// Source after a restart: what became of the migration?
    Query,
    /// The answer to [`ControlMsg::Query`].
    Outcome {
        /// The destination's answer.
        outcome: Outcome,
    },
    /// Source to destination, right after every [`ControlMsg::Hello`]: every file the `files`
    /// channel will carry (a cold move's disks, then each snapshot's files; a live
    /// migration's snapshots only, maybe none), so the destination
    /// checks each against its spec and admits the space before a byte is written.
    Announce {
        /// The files, in the order they are sent.
        files: Vec<AnnouncedFile>,
    },
    /// Either side, whenever it sent nothing for a while: the channel is alive (consumed by
    /// [`Control`], never returned by [`Control::recv`]).
    Ping,
}

/// One file in [`ControlMsg::Announce`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnnouncedFile {
    /// Its wire name (`boot`, `data:NAME`, `uefi-vars`, `snapshot:SNAPSHOT/FILE`).
    pub name: String,
    /// Its length in bytes (its header on the `files` channel must say the same).
    pub bytes: u64,
    /// The bytes it occupies on the source (its allocated blocks): what the destination
    /// reserves, since the receiver leaves runs of zeros sparse as the source has them.
    pub allocated: u64,
}

/// What the source tells the destination first ([`ControlMsg::Hello`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Hello {
    /// The spec the source's QEMU runs (its running spec): must equal the destination's.
    pub spec: crate::api::VmSpec,
    /// The source record's cloud-init instance id (the destination's seed carries the same).
    pub instance_id: Option<String>,
    /// Each NIC's MAC, in spec order.
    pub macs: Vec<String>,
    /// Each disk to mirror: QEMU's device name on the source, its size in bytes, its format.
    pub disks: Vec<HelloDisk>,
    /// The machine the source's QEMU runs (a live migration's only; a cold move starts QEMU
    /// afresh). Absent, the destination cannot compare and says so in its log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<MachineFacts>,
}

/// What a running guest depends on that the destination's QEMU must give it too
/// ([`Hello::machine`]; compared by `lifecycle::migrate::machine::check`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineFacts {
    /// The machine type QEMU resolved `-machine` to (`pc-q35-7.2` for `q35`): the devices'
    /// layout and migration format.
    pub machine: String,
    /// `kvm` or `tcg`.
    pub accel: String,
    /// `-cpu`'s model (`host`, a named model), empty for QEMU's default.
    pub cpu: String,
    /// Under KVM: the CPU features QEMU enables for that model on this host, sorted; the guest
    /// saw them at boot and may use any of them at any time.
    pub cpu_features: Vec<String>,
}

/// One disk in [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HelloDisk {
    /// `virtio0` (the boot disk) or `data-NAME`.
    pub device: String,
    /// Virtual size in bytes (the destination makes its disk exactly this size).
    pub bytes: u64,
    /// `qcow2` or `raw`.
    pub format: String,
}

/// What became of a migration, as the destination answers a [`ControlMsg::Query`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The destination committed: the guest runs there.
    Committed,
    /// The destination gave it up (or never had it): the guest must run on the source.
    Abandoned,
    /// Still in progress on the destination.
    Pending,
}

/// Answers [`ControlMsg::Query`] from the records (implemented by the lifecycle).
pub trait Outcomes: Send + Sync {
    /// The secret and outcome of VM `vm`'s last incoming migration, if this host knows it.
    fn outcome(&self, vm: &str) -> Option<(Secret, Outcome)>;

    /// Every migration of VM `vm` this host can still answer for (the record's, then those it
    /// gave up, newest first): a source's query is answered by the one whose secret it proves.
    fn outcomes(&self, vm: &str) -> Vec<(Secret, Outcome)> {
        self.outcome(vm).into_iter().collect()
    }
}

/// The migration port.
pub struct Migrations {
    config: MigrationConfig,
    shared: Arc<listener::Shared>,
    /// Bound by [`Migrations::bind`], taken by [`Migrations::serve`].
    bound: Mutex<Option<tokio::net::TcpListener>>,
    /// The address bound (the kernel's port when `listen` says 0, as tests do).
    local: Mutex<Option<std::net::SocketAddr>>,
}

impl Migrations {
    /// From `[migration]`; nothing is bound yet.
    pub fn new(config: &MigrationConfig) -> Migrations {
        Migrations { config: config.clone(), shared: Arc::default(), bound: Mutex::new(None), local: Mutex::new(None) }
    }

    /// `HOST:PORT` the destination answers in `vm.migrate_in`, or `None` without a port.
    pub fn address(&self) -> Option<String> {
        self.config.advertise.clone()
    }

    /// The address the port is bound to, once [`Migrations::bind`] did.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        *self.local.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long a destination waits for the source's first stream (`prepare_timeout_s`).
    pub fn prepare_timeout(&self) -> Duration {
        Duration::from_secs(self.config.prepare_timeout_s)
    }

    /// Binds the port (call at start, so a port in use stops the daemon); without a port it
    /// does nothing. Needs a tokio runtime.
    ///
    /// # Errors
    /// [`MigrationError::Bind`] when the port cannot be bound.
    pub fn bind(&self) -> Result<(), MigrationError> {
        let Some(addr) = self.config.listen else { return Ok(()) };
        let mut bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
        if bound.is_some() {
            return Ok(());
        }
        let bind = || -> std::io::Result<tokio::net::TcpListener> {
            let socket =
                if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
            // A restarted daemon rebinds while its predecessor's streams are in TIME_WAIT.
            socket.set_reuseaddr(true)?;
            socket.bind(addr)?;
            socket.listen(128)
        };
        let listener = bind().map_err(|source| MigrationError::Bind { addr, source })?;
        *self.local.lock().unwrap_or_else(|e| e.into_inner()) = listener.local_addr().ok();
        *bound = Some(listener);
        tracing::info!(listen = %addr, advertise = self.config.advertise.as_deref().unwrap_or(""), "migration port listening");
        Ok(())
    }

    /// Accepts streams until the daemon ends (binds first unless [`Migrations::bind`] did).
    ///
    /// # Errors
    /// [`MigrationError::NotConfigured`] without a port; [`MigrationError::Bind`] when the port
    /// cannot be bound.
    pub async fn serve(&self, outcomes: Arc<dyn Outcomes>) -> Result<(), MigrationError> {
        if self.config.listen.is_none() {
            return Err(MigrationError::NotConfigured);
        }
        self.bind()?;
        let listener = self.bound.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(listener) = listener else {
            return Err(MigrationError::Protocol("the migration port is already served".into()));
        };
        listener::serve(listener, Arc::clone(&self.shared), outcomes).await;
        Ok(())
    }

    /// Destination: expect VM `vm`'s streams, authenticated by `secret`.
    ///
    /// # Errors
    /// [`MigrationError::NotConfigured`] without a port; [`MigrationError::AlreadyExpected`]
    /// when `vm` is already expected.
    pub fn expect(&self, vm: &str, secret: &Secret) -> Result<Expectation, MigrationError> {
        if self.config.listen.is_none() {
            return Err(MigrationError::NotConfigured);
        }
        self.shared.expect(vm, secret)
    }
}

impl Default for Migrations {
    fn default() -> Self {
        Self::new(&MigrationConfig::default())
    }
}

/// Source: opens a stream of `kind` for VM `vm` to `address` (`HOST:PORT`), authenticated
/// with `secret`. The stream is in blocking mode.
///
/// # Errors
/// When the destination cannot be reached, does not speak the wire, or refuses the proof
/// ([`MigrationError::Refused`]).
pub async fn connect(
    address: &str,
    vm: &str,
    secret: &Secret,
    kind: &ChannelKind,
) -> Result<TcpStream, MigrationError> {
    let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(address))
        .await
        .map_err(|_| MigrationError::Timeout("connect"))?
        .map_err(|e| MigrationError::io("connect", e))?;
    // Many small writes (frames) follow on the control channel; latency matters more there.
    let _ = stream.set_nodelay(true);
    tokio::time::timeout(CONNECT_TIMEOUT, async {
        let mut greeting = [0u8; wire::GREETING.len() + wire::NONCE_LEN];
        stream.read_exact(&mut greeting).await.map_err(|e| MigrationError::io("opening exchange", e))?;
        if &greeting[..wire::GREETING.len()] != wire::GREETING {
            return Err(MigrationError::Protocol(format!("{address} is not a vmhost migration port")));
        }
        let mut nonce = [0u8; wire::NONCE_LEN];
        nonce.copy_from_slice(&greeting[wire::GREETING.len()..]);
        let line = wire::encode_open(vm, kind, &wire::proof(secret, &nonce, vm, kind));
        stream.write_all(&line).await.map_err(|e| MigrationError::io("opening exchange", e))?;
        // Byte by byte up to `\n`: what follows `ok` belongs to the channel.
        let mut answer = Vec::new();
        let mut byte = [0u8; 1];
        while answer.len() < wire::REFUSED.len() {
            let n = stream.read(&mut byte).await.map_err(|e| MigrationError::io("opening exchange", e))?;
            if n == 0 {
                break;
            }
            answer.push(byte[0]);
            if byte[0] == b'\n' {
                break;
            }
        }
        match answer.as_slice() {
            a if a == wire::OK => Ok(()),
            a if a == wire::REFUSED || a.is_empty() => Err(MigrationError::Refused),
            _ => Err(MigrationError::Protocol("unexpected answer to the proof".into())),
        }
    })
    .await
    .map_err(|_| MigrationError::Timeout("opening exchange"))??;
    listener::into_blocking(stream).map_err(|e| MigrationError::io("connect", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Known(Mutex<Option<(Secret, Outcome)>>);

    impl Outcomes for Known {
        fn outcome(&self, _vm: &str) -> Option<(Secret, Outcome)> {
            self.0.lock().unwrap().clone()
        }
    }

    /// A port on 127.0.0.1 served in the background, with `known` as the records' answer.
    async fn port(known: Option<(Secret, Outcome)>) -> (Arc<Migrations>, String, Arc<Known>) {
        let config = MigrationConfig {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            advertise: Some("unused:1".into()),
            prepare_timeout_s: 1,
        };
        let m = Arc::new(Migrations::new(&config));
        m.bind().unwrap();
        let addr = m.local_addr().unwrap().to_string();
        let outcomes = Arc::new(Known(Mutex::new(known)));
        let (m2, o2) = (Arc::clone(&m), Arc::clone(&outcomes));
        tokio::spawn(async move { m2.serve(o2).await });
        (m, addr, outcomes)
    }

    const T: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn an_expected_vm_gets_each_authenticated_stream_with_its_bytes() {
        let (m, addr, _) = port(None).await;
        let secret = Secret::generate().unwrap();
        let mut exp = m.expect("web-1", &secret).unwrap();
        for kind in [ChannelKind::Control, ChannelKind::Ram, ChannelKind::Disk("virtio0".into()), ChannelKind::Files] {
            let mut client = connect(&addr, "web-1", &secret, &kind).await.unwrap();
            use std::io::Write;
            client.write_all(b"payload").unwrap();
            let ch = exp.next(T).await.unwrap();
            assert_eq!(ch.kind, kind);
            let mut got = [0u8; 7];
            use std::io::Read;
            let mut stream = ch.stream;
            stream.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"payload", "{kind:?}: the bytes after `ok` belong to the channel");
        }
        assert!(exp.next(Duration::from_millis(50)).await.is_none());
    }

    #[tokio::test]
    async fn wrong_proofs_unknown_vms_and_second_channels_are_refused() {
        let (m, addr, _) = port(None).await;
        let secret = Secret::generate().unwrap();
        let mut exp = m.expect("web-1", &secret).unwrap();
        let wrong = Secret::generate().unwrap();
        for kind in [ChannelKind::Control, ChannelKind::Ram, ChannelKind::Disk("virtio0".into())] {
            let e = connect(&addr, "web-1", &wrong, &kind).await.unwrap_err();
            assert!(matches!(e, MigrationError::Refused), "{e}");
            let e = connect(&addr, "web-2", &secret, &kind).await.unwrap_err();
            assert!(matches!(e, MigrationError::Refused), "{e}");
        }
        assert!(exp.next(Duration::from_millis(50)).await.is_none(), "a refused stream was delivered");
        // The refusals did not use up the channels: the right proof still opens each once.
        for kind in [ChannelKind::Control, ChannelKind::Ram] {
            connect(&addr, "web-1", &secret, &kind).await.unwrap();
            let e = connect(&addr, "web-1", &secret, &kind).await.unwrap_err();
            assert!(matches!(e, MigrationError::Refused), "a second {kind:?}: {e}");
        }
        // Disks may be reopened (one per export; a retry is the lifecycle's decision).
        connect(&addr, "web-1", &secret, &ChannelKind::Disk("virtio0".into())).await.unwrap();
        connect(&addr, "web-1", &secret, &ChannelKind::Disk("virtio0".into())).await.unwrap();
        let mut kinds = Vec::new();
        while let Some(ch) = exp.next(Duration::from_millis(200)).await {
            kinds.push(ch.kind);
        }
        assert_eq!(kinds.len(), 4, "{kinds:?}");
    }

    #[tokio::test]
    async fn one_expectation_per_vm_and_dropping_it_unregisters() {
        let (m, addr, _) = port(None).await;
        let secret = Secret::generate().unwrap();
        let exp = m.expect("web-1", &secret).unwrap();
        let e = m.expect("web-1", &secret).err().unwrap();
        assert!(matches!(e, MigrationError::AlreadyExpected(_)));
        assert_eq!(ApiError::from(e).code, Code::HardwareInUse);
        drop(exp);
        let e = connect(&addr, "web-1", &secret, &ChannelKind::Ram).await.unwrap_err();
        assert!(matches!(e, MigrationError::Refused), "{e}");
        let _again = m.expect("web-1", &secret).unwrap();
        connect(&addr, "web-1", &secret, &ChannelKind::Ram).await.unwrap();
    }

    #[tokio::test]
    async fn a_port_in_use_is_a_bind_error() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let config = MigrationConfig {
            listen: Some(taken.local_addr().unwrap()),
            advertise: Some("h:1".into()),
            prepare_timeout_s: 1,
        };
        let e = Migrations::new(&config).bind().unwrap_err();
        assert!(matches!(e, MigrationError::Bind { .. }), "{e}");
    }

    #[tokio::test]
    async fn without_a_port_nothing_is_expected() {
        let m = Migrations::default();
        assert_eq!(m.address(), None);
        let e = m.expect("web-1", &Secret::generate().unwrap()).err().unwrap();
        let api = ApiError::from(e);
        assert_eq!((api.code, api.data().field.as_deref()), (Code::NotInModel, Some("migration.listen")));
        assert!(matches!(m.serve(Arc::new(Known(Mutex::new(None)))).await, Err(MigrationError::NotConfigured)));
    }

    #[tokio::test]
    async fn control_messages_cross_both_ways_in_order() {
        let (m, addr, _) = port(None).await;
        let secret = Secret::generate().unwrap();
        let mut exp = m.expect("web-1", &secret).unwrap();
        let stream = connect(&addr, "web-1", &secret, &ChannelKind::Control).await.unwrap();
        let mut source = Control::new(stream, &secret);
        let mut dest = Control::new(exp.next(T).await.unwrap().stream, &secret);
        let s = tokio::spawn(async move {
            source.send(&ControlMsg::Commit).await.unwrap();
            source.send(&ControlMsg::Abort { code: 4001, message: "x".into() }).await.unwrap();
            let got = source.recv(T).await.unwrap();
            (source, got)
        });
        assert_eq!(dest.recv(T).await.unwrap(), ControlMsg::Commit);
        assert_eq!(dest.recv(T).await.unwrap(), ControlMsg::Abort { code: 4001, message: "x".into() });
        dest.send(&ControlMsg::Ready { exports: vec!["virtio0".into()] }).await.unwrap();
        let (mut source, got) = s.await.unwrap();
        assert_eq!(got, ControlMsg::Ready { exports: vec!["virtio0".into()] });
        drop(dest);
        assert!(matches!(source.recv(T).await, Err(MigrationError::Closed)));
        assert!(matches!(
            tokio::time::timeout(T, source.recv(Duration::from_millis(10))).await.unwrap(),
            Err(MigrationError::Closed)
        ));
    }

    /// A peer that speaks the framing by hand: nonce exchange, then whatever frames it likes
    /// (made with its own keys), then it reads until we close.
    async fn raw_peer(
        secret: Secret,
        frames: impl FnOnce(wire::FrameKeys) -> Vec<Vec<u8>> + Send + 'static,
    ) -> (Control, tokio::task::JoinHandle<()>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (theirs, _) = l.accept().unwrap();
        theirs.set_nonblocking(true).unwrap();
        let mut theirs = tokio::net::TcpStream::from_std(theirs).unwrap();
        let task = tokio::spawn(async move {
            let mine = [0x42u8; 32];
            theirs.write_all(&mine).await.unwrap();
            let mut peer = [0u8; 32];
            theirs.read_exact(&mut peer).await.unwrap();
            for f in frames(wire::frame_keys(&secret, &mine, &peer).unwrap()) {
                let _ = theirs.write_all(&f).await;
            }
            let mut rest = Vec::new();
            let _ = theirs.read_to_end(&mut rest).await;
        });
        (Control::new(ours, &Secret([1; 32])), task)
    }

    fn json(msg: &ControlMsg) -> Vec<u8> {
        serde_json::to_vec(msg).unwrap()
    }

    #[tokio::test]
    async fn frames_out_of_sequence_tampered_or_under_another_key_end_the_channel() {
        let secret = Secret([1; 32]);
        // Sequence 1 first (0 was dropped, or 1 is a replay): refused, and the valid 0 after it too.
        let (mut c, _t) = raw_peer(secret.clone(), move |k| {
            vec![
                wire::seal(&k.send, 1, &json(&ControlMsg::Commit)).unwrap(),
                wire::seal(&k.send, 0, &json(&ControlMsg::Commit)).unwrap(),
            ]
        })
        .await;
        assert!(matches!(c.recv(T).await, Err(MigrationError::Wire(wire::WireError::FrameMac))));
        assert!(matches!(c.recv(T).await, Err(MigrationError::Closed)));
        assert!(c.send(&ControlMsg::Query).await.is_err(), "an ended channel still sent");
        // The same frame twice (a replay at the next position).
        let (mut c, _t) = raw_peer(secret.clone(), move |k| {
            let f = wire::seal(&k.send, 0, &json(&ControlMsg::Commit)).unwrap();
            vec![f.clone(), f]
        })
        .await;
        assert_eq!(c.recv(T).await.unwrap(), ControlMsg::Commit);
        assert!(matches!(c.recv(T).await, Err(MigrationError::Wire(wire::WireError::FrameMac))));
        // Another key (an injector without the secret).
        let (mut c, _t) = raw_peer(secret.clone(), move |_| {
            let k = wire::frame_keys(&Secret([2; 32]), &[0x42; 32], &[0x43; 32]).unwrap();
            vec![wire::seal(&k.send, 0, &json(&ControlMsg::Committed)).unwrap()]
        })
        .await;
        assert!(matches!(c.recv(T).await, Err(MigrationError::Wire(wire::WireError::FrameMac))));
        // Our own direction's frame reflected back (sealed with the key we send with).
        let (mut c, _t) =
            raw_peer(secret.clone(), move |k| vec![wire::seal(&k.receive, 0, &json(&ControlMsg::Commit)).unwrap()])
                .await;
        assert!(matches!(c.recv(T).await, Err(MigrationError::Wire(wire::WireError::FrameMac))));
        // A byte of the ciphertext flipped.
        let (mut c, _t) = raw_peer(secret.clone(), move |k| {
            let mut f = wire::seal(&k.send, 0, &json(&ControlMsg::Commit)).unwrap();
            f[6] ^= 1;
            vec![f]
        })
        .await;
        assert!(matches!(c.recv(T).await, Err(MigrationError::Wire(wire::WireError::FrameMac))));
        // A length beyond the bound is refused before anything is allocated.
        let (mut c, _t) = raw_peer(secret.clone(), |_| vec![u32::MAX.to_be_bytes().to_vec()]).await;
        assert!(matches!(c.recv(T).await, Err(MigrationError::Wire(wire::WireError::FrameLength(_)))));
        // Authentic but not a control message.
        let (mut c, _t) =
            raw_peer(secret.clone(), move |k| vec![wire::seal(&k.send, 0, b"{\"msg\":\"reboot\"}").unwrap()]).await;
        assert!(matches!(c.recv(T).await, Err(MigrationError::Protocol(_))));
        assert!(matches!(c.recv(T).await, Err(MigrationError::Closed)));
        // In sequence and authentic, pings among them: the messages, never a ping.
        let (mut c, _t) = raw_peer(secret.clone(), move |k| {
            vec![
                wire::seal(&k.send, 0, &json(&ControlMsg::Ping)).unwrap(),
                wire::seal(&k.send, 1, &json(&ControlMsg::Commit)).unwrap(),
                wire::seal(&k.send, 2, &json(&ControlMsg::Ping)).unwrap(),
                wire::seal(&k.send, 3, &json(&ControlMsg::Query)).unwrap(),
            ]
        })
        .await;
        assert_eq!(c.recv(T).await.unwrap(), ControlMsg::Commit);
        assert_eq!(c.recv(T).await.unwrap(), ControlMsg::Query);
    }

    const FAST: KeepAlive = KeepAlive { ping: Duration::from_millis(50), idle: Duration::from_millis(400) };

    /// Two connected control channels with `FAST` keep-alives.
    fn fast_pair() -> (Control, Control) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let secret = Secret([3; 32]);
        (Control::with_keepalive(a, &secret, FAST), Control::with_keepalive(b, &secret, FAST))
    }

    #[tokio::test]
    async fn keep_alives_carry_a_channel_through_a_long_silence() {
        let (mut a, mut b) = fast_pair();
        let first = tokio::spawn(async move {
            a.send(&ControlMsg::Query).await.unwrap();
            a
        });
        assert_eq!(b.recv(T).await.unwrap(), ControlMsg::Query);
        let mut a = first.await.unwrap();
        // Five idle timeouts with no message either way, and nobody receiving on `a`: the
        // pings flow from the channels' own tasks.
        let waited = tokio::time::Instant::now();
        assert!(matches!(b.recv(FAST.idle * 5).await, Err(MigrationError::Timeout("receive"))));
        assert!(waited.elapsed() >= FAST.idle * 5);
        a.send(&ControlMsg::Commit).await.unwrap();
        assert_eq!(b.recv(T).await.unwrap(), ControlMsg::Commit, "the channel died in the silence");
        b.send(&ControlMsg::Committed).await.unwrap();
        assert_eq!(a.recv(T).await.unwrap(), ControlMsg::Committed);
    }

    #[tokio::test]
    async fn a_peer_that_stops_answering_is_found_dead_within_the_idle_timeout() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (theirs, _) = l.accept().unwrap();
        // Half-open: the peer completes the nonce exchange, then neither reads nor writes (and
        // never closes: no end of stream to see).
        theirs.set_nonblocking(true).unwrap();
        let mut theirs = tokio::net::TcpStream::from_std(theirs).unwrap();
        let peer = tokio::spawn(async move {
            theirs.write_all(&[0x42; 32]).await.unwrap();
            let mut n = [0u8; 32];
            theirs.read_exact(&mut n).await.unwrap();
            theirs
        });
        let mut c = Control::with_keepalive(ours, &Secret([1; 32]), FAST);
        let started = tokio::time::Instant::now();
        let e = c.recv(T).await.unwrap_err();
        let took = started.elapsed();
        assert!(matches!(e, MigrationError::Timeout(_)), "{e}");
        assert!(took >= FAST.idle && took < FAST.idle * 3, "found dead after {took:?}");
        assert!(matches!(c.recv(T).await, Err(MigrationError::Closed)));
        assert!(c.send(&ControlMsg::Query).await.is_err(), "a dead channel still sent");
        drop(peer.await.unwrap());
    }

    #[test]
    fn the_default_keep_alive_is_five_and_twenty_seconds() {
        assert_eq!(KeepAlive::default(), KeepAlive { ping: PING_INTERVAL, idle: IDLE_TIMEOUT });
        assert_eq!((PING_INTERVAL.as_secs(), IDLE_TIMEOUT.as_secs()), (5, 20));
    }

    #[tokio::test]
    async fn a_peer_echoing_our_nonce_is_refused() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (theirs, _) = l.accept().unwrap();
        theirs.set_nonblocking(true).unwrap();
        let mut theirs = tokio::net::TcpStream::from_std(theirs).unwrap();
        tokio::spawn(async move {
            let mut n = [0u8; 32];
            theirs.read_exact(&mut n).await.unwrap();
            theirs.write_all(&n).await.unwrap();
            let mut rest = Vec::new();
            let _ = theirs.read_to_end(&mut rest).await;
        });
        let mut c = Control::new(ours, &Secret([1; 32]));
        assert!(matches!(c.recv(T).await, Err(MigrationError::Wire(wire::WireError::Reflected))));
    }

    #[tokio::test]
    async fn a_silent_peer_times_out() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_theirs, _) = l.accept().unwrap();
        let mut c = Control::new(ours, &Secret([1; 32]));
        assert!(matches!(c.recv(Duration::from_millis(100)).await, Err(MigrationError::Timeout(_))));
    }

    #[tokio::test]
    async fn the_listener_answers_a_query_for_a_vm_it_no_longer_expects() {
        let secret = Secret::generate().unwrap();
        let (_m, addr, known) = port(Some((secret.clone(), Outcome::Committed))).await;
        let ask = |secret: Secret| {
            let addr = addr.clone();
            async move {
                let stream = connect(&addr, "web-1", &secret, &ChannelKind::Control).await?;
                let mut c = Control::new(stream, &secret);
                c.send(&ControlMsg::Query).await?;
                c.recv(T).await
            }
        };
        assert_eq!(ask(secret.clone()).await.unwrap(), ControlMsg::Outcome { outcome: Outcome::Committed });
        *known.0.lock().unwrap() = Some((secret.clone(), Outcome::Abandoned));
        assert_eq!(ask(secret.clone()).await.unwrap(), ControlMsg::Outcome { outcome: Outcome::Abandoned });
        // Another secret: refused at the proof. Nothing known: refused (the source keeps asking).
        assert!(matches!(ask(Secret::generate().unwrap()).await, Err(MigrationError::Refused)));
        *known.0.lock().unwrap() = None;
        assert!(matches!(ask(secret.clone()).await, Err(MigrationError::Refused)));
        // Only a control channel is answered for an unexpected VM.
        *known.0.lock().unwrap() = Some((secret.clone(), Outcome::Committed));
        assert!(matches!(connect(&addr, "web-1", &secret, &ChannelKind::Ram).await, Err(MigrationError::Refused)));
    }

    #[tokio::test]
    async fn connect_refuses_what_is_not_a_migration_port() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            s.write_all(&[b'x'; 64]).await.unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
        });
        let e = connect(&addr, "web-1", &Secret([1; 32]), &ChannelKind::Ram).await.unwrap_err();
        assert!(matches!(e, MigrationError::Protocol(_)), "{e}");
    }

    #[tokio::test]
    async fn a_garbage_opening_line_is_refused_and_the_port_keeps_serving() {
        let (m, addr, _) = port(None).await;
        let secret = Secret::generate().unwrap();
        let mut exp = m.expect("web-1", &secret).unwrap();
        for junk in [&b"\n"[..], b"{\"vm\":1}\n", &[b'a'; 2000][..]] {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let mut greeting = [0u8; 49];
            s.read_exact(&mut greeting).await.unwrap();
            assert!(greeting.starts_with(wire::GREETING));
            let _ = s.write_all(junk).await;
            let mut answer = Vec::new();
            let _ = s.read_to_end(&mut answer).await;
            assert_ne!(answer, wire::OK);
        }
        connect(&addr, "web-1", &secret, &ChannelKind::Ram).await.unwrap();
        assert_eq!(exp.next(T).await.unwrap().kind, ChannelKind::Ram);
    }
}
