//! The migration port: the one TCP port through which vmhostds send each other VMs
//! (docs/moving.md). Owner of every migration stream on this host.
//!
//! SKELETON (issue 32): the types and signatures the lifecycle uses; the transport helper
//! fills the bodies. Order of use:
//!
//! 1. [`Migrations::new`] at daemon start from `[migration]`; [`Migrations::serve`] after
//!    recovery (the listener answers [`ControlMsg::Query`] from records via [`Outcomes`]);
//! 2. destination: [`Migrations::expect`] for a VM being received, then its [`Expectation`]
//!    yields each authenticated [`IncomingChannel`]; dropping it stops expecting;
//! 3. source: [`connect`] one stream per channel; [`Control`] frames the control channel.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

/// Why a migration stream could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The port is not configured (`[migration] listen`).
    #[error("this vmhostd has no migration port ([migration] listen is not set)")]
    NotConfigured,
    /// Not built yet (skeleton).
    #[error("not built yet: {0}")]
    NotBuilt(&'static str),
}

/// A one-time migration secret: 32 random bytes, written as 64 hex digits.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; 32]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A new random secret.
    ///
    /// # Errors
    /// When the kernel's random source fails.
    pub fn generate() -> Result<Secret, MigrationError> {
        Err(MigrationError::NotBuilt("Secret::generate"))
    }
    /// Parses 64 hex digits.
    ///
    /// # Errors
    /// When `hex` is not 64 hex digits.
    pub fn parse(_hex: &str) -> Result<Secret, MigrationError> {
        Err(MigrationError::NotBuilt("Secret::parse"))
    }
    /// The 64 hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
    /// The key QEMU's TLS uses (hex), derived from the secret so QEMU never holds the secret.
    pub fn tls_psk_hex(&self) -> String {
        String::new()
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
    _private: (),
}

impl Migrations {
    /// From `[migration]` (skeleton: no port).
    pub fn new() -> Migrations {
        Migrations { _private: () }
    }
    /// `HOST:PORT` the destination answers in `vm.migrate_in`, or `None` without a port.
    pub fn address(&self) -> Option<String> {
        None
    }
    /// Accepts streams until the daemon ends.
    ///
    /// # Errors
    /// When the port cannot be bound.
    pub async fn serve(&self, _outcomes: Arc<dyn Outcomes>) -> Result<(), MigrationError> {
        Err(MigrationError::NotConfigured)
    }
    /// Destination: expect VM `vm`'s streams, authenticated by `secret`.
    ///
    /// # Errors
    /// [`MigrationError::NotConfigured`] without a port.
    pub fn expect(&self, _vm: &str, _secret: &Secret) -> Result<Expectation, MigrationError> {
        Err(MigrationError::NotConfigured)
    }
}

impl Default for Migrations {
    fn default() -> Self {
        Self::new()
    }
}

/// The streams of one expected incoming migration; dropped, the VM is no longer expected.
pub struct Expectation {
    _private: (),
}

impl Expectation {
    /// The next authenticated stream, or `None` when `timeout` passes first.
    pub async fn next(&mut self, _timeout: Duration) -> Option<IncomingChannel> {
        None
    }
}

/// Source: opens a stream of `kind` for VM `vm` to `address`, authenticated with `secret`.
///
/// # Errors
/// When the destination cannot be reached or refuses the proof.
pub async fn connect(
    _address: &str,
    _vm: &str,
    _secret: &Secret,
    _kind: &ChannelKind,
) -> Result<TcpStream, MigrationError> {
    Err(MigrationError::NotBuilt("connect"))
}

/// The control channel, framed and authenticated message by message.
pub struct Control {
    _private: (),
}

impl Control {
    /// Over a connected control stream.
    pub fn new(_stream: TcpStream, _secret: &Secret) -> Control {
        Control { _private: () }
    }
    /// Sends one message.
    ///
    /// # Errors
    /// When the stream fails.
    pub async fn send(&mut self, _msg: &ControlMsg) -> Result<(), MigrationError> {
        Err(MigrationError::NotBuilt("Control::send"))
    }
    /// The next message, waiting at most `timeout`.
    ///
    /// # Errors
    /// When the stream fails or closes, a message is not authentic, or `timeout` passes.
    pub async fn recv(&mut self, _timeout: Duration) -> Result<ControlMsg, MigrationError> {
        Err(MigrationError::NotBuilt("Control::recv"))
    }
}
