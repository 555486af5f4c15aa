//! Files over the `files` channel (a cold move's disks, a cold or live move's snapshots), every byte in encrypted and
//! authenticated frames (the framing of [`super::control`]): per file a header `{name, bytes}`,
//! its content in chunks of at most [`CHUNK`] bytes (a chunk of zeros travels as its length
//! only and stays a hole on the receiver), then a trailer with the sha256 the sender computed
//! while sending; an `end` frame closes the list. The header goes first, so a multi-GiB disk's
//! first bytes leave at once (no pass over the file before them); the receiver hashes as it
//! writes and checks the trailer: the frames already authenticate every chunk, the sha256 is
//! what the logs and the API's 2003 name.
//!
//! Order: source [`FileSender::new`], [`FileSender::send`] per file, [`FileSender::finish`];
//! destination [`FileReceiver::new`], then [`FileReceiver::next`] and
//! [`FileReceiver::receive`] per file until `next` answers `None`. The receiver writes where
//! its caller says, never to a name from the wire. [`parse_frame`] is the pure reading of one
//! frame's payload (fuzzed).

use super::control::Framed;
use super::{MigrationError, Secret};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

/// Largest chunk of a file's content in one frame (the frame adds one byte: below
/// [`super::wire::MAX_FRAME`]); also the unit in which runs of zeros are skipped.
pub const CHUNK: usize = 512 * 1024;
/// How long the receiver waits for a file's next chunk (or its trailer): an idle timeout, not
/// a whole file's.
const CHUNK_STALL: Duration = Duration::from_secs(60);

static ZEROS: [u8; CHUNK] = [0; CHUNK];

/// What a header frame announces.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileHeader {
    /// The sender's name for the file (the receiver's caller maps it to a path).
    pub name: String,
    /// Its length.
    pub bytes: u64,
}

/// A file sent or received whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDone {
    /// Its name on the wire.
    pub name: String,
    /// Its length.
    pub bytes: u64,
    /// Its sha256 (64 lower-case hex digits), as the trailer said and the receiver found.
    pub sha256: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Trailer {
    sha256: String,
}

/// One frame of the `files` channel, as [`parse_frame`] reads its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FilesFrame<'a> {
    /// `H` + JSON: a file begins.
    Header(FileHeader),
    /// `D` + 1 to [`CHUNK`] bytes of content.
    Data(&'a [u8]),
    /// `Z` + a u64 (big-endian, 1 to [`CHUNK`]): that many zero bytes of content.
    Zeros(u64),
    /// `T` + JSON: the file's sha256 (64 lower-case hex digits); the file ends.
    Trailer(String),
    /// `E`: no file follows.
    End,
}

impl FilesFrame<'_> {
    /// The frame's payload.
    pub fn encode(&self) -> Vec<u8> {
        let json = |tag: u8, v: serde_json::Result<Vec<u8>>| {
            let mut out = vec![tag];
            out.extend(v.unwrap_or_default());
            out
        };
        match self {
            FilesFrame::Header(h) => json(b'H', serde_json::to_vec(h)),
            FilesFrame::Data(d) => [&[b'D'][..], d].concat(),
            FilesFrame::Zeros(n) => [&[b'Z'][..], &n.to_be_bytes()].concat(),
            FilesFrame::Trailer(sha256) => json(b'T', serde_json::to_vec(&Trailer { sha256: sha256.clone() })),
            FilesFrame::End => vec![b'E'],
        }
    }
}

/// Reads one frame's payload.
///
/// # Errors
/// A message saying what is wrong: an unknown kind, a chunk empty or above [`CHUNK`], a header
/// or trailer that is not its JSON, a sha256 that is not 64 lower-case hex digits.
pub fn parse_frame(payload: &[u8]) -> Result<FilesFrame<'_>, String> {
    let Some((&kind, rest)) = payload.split_first() else { return Err("an empty frame".into()) };
    match kind {
        b'H' => serde_json::from_slice(rest).map(FilesFrame::Header).map_err(|e| format!("header: {e}")),
        b'D' if !rest.is_empty() && rest.len() <= CHUNK => Ok(FilesFrame::Data(rest)),
        b'D' => Err(format!("a chunk of {} bytes", rest.len())),
        b'Z' => {
            let n = <[u8; 8]>::try_from(rest).map(u64::from_be_bytes).map_err(|_| "a malformed zero run")?;
            if n == 0 || n > CHUNK as u64 {
                return Err(format!("a zero run of {n} bytes"));
            }
            Ok(FilesFrame::Zeros(n))
        }
        b'T' => {
            let t: Trailer = serde_json::from_slice(rest).map_err(|e| format!("trailer: {e}"))?;
            if t.sha256.len() != 64 || !t.sha256.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
                return Err("a trailer whose sha256 is not 64 lower-case hex digits".into());
            }
            Ok(FilesFrame::Trailer(t.sha256))
        }
        b'E' if rest.is_empty() => Ok(FilesFrame::End),
        _ => Err(format!("an unknown frame kind {kind:#04x}")),
    }
}

fn protocol(what: impl std::fmt::Display) -> MigrationError {
    MigrationError::Protocol(format!("files channel: {what}"))
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

    /// Sends the file at `path` as `name`: the header, its content hashed as it goes, the
    /// trailer.
    ///
    /// # Errors
    /// When the file cannot be read or shrinks while sent, or the stream fails (which ends the
    /// channel).
    pub async fn send(&mut self, name: &str, path: &Path) -> Result<FileDone, MigrationError> {
        let mut file = tokio::fs::File::open(path).await.map_err(|e| MigrationError::io("read file", e))?;
        let bytes = file.metadata().await.map_err(|e| MigrationError::io("read file", e))?.len();
        let header = FileHeader { name: name.to_string(), bytes };
        self.framed.send(&FilesFrame::Header(header).encode()).await?;
        let mut hasher = Sha256::new();
        let mut left = bytes;
        let mut buf = vec![0u8; CHUNK];
        let copied = async {
            while left > 0 {
                let want = CHUNK.min(usize::try_from(left).unwrap_or(CHUNK));
                let mut filled = 0;
                while filled < want {
                    let n = file.read(&mut buf[filled..want]).await.map_err(|e| MigrationError::io("read file", e))?;
                    if n == 0 {
                        return Err(MigrationError::Protocol(format!("{} shrank while sent", path.display())));
                    }
                    filled += n;
                }
                let chunk = &buf[..want];
                hasher.update(chunk);
                // A slice comparison is a memcmp: fast even unoptimised.
                let frame =
                    if chunk == &ZEROS[..want] { FilesFrame::Zeros(want as u64) } else { FilesFrame::Data(chunk) };
                self.framed.send(&frame.encode()).await?;
                left -= want as u64;
            }
            Ok(())
        }
        .await;
        if copied.is_err() {
            // The receiver is mid-file: nothing sent after this could be read in step.
            self.framed.break_off();
        }
        copied?;
        let sha256 = super::secret::to_hex(&hasher.finalize());
        self.framed.send(&FilesFrame::Trailer(sha256.clone()).encode()).await?;
        Ok(FileDone { name: name.to_string(), bytes, sha256 })
    }

    /// Says no file follows.
    ///
    /// # Errors
    /// When the stream fails.
    pub async fn finish(mut self) -> Result<(), MigrationError> {
        self.framed.send(&FilesFrame::End.encode()).await?;
        self.framed.shutdown().await;
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
    /// When the stream fails, closes, or a frame is not a header;
    /// [`MigrationError::FileNotAuthentic`] when it is not authentic.
    pub async fn next(&mut self, timeout: Duration) -> Result<Option<FileHeader>, MigrationError> {
        let payload = self.framed.recv(timeout).await.map_err(|e| e.of_file("files channel"))?;
        match parse_frame(&payload) {
            Ok(FilesFrame::Header(h)) => Ok(Some(h)),
            Ok(FilesFrame::End) => Ok(None),
            Ok(_) => {
                self.framed.break_off();
                Err(protocol("content outside a file"))
            }
            Err(e) => {
                self.framed.break_off();
                Err(protocol(e))
            }
        }
    }

    /// Writes the content of the file `header` announced to a new file `dest` (mode 0600; it
    /// must not exist), hashing as it writes; runs of zeros are left as holes. Each chunk may
    /// take up to a minute to come.
    ///
    /// # Errors
    /// [`MigrationError::ChecksumMismatch`] when the content does not have the trailer's sha256,
    /// [`MigrationError::FileNotAuthentic`] when a frame was changed on the way (both 2003), or
    /// the stream, a frame or the file fails; the file is removed in every case.
    pub async fn receive(&mut self, header: &FileHeader, dest: &Path) -> Result<FileDone, MigrationError> {
        self.receive_within(header, dest, u64::MAX).await
    }

    /// As [`FileReceiver::receive`], writing at most `max_written` bytes of data (the file's
    /// holes and 4 KiB blocks of zeros are not written): what the caller reserved on the disk,
    /// so a source that announced a sparse file and sends a full one cannot fill it.
    ///
    /// # Errors
    /// As [`FileReceiver::receive`]; [`MigrationError::Protocol`] past `max_written`.
    pub async fn receive_within(
        &mut self,
        header: &FileHeader,
        dest: &Path,
        max_written: u64,
    ) -> Result<FileDone, MigrationError> {
        // Before anything is read: a path that exists is the caller's error, and it is not ours
        // to remove afterwards.
        let file = match tokio::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(dest).await {
            Ok(f) => f,
            Err(e) => {
                self.framed.break_off();
                return Err(MigrationError::io("create file", e));
            }
        };
        let result = write_file(&mut self.framed, file, header, max_written).await.map_err(|e| e.of_file(&header.name));
        if result.is_err() {
            self.framed.break_off();
            let _ = tokio::fs::remove_file(dest).await;
        }
        result
    }
}

/// The unit [`write_file`] leaves as a hole when it is all zeros: a file system block.
const BLOCK: usize = 4096;

async fn write_file(
    framed: &mut Framed,
    mut file: tokio::fs::File,
    header: &FileHeader,
    max_written: u64,
) -> Result<FileDone, MigrationError> {
    let mut hasher = Sha256::new();
    let mut left = header.bytes;
    let mut written: u64 = 0;
    while left > 0 {
        let payload = framed.recv(CHUNK_STALL).await?;
        let frame = parse_frame(&payload).map_err(protocol)?;
        let n = match &frame {
            FilesFrame::Data(d) => d.len() as u64,
            FilesFrame::Zeros(n) => *n,
            _ => return Err(protocol(format!("{} ended {left} bytes early", header.name))),
        };
        if n > left {
            return Err(protocol(format!("{} is longer than its {} bytes", header.name, header.bytes)));
        }
        match frame {
            FilesFrame::Data(chunk) if chunk != &ZEROS[..chunk.len()] => {
                hasher.update(chunk);
                // Block by block, zeros as holes: the file takes about what it took on the
                // source, which is what the caller reserved.
                for block in chunk.chunks(BLOCK) {
                    if block == &ZEROS[..block.len()] {
                        file.seek(std::io::SeekFrom::Current(block.len() as i64))
                            .await
                            .map_err(|e| MigrationError::io("write file", e))?;
                        continue;
                    }
                    written += block.len() as u64;
                    if written > max_written {
                        return Err(protocol(format!(
                            "{} holds more data than the {max_written} bytes its source announced",
                            header.name
                        )));
                    }
                    file.write_all(block).await.map_err(|e| MigrationError::io("write file", e))?;
                }
            }
            _ => {
                // usize: n <= CHUNK.
                hasher.update(&ZEROS[..n as usize]);
                file.seek(std::io::SeekFrom::Current(n as i64))
                    .await
                    .map_err(|e| MigrationError::io("write file", e))?;
            }
        }
        left -= n;
    }
    let payload = framed.recv(CHUNK_STALL).await?;
    let expected = match parse_frame(&payload).map_err(protocol)? {
        FilesFrame::Trailer(sha256) => sha256,
        _ => return Err(protocol(format!("{} is longer than its {} bytes", header.name, header.bytes))),
    };
    // tokio's File writes in the background and keeps a failed write (ENOSPC, EIO) until the
    // next write or flush: seeks, set_len and sync_all do not report it. Without this flush a
    // disk that did not fit would pass its sha256 (hashed from memory) with a hole in it.
    file.flush().await.map_err(|e| MigrationError::io("write file", e))?;
    // A trailing hole is only a seek: the length makes it part of the file.
    file.set_len(header.bytes).await.map_err(|e| MigrationError::io("write file", e))?;
    file.sync_all().await.map_err(|e| MigrationError::io("write file", e))?;
    let found = super::secret::to_hex(&hasher.finalize());
    if found != expected {
        return Err(MigrationError::ChecksumMismatch {
            name: header.name.clone(),
            expected,
            found,
            bytes: header.bytes,
        });
    }
    Ok(FileDone { name: header.name.clone(), bytes: header.bytes, sha256: found })
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

    const T: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn files_arrive_identical_and_sparse_runs_stay_holes() {
        let dir = tempfile::tempdir().unwrap();
        let mut content = vec![0u8; 3 * CHUNK + 123];
        content[5] = 1;
        content[2 * CHUNK + 7] = 9;
        std::fs::write(dir.path().join("a"), &content).unwrap();
        std::fs::write(dir.path().join("b"), b"small").unwrap();
        std::fs::write(dir.path().join("c"), b"").unwrap();
        let secret = Secret([5; 32]);
        let (a, b) = pair();
        let s2 = secret.clone();
        let d = dir.path().to_path_buf();
        let sender = tokio::spawn(async move {
            let mut tx = FileSender::new(a, &s2);
            let mut sent = Vec::new();
            for (name, file) in [("disk", "a"), ("overlay", "b"), ("empty", "c")] {
                sent.push(tx.send(name, &d.join(file)).await.unwrap());
            }
            tx.finish().await.unwrap();
            sent
        });
        let mut rx = FileReceiver::new(b, &secret);
        let mut got = Vec::new();
        while let Some(h) = rx.next(T).await.unwrap() {
            let dest = dir.path().join(format!("out-{}", got.len()));
            got.push(rx.receive(&h, &dest).await.unwrap());
        }
        let sent = sender.await.unwrap();
        assert_eq!(got, sent);
        assert_eq!(sent[0].bytes, content.len() as u64);
        use sha2::Digest;
        assert_eq!(sent[0].sha256, crate::migration::secret::to_hex(&Sha256::digest(&content)));
        assert_eq!(std::fs::read(dir.path().join("out-0")).unwrap(), content);
        assert_eq!(std::fs::read(dir.path().join("out-1")).unwrap(), b"small");
        assert_eq!(std::fs::read(dir.path().join("out-2")).unwrap(), b"");
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(dir.path().join("out-0")).unwrap().blocks() * 512;
        assert!(blocks < content.len() as u64, "zero chunks were written out: {blocks} bytes allocated");
    }

    /// A sender speaking the framing by hand: these payloads, then it closes.
    fn raw_sender(a: std::net::TcpStream, secret: &Secret, frames: Vec<Vec<u8>>) -> tokio::task::JoinHandle<()> {
        let secret = secret.clone();
        tokio::spawn(async move {
            let mut framed = Framed::new(a, &secret);
            for f in frames {
                if framed.send(&f).await.is_err() {
                    return;
                }
            }
        })
    }

    fn header(bytes: u64) -> Vec<u8> {
        FilesFrame::Header(FileHeader { name: "x".into(), bytes }).encode()
    }

    #[tokio::test]
    async fn a_wrong_trailer_fails_2003_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let secret = Secret([5; 32]);
        let (a, b) = pair();
        let frames = vec![header(4), FilesFrame::Data(b"abcd").encode(), FilesFrame::Trailer("00".repeat(32)).encode()];
        let sender = raw_sender(a, &secret, frames);
        let mut rx = FileReceiver::new(b, &secret);
        let h = rx.next(T).await.unwrap().unwrap();
        let dest = dir.path().join("out");
        let err = rx.receive(&h, &dest).await.unwrap_err();
        assert!(matches!(err, MigrationError::ChecksumMismatch { bytes: 4, .. }), "{err}");
        assert_eq!(crate::api::ApiError::from(err).code, crate::api::Code::ChecksumMismatch);
        assert!(!dest.exists());
        sender.await.unwrap();
    }

    #[tokio::test]
    async fn data_beyond_what_the_receiver_allows_is_refused_and_zero_blocks_do_not_count() {
        let secret = Secret([5; 32]);
        // Two data blocks and two zero blocks in one chunk: 8 KiB written.
        let mut chunk = vec![0u8; 4 * BLOCK];
        chunk[0] = 1;
        chunk[3 * BLOCK] = 2;
        let trailer = super::super::secret::to_hex(&Sha256::digest(&chunk));
        for (max, ok) in [(2 * BLOCK as u64, true), (2 * BLOCK as u64 - 1, false)] {
            let dir = tempfile::tempdir().unwrap();
            let (a, b) = pair();
            let frames = vec![
                FilesFrame::Header(FileHeader { name: "x".into(), bytes: chunk.len() as u64 }).encode(),
                FilesFrame::Data(&chunk).encode(),
                FilesFrame::Trailer(trailer.clone()).encode(),
            ];
            let sender = raw_sender(a, &secret, frames);
            let mut rx = FileReceiver::new(b, &secret);
            let h = rx.next(T).await.unwrap().unwrap();
            let dest = dir.path().join("out");
            let got = rx.receive_within(&h, &dest, max).await;
            assert_eq!(got.is_ok(), ok, "max {max}: {got:?}");
            if ok {
                assert_eq!(std::fs::read(&dest).unwrap(), chunk);
            } else {
                assert!(!dest.exists(), "a refused file stays");
            }
            sender.await.unwrap();
        }
    }

    #[tokio::test]
    async fn content_beyond_or_short_of_the_header_is_refused() {
        let secret = Secret([5; 32]);
        let cases: Vec<Vec<Vec<u8>>> = vec![
            // More than announced in one chunk, in zeros, or a second chunk past the end.
            vec![header(3), FilesFrame::Data(b"abcd").encode()],
            vec![header(3), FilesFrame::Zeros(4).encode()],
            vec![header(4), FilesFrame::Data(b"abcd").encode(), FilesFrame::Data(b"e").encode()],
            // The trailer (or the end) before the content is whole.
            vec![header(8), FilesFrame::Data(b"abcd").encode(), FilesFrame::Trailer("00".repeat(32)).encode()],
            vec![header(8), FilesFrame::End.encode()],
            // Not a frame of this channel.
            vec![header(8), b"{\"msg\":\"ping\"}".to_vec()],
        ];
        for (i, frames) in cases.into_iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let (a, b) = pair();
            let sender = raw_sender(a, &secret, frames);
            let mut rx = FileReceiver::new(b, &secret);
            let h = rx.next(T).await.unwrap().unwrap();
            let dest = dir.path().join("out");
            let err = rx.receive(&h, &dest).await.unwrap_err();
            assert!(matches!(err, MigrationError::Protocol(_)), "case {i}: {err}");
            assert!(!dest.exists(), "case {i}: a part was left");
            assert!(rx.next(Duration::from_millis(100)).await.is_err(), "case {i}: the channel stays ended");
            sender.await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_short_stream_fails_and_an_existing_destination_is_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let secret = Secret([5; 32]);
        let (a, b) = pair();
        let sender = raw_sender(a, &secret, vec![header(100), FilesFrame::Data(b"abcd").encode()]);
        let mut rx = FileReceiver::new(b, &secret);
        let h = rx.next(T).await.unwrap().unwrap();
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
        let sender = raw_sender(a, &secret, vec![header(100), FilesFrame::Data(b"abcd").encode()]);
        let mut rx = FileReceiver::new(b, &secret);
        let h = rx.next(T).await.unwrap().unwrap();
        sender.await.unwrap();
        let dest = dir.path().join("out");
        assert!(matches!(rx.receive(&h, &dest).await, Err(MigrationError::Closed)));
        assert!(!dest.exists());
        assert!(rx.next(Duration::from_secs(1)).await.is_err(), "the channel stays ended");
    }

    #[tokio::test]
    async fn a_tampered_chunk_is_refused_and_removes_the_part() {
        let dir = tempfile::tempdir().unwrap();
        let secret = Secret([5; 32]);
        let (a, b) = pair();
        // A relay that flips one byte of the second frame's ciphertext (the first chunk).
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let to_rx = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (relay_out, _) = l.accept().unwrap();
        let d = dir.path().join("src");
        std::fs::write(&d, vec![7u8; 1000]).unwrap();
        let s2 = secret.clone();
        let sender = tokio::spawn(async move {
            let mut tx = FileSender::new(a, &s2);
            let _ = tx.send("x", &d).await;
        });
        let relay = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut from, mut to) = (b, relay_out);
            let mut seen = 0usize;
            let mut buf = [0u8; 4096];
            let mut flipped = false;
            loop {
                let n = match from.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                // Nonce (32), header frame (4 + 26 + 16), then the chunk frame's body.
                let target = 32 + 4 + 26 + 16 + 4 + 100;
                if !flipped && seen + n > target {
                    buf[target - seen] ^= 1;
                    flipped = true;
                }
                seen += n;
                if to.write_all(&buf[..n]).is_err() {
                    return;
                }
                // The receiver's nonce goes back the other way.
                if seen == 32 {
                    let mut nonce = [0u8; 32];
                    if to.read_exact(&mut nonce).is_err() || from.write_all(&nonce).is_err() {
                        return;
                    }
                }
            }
        });
        let mut rx = FileReceiver::new(to_rx, &secret);
        let h = rx.next(T).await.unwrap().unwrap();
        assert_eq!(h, FileHeader { name: "x".into(), bytes: 1000 });
        let dest = dir.path().join("out");
        let err = rx.receive(&h, &dest).await.unwrap_err();
        assert!(matches!(&err, MigrationError::FileNotAuthentic { name, .. } if name == "x"), "{err}");
        assert_eq!(crate::api::ApiError::from(err).code, crate::api::Code::ChecksumMismatch);
        assert!(!dest.exists());
        drop(rx);
        sender.await.unwrap();
        relay.join().unwrap();
    }

    #[test]
    fn frames_parse_back_and_malformed_ones_are_refused() {
        let sha = "ab".repeat(32);
        for f in [
            FilesFrame::Header(FileHeader { name: "disk".into(), bytes: 7 }),
            FilesFrame::Data(b"xyz"),
            FilesFrame::Zeros(CHUNK as u64),
            FilesFrame::Trailer(sha.clone()),
            FilesFrame::End,
        ] {
            assert_eq!(parse_frame(&f.encode()).unwrap(), f);
        }
        let big = vec![1u8; CHUNK + 1];
        let bad: Vec<Vec<u8>> = vec![
            vec![],
            b"D".to_vec(),
            [&b"D"[..], &big].concat(),
            [&b"Z"[..], &0u64.to_be_bytes()].concat(),
            [&b"Z"[..], &(CHUNK as u64 + 1).to_be_bytes()].concat(),
            b"Z1234".to_vec(),
            b"H{\"name\":\"x\"}".to_vec(),
            b"H{\"name\":\"x\",\"bytes\":1,\"sha256\":\"\"}".to_vec(),
            format!("T{{\"sha256\":\"{}\"}}", "AB".repeat(32)).into_bytes(),
            b"T{\"sha256\":\"00\"}".to_vec(),
            b"Ex".to_vec(),
            b"Q".to_vec(),
        ];
        for b in bad {
            assert!(parse_frame(&b).is_err(), "{:?}", String::from_utf8_lossy(&b));
        }
    }
}
