//! The virtio-serial port: finding it by name, and serving requests on it across host sessions.
//!
//! Order of use: [`find_port`] resolves the port name to a device (`/dev/virtio-ports/NAME` where
//! udev made that link, else the `vportNpM` whose `/sys/class/virtio-ports/vportNpM/name` matches);
//! [`Port::open`] opens it non-blocking; [`Server::run`] serves until the device itself fails, after
//! which the caller finds and opens it again.
//!
//! Host sessions: the port stays open across them. While no host is connected to the chardev,
//! `poll` on the port reports `POLLHUP` at once and `read` returns 0 (or `EAGAIN`) every time, so
//! the server sleeps [`HANGUP_RETRY`] between looks instead of spinning, and serves again as soon
//! as the hang-up clears. Whatever the previous session left (a partial request in our buffer,
//! unread requests in the device, half a reply on the wire) is dealt with by the protocol's resync
//! rule (see [`crate::protocol`]): the server does not try to tell sessions apart itself, because
//! reading or dropping bytes around a reconnection would race with the new host's first bytes.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::log;
use crate::protocol::{handle_frame, LineBuffer, Methods};

/// The port name the host's chardev is attached to.
pub const PORT_NAME: &str = "org.vmhost.agent.0";

/// How long to wait between looks while the host is disconnected.
pub const HANGUP_RETRY: Duration = Duration::from_millis(200);

/// How long one reply may wait for room in the port before it is dropped (a host that does not
/// read).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often, while no host is connected, the server checks that its device still exists.
pub const RECHECK: Duration = Duration::from_secs(5);

/// How long one wait for input lasts before the loop looks again.
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Finds the device of the virtio-serial port called `name`: `dev/virtio-ports/NAME` when udev
/// created it, otherwise `dev/vportNpM` for the `class/NAME` entry under `sys_class` whose `name`
/// file matches. `dev` is `/dev` and `sys_class` `/sys/class/virtio-ports` outside tests.
pub fn find_port(name: &str, dev: &Path, sys_class: &Path) -> Option<PathBuf> {
    let link = dev.join("virtio-ports").join(name);
    if link.exists() {
        return Some(link);
    }
    let mut entries: Vec<_> = std::fs::read_dir(sys_class).ok()?.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    entries.into_iter().find_map(|entry| {
        let found = std::fs::read(entry.path().join("name")).ok()?;
        (String::from_utf8_lossy(&found).trim_end() == name).then(|| dev.join(entry.file_name()))
    })
}

/// What one wait on the port found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Bytes can be read.
    Readable,
    /// No host is connected (`POLLHUP`).
    HangUp,
    /// Nothing happened within the timeout.
    Idle,
}

/// An open port (or, in tests, any stream descriptor).
pub struct Port {
    /// The non-blocking descriptor.
    fd: OwnedFd,
}

/// Polls `fd` for `events` up to `timeout`; returns the `revents`, 0 on timeout or signal.
fn poll(fd: &OwnedFd, events: libc::c_short, timeout: Duration) -> io::Result<libc::c_short> {
    let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events, revents: 0 };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let err = io::Error::last_os_error();
        return if err.kind() == io::ErrorKind::Interrupted { Ok(0) } else { Err(err) };
    }
    Ok(if n == 0 { 0 } else { pfd.revents })
}

impl AsRawFd for Port {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

impl Port {
    /// Opens the device at `path` read-write and non-blocking.
    ///
    /// # Errors
    /// The `open` error (`EBUSY` when another process has the port open: a virtio-serial port has
    /// one opener at a time).
    pub fn open(path: &Path) -> io::Result<Port> {
        let c_path =
            CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a NUL-terminated path; the result is checked.
        let fd =
            unsafe { libc::open(c_path.as_ptr(), libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(Port { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Wraps an already open descriptor, switching it to non-blocking mode.
    ///
    /// # Errors
    /// The `fcntl` error.
    pub fn from_fd(fd: OwnedFd) -> io::Result<Port> {
        // SAFETY: fcntl on a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Port { fd })
    }

    /// True when `path` is still the device this port has open (same device number), false when
    /// it is gone or is now another device.
    pub fn is_at(&self, path: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: a zeroed stat is valid storage for fstat to fill.
        let mut ours: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a descriptor we own, into `ours`.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), &mut ours) } != 0 {
            return false;
        }
        std::fs::metadata(path)
            .is_ok_and(|m| m.dev() == ours.st_dev && m.ino() == ours.st_ino && m.rdev() == ours.st_rdev)
    }

    /// Waits up to `timeout` for input or a hang-up.
    ///
    /// # Errors
    /// The `poll` error, or `InvalidInput` when the descriptor is no longer valid (`POLLNVAL`).
    pub fn wait(&self, timeout: Duration) -> io::Result<Readiness> {
        let revents = poll(&self.fd, libc::POLLIN, timeout)?;
        if revents & libc::POLLNVAL != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "port descriptor is not valid"));
        }
        // POLLHUP wins over POLLIN: bytes left from the session that ended are read once a host is
        // back (and answered into the new session, where the host's resync discards the answers).
        if revents & libc::POLLHUP != 0 {
            Ok(Readiness::HangUp)
        } else if revents & (libc::POLLIN | libc::POLLERR) != 0 {
            Ok(Readiness::Readable)
        } else {
            Ok(Readiness::Idle)
        }
    }

    /// Reads what is available into `buf`; `Ok(0)` means end of file (no host) or nothing to read.
    ///
    /// # Errors
    /// A `read` error other than `EAGAIN` and `EINTR`.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: the pointer and length describe `buf`.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let err = io::Error::last_os_error();
            return match err.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
                _ => Err(err),
            };
        }
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Writes all of `data` within `timeout`.
    ///
    /// # Errors
    /// `BrokenPipe` when the host disconnects meanwhile, `TimedOut` when it does not read, or the
    /// `write` error. What was not written is dropped (the resync rule copes with the half line).
    pub fn write_all(&self, mut data: &[u8], timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        while !data.is_empty() {
            // SAFETY: the pointer and length describe `data`.
            let n = unsafe { libc::write(self.fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
            if n >= 0 {
                data = &data[usize::try_from(n).unwrap_or(0)..];
                continue;
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {}
                _ => return Err(err),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "host does not read"));
            }
            let revents = poll(&self.fd, libc::POLLOUT, left.min(POLL_INTERVAL))?;
            if revents & (libc::POLLHUP | libc::POLLERR) != 0 {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, "host disconnected"));
            }
        }
        Ok(())
    }
}

/// Serves requests on a [`Port`] for as long as it works.
pub struct Server<M: Methods> {
    /// The port.
    port: Port,
    /// Input cut into frames.
    buffer: LineBuffer,
    /// The request handlers.
    methods: M,
    /// Whether the last look saw a host (for logging transitions only).
    connected: Option<bool>,
    /// Read buffer.
    chunk: Vec<u8>,
}

impl<M: Methods> Server<M> {
    /// A server for `port` answering with `methods`.
    pub fn new(port: Port, methods: M) -> Server<M> {
        Server { port, buffer: LineBuffer::new(), methods, connected: None, chunk: vec![0; 16 * 1024] }
    }

    /// Notes whether a host is connected, logging changes.
    fn note(&mut self, connected: bool) {
        if self.connected != Some(connected) {
            log(if connected { "host connected" } else { "no host connected; waiting" });
            self.connected = Some(connected);
        }
    }

    /// One round: waits up to `timeout` for input, reads it, answers every complete request.
    /// Returns what the wait found.
    ///
    /// # Errors
    /// A read or poll error of the port itself (not a disconnect, which is [`Readiness::HangUp`]).
    pub fn turn(&mut self, timeout: Duration) -> io::Result<Readiness> {
        let readiness = self.port.wait(timeout)?;
        if readiness != Readiness::Readable {
            return Ok(readiness);
        }
        let n = self.port.read(&mut self.chunk)?;
        if n == 0 {
            // End of file: the host side is closed (a stream socket in tests behaves the same).
            return Ok(Readiness::HangUp);
        }
        let mut replies = Vec::new();
        let methods = &mut self.methods;
        self.buffer.push(&self.chunk[..n], |frame| replies.extend(handle_frame(&frame, methods)));
        for mut reply in replies {
            reply.push('\n');
            if let Err(e) = self.port.write_all(reply.as_bytes(), WRITE_TIMEOUT) {
                log(&format!("reply dropped: {e}"));
                if e.kind() == io::ErrorKind::BrokenPipe {
                    return Ok(Readiness::HangUp);
                }
            }
        }
        Ok(Readiness::Readable)
    }

    /// Serves until the port fails: sleeps [`HANGUP_RETRY`] between looks while no host is
    /// connected, answers requests while one is.
    ///
    /// While no host is connected, `still_there` is asked every [`RECHECK`] whether the device is
    /// still the one that was opened (a hot-unplugged port just looks disconnected forever); when
    /// it says no, serving ends so that the caller finds the port again.
    ///
    /// # Errors
    /// Only returns, with the error that ended serving; the caller reopens the port.
    pub fn run(&mut self, mut still_there: impl FnMut(&Port) -> bool) -> io::Error {
        let mut last_check = Instant::now();
        loop {
            match self.turn(POLL_INTERVAL) {
                Ok(Readiness::HangUp) => {
                    self.note(false);
                    if last_check.elapsed() >= RECHECK {
                        last_check = Instant::now();
                        if !still_there(&self.port) {
                            return io::Error::new(io::ErrorKind::NotFound, "the port device went away");
                        }
                    }
                    std::thread::sleep(HANGUP_RETRY);
                }
                Ok(_) => self.note(true),
                Err(e) => return e,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::RpcError;
    use serde_json::{json, Value};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    struct Echo;

    impl Methods for Echo {
        fn call(&mut self, method: &str, params: Option<Value>) -> Result<Value, RpcError> {
            Ok(json!({ "method": method, "params": params }))
        }
    }

    #[test]
    fn ports_are_found_by_name_with_and_without_udev() {
        let root = tempfile::tempdir().expect("tempdir");
        let dev = root.path().join("dev");
        let sys = root.path().join("sys/class/virtio-ports");
        for (port, name) in [("vport1p1", "org.qemu.guest_agent.0"), ("vport2p1", PORT_NAME)] {
            std::fs::create_dir_all(sys.join(port)).expect("mkdir");
            std::fs::write(sys.join(port).join("name"), format!("{name}\n")).expect("write");
        }
        std::fs::create_dir_all(&dev).expect("mkdir");
        assert_eq!(find_port(PORT_NAME, &dev, &sys), Some(dev.join("vport2p1")));
        assert_eq!(find_port("org.other", &dev, &sys), None);
        assert_eq!(find_port(PORT_NAME, &dev, &root.path().join("missing")), None);
        // A udev link wins.
        std::fs::create_dir_all(dev.join("virtio-ports")).expect("mkdir");
        std::fs::write(dev.join("virtio-ports").join(PORT_NAME), "").expect("write");
        assert_eq!(find_port(PORT_NAME, &dev, &sys), Some(dev.join("virtio-ports").join(PORT_NAME)));
    }

    #[test]
    fn serves_split_requests_and_reports_the_hang_up() {
        let (agent_end, mut host) = UnixStream::pair().expect("socketpair");
        let mut server = Server::new(Port::from_fd(OwnedFd::from(agent_end)).expect("port"), Echo);
        assert_eq!(server.turn(Duration::from_millis(10)).expect("turn"), Readiness::Idle);
        host.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"met").expect("write");
        assert_eq!(server.turn(Duration::from_secs(1)).expect("turn"), Readiness::Readable);
        host.write_all(b"hod\":\"a\"}\n\xff\n").expect("write");
        assert_eq!(server.turn(Duration::from_secs(1)).expect("turn"), Readiness::Readable);
        let mut got = vec![0u8; 4096];
        let n = host.read(&mut got).expect("read");
        let text = String::from_utf8_lossy(&got[..n]).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], r#"{"jsonrpc":"2.0","id":1,"result":{"method":"a","params":null}}"#);
        assert!(lines[1].contains("-32700"), "{text}");
        drop(host);
        assert_eq!(server.turn(Duration::from_secs(1)).expect("turn"), Readiness::HangUp);
    }

    #[test]
    fn a_replaced_or_vanished_device_is_noticed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vport0p1");
        std::fs::write(&path, "").expect("create");
        let port = Port::open(&path).expect("open");
        assert!(port.is_at(&path));
        // Replaced while we hold the old one open (so its inode cannot be reused), then gone.
        let other = dir.path().join("new");
        std::fs::write(&other, "").expect("create");
        std::fs::rename(&other, &path).expect("replace");
        assert!(!port.is_at(&path), "another file now");
        std::fs::remove_file(&path).expect("remove");
        assert!(!port.is_at(&path), "gone");
    }

    #[test]
    fn a_host_that_does_not_read_costs_a_bounded_wait() {
        let (agent_end, host) = UnixStream::pair().expect("socketpair");
        let port = Port::from_fd(OwnedFd::from(agent_end)).expect("port");
        let big = vec![b'x'; 4 << 20];
        let start = Instant::now();
        let err = port.write_all(&big, Duration::from_millis(200)).expect_err("host never reads");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() < Duration::from_secs(2));
        drop(host);
        let err = port.write_all(&big, Duration::from_secs(5)).expect_err("host gone");
        assert!(matches!(err.kind(), io::ErrorKind::BrokenPipe), "{err}");
    }
}
