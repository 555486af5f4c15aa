//! The API socket's permission bits, set at creation instead of by a later `chmod`.
//!
//! A Unix socket's file gets `0777 & !umask` when it is bound, and the daemon's seccomp table
//! has no path-based `chmod` (a compromised daemon must not be able to open up a device node by
//! name, [`super::seccomp`]). The umask is process-wide, and other threads may create files or
//! directories at the same moment, so [`bind`] changes it only in a short-lived thread that
//! first gave itself a private copy of its file-system attributes (`unshare(CLONE_FS)`, which
//! creates no namespace and is the one `unshare` the table allows).

use std::io;
use std::os::unix::net::UnixListener;
use std::path::Path;

/// Binds a listening socket at `path` whose file has exactly the permission bits `mode`
/// (`mode & 0o777`), without touching the umask of the daemon's other threads.
///
/// # Errors
/// The thread could not be started, `unshare(CLONE_FS)` failed, or binding failed.
pub fn bind(path: &Path, mode: u32) -> io::Result<UnixListener> {
    let path = path.to_path_buf();
    std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: unshare with a flag, in this thread only.
            if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: umask takes a plain integer; it now applies to this thread only.
            unsafe { libc::umask(!mode & 0o777) };
            UnixListener::bind(&path)
        })
        .join()
        .map_err(|_| io::Error::other("the socket thread panicked"))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_socket_gets_the_mode_and_the_process_keeps_its_umask() {
        let dir = tempfile::tempdir().unwrap();
        for mode in [0o666, 0o660, 0o600] {
            let path = dir.path().join(format!("s{mode:o}"));
            let _l = bind(&path, mode).unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, mode);
        }
        // The process umask is untouched: a new file still gets the usual bits.
        // SAFETY: umask read-and-restore.
        let ours = unsafe { libc::umask(0o022) };
        // SAFETY: as above.
        unsafe { libc::umask(ours) };
        assert_ne!(ours, !0o600 & 0o777, "the thread's umask did not leak");
    }
}
