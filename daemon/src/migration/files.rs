//! A cold move's files (`vm.move`) over the `files` channel: per file an authenticated header
//! frame `{name, bytes, sha256}` (the framing of [`super::control`]), then exactly `bytes` raw
//! bytes; an `end` frame closes the list. The header's MAC makes the sha256 authentic, and the
//! sha256 makes the raw bytes so.
//!
//! Order: source [`FileSender::new`], [`FileSender::send`] per file, [`FileSender::finish`];
//! destination [`FileReceiver::new`], then [`FileReceiver::next`] and
//! [`FileReceiver::receive`] per file until `next` answers `None`. The receiver writes where
//! its caller says, never to a name from the wire.

use super::control::{Framed, WRITE_TIMEOUT};
use super::{MigrationError, Secret};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

/// Copy buffer; also the unit in which runs of zeros are skipped (left sparse).
const CHUNK: usize = 1024 * 1024;
/// How long a read of a file's bytes may stall.
const READ_STALL: Duration = Duration::from_secs(60);

/// What a header frame announces.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileHeader {
    /// The sender's name for the file (the receiver's caller maps it to a path).
    pub name: String,
    /// Its length.
    pub bytes: u64,
    /// Its sha256 (64 lower-case hex digits).
    pub sha256: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(tag = "frame", rename_all = "snake_case", deny_unknown_fields)]
enum FilesFrame {
    File(FileHeader),
    End,
}

/// The source's end of a `files` channel.
pub struct FileSender {
    framed: Framed,
}

impl FileSender {
    /// Over a connected `files` stream.
    pub fn new(stream: std::net::TcpStream, secret: &Secret) -> FileSender {
        FileSender { framed: Framed::new(stream, secret) }
    }

    /// Sends the file at `path` as `name`: hashes it, sends the header, then its bytes.
    ///
    /// # Errors
    /// When the file cannot be read or changes length while sent, or the stream fails.
    pub async fn send(&mut self, name: &str, path: &Path) -> Result<FileHeader, MigrationError> {
        let (bytes, sha256) = hash_file(path).await?;
        let header = FileHeader { name: name.to_string(), bytes, sha256 };
        let json = serde_json::to_vec(&FilesFrame::File(header.clone()))
            .map_err(|e| MigrationError::Protocol(format!("encode: {e}")))?;
        self.framed.send(&json).await?;
        let mut file = tokio::fs::File::open(path).await.map_err(|e| MigrationError::io("read file", e))?;
        let stream = self.framed.raw()?;
        let mut left = bytes;
        let mut buf = vec![0u8; CHUNK];
        let copied = async {
            while left > 0 {
                let want = buf.len().min(usize::try_from(left).unwrap_or(CHUNK));
                let n = file.read(&mut buf[..want]).await.map_err(|e| MigrationError::io("read file", e))?;
                if n == 0 {
                    return Err(MigrationError::Protocol(format!("{} shrank while sent", path.display())));
                }
                tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(&buf[..n]))
                    .await
                    .map_err(|_| MigrationError::Timeout("send file"))?
                    .map_err(|e| MigrationError::io("send file", e))?;
                left -= n as u64;
            }
            Ok(())
        }
        .await;
        if copied.is_err() {
            self.framed.break_off();
        }
        copied.map(|()| header)
    }

    /// Says no file follows.
    ///
    /// # Errors
    /// When the stream fails.
    pub async fn finish(mut self) -> Result<(), MigrationError> {
        let json = serde_json::to_vec(&FilesFrame::End).map_err(|e| MigrationError::Protocol(e.to_string()))?;
        self.framed.send(&json).await?;
        let stream = self.framed.raw()?;
        let _ = stream.shutdown().await;
        Ok(())
    }
}

/// The destination's end of a `files` channel.
pub struct FileReceiver {
    framed: Framed,
}

impl FileReceiver {
    /// Over an authenticated `files` stream ([`super::IncomingChannel`]).
    pub fn new(stream: std::net::TcpStream, secret: &Secret) -> FileReceiver {
        FileReceiver { framed: Framed::new(stream, secret) }
    }

    /// The next file's header, or `None` when the sender said it sent all; waits at most
    /// `timeout`.
    ///
    /// # Errors
    /// When the stream fails, closes, or a frame is not authentic or not a header.
    pub async fn next(&mut self, timeout: Duration) -> Result<Option<FileHeader>, MigrationError> {
        let payload = self.framed.recv(timeout).await?;
        match serde_json::from_slice(&payload) {
            Ok(FilesFrame::File(h)) => Ok(Some(h)),
            Ok(FilesFrame::End) => Ok(None),
            Err(e) => {
                self.framed.break_off();
                Err(MigrationError::Protocol(format!("not a files frame: {e}")))
            }
        }
    }

    /// Writes the bytes of the file `header` announced to a new file `dest` (mode 0600; it
    /// must not exist), hashing as it writes; runs of zeros are left as holes.
    ///
    /// # Errors
    /// [`MigrationError::ChecksumMismatch`] when the bytes do not have the header's sha256
    /// (the file is removed), or the stream or file fails (the file is removed).
    pub async fn receive(&mut self, header: &FileHeader, dest: &Path) -> Result<(), MigrationError> {
        let stream = self.framed.raw()?;
        // Before anything is read: a path that exists is the caller's error, and it is not ours
        // to remove afterwards.
        let file = match tokio::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(dest).await {
            Ok(f) => f,
            Err(e) => {
                self.framed.break_off();
                return Err(MigrationError::io("create file", e));
            }
        };
        let result = write_file(stream, file, header).await;
        if result.is_err() {
            self.framed.break_off();
            let _ = tokio::fs::remove_file(dest).await;
        }
        result
    }
}

async fn write_file(
    stream: &mut tokio::net::TcpStream,
    mut file: tokio::fs::File,
    header: &FileHeader,
) -> Result<(), MigrationError> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut left = header.bytes;
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(CHUNK));
        let mut filled = 0;
        while filled < want {
            let n = tokio::time::timeout(READ_STALL, stream.read(&mut buf[filled..want]))
                .await
                .map_err(|_| MigrationError::Timeout("receive file"))?
                .map_err(|e| MigrationError::io("receive file", e))?;
            if n == 0 {
                return Err(MigrationError::Closed);
            }
            filled += n;
        }
        let chunk = &buf[..want];
        hasher.update(chunk);
        if chunk.iter().all(|&b| b == 0) {
            file.seek(std::io::SeekFrom::Current(want as i64))
                .await
                .map_err(|e| MigrationError::io("write file", e))?;
        } else {
            file.write_all(chunk).await.map_err(|e| MigrationError::io("write file", e))?;
        }
        left -= want as u64;
    }
    // A trailing hole is only a seek: the length makes it part of the file.
    file.set_len(header.bytes).await.map_err(|e| MigrationError::io("write file", e))?;
    file.sync_all().await.map_err(|e| MigrationError::io("write file", e))?;
    let found = super::secret::to_hex(&hasher.finalize());
    if found != header.sha256.to_ascii_lowercase() {
        return Err(MigrationError::ChecksumMismatch {
            name: header.name.clone(),
            expected: header.sha256.clone(),
            found,
            bytes: header.bytes,
        });
    }
    Ok(())
}

/// Length and sha256 of the file at `path`, read off the async threads.
async fn hash_file(path: &Path) -> Result<(u64, String), MigrationError> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut file = std::fs::File::open(&path)?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; CHUNK];
        let mut bytes = 0u64;
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            bytes += n as u64;
        }
        Ok::<_, std::io::Error>((bytes, super::secret::to_hex(&hasher.finalize())))
    })
    .await
    .map_err(|e| MigrationError::Protocol(format!("hash task: {e}")))?
    .map_err(|e| MigrationError::io("hash file", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[tokio::test]
    async fn files_arrive_identical_and_sparse_runs_stay_holes() {
        let dir = tempfile::tempdir().unwrap();
        let mut content = vec![0u8; 3 * CHUNK + 123];
        content[5] = 1;
        content[2 * CHUNK + 7] = 9;
        std::fs::write(dir.path().join("a"), &content).unwrap();
        std::fs::write(dir.path().join("b"), b"small").unwrap();
        let secret = Secret([5; 32]);
        let (a, b) = pair();
        let s2 = secret.clone();
        let d = dir.path().to_path_buf();
        let sender = tokio::spawn(async move {
            let mut tx = FileSender::new(a, &s2);
            let h1 = tx.send("disk", &d.join("a")).await.unwrap();
            let h2 = tx.send("overlay", &d.join("b")).await.unwrap();
            tx.finish().await.unwrap();
            (h1, h2)
        });
        let mut rx = FileReceiver::new(b, &secret);
        let mut got = Vec::new();
        while let Some(h) = rx.next(Duration::from_secs(10)).await.unwrap() {
            let dest = dir.path().join(format!("out-{}", got.len()));
            rx.receive(&h, &dest).await.unwrap();
            got.push(h);
        }
        let (h1, h2) = sender.await.unwrap();
        assert_eq!(got, vec![h1.clone(), h2]);
        assert_eq!(h1.bytes, content.len() as u64);
        assert_eq!(std::fs::read(dir.path().join("out-0")).unwrap(), content);
        assert_eq!(std::fs::read(dir.path().join("out-1")).unwrap(), b"small");
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(dir.path().join("out-0")).unwrap().blocks() * 512;
        assert!(blocks < content.len() as u64, "zero chunks were written out: {blocks} bytes allocated");
    }

    #[tokio::test]
    async fn a_wrong_hash_fails_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let secret = Secret([5; 32]);
        let (a, b) = pair();
        let s2 = secret.clone();
        // A sender whose header lies about the hash: raw frames, as a broken peer would.
        let sender = tokio::spawn(async move {
            let mut framed = Framed::new(a, &s2);
            let header = FileHeader { name: "x".into(), bytes: 4, sha256: "00".repeat(32) };
            framed.send(&serde_json::to_vec(&FilesFrame::File(header)).unwrap()).await.unwrap();
            framed.raw().unwrap().write_all(b"abcd").await.unwrap();
            framed
        });
        let mut rx = FileReceiver::new(b, &secret);
        let h = rx.next(Duration::from_secs(10)).await.unwrap().unwrap();
        let dest = dir.path().join("out");
        let err = rx.receive(&h, &dest).await.unwrap_err();
        assert!(matches!(err, MigrationError::ChecksumMismatch { bytes: 4, .. }), "{err}");
        assert_eq!(crate::api::ApiError::from(err).code, crate::api::Code::ChecksumMismatch);
        assert!(!dest.exists());
        drop(sender.await.unwrap());
    }

    #[tokio::test]
    async fn a_short_stream_fails_and_an_existing_destination_is_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let secret = Secret([5; 32]);
        let (a, b) = pair();
        let s2 = secret.clone();
        let sender = tokio::spawn(async move {
            let mut framed = Framed::new(a, &s2);
            let header = FileHeader { name: "x".into(), bytes: 100, sha256: "00".repeat(32) };
            framed.send(&serde_json::to_vec(&FilesFrame::File(header.clone())).unwrap()).await.unwrap();
            framed.raw().unwrap().write_all(b"abcd").await.unwrap();
        });
        let mut rx = FileReceiver::new(b, &secret);
        let h = rx.next(Duration::from_secs(10)).await.unwrap().unwrap();
        sender.await.unwrap();
        let kept = dir.path().join("kept");
        std::fs::write(&kept, b"mine").unwrap();
        assert!(rx.receive(&h, &kept).await.is_err());
        assert_eq!(std::fs::read(&kept).unwrap(), b"mine", "an existing file was touched");
    }

    #[tokio::test]
    async fn a_stream_closed_mid_file_fails_and_removes_the_part() {
        let dir = tempfile::tempdir().unwrap();
        let secret = Secret([5; 32]);
        let (a, b) = pair();
        let s2 = secret.clone();
        let sender = tokio::spawn(async move {
            let mut framed = Framed::new(a, &s2);
            let header = FileHeader { name: "x".into(), bytes: 100, sha256: "00".repeat(32) };
            framed.send(&serde_json::to_vec(&FilesFrame::File(header.clone())).unwrap()).await.unwrap();
            framed.raw().unwrap().write_all(b"abcd").await.unwrap();
        });
        let mut rx = FileReceiver::new(b, &secret);
        let h = rx.next(Duration::from_secs(10)).await.unwrap().unwrap();
        sender.await.unwrap();
        let dest = dir.path().join("out");
        assert!(matches!(rx.receive(&h, &dest).await, Err(MigrationError::Closed)));
        assert!(!dest.exists());
        assert!(rx.next(Duration::from_secs(1)).await.is_err(), "the channel stays ended");
    }
}
