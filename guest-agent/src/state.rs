//! What the guest's network looks like: the reply of `net.state`, and the kernel snapshot that
//! `net.check` and `net.apply` work from.
//!
//! Order of use: [`Snapshot::take`] reads links, IPv4 addresses and main-table routes through one
//! netlink socket; [`read_dns`] reads `/etc/resolv.conf` (or, when that names only
//! systemd-resolved's local stub, resolved's own list of upstream servers); [`Snapshot::view`]
//! turns both into the [`NetState`] the host sees. `net.check` evaluates its expectations against that same
//! [`NetState`], so a check never sees anything the host could not see itself.

use std::path::Path;

pub use vmhost_agent_protocol::{Dns, Interface, NetState, RouteView};

use crate::addr::{format_mac, Ipv4Net};
use crate::netlink::{Address, Link, Netlink, NetlinkError, Route};

/// Where the resolver configuration is read from.
pub const RESOLV_CONF: &str = "/etc/resolv.conf";

/// Where systemd-resolved writes the servers and search domains it forwards to (its own
/// `resolv.conf`, without the stub), read when [`RESOLV_CONF`] names only the stub.
pub const RESOLVED_CONF: &str = "/run/systemd/resolve/resolv.conf";

/// systemd-resolved's local stub listeners (`127.0.0.53`, and `127.0.0.54` in proxy mode).
pub const RESOLVED_STUBS: [&str; 2] = ["127.0.0.53", "127.0.0.54"];

/// The kernel's view of links, IPv4 addresses and main-table routes at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Every link, in index order.
    pub links: Vec<Link>,
    /// Every IPv4 address.
    pub addresses: Vec<Address>,
    /// IPv4 unicast routes of the main table.
    pub routes: Vec<Route>,
}

impl Snapshot {
    /// Reads links, addresses and routes through `netlink`.
    ///
    /// # Errors
    /// Any [`NetlinkError`] of the three dumps.
    pub fn take(netlink: &mut Netlink) -> Result<Snapshot, NetlinkError> {
        Ok(Snapshot { links: netlink.links()?, addresses: netlink.addresses()?, routes: netlink.routes()? })
    }

    /// The link called `name`.
    pub fn link(&self, name: &str) -> Option<&Link> {
        self.links.iter().find(|l| l.name == name)
    }

    /// The name of link `index`, or `#index` for a link that vanished between dumps.
    pub fn name_of(&self, index: u32) -> String {
        self.links.iter().find(|l| l.index == index).map_or_else(|| format!("#{index}"), |l| l.name.clone())
    }

    /// The IPv4 addresses of link `index`, in the kernel's order.
    pub fn addresses_of(&self, index: u32) -> Vec<Ipv4Net> {
        self.addresses.iter().filter(|a| a.index == index).map(|a| Ipv4Net { addr: a.addr, prefix: a.prefix }).collect()
    }

    /// The default routes, in the kernel's order.
    pub fn default_routes(&self) -> Vec<Route> {
        self.routes.iter().filter(|r| r.is_default()).copied().collect()
    }

    /// The `net.state` view of this snapshot plus `dns`, without the links' promiscuous flags
    /// (what a host that did not ask for them gets).
    pub fn view(&self, dns: Dns) -> NetState {
        self.view_with(dns, false)
    }

    /// The `net.state` view of this snapshot plus `dns`; with `promisc`, each interface's
    /// [`Interface::promisc`] is reported.
    pub fn view_with(&self, dns: Dns, promisc: bool) -> NetState {
        let interfaces = self
            .links
            .iter()
            .map(|l| Interface {
                name: l.name.clone(),
                mac: l.mac.as_ref().map(format_mac).unwrap_or_default(),
                up: l.up,
                mtu: l.mtu,
                kind: l.kind.clone(),
                alias: l.alias.clone(),
                addresses: self.addresses_of(l.index).iter().map(Ipv4Net::to_string).collect(),
                promisc: promisc.then_some(l.promisc),
            })
            .collect();
        let routes = self
            .routes
            .iter()
            .map(|r| RouteView {
                dst: if r.is_default() {
                    "default".to_string()
                } else {
                    Ipv4Net { addr: r.dst, prefix: r.dst_len }.to_string()
                },
                gateway: r.gateway.map(|g| g.to_string()),
                dev: r.oif.map(|i| self.name_of(i)).unwrap_or_default(),
            })
            .collect();
        NetState { interfaces, routes, dns }
    }
}

/// Parses `resolv.conf` text: `nameserver` lines in order, and the search list of the last
/// `search` or `domain` line (the two override each other, as in glibc's resolver). Comments
/// (`#`, `;`) and other options are ignored.
pub fn parse_resolv_conf(text: &str) -> Dns {
    let mut dns = Dns::default();
    for line in text.lines() {
        let line = line.split(['#', ';']).next().unwrap_or("");
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => dns.servers.extend(words.next().map(str::to_string)),
            Some("search") => dns.search = words.map(str::to_string).collect(),
            Some("domain") => dns.search = words.next().map(str::to_string).into_iter().collect(),
            _ => {}
        }
    }
    dns
}

/// Reads and parses one resolver configuration file; `None` when it cannot be read.
fn read_resolv_conf(path: &Path) -> Option<Dns> {
    std::fs::read(path).ok().map(|bytes| parse_resolv_conf(&String::from_utf8_lossy(&bytes)))
}

/// True when `dns` has servers and every one is a systemd-resolved stub ([`RESOLVED_STUBS`]):
/// the guest's real servers are then resolved's upstreams, not these.
pub fn names_only_the_stub(dns: &Dns) -> bool {
    !dns.servers.is_empty() && dns.servers.iter().all(|s| RESOLVED_STUBS.contains(&s.as_str()))
}

/// The DNS configuration to report, from `/etc/resolv.conf`'s (`etc`) and systemd-resolved's
/// (`resolved`, `None` when that file cannot be read): resolved's servers and search domains
/// when `etc` names only the stub and resolved's file is there; otherwise `etc` unchanged.
pub fn choose_dns(etc: Dns, resolved: Option<Dns>) -> Dns {
    match resolved {
        Some(upstream) if names_only_the_stub(&etc) => upstream,
        _ => etc,
    }
}

/// Reads the resolver configuration at `resolv_conf`, or, when it names only systemd-resolved's
/// stub, the upstream one resolved writes at `resolved_conf` ([`choose_dns`]). A missing or
/// unreadable `resolv_conf` is an empty configuration (the resolver then has no servers either).
pub fn read_dns(resolv_conf: &Path, resolved_conf: &Path) -> Dns {
    let etc = read_resolv_conf(resolv_conf).unwrap_or_default();
    if !names_only_the_stub(&etc) {
        return etc;
    }
    choose_dns(etc, read_resolv_conf(resolved_conf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn resolv_conf_follows_the_resolver() {
        let dns = parse_resolv_conf(
            "# generated\nnameserver 10.0.2.3\nnameserver 2001:db8::1 # v6\n\
             domain old.example\nsearch example.org lab.example.org\noptions ndots:2\n;nameserver 1.1.1.1\n",
        );
        assert_eq!(dns.servers, ["10.0.2.3", "2001:db8::1"]);
        assert_eq!(dns.search, ["example.org", "lab.example.org"]);
        // The last of search/domain wins.
        assert_eq!(parse_resolv_conf("search a.example b.example\ndomain c.example\n").search, ["c.example"]);
        assert_eq!(parse_resolv_conf(""), Dns::default());
        let none = Path::new("/nonexistent/resolv.conf");
        assert_eq!(read_dns(none, none), Dns::default());
    }

    /// What systemd-resolved writes: the stub file /etc/resolv.conf links to, and its own.
    const STUB: &str = "# This is /run/systemd/resolve/stub-resolv.conf managed by man:systemd-resolved(8).\n\
                        nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch lab.example\n";
    const UPSTREAM: &str = "# This is /run/systemd/resolve/resolv.conf managed by man:systemd-resolved(8).\n\
                            nameserver 10.0.2.3\nnameserver 10.0.2.4\nsearch lab.example corp.example\n";

    fn dns(servers: &[&str], search: &[&str]) -> Dns {
        Dns {
            servers: servers.iter().map(|s| s.to_string()).collect(),
            search: search.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn only_the_stub_means_resolveds_upstreams_are_the_servers() {
        let etc = parse_resolv_conf(STUB);
        assert!(names_only_the_stub(&etc));
        assert!(names_only_the_stub(&dns(&["127.0.0.54"], &[])));
        assert!(names_only_the_stub(&dns(&["127.0.0.53", "127.0.0.54"], &[])));
        assert_eq!(
            choose_dns(etc.clone(), Some(parse_resolv_conf(UPSTREAM))),
            dns(&["10.0.2.3", "10.0.2.4"], &["lab.example", "corp.example"])
        );
        // resolved's file is not there (not running): what /etc/resolv.conf says.
        assert_eq!(choose_dns(etc.clone(), None), etc);
        // resolved with no upstream: that is the truth, no servers.
        assert_eq!(choose_dns(etc, Some(Dns::default())), Dns::default());
    }

    #[test]
    fn a_plain_resolv_conf_is_reported_as_it_is() {
        let upstream = Some(parse_resolv_conf(UPSTREAM));
        for etc in [
            dns(&["10.0.2.3"], &["example.org"]),
            dns(&["127.0.0.53", "10.0.2.9"], &[]),
            dns(&["127.0.0.1"], &[]),
            dns(&[], &["example.org"]),
            Dns::default(),
        ] {
            assert!(!names_only_the_stub(&etc), "{etc:?}");
            assert_eq!(choose_dns(etc.clone(), upstream.clone()), etc);
        }
    }

    #[test]
    fn read_dns_picks_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (etc, resolved) = (dir.path().join("resolv.conf"), dir.path().join("resolved.conf"));
        std::fs::write(&resolved, UPSTREAM).expect("write");
        std::fs::write(&etc, STUB).expect("write");
        assert_eq!(read_dns(&etc, &resolved).servers, ["10.0.2.3", "10.0.2.4"]);
        std::fs::write(&etc, "nameserver 192.0.2.1\n").expect("write");
        assert_eq!(read_dns(&etc, &resolved).servers, ["192.0.2.1"]);
        std::fs::write(&etc, STUB).expect("write");
        std::fs::remove_file(&resolved).expect("remove");
        assert_eq!(read_dns(&etc, &resolved), dns(&["127.0.0.53"], &["lab.example"]));
    }

    #[test]
    fn view_names_devices_and_default_routes() {
        let snapshot = Snapshot {
            links: vec![
                Link { index: 1, name: "lo".into(), up: true, mtu: 65536, mac: Some([0; 6]), ..Link::default() },
                Link {
                    index: 2,
                    name: "eth0".into(),
                    up: true,
                    mtu: 1500,
                    mac: Some([0x52, 0x54, 0, 0x12, 0x34, 0x56]),
                    ..Link::default()
                },
            ],
            addresses: vec![
                Address { index: 1, addr: Ipv4Addr::LOCALHOST, prefix: 8 },
                Address { index: 2, addr: Ipv4Addr::new(10, 0, 2, 15), prefix: 24 },
            ],
            routes: vec![
                Route {
                    dst: Ipv4Addr::UNSPECIFIED,
                    dst_len: 0,
                    gateway: Some(Ipv4Addr::new(10, 0, 2, 2)),
                    oif: Some(2),
                    priority: 0,
                },
                Route { dst: Ipv4Addr::new(10, 0, 2, 0), dst_len: 24, gateway: None, oif: Some(2), priority: 0 },
                Route { dst: Ipv4Addr::new(10, 9, 0, 0), dst_len: 16, gateway: None, oif: Some(9), priority: 0 },
            ],
        };
        let state = snapshot.view(Dns::default());
        assert_eq!(state.interfaces[1].mac, "52:54:00:12:34:56");
        assert_eq!(state.interfaces[1].addresses, ["10.0.2.15/24"]);
        assert_eq!(
            state.routes[0],
            RouteView { dst: "default".into(), gateway: Some("10.0.2.2".into()), dev: "eth0".into() }
        );
        assert_eq!(state.routes[1].dst, "10.0.2.0/24");
        assert_eq!(state.routes[2].dev, "#9");
        let json = serde_json::to_value(&state).expect("serializes");
        assert_eq!(json["interfaces"][0]["kind"], "");
        assert_eq!(json["routes"][1]["gateway"], serde_json::Value::Null);
        // The promiscuous flag only when asked (an older host's closed type refuses the member).
        assert!(json["interfaces"][1].get("promisc").is_none(), "{json}");
        let mut promisc = snapshot.clone();
        promisc.links[1].promisc = true;
        let asked = promisc.view_with(Dns::default(), true);
        assert_eq!(asked.interfaces.iter().map(|i| i.promisc).collect::<Vec<_>>(), [Some(false), Some(true)]);
    }
}
