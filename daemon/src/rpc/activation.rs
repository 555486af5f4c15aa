//! systemd socket activation and readiness notification, without libsystemd.
//!
//! Socket activation (`sd_listen_fds(3)`): the service manager binds and listens on the API socket
//! itself (`vmhostd.socket`) and starts vmhostd with the listening socket as file descriptor 3,
//! `LISTEN_FDS=1` and `LISTEN_PID` set to vmhostd's pid. The socket then exists before the daemon
//! runs and survives its restarts: clients connecting while vmhostd restarts wait in the backlog
//! instead of failing.
//!
//! Readiness (`sd_notify(3)`): with `Type=notify` the manager passes `NOTIFY_SOCKET`, and
//! vmhostd sends `READY=1` once the socket serves (VMs already re-adopted) and `STOPPING=1` when
//! it shuts down.
//!
//! Start-up order: [`Activation::from_env`] first, before anything forks, so the inherited socket
//! is close-on-exec before any program could inherit it; then whatever else must run while the
//! process has one thread (it must keep descriptor 3 and these variables: the daemon's sandbox
//! does); then [`remove_env`] (as `sd_listen_fds(1)` does), so QEMU and every other child starts
//! without the variables. Both must run before any other thread exists: changing the environment
//! is not thread-safe.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::{UnixDatagram, UnixListener};

/// The first inherited descriptor (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

/// Why the inherited environment cannot be used. The daemon refuses to start on any of these:
/// serving somewhere else than where systemd listens would leave clients hanging.
#[derive(Debug, PartialEq, Eq)]
pub enum ActivationError {
    /// `LISTEN_PID` or `LISTEN_FDS` is not a number.
    Malformed { var: &'static str, value: String },
    /// More than one descriptor was passed; vmhostd serves exactly one socket.
    TooMany(usize),
    /// Descriptor 3 is not a listening Unix stream socket.
    NotAListener(String),
}

impl fmt::Display for ActivationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ActivationError::Malformed { var, value } => {
                write!(f, "socket activation: {var}={value:?} is not a number")
            }
            ActivationError::TooMany(n) => {
                write!(f, "socket activation: {n} sockets passed (LISTEN_FDS); vmhostd serves exactly one")
            }
            ActivationError::NotAListener(why) => write!(f, "socket activation: descriptor 3 {why}"),
        }
    }
}

impl std::error::Error for ActivationError {}

/// What the service manager handed over.
#[derive(Debug, Default)]
pub struct Activation {
    /// The inherited listening socket, if vmhostd was socket-activated.
    pub listener: Option<UnixListener>,
    /// `NOTIFY_SOCKET`, if the manager wants readiness notifications.
    notify: Option<OsString>,
}

impl Activation {
    /// Takes the inherited socket (made close-on-exec) and the notification address from the
    /// environment. The variables stay until [`remove_env`].
    ///
    /// Call this once, before starting any thread (the async runtime included) or process.
    ///
    /// # Errors
    ///
    /// When the variables are addressed to this process but malformed, name more than one socket,
    /// or descriptor 3 is not a listening `AF_UNIX` `SOCK_STREAM` socket.
    pub fn from_env() -> Result<Activation, ActivationError> {
        let pid = std::env::var_os("LISTEN_PID");
        let fds = std::env::var_os("LISTEN_FDS");
        let notify = std::env::var_os("NOTIFY_SOCKET").filter(|s| !s.is_empty());
        let count = listen_fds(
            pid.as_ref().map(|s| s.to_string_lossy()).as_deref(),
            fds.as_ref().map(|s| s.to_string_lossy()).as_deref(),
            std::process::id(),
        )?;
        // Whatever was passed must not leak into QEMU, even when it is refused below.
        for fd in (0..count).filter_map(|i| RawFd::try_from(i).ok()).map(|i| LISTEN_FDS_START + i) {
            set_cloexec(fd);
        }
        let listener = match count {
            0 => None,
            1 => {
                check_listener(LISTEN_FDS_START)?;
                // SAFETY: descriptor 3 was handed to this process for it to own (LISTEN_PID is our
                // pid), it is open (check_listener's getsockopt calls succeeded), and nothing else
                // in this process refers to it.
                Some(unsafe { UnixListener::from_raw_fd(LISTEN_FDS_START) })
            }
            n => return Err(ActivationError::TooMany(n)),
        };
        Ok(Activation { listener, notify })
    }

    /// Sends `state` (e.g. `READY=1`) to the service manager when it asked for notifications;
    /// does nothing otherwise. A failure is returned for logging; it never stops the daemon.
    ///
    /// # Errors
    ///
    /// When `NOTIFY_SOCKET` is not a usable address or the datagram cannot be sent.
    pub fn notify(&self, state: &str) -> io::Result<()> {
        let Some(addr) = &self.notify else { return Ok(()) };
        let socket = UnixDatagram::unbound()?;
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(addr.as_os_str());
        match bytes.split_first() {
            // An abstract socket address: `@` stands for the leading NUL byte.
            Some((b'@', name)) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                socket.send_to_addr(state.as_bytes(), &addr)?;
            }
            Some((b'/', _)) => {
                socket.send_to(state.as_bytes(), addr)?;
            }
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("NOTIFY_SOCKET={addr:?} is not a path"),
                ))
            }
        }
        Ok(())
    }
}

/// The variables of socket activation and readiness notification.
pub const VARIABLES: [&str; 4] = ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "NOTIFY_SOCKET"];

/// Removes [`VARIABLES`] from the environment, so that no child inherits them.
///
/// Call this before starting any thread: changing the environment is not thread-safe.
pub fn remove_env() {
    for var in VARIABLES {
        std::env::remove_var(var);
    }
}

/// How many descriptors were passed to the process `my_pid`, by `sd_listen_fds` rules: none when
/// `LISTEN_PID` is absent or names another process (the variables were inherited from a parent
/// that was activated itself), else `LISTEN_FDS`.
///
/// # Errors
///
/// When a variable that counts is not a number.
pub fn listen_fds(pid: Option<&str>, fds: Option<&str>, my_pid: u32) -> Result<usize, ActivationError> {
    let Some(pid) = pid else { return Ok(0) };
    let pid: u32 =
        pid.trim().parse().map_err(|_| ActivationError::Malformed { var: "LISTEN_PID", value: pid.to_string() })?;
    if pid != my_pid {
        return Ok(0);
    }
    let Some(fds) = fds else { return Ok(0) };
    fds.trim().parse().map_err(|_| ActivationError::Malformed { var: "LISTEN_FDS", value: fds.to_string() })
}

/// Marks `fd` close-on-exec; a descriptor that is not open is left alone.
fn set_cloexec(fd: RawFd) {
    // SAFETY: fcntl on a plain integer only reads or sets the descriptor's flags; EBADF is harmless.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
        }
    }
}

/// Checks that `fd` is a listening `AF_UNIX` `SOCK_STREAM` socket.
///
/// # Errors
///
/// [`ActivationError::NotAListener`] saying what it is instead.
pub fn check_listener(fd: RawFd) -> Result<(), ActivationError> {
    let not = |why: String| ActivationError::NotAListener(why);
    let domain = sockopt(fd, libc::SO_DOMAIN).map_err(|e| not(format!("is not a socket ({e})")))?;
    if domain != libc::AF_UNIX {
        return Err(not(format!("is not a Unix socket (address family {domain})")));
    }
    let kind = sockopt(fd, libc::SO_TYPE).map_err(|e| not(format!("is not a socket ({e})")))?;
    if kind != libc::SOCK_STREAM {
        return Err(not(format!("is not a stream socket (type {kind}); use ListenStream=")));
    }
    let listening = sockopt(fd, libc::SO_ACCEPTCONN).map_err(|e| not(format!("is not a socket ({e})")))?;
    if listening == 0 {
        return Err(not("is not listening (Accept=yes is not supported)".into()));
    }
    Ok(())
}

/// An integer `SOL_SOCKET` option of `fd`.
fn sockopt(fd: RawFd, option: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).unwrap_or(4);
    // SAFETY: value and len are valid for writes of the sizes given.
    let rc = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, option, std::ptr::addr_of_mut!(value).cast(), &mut len) };
    if rc == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn counts_only_descriptors_addressed_to_this_process() {
        assert_eq!(listen_fds(None, None, 42), Ok(0));
        assert_eq!(listen_fds(None, Some("1"), 42), Ok(0));
        assert_eq!(listen_fds(Some("41"), Some("1"), 42), Ok(0));
        assert_eq!(listen_fds(Some("42"), Some("1"), 42), Ok(1));
        assert_eq!(listen_fds(Some("42"), Some("2"), 42), Ok(2));
        assert_eq!(listen_fds(Some("42"), None, 42), Ok(0));
        assert_eq!(listen_fds(Some("42"), Some("0"), 42), Ok(0));
    }

    #[test]
    fn refuses_malformed_variables() {
        assert!(matches!(
            listen_fds(Some("x"), Some("1"), 42),
            Err(ActivationError::Malformed { var: "LISTEN_PID", .. })
        ));
        assert!(matches!(
            listen_fds(Some("42"), Some("-1"), 42),
            Err(ActivationError::Malformed { var: "LISTEN_FDS", .. })
        ));
        // Not addressed to us: LISTEN_FDS is not even looked at.
        assert_eq!(listen_fds(Some("41"), Some("junk"), 42), Ok(0));
    }

    #[test]
    fn accepts_only_listening_unix_stream_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join("s")).unwrap();
        assert_eq!(check_listener(listener.as_raw_fd()), Ok(()));

        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let err = check_listener(a.as_raw_fd()).unwrap_err().to_string();
        assert!(err.contains("not listening"), "{err}");

        let dgram = UnixDatagram::unbound().unwrap();
        let err = check_listener(dgram.as_raw_fd()).unwrap_err().to_string();
        assert!(err.contains("not a stream socket"), "{err}");

        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let err = check_listener(tcp.as_raw_fd()).unwrap_err().to_string();
        assert!(err.contains("not a Unix socket"), "{err}");

        let file = std::fs::File::open("/dev/null").unwrap();
        let err = check_listener(file.as_raw_fd()).unwrap_err().to_string();
        assert!(err.contains("is not a socket"), "{err}");
    }

    #[test]
    fn notifies_path_and_abstract_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let receiver = UnixDatagram::bind(&path).unwrap();
        let act = Activation { listener: None, notify: Some(path.clone().into_os_string()) };
        act.notify("READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = receiver.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("vmhost-test-notify-{}", std::process::id());
        let abs = UnixDatagram::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let act = Activation { listener: None, notify: Some(format!("@{name}").into()) };
        act.notify("STOPPING=1").unwrap();
        let n = abs.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");

        assert!(Activation::default().notify("READY=1").is_ok(), "no NOTIFY_SOCKET: nothing to do");
        let bad = Activation { listener: None, notify: Some("relative".into()) };
        assert!(bad.notify("READY=1").is_err());
    }
}
