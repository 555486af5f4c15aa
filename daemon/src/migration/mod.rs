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

pub use control::Control;
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
}

impl MigrationError {
    pub(crate) fn io(step: &'static str, source: std::io::Error) -> MigrationError {
        MigrationError::Io { step, source }
    }

    /// The API code this error maps to.
    pub fn code(&self) -> Code {
        match self {
            MigrationError::NotConfigured => Code::NotInModel,
            MigrationError::BadSecret => Code::InvalidSpec,
            MigrationError::AlreadyExpected(_) => Code::HardwareInUse,
            MigrationError::ChecksumMismatch { .. } => Code::ChecksumMismatch,
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
    /// A cold move's files.
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
}

/// The migration port.
pub struct Migrations {
    config: MigrationConfig,
    shared: Arc<listener::Shared>,
    /// Bound by [`Migrations::bind`], taken by [`Migrations::serve`].
    bound: Mutex<Option<tokio::net::TcpListener>>,
}

impl Migrations {
    /// From `[migration]`; nothing is bound yet.
    pub fn new(config: &MigrationConfig) -> Migrations {
        Migrations { config: config.clone(), shared: Arc::default(), bound: Mutex::new(None) }
    }

    /// `HOST:PORT` the destination answers in `vm.migrate_in`, or `None` without a port.
    pub fn address(&self) -> Option<String> {
        self.config.advertise.clone()
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
        *bound = Some(bind().map_err(|source| MigrationError::Bind { addr, source })?);
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
