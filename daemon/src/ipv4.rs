//! IPv4 addresses with a prefix (`10.0.0.5/24`), as used in network config and NIC specs.
//!
//! Pure parsing and arithmetic; no crate needed for four octets and a mask.

use std::fmt;
use std::net::Ipv4Addr;

/// An address with its prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Cidr {
    /// The address (host or network).
    pub addr: Ipv4Addr,
    /// Prefix length, 0..=32.
    pub prefix: u8,
}

impl Ipv4Cidr {
    /// Parses `a.b.c.d/p`.
    ///
    /// # Errors
    /// A message saying what is wrong.
    pub fn parse(text: &str) -> Result<Ipv4Cidr, String> {
        let (a, p) = text.split_once('/').ok_or_else(|| format!("{text:?} is not of the form a.b.c.d/prefix"))?;
        let addr: Ipv4Addr = a.parse().map_err(|_| format!("{a:?} is not an IPv4 address"))?;
        let prefix: u8 = p.parse().map_err(|_| format!("{p:?} is not a prefix length"))?;
        if prefix > 32 {
            return Err(format!("prefix /{prefix} is above 32"));
        }
        Ok(Ipv4Cidr { addr, prefix })
    }

    /// The netmask.
    pub fn mask(self) -> Ipv4Addr {
        Ipv4Addr::from(self.mask_bits())
    }

    fn mask_bits(self) -> u32 {
        if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.prefix))
        }
    }

    /// The network address.
    pub fn network(self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) & self.mask_bits())
    }

    /// The broadcast address.
    pub fn broadcast(self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) | !self.mask_bits())
    }

    /// True when `ip` is inside this network.
    pub fn contains(self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask_bits() == u32::from(self.network())
    }

    /// True when the address is the network or broadcast address of a /0../30 network, where
    /// those cannot be host addresses.
    pub fn is_network_or_broadcast(self) -> bool {
        self.prefix <= 30 && (self.addr == self.network() || self.addr == self.broadcast())
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_arithmetic() {
        let c = Ipv4Cidr::parse("10.0.0.5/24").unwrap();
        assert_eq!(c.to_string(), "10.0.0.5/24");
        assert_eq!(c.mask(), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(c.network(), Ipv4Addr::new(10, 0, 0, 0));
        assert_eq!(c.broadcast(), Ipv4Addr::new(10, 0, 0, 255));
        assert!(c.contains(Ipv4Addr::new(10, 0, 0, 200)));
        assert!(!c.contains(Ipv4Addr::new(10, 0, 1, 1)));
        assert!(!c.is_network_or_broadcast());
        assert!(Ipv4Cidr::parse("10.0.0.0/24").unwrap().is_network_or_broadcast());
        assert!(Ipv4Cidr::parse("10.0.0.255/24").unwrap().is_network_or_broadcast());
        assert!(!Ipv4Cidr::parse("10.0.0.1/31").unwrap().is_network_or_broadcast());
        let all = Ipv4Cidr::parse("0.0.0.0/0").unwrap();
        assert!(all.contains(Ipv4Addr::new(8, 8, 8, 8)));
        assert_eq!(Ipv4Cidr::parse("1.2.3.4/32").unwrap().broadcast(), Ipv4Addr::new(1, 2, 3, 4));
    }

    #[test]
    fn rejects_bad_text() {
        for t in ["10.0.0.5", "10.0.0.5/33", "10.0.0/24", "10.0.0.256/24", "a/24", "10.0.0.5/x", ""] {
            assert!(Ipv4Cidr::parse(t).is_err(), "{t}");
        }
    }
}
