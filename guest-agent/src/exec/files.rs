//! `file.push` and `file.pull`: files into and out of the guest, atomically and checksummed.
//!
//! Order of use for a push: [`Push::begin`] validates the request, resolves the owner and
//! creates the temporary file next to the target; the session feeds every announced byte to
//! [`Push::write`] (and, when `begin` refused, reads and drops them all the same, so the stream
//! stays in step); [`Push::finish`] checks the sha256 and only then puts the file in place. A
//! pull is one call, [`pull`], which streams the file through a callback.
//!
//! Atomic means a reader of the target sees the old file or the complete new one, never a part:
//! the content goes to `.NAME.vmhost-XXXXXXXX` in the target's directory (created
//! `O_EXCL|O_NOFOLLOW`, mode 0600, so nobody else can open it meanwhile), gets its owner, mode
//! and an `fsync`, is compared against the announced sha256, and is renamed over the target;
//! the directory is synced so the rename survives a crash. Any failure (including a wrong
//! checksum or a host that hangs up) removes the temporary file and leaves the target as it was.

use std::fs::{File, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use vmhost_agent_protocol::exec::{FilePullParams, FilePullReply, FilePushParams, FilePushReply, MAX_CHUNK};

use super::accounts::{read_groups, read_users, resolve_owner};
use super::chunks::hex;
use crate::protocol::RpcError;

/// Longest path, in bytes (`PATH_MAX`).
pub const MAX_PATH: usize = 4096;

/// Checks that `path` is absolute, has no NUL and fits [`MAX_PATH`].
///
/// # Errors
/// 5100 naming `path`.
pub fn check_path(path: &str) -> Result<(), RpcError> {
    if !path.starts_with('/') || path.contains('\0') || path.len() > MAX_PATH {
        return Err(RpcError::invalid("path", format!("path must be absolute, at most {MAX_PATH} bytes, no NUL")));
    }
    Ok(())
}

/// Eight random hex digits for a temporary name.
fn random_suffix() -> String {
    let mut bytes = [0u8; 4];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into `bytes`.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != 4 {
        // No entropy yet (early boot): O_EXCL still makes the name safe, only likelier to clash.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        bytes = (nanos ^ std::process::id()).to_le_bytes();
    }
    hex(&bytes)
}

/// A push in progress: the temporary file being written.
#[derive(Debug)]
pub struct Push {
    /// The target.
    target: PathBuf,
    /// Its directory.
    dir: PathBuf,
    /// The temporary file's path.
    temp: PathBuf,
    /// The temporary file (`None` after a write failed).
    file: Option<File>,
    /// The first write error.
    error: Option<io::Error>,
    /// Digest of what was written.
    hasher: Sha256,
    /// Bytes written.
    size: u64,
    /// From the request.
    params: FilePushParams,
    /// Owner ids.
    owner: (u32, u32),
    /// Renamed into place: the temporary file is gone.
    done: bool,
}

impl Push {
    /// Validates `params` (owner looked up in `etc`), creates missing parents when asked and
    /// creates the temporary file.
    ///
    /// # Errors
    /// 5100 naming `path`, `mode`, `owner` or `sha256`; -32603 when the file cannot be created.
    pub fn begin(params: FilePushParams, etc: &Path) -> Result<Push, RpcError> {
        check_path(&params.path)?;
        let target = PathBuf::from(&params.path);
        let name = match target.file_name().and_then(|n| n.to_str()) {
            Some(name) if !params.path.ends_with('/') => name.to_string(),
            _ => return Err(RpcError::invalid("path", "path must name a file")),
        };
        let dir = target.parent().map_or_else(|| PathBuf::from("/"), Path::to_path_buf);
        if params.mode > 0o7777 {
            return Err(RpcError::invalid("mode", "mode is at most 0o7777"));
        }
        if params.sha256.len() != 64 || !params.sha256.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(RpcError::invalid("sha256", "sha256 must be 64 lowercase hex digits"));
        }
        let owner = match &params.owner {
            Some(owner) => resolve_owner(owner, &read_users(etc), &read_groups(etc))?,
            None => (0, 0),
        };
        if params.mkdir {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(&dir)
                .map_err(|e| RpcError::invalid("path", format!("cannot create {}: {e}", dir.display())))?;
        }
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(RpcError::invalid("path", format!("{} is not a directory", dir.display()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(RpcError::invalid(
                    "path",
                    format!("the parent directory does not exist (mkdir: true creates it): {}", dir.display()),
                ))
            }
            Err(e) => return Err(RpcError::invalid("path", format!("cannot use {}: {e}", dir.display()))),
        }
        if std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir()) {
            return Err(RpcError::invalid("path", format!("{} is a directory", target.display())));
        }
        let mut attempt = 0;
        let (temp, file) = loop {
            let temp = dir.join(format!(".{name}.vmhost-{}", random_suffix()));
            match OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(&temp)
            {
                Ok(file) => break (temp, file),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 8 => attempt += 1,
                Err(e) => {
                    return Err(RpcError::internal(format!("cannot create a temporary file in {}: {e}", dir.display())))
                }
            }
        };
        Ok(Push {
            target,
            dir,
            temp,
            file: Some(file),
            error: None,
            hasher: Sha256::new(),
            size: 0,
            params,
            owner,
            done: false,
        })
    }

    /// The temporary file's path (while the push is in progress).
    pub fn temp_path(&self) -> &Path {
        &self.temp
    }

    /// Appends content. A write error is kept for [`Push::finish`]; later bytes are dropped.
    pub fn write(&mut self, data: &[u8]) {
        self.hasher.update(data);
        self.size += data.len() as u64;
        if let Some(file) = self.file.as_mut() {
            if let Err(e) = file.write_all(data) {
                self.error = Some(e);
                self.file = None;
            }
        }
    }

    /// Checks the content and puts it in place (see the module documentation).
    ///
    /// # Errors
    /// 5100 (`sha256`) when the content differs from the announced digest; -32603 for a write,
    /// `fchown`, `fchmod`, `fsync` or `rename` failure. The temporary file is removed either way.
    pub fn finish(mut self) -> Result<FilePushReply, RpcError> {
        let digest = hex(&std::mem::take(&mut self.hasher).finalize());
        let file = match (self.file.take(), self.error.take()) {
            (Some(file), None) => file,
            (_, e) => {
                let e = e.map_or_else(|| "unknown".to_string(), |e| e.to_string());
                return Err(RpcError::internal(format!("cannot write {}: {e}", self.temp.display())));
            }
        };
        if self.size != self.params.size {
            return Err(RpcError::internal(format!("{} bytes received, {} announced", self.size, self.params.size)));
        }
        if digest != self.params.sha256 {
            return Err(RpcError::invalid(
                "sha256",
                format!("the content's sha256 is {digest}, not the announced {}", self.params.sha256),
            ));
        }
        let fail = |what: &str, e: io::Error| RpcError::internal(format!("{what} {}: {e}", self.target.display()));
        // Owner before mode: chown clears set-user-id and set-group-id bits.
        std::os::unix::fs::fchown(&file, Some(self.owner.0), Some(self.owner.1))
            .map_err(|e| fail("cannot chown", e))?;
        file.set_permissions(Permissions::from_mode(self.params.mode)).map_err(|e| fail("cannot chmod", e))?;
        file.sync_all().map_err(|e| fail("cannot sync", e))?;
        drop(file);
        std::fs::rename(&self.temp, &self.target).map_err(|e| fail("cannot rename onto", e))?;
        self.done = true;
        // The rename is durable once the directory is; a failure here changes nothing any more.
        if let Ok(dir) = File::open(&self.dir) {
            let _ = dir.sync_all();
        }
        Ok(FilePushReply { size: self.size, sha256: digest })
    }
}

impl Drop for Push {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// Why a pull ended without a reply.
#[derive(Debug)]
pub enum PullError {
    /// Refused or failed before or while reading: answer this.
    Rpc(RpcError),
    /// The content could not be delivered (the host is gone): no answer.
    Send(io::Error),
}

/// `file.pull`: opens `params.path`, refuses a non-regular file or one larger than
/// `max_bytes`, and passes the content to `send` in pieces of at most [`MAX_CHUNK`] bytes.
///
/// # Errors
/// [`PullError::Rpc`] with 5100 (`path`: missing, not a regular file; `max_bytes`: too large,
/// the message says the size) or -32603 for a read error; [`PullError::Send`] when `send` fails.
pub fn pull(
    params: &FilePullParams,
    mut send: impl FnMut(&[u8]) -> io::Result<()>,
) -> Result<FilePullReply, PullError> {
    check_path(&params.path).map_err(PullError::Rpc)?;
    let mut file = File::open(&params.path)
        .map_err(|e| PullError::Rpc(RpcError::invalid("path", format!("cannot open {}: {e}", params.path))))?;
    let meta =
        file.metadata().map_err(|e| PullError::Rpc(RpcError::internal(format!("cannot stat {}: {e}", params.path))))?;
    if !meta.is_file() {
        return Err(PullError::Rpc(RpcError::invalid("path", format!("{} is not a regular file", params.path))));
    }
    if meta.len() > params.max_bytes {
        return Err(PullError::Rpc(RpcError::invalid(
            "max_bytes",
            format!("{} is {} bytes, more than max_bytes {}", params.path, meta.len(), params.max_bytes),
        )));
    }
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(PullError::Rpc(RpcError::internal(format!("cannot read {}: {e}", params.path)))),
        };
        size += n as u64;
        if size > params.max_bytes {
            return Err(PullError::Rpc(RpcError::invalid(
                "max_bytes",
                format!("{} grew beyond max_bytes {} while it was read", params.path, params.max_bytes),
            )));
        }
        hasher.update(&buf[..n]);
        send(&buf[..n]).map_err(PullError::Send)?;
    }
    Ok(FilePullReply { size, sha256: hex(&hasher.finalize()), mode: meta.mode() & 0o7777 })
}

/// sha256 of `data`, lowercase hex.
pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push_params(path: &Path, content: &[u8]) -> FilePushParams {
        FilePushParams {
            path: path.display().to_string(),
            mode: 0o640,
            owner: None,
            size: content.len() as u64,
            sha256: sha256_hex(content),
            mkdir: false,
        }
    }

    /// Pushes `content` as `params` describe, in 3-byte pieces.
    fn push(params: FilePushParams, content: &[u8], etc: &Path) -> Result<FilePushReply, RpcError> {
        let mut p = Push::begin(params, etc)?;
        for piece in content.chunks(3) {
            p.write(piece);
        }
        p.finish()
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        names.sort();
        names
    }

    #[test]
    fn a_push_replaces_the_file_atomically_with_mode_and_digest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("f.conf");
        std::fs::write(&target, b"old").expect("write");
        let content = b"new content\n".repeat(1000);
        let params = push_params(&target, &content);
        let mut p = Push::begin(params.clone(), dir.path()).unwrap_or_else(|e| panic!("{e:?}"));
        let temp = p.temp_path().to_path_buf();
        let name = temp.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        assert!(name.starts_with(".f.conf.vmhost-") && name.len() == ".f.conf.vmhost-".len() + 8, "{name}");
        assert_eq!(std::fs::metadata(&temp).map(|m| m.mode() & 0o777).ok(), Some(0o600));
        p.write(&content[..5000]);
        // Halfway: the target is still the old file.
        assert_eq!(std::fs::read(&target).ok().as_deref(), Some(&b"old"[..]));
        p.write(&content[5000..]);
        let reply = p.finish().unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((reply.size, reply.sha256), (content.len() as u64, params.sha256));
        assert_eq!(std::fs::read(&target).ok(), Some(content));
        assert_eq!(std::fs::metadata(&target).map(|m| m.mode() & 0o7777).ok(), Some(0o640));
        assert_eq!(entries(dir.path()), ["f.conf"], "no temporary file left");
    }

    #[test]
    fn a_wrong_digest_or_an_abandoned_push_leaves_the_old_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("f");
        std::fs::write(&target, b"old").expect("write");
        let mut params = push_params(&target, b"new");
        params.sha256 = sha256_hex(b"other");
        let e = push(params, b"new", dir.path()).err();
        assert_eq!(e.and_then(|e| e.data).map(|d| d["field"].clone()), Some("sha256".into()));
        assert_eq!(std::fs::read(&target).ok().as_deref(), Some(&b"old"[..]));
        assert_eq!(entries(dir.path()), ["f"]);
        // The host went away halfway: the push is dropped unfinished.
        let mut p = Push::begin(push_params(&target, b"new"), dir.path()).unwrap_or_else(|e| panic!("{e:?}"));
        p.write(b"ne");
        drop(p);
        assert_eq!(entries(dir.path()), ["f"]);
        assert_eq!(std::fs::read(&target).ok().as_deref(), Some(&b"old"[..]));
    }

    #[test]
    fn parents_are_created_only_when_asked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("a/b/c.txt");
        let e = push(push_params(&target, b"x"), b"x", dir.path()).err();
        assert!(e.as_ref().is_some_and(|e| e.message.contains("mkdir")), "{e:?}");
        assert!(!dir.path().join("a").exists());
        let mut params = push_params(&target, b"x");
        params.mkdir = true;
        push(params, b"x", dir.path()).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(std::fs::read(&target).ok().as_deref(), Some(&b"x"[..]));
        assert_eq!(std::fs::metadata(dir.path().join("a/b")).map(|m| m.mode() & 0o777).ok(), Some(0o755));
    }

    #[test]
    fn bad_requests_are_refused_by_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let field =
            |p: FilePushParams| Push::begin(p, dir.path()).err().and_then(|e| e.data).map(|d| d["field"].clone());
        let good = push_params(&dir.path().join("f"), b"x");
        for (path, what) in [("relative", "path"), ("/a\0b", "path"), ("/", "path"), ("/tmp/", "path")] {
            let mut p = good.clone();
            p.path = path.into();
            assert_eq!(field(p), Some(what.into()), "{path:?}");
        }
        let mut p = good.clone();
        p.path = dir.path().display().to_string();
        assert_eq!(field(p), Some("path".into()), "a directory");
        let mut p = good.clone();
        p.mode = 0o10000;
        assert_eq!(field(p), Some("mode".into()));
        let mut p = good.clone();
        p.sha256 = p.sha256.to_uppercase();
        assert_eq!(field(p), Some("sha256".into()));
        let mut p = good.clone();
        p.owner = Some("nosuchuser".into());
        assert_eq!(field(p), Some("owner".into()));
        assert_eq!(entries(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn a_symlink_target_is_replaced_not_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep").expect("write");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).expect("symlink");
        push(push_params(&link, b"x"), b"x", dir.path()).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(std::fs::read(&victim).ok().as_deref(), Some(&b"keep"[..]));
        assert!(std::fs::symlink_metadata(&link).is_ok_and(|m| m.is_file()));
    }

    #[test]
    fn a_pull_streams_the_file_and_refuses_big_or_odd_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("data");
        let content: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(&file, &content).expect("write");
        std::fs::set_permissions(&file, Permissions::from_mode(0o604)).expect("chmod");
        let mut got = Vec::new();
        let params = FilePullParams { path: file.display().to_string(), max_bytes: 100_000 };
        let reply = pull(&params, |piece| {
            assert!(piece.len() <= MAX_CHUNK);
            got.extend_from_slice(piece);
            Ok(())
        });
        let reply = reply.unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(got, content);
        assert_eq!((reply.size, reply.sha256, reply.mode), (100_000, sha256_hex(&content), 0o604));
        let refused =
            |path: &Path, max| match pull(&FilePullParams { path: path.display().to_string(), max_bytes: max }, |_| {
                Ok(())
            }) {
                Err(PullError::Rpc(e)) => e.message,
                other => panic!("{other:?}"),
            };
        assert!(refused(&file, 99_999).contains("100000 bytes"));
        assert!(refused(dir.path(), 10).contains("not a regular file"));
        assert!(refused(&dir.path().join("missing"), 10).contains("cannot open"));
        let failed = pull(&params, |_| Err(io::Error::from(io::ErrorKind::BrokenPipe)));
        assert!(matches!(failed, Err(PullError::Send(_))));
    }
}
