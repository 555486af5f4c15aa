//! Which addresses a URL import may reach: the host itself, its LAN and the networks only it
//! can route to are not the internet, and a request to fetch "an image" must not become a way
//! to reach them from the daemon's side of the firewall (docs/images.md, threat model).
//!
//! [`classify`] puts an address in one class of the IANA special-purpose registries (an
//! IPv4-mapped, NAT64 or 6to4 IPv6 address by the IPv4 address it carries); [`check`] decides
//! with the `[images] allow_private` policy ([`AllowPrivate`]). Both are pure.

use serde::Deserialize;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// What kind of address an address is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Globally routable unicast: always allowed.
    Public,
    /// 127.0.0.0/8, ::1: the host itself.
    Loopback,
    /// 10/8, 172.16/12, 192.168/16, fec0::/10 (deprecated site-local).
    Private,
    /// 100.64.0.0/10: carrier-grade NAT, shared address space.
    SharedNat,
    /// 169.254.0.0/16 (cloud metadata services live here), fe80::/10.
    LinkLocal,
    /// fc00::/7.
    UniqueLocal,
    /// 192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32, 3fff::/20.
    Documentation,
    /// Any other special-purpose or unassigned range: 192.0.0/24, 192.88.99/24, 198.18/15,
    /// 240/4, ::/96, 100::/64, 2001::/23, 64:ff9b:1::/48, everything outside 2000::/3.
    Reserved,
    /// 0.0.0.0/8 ("this network"; 0.0.0.0 connects to the host), `::`.
    Unspecified,
    /// 224/4, ff00::/8.
    Multicast,
    /// 255.255.255.255.
    Broadcast,
}

impl Class {
    /// Why an address of this class is not the internet, for an error message.
    pub fn why(self) -> &'static str {
        match self {
            Class::Public => "a public address",
            Class::Loopback => "a loopback address (the host itself)",
            Class::Private => "a private address",
            Class::SharedNat => "a shared (carrier-grade NAT) address",
            Class::LinkLocal => "a link-local address",
            Class::UniqueLocal => "a unique-local address",
            Class::Documentation => "a documentation address",
            Class::Reserved => "a reserved address",
            Class::Unspecified => "an unspecified address",
            Class::Multicast => "a multicast address",
            Class::Broadcast => "the broadcast address",
        }
    }

    /// Whether `allow_private` can allow it: not an address no download has any business with
    /// (unspecified, multicast, broadcast).
    fn allowable(self) -> bool {
        !matches!(self, Class::Unspecified | Class::Multicast | Class::Broadcast)
    }
}

fn v4_in(ip: Ipv4Addr, net: [u8; 4], len: u32) -> bool {
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    u32::from(ip) & mask == u32::from(Ipv4Addr::from(net)) & mask
}

fn v6_in(ip: Ipv6Addr, net: Ipv6Addr, len: u32) -> bool {
    let mask = if len == 0 { 0 } else { u128::MAX << (128 - len) };
    u128::from(ip) & mask == u128::from(net) & mask
}

/// The class of an IPv4 address.
fn classify_v4(ip: Ipv4Addr) -> Class {
    const RANGES: &[([u8; 4], u32, Class)] = &[
        ([0, 0, 0, 0], 8, Class::Unspecified),
        ([10, 0, 0, 0], 8, Class::Private),
        ([100, 64, 0, 0], 10, Class::SharedNat),
        ([127, 0, 0, 0], 8, Class::Loopback),
        ([169, 254, 0, 0], 16, Class::LinkLocal),
        ([172, 16, 0, 0], 12, Class::Private),
        ([192, 0, 0, 0], 24, Class::Reserved),
        ([192, 0, 2, 0], 24, Class::Documentation),
        ([192, 88, 99, 0], 24, Class::Reserved),
        ([192, 168, 0, 0], 16, Class::Private),
        ([198, 18, 0, 0], 15, Class::Reserved),
        ([198, 51, 100, 0], 24, Class::Documentation),
        ([203, 0, 113, 0], 24, Class::Documentation),
        ([224, 0, 0, 0], 4, Class::Multicast),
        ([255, 255, 255, 255], 32, Class::Broadcast),
        ([240, 0, 0, 0], 4, Class::Reserved),
    ];
    RANGES.iter().find(|(net, len, _)| v4_in(ip, *net, *len)).map_or(Class::Public, |(_, _, c)| *c)
}

/// The IPv4 address bits `from..from+32` of `ip` carry.
fn embedded_v4(ip: Ipv6Addr, from: u32) -> Ipv4Addr {
    Ipv4Addr::from(((u128::from(ip) >> (128 - from - 32)) & u128::from(u32::MAX)) as u32)
}

/// The class of an IPv6 address; one carrying an IPv4 address that reaches it (mapped, NAT64,
/// 6to4) has that address's class.
fn classify_v6(ip: Ipv6Addr) -> Class {
    let net = |s: &str| s.parse::<Ipv6Addr>().unwrap_or(Ipv6Addr::UNSPECIFIED);
    if ip.is_unspecified() {
        return Class::Unspecified;
    }
    if ip.is_loopback() {
        return Class::Loopback;
    }
    if let Some(v4) = ip.to_ipv4_mapped() {
        return classify_v4(v4);
    }
    if v6_in(ip, net("64:ff9b::"), 96) {
        return classify_v4(embedded_v4(ip, 96));
    }
    if v6_in(ip, net("2002::"), 16) {
        return classify_v4(embedded_v4(ip, 16));
    }
    let ranges: [(&str, u32, Class); 10] = [
        ("::", 96, Class::Reserved), // IPv4-compatible, deprecated
        ("64:ff9b:1::", 48, Class::Reserved),
        ("100::", 64, Class::Reserved),
        ("2001:db8::", 32, Class::Documentation),
        ("2001::", 23, Class::Reserved),
        ("3fff::", 20, Class::Documentation),
        ("fc00::", 7, Class::UniqueLocal),
        ("fe80::", 10, Class::LinkLocal),
        ("fec0::", 10, Class::Private),
        ("ff00::", 8, Class::Multicast),
    ];
    if let Some((_, _, c)) = ranges.iter().find(|(n, len, _)| v6_in(ip, net(n), *len)) {
        return *c;
    }
    // Only 2000::/3 is global unicast; the rest is unassigned.
    if v6_in(ip, net("2000::"), 3) {
        Class::Public
    } else {
        Class::Reserved
    }
}

/// The class of `ip`.
pub fn classify(ip: IpAddr) -> Class {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

/// A network of `[images] allow_private`: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    len: u32,
}

impl Network {
    /// Parses `ADDR/LEN` (or a bare address: one host).
    ///
    /// # Errors
    /// Not an address, a prefix length beyond the family's bits, or bits set after the prefix.
    pub fn parse(s: &str) -> Result<Network, String> {
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| format!("{s:?} is not a network (ADDRESS/PREFIX)"))?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            Some(l) if !l.is_empty() && l.len() <= 3 && l.bytes().all(|b| b.is_ascii_digit()) => {
                l.parse::<u32>().map_err(|_| format!("{s:?}: bad prefix length"))?
            }
            Some(_) => return Err(format!("{s:?}: bad prefix length")),
            None => bits,
        };
        if len > bits {
            return Err(format!("{s:?}: a prefix of at most {bits} bits"));
        }
        let net = Network { addr, len };
        if net.host_bits(addr) {
            return Err(format!("{s:?} has bits set after its /{len} prefix"));
        }
        Ok(net)
    }

    fn host_bits(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(v4) => self.len < 32 && u32::from(v4) & (u32::MAX >> self.len) != 0,
            IpAddr::V6(v6) => self.len < 128 && u128::from(v6) & (u128::MAX >> self.len) != 0,
        }
    }

    /// Whether `ip` is in the network (an IPv4-mapped IPv6 address counts as its IPv4 one).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(a)) => v4_in(a, net.octets(), self.len),
            (IpAddr::V6(net), IpAddr::V6(a)) => v6_in(a, net, self.len),
            _ => false,
        }
    }
}

impl std::fmt::Display for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// `[images] allow_private`: which non-public addresses a URL import may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AllowPrivate {
    /// `false` (the default): public addresses only.
    #[default]
    No,
    /// `true`: every address but unspecified, multicast and broadcast ones.
    All,
    /// A list of networks: public addresses and these.
    Networks(Vec<Network>),
}

impl<'de> Deserialize<'de> for AllowPrivate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bool(bool),
            List(Vec<String>),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("allow_private is true, false or a list of networks (\"10.1.0.0/16\")")
        })? {
            Raw::Bool(false) => Ok(AllowPrivate::No),
            Raw::Bool(true) => Ok(AllowPrivate::All),
            Raw::List(list) => list
                .iter()
                .map(|s| Network::parse(s))
                .collect::<Result<Vec<_>, _>>()
                .map(AllowPrivate::Networks)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// Whether a download may connect to `ip` under `policy`: `Err` with the address's class when
/// not.
///
/// # Errors
/// The class of a non-public address `policy` does not allow.
pub fn check(ip: IpAddr, policy: &AllowPrivate) -> Result<(), Class> {
    let class = classify(ip);
    let allowed = match (class, policy) {
        (Class::Public, _) => true,
        (c, _) if !c.allowable() => false,
        (_, AllowPrivate::No) => false,
        (_, AllowPrivate::All) => true,
        (_, AllowPrivate::Networks(nets)) => nets.iter().any(|n| n.contains(ip)),
    };
    if allowed {
        Ok(())
    } else {
        Err(class)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn every_special_range_is_classified_at_its_edges() {
        let cases: &[(&str, Class)] = &[
            ("0.0.0.0", Class::Unspecified),
            ("0.255.255.255", Class::Unspecified),
            ("1.0.0.0", Class::Public),
            ("8.8.8.8", Class::Public),
            ("9.255.255.255", Class::Public),
            ("10.0.0.0", Class::Private),
            ("10.255.255.255", Class::Private),
            ("11.0.0.0", Class::Public),
            ("100.63.255.255", Class::Public),
            ("100.64.0.0", Class::SharedNat),
            ("100.127.255.255", Class::SharedNat),
            ("100.128.0.0", Class::Public),
            ("126.255.255.255", Class::Public),
            ("127.0.0.1", Class::Loopback),
            ("127.255.255.254", Class::Loopback),
            ("128.0.0.0", Class::Public),
            ("169.253.255.255", Class::Public),
            ("169.254.169.254", Class::LinkLocal),
            ("169.255.0.0", Class::Public),
            ("172.15.255.255", Class::Public),
            ("172.16.0.0", Class::Private),
            ("172.31.255.255", Class::Private),
            ("172.32.0.0", Class::Public),
            ("192.0.0.8", Class::Reserved),
            ("192.0.1.0", Class::Public),
            ("192.0.2.1", Class::Documentation),
            ("192.88.99.1", Class::Reserved),
            ("192.167.255.255", Class::Public),
            ("192.168.0.1", Class::Private),
            ("192.168.255.255", Class::Private),
            ("192.169.0.0", Class::Public),
            ("198.17.255.255", Class::Public),
            ("198.18.0.0", Class::Reserved),
            ("198.19.255.255", Class::Reserved),
            ("198.20.0.0", Class::Public),
            ("198.51.100.7", Class::Documentation),
            ("203.0.113.9", Class::Documentation),
            ("223.255.255.255", Class::Public),
            ("224.0.0.1", Class::Multicast),
            ("239.255.255.255", Class::Multicast),
            ("240.0.0.0", Class::Reserved),
            ("255.255.255.254", Class::Reserved),
            ("255.255.255.255", Class::Broadcast),
            ("::", Class::Unspecified),
            ("::1", Class::Loopback),
            ("::2", Class::Reserved),
            ("::7f00:1", Class::Reserved),
            ("::ffff:127.0.0.1", Class::Loopback),
            ("::ffff:10.1.2.3", Class::Private),
            ("::ffff:169.254.169.254", Class::LinkLocal),
            ("::ffff:8.8.8.8", Class::Public),
            ("64:ff9b::7f00:1", Class::Loopback),
            ("64:ff9b::808:808", Class::Public),
            ("64:ff9b:1::1", Class::Reserved),
            ("100::1", Class::Reserved),
            ("2001::1", Class::Reserved),
            ("2001:1ff:ffff::", Class::Reserved),
            ("2001:200::1", Class::Public),
            ("2001:db8::1", Class::Documentation),
            ("2001:4860:4860::8888", Class::Public),
            ("2002:7f00:1::", Class::Loopback),
            ("2002:c0a8:101::1", Class::Private),
            ("2002:808:808::1", Class::Public),
            ("2a00:1450::1", Class::Public),
            ("3ffe::1", Class::Public),
            ("3fff::1", Class::Documentation),
            ("4000::1", Class::Reserved),
            ("1fff::1", Class::Reserved),
            ("fbff::1", Class::Reserved),
            ("fc00::1", Class::UniqueLocal),
            ("fdff:ffff::1", Class::UniqueLocal),
            ("fe80::1", Class::LinkLocal),
            ("febf::1", Class::LinkLocal),
            ("fec0::1", Class::Private),
            ("ff02::1", Class::Multicast),
        ];
        for (a, class) in cases {
            assert_eq!(classify(ip(a)), *class, "{a}");
        }
    }

    #[test]
    fn only_public_addresses_pass_by_default() {
        let policy = AllowPrivate::No;
        assert_eq!(check(ip("93.184.216.34"), &policy), Ok(()));
        assert_eq!(check(ip("2606:2800:220:1::1"), &policy), Ok(()));
        for (a, class) in [
            ("127.0.0.1", Class::Loopback),
            ("10.0.0.1", Class::Private),
            ("172.20.1.1", Class::Private),
            ("192.168.1.1", Class::Private),
            ("100.100.100.100", Class::SharedNat),
            ("169.254.169.254", Class::LinkLocal),
            ("fe80::1", Class::LinkLocal),
            ("fd00::1", Class::UniqueLocal),
            ("::ffff:127.0.0.1", Class::Loopback),
            ("224.0.0.251", Class::Multicast),
            ("0.0.0.0", Class::Unspecified),
            ("255.255.255.255", Class::Broadcast),
            ("192.0.2.1", Class::Documentation),
        ] {
            assert_eq!(check(ip(a), &policy), Err(class), "{a}");
        }
    }

    #[test]
    fn allow_private_opens_non_public_addresses_but_never_the_meaningless_ones() {
        let all = AllowPrivate::All;
        for a in ["127.0.0.1", "10.0.0.1", "169.254.1.1", "fd00::1", "::1", "192.0.2.1", "240.0.0.1"] {
            assert_eq!(check(ip(a), &all), Ok(()), "{a}");
        }
        for a in ["0.0.0.0", "::", "224.0.0.1", "ff02::1", "255.255.255.255", "::ffff:0.0.0.0"] {
            assert!(check(ip(a), &all).is_err(), "{a}");
        }
        let some =
            AllowPrivate::Networks(vec![Network::parse("127.0.0.1/32").unwrap(), Network::parse("fd00::/8").unwrap()]);
        assert_eq!(check(ip("127.0.0.1"), &some), Ok(()));
        assert_eq!(check(ip("::ffff:127.0.0.1"), &some), Ok(()), "mapped counts as its IPv4 address");
        assert_eq!(check(ip("fd12::1"), &some), Ok(()));
        assert_eq!(check(ip("8.8.8.8"), &some), Ok(()), "public stays allowed");
        assert_eq!(check(ip("127.0.0.2"), &some), Err(Class::Loopback));
        assert_eq!(check(ip("10.0.0.1"), &some), Err(Class::Private));
        assert_eq!(check(ip("fe80::1"), &some), Err(Class::LinkLocal));
        let wide = AllowPrivate::Networks(vec![Network::parse("0.0.0.0/0").unwrap()]);
        assert!(check(ip("0.0.0.0"), &wide).is_err(), "never the unspecified address");
        assert!(check(ip("224.0.0.1"), &wide).is_err());
    }

    #[test]
    fn networks_parse_strictly() {
        assert_eq!(Network::parse("10.1.0.0/16").unwrap().to_string(), "10.1.0.0/16");
        assert_eq!(Network::parse("192.168.1.5").unwrap().to_string(), "192.168.1.5/32");
        assert_eq!(Network::parse("fd00::/8").unwrap().to_string(), "fd00::/8");
        assert_eq!(Network::parse("::1").unwrap().to_string(), "::1/128");
        for bad in ["", "10.1.0.0/", "10.1.0.1/16", "10.0.0.0/33", "fd00::/129", "x/8", "10.0.0.0/+8", "10.0.0.0/08a"] {
            assert!(Network::parse(bad).is_err(), "{bad}");
        }
        let parse =
            |s: &str| toml::from_str::<std::collections::BTreeMap<String, AllowPrivate>>(s).map(|m| m["a"].clone());
        assert_eq!(parse("a = false").unwrap(), AllowPrivate::No);
        assert_eq!(parse("a = true").unwrap(), AllowPrivate::All);
        assert_eq!(
            parse("a = [\"10.0.0.0/8\"]").unwrap(),
            AllowPrivate::Networks(vec![Network::parse("10.0.0.0/8").unwrap()])
        );
        assert!(parse("a = [\"10.0.0.1/8\"]").is_err());
        assert!(parse("a = 1").is_err());
    }
}
