//! The kernel-facing layer of host networking: taps, bridges, addresses and bridge VLANs.
//!
//! vmhostd gives each VM NIC a tap on a bridge. This module is the only place that asks the kernel
//! for those links, and it speaks to the kernel directly: netlink (through `rtnetlink`) for links,
//! addresses and VLANs, the `/dev/net/tun` ioctl for taps. It never runs `ip`, `brctl` or
//! `bridge`: their output is not an interface, and a daemon that shells out cannot tell a kernel
//! refusal from a missing binary.
//!
//! The networking layer above uses it in this order:
//!
//! 1. [`link::Netlink::connect`] opens one netlink socket (inside a tokio runtime);
//! 2. for a network the daemon owns, [`link::Netlink::create_bridge`] makes the bridge with its
//!    ownership marker ([`owner_alias`]), then sets its MTU, address and VLAN filtering and brings it
//!    up; an existing bridge is only looked up ([`link::Netlink::link_by_name`]);
//! 3. per NIC, [`tap::create_tap`] makes a tap whose life is tied to its file descriptor;
//!    [`link::Netlink::set_alias`] marks it, then it gets the bridge's MTU, is attached with
//!    [`link::Netlink::set_master`], gets its VLAN ([`link::Netlink::bridge_vlan_add`]) and is brought
//!    up; the descriptor goes to QEMU (`-netdev tap,fd=N`);
//!    with more than one queue the tap is multiqueue, one descriptor per queue
//!    ([`tap::create_tap_queues`]), and where `/dev/vhost-net` opens each queue also gets a
//!    vhost-net descriptor ([`vhost::open_for_nics`]);
//!    a trunk port also gets its tagged VLANs in one message ([`link::Netlink::bridge_vlan_add_tagged`]);
//!    a monitor NIC's tap (a capture NIC) is on no bridge: it gets its source's MTU, IPv6 address
//!    generation off ([`link::Netlink::set_ipv6_off`]) and a drop filter on its ingress
//!    ([`link::Netlink::add_drop_all`], in [`tc`]) before it goes up;
//! 4. for capture NICs, `net::capture` mirrors each source's frames into the monitor taps with
//!    [`tc`] (a clsact qdisc, a classic-BPF filter with a `mirred` action carrying vmhostd's
//!    cookie) and sets the source promiscuous ([`link::Netlink::set_promisc`]); the daemon's link
//!    watcher ([`watch::LinkWatch`]) tells it when a source comes or goes;
//! 5. on destroy or at start-up, [`link::Netlink::links`] plus [`parse_owner`] find the links the
//!    daemon made, and [`link::Netlink::delete_link`] removes them.
//!
//! # Ownership
//! Every link vmhostd creates carries an interface alias (`ifalias`) starting with [`ALIAS_PREFIX`]
//! that names its owner ([`Owner`]). The daemon never changes or deletes a link without such a
//! marker: a bridge the operator made, an uplink, another program's veth are left exactly as they
//! are. Taps additionally vanish by themselves when their last descriptor closes (see [`tap`]), so a
//! crash between creating a tap and marking it leaves nothing behind. On a link vmhostd does not
//! own (a capture source), its tc filters are marked by their action cookie instead, and a filter
//! without that cookie is never changed or deleted.
//!
//! # Where this is proven
//! The tests here run against the real kernel, each in its own network namespace (see
//! `testing::in_netns`). This machine's kernel has bridges but no bridge VLAN filtering, so here
//! the tests only prove that the VLAN calls fail with a clear [`NetError::Unsupported`]. VLAN
//! behaviour itself (PVID/untagged access ports, tagged trunks, isolation between VLANs) is proven
//! in the lab host: a QEMU/TCG VM running Debian's cloud kernel, whose bridge has VLAN filtering
//! (built separately, see the host-networking issue).

pub mod backing;
pub mod capture;
pub mod host;
pub mod link;
pub mod tap;
pub mod tc;
pub mod vhost;
pub mod watch;

use std::io;

/// The start of every ownership marker vmhostd writes into a link's `ifalias`.
pub const ALIAS_PREFIX: &str = "vmhost:";

/// Longest interface name the kernel accepts, in bytes (`IFNAMSIZ` minus the terminating NUL).
pub const MAX_LINK_NAME: usize = 15;

/// Who owns a link that vmhostd created, as recorded in its `ifalias`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Owner {
    /// A VM's tap (`vmhost:vm=NAME`).
    Vm(String),
    /// A bridge vmhostd created for a network (`vmhost:net=NAME`).
    Network(String),
}

/// The `ifalias` marker naming `owner`: `vmhost:vm=NAME` or `vmhost:net=NAME`.
///
/// [`parse_owner`] reads it back. The kernel limits an alias to 255 bytes; names are validated
/// far below that by the config and spec rules.
pub fn owner_alias(owner: &Owner) -> String {
    match owner {
        Owner::Vm(name) => format!("{ALIAS_PREFIX}vm={name}"),
        Owner::Network(name) => format!("{ALIAS_PREFIX}net={name}"),
    }
}

/// The owner recorded in an `ifalias`, or `None` when the alias is not a vmhost marker (a link
/// vmhostd must not touch).
///
/// Only the exact forms [`owner_alias`] writes count: an unknown kind or an empty name is `None`.
pub fn parse_owner(alias: &str) -> Option<Owner> {
    let rest = alias.strip_prefix(ALIAS_PREFIX)?;
    let (kind, name) = rest.split_once('=')?;
    if name.is_empty() {
        return None;
    }
    match kind {
        "vm" => Some(Owner::Vm(name.to_string())),
        "net" => Some(Owner::Network(name.to_string())),
        _ => None,
    }
}

/// What can go wrong when talking to the kernel about links.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A link name the kernel would refuse, or one this module refuses to pass on.
    #[error("invalid link name {name:?}: {reason}")]
    InvalidName {
        /// The name given.
        name: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A VLAN id outside 1..=4094.
    #[error("invalid VLAN id {0} (must be 1..=4094)")]
    InvalidVlan(u16),
    /// A tc action cookie that is empty or longer than the kernel keeps ([`tc::MAX_COOKIE`] bytes).
    #[error("invalid tc action cookie of {0} bytes (must be 1..=16)")]
    InvalidCookie(usize),
    /// An IPv4 prefix length above 32.
    #[error("invalid IPv4 prefix length {0} (must be 0..=32)")]
    InvalidPrefix(u8),
    /// The link, address or VLAN does not exist (`ENODEV`, `ENOENT`, ...).
    #[error("{0} not found")]
    NotFound(String),
    /// A link with that name, or that address, already exists (`EEXIST`, `EBUSY` from the tun driver).
    #[error("{0} already exists")]
    Exists(String),
    /// The link is not a bridge, but the operation needs one.
    #[error("link #{index} is not a bridge (kind {kind:?})")]
    NotABridge {
        /// The link's index.
        index: u32,
        /// Its kind as the kernel reports it (`None` for a plain device).
        kind: Option<String>,
    },
    /// The link is not attached to a bridge, but the operation works on bridge ports.
    #[error("link #{0} is not a bridge port")]
    NotABridgePort(u32),
    /// The kernel lacks a feature (`EOPNOTSUPP`), e.g. bridge VLAN filtering on this build.
    #[error("{what} is not supported by this kernel")]
    Unsupported {
        /// The feature.
        what: &'static str,
    },
    /// The kernel refused a netlink request for another reason.
    #[error("netlink {op} failed: {source}")]
    Netlink {
        /// The operation (`create bridge`, `set master`, ...).
        op: &'static str,
        /// The kernel's errno, when the failure is a kernel answer.
        errno: Option<i32>,
        /// The netlink library's error.
        #[source]
        source: rtnetlink::Error,
    },
    /// A system call outside netlink failed (opening `/dev/net/tun`, `TUNSETIFF`, the socket).
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// The kernel's answer lacks something it always sends (e.g. a just-created link is missing).
    #[error("unexpected netlink answer: {0}")]
    Unexpected(String),
    /// `/dev/vhost-net` could not be opened for a NIC queue ([`vhost`]).
    #[error("vhost-net: {reason}")]
    Vhost {
        /// Why, in words an operator acts on (absent device, no module, refused).
        reason: String,
        /// The open's failure.
        #[source]
        source: io::Error,
    },
}

impl NetError {
    /// A short, stable word for the kind of failure, for logs and error details.
    pub fn code(&self) -> &'static str {
        match self {
            NetError::InvalidName { .. } => "invalid_name",
            NetError::InvalidVlan(_) => "invalid_vlan",
            NetError::InvalidCookie(_) => "invalid_cookie",
            NetError::InvalidPrefix(_) => "invalid_prefix",
            NetError::NotFound(_) => "not_found",
            NetError::Exists(_) => "exists",
            NetError::NotABridge { .. } => "not_a_bridge",
            NetError::NotABridgePort(_) => "not_a_bridge_port",
            NetError::Unsupported { .. } => "unsupported",
            NetError::Netlink { .. } => "netlink",
            NetError::Io { .. } => "io",
            NetError::Unexpected(_) => "unexpected",
            NetError::Vhost { .. } => "vhost",
        }
    }

    /// The kernel's errno behind a [`NetError::Netlink`] or [`NetError::Io`] error.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetError::Netlink { errno, .. } => *errno,
            NetError::Io { source, .. } | NetError::Vhost { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Checks a link name by vmhostd's one rule ([`crate::config::ifname_problem`]: the kernel's
/// `dev_valid_name` and a little more).
///
/// # Errors
/// [`NetError::InvalidName`] with the reason.
pub fn validate_link_name(name: &str) -> Result<(), NetError> {
    match crate::config::ifname_problem(name) {
        Some(reason) => Err(NetError::InvalidName { name: name.to_string(), reason }),
        None => Ok(()),
    }
}

/// Test support: running async code in a fresh network namespace.
#[cfg(test)]
pub(crate) mod testing {
    use std::future::Future;

    /// Waits up to ten seconds for link `name` to be gone. A tap goes when its last descriptor
    /// closes, and a child another test thread forks at that moment holds a copy until its exec.
    pub(crate) async fn wait_link_gone(nl: &super::link::Netlink, name: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while nl.link_by_name(name).await.unwrap().is_some() {
            assert!(std::time::Instant::now() < deadline, "{name} is still there");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    use nix::sched::CloneFlags;

    /// Runs `body` in a new thread that first moves into a network namespace of its own
    /// (`unshare(CLONE_NEWNET)`), then drives `body` on a current-thread tokio runtime.
    ///
    /// A network namespace belongs to a thread, not a process, so other tests running in parallel
    /// keep theirs; everything `body` creates is confined to the new namespace and disappears with
    /// it. Netlink sockets, `/dev/net/tun` descriptors and child processes made inside `body` all
    /// live in that namespace, which is why the socket must be opened after the `unshare`, inside
    /// the thread. Needs root (`CAP_SYS_ADMIN`); a panic in `body` is re-raised in the caller.
    pub(crate) fn in_netns<F, Fut, T>(body: F) -> T
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T>,
        T: Send + 'static,
    {
        let thread = std::thread::spawn(move || {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET) needs root");
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
            runtime.block_on(body())
        });
        match thread.join() {
            Ok(value) => value,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// The local experimental ethertype test frames carry, so nothing else is mistaken for one.
    pub(crate) const TEST_ETHERTYPE: u16 = 0x88b5;

    /// An Ethernet frame from `src` to `dst` with [`TEST_ETHERTYPE`] and `payload`, with an
    /// 802.1Q tag of VLAN `vlan` if given.
    pub(crate) fn test_frame(dst: [u8; 6], src: [u8; 6], vlan: Option<u16>, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::with_capacity(18 + payload.len());
        f.extend_from_slice(&dst);
        f.extend_from_slice(&src);
        if let Some(vid) = vlan {
            f.extend_from_slice(&0x8100u16.to_be_bytes());
            f.extend_from_slice(&vid.to_be_bytes());
        }
        f.extend_from_slice(&TEST_ETHERTYPE.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Sends `frame` as it is out of link `ifname` (an `AF_PACKET` raw socket of the calling
    /// thread's namespace): what a wire delivers to the link's peer.
    pub(crate) fn send_frame(ifname: &str, frame: &[u8]) {
        let name = std::ffi::CString::new(ifname).expect("link name");
        // SAFETY: plain calls with valid pointers; the socket is closed below.
        unsafe {
            let index = libc::if_nametoindex(name.as_ptr());
            assert_ne!(index, 0, "no link {ifname}");
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "AF_PACKET socket: {}", std::io::Error::last_os_error());
            let mut addr: libc::sockaddr_ll = std::mem::zeroed();
            addr.sll_family = libc::AF_PACKET as u16;
            addr.sll_ifindex = index as i32;
            addr.sll_halen = 6;
            addr.sll_addr[..6].copy_from_slice(&frame[..6]);
            let sent = libc::sendto(
                fd,
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
            let err = std::io::Error::last_os_error();
            libc::close(fd);
            assert_eq!(sent, frame.len() as isize, "send on {ifname}: {err}");
        }
    }

    /// Writes `frame` into a tap's descriptor (made with `IFF_VNET_HDR`): what a guest sends.
    pub(crate) fn write_tap(fd: &std::os::fd::OwnedFd, frame: &[u8]) {
        use std::os::fd::AsRawFd;
        let mut buf = vec![0u8; VNET_HDR + frame.len()];
        buf[VNET_HDR..].copy_from_slice(frame);
        // SAFETY: writes from a live buffer to an open descriptor.
        let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        assert_eq!(n, buf.len() as isize, "write tap: {}", std::io::Error::last_os_error());
    }

    /// The virtio-net header in front of every frame on a tap descriptor (the default size).
    const VNET_HDR: usize = 10;

    /// Reads frames from a tap's descriptor until `want` test frames ([`TEST_ETHERTYPE`], tagged
    /// or not) arrived or `within` passed, and returns the test frames (others, such as a
    /// kernel's own chatter, are skipped).
    pub(crate) fn read_test_frames(
        fd: &std::os::fd::OwnedFd,
        want: usize,
        within: std::time::Duration,
    ) -> Vec<Vec<u8>> {
        use std::os::fd::AsRawFd;
        let deadline = std::time::Instant::now() + within;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 65_536 + VNET_HDR];
        while out.len() < want {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(60_000) as i32 + 1) };
            if ready <= 0 {
                continue;
            }
            // SAFETY: reads into a live buffer of the given length.
            let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            assert!(n >= 0, "read tap: {}", std::io::Error::last_os_error());
            let frame = &buf[VNET_HDR.min(n as usize)..n as usize];
            if is_test_frame(frame) {
                out.push(frame.to_vec());
            }
        }
        out
    }

    /// Whether `frame` carries [`TEST_ETHERTYPE`], behind one 802.1Q tag or none.
    pub(crate) fn is_test_frame(frame: &[u8]) -> bool {
        let at = |i: usize| frame.get(i..i + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
        match at(12) {
            Some(0x8100) => at(16) == Some(TEST_ETHERTYPE),
            Some(t) => t == TEST_ETHERTYPE,
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_alias_round_trips() {
        let vm = Owner::Vm("web-1".to_string());
        let net = Owner::Network("lan".to_string());
        assert_eq!(owner_alias(&vm), "vmhost:vm=web-1");
        assert_eq!(owner_alias(&net), "vmhost:net=lan");
        assert_eq!(parse_owner(&owner_alias(&vm)), Some(vm));
        assert_eq!(parse_owner(&owner_alias(&net)), Some(net));
        // A name may itself contain '=' or ':'; only the first '=' separates.
        assert_eq!(parse_owner("vmhost:vm=a=b:c"), Some(Owner::Vm("a=b:c".to_string())));
    }

    #[test]
    fn foreign_aliases_have_no_owner() {
        for alias in [
            "",
            "uplink to the rack",
            "vmhost",
            "vmhost:",
            "vmhost:vm",
            "vmhost:vm=",
            "vmhost:net=",
            "vmhost:disk=x",
            "VMHOST:vm=x",
            " vmhost:vm=x",
            "libvirt:vm=x",
        ] {
            assert_eq!(parse_owner(alias), None, "{alias:?}");
        }
    }

    #[test]
    fn link_names_follow_the_kernel_rules() {
        for good in ["a", "vmt-web1-0", "br-lan", "x".repeat(15).as_str(), "tap.0", "eth0.100"] {
            assert!(validate_link_name(good).is_ok(), "{good:?}");
        }
        // Stricter than the kernel where vmhostd needs it: ASCII only (the config's rule too),
        // no leading dot (a capture ledger's file would be a hidden temporary file).
        for bad in ["", ".", "..", ".x", "é", "a/b", "a b", "a\tb", "a\nb", "eth0:1", "tap%d", "a\0b", &"x".repeat(16)]
        {
            let err = validate_link_name(bad).unwrap_err();
            assert_eq!(err.code(), "invalid_name", "{bad:?}");
        }
        // The length is counted in bytes, as the kernel's IFNAMSIZ does.
        assert!(validate_link_name(&"x".repeat(16)).is_err_and(|e| e.to_string().contains("longer than 15 bytes")));
    }

    #[test]
    fn error_codes_and_errno() {
        let e = NetError::Io { op: "open /dev/net/tun", source: io::Error::from_raw_os_error(libc::EPERM) };
        assert_eq!(e.code(), "io");
        assert_eq!(e.errno(), Some(libc::EPERM));
        assert_eq!(NetError::Unsupported { what: "bridge VLAN filtering" }.errno(), None);
        assert_eq!(
            NetError::Unsupported { what: "bridge VLAN filtering" }.to_string(),
            "bridge VLAN filtering is not supported by this kernel"
        );
    }
}
