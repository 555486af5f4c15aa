//! A small async netlink facade: the link, address and bridge-VLAN requests vmhostd needs, and
//! nothing else.
//!
//! [`Netlink`] wraps one `rtnetlink` connection. The networking layer calls it in this order:
//! [`Netlink::connect`] once; [`Netlink::link_by_name`] / [`Netlink::links`] to look; for an owned
//! network [`Netlink::create_bridge`], [`Netlink::set_mtu`], [`Netlink::add_address`],
//! [`Netlink::set_up`]; per tap (made by [`super::tap::create_tap`]) [`Netlink::set_alias`],
//! [`Netlink::set_mtu`], [`Netlink::set_master`], [`Netlink::bridge_vlan_add`],
//! [`Netlink::bridge_vlan_add_tagged`] (a trunk), [`Netlink::set_up`]; per monitor tap
//! [`Netlink::set_ipv6_off`] before [`Netlink::set_up`]; per capture source
//! [`Netlink::set_promisc`]; on cleanup [`Netlink::bridge_vlan_del`] and [`Netlink::delete_link`].
//! The tc requests on the same connection are in [`super::tc`].
//!
//! Kernel answers are turned into [`NetError`]s that say what happened: `ENODEV` is
//! [`NetError::NotFound`], `EEXIST` is [`NetError::Exists`], and `EOPNOTSUPP` from a VLAN request is
//! [`NetError::Unsupported`]. The facade itself enforces no ownership: checking the `ifalias`
//! marker ([`super::parse_owner`]) before changing or deleting a link is the caller's rule, and
//! [`LinkInfo::alias`] is there for it.
//!
//! Bridge VLANs cannot be exercised on the development machines (their kernel has no bridge VLAN
//! filtering); there the VLAN calls are only tested for their [`NetError::Unsupported`] answer.
//! Their real behaviour is proven in the lab host (see the module docs of [`super`]).

use std::net::{IpAddr, Ipv4Addr};

use futures_util::TryStreamExt;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{
    AfSpecBridge, AfSpecInet6, AfSpecUnspec, BridgeVlanInfoFlags, In6AddrGenMode, InfoKind, LinkAttribute,
    LinkExtentMask, LinkFlags, LinkInfo as NlLinkInfo, LinkMessage,
};
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::{LinkBridge, LinkBridgeVlan, LinkMessageBuilder, LinkUnspec};

use super::{validate_link_name, NetError};

/// The feature named in [`NetError::Unsupported`] for VLAN requests.
const VLAN_FILTERING: &str = "bridge VLAN filtering";

/// A link as the kernel describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// Interface index.
    pub index: u32,
    /// Interface name.
    pub name: String,
    /// `IFLA_INFO_KIND`: `"bridge"`, `"tun"` (taps too), `"veth"`, ...; `None` for a plain device
    /// such as a physical NIC or `lo`.
    pub kind: Option<String>,
    /// The interface alias (`ifalias`), where vmhostd's ownership marker lives.
    pub alias: Option<String>,
    /// MTU in bytes.
    pub mtu: u32,
    /// Index of the bridge (or other master) the link is attached to.
    pub master: Option<u32>,
    /// Administratively up (`IFF_UP`); says nothing about carrier.
    pub up: bool,
    /// The user-set promiscuous flag (`IFF_PROMISC` in `ifi_flags`): what `ip link set promisc`
    /// and [`Netlink::set_promisc`] set. The kernel reports it apart from the promiscuity count
    /// that bridges and packet sockets take, so a bridge port reads `false` unless someone set it.
    pub promisc: bool,
    /// Ethernet address, for links that have a six-byte one.
    pub mac: Option<[u8; 6]>,
}

impl LinkInfo {
    /// Builds the summary from an `RTM_NEWLINK` answer.
    fn from_message(msg: &LinkMessage) -> LinkInfo {
        let mut info = LinkInfo {
            index: msg.header.index,
            name: String::new(),
            kind: None,
            alias: None,
            mtu: 0,
            master: None,
            up: msg.header.flags.contains(LinkFlags::Up),
            promisc: msg.header.flags.contains(LinkFlags::Promisc),
            mac: None,
        };
        for attr in &msg.attributes {
            match attr {
                LinkAttribute::IfName(name) => info.name.clone_from(name),
                LinkAttribute::IfAlias(alias) => info.alias = Some(alias.clone()),
                LinkAttribute::Mtu(mtu) => info.mtu = *mtu,
                LinkAttribute::Controller(master) if *master != 0 => info.master = Some(*master),
                LinkAttribute::Address(bytes) => info.mac = <[u8; 6]>::try_from(bytes.as_slice()).ok(),
                LinkAttribute::LinkInfo(infos) => {
                    for nested in infos {
                        if let NlLinkInfo::Kind(kind) = nested {
                            info.kind = Some(kind.to_string());
                        }
                    }
                }
                _ => {}
            }
        }
        info
    }
}

/// A link's cumulative traffic counters (`IFLA_STATS64`), as the host side sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinkCounters {
    /// Bytes received by the link.
    pub rx_bytes: u64,
    /// Packets received.
    pub rx_packets: u64,
    /// Received packets dropped.
    pub rx_dropped: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Packets sent.
    pub tx_packets: u64,
    /// Packets dropped on the way out (for a tap: the guest did not take them in time).
    pub tx_dropped: u64,
}

/// The counters in an `RTM_NEWLINK` answer, if it carries `IFLA_STATS64`.
fn counters_of(msg: &LinkMessage) -> Option<LinkCounters> {
    msg.attributes.iter().find_map(|attr| match attr {
        LinkAttribute::Stats64(s) => Some(LinkCounters {
            rx_bytes: s.rx_bytes,
            rx_packets: s.rx_packets,
            rx_dropped: s.rx_dropped,
            tx_bytes: s.tx_bytes,
            tx_packets: s.tx_packets,
            tx_dropped: s.tx_dropped,
        }),
        _ => None,
    })
}

/// One bridge VLAN entry of a port, as [`Netlink::bridge_vlans`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BridgeVlan {
    /// VLAN id.
    pub vid: u16,
    /// Untagged frames entering the port are assigned to this VLAN.
    pub pvid: bool,
    /// Frames of this VLAN leave the port untagged.
    pub untagged: bool,
}

/// A set of VLAN ids, each 1-4094, for [`Netlink::bridge_vlan_add_tagged`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VlanSet(std::collections::BTreeSet<u16>);

impl VlanSet {
    /// The set of `vids`; repeats count once.
    ///
    /// # Errors
    /// [`NetError::InvalidVlan`] for 0 or an id above 4094.
    pub fn new(vids: impl IntoIterator<Item = u16>) -> Result<VlanSet, NetError> {
        let mut set = std::collections::BTreeSet::new();
        for vid in vids {
            check_vid(vid)?;
            set.insert(vid);
        }
        Ok(VlanSet(set))
    }

    /// Every VLAN, 1-4094 (a trunk).
    pub fn all() -> VlanSet {
        VlanSet((1..=4094).collect())
    }

    /// The set without `vid` (a port's PVID, which must keep its own flags).
    #[must_use]
    pub fn without(mut self, vid: u16) -> VlanSet {
        self.0.remove(&vid);
        self
    }

    /// Whether the set has no VLAN.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `vid` is in the set.
    pub fn contains(&self, vid: u16) -> bool {
        self.0.contains(&vid)
    }

    /// The ids in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.0.iter().copied()
    }

    /// The runs of consecutive ids, `(first, last)`, ascending: what one message carries.
    pub fn ranges(&self) -> Vec<(u16, u16)> {
        let mut out: Vec<(u16, u16)> = Vec::new();
        for vid in self.iter() {
            match out.last_mut() {
                Some((_, last)) if *last + 1 == vid => *last = vid,
                _ => out.push((vid, vid)),
            }
        }
        out
    }
}

/// A netlink route socket and the task that drives it.
///
/// Requests are sent from any task; answers are matched to requests by the connection task,
/// spawned by [`Netlink::connect`] on the current tokio runtime and stopped when this value is
/// dropped. The socket lives in the network namespace of the thread that called `connect`.
pub struct Netlink {
    /// The request side of the connection (`net::tc` builds its own messages on it).
    pub(super) handle: rtnetlink::Handle,
    /// The connection task.
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Netlink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The errno in an rtnetlink error, when it is a kernel answer.
pub(super) fn errno_of(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(msg) => msg.code.map(|code| code.get().abs()),
        _ => None,
    }
}

/// Maps an rtnetlink error to a [`NetError`]: `ENODEV` means `subject` does not exist, `EEXIST`
/// that it already does; everything else is [`NetError::Netlink`] for `op`.
fn map_err(op: &'static str, subject: impl FnOnce() -> String) -> impl FnOnce(rtnetlink::Error) -> NetError {
    move |source| {
        let errno = errno_of(&source);
        match errno {
            Some(libc::ENODEV) => NetError::NotFound(subject()),
            Some(libc::EEXIST) => NetError::Exists(subject()),
            _ => NetError::Netlink { op, errno, source },
        }
    }
}

/// Like [`map_err`], and `EOPNOTSUPP` means the kernel has no bridge VLAN filtering.
fn map_vlan_err(op: &'static str, subject: impl FnOnce() -> String) -> impl FnOnce(rtnetlink::Error) -> NetError {
    move |source| match errno_of(&source) {
        Some(libc::EOPNOTSUPP) => NetError::Unsupported { what: VLAN_FILTERING },
        _ => map_err(op, subject)(source),
    }
}

/// Checks a VLAN id: 0 and 4095 are reserved by 802.1Q.
fn check_vid(vid: u16) -> Result<(), NetError> {
    if (1..=4094).contains(&vid) {
        Ok(())
    } else {
        Err(NetError::InvalidVlan(vid))
    }
}

/// The VLAN entries in the `IFLA_AF_SPEC` of an `AF_BRIDGE` link message, ranges expanded.
fn vlans_of(msg: &LinkMessage) -> Vec<BridgeVlan> {
    let mut out = Vec::new();
    let mut range_start: Option<u16> = None;
    for attr in &msg.attributes {
        let LinkAttribute::AfSpecBridge(specs) = attr else { continue };
        for spec in specs {
            let AfSpecBridge::VlanInfo(info) = spec else { continue };
            let entry = |vid| BridgeVlan {
                vid,
                pvid: info.flags.contains(BridgeVlanInfoFlags::Pvid),
                untagged: info.flags.contains(BridgeVlanInfoFlags::Untagged),
            };
            if info.flags.contains(BridgeVlanInfoFlags::RangeBegin) {
                range_start = Some(info.vid);
            } else if info.flags.contains(BridgeVlanInfoFlags::RangeEnd) {
                let start = range_start.take().unwrap_or(info.vid);
                out.extend((start..=info.vid).map(entry));
            } else {
                out.push(entry(info.vid));
            }
        }
    }
    out
}

impl Netlink {
    /// Opens a netlink route socket and spawns its connection task on the current tokio runtime.
    ///
    /// The socket belongs to the calling thread's network namespace.
    ///
    /// # Errors
    /// [`NetError::Io`] when the socket cannot be opened, or when called outside a tokio runtime.
    pub fn connect() -> Result<Netlink, NetError> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| NetError::Io { op: "netlink connect", source: std::io::Error::other(e) })?;
        let (connection, handle, _messages) =
            rtnetlink::new_connection().map_err(|source| NetError::Io { op: "netlink socket", source })?;
        let task = runtime.spawn(connection);
        Ok(Netlink { handle, task })
    }

    /// The link named `name`, or `None` if there is none.
    ///
    /// # Errors
    /// [`NetError::InvalidName`] for a name no link can have; [`NetError::Netlink`] when the
    /// request fails.
    pub async fn link_by_name(&self, name: &str) -> Result<Option<LinkInfo>, NetError> {
        validate_link_name(name)?;
        let mut answers = self.handle.link().get().match_name(name).execute();
        match answers.try_next().await {
            Ok(msg) => Ok(msg.as_ref().map(LinkInfo::from_message)),
            Err(e) if errno_of(&e) == Some(libc::ENODEV) => Ok(None),
            Err(source) => Err(NetError::Netlink { op: "get link", errno: errno_of(&source), source }),
        }
    }

    /// The link with interface index `index`, or `None` if there is none.
    ///
    /// # Errors
    /// [`NetError::Netlink`] when the request fails.
    pub async fn link_by_index(&self, index: u32) -> Result<Option<LinkInfo>, NetError> {
        if index == 0 {
            return Ok(None);
        }
        let mut answers = self.handle.link().get().match_index(index).execute();
        match answers.try_next().await {
            Ok(msg) => Ok(msg.as_ref().map(LinkInfo::from_message)),
            Err(e) if errno_of(&e) == Some(libc::ENODEV) => Ok(None),
            Err(source) => Err(NetError::Netlink { op: "get link", errno: errno_of(&source), source }),
        }
    }

    /// Every link in the namespace, in the kernel's dump order (by index on current kernels).
    ///
    /// # Errors
    /// [`NetError::Netlink`] when the dump fails.
    pub async fn links(&self) -> Result<Vec<LinkInfo>, NetError> {
        let mut answers = self.handle.link().get().execute();
        let mut out = Vec::new();
        while let Some(msg) = answers.try_next().await.map_err(|source| NetError::Netlink {
            op: "dump links",
            errno: errno_of(&source),
            source,
        })? {
            out.push(LinkInfo::from_message(&msg));
        }
        Ok(out)
    }

    /// The traffic counters of every link that reports them, by name: one dump, however many
    /// links are asked about (`vm.stats` reads every tap this way).
    ///
    /// # Errors
    /// [`NetError::Netlink`] when the dump fails.
    pub async fn link_counters(&self) -> Result<std::collections::BTreeMap<String, LinkCounters>, NetError> {
        let mut answers = self.handle.link().get().execute();
        let mut out = std::collections::BTreeMap::new();
        while let Some(msg) = answers.try_next().await.map_err(|source| NetError::Netlink {
            op: "dump link counters",
            errno: errno_of(&source),
            source,
        })? {
            if let Some(counters) = counters_of(&msg) {
                out.insert(LinkInfo::from_message(&msg).name, counters);
            }
        }
        Ok(out)
    }

    /// The link `index`, which must exist.
    async fn existing(&self, index: u32) -> Result<LinkInfo, NetError> {
        self.link_by_index(index).await?.ok_or_else(|| NetError::NotFound(format!("link #{index}")))
    }

    /// Creates the bridge `name`, down, with `alias` as its `ifalias` (normally an
    /// [`super::owner_alias`] marker) and, if asked, VLAN filtering on.
    ///
    /// The kernel ignores an alias sent with the creating `RTM_NEWLINK` (checked on 6.18), so the
    /// alias is set right after; if that fails the bridge is deleted again. A crash between the two steps
    /// would leave an unmarked bridge, which the daemon then refuses to adopt as its own: the
    /// operator sees a name clash instead of silent reuse.
    ///
    /// # Errors
    /// [`NetError::InvalidName`]; [`NetError::Exists`] when a link with that name exists;
    /// [`NetError::Unsupported`] when `vlan_filtering` is asked of a kernel without it (nothing is
    /// created then); [`NetError::Netlink`] for other refusals.
    pub async fn create_bridge(&self, name: &str, vlan_filtering: bool, alias: &str) -> Result<LinkInfo, NetError> {
        validate_link_name(name)?;
        // The alias rides along in case a kernel honours it at creation; 6.18 does not.
        let mut builder = LinkMessageBuilder::<LinkBridge>::new(name).alias(alias);
        if vlan_filtering {
            // Only sent when wanted: a kernel without VLAN filtering refuses even "off".
            builder = builder.vlan_filtering(true);
        }
        self.handle.link().add(builder.build()).execute().await.map_err(|source| match errno_of(&source) {
            Some(libc::EOPNOTSUPP) if vlan_filtering => NetError::Unsupported { what: VLAN_FILTERING },
            _ => map_err("create bridge", || format!("link {name}"))(source),
        })?;
        let created = self
            .link_by_name(name)
            .await?
            .ok_or_else(|| NetError::Unexpected(format!("bridge {name} missing right after its creation")))?;
        if created.alias.as_deref() == Some(alias) || alias.is_empty() {
            return Ok(created);
        }
        if let Err(e) = self.set_alias(created.index, alias).await {
            if let Err(del) = self.delete_link(created.index).await {
                tracing::warn!(bridge = name, error = %del, "cannot delete a bridge whose alias could not be set");
            }
            return Err(e);
        }
        self.existing(created.index).await
    }

    /// Sends an `RTM_NEWLINK` change for an existing link.
    async fn change(&self, op: &'static str, index: u32, msg: LinkMessage) -> Result<(), NetError> {
        self.handle.link().change(msg).execute().await.map_err(map_err(op, || format!("link #{index}")))
    }

    /// Sets (or, with `""`, clears) the `ifalias` of link `index`.
    ///
    /// # Errors
    /// [`NetError::NotFound`] when there is no such link; [`NetError::Netlink`] otherwise (e.g.
    /// `EINVAL` for an alias of 256 bytes or more).
    pub async fn set_alias(&self, index: u32, alias: &str) -> Result<(), NetError> {
        self.change("set alias", index, LinkUnspec::new_with_index(index).alias(alias).build()).await
    }

    /// Attaches link `index` to the bridge `master_index` (`0` detaches it).
    ///
    /// # Errors
    /// [`NetError::NotFound`] when either link is missing; [`NetError::Netlink`] otherwise (e.g.
    /// `EOPNOTSUPP` when the master is not a bridge, `ELOOP` for a bridge into itself).
    pub async fn set_master(&self, index: u32, master_index: u32) -> Result<(), NetError> {
        self.change("set master", index, LinkUnspec::new_with_index(index).controller(master_index).build()).await
    }

    /// Sets the MTU of link `index`.
    ///
    /// # Errors
    /// [`NetError::NotFound`] when there is no such link; [`NetError::Netlink`] otherwise (e.g.
    /// `EINVAL` for an MTU outside the device's range).
    pub async fn set_mtu(&self, index: u32, mtu: u32) -> Result<(), NetError> {
        self.change("set mtu", index, LinkUnspec::new_with_index(index).mtu(mtu).build()).await
    }

    /// Brings link `index` administratively up.
    ///
    /// # Errors
    /// [`NetError::NotFound`] when there is no such link; [`NetError::Netlink`] otherwise.
    pub async fn set_up(&self, index: u32) -> Result<(), NetError> {
        self.change("set up", index, LinkUnspec::new_with_index(index).up().build()).await
    }

    /// Deletes link `index`. Deleting a tap this way works too, though closing its descriptor is
    /// the usual way.
    ///
    /// # Errors
    /// [`NetError::NotFound`] when there is no such link; [`NetError::Netlink`] otherwise (e.g.
    /// `EOPNOTSUPP` for a device that cannot be deleted, such as `lo`).
    pub async fn delete_link(&self, index: u32) -> Result<(), NetError> {
        self.handle.link().del(index).execute().await.map_err(map_err("delete link", || format!("link #{index}")))
    }

    /// Adds the IPv4 address `addr/prefix` to link `index`.
    ///
    /// # Errors
    /// [`NetError::InvalidPrefix`] for a prefix above 32; [`NetError::Exists`] when the link
    /// already has this address; [`NetError::NotFound`] when there is no such link;
    /// [`NetError::Netlink`] otherwise.
    pub async fn add_address(&self, index: u32, addr: Ipv4Addr, prefix: u8) -> Result<(), NetError> {
        if prefix > 32 {
            return Err(NetError::InvalidPrefix(prefix));
        }
        self.handle.address().add(index, IpAddr::V4(addr), prefix).execute().await.map_err(|source| {
            match errno_of(&source) {
                Some(libc::EEXIST) => NetError::Exists(format!("address {addr}/{prefix} on link #{index}")),
                _ => map_err("add address", || format!("link #{index}"))(source),
            }
        })
    }

    /// The addresses (IPv4 and IPv6) of link `index` with their prefix lengths, in kernel order.
    ///
    /// # Errors
    /// [`NetError::Netlink`] when the dump fails.
    pub async fn addresses(&self, index: u32) -> Result<Vec<(IpAddr, u8)>, NetError> {
        let mut answers = self.handle.address().get().set_link_index_filter(index).execute();
        let mut out = Vec::new();
        let dump_err = |source| NetError::Netlink { op: "dump addresses", errno: errno_of(&source), source };
        while let Some(msg) = answers.try_next().await.map_err(dump_err)? {
            // For IPv4, IFA_LOCAL is the interface's own address (IFA_ADDRESS is the peer's on
            // point-to-point links); IPv6 sends only IFA_ADDRESS.
            let local = msg.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(ip) => Some(*ip),
                _ => None,
            });
            let address = msg.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(ip) => Some(*ip),
                _ => None,
            });
            if let Some(ip) = local.or(address) {
                out.push((ip, msg.header.prefix_len));
            }
        }
        Ok(out)
    }

    /// Indexes of the links that carry a default route (IPv4 or IPv6, any table, multipath
    /// included): a NIC with one is in use by the host and must not be passed through.
    ///
    /// # Errors
    /// The route dump fails.
    pub async fn default_route_links(&self) -> Result<std::collections::BTreeSet<u32>, NetError> {
        use rtnetlink::packet_route::route::RouteAttribute;
        let mut out = std::collections::BTreeSet::new();
        let requests = [
            rtnetlink::RouteMessageBuilder::<Ipv4Addr>::new().build(),
            rtnetlink::RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
        ];
        for request in requests {
            let mut routes = self.handle.route().get(request).execute();
            let dump_err = |source| NetError::Netlink { op: "dump routes", errno: errno_of(&source), source };
            while let Some(route) = routes.try_next().await.map_err(dump_err)? {
                if route.header.destination_prefix_length != 0 {
                    continue;
                }
                for attr in &route.attributes {
                    match attr {
                        RouteAttribute::Oif(index) => {
                            out.insert(*index);
                        }
                        RouteAttribute::MultiPath(hops) => out.extend(hops.iter().map(|h| h.interface_index)),
                        _ => {}
                    }
                }
            }
        }
        Ok(out)
    }

    /// Checks a port VLAN request before the kernel sees it: a valid VLAN id, and a link
    /// `port_index` that exists and is attached to a master.
    async fn check_port(&self, port_index: u32, vid: u16) -> Result<(), NetError> {
        check_vid(vid)?;
        let port = self.existing(port_index).await?;
        if port.master.is_none() {
            return Err(NetError::NotABridgePort(port_index));
        }
        Ok(())
    }

    /// Adds VLAN `vid` to bridge port `port_index`: as its PVID and untagged (an access port) when
    /// `pvid_untagged`, else as a tagged VLAN (a trunk member). Adding an existing VLAN updates
    /// its flags.
    ///
    /// Takes effect once the bridge has VLAN filtering on.
    ///
    /// # Errors
    /// [`NetError::InvalidVlan`] for 0 or above 4094; [`NetError::NotFound`] when there is no such
    /// link; [`NetError::NotABridgePort`] when it is not attached to a bridge;
    /// [`NetError::Unsupported`] when the kernel has no bridge VLAN filtering (`EOPNOTSUPP`);
    /// [`NetError::Netlink`] otherwise.
    pub async fn bridge_vlan_add(&self, port_index: u32, vid: u16, pvid_untagged: bool) -> Result<(), NetError> {
        self.check_port(port_index, vid).await?;
        let flags = if pvid_untagged {
            BridgeVlanInfoFlags::Pvid | BridgeVlanInfoFlags::Untagged
        } else {
            BridgeVlanInfoFlags::empty()
        };
        let msg = LinkBridgeVlan::new(port_index).vlan(vid, flags).build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(map_vlan_err("add bridge vlan", || format!("link #{port_index}")))
    }

    /// Removes VLAN `vid` from bridge port `port_index`.
    ///
    /// Idempotent: the kernel's `RTM_DELLINK` handler ignores the result of the per-VLAN delete,
    /// so removing a VLAN the port does not have succeeds, and so does any removal on a kernel
    /// without VLAN filtering (seen on this machine's 6.18). Read [`Netlink::bridge_vlans`] to
    /// know what is there.
    ///
    /// # Errors
    /// [`NetError::InvalidVlan`], [`NetError::NotFound`], [`NetError::NotABridgePort`] as for
    /// [`Netlink::bridge_vlan_add`]; [`NetError::Unsupported`] or [`NetError::Netlink`] should the
    /// kernel refuse after all.
    pub async fn bridge_vlan_del(&self, port_index: u32, vid: u16) -> Result<(), NetError> {
        self.check_port(port_index, vid).await?;
        let msg = LinkBridgeVlan::new(port_index).vlan(vid, BridgeVlanInfoFlags::empty()).build();
        self.handle
            .link()
            .del_with_message(msg)
            .execute()
            .await
            .map_err(map_vlan_err("delete bridge vlan", || format!("link #{port_index}")))
    }

    /// Adds every VLAN of `vids` to bridge port `port_index` as a tagged VLAN (not PVID, not
    /// untagged): a trunk. Runs of consecutive ids travel as ranges (`RangeBegin`/`RangeEnd`), all
    /// in one message, so a trunk of 1-4094 is one request. An empty set changes nothing.
    ///
    /// A VLAN the port has already gets the tagged flags (so adding the port's PVID here would
    /// take its PVID away: leave it out of `vids`).
    ///
    /// # Errors
    /// [`NetError::NotFound`], [`NetError::NotABridgePort`], [`NetError::Unsupported`],
    /// [`NetError::Netlink`] as for [`Netlink::bridge_vlan_add`].
    pub async fn bridge_vlan_add_tagged(&self, port_index: u32, vids: &VlanSet) -> Result<(), NetError> {
        let ranges = vids.ranges();
        let Some(&(first, _)) = ranges.first() else { return Ok(()) };
        self.check_port(port_index, first).await?;
        let mut msg = LinkBridgeVlan::new(port_index);
        for (start, end) in ranges {
            msg = if start == end {
                msg.vlan(start, BridgeVlanInfoFlags::empty())
            } else {
                msg.vlan_range_start(start, BridgeVlanInfoFlags::empty())
                    .vlan_range_end(end, BridgeVlanInfoFlags::empty())
            };
        }
        self.handle
            .link()
            .set(msg.build())
            .execute()
            .await
            .map_err(map_vlan_err("add bridge vlans", || format!("link #{port_index}")))
    }

    /// Sets or clears the user-set promiscuous flag of link `index` (`ip link set promisc`);
    /// [`LinkInfo::promisc`] reads it back. The promiscuity count others hold (a bridge, a packet
    /// socket) is theirs and stays.
    ///
    /// # Errors
    /// [`NetError::NotFound`] when there is no such link; [`NetError::Netlink`] otherwise.
    pub async fn set_promisc(&self, index: u32, on: bool) -> Result<(), NetError> {
        self.change("set promisc", index, LinkUnspec::new_with_index(index).promiscuous(on).build()).await
    }

    /// Turns IPv6 address generation off on link `index` (`IFLA_INET6_ADDR_GEN_MODE` = none):
    /// called on a monitor tap before it goes up, it gets no link-local address, so the host
    /// sends no router solicitation, no DAD and no MLD report into the guest's capture.
    ///
    /// A link without IPv6 (IPv6 disabled in the kernel, or an MTU below 1280) has nothing to
    /// turn off: that is success.
    ///
    /// # Errors
    /// [`NetError::NotFound`] when there is no such link; [`NetError::Netlink`] otherwise.
    pub async fn set_ipv6_off(&self, index: u32) -> Result<(), NetError> {
        let spec = LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(vec![AfSpecInet6::AddrGenMode(
            In6AddrGenMode::None,
        )])]);
        let msg = LinkUnspec::new_with_index(index).append_extra_attribute(spec).build();
        match self.handle.link().change(msg).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno_of(&e) == Some(libc::EAFNOSUPPORT) => Ok(()),
            Err(e) => Err(map_err("set ipv6 addrgenmode", || format!("link #{index}"))(e)),
        }
    }

    /// The VLANs of bridge port (or bridge) `port_index`, from an `AF_BRIDGE` link dump with
    /// `RTEXT_FILTER_BRVLAN`. Empty when the link is not a bridge or bridge port, or when the
    /// kernel has no VLAN filtering.
    ///
    /// # Errors
    /// [`NetError::Netlink`] when the dump fails.
    pub async fn bridge_vlans(&self, port_index: u32) -> Result<Vec<BridgeVlan>, NetError> {
        let mut answers =
            self.handle.link().get().set_filter_mask(AddressFamily::Bridge, vec![LinkExtentMask::Brvlan]).execute();
        let mut out = Vec::new();
        let dump_err = |source| NetError::Netlink { op: "dump bridge vlans", errno: errno_of(&source), source };
        while let Some(msg) = answers.try_next().await.map_err(dump_err)? {
            if msg.header.index == port_index {
                out.extend(vlans_of(&msg));
            }
        }
        Ok(out)
    }

    /// Turns VLAN filtering of bridge `bridge_index` on or off.
    ///
    /// Turning it off on a kernel without VLAN filtering succeeds: it is off already.
    ///
    /// # Errors
    /// [`NetError::NotFound`]; [`NetError::NotABridge`] when the link is not a bridge;
    /// [`NetError::Unsupported`] when turning it on and the kernel lacks it; [`NetError::Netlink`]
    /// otherwise.
    pub async fn set_bridge_vlan_filtering(&self, bridge_index: u32, on: bool) -> Result<(), NetError> {
        let bridge = self.existing(bridge_index).await?;
        if bridge.kind.as_deref() != Some("bridge") {
            return Err(NetError::NotABridge { index: bridge_index, kind: bridge.kind });
        }
        let msg = LinkMessageBuilder::<LinkBridge>::new_with_info_kind(InfoKind::Bridge)
            .index(bridge_index)
            .vlan_filtering(on)
            .build();
        match self.handle.link().change(msg).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno_of(&e) == Some(libc::EOPNOTSUPP) && !on => Ok(()),
            Err(e) => Err(map_vlan_err("set bridge vlan filtering", || format!("link #{bridge_index}"))(e)),
        }
    }

    /// The permanent hardware address of link `name` (`IFLA_PERM_ADDRESS`: the address the
    /// device came with, what `ethtool -P` shows, whatever address it has now); `None` when
    /// there is no such link or the kernel reports none (virtual links, drivers without one).
    ///
    /// # Errors
    /// [`NetError::InvalidName`] for a name no link can have; [`NetError::Netlink`] when the
    /// request fails.
    pub async fn permanent_address(&self, name: &str) -> Result<Option<[u8; 6]>, NetError> {
        validate_link_name(name)?;
        let mut answers = self.handle.link().get().match_name(name).execute();
        match answers.try_next().await {
            Ok(msg) => Ok(msg.and_then(|m| {
                m.attributes.iter().find_map(|a| match a {
                    LinkAttribute::PermAddress(bytes) => {
                        <[u8; 6]>::try_from(bytes.as_slice()).ok().filter(|b| b.iter().any(|&x| x != 0))
                    }
                    _ => None,
                })
            })),
            Err(e) if errno_of(&e) == Some(libc::ENODEV) => Ok(None),
            Err(source) => Err(NetError::Netlink { op: "get link", errno: errno_of(&source), source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::super::testing::in_netns;
    use super::super::{owner_alias, parse_owner, tap, Owner};
    use super::*;

    /// Runs `ip ARGS` as a test fixture (only for links the code under test must not create).
    fn ip(args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("run ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    #[test]
    fn virtual_and_absent_links_have_no_permanent_address() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            // lo has no hardware address; a bridge's is generated, never permanent.
            assert_eq!(nl.permanent_address("lo").await.unwrap(), None);
            let alias = owner_alias(&Owner::Network("perm".into()));
            nl.create_bridge("vmbr-perm", false, &alias).await.unwrap();
            assert_eq!(nl.permanent_address("vmbr-perm").await.unwrap(), None);
            assert_eq!(nl.permanent_address("no-such-link").await.unwrap(), None);
            assert!(nl.permanent_address("a/b").await.is_err());
        });
    }

    #[test]
    fn connect_outside_a_runtime_is_an_error() {
        let err = Netlink::connect().err().expect("connect without a runtime");
        assert_eq!(err.code(), "io");
    }

    #[test]
    fn bridge_is_created_marked_and_down_then_configured() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let alias = owner_alias(&Owner::Network("lan".into()));
            let br = nl.create_bridge("vmbr-lan", false, &alias).await.unwrap();
            assert_eq!(br.name, "vmbr-lan");
            assert_eq!(br.kind.as_deref(), Some("bridge"));
            assert_eq!(br.alias.as_deref(), Some(alias.as_str()));
            assert_eq!(parse_owner(br.alias.as_deref().unwrap()), Some(Owner::Network("lan".into())));
            assert!(!br.up, "a new bridge stays down until set_up");
            assert_eq!(br.master, None);
            assert!(br.mac.is_some());
            assert_eq!(br.mtu, 1500);

            nl.set_mtu(br.index, 1400).await.unwrap();
            nl.set_up(br.index).await.unwrap();
            let again = nl.link_by_name("vmbr-lan").await.unwrap().unwrap();
            assert_eq!(again.index, br.index);
            assert_eq!(again.mtu, 1400);
            assert!(again.up);
            assert_eq!(nl.link_by_index(br.index).await.unwrap(), Some(again.clone()));

            let all = nl.links().await.unwrap();
            assert!(all.contains(&again));
            let lo = all.iter().find(|l| l.name == "lo").expect("lo in a new namespace");
            assert_eq!(lo.kind, None);

            // The same name again is a clear conflict, and the first bridge is untouched.
            let err = nl.create_bridge("vmbr-lan", false, &alias).await.unwrap_err();
            assert!(matches!(err, NetError::Exists(_)), "{err:?}");
            assert_eq!(nl.link_by_name("vmbr-lan").await.unwrap(), Some(again));

            // Alias changes and clears.
            nl.set_alias(br.index, "vmhost:net=other").await.unwrap();
            let renamed = nl.link_by_index(br.index).await.unwrap().unwrap();
            assert_eq!(renamed.alias.as_deref(), Some("vmhost:net=other"));
            nl.set_alias(br.index, "").await.unwrap();
            assert_eq!(nl.link_by_index(br.index).await.unwrap().unwrap().alias, None);
        });
    }

    #[test]
    fn missing_links_are_none_or_not_found() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            assert_eq!(nl.link_by_name("nope0").await.unwrap(), None);
            assert_eq!(nl.link_by_index(4242).await.unwrap(), None);
            assert_eq!(nl.link_by_index(0).await.unwrap(), None);
            assert!(matches!(nl.link_by_name("bad name").await, Err(NetError::InvalidName { .. })));
            for err in [
                nl.set_up(4242).await.unwrap_err(),
                nl.set_mtu(4242, 1400).await.unwrap_err(),
                nl.set_alias(4242, "x").await.unwrap_err(),
                nl.delete_link(4242).await.unwrap_err(),
            ] {
                assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
            }
        });
    }

    #[test]
    fn default_routes_are_found_per_link() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            ip(&["link", "add", "up0", "type", "veth", "peer", "name", "up1"]);
            for l in ["up0", "up1"] {
                ip(&["link", "set", l, "up"]);
            }
            ip(&["addr", "add", "192.0.2.2/24", "dev", "up0"]);
            ip(&["addr", "add", "198.51.100.2/24", "dev", "up1"]);
            assert!(nl.default_route_links().await.unwrap().is_empty());
            ip(&["route", "add", "default", "via", "192.0.2.1", "dev", "up0"]);
            let up0 = nl.link_by_name("up0").await.unwrap().unwrap().index;
            let links = nl.default_route_links().await.unwrap();
            assert_eq!(links.into_iter().collect::<Vec<_>>(), vec![up0], "only up0 carries the default route");
        });
    }

    #[test]
    fn foreign_link_has_no_owner_and_delete_removes_only_what_is_asked() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            // Fixture: a veth pair the daemon did not make, one end with an operator's alias.
            ip(&["link", "add", "uplink0", "type", "veth", "peer", "name", "uplink1"]);
            ip(&["link", "set", "uplink0", "alias", "rack uplink"]);
            let br = nl.create_bridge("vmbr0", false, "vmhost:net=lan").await.unwrap();

            let foreign: Vec<LinkInfo> = nl
                .links()
                .await
                .unwrap()
                .into_iter()
                .filter(|l| l.alias.as_deref().and_then(parse_owner).is_none())
                .collect();
            let mut names: Vec<&str> = foreign.iter().map(|l| l.name.as_str()).collect();
            names.sort_unstable();
            assert_eq!(names, ["lo", "uplink0", "uplink1"], "only the bridge carries a marker");
            let veth = nl.link_by_name("uplink0").await.unwrap().unwrap();
            assert_eq!(veth.kind.as_deref(), Some("veth"));
            assert_eq!(veth.alias.as_deref(), Some("rack uplink"));
            assert_eq!(parse_owner(veth.alias.as_deref().unwrap()), None);
            assert_eq!(nl.link_by_name("uplink1").await.unwrap().unwrap().alias, None);

            nl.delete_link(br.index).await.unwrap();
            assert_eq!(nl.link_by_name("vmbr0").await.unwrap(), None);
            assert!(nl.link_by_name("uplink0").await.unwrap().is_some());
            assert!(nl.link_by_name("uplink1").await.unwrap().is_some());
            let err = nl.delete_link(br.index).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
        });
    }

    #[test]
    fn addresses_are_added_and_listed() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let br = nl.create_bridge("vmbr0", false, "vmhost:net=lan").await.unwrap();
            assert_eq!(nl.addresses(br.index).await.unwrap(), []);
            nl.add_address(br.index, Ipv4Addr::new(10, 77, 0, 1), 24).await.unwrap();
            nl.add_address(br.index, Ipv4Addr::new(10, 78, 0, 1), 16).await.unwrap();
            let v4: Vec<(IpAddr, u8)> =
                nl.addresses(br.index).await.unwrap().into_iter().filter(|(ip, _)| ip.is_ipv4()).collect();
            assert_eq!(
                v4,
                [(IpAddr::V4(Ipv4Addr::new(10, 77, 0, 1)), 24), (IpAddr::V4(Ipv4Addr::new(10, 78, 0, 1)), 16)]
            );

            let dup = nl.add_address(br.index, Ipv4Addr::new(10, 77, 0, 1), 24).await.unwrap_err();
            assert!(matches!(dup, NetError::Exists(_)), "{dup:?}");
            let bad = nl.add_address(br.index, Ipv4Addr::new(10, 77, 0, 2), 33).await.unwrap_err();
            assert!(matches!(bad, NetError::InvalidPrefix(33)), "{bad:?}");
            let missing = nl.add_address(4242, Ipv4Addr::new(10, 77, 0, 3), 24).await.unwrap_err();
            assert!(matches!(missing, NetError::NotFound(_)), "{missing:?}");

            // Another link's addresses are not reported.
            let lo = nl.link_by_name("lo").await.unwrap().unwrap();
            assert!(nl.addresses(lo.index).await.unwrap().iter().all(|(ip, _)| !ip.to_string().starts_with("10.7")));
        });
    }

    #[test]
    fn vlan_requests_on_this_kernel_are_unsupported() {
        // This machine's kernel has no bridge VLAN filtering; the lab host proves the real thing.
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let br = nl.create_bridge("vmbr0", false, "vmhost:net=lan").await.unwrap();
            let _tap = tap::create_tap("vmt0").unwrap();
            let port = nl.link_by_name("vmt0").await.unwrap().unwrap();

            // Checked before the kernel is asked.
            for vid in [0, 4095, 5000] {
                let err = nl.bridge_vlan_add(port.index, vid, true).await.unwrap_err();
                assert!(matches!(err, NetError::InvalidVlan(v) if v == vid), "{err:?}");
            }
            let err = nl.bridge_vlan_add(port.index, 10, true).await.unwrap_err();
            assert!(matches!(err, NetError::NotABridgePort(i) if i == port.index), "{err:?}");
            let err = nl.bridge_vlan_add(4242, 10, true).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");

            nl.set_master(port.index, br.index).await.unwrap();
            for pvid_untagged in [true, false] {
                let err = nl.bridge_vlan_add(port.index, 10, pvid_untagged).await.unwrap_err();
                assert!(matches!(err, NetError::Unsupported { what: VLAN_FILTERING }), "{err:?}");
            }
            // The kernel ignores per-VLAN delete results, so a delete "succeeds" even here.
            nl.bridge_vlan_del(port.index, 10).await.unwrap();
            let err = nl.bridge_vlan_del(port.index, 0).await.unwrap_err();
            assert!(matches!(err, NetError::InvalidVlan(0)), "{err:?}");
            assert_eq!(nl.bridge_vlans(port.index).await.unwrap(), []);
            assert_eq!(nl.bridge_vlans(br.index).await.unwrap(), []);

            let err = nl.set_bridge_vlan_filtering(br.index, true).await.unwrap_err();
            assert!(matches!(err, NetError::Unsupported { .. }), "{err:?}");
            nl.set_bridge_vlan_filtering(br.index, false).await.unwrap();
            let err = nl.set_bridge_vlan_filtering(port.index, false).await.unwrap_err();
            assert!(matches!(err, NetError::NotABridge { ref kind, .. } if kind.as_deref() == Some("tun")), "{err:?}");

            // Creating a filtering bridge fails cleanly and leaves nothing behind.
            let err = nl.create_bridge("vmbr1", true, "vmhost:net=v").await.unwrap_err();
            assert!(matches!(err, NetError::Unsupported { .. }), "{err:?}");
            assert_eq!(nl.link_by_name("vmbr1").await.unwrap(), None);
        });
    }

    #[test]
    fn promisc_flag_round_trips_apart_from_a_bridge_count() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            ip(&["link", "add", "src0", "type", "veth", "peer", "name", "peer0"]);
            let src = nl.link_by_name("src0").await.unwrap().unwrap();
            assert!(!src.promisc);
            // A bridge port has a promiscuity count from the bridge, not the user-set flag.
            let br = nl.create_bridge("br0", false, "").await.unwrap();
            nl.set_master(src.index, br.index).await.unwrap();
            nl.set_up(src.index).await.unwrap();
            assert!(!nl.link_by_index(src.index).await.unwrap().unwrap().promisc);
            nl.set_promisc(src.index, true).await.unwrap();
            let on = nl.link_by_index(src.index).await.unwrap().unwrap();
            assert!(on.promisc && on.up && on.master == Some(br.index), "{on:?}");
            nl.set_promisc(src.index, false).await.unwrap();
            let off = nl.link_by_index(src.index).await.unwrap().unwrap();
            assert!(!off.promisc && off.up && off.master == Some(br.index), "{off:?}");
            let err = nl.set_promisc(4242, true).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
        });
    }

    #[test]
    fn ipv6_off_before_up_leaves_a_tap_without_link_local_address() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let _quiet = tap::create_tap("vmtq0").unwrap();
            let _plain = tap::create_tap("vmtp0").unwrap();
            let quiet = nl.link_by_name("vmtq0").await.unwrap().unwrap().index;
            let plain = nl.link_by_name("vmtp0").await.unwrap().unwrap().index;
            nl.set_ipv6_off(quiet).await.unwrap();
            nl.set_up(quiet).await.unwrap();
            nl.set_up(plain).await.unwrap();
            let link_local = |addrs: Vec<(IpAddr, u8)>| {
                addrs.iter().any(|(ip, _)| matches!(ip, IpAddr::V6(v6) if v6.segments()[0] == 0xfe80))
            };
            // The tap without the call gets its fe80 address on up (so the check can fail)...
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !link_local(nl.addresses(plain).await.unwrap()) {
                assert!(std::time::Instant::now() < deadline, "no fe80 address on the plain tap");
                tokio::task::yield_now().await;
            }
            // ...by the same time the quiet one has none.
            assert!(!link_local(nl.addresses(quiet).await.unwrap()));
            assert_eq!(nl.addresses(quiet).await.unwrap(), []);
            let err = nl.set_ipv6_off(4242).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
        });
    }

    #[test]
    fn vlan_sets_are_checked_and_sent_as_ranges() {
        assert_eq!(VlanSet::all().ranges(), [(1, 4094)]);
        assert_eq!(VlanSet::all().without(1).ranges(), [(2, 4094)]);
        assert_eq!(VlanSet::all().without(100).ranges(), [(1, 99), (101, 4094)]);
        let set = VlanSet::new([20, 10, 11, 12, 4094, 11]).unwrap();
        assert_eq!(set.ranges(), [(10, 12), (20, 20), (4094, 4094)]);
        assert_eq!(set.iter().collect::<Vec<_>>(), [10, 11, 12, 20, 4094]);
        assert!(set.contains(20) && !set.contains(13));
        assert!(VlanSet::new([]).unwrap().is_empty());
        assert_eq!(VlanSet::new([]).unwrap().ranges(), []);
        for bad in [0, 4095] {
            assert!(matches!(VlanSet::new([5, bad]), Err(NetError::InvalidVlan(v)) if v == bad));
        }
    }

    #[test]
    fn tagged_vlans_on_this_kernel_are_unsupported() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let br = nl.create_bridge("vmbr0", false, "vmhost:net=lan").await.unwrap();
            let _tap = tap::create_tap("vmt0").unwrap();
            let port = nl.link_by_name("vmt0").await.unwrap().unwrap();
            // An empty set asks nothing of the kernel.
            nl.bridge_vlan_add_tagged(port.index, &VlanSet::default()).await.unwrap();
            let err = nl.bridge_vlan_add_tagged(port.index, &VlanSet::all()).await.unwrap_err();
            assert!(matches!(err, NetError::NotABridgePort(i) if i == port.index), "{err:?}");
            nl.set_master(port.index, br.index).await.unwrap();
            for set in [VlanSet::all().without(1), VlanSet::new([10, 20]).unwrap()] {
                let err = nl.bridge_vlan_add_tagged(port.index, &set).await.unwrap_err();
                assert!(matches!(err, NetError::Unsupported { what: VLAN_FILTERING }), "{err:?}");
            }
            let err = nl.bridge_vlan_add_tagged(4242, &VlanSet::all()).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
        });
    }

    #[test]
    fn vlan_entries_are_read_from_af_spec_with_ranges_expanded() {
        use rtnetlink::packet_route::link::BridgeVlanInfo;
        let mut msg = LinkMessage::default();
        let info = |vid, flags| AfSpecBridge::VlanInfo(BridgeVlanInfo { vid, flags });
        msg.attributes.push(LinkAttribute::AfSpecBridge(vec![
            info(1, BridgeVlanInfoFlags::empty()),
            info(10, BridgeVlanInfoFlags::Pvid | BridgeVlanInfoFlags::Untagged),
            info(20, BridgeVlanInfoFlags::RangeBegin),
            info(22, BridgeVlanInfoFlags::RangeEnd),
        ]));
        let plain = |vid| BridgeVlan { vid, pvid: false, untagged: false };
        assert_eq!(
            vlans_of(&msg),
            [plain(1), BridgeVlan { vid: 10, pvid: true, untagged: true }, plain(20), plain(21), plain(22)]
        );
    }
}
