//! The destination's NBD relay: QEMU's NBD server needs a listening socket it accepts on
//! itself, so it cannot be handed the source's TCP stream; the daemon connects to QEMU's Unix
//! listener and copies both ways. QEMU's TLS runs end to end through it: the relay sees only
//! ciphertext.
//!
//! Used once per `disk:EXPORT` channel, after the destination's QEMU listens.

use super::MigrationError;
use std::path::Path;

/// Bytes a [`relay`] copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Relayed {
    /// From the source (TCP) to QEMU (Unix).
    pub to_qemu: u64,
    /// From QEMU to the source.
    pub to_peer: u64,
}

/// Copies between `tcp` and a new connection to the Unix socket `unix` until either side
/// closes. It has no idle timeout (a ready mirror is quiet while the guest writes nothing):
/// the caller drops the task when the migration ends.
///
/// # Errors
/// When `unix` cannot be connected or a copy fails.
pub async fn relay(tcp: std::net::TcpStream, unix: &Path) -> Result<Relayed, MigrationError> {
    tcp.set_nonblocking(true).map_err(|e| MigrationError::io("relay", e))?;
    let mut tcp = tokio::net::TcpStream::from_std(tcp).map_err(|e| MigrationError::io("relay", e))?;
    let mut qemu = tokio::net::UnixStream::connect(unix).await.map_err(|e| MigrationError::io("relay connect", e))?;
    let (to_qemu, to_peer) =
        tokio::io::copy_bidirectional(&mut tcp, &mut qemu).await.map_err(|e| MigrationError::io("relay", e))?;
    Ok(Relayed { to_qemu, to_peer })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn copies_both_ways_until_a_side_closes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd");
        let unix = tokio::net::UnixListener::bind(&path).unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (server, _) = tcp.accept().unwrap();
        let task = tokio::spawn(async move { relay(server, &path).await });
        let (mut qemu, _) = unix.accept().await.unwrap();
        client.write_all(b"hello qemu").await.unwrap();
        let mut buf = [0u8; 10];
        qemu.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello qemu");
        qemu.write_all(b"hi").await.unwrap();
        drop(qemu);
        let mut back = Vec::new();
        client.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"hi");
        drop(client);
        let copied = task.await.unwrap().unwrap();
        assert_eq!(copied, Relayed { to_qemu: 10, to_peer: 2 });
    }

    #[tokio::test]
    async fn a_missing_listener_is_an_error() {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(tcp.local_addr().unwrap()).unwrap();
        let (server, _) = tcp.accept().unwrap();
        assert!(relay(server, Path::new("/nonexistent/nbd")).await.is_err());
    }
}
