//! The protocol between the daemon and its spawner, both ends of it.
//!
//! One `SOCK_SEQPACKET` control socket pair ([`control_pair`]) carries requests, one record
//! each: a JSON [`Request`] with descriptors attached (`SCM_RIGHTS`), the first of them always a
//! fresh per-request reply socket. On that reply socket the spawner writes [`Reply`] lines,
//! again with descriptors where a reply carries one (a pidfd, a boot file's sealed copy).
//!
//! In the order they are used: [`install`] makes the daemon's end the process-wide
//! [`Control`] ([`spawner`] reads it back); [`send_request`] sends one request and returns the
//! reply socket; [`next_message`] reads each reply line there and [`reply_error`] turns an error
//! reply back into an `io::Error` of the same kind. The spawner side reads with
//! [`recv_with_fds`] and answers with [`send_reply`]. What a request does is not decided here:
//! the client ([`super::client`], [`super::requests`]) makes them, the server
//! ([`super::server`]) checks and serves them.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
};
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::setup::MAX_PASSED_FDS;
use crate::qemu::kvm::Access;

/// Largest request the spawner reads (argv as JSON).
pub(super) const MAX_REQUEST: usize = 256 * 1024;

/// The daemon's connection to its spawner, once [`crate::sandbox::enter`] forked one.
static SPAWNER: OnceLock<Control> = OnceLock::new();

/// The daemon's end of the control socket, non-blocking.
///
/// Requests are sent with a non-blocking `sendmsg`; when the socket is full (the spawner is busy
/// copying a boot file, or stalled) the sending task waits for writability on the runtime's
/// reactor instead of blocking its worker thread, so a stalled spawner delays only the tasks
/// that need it. No lock is needed: on a `SOCK_SEQPACKET` socket each `sendmsg` is one whole
/// record, so concurrent senders never interleave. (The alternative, a blocking `sendmsg` on
/// `spawn_blocking` behind a tokio mutex, would still let every waiting request pin one thread
/// of the blocking pool for as long as the spawner stalls; readiness pins none.)
#[derive(Debug)]
pub(crate) struct Control {
    fd: OwnedFd,
}

/// A request to the spawner. The reply socket always travels first among the descriptors.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum Request {
    /// Start a program ([`RunRequest`]).
    Run(RunRequest),
    /// Open a kernel or initrd ([`crate::qemu::boot_files`]) and, with `copy`, send back its
    /// sealed copy (from the spawner's [`crate::qemu::boot_files::CopyCache`]); without, only
    /// whether it can be opened.
    BootFile {
        /// The file a spec names.
        path: String,
        /// Copy it (a launch) or only open it (the check before anything starts).
        copy: bool,
    },
    /// Whether QEMU's user, with the groups QEMU gets, can open `/dev/kvm`.
    KvmAccess,
    /// Open TPM state file `name` ([`crate::tpm::STATE_FILE_NAMES`]) in the state directory
    /// passed after the reply socket, with `CAP_DAC_READ_SEARCH` raised for the open
    /// ([`crate::tpm::open_state_file`]); the reply's `ok` carries it.
    TpmStateFile {
        /// The file's name in the directory.
        name: String,
    },
    /// Write the bytes of the file passed second as TPM state file `name` in the state
    /// directory passed first, as `qemu.user` ([`crate::tpm::write_state_file_as`]).
    TpmStatePlace {
        /// The file's name in the directory.
        name: String,
    },
    /// Give the VFIO group node `/dev/vfio/GROUP` group `gid` and permission bits `mode`
    /// (within [`super::VFIO_NODE_MODES`]); the reply's `node` is what it had before.
    VfioNode {
        /// The IOMMU group number (the spawner makes the path itself).
        group: u32,
        /// The node's new group.
        gid: u32,
        /// The node's new permission bits.
        mode: u32,
    },
}

/// Start a program. After the reply socket come stdout's write end (if `stdout`), stderr's (if
/// `stderr`), then `nfds` passed fds.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct RunRequest {
    pub(super) program: String,
    pub(super) args: Vec<String>,
    /// What the program reads on stdin ([`Command::stdin_data`]); `/dev/null` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) stdin: Option<String>,
    pub(super) stdout: bool,
    pub(super) stderr: bool,
    pub(super) nfds: usize,
    pub(super) memlock: Option<u64>,
    /// The CPUs the program runs on ([`super::Command::affinity`]); absent: the spawner's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) affinity: Option<Vec<u32>>,
}

/// A VFIO group node's group and permission bits: what [`super::vfio_node`] found before it
/// changed them, recorded (with intent, before the change, in [`crate::pci::bind::Binding`]) so
/// they can be put back on release. Defined with the reply that carries it, below the owners
/// that record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAccess {
    /// The IOMMU group number: the node is `/dev/vfio/GROUP`.
    pub group: u32,
    /// Its group id.
    pub gid: u32,
    /// Its permission bits.
    pub mode: u32,
}

/// A line on a reply socket. For `run`: first `pid` (with a pidfd attached) or `error`, then
/// `status`. For `boot_file`: `ok` (with the copy attached when asked) or `error`. For
/// `kvm_access`: `access` or `error`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Reply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) ok: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) access: Option<Access>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) node: Option<NodeAccess>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) pid: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) errno: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) status: Option<i32>,
}

pub(super) fn utf8(what: &str, s: &std::ffi::OsStr) -> io::Result<String> {
    s.to_str()
        .map(str::to_string)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{what} is not UTF-8: {s:?}")))
}

impl Control {
    /// Takes over the daemon's end of a control socket pair and makes it non-blocking.
    ///
    /// # Errors
    /// fcntl failed.
    pub(crate) fn new(fd: OwnedFd) -> io::Result<Control> {
        let flags = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GETFL)?;
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(flags))?;
        Ok(Control { fd })
    }

    /// Sends one record (`payload` with `fds`), waiting on the reactor while the socket is full.
    pub(super) async fn send(&self, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let cmsgs = [ControlMessage::ScmRights(fds)];
        loop {
            match sendmsg::<()>(
                self.fd.as_raw_fd(),
                &[IoSlice::new(payload)],
                &cmsgs,
                MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                None,
            ) {
                Ok(_) => return Ok(()),
                Err(nix::errno::Errno::EAGAIN) => self.writable().await?,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(io::Error::new(io::ErrorKind::BrokenPipe, format!("the spawner process is gone: {e}")))
                }
            }
        }
    }

    /// Waits until the socket has room. A duplicate descriptor is registered for the wait, so
    /// any number of tasks (and runtimes) may wait at once: the same descriptor cannot be added
    /// to one epoll twice, a duplicate is a new entry. Edge-triggered registration reports a
    /// socket that became writable before it was registered, so no wake-up is lost.
    async fn writable(&self) -> io::Result<()> {
        let dup = self.fd.try_clone()?;
        // SAFETY: `dup` is an open descriptor we own; the AsyncFd owns it until the wait ends.
        let fd = unsafe { AsyncFd::register_with_interest(dup, Interest::WRITABLE) }?;
        let _ready = fd.writable().await?;
        Ok(())
    }
}

/// Sends `req` with `fds` after a new reply socket, and returns our end of that socket.
pub(super) async fn send_request(control: &Control, req: &Request, fds: Vec<OwnedFd>) -> io::Result<AsyncFd<OwnedFd>> {
    let payload = serde_json::to_vec(req).map_err(io::Error::other)?;
    if payload.len() > MAX_REQUEST {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "command line too long for the spawner"));
    }
    let (mine, theirs) =
        socketpair(AddressFamily::Unix, SockType::Stream, None, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK)?;
    let send: Vec<OwnedFd> = std::iter::once(theirs).chain(fds).collect();
    let raw: Vec<RawFd> = send.iter().map(AsRawFd::as_raw_fd).collect();
    control.send(&payload, &raw).await?;
    drop(send);
    // SAFETY: `mine` is an open socket we own; the AsyncFd owns it from here on.
    unsafe { AsyncFd::register(mine) }.map_err(io::Error::from)
}

/// The error a reply carries, if any.
pub(super) fn reply_error(reply: &Reply) -> Option<io::Error> {
    let error = reply.error.clone()?;
    Some(match reply.errno {
        Some(n) => io::Error::new(io::Error::from_raw_os_error(n).kind(), error),
        None => io::Error::other(error),
    })
}

/// Reads the next reply line (and any descriptors sent with it).
pub(super) async fn next_message(sock: &AsyncFd<OwnedFd>, buf: &mut Vec<u8>) -> io::Result<(Reply, Vec<OwnedFd>)> {
    let mut fds = Vec::new();
    loop {
        if let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let reply: Reply = serde_json::from_slice(&line).map_err(io::Error::other)?;
            return Ok((reply, fds));
        }
        let mut guard = sock.readable().await?;
        match guard.try_io(|s| recv_with_fds(s.get_ref().as_fd().as_raw_fd(), MsgFlags::MSG_DONTWAIT)) {
            Ok(Ok((bytes, got))) => {
                if bytes.is_empty() {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the spawner closed the reply"));
                }
                buf.extend_from_slice(&bytes);
                fds.extend(got);
            }
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
}

/// One recvmsg: the bytes and the descriptors (close-on-exec) that came with them.
pub(super) fn recv_with_fds(fd: RawFd, flags: MsgFlags) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut data = vec![0u8; MAX_REQUEST];
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_PASSED_FDS + 4]);
    let mut iov = [IoSliceMut::new(&mut data)];
    let msg = recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), flags | MsgFlags::MSG_CMSG_CLOEXEC).map_err(|e| {
        if e == nix::errno::Errno::EAGAIN {
            io::Error::from(io::ErrorKind::WouldBlock)
        } else {
            io::Error::from(e)
        }
    })?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(list) = c {
            // SAFETY: the kernel just installed these descriptors in this process for us.
            fds.extend(list.into_iter().map(|raw| unsafe { OwnedFd::from_raw_fd(raw) }));
        }
    }
    let n = msg.bytes;
    data.truncate(n);
    Ok((data, fds))
}

/// Creates the daemon↔spawner socket pair: `(daemon end, spawner end)`.
///
/// # Errors
/// socketpair failed.
pub(crate) fn control_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?)
}

/// Makes `control` the daemon's way to start programs (called once, in the daemon).
///
/// # Errors
/// The socket cannot be made non-blocking.
pub(crate) fn install(control: OwnedFd) -> io::Result<()> {
    let _ = SPAWNER.set(Control::new(control)?);
    Ok(())
}

/// The daemon's connection to its spawner; `None` without one (`sandbox = "off"`, unit tests,
/// and inside the spawner itself).
pub(super) fn spawner() -> Option<&'static Control> {
    SPAWNER.get()
}

pub(super) fn send_reply(sock: &OwnedFd, reply: &Reply, fd: Option<&OwnedFd>) {
    let mut line = serde_json::to_vec(reply).unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    let raw: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
    let cmsgs: Vec<ControlMessage> = if raw.is_empty() { Vec::new() } else { vec![ControlMessage::ScmRights(&raw)] };
    // The reply socket is non-blocking and holds at most two short lines: a failure means the
    // daemon side is gone, and then nobody is waiting for the answer.
    let _ = sendmsg::<()>(sock.as_raw_fd(), &[IoSlice::new(&line)], &cmsgs, MsgFlags::MSG_NOSIGNAL, None);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stalled_spawner_blocks_no_runtime_thread() {
        const REQUESTS: usize = 5000;
        let (daemon_end, spawner_end) = control_pair().unwrap();
        let control = std::sync::Arc::new(Control::new(daemon_end).unwrap());
        let probe = control.fd.try_clone().unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let runtime = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let sender = {
                    let (c, sent) = (control.clone(), sent.clone());
                    tokio::spawn(async move {
                        for _ in 0..REQUESTS {
                            send_request(&c, &Request::KvmAccess, Vec::new()).await?;
                            sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        io::Result::Ok(())
                    })
                };
                // This task runs on the same single thread: it gets here again only if the
                // sender yields when the socket is full.
                loop {
                    tokio::task::yield_now().await;
                    let full = matches!(
                        sendmsg::<()>(probe.as_raw_fd(), &[IoSlice::new(b"")], &[], MsgFlags::MSG_DONTWAIT, None),
                        Err(nix::errno::Errno::EAGAIN)
                    );
                    if full && sent.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                        break;
                    }
                }
                if sender.is_finished() {
                    panic!("the sender did not wait for room: {:?}", sender.await);
                }
                // The spawner wakes up and drains: every request arrives, whole.
                let drain = std::thread::spawn(move || {
                    let mut got = 0;
                    while got < REQUESTS {
                        let (bytes, fds) = recv_with_fds(spawner_end.as_raw_fd(), MsgFlags::empty()).unwrap();
                        if bytes.is_empty() {
                            continue; // the probe's empty records
                        }
                        assert!(serde_json::from_slice::<Request>(&bytes).is_ok());
                        assert_eq!(fds.len(), 1, "the reply socket");
                        got += 1;
                    }
                });
                sender.await.unwrap().unwrap();
                drain.join().unwrap();
            });
            let _ = done_tx.send(());
        });
        // A deadlock guard, not a timing assertion: with a blocking send the runtime never ends.
        if done_rx.recv_timeout(std::time::Duration::from_secs(120)).is_err() {
            panic!("the runtime's only thread is blocked by the stalled spawner");
        }
        runtime.join().unwrap();
    }
}
