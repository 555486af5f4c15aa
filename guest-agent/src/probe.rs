//! Gateway reachability: ICMP echo with a bounded total time.
//!
//! [`ping`] sends up to [`ATTEMPTS`] echo requests spread over [`TIMEOUT`] and stops at the first
//! matching echo reply. It uses an unprivileged ICMP datagram socket when the kernel allows it
//! (`net.ipv4.ping_group_range`, which is empty by default) and a raw ICMP socket otherwise (the
//! agent runs as root, with `CAP_NET_RAW`). No `ping` binary is run: its presence, flags and output
//! differ between images.
//!
//! A raw socket sees every ICMP packet of the namespace, so replies are matched on source address,
//! identifier and sequence number; a datagram socket gets only its own replies (the kernel sets the
//! identifier to the socket's port) and is matched on source and sequence.

use std::fmt;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// Total time one probe may take.
pub const TIMEOUT: Duration = Duration::from_millis(1000);
/// Echo requests sent per probe, evenly spread over [`TIMEOUT`].
pub const ATTEMPTS: u16 = 3;

/// ICMP message types.
const ECHO_REPLY: u8 = 0;
const ECHO_REQUEST: u8 = 8;

/// What a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// An echo reply arrived after this round-trip time.
    Reply(Duration),
    /// No reply within this time.
    NoReply(Duration),
    /// The probe could not be sent (no socket, no route, ...).
    Failed(String),
}

impl ProbeOutcome {
    /// True for [`ProbeOutcome::Reply`].
    pub fn is_reply(&self) -> bool {
        matches!(self, ProbeOutcome::Reply(_))
    }

    /// What a passing probe looks like, for the `expected` side of a check.
    pub fn expectation(&self) -> String {
        format!("echo reply within {} ms", TIMEOUT.as_millis())
    }
}

impl fmt::Display for ProbeOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeOutcome::Reply(rtt) => write!(f, "reply in {:.1} ms", rtt.as_secs_f64() * 1000.0),
            ProbeOutcome::NoReply(waited) => write!(f, "no reply within {} ms", waited.as_millis()),
            ProbeOutcome::Failed(why) => write!(f, "probe failed: {why}"),
        }
    }
}

/// The Internet checksum (RFC 1071) of `data`.
fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 =
        data.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An echo request with identifier `id`, sequence `seq` and a fixed payload.
fn echo_request(id: u16, seq: u16) -> Vec<u8> {
    let mut packet = vec![ECHO_REQUEST, 0, 0, 0];
    packet.extend_from_slice(&id.to_be_bytes());
    packet.extend_from_slice(&seq.to_be_bytes());
    packet.extend_from_slice(b"vmhost-agent....");
    let sum = checksum(&packet);
    packet[2..4].copy_from_slice(&sum.to_be_bytes());
    packet
}

/// The `(identifier, sequence)` of an echo reply in `packet` (an ICMP message, after the IP header
/// when `raw`), or `None` for anything else.
fn parse_reply(packet: &[u8], raw: bool) -> Option<(u16, u16)> {
    let icmp = if raw {
        let ihl = usize::from(packet.first()? & 0x0f) * 4;
        packet.get(ihl..)?
    } else {
        packet
    };
    if *icmp.first()? != ECHO_REPLY {
        return None;
    }
    let id = u16::from_be_bytes([*icmp.get(4)?, *icmp.get(5)?]);
    let seq = u16::from_be_bytes([*icmp.get(6)?, *icmp.get(7)?]);
    Some((id, seq))
}

/// Opens an ICMP socket: datagram when allowed, raw otherwise. Returns it and whether it is raw.
fn open_socket() -> io::Result<(OwnedFd, bool)> {
    for (kind, raw) in [(libc::SOCK_DGRAM, false), (libc::SOCK_RAW, true)] {
        // SAFETY: plain socket(2); the result is checked.
        let fd =
            unsafe { libc::socket(libc::AF_INET, kind | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, libc::IPPROTO_ICMP) };
        if fd >= 0 {
            // SAFETY: a fresh descriptor nothing else owns.
            return Ok((unsafe { OwnedFd::from_raw_fd(fd) }, raw));
        }
        let err = io::Error::last_os_error();
        let denied = matches!(err.raw_os_error(), Some(libc::EACCES | libc::EPERM | libc::EPROTONOSUPPORT));
        if raw || !denied {
            return Err(err);
        }
    }
    Err(io::Error::from_raw_os_error(libc::EPERM))
}

/// A `sockaddr_in` for `addr` (port 0).
fn sockaddr(addr: Ipv4Addr) -> libc::sockaddr_in {
    // SAFETY: all-zero is a valid sockaddr_in.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_addr.s_addr = u32::from_ne_bytes(addr.octets());
    sa
}

/// Waits up to `timeout` for the socket to become readable.
fn wait_readable(fd: &OwnedFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    match n {
        n if n < 0 => {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(err)
            }
        }
        0 => Ok(false),
        _ => Ok(true),
    }
}

/// Sends ICMP echo requests to `target` and waits for a reply, for at most [`TIMEOUT`].
pub fn ping(target: Ipv4Addr) -> ProbeOutcome {
    ping_within(target, TIMEOUT)
}

/// [`ping`] with an explicit total time.
pub fn ping_within(target: Ipv4Addr, timeout: Duration) -> ProbeOutcome {
    match ping_for(target, timeout) {
        Ok(outcome) => outcome,
        Err(e) => ProbeOutcome::Failed(e.to_string()),
    }
}

/// The probe itself; errors are a socket that could not be opened or a send the kernel refused.
fn ping_for(target: Ipv4Addr, timeout: Duration) -> io::Result<ProbeOutcome> {
    let (fd, raw) = open_socket()?;
    // Distinguishes our replies on a raw socket; the datagram socket's kernel-chosen id is not
    // known in advance, so there only the sequence is matched.
    let id = (std::process::id() & 0xffff) as u16;
    let dest = sockaddr(target);
    let start = Instant::now();
    let interval = timeout / u32::from(ATTEMPTS);
    let mut sent_at = Vec::new();
    let mut buf = [0u8; 1500];
    loop {
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            return Ok(ProbeOutcome::NoReply(timeout));
        }
        let due = sent_at.len() < usize::from(ATTEMPTS) && elapsed >= interval * sent_at.len() as u32;
        if due {
            let seq = sent_at.len() as u16 + 1;
            let packet = echo_request(id, seq);
            // SAFETY: pointers and lengths describe `packet` and `dest`.
            let n = unsafe {
                libc::sendto(
                    fd.as_raw_fd(),
                    packet.as_ptr().cast(),
                    packet.len(),
                    0,
                    (&dest as *const libc::sockaddr_in).cast(),
                    std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                )
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                // A full neighbour queue while ARP is unanswered is not final; the rest is.
                if err.kind() != io::ErrorKind::WouldBlock {
                    return Err(err);
                }
            }
            sent_at.push(Instant::now());
        }
        let next_send = if sent_at.len() < usize::from(ATTEMPTS) { interval * sent_at.len() as u32 } else { timeout };
        let wait = next_send.min(timeout).saturating_sub(start.elapsed());
        if !wait_readable(&fd, wait)? {
            continue;
        }
        // SAFETY: zeroed sockaddr_in storage for recvfrom to fill.
        let mut from: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        let mut from_len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: pointers and lengths describe `buf` and `from`.
        let n = unsafe {
            libc::recvfrom(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                (&mut from as *mut libc::sockaddr_in).cast(),
                &mut from_len,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) {
                continue;
            }
            return Err(err);
        }
        let packet = &buf[..usize::try_from(n).unwrap_or(0)];
        if Ipv4Addr::from(from.sin_addr.s_addr.to_ne_bytes()) != target {
            continue;
        }
        let Some((reply_id, seq)) = parse_reply(packet, raw) else { continue };
        if raw && reply_id != id {
            continue;
        }
        if let Some(sent) = usize::from(seq).checked_sub(1).and_then(|i| sent_at.get(i)) {
            return Ok(ProbeOutcome::Reply(sent.elapsed()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_requests_carry_a_valid_checksum() {
        let packet = echo_request(0x1234, 2);
        assert_eq!(&packet[..2], &[ECHO_REQUEST, 0]);
        // Summing a packet including its checksum gives zero.
        assert_eq!(checksum(&packet), 0);
        assert_eq!(checksum(&[0x00, 0x01, 0xf2]), !0xf201);
    }

    #[test]
    fn replies_are_recognised_with_and_without_ip_header() {
        let mut reply = echo_request(7, 3);
        reply[0] = ECHO_REPLY;
        assert_eq!(parse_reply(&reply, false), Some((7, 3)));
        let mut with_ip = vec![0x45; 1];
        with_ip.extend_from_slice(&[0; 19]);
        with_ip.extend_from_slice(&reply);
        assert_eq!(parse_reply(&with_ip, true), Some((7, 3)));
        assert_eq!(parse_reply(&echo_request(7, 3), false), None, "a request is not a reply");
        assert_eq!(parse_reply(&[0x4f], true), None);
        assert_eq!(parse_reply(&[], false), None);
    }

    #[test]
    fn outcomes_read_well() {
        assert_eq!(ProbeOutcome::Reply(Duration::from_micros(1250)).to_string(), "reply in 1.2 ms");
        assert_eq!(ProbeOutcome::NoReply(TIMEOUT).to_string(), "no reply within 1000 ms");
        assert_eq!(ProbeOutcome::Failed("x".into()).expectation(), "echo reply within 1000 ms");
    }
}
