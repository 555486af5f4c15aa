//! The socket's directory must be the daemon's: owned by root (or the user vmhostd runs as) and
//! writable by nobody else.
//!
//! Whoever may write the directory can rename or remove the socket file and put their own socket
//! at its path: clients (Salt, Puppet, vmhostctl as root) would then send their requests, VM
//! specs included, to an impostor. So vmhostd refuses to start when the directory is group- or
//! world-writable or owned by another user, and says which and how to fix it. Used once at start:
//! [`check`] on the directory of `paths.socket` after creating it (or of the socket systemd
//! passed), which reads its owner and mode and applies the pure [`judge`].

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Why the directory is refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SocketDirError {
    /// Its owner is neither root nor the daemon's user.
    #[error(
        "the socket's directory {} is owned by uid {owner}: it must be owned by root (or the user vmhostd runs as, uid {daemon}); chown it or choose another paths.socket",
        dir.display()
    )]
    Owner {
        /// The directory.
        dir: PathBuf,
        /// Its owner.
        owner: u32,
        /// The daemon's effective uid.
        daemon: u32,
    },
    /// Its group or others may write it.
    #[error(
        "the socket's directory {} has mode {mode:04o}: group or others may write it, so they could replace the socket; make it 0755 or stricter (chmod go-w) or choose another paths.socket",
        dir.display()
    )]
    Writable {
        /// The directory.
        dir: PathBuf,
        /// Its permission bits (with sticky, setgid, setuid).
        mode: u32,
    },
    /// It is not a directory, or cannot be inspected.
    #[error("the socket's directory {} cannot be checked: {why}", dir.display())]
    Unreadable {
        /// The directory.
        dir: PathBuf,
        /// What went wrong.
        why: String,
    },
}

impl From<SocketDirError> for std::io::Error {
    fn from(e: SocketDirError) -> Self {
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string())
    }
}

/// The rule: `owner` must be root or `daemon`, and `mode` must not let group or others write.
///
/// # Errors
/// The [`SocketDirError`] saying which part of the rule is broken.
pub fn judge(dir: &Path, owner: u32, mode: u32, daemon: u32) -> Result<(), SocketDirError> {
    if owner != 0 && owner != daemon {
        return Err(SocketDirError::Owner { dir: dir.to_path_buf(), owner, daemon });
    }
    if mode & 0o022 != 0 {
        return Err(SocketDirError::Writable { dir: dir.to_path_buf(), mode: mode & 0o7777 });
    }
    Ok(())
}

/// Checks the directory `dir` (following symbolic links: the directory the socket really is in).
///
/// # Errors
/// As [`judge`], or [`SocketDirError::Unreadable`].
pub fn check(dir: &Path) -> Result<(), SocketDirError> {
    let unreadable = |why: String| SocketDirError::Unreadable { dir: dir.to_path_buf(), why };
    let meta = std::fs::metadata(dir).map_err(|e| unreadable(e.to_string()))?;
    if !meta.is_dir() {
        return Err(unreadable("not a directory".into()));
    }
    judge(dir, meta.uid(), meta.mode(), nix::unistd::geteuid().as_raw())
}

/// The directory a socket path is in (`.` for a bare file name).
pub fn parent_of(socket: &Path) -> PathBuf {
    match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_the_daemons_own_unshared_directories_pass() {
        let d = Path::new("/run/vmhost");
        assert_eq!(judge(d, 0, 0o40755, 0), Ok(()));
        assert_eq!(judge(d, 0, 0o700, 0), Ok(()));
        assert_eq!(judge(d, 1000, 0o755, 1000), Ok(()), "the daemon's own user");
        assert_eq!(judge(d, 0, 0o755, 1000), Ok(()), "root's directory for a non-root daemon");
        assert!(matches!(judge(d, 1000, 0o755, 0), Err(SocketDirError::Owner { owner: 1000, .. })));
        assert!(matches!(judge(d, 0, 0o1777, 0), Err(SocketDirError::Writable { mode: 0o1777, .. })));
        assert!(matches!(judge(d, 0, 0o775, 0), Err(SocketDirError::Writable { .. })));
        assert!(matches!(judge(d, 0, 0o757, 0), Err(SocketDirError::Writable { .. })));
        let msg = judge(d, 0, 0o1777, 0).unwrap_err().to_string();
        assert!(msg.contains("/run/vmhost") && msg.contains("1777") && msg.contains("chmod go-w"), "{msg}");
    }

    #[test]
    fn checks_real_directories() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(check(dir.path()), Ok(()));
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(check(dir.path()), Err(SocketDirError::Writable { .. })));
        let file = dir.path().join("f");
        std::fs::write(&file, b"").unwrap();
        assert!(matches!(check(&file), Err(SocketDirError::Unreadable { .. })));
        assert_eq!(parent_of(Path::new("s.sock")), PathBuf::from("."));
        assert_eq!(parent_of(Path::new("/run/vmhost/s.sock")), PathBuf::from("/run/vmhost"));
    }
}
