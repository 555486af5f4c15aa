//! Files into and out of a guest over an exec port, checked by sha256 on both sides.
//!
//! Order: for a push, the bytes come from the request ([`PushContent::Bytes`]) or from a file
//! under `[agent] files_dir` that [`open_source`] opened beneath that directory (never a path
//! outside it, whatever symlinks it holds); [`push`] hashes them on the host first (the request
//! may name the sha256 they must have), then sends them as chunks after `file.push` (the guest
//! writes a temporary file, checks the sha256 and renames it into place: a reader never sees
//! half a file). [`pull`] asks `file.pull` for at most `max_bytes`, and checks the sha256 of what
//! arrived against the guest's claim. Memory: a push from a file streams it in chunks; a pull
//! keeps at most `max_bytes`.

use super::session::{Body, ExecError, Session};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;
use vmhost_agent_protocol::exec::{FilePullParams, FilePullReply, FilePushParams, FilePushReply, MAX_CHUNK};

/// Bound on a transfer: this much, plus [`TRANSFER_PER_MIB`] per MiB.
pub const TRANSFER_BASE: Duration = Duration::from_secs(60);

/// Extra time per MiB of a transfer (a TCG guest decodes and writes slowly).
pub const TRANSFER_PER_MIB: Duration = Duration::from_secs(4);

/// The bound on moving `bytes`.
pub fn transfer_bound(bytes: u64) -> Duration {
    let mib = u32::try_from(bytes.div_ceil(1 << 20)).unwrap_or(u32::MAX);
    TRANSFER_BASE.saturating_add(TRANSFER_PER_MIB.saturating_mul(mib))
}

/// Why a `source` cannot be sent.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The host has no `[agent] files_dir`.
    #[error("source needs [agent] files_dir in the host's config")]
    NoFilesDir,
    /// The name is not a plain relative path (absolute, `.` or `..`, empty, NUL).
    #[error("{0:?} is not a path relative to [agent] files_dir without . or .. components")]
    NotRelative(String),
    /// Opening it failed, or resolving it left the directory (a symlink pointing out).
    #[error("cannot open {rel:?} under [agent] files_dir: {source}")]
    Open {
        /// The name asked for.
        rel: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It is larger than `[agent] max_file_mib`.
    #[error("{rel:?} is {size} bytes; [agent] max_file_mib allows {max}")]
    TooLarge {
        /// The name asked for.
        rel: String,
        /// Its size.
        size: u64,
        /// The limit in bytes.
        max: u64,
    },
}

/// What a push sends.
#[derive(Debug)]
pub enum PushContent {
    /// Bytes of the request.
    Bytes(Vec<u8>),
    /// A file [`open_source`] opened, and where it is (for messages).
    File(std::fs::File, PathBuf),
}

/// Opens `rel` beneath `files_dir` for reading: a regular file of at most `max_bytes`.
///
/// # Errors
/// [`SourceError`]: no `files_dir`, a name that is not plain and relative, a path that leaves
/// the directory (also through a symlink: the open resolves beneath it), not a regular file, too
/// large.
pub fn open_source(files_dir: Option<&Path>, rel: &str, max_bytes: u64) -> Result<PushContent, SourceError> {
    let dir = files_dir.ok_or(SourceError::NoFilesDir)?;
    let path = Path::new(rel);
    let plain = !rel.is_empty()
        && !rel.contains('\0')
        && path.components().all(|c| matches!(c, Component::Normal(_)))
        && !rel.split('/').any(|c| c == "." || c == "..");
    if !plain {
        return Err(SourceError::NotRelative(rel.to_string()));
    }
    let full = dir.join(path);
    let file = crate::qemu::boot_files::open_under(&[dir.to_path_buf()], &full)
        .map_err(|source| SourceError::Open { rel: rel.to_string(), source })?;
    let size = file.metadata().map_err(|source| SourceError::Open { rel: rel.to_string(), source })?.len();
    if size > max_bytes {
        return Err(SourceError::TooLarge { rel: rel.to_string(), size, max: max_bytes });
    }
    Ok(PushContent::File(file, full))
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The sha256 (hex) of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Size and sha256 of what `content` holds, leaving a file at its start.
fn measure(content: &mut PushContent) -> Result<(u64, String), ExecError> {
    match content {
        PushContent::Bytes(b) => Ok((b.len() as u64, sha256(b))),
        PushContent::File(file, path) => {
            let failed = |source| ExecError::Source { path: path.clone(), source };
            crate::blocking::run(|| {
                use std::io::Seek;
                let mut hasher = Sha256::new();
                let mut size = 0u64;
                let mut buf = vec![0u8; 4 * MAX_CHUNK];
                file.rewind()?;
                loop {
                    let n = file.read(&mut buf)?;
                    if n == 0 {
                        break;
                    }
                    hasher.update(buf.get(..n).unwrap_or_default());
                    size += n as u64;
                }
                file.rewind()?;
                Ok((size, hex(&hasher.finalize())))
            })
            .map_err(failed)
        }
    }
}

/// What a push asks for, but its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushRequest {
    /// Absolute guest path.
    pub path: String,
    /// Permission bits.
    pub mode: u32,
    /// `user[:group]`.
    pub owner: Option<String>,
    /// The sha256 the bytes must have, when the caller named one.
    pub sha256: Option<String>,
    /// Create missing parent directories.
    pub mkdir: bool,
}

/// Pushes `content` to the guest on `session`.
///
/// # Errors
/// [`ExecError::Checksum`] when the bytes do not have `request.sha256` (nothing is sent);
/// otherwise as [`Session::request`] (the guest refuses with [`ExecError::Refused`]).
pub async fn push(
    session: &mut Session,
    request: &PushRequest,
    mut content: PushContent,
) -> Result<FilePushReply, ExecError> {
    let (size, sha) = measure(&mut content)?;
    if let Some(expected) = &request.sha256 {
        if !expected.eq_ignore_ascii_case(&sha) {
            return Err(ExecError::Checksum {
                what: "the content",
                expected: expected.clone(),
                found: sha,
                bytes: size,
            });
        }
    }
    let params = FilePushParams {
        path: request.path.clone(),
        mode: request.mode,
        owner: request.owner.clone(),
        size,
        sha256: sha.clone(),
        mkdir: request.mkdir,
    };
    let bound = transfer_bound(size);
    let reply: FilePushReply = match &mut content {
        PushContent::Bytes(b) => session.send_with_body(&params, Body::Bytes(b), bound).await?,
        PushContent::File(file, path) => {
            let std_file = file.try_clone().map_err(|source| ExecError::Source { path: path.clone(), source })?;
            let mut file = tokio::fs::File::from_std(std_file);
            session.send_with_body(&params, Body::File { file: &mut file, path, size }, bound).await?
        }
    };
    if reply.sha256 != sha || reply.size != size {
        return Err(ExecError::Checksum {
            what: "the file written in the guest",
            expected: sha,
            found: reply.sha256,
            bytes: reply.size,
        });
    }
    Ok(reply)
}

/// Pulls a file of at most `max_bytes`; returns the guest's reply and the bytes, whose sha256
/// and size were checked against the reply.
///
/// # Errors
/// [`ExecError::Checksum`] when the bytes differ from the guest's claim; as
/// [`Session::request`] otherwise (a file over `max_bytes` is the guest's refusal).
pub async fn pull(session: &mut Session, path: &str, max_bytes: u64) -> Result<(FilePullReply, Vec<u8>), ExecError> {
    let params = FilePullParams { path: path.to_string(), max_bytes };
    let (reply, data): (FilePullReply, Vec<u8>) =
        session.receive_file(&params, max_bytes, transfer_bound(max_bytes)).await?;
    let found = sha256(&data);
    if found != reply.sha256.to_ascii_lowercase() || reply.size != data.len() as u64 {
        return Err(ExecError::Checksum {
            what: "the file received",
            expected: reply.sha256,
            found,
            bytes: data.len() as u64,
        });
    }
    Ok((reply, data))
}
