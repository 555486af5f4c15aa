//! Framed, authenticated messages on a migration stream: the control channel ([`Control`])
//! and the headers of a cold move's files ([`super::files`]).
//!
//! Why a nonce exchange before the first frame: the sequence numbers restart at 0 on every
//! stream, so a frame MAC'd over the secret and the number alone could be replayed from an
//! earlier control channel of the same migration (a recorded `Commit` into a later `Query`
//! channel), or reflected back to its sender. Each side sends 32 fresh random bytes first and
//! every frame's MAC covers both (the sender's first, which also fixes the direction), so a
//! frame is valid on one stream, in one direction, at one position only.
//!
//! Order: [`Framed::new`] over an authenticated stream; the first [`Framed::send`] or
//! [`Framed::recv`] exchanges the nonces; any failure ends the stream for good.

use super::wire::{self, NONCE_LEN};
use super::{ControlMsg, MigrationError, Secret};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one write may take before the stream counts as dead.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// The framing state of one stream.
pub(crate) struct Framed {
    pending: Option<std::net::TcpStream>,
    stream: Option<tokio::net::TcpStream>,
    secret: Secret,
    mine: [u8; NONCE_LEN],
    theirs: Option<[u8; NONCE_LEN]>,
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
            mine: [0; NONCE_LEN],
            theirs: None,
            sent: 0,
            received: 0,
            broken: false,
        }
    }

    /// The tokio stream with the nonces exchanged, within `timeout`.
    async fn ready(&mut self, timeout: Duration) -> Result<&mut tokio::net::TcpStream, MigrationError> {
        if self.broken {
            return Err(MigrationError::Closed);
        }
        if let Some(std) = self.pending.take() {
            std.set_nonblocking(true).map_err(|e| MigrationError::io("stream", e))?;
            self.stream = Some(tokio::net::TcpStream::from_std(std).map_err(|e| MigrationError::io("stream", e))?);
        }
        let Some(stream) = self.stream.as_mut() else { return Err(MigrationError::Closed) };
        if self.theirs.is_none() {
            self.broken = true;
            self.mine = super::secret::random_32()?;
            let mine = self.mine;
            let theirs = tokio::time::timeout(timeout, async {
                stream.write_all(&mine).await?;
                let mut theirs = [0u8; NONCE_LEN];
                stream.read_exact(&mut theirs).await?;
                Ok::<_, std::io::Error>(theirs)
            })
            .await
            .map_err(|_| MigrationError::Timeout("nonce exchange"))?
            .map_err(|e| MigrationError::io("nonce exchange", e))?;
            if theirs == mine {
                return Err(MigrationError::Wire(wire::WireError::Reflected));
            }
            self.theirs = Some(theirs);
            self.broken = false;
        }
        Ok(stream)
    }

    /// Sends one frame carrying `payload`, then `extra` raw bytes are the caller's to write.
    pub(crate) async fn send(&mut self, payload: &[u8]) -> Result<(), MigrationError> {
        self.ready(WRITE_TIMEOUT).await?;
        let (mine, theirs) = (self.mine, self.theirs.unwrap_or_default());
        let frame = wire::seal(&self.secret, &mine, &theirs, self.sent, payload).map_err(MigrationError::Wire)?;
        self.broken = true;
        let Some(stream) = self.stream.as_mut() else { return Err(MigrationError::Closed) };
        tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(&frame))
            .await
            .map_err(|_| MigrationError::Timeout("send"))?
            .map_err(|e| MigrationError::io("send", e))?;
        self.sent += 1;
        self.broken = false;
        Ok(())
    }

    /// The next frame's payload, waiting at most `timeout`.
    pub(crate) async fn recv(&mut self, timeout: Duration) -> Result<Vec<u8>, MigrationError> {
        let deadline = tokio::time::Instant::now() + timeout;
        self.ready(timeout).await?;
        let (mine, theirs) = (self.mine, self.theirs.unwrap_or_default());
        // Whatever happens below, a half-read frame leaves the stream unusable.
        self.broken = true;
        let Some(stream) = self.stream.as_mut() else { return Err(MigrationError::Closed) };
        let body = tokio::time::timeout_at(deadline, async {
            let mut header = [0u8; 4];
            match stream.read_exact(&mut header).await {
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(MigrationError::Closed),
                r => r.map_err(|e| MigrationError::io("receive", e))?,
            };
            let len = wire::frame_len(header).map_err(MigrationError::Wire)?;
            let mut body = vec![0u8; len + wire::MAC_LEN];
            stream.read_exact(&mut body).await.map_err(|e| MigrationError::io("receive", e))?;
            Ok(body)
        })
        .await
        .map_err(|_| MigrationError::Timeout("receive"))??;
        let payload =
            wire::open_frame(&self.secret, &theirs, &mine, self.received, &body).map_err(MigrationError::Wire)?;
        let payload = payload.to_vec();
        self.received += 1;
        self.broken = false;
        Ok(payload)
    }

    /// The stream after the last frame, for raw bytes that follow a frame (a file's content).
    pub(crate) fn raw(&mut self) -> Result<&mut tokio::net::TcpStream, MigrationError> {
        if self.broken || self.theirs.is_none() {
            return Err(MigrationError::Closed);
        }
        self.stream.as_mut().ok_or(MigrationError::Closed)
    }

    /// Marks the stream unusable (a raw transfer failed half way).
    pub(crate) fn break_off(&mut self) {
        self.broken = true;
    }
}

/// The control channel, framed and authenticated message by message.
pub struct Control {
    framed: Framed,
}

impl Control {
    /// Over a connected control stream (from [`super::connect`] or an [`super::IncomingChannel`]).
    pub fn new(stream: std::net::TcpStream, secret: &Secret) -> Control {
        Control { framed: Framed::new(stream, secret) }
    }

    /// Sends one message.
    ///
    /// # Errors
    /// When the stream fails, the message is larger than a frame, or an earlier failure ended
    /// the channel.
    pub async fn send(&mut self, msg: &ControlMsg) -> Result<(), MigrationError> {
        let json = serde_json::to_vec(msg).map_err(|e| MigrationError::Protocol(format!("encode: {e}")))?;
        self.framed.send(&json).await
    }

    /// The next message, waiting at most `timeout`.
    ///
    /// # Errors
    /// When the stream fails or closes, a message is not authentic or out of sequence (which
    /// ends the channel), not a [`ControlMsg`], or `timeout` passes.
    pub async fn recv(&mut self, timeout: Duration) -> Result<ControlMsg, MigrationError> {
        let payload = self.framed.recv(timeout).await?;
        serde_json::from_slice(&payload).map_err(|e| {
            self.framed.break_off();
            MigrationError::Protocol(format!("not a control message: {e}"))
        })
    }
}
