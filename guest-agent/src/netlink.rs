//! A small blocking `NETLINK_ROUTE` client: exactly the link, address and route requests the agent
//! needs, over `std` and `libc`.
//!
//! Why hand-rolled: `rtnetlink` needs tokio, and the two together added 1.7 MB to a static binary
//! that has a 2 MiB budget (measured; see README.md). The agent is single-threaded and blocking, so
//! a socket plus a few dozen lines of message layout is all it takes.
//!
//! Order of use: [`Netlink::open`] once per request that needs the kernel (the socket lives in the
//! network namespace of the calling thread); then the dumps [`Netlink::links`],
//! [`Netlink::addresses`] and [`Netlink::routes`] to look; and for `net.apply`
//! [`Netlink::create_dummy`] / [`Netlink::create_vlan`], [`Netlink::link_by_name`] to learn the new
//! index, [`Netlink::set_alias`], [`Netlink::add_address`] / [`Netlink::delete_address`],
//! [`Netlink::set_up`] and [`Netlink::delete_link`].
//!
//! Every request carries a sequence number and answers with another one are skipped, so a late
//! answer to a request that timed out can never be taken for the current one. The socket has a
//! receive timeout ([`RECV_TIMEOUT`]); a kernel that does not answer becomes [`NetlinkError::Io`]
//! with `WouldBlock`, never a hang. The kernel's extended-ack text ("Unknown device type", ...) is
//! kept in [`NetlinkError::Kernel`].

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// How long one receive may wait for the kernel.
pub const RECV_TIMEOUT: Duration = Duration::from_secs(5);

/// Netlink and rtnetlink numbers from the kernel's uapi headers (`linux/netlink.h`,
/// `linux/rtnetlink.h`, `linux/if_link.h`, `linux/if_addr.h`). Spelled out here rather than taken
/// from `libc`, which lacks several of them (e.g. `IFLA_VLAN_ID`).
mod uapi {
    pub const NLMSG_ERROR: u16 = 2;
    pub const NLMSG_DONE: u16 = 3;
    pub const NLM_F_REQUEST: u16 = 0x1;
    pub const NLM_F_MULTI: u16 = 0x2;
    pub const NLM_F_ACK: u16 = 0x4;
    pub const NLM_F_DUMP: u16 = 0x300;
    pub const NLM_F_EXCL: u16 = 0x200;
    pub const NLM_F_CREATE: u16 = 0x400;
    /// In an `NLMSG_ERROR` answer: TLVs (the extended ack) follow the echoed request header.
    pub const NLM_F_ACK_TLVS: u16 = 0x200;
    pub const SOL_NETLINK: i32 = 270;
    pub const NETLINK_CAP_ACK: i32 = 10;
    pub const NETLINK_EXT_ACK: i32 = 11;
    pub const NLMSGERR_ATTR_MSG: u16 = 1;

    pub const RTM_NEWLINK: u16 = 16;
    pub const RTM_DELLINK: u16 = 17;
    pub const RTM_GETLINK: u16 = 18;
    pub const RTM_NEWADDR: u16 = 20;
    pub const RTM_DELADDR: u16 = 21;
    pub const RTM_GETADDR: u16 = 22;
    pub const RTM_GETROUTE: u16 = 26;

    pub const IFLA_ADDRESS: u16 = 1;
    pub const IFLA_IFNAME: u16 = 3;
    pub const IFLA_MTU: u16 = 4;
    pub const IFLA_LINK: u16 = 5;
    pub const IFLA_LINKINFO: u16 = 18;
    pub const IFLA_IFALIAS: u16 = 20;
    pub const IFLA_INFO_KIND: u16 = 1;
    pub const IFLA_INFO_DATA: u16 = 2;
    pub const IFLA_VLAN_ID: u16 = 1;

    pub const IFA_ADDRESS: u16 = 1;
    pub const IFA_LOCAL: u16 = 2;

    pub const RTA_DST: u16 = 1;
    pub const RTA_OIF: u16 = 4;
    pub const RTA_GATEWAY: u16 = 5;
    pub const RTA_PRIORITY: u16 = 6;
    pub const RTA_TABLE: u16 = 15;
    pub const RT_TABLE_MAIN: u32 = 254;

    /// `struct nlmsghdr`.
    pub const NLMSG_HDR: usize = 16;
    /// `struct ifinfomsg`.
    pub const IFINFOMSG: usize = 16;
    /// `struct ifaddrmsg`.
    pub const IFADDRMSG: usize = 8;
    /// `struct rtmsg`.
    pub const RTMSG: usize = 12;
}

use uapi::*;

/// What can go wrong when talking to the kernel through netlink.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// A socket system call failed, or the kernel did not answer within [`RECV_TIMEOUT`]
    /// (`WouldBlock`).
    #[error("netlink {op}: {source}")]
    Io {
        /// The step (`socket`, `send`, `receive`, ...).
        op: &'static str,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// The kernel refused a request.
    #[error("{op}: {}{}", io::Error::from_raw_os_error(*errno), message.as_deref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Kernel {
        /// The request (`create vlan`, `add address`, ...).
        op: &'static str,
        /// The kernel's errno (positive).
        errno: i32,
        /// The kernel's extended-ack message, when it sent one.
        message: Option<String>,
    },
    /// The kernel's answer does not have the layout the uapi headers describe.
    #[error("malformed netlink answer to {op}: {what}")]
    Malformed {
        /// The request being answered.
        op: &'static str,
        /// What is wrong with it.
        what: &'static str,
    },
}

impl NetlinkError {
    /// The kernel's errno behind a [`NetlinkError::Kernel`] or [`NetlinkError::Io`] error.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Kernel { errno, .. } => Some(*errno),
            NetlinkError::Io { source, .. } => source.raw_os_error(),
            NetlinkError::Malformed { .. } => None,
        }
    }
}

/// A link as the kernel describes it in an `RTM_NEWLINK` answer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Interface name.
    pub name: String,
    /// `IFLA_INFO_KIND` (`"vlan"`, `"dummy"`, `"veth"`, ...); empty for a device without a link
    /// kind, such as a hardware NIC or `lo`.
    pub kind: String,
    /// The interface alias (`ifalias`); empty when unset.
    pub alias: String,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
    /// Promiscuous as set on the link (`IFF_PROMISC` of `ifi_flags`: the kernel reports the bit
    /// a user set, not the count packet sockets and bridges take).
    pub promisc: bool,
    /// MTU in bytes.
    pub mtu: u32,
    /// Hardware address, for links that have a six-byte one.
    pub mac: Option<[u8; 6]>,
    /// `IFLA_LINK`: the lower device of a VLAN (or a veth's peer), when it differs from `index`.
    pub parent: Option<u32>,
    /// The 802.1Q id of a VLAN link.
    pub vlan_id: Option<u16>,
}

/// An IPv4 address assigned to a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Address {
    /// Index of the link holding it.
    pub index: u32,
    /// The local address (`IFA_LOCAL`).
    pub addr: Ipv4Addr,
    /// Prefix length.
    pub prefix: u8,
}

/// An IPv4 unicast route of the main table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Route {
    /// Destination network; `0.0.0.0` with `dst_len` 0 for the default route.
    pub dst: Ipv4Addr,
    /// Destination prefix length.
    pub dst_len: u8,
    /// Next hop, for routes via a gateway.
    pub gateway: Option<Ipv4Addr>,
    /// Output interface index (`RTA_OIF`); `None` for multipath routes, which are not decoded.
    pub oif: Option<u32>,
    /// Metric (`RTA_PRIORITY`).
    pub priority: u32,
}

impl Route {
    /// True for a default route (`0.0.0.0/0`).
    pub fn is_default(&self) -> bool {
        self.dst_len == 0
    }
}

/// One open `NETLINK_ROUTE` socket.
pub struct Netlink {
    /// The socket.
    fd: OwnedFd,
    /// Sequence number of the last request sent.
    seq: u32,
    /// Receive buffer, reused across requests.
    buf: Vec<u8>,
}

/// Appends an attribute (`struct rtattr` + payload, padded to 4 bytes).
fn push_attr(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    // Attribute payloads here are names, addresses and nested link info: far below 64 KiB.
    out.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(align4(out.len()), 0);
}

/// Appends a NUL-terminated string attribute.
fn push_str_attr(out: &mut Vec<u8>, kind: u16, value: &str) {
    let mut bytes = Vec::with_capacity(value.len() + 1);
    bytes.extend_from_slice(value.as_bytes());
    bytes.push(0);
    push_attr(out, kind, &bytes);
}

/// Rounds up to the netlink alignment of 4 bytes.
fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A `struct ifinfomsg` for `index` (0 = none) with the given flags and change mask.
fn ifinfomsg(index: u32, flags: u32, change: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(IFINFOMSG);
    out.push(libc::AF_UNSPEC as u8);
    out.push(0);
    out.extend_from_slice(&0u16.to_ne_bytes());
    out.extend_from_slice(&index.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&change.to_ne_bytes());
    out
}

/// A `struct ifaddrmsg` for an IPv4 address on `index`.
fn ifaddrmsg(index: u32, prefix: u8) -> Vec<u8> {
    let mut out = vec![libc::AF_INET as u8, prefix, 0, 0];
    out.extend_from_slice(&index.to_ne_bytes());
    out
}

/// Iterates over the attributes in `data` as `(type, payload)`; the nested flag bit is masked off.
/// Stops at the first attribute whose length does not fit.
fn attrs(data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = data;
    std::iter::from_fn(move || {
        let len = usize::from(u16::from_ne_bytes([*rest.first()?, *rest.get(1)?]));
        let kind = u16::from_ne_bytes([*rest.get(2)?, *rest.get(3)?]) & 0x3fff;
        if len < 4 || len > rest.len() {
            return None;
        }
        let payload = &rest[4..len];
        rest = rest.get(align4(len)..).unwrap_or(&[]);
        Some((kind, payload))
    })
}

fn u32_at(data: &[u8], offset: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(data.get(offset..offset + 4)?.try_into().ok()?))
}

fn u16_at(data: &[u8], offset: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(data.get(offset..offset + 2)?.try_into().ok()?))
}

/// A string attribute without its NUL terminator (lossy for non-UTF-8 bytes).
fn attr_str(payload: &[u8]) -> String {
    let end = payload.iter().position(|&b| b == 0).unwrap_or(payload.len());
    String::from_utf8_lossy(&payload[..end]).into_owned()
}

fn attr_ipv4(payload: &[u8]) -> Option<Ipv4Addr> {
    let bytes: [u8; 4] = payload.get(..4)?.try_into().ok()?;
    Some(Ipv4Addr::from(bytes))
}

/// Decodes the body (after `nlmsghdr`) of an `RTM_NEWLINK` message.
pub(crate) fn parse_link(body: &[u8]) -> Option<Link> {
    let index = u32_at(body, 4)?;
    let flags = u32_at(body, 8)?;
    let mut link = Link {
        index,
        up: flags & libc::IFF_UP as u32 != 0,
        promisc: flags & libc::IFF_PROMISC as u32 != 0,
        ..Link::default()
    };
    for (kind, payload) in attrs(body.get(IFINFOMSG..)?) {
        match kind {
            IFLA_IFNAME => link.name = attr_str(payload),
            IFLA_IFALIAS => link.alias = attr_str(payload),
            IFLA_MTU => link.mtu = u32_at(payload, 0).unwrap_or(0),
            IFLA_ADDRESS => link.mac = payload.try_into().ok(),
            IFLA_LINK => link.parent = u32_at(payload, 0).filter(|&p| p != 0 && p != index),
            IFLA_LINKINFO => {
                for (info, value) in attrs(payload) {
                    match info {
                        IFLA_INFO_KIND => link.kind = attr_str(value),
                        // The layout of INFO_DATA depends on the kind, which the kernel sends first.
                        IFLA_INFO_DATA if link.kind == "vlan" => {
                            link.vlan_id =
                                attrs(value).find(|(t, _)| *t == IFLA_VLAN_ID).and_then(|(_, v)| u16_at(v, 0));
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(link)
}

/// Decodes the body of an `RTM_NEWADDR` message; `None` for anything but IPv4.
pub(crate) fn parse_address(body: &[u8]) -> Option<Address> {
    if i32::from(*body.first()?) != libc::AF_INET {
        return None;
    }
    let prefix = *body.get(1)?;
    let index = u32_at(body, 4)?;
    let mut local = None;
    let mut address = None;
    for (kind, payload) in attrs(body.get(IFADDRMSG..)?) {
        match kind {
            IFA_LOCAL => local = attr_ipv4(payload),
            IFA_ADDRESS => address = attr_ipv4(payload),
            _ => {}
        }
    }
    // On point-to-point links IFA_ADDRESS is the peer; IFA_LOCAL is always our own address.
    Some(Address { index, addr: local.or(address)?, prefix })
}

/// Decodes the body of an `RTM_NEWROUTE` message; `None` unless it is an IPv4 unicast route of the
/// main table.
pub(crate) fn parse_route(body: &[u8]) -> Option<Route> {
    if i32::from(*body.first()?) != libc::AF_INET {
        return None;
    }
    let dst_len = *body.get(1)?;
    let mut table = u32::from(*body.get(4)?);
    let route_type = *body.get(7)?;
    if route_type != libc::RTN_UNICAST {
        return None;
    }
    let mut route = Route { dst: Ipv4Addr::UNSPECIFIED, dst_len, gateway: None, oif: None, priority: 0 };
    for (kind, payload) in attrs(body.get(RTMSG..)?) {
        match kind {
            RTA_DST => route.dst = attr_ipv4(payload)?,
            RTA_GATEWAY => route.gateway = attr_ipv4(payload),
            RTA_OIF => route.oif = u32_at(payload, 0),
            RTA_PRIORITY => route.priority = u32_at(payload, 0).unwrap_or(0),
            RTA_TABLE => table = u32_at(payload, 0).unwrap_or(table),
            _ => {}
        }
    }
    (table == RT_TABLE_MAIN).then_some(route)
}

/// Extracts the extended-ack message from the body of an `NLMSG_ERROR` answer, sent with
/// `NETLINK_CAP_ACK` (only the request's header is echoed).
fn ext_ack_message(flags: u16, body: &[u8]) -> Option<String> {
    if flags & NLM_F_ACK_TLVS == 0 {
        return None;
    }
    attrs(body.get(4 + NLMSG_HDR..)?).find(|(t, _)| *t == NLMSGERR_ATTR_MSG).map(|(_, v)| attr_str(v))
}

/// The error an `NLMSG_ERROR` message with a non-zero code stands for.
fn error_of(op: &'static str, msg: &Message<'_>) -> NetlinkError {
    match u32_at(msg.body, 0) {
        // The kernel sends the negated errno.
        Some(code) => NetlinkError::Kernel {
            op,
            errno: (code as i32).wrapping_neg(),
            message: ext_ack_message(msg.flags, msg.body),
        },
        None => NetlinkError::Malformed { op, what: "short error message" },
    }
}

/// One message of a netlink answer.
struct Message<'a> {
    kind: u16,
    flags: u16,
    seq: u32,
    body: &'a [u8],
}

/// Splits a datagram into messages. Stops at the first malformed length.
fn messages(data: &[u8]) -> impl Iterator<Item = Message<'_>> {
    let mut rest = data;
    std::iter::from_fn(move || {
        let len = usize::try_from(u32_at(rest, 0)?).ok()?;
        if len < NLMSG_HDR || len > rest.len() {
            return None;
        }
        let msg = Message {
            kind: u16_at(rest, 4)?,
            flags: u16_at(rest, 6)?,
            seq: u32_at(rest, 8)?,
            body: &rest[NLMSG_HDR..len],
        };
        rest = rest.get(align4(len)..).unwrap_or(&[]);
        Some(msg)
    })
}

/// Converts a `-1` return into the current `errno`.
fn check(ret: libc::c_int, op: &'static str) -> Result<libc::c_int, NetlinkError> {
    if ret < 0 {
        Err(NetlinkError::Io { op, source: io::Error::last_os_error() })
    } else {
        Ok(ret)
    }
}

/// Sets an integer socket option.
fn set_int_opt(fd: &OwnedFd, level: i32, name: i32, value: i32, op: &'static str) -> Result<(), NetlinkError> {
    // SAFETY: the pointer and length describe a live c_int.
    let ret = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    check(ret, op).map(drop)
}

impl Netlink {
    /// Opens a `NETLINK_ROUTE` socket in the calling thread's network namespace, with a receive
    /// timeout and extended acks.
    ///
    /// # Errors
    /// [`NetlinkError::Io`] when the socket cannot be created, bound or configured.
    pub fn open() -> Result<Netlink, NetlinkError> {
        // SAFETY: plain socket(2); the result is checked before use.
        let raw = check(
            unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) },
            "socket",
        )?;
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a zeroed sockaddr_nl (pid 0: let the kernel pick) is a valid address.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: the pointer and length describe `addr`.
        let ret = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        check(ret, "bind")?;
        let timeout = libc::timeval { tv_sec: RECV_TIMEOUT.as_secs() as libc::time_t, tv_usec: 0 };
        // SAFETY: the pointer and length describe `timeout`.
        let ret = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        check(ret, "set receive timeout")?;
        // Best effort: older kernels lack these; errors then just carry no text.
        let _ = set_int_opt(&fd, SOL_NETLINK, NETLINK_EXT_ACK, 1, "extended ack");
        let _ = set_int_opt(&fd, SOL_NETLINK, NETLINK_CAP_ACK, 1, "capped ack");
        // The kernel sizes dump datagrams to at most SKB_WITH_OVERHEAD(32768) bytes, so 32 KiB
        // always holds one; `receive` still detects a larger one (MSG_TRUNC) instead of cutting it.
        Ok(Netlink { fd, seq: 0, buf: vec![0; 32 * 1024] })
    }

    /// Sends one request (`payload` = the fixed struct after `nlmsghdr`, then attributes) and
    /// returns its sequence number.
    fn send(&mut self, kind: u16, flags: u16, payload: &[u8], op: &'static str) -> Result<u32, NetlinkError> {
        self.seq = self.seq.wrapping_add(1);
        let len = NLMSG_HDR + payload.len();
        let mut msg = Vec::with_capacity(len);
        msg.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_ne_bytes());
        msg.extend_from_slice(&kind.to_ne_bytes());
        msg.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        msg.extend_from_slice(&self.seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(payload);
        // SAFETY: the pointer and length describe `msg`; the socket is connected to the kernel by
        // default (destination pid 0).
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(NetlinkError::Io { op, source: io::Error::last_os_error() });
        }
        Ok(self.seq)
    }

    /// Receives one datagram into the buffer; returns its length.
    fn receive(&mut self, op: &'static str) -> Result<usize, NetlinkError> {
        loop {
            // MSG_TRUNC makes the kernel report the datagram's real length, so a datagram larger
            // than the buffer is detected rather than silently cut.
            // SAFETY: the pointer and length describe `self.buf`.
            let n = unsafe {
                libc::recv(self.fd.as_raw_fd(), self.buf.as_mut_ptr().cast(), self.buf.len(), libc::MSG_TRUNC)
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(NetlinkError::Io { op, source: err });
            }
            let n = usize::try_from(n).unwrap_or(0);
            if n > self.buf.len() {
                return Err(NetlinkError::Malformed { op, what: "datagram larger than the receive buffer" });
            }
            return Ok(n);
        }
    }

    /// Sends a dump request and calls `each` with the body of every answer message.
    fn dump(
        &mut self,
        kind: u16,
        header: &[u8],
        op: &'static str,
        mut each: impl FnMut(&[u8]),
    ) -> Result<(), NetlinkError> {
        let seq = self.send(kind, NLM_F_DUMP, header, op)?;
        loop {
            let n = self.receive(op)?;
            for msg in messages(&self.buf[..n]) {
                if msg.seq != seq {
                    continue;
                }
                match msg.kind {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => return Err(error_of(op, &msg)),
                    _ => each(msg.body),
                }
                if msg.flags & NLM_F_MULTI == 0 {
                    return Ok(());
                }
            }
        }
    }

    /// Sends a request with `NLM_F_ACK` and waits for the kernel's answer.
    ///
    /// A reply message other than the ack (e.g. the link of a `RTM_GETLINK` by name) is returned.
    fn request(
        &mut self,
        kind: u16,
        flags: u16,
        payload: &[u8],
        op: &'static str,
    ) -> Result<Option<Vec<u8>>, NetlinkError> {
        let seq = self.send(kind, flags | NLM_F_ACK, payload, op)?;
        let mut reply = None;
        loop {
            let n = self.receive(op)?;
            for msg in messages(&self.buf[..n]) {
                if msg.seq != seq {
                    continue;
                }
                if msg.kind != NLMSG_ERROR {
                    reply = Some(msg.body.to_vec());
                    continue;
                }
                if u32_at(msg.body, 0) == Some(0) {
                    return Ok(reply);
                }
                return Err(error_of(op, &msg));
            }
        }
    }

    /// Every link in the namespace, in index order.
    ///
    /// # Errors
    /// Any [`NetlinkError`].
    pub fn links(&mut self) -> Result<Vec<Link>, NetlinkError> {
        let mut out = Vec::new();
        self.dump(RTM_GETLINK, &ifinfomsg(0, 0, 0), "dump links", |body| out.extend(parse_link(body)))?;
        out.sort_by_key(|l| l.index);
        Ok(out)
    }

    /// The link called `name`, or `None` when there is none.
    ///
    /// # Errors
    /// Any [`NetlinkError`] but "no such device".
    pub fn link_by_name(&mut self, name: &str) -> Result<Option<Link>, NetlinkError> {
        let mut payload = ifinfomsg(0, 0, 0);
        push_str_attr(&mut payload, IFLA_IFNAME, name);
        match self.request(RTM_GETLINK, 0, &payload, "get link") {
            Ok(Some(body)) => Ok(parse_link(&body)),
            Ok(None) => Err(NetlinkError::Malformed { op: "get link", what: "no link in the answer" }),
            Err(NetlinkError::Kernel { errno: libc::ENODEV, .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every IPv4 address, in the kernel's order.
    ///
    /// # Errors
    /// Any [`NetlinkError`].
    pub fn addresses(&mut self) -> Result<Vec<Address>, NetlinkError> {
        let mut out = Vec::new();
        self.dump(RTM_GETADDR, &ifaddrmsg(0, 0), "dump addresses", |body| out.extend(parse_address(body)))?;
        Ok(out)
    }

    /// Every IPv4 unicast route of the main table.
    ///
    /// # Errors
    /// Any [`NetlinkError`].
    pub fn routes(&mut self) -> Result<Vec<Route>, NetlinkError> {
        let mut out = Vec::new();
        let mut header = vec![0u8; RTMSG];
        header[0] = libc::AF_INET as u8;
        self.dump(RTM_GETROUTE, &header, "dump routes", |body| out.extend(parse_route(body)))?;
        Ok(out)
    }

    /// Creates a link of `kind` called `name` (down, without alias), with `extra` attributes
    /// inside `IFLA_LINKINFO` and `top` attributes beside it.
    fn create_link(
        &mut self,
        name: &str,
        kind: &str,
        data: &[u8],
        top: &[u8],
        op: &'static str,
    ) -> Result<(), NetlinkError> {
        let mut info = Vec::new();
        push_str_attr(&mut info, IFLA_INFO_KIND, kind);
        if !data.is_empty() {
            push_attr(&mut info, IFLA_INFO_DATA, data);
        }
        let mut payload = ifinfomsg(0, 0, 0);
        push_str_attr(&mut payload, IFLA_IFNAME, name);
        payload.extend_from_slice(top);
        push_attr(&mut payload, IFLA_LINKINFO, &info);
        self.request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, &payload, op).map(drop)
    }

    /// Creates a dummy link (down, no alias yet).
    ///
    /// # Errors
    /// [`NetlinkError::Kernel`], e.g. `EEXIST` for a taken name or `EOPNOTSUPP` when the kernel
    /// has no dummy driver.
    pub fn create_dummy(&mut self, name: &str) -> Result<(), NetlinkError> {
        self.create_link(name, "dummy", &[], &[], "create dummy")
    }

    /// Creates an 802.1Q VLAN link with id `vlan_id` on the link with index `parent` (down, no
    /// alias yet).
    ///
    /// # Errors
    /// [`NetlinkError::Kernel`], e.g. `EEXIST` for a taken name or VLAN id, `EOPNOTSUPP` without
    /// the 8021q driver.
    pub fn create_vlan(&mut self, name: &str, parent: u32, vlan_id: u16) -> Result<(), NetlinkError> {
        let mut data = Vec::new();
        push_attr(&mut data, IFLA_VLAN_ID, &vlan_id.to_ne_bytes());
        let mut top = Vec::new();
        push_attr(&mut top, IFLA_LINK, &parent.to_ne_bytes());
        self.create_link(name, "vlan", &data, &top, "create vlan")
    }

    /// Sets the interface alias of link `index`. (The kernel ignores `IFLA_IFALIAS` when creating a
    /// link, hence a separate request.)
    ///
    /// # Errors
    /// [`NetlinkError::Kernel`] (`ENODEV` when the link is gone).
    pub fn set_alias(&mut self, index: u32, alias: &str) -> Result<(), NetlinkError> {
        let mut payload = ifinfomsg(index, 0, 0);
        push_str_attr(&mut payload, IFLA_IFALIAS, alias);
        self.request(RTM_NEWLINK, 0, &payload, "set alias").map(drop)
    }

    /// Sets or clears `IFF_UP` on link `index`.
    ///
    /// # Errors
    /// [`NetlinkError::Kernel`].
    pub fn set_up(&mut self, index: u32, up: bool) -> Result<(), NetlinkError> {
        let flag = libc::IFF_UP as u32;
        let payload = ifinfomsg(index, if up { flag } else { 0 }, flag);
        self.request(RTM_NEWLINK, 0, &payload, "set up").map(drop)
    }

    /// Sets or clears `IFF_PROMISC` on link `index` (the flag a user sets, as
    /// `ip link set promisc on` does).
    ///
    /// # Errors
    /// [`NetlinkError::Kernel`].
    pub fn set_promisc(&mut self, index: u32, on: bool) -> Result<(), NetlinkError> {
        let flag = libc::IFF_PROMISC as u32;
        let payload = ifinfomsg(index, if on { flag } else { 0 }, flag);
        self.request(RTM_NEWLINK, 0, &payload, "set promisc").map(drop)
    }

    /// The payload of an address request.
    fn address_payload(index: u32, addr: Ipv4Addr, prefix: u8) -> Vec<u8> {
        let mut payload = ifaddrmsg(index, prefix);
        push_attr(&mut payload, IFA_LOCAL, &addr.octets());
        push_attr(&mut payload, IFA_ADDRESS, &addr.octets());
        payload
    }

    /// Adds `addr/prefix` to link `index`.
    ///
    /// # Errors
    /// [`NetlinkError::Kernel`] (`EEXIST` when it is already there).
    pub fn add_address(&mut self, index: u32, addr: Ipv4Addr, prefix: u8) -> Result<(), NetlinkError> {
        let payload = Self::address_payload(index, addr, prefix);
        self.request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, &payload, "add address").map(drop)
    }

    /// Removes `addr/prefix` from link `index`.
    ///
    /// # Errors
    /// [`NetlinkError::Kernel`] (`EADDRNOTAVAIL` when it is not there).
    pub fn delete_address(&mut self, index: u32, addr: Ipv4Addr, prefix: u8) -> Result<(), NetlinkError> {
        let payload = Self::address_payload(index, addr, prefix);
        self.request(RTM_DELADDR, 0, &payload, "delete address").map(drop)
    }

    /// Deletes link `index`.
    ///
    /// # Errors
    /// [`NetlinkError::Kernel`] (`ENODEV` when it is gone).
    pub fn delete_link(&mut self, index: u32) -> Result<(), NetlinkError> {
        self.request(RTM_DELLINK, 0, &ifinfomsg(index, 0, 0), "delete link").map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `RTM_NEWLINK` body as the kernel would send it.
    fn link_body(index: u32, up: bool, attributes: &[u8]) -> Vec<u8> {
        let mut body = ifinfomsg(index, if up { libc::IFF_UP as u32 } else { 0 }, 0);
        body.extend_from_slice(attributes);
        body
    }

    #[test]
    fn the_promiscuous_flag_is_read_from_the_link_flags() {
        let mut attributes = Vec::new();
        push_str_attr(&mut attributes, IFLA_IFNAME, "eth1");
        let mut body = ifinfomsg(3, (libc::IFF_UP | libc::IFF_PROMISC) as u32, 0);
        body.extend_from_slice(&attributes);
        let link = parse_link(&body).expect("parses");
        assert!(link.up && link.promisc, "{link:?}");
        assert!(!parse_link(&link_body(3, true, &attributes)).expect("parses").promisc);
    }

    #[test]
    fn parses_a_vlan_link() {
        let mut data = Vec::new();
        push_attr(&mut data, IFLA_VLAN_ID, &20u16.to_ne_bytes());
        let mut info = Vec::new();
        push_str_attr(&mut info, IFLA_INFO_KIND, "vlan");
        push_attr(&mut info, IFLA_INFO_DATA, &data);
        let mut attributes = Vec::new();
        push_str_attr(&mut attributes, IFLA_IFNAME, "eth0.20");
        push_str_attr(&mut attributes, IFLA_IFALIAS, "vmhost-agent");
        push_attr(&mut attributes, IFLA_MTU, &1500u32.to_ne_bytes());
        push_attr(&mut attributes, IFLA_ADDRESS, &[2, 0, 0, 0, 0, 1]);
        push_attr(&mut attributes, IFLA_LINK, &2u32.to_ne_bytes());
        push_attr(&mut attributes, IFLA_LINKINFO, &info);
        let link = parse_link(&link_body(7, true, &attributes)).expect("parses");
        assert_eq!(
            link,
            Link {
                index: 7,
                name: "eth0.20".into(),
                kind: "vlan".into(),
                alias: "vmhost-agent".into(),
                up: true,
                promisc: false,
                mtu: 1500,
                mac: Some([2, 0, 0, 0, 0, 1]),
                parent: Some(2),
                vlan_id: Some(20),
            }
        );
    }

    #[test]
    fn truncated_messages_do_not_panic() {
        let mut attributes = Vec::new();
        push_str_attr(&mut attributes, IFLA_IFNAME, "eth0");
        let body = link_body(1, false, &attributes);
        for cut in 0..body.len() {
            let _ = parse_link(&body[..cut]);
            let _ = parse_address(&body[..cut]);
            let _ = parse_route(&body[..cut]);
        }
        // An attribute claiming more bytes than there are ends the walk.
        let bogus = [200u8, 0, 3, 0, b'x'];
        assert_eq!(attrs(&bogus).count(), 0);
        assert_eq!(messages(&[255, 255, 255, 255, 0, 0]).count(), 0);
    }

    #[test]
    fn parses_routes_of_the_main_table_only() {
        let mut body = vec![libc::AF_INET as u8, 0, 0, 0, 254, 3, 0, libc::RTN_UNICAST, 0, 0, 0, 0];
        push_attr(&mut body, RTA_GATEWAY, &[10, 0, 2, 2]);
        push_attr(&mut body, RTA_OIF, &2u32.to_ne_bytes());
        let route = parse_route(&body).expect("main-table default route");
        assert!(route.is_default());
        assert_eq!(route.gateway, Some(Ipv4Addr::new(10, 0, 2, 2)));
        assert_eq!(route.oif, Some(2));
        // The local table (255) is not reported.
        body[4] = 255;
        assert_eq!(parse_route(&body), None);
    }

    #[test]
    fn kernel_errors_read_well() {
        let e = NetlinkError::Kernel {
            op: "create vlan",
            errno: libc::EOPNOTSUPP,
            message: Some("Unknown device type".into()),
        };
        assert!(e.to_string().starts_with("create vlan: Operation not supported"), "{e}");
        assert!(e.to_string().ends_with("(Unknown device type)"), "{e}");
        assert_eq!(e.errno(), Some(libc::EOPNOTSUPP));
    }
}
