//! The host hardware model: which PCI device each `(class, index)` of a spec refers to.
//!
//! Operators (and Security Onion's model files) name passthrough devices by class and index; the
//! daemon resolves them here. Built once from the config by [`HardwareModel::from_config`], then
//! only read. PCI addresses are normalised to `DDDD:BB:SS.F`.

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

/// Every passthrough device the host offers, by class and index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HardwareModel {
    devices: BTreeMap<(HardwareClass, u32), PciAddress>,
}

impl HardwareModel {
    /// Builds a model from `(class, index, address)` triples already checked by the config.
    pub fn new(items: impl IntoIterator<Item = (HardwareClass, u32, PciAddress)>) -> Self {
        HardwareModel { devices: items.into_iter().map(|(c, i, a)| ((c, i), a)).collect() }
    }

    /// The device at `(class, index)`, if the model has it.
    pub fn get(&self, class: HardwareClass, index: u32) -> Option<PciAddress> {
        self.devices.get(&(class, index)).copied()
    }

    /// All devices in (class, index) order.
    pub fn iter(&self) -> impl Iterator<Item = (HardwareClass, u32, PciAddress)> + '_ {
        self.devices.iter().map(|(&(c, i), &a)| (c, i, a))
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
}
