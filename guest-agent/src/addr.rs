//! The two address notations of the protocol: IPv4 networks as `a.b.c.d/p` and MAC addresses as
//! `aa:bb:cc:dd:ee:ff`.
//!
//! Parsing is strict (exactly four decimal octets and a prefix of 0 to 32; exactly six two-digit
//! hex groups) because the strings come from the host and are compared with what the kernel
//! reports; formatting is canonical (lower-case MACs), so that the same value is always written the
//! same way in `net.state` and in check names.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// An IPv4 address with its prefix length, as assigned to an interface (`10.0.0.5/24`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Net {
    /// The address (host bits are kept: this is an interface address, not a network).
    pub addr: Ipv4Addr,
    /// Prefix length, 0 to 32.
    pub prefix: u8,
}

/// Why a string is not an `a.b.c.d/p` address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    /// No `/` separating address and prefix length.
    #[error("expected a.b.c.d/prefix")]
    NoPrefix,
    /// The part before `/` (or the whole string, where no prefix is expected) is not an IPv4 address.
    #[error("not an IPv4 address")]
    BadAddress,
    /// The prefix length is not a number from 0 to 32.
    #[error("prefix length must be 0 to 32")]
    BadPrefix,
    /// Not six colon-separated pairs of hex digits.
    #[error("expected a MAC address like 02:00:00:00:00:01")]
    BadMac,
}

impl FromStr for Ipv4Net {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Ipv4Net, AddrError> {
        let (addr, prefix) = s.split_once('/').ok_or(AddrError::NoPrefix)?;
        let addr = addr.parse::<Ipv4Addr>().map_err(|_| AddrError::BadAddress)?;
        // Plain decimal digits only: "+24" or " 24" would parse as u8 otherwise.
        if prefix.is_empty() || prefix.len() > 2 || !prefix.bytes().all(|b| b.is_ascii_digit()) {
            return Err(AddrError::BadPrefix);
        }
        let prefix = prefix.parse::<u8>().map_err(|_| AddrError::BadPrefix)?;
        if prefix > 32 {
            return Err(AddrError::BadPrefix);
        }
        Ok(Ipv4Net { addr, prefix })
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Parses a plain IPv4 address (a gateway, a DNS server).
///
/// # Errors
/// [`AddrError::BadAddress`].
pub fn parse_ipv4(s: &str) -> Result<Ipv4Addr, AddrError> {
    s.parse().map_err(|_| AddrError::BadAddress)
}

/// Parses `aa:bb:cc:dd:ee:ff` (either case).
///
/// # Errors
/// [`AddrError::BadMac`].
pub fn parse_mac(s: &str) -> Result<[u8; 6], AddrError> {
    let mut out = [0u8; 6];
    let mut groups = s.split(':');
    for byte in &mut out {
        let group = groups.next().ok_or(AddrError::BadMac)?;
        if group.len() != 2 || !group.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(AddrError::BadMac);
        }
        *byte = u8::from_str_radix(group, 16).map_err(|_| AddrError::BadMac)?;
    }
    if groups.next().is_some() {
        return Err(AddrError::BadMac);
    }
    Ok(out)
}

/// Formats a MAC address in lower case with colons.
pub fn format_mac(mac: &[u8; 6]) -> String {
    let [a, b, c, d, e, f] = mac;
    format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{f:02x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_parse_strictly() {
        assert_eq!("10.0.0.5/24".parse(), Ok(Ipv4Net { addr: Ipv4Addr::new(10, 0, 0, 5), prefix: 24 }));
        assert_eq!("0.0.0.0/0".parse::<Ipv4Net>().map(|n| n.to_string()), Ok("0.0.0.0/0".to_string()));
        assert_eq!("10.0.0.5".parse::<Ipv4Net>(), Err(AddrError::NoPrefix));
        for bad in ["10.0.0.5/33", "10.0.0.5/", "10.0.0.5/+4", "10.0.0.5/ 4", "10.0.0.5/024", "10.0.0.5/x"] {
            assert_eq!(bad.parse::<Ipv4Net>(), Err(AddrError::BadPrefix), "{bad}");
        }
        for bad in ["10.0.0/24", "10.0.0.256/24", "::1/64", "/24", "a.b.c.d/24"] {
            assert_eq!(bad.parse::<Ipv4Net>(), Err(AddrError::BadAddress), "{bad}");
        }
    }

    #[test]
    fn macs_round_trip_in_lower_case() {
        let mac = parse_mac("52:54:00:AB:cd:0F").expect("valid");
        assert_eq!(mac, [0x52, 0x54, 0, 0xab, 0xcd, 0x0f]);
        assert_eq!(format_mac(&mac), "52:54:00:ab:cd:0f");
        for bad in
            ["", "52:54:00:ab:cd", "52:54:00:ab:cd:0f:00", "52-54-00-ab-cd-0f", "5:54:00:ab:cd:0f", "52:54:00:ab:cd:0g"]
        {
            assert_eq!(parse_mac(bad), Err(AddrError::BadMac), "{bad}");
        }
    }
}
