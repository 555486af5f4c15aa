//! The environment and inherited descriptors: nothing the daemon did not ask for survives.
//!
//! Whoever starts vmhostd may hand it variables (`LD_PRELOAD` has no effect any more at this
//! point, but `PATH`, `HOME`, locale and proxy settings would reach every library call and, in
//! the unsandboxed past, QEMU) and open descriptors (a terminal, a leaked socket of the service
//! manager). [`clear_env`] removes every variable except the service manager's socket-activation
//! and notification variables ([`KEPT_VARS`]); [`close_stray_fds`] closes every descriptor above
//! stderr except the ones socket activation passed (`LISTEN_FDS` starting at 3, when
//! `LISTEN_PID` is this process). Both run while the process has a single thread.

use std::os::fd::RawFd;

/// Variables kept: systemd's socket activation (`LISTEN_*`) and readiness (`NOTIFY_SOCKET`).
pub const KEPT_VARS: &[&str] = &["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "NOTIFY_SOCKET"];

/// Removes every environment variable not in [`KEPT_VARS`]. Returns how many were removed.
///
/// Must run while the process has one thread (before the async runtime).
pub fn clear_env() -> usize {
    let names: Vec<std::ffi::OsString> =
        std::env::vars_os().map(|(k, _)| k).filter(|k| !KEPT_VARS.iter().any(|kept| k == kept)).collect();
    for k in &names {
        // Single-threaded here: nothing reads the environment concurrently.
        std::env::remove_var(k);
    }
    names.len()
}

/// The descriptors socket activation passed to this process: `3 .. 3 + LISTEN_FDS` when
/// `LISTEN_PID` is our pid, else none.
pub fn activation_fds(listen_pid: Option<&str>, listen_fds: Option<&str>, our_pid: u32) -> std::ops::Range<RawFd> {
    let ours = listen_pid.and_then(|p| p.trim().parse::<u32>().ok()) == Some(our_pid);
    let n = listen_fds.and_then(|n| n.trim().parse::<RawFd>().ok()).filter(|n| (0..=1024).contains(n)).unwrap_or(0);
    if ours {
        3..3 + n
    } else {
        3..3
    }
}

/// Closes every descriptor above 2 that is not in `keep`. Returns the closed ones.
///
/// # Errors
/// `/proc/self/fd` cannot be listed.
pub fn close_stray_fds(keep: std::ops::Range<RawFd>) -> std::io::Result<Vec<RawFd>> {
    let mut fds: Vec<RawFd> = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd")? {
        if let Some(fd) = e?.file_name().to_str().and_then(|s| s.parse::<RawFd>().ok()) {
            fds.push(fd);
        }
    }
    // The directory's own descriptor was in the listing and is closed by now.
    let mut closed = Vec::new();
    for fd in fds {
        if fd > 2 && !keep.contains(&fd) {
            // SAFETY: closing a descriptor nothing in this single-threaded process owns yet
            // (std and tokio have not opened any at this point); EBADF (the read_dir fd) is fine.
            if unsafe { libc::close(fd) } == 0 {
                closed.push(fd);
            }
        }
    }
    Ok(closed)
}

/// Sets no_new_privs: no execve by this process or its children can gain privileges (setuid
/// bits, file capabilities). Required by Landlock and seccomp without CAP_SYS_ADMIN.
///
/// # Errors
/// prctl failed.
pub fn set_no_new_privs() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// True when no_new_privs is set on this process.
pub fn no_new_privs() -> bool {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_fds_only_for_this_pid() {
        assert_eq!(activation_fds(Some("42"), Some("2"), 42), 3..5);
        assert_eq!(activation_fds(Some("41"), Some("2"), 42), 3..3);
        assert_eq!(activation_fds(None, Some("2"), 42), 3..3);
        assert_eq!(activation_fds(Some("42"), Some("x"), 42), 3..3);
        assert_eq!(activation_fds(Some("42"), Some("-1"), 42), 3..3);
    }
}
