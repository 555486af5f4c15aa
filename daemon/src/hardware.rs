//! The host hardware model: which PCI device each `(class, index)` of a spec refers to.
//!
//! Operators (and Security Onion's model files) name passthrough devices by class and index; the
//! daemon resolves them here. Built once from the config by [`HardwareModel::from_config`], then
//! only read. PCI addresses are normalised to `DDDD:BB:SS.F`. An entry may also pin what device
//! must sit at its address ([`DeviceIdentity`]: ids, subsystem, MAC), so a swapped card or a
//! renumbered bus is refused (`pci::identity`) instead of handing the wrong device to a sensor.

use crate::api::HardwareClass;
use std::collections::BTreeMap;
use std::fmt;

/// A PCI address `domain:bus:slot.function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    /// PCI domain (segment).
    pub domain: u16,
    /// Bus number.
    pub bus: u8,
    /// Device (slot) number, 0..=31.
    pub slot: u8,
    /// Function number, 0..=7.
    pub function: u8,
}

impl PciAddress {
    /// Parses `0000:c7:00.0`, `c7:00.0` (domain 0) or Security Onion's `pci_0000_c7_00_0`.
    ///
    /// # Errors
    /// A message saying what is wrong with the text.
    pub fn parse(text: &str) -> Result<PciAddress, String> {
        let t = text.trim();
        let canonical = if let Some(rest) = t.strip_prefix("pci_") {
            // pci_DDDD_BB_SS_F
            let parts: Vec<&str> = rest.split('_').collect();
            if parts.len() != 4 {
                return Err(format!("{text:?} is not of the form pci_DDDD_BB_SS_F"));
            }
            format!("{}:{}:{}.{}", parts[0], parts[1], parts[2], parts[3])
        } else if t.matches(':').count() == 1 {
            format!("0000:{t}")
        } else {
            t.to_string()
        };
        let bad = || format!("{text:?} is not a PCI address (expected DDDD:BB:SS.F)");
        let (dom, rest) = canonical.split_once(':').ok_or_else(bad)?;
        let (bus, rest) = rest.split_once(':').ok_or_else(bad)?;
        let (slot, func) = rest.split_once('.').ok_or_else(bad)?;
        let hex = |s: &str, width: usize| -> Result<u32, String> {
            if s.is_empty() || s.len() > width || !s.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            u32::from_str_radix(s, 16).map_err(|_| bad())
        };
        let domain = hex(dom, 4)?;
        let bus = hex(bus, 2)?;
        let slot = hex(slot, 2)?;
        let function = hex(func, 1)?;
        if slot > 0x1f || function > 7 {
            return Err(format!("{text:?}: slot must be 00-1f and function 0-7"));
        }
        // The hex() widths above bound every value to its field's size.
        Ok(PciAddress { domain: domain as u16, bus: bus as u8, slot: slot as u8, function: function as u8 })
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.slot, self.function)
    }
}

/// What a model entry pins about the device at its address: its PCI ids, optionally its
/// subsystem ids and the permanent MAC address of its network interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceIdentity {
    /// PCI vendor id (`/sys/bus/pci/devices/ADDR/vendor`).
    pub vendor: u16,
    /// PCI device id.
    pub device: u16,
    /// Subsystem vendor and device ids, when pinned.
    pub subsystem: Option<(u16, u16)>,
    /// The permanent MAC address of the device's network interface, when pinned.
    pub mac: Option<[u8; 6]>,
}

impl DeviceIdentity {
    /// Parses `vvvv:dddd` (hex, any case, exactly four digits each) into two ids.
    ///
    /// # Errors
    /// A message saying what is wrong with the text.
    pub fn parse_ids(text: &str) -> Result<(u16, u16), String> {
        let bad = || format!("{text:?} is not a PCI id pair (expected vvvv:dddd, hex)");
        let (a, b) = text.split_once(':').ok_or_else(bad)?;
        let hex = |s: &str| {
            if s.len() == 4 && s.chars().all(|c| c.is_ascii_hexdigit()) {
                u16::from_str_radix(s, 16).map_err(|_| bad())
            } else {
                Err(bad())
            }
        };
        Ok((hex(a)?, hex(b)?))
    }

    /// Parses a MAC address `aa:bb:cc:dd:ee:ff` (hex, any case, also `-` separated).
    ///
    /// # Errors
    /// A message saying what is wrong with the text.
    pub fn parse_mac(text: &str) -> Result<[u8; 6], String> {
        let bad = || format!("{text:?} is not a MAC address (expected aa:bb:cc:dd:ee:ff)");
        let sep = if text.contains('-') { '-' } else { ':' };
        let parts: Vec<&str> = text.split(sep).collect();
        if parts.len() != 6 {
            return Err(bad());
        }
        let mut mac = [0u8; 6];
        for (byte, part) in mac.iter_mut().zip(parts) {
            if part.len() != 2 || !part.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            *byte = u8::from_str_radix(part, 16).map_err(|_| bad())?;
        }
        Ok(mac)
    }

    /// `vvvv:dddd`, lower-case hex (as `lspci -nn` shows it).
    pub fn id_text(&self) -> String {
        format!("{:04x}:{:04x}", self.vendor, self.device)
    }

    /// The subsystem as `vvvv:dddd`, when pinned.
    pub fn subsystem_text(&self) -> Option<String> {
        self.subsystem.map(|(v, d)| format!("{v:04x}:{d:04x}"))
    }

    /// The MAC as `aa:bb:cc:dd:ee:ff`, when pinned.
    pub fn mac_text(&self) -> Option<String> {
        self.mac.map(|m| mac_text(&m))
    }
}

/// `aa:bb:cc:dd:ee:ff`, lower case.
pub fn mac_text(mac: &[u8; 6]) -> String {
    let parts: Vec<String> = mac.iter().map(|b| format!("{b:02x}")).collect();
    parts.join(":")
}

/// One model entry: where the device is and, optionally, what it must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    address: PciAddress,
    identity: Option<DeviceIdentity>,
}

/// Every passthrough device the host offers, by class and index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HardwareModel {
    devices: BTreeMap<(HardwareClass, u32), Entry>,
}

impl HardwareModel {
    /// Builds a model from `(class, index, address)` triples already checked by the config.
    pub fn new(items: impl IntoIterator<Item = (HardwareClass, u32, PciAddress)>) -> Self {
        HardwareModel::with_identities(items.into_iter().map(|(c, i, a)| (c, i, a, None)))
    }

    /// Builds a model whose entries may pin a [`DeviceIdentity`], from items already checked by
    /// the config.
    pub fn with_identities(
        items: impl IntoIterator<Item = (HardwareClass, u32, PciAddress, Option<DeviceIdentity>)>,
    ) -> Self {
        HardwareModel {
            devices: items.into_iter().map(|(c, i, address, identity)| ((c, i), Entry { address, identity })).collect(),
        }
    }

    /// The device at `(class, index)`, if the model has it.
    pub fn get(&self, class: HardwareClass, index: u32) -> Option<PciAddress> {
        self.devices.get(&(class, index)).map(|e| e.address)
    }

    /// What the entry `(class, index)` pins about its device, if the model has the entry and it
    /// pins anything.
    pub fn identity(&self, class: HardwareClass, index: u32) -> Option<DeviceIdentity> {
        self.devices.get(&(class, index)).and_then(|e| e.identity)
    }

    /// All devices in (class, index) order.
    pub fn iter(&self) -> impl Iterator<Item = (HardwareClass, u32, PciAddress)> + '_ {
        self.devices.iter().map(|(&(c, i), e)| (c, i, e.address))
    }

    /// The entries that pin an identity, in (class, index) order.
    pub fn pinned(&self) -> impl Iterator<Item = (HardwareClass, u32, PciAddress, DeviceIdentity)> + '_ {
        self.devices.iter().filter_map(|(&(c, i), e)| e.identity.map(|id| (c, i, e.address, id)))
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// True when the model has no devices.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_all_forms_to_one_address() {
        let want = PciAddress { domain: 0, bus: 0xc7, slot: 0, function: 0 };
        for t in ["0000:c7:00.0", "c7:00.0", "pci_0000_c7_00_0", " 0000:C7:00.0 "] {
            assert_eq!(PciAddress::parse(t), Ok(want), "{t}");
        }
        assert_eq!(want.to_string(), "0000:c7:00.0");
        let a = PciAddress::parse("0001:0a:1f.7").unwrap();
        assert_eq!(a.to_string(), "0001:0a:1f.7");
    }

    #[test]
    fn rejects_malformed_addresses() {
        for t in [
            "",
            "c7",
            "0000:c7:00",
            "0000:c7:20.0",
            "0000:c7:00.8",
            "00000:c7:00.0",
            "0000:c7x:00.0",
            "pci_0000_c7_00",
            "0000:c7:00.0.1",
            "zz:00.0",
            "0000:c7:00.-1",
        ] {
            assert!(PciAddress::parse(t).is_err(), "{t:?} accepted");
        }
    }

    #[test]
    fn ids_and_macs_parse_in_any_case() {
        assert_eq!(DeviceIdentity::parse_ids("8086:1572"), Ok((0x8086, 0x1572)));
        assert_eq!(DeviceIdentity::parse_ids("15AD:07b0"), Ok((0x15ad, 0x07b0)));
        for bad in ["", "8086", "8086:", "8086:157", "8086:15722", "0x8086:1572", "80g6:1572", "8086:1572:1"] {
            assert!(DeviceIdentity::parse_ids(bad).is_err(), "{bad:?} accepted");
        }
        let mac = [0x3c, 0xfd, 0xfe, 0xaa, 0xbb, 0xcc];
        for t in ["3c:fd:fe:aa:bb:cc", "3C:FD:FE:AA:BB:CC", "3c-fd-fe-aa-bb-cc"] {
            assert_eq!(DeviceIdentity::parse_mac(t), Ok(mac), "{t}");
        }
        for bad in
            ["", "3c:fd:fe:aa:bb", "3c:fd:fe:aa:bb:cc:dd", "3c:fd:fe:aa:bb:c", "3c:fd:fe:aa:bb:zz", "3cfd.feaa.bbcc"]
        {
            assert!(DeviceIdentity::parse_mac(bad).is_err(), "{bad:?} accepted");
        }
        let id = DeviceIdentity { vendor: 0x8086, device: 0x1572, subsystem: Some((0x8086, 7)), mac: Some(mac) };
        assert_eq!(id.id_text(), "8086:1572");
        assert_eq!(id.subsystem_text().as_deref(), Some("8086:0007"));
        assert_eq!(id.mac_text().as_deref(), Some("3c:fd:fe:aa:bb:cc"));
    }

    #[test]
    fn the_model_keeps_identities_per_entry() {
        let a = PciAddress::parse("0000:07:00.0").unwrap();
        let b = PciAddress::parse("0000:08:00.0").unwrap();
        let id = DeviceIdentity { vendor: 0x8086, device: 0x1572, subsystem: None, mac: None };
        let m =
            HardwareModel::with_identities([(HardwareClass::Sfp, 5, a, Some(id)), (HardwareClass::Sfp, 6, b, None)]);
        assert_eq!(m.identity(HardwareClass::Sfp, 5), Some(id));
        assert_eq!(m.identity(HardwareClass::Sfp, 6), None);
        assert_eq!(m.identity(HardwareClass::Sfp, 7), None);
        assert_eq!(m.get(HardwareClass::Sfp, 6), Some(b));
        assert_eq!(m.pinned().collect::<Vec<_>>(), vec![(HardwareClass::Sfp, 5, a, id)]);
        // The old constructor pins nothing.
        let plain = HardwareModel::new([(HardwareClass::Sfp, 5, a)]);
        assert_eq!((plain.identity(HardwareClass::Sfp, 5), plain.pinned().count()), (None, 0));
    }
}
