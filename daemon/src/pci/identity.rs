//! Is the device at a model entry's address the device the entry pins?
//!
//! A hardware model names devices by address, and an address says nothing about what sits
//! there: a card swapped for another model, a NIC moved to another slot, or a firmware update
//! that renumbers the buses puts another device at the configured address, and passthrough would
//! hand it to a sensor VM (and take it from the host) without a word. An entry may therefore pin
//! the device's identity ([`DeviceIdentity`]: PCI ids, subsystem ids, the permanent MAC of its
//! network interface); this module reads what is there and judges it. A mismatch refuses the
//! start before anything is bound (API code 3006).
//!
//! Order of use (by `lifecycle::vfio` before any bind, and by `host.check`):
//!
//! 1. [`read`] (sysfs, blocking): the ids, the subsystem ids, the driver and the device's network
//!    interfaces with the address sysfs shows when it is the permanent one
//!    (`addr_assign_type` 0);
//! 2. the caller asks the net owner for each interface's permanent address (netlink
//!    `IFLA_PERM_ADDRESS`, what `ethtool -P` shows), since this module speaks only sysfs;
//! 3. [`Reading::found`] settles the MAC: netlink's answer, else sysfs's permanent one, else
//!    unknown (no interface: the device is on vfio-pci or has no driver);
//! 4. [`judge`] (pure) compares it with the pin; [`IdentityError`] carries every mismatch of a
//!    request with the model entry and request field it is about.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use super::{dev_attr, is_absent, parse_hex, Pci, PciError};
use crate::api::HardwareClass;
use crate::hardware::{mac_text, DeviceIdentity, PciAddress};

/// A network interface of the device, as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Netdev {
    /// The interface name (`class/net/NAME`).
    pub name: String,
    /// Its address when sysfs says it is the permanent one (`addr_assign_type` 0); `None` when
    /// the address was set by software, generated, or cannot be read.
    pub sysfs_permanent: Option<[u8; 6]>,
}

/// What sysfs says about the device at an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
    /// Subsystem vendor and device ids (`None` when the kernel shows none).
    pub subsystem: Option<(u16, u16)>,
    /// The bound driver, for the message when there is no network interface.
    pub driver: Option<String>,
    /// The device's network interfaces.
    pub netdevs: Vec<Netdev>,
}

/// The MAC part of what was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FoundMac {
    /// Not looked at: the pin has no MAC.
    NotRead,
    /// The permanent address of the device's network interface.
    Address([u8; 6]),
    /// No permanent address could be found; why.
    Unknown(String),
}

/// What sits at the address, as far as the pin asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
    /// Subsystem ids, when the kernel shows them.
    pub subsystem: Option<(u16, u16)>,
    /// The permanent MAC.
    pub mac: FoundMac,
}

impl Found {
    /// `vvvv:dddd`.
    pub fn id_text(&self) -> String {
        format!("{:04x}:{:04x}", self.vendor, self.device)
    }

    /// The subsystem as `vvvv:dddd`.
    pub fn subsystem_text(&self) -> Option<String> {
        self.subsystem.map(|(v, d)| format!("{v:04x}:{d:04x}"))
    }
}

impl Reading {
    /// What was found, with the MAC taken from `permanent` (each interface's permanent address
    /// as netlink reports it), else from sysfs when it is the permanent address there; only when
    /// `want_mac` (the pin has a MAC).
    pub fn found(&self, want_mac: bool, permanent: &BTreeMap<String, [u8; 6]>) -> Found {
        let mac = if !want_mac {
            FoundMac::NotRead
        } else if self.netdevs.is_empty() {
            let why = match self.driver.as_deref() {
                None => "the device has no driver".to_string(),
                Some(super::VFIO_PCI) => "the device is on vfio-pci".to_string(),
                Some(d) => format!("driver {d} made none"),
            };
            FoundMac::Unknown(format!("no network interface: {why}"))
        } else {
            let known = self.netdevs.iter().find_map(|n| permanent.get(&n.name).copied().or(n.sysfs_permanent));
            match known {
                Some(mac) => FoundMac::Address(mac),
                None => {
                    let names: Vec<&str> = self.netdevs.iter().map(|n| n.name.as_str()).collect();
                    FoundMac::Unknown(format!("{} shows no permanent address", names.join(", ")))
                }
            }
        };
        Found { vendor: self.vendor, device: self.device, subsystem: self.subsystem, mac }
    }
}

/// What differs between a pin and the device found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The pin.
    pub expected: DeviceIdentity,
    /// The device.
    pub found: Found,
}

/// The text of the pinned parts of an identity: `8086:1572 (subsystem 8086:0007, MAC ...)`.
fn with_extras(id: String, extras: Vec<String>) -> String {
    if extras.is_empty() {
        id
    } else {
        format!("{id} ({})", extras.join(", "))
    }
}

impl Mismatch {
    /// The device as far as the pin asks: `8086:10d3 (subsystem 8086:0000, MAC unknown: ...)`.
    pub fn found_text(&self) -> String {
        let mut extras = Vec::new();
        if self.expected.subsystem.is_some() {
            extras.push(match self.found.subsystem_text() {
                Some(s) => format!("subsystem {s}"),
                None => "no subsystem".to_string(),
            });
        }
        match &self.found.mac {
            FoundMac::NotRead => {}
            FoundMac::Address(m) => extras.push(format!("MAC {}", mac_text(m))),
            FoundMac::Unknown(why) => extras.push(format!("MAC unknown: {why}")),
        }
        with_extras(self.found.id_text(), extras)
    }

    /// The pin: `8086:1572 (subsystem 8086:0007, MAC 3c:fd:fe:aa:bb:cc)`.
    pub fn expected_text(&self) -> String {
        let e = &self.expected;
        let mut extras = Vec::new();
        if let Some(s) = e.subsystem_text() {
            extras.push(format!("subsystem {s}"));
        }
        if let Some(m) = e.mac_text() {
            extras.push(format!("MAC {m}"));
        }
        with_extras(e.id_text(), extras)
    }
}

/// Compares what was found with the pin: the ids always, the subsystem and the MAC when pinned.
/// A pinned MAC that could not be read is a mismatch: the device cannot be told from another
/// of the same model.
///
/// # Errors
/// [`Mismatch`] with both sides when any pinned part differs.
pub fn judge(expected: &DeviceIdentity, found: &Found) -> Result<(), Mismatch> {
    let ids = (expected.vendor, expected.device) == (found.vendor, found.device);
    let subsystem = expected.subsystem.is_none_or(|s| found.subsystem == Some(s));
    let mac = match expected.mac {
        None => true,
        Some(m) => found.mac == FoundMac::Address(m),
    };
    if ids && subsystem && mac {
        Ok(())
    } else {
        Err(Mismatch { expected: *expected, found: found.clone() })
    }
}

/// A mismatch of one requested device, with the model entry that pins it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedMismatch {
    /// The entry's class.
    pub class: HardwareClass,
    /// The entry's index.
    pub index: u32,
    /// The device's address.
    pub address: PciAddress,
    /// The request field that asked for it (`spec.hardware.sfp[0]`).
    pub field: String,
    /// What differs.
    pub mismatch: Mismatch,
}

impl fmt::Display for PinnedMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "hardware {} {} ({}) is {}, the model pins {}",
            self.class,
            self.index,
            self.address,
            self.mismatch.found_text(),
            self.mismatch.expected_text()
        )
    }
}

/// A request whose devices are not all what the model pins.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// These devices (at least one) differ from their pins; nothing was bound.
    #[error("{}", mismatch_list(.0))]
    Mismatch(Vec<PinnedMismatch>),
}

fn mismatch_list(list: &[PinnedMismatch]) -> String {
    let texts: Vec<String> = list.iter().map(ToString::to_string).collect();
    texts.join("; ")
}

/// A device whose model entry pins an identity, to be judged: requested by a spec (`field` is
/// the request field) or configured (`host.check`: `field` is the config key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedDevice {
    /// The entry's class.
    pub class: HardwareClass,
    /// The entry's index.
    pub index: u32,
    /// The device's address.
    pub address: PciAddress,
    /// The pin.
    pub identity: DeviceIdentity,
    /// The request field (or config key) it is judged for.
    pub field: String,
    /// The VM whose record has the device on vfio-pci now. Its MAC is not compared then: the
    /// device has no network interface while a VM holds it, and it was judged before it was
    /// bound (a device held by another VM is refused next, 3003).
    pub held_by: Option<String>,
}

impl PinnedDevice {
    /// The pin as judged: without the MAC while a VM holds the device.
    pub fn expected(&self) -> DeviceIdentity {
        match self.held_by {
            Some(_) => DeviceIdentity { mac: None, ..self.identity },
            None => self.identity,
        }
    }
}

/// What a pinned device turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judged {
    /// It is what the entry pins.
    Matches,
    /// There is no device at the address (the passthrough check and `hardware_model` report it).
    Absent,
    /// It is not.
    Mismatch(PinnedMismatch),
}

/// Judges `reading` (of `pinned`'s address; `None` when absent) with `permanent` (each network
/// interface's permanent address from netlink).
pub fn judge_pinned(pinned: &PinnedDevice, reading: Option<&Reading>, permanent: &BTreeMap<String, [u8; 6]>) -> Judged {
    let Some(reading) = reading else { return Judged::Absent };
    let expected = pinned.expected();
    let found = reading.found(expected.mac.is_some(), permanent);
    match judge(&expected, &found) {
        Ok(()) => Judged::Matches,
        Err(mismatch) => Judged::Mismatch(PinnedMismatch {
            class: pinned.class,
            index: pinned.index,
            address: pinned.address,
            field: pinned.field.clone(),
            mismatch,
        }),
    }
}

/// `vvvv` ids of an attribute, checked to fit 16 bits.
fn id16(pci: &Pci, address: PciAddress, attr: &str) -> Result<Option<u16>, PciError> {
    let rel = dev_attr(address, attr);
    let text = match pci.io.read(&rel) {
        Ok(t) => t,
        Err(e) if is_absent(&e) => return Ok(None),
        Err(source) => return Err(PciError::Io { path: rel, source }),
    };
    let v = parse_hex(&rel, &text)?;
    u16::try_from(v).map(Some).map_err(|_| PciError::Parse { path: rel, text })
}

/// `aa:bb:cc:dd:ee:ff` as sysfs writes a link's `address`.
fn parse_sysfs_mac(text: &str) -> Option<[u8; 6]> {
    DeviceIdentity::parse_mac(text.trim()).ok()
}

/// The address of interface `name` when sysfs says it is the permanent one.
fn sysfs_permanent(pci: &Pci, name: &str) -> Option<[u8; 6]> {
    let dir = PathBuf::from("class/net").join(name);
    // 0 is NET_ADDR_PERM: the address the device came with. Anything else (random, stolen,
    // set by software) says nothing about which device this is.
    let assign = pci.io.read(&dir.join("addr_assign_type")).ok()?;
    if assign.trim() != "0" {
        return None;
    }
    parse_sysfs_mac(&pci.io.read(&dir.join("address")).ok()?)
}

/// What sysfs says about the device at `address`; `None` when there is no such device (the
/// passthrough check refuses it with its own code).
///
/// # Errors
/// [`PciError`] when an attribute of an existing device cannot be read or is malformed.
pub fn read(pci: &Pci, address: PciAddress) -> Result<Option<Reading>, PciError> {
    let Some(dev) = pci.device(address)? else { return Ok(None) };
    let subsystem = match (id16(pci, address, "subsystem_vendor")?, id16(pci, address, "subsystem_device")?) {
        (Some(v), Some(d)) => Some((v, d)),
        _ => None,
    };
    let netdevs = dev
        .net_ifaces
        .iter()
        .map(|name| Netdev { name: name.clone(), sysfs_permanent: sysfs_permanent(pci, name) })
        .collect();
    Ok(Some(Reading { vendor: dev.vendor, device: dev.device, subsystem, driver: dev.driver, netdevs }))
}

#[cfg(test)]
mod tests {
    use super::super::fake::{addr, FakeDevice, FakeSysfs};
    use super::*;

    const MAC: [u8; 6] = [0x3c, 0xfd, 0xfe, 0xaa, 0xbb, 0xcc];
    const OTHER_MAC: [u8; 6] = [0x3c, 0xfd, 0xfe, 0xaa, 0xbb, 0xcd];

    fn pin(subsystem: Option<(u16, u16)>, mac: Option<[u8; 6]>) -> DeviceIdentity {
        DeviceIdentity { vendor: 0x8086, device: 0x1572, subsystem, mac }
    }

    fn found(vendor: u16, device: u16, subsystem: Option<(u16, u16)>, mac: FoundMac) -> Found {
        Found { vendor, device, subsystem, mac }
    }

    #[test]
    fn judge_compares_what_is_pinned() {
        let sub = Some((0x8086, 0x0007));
        let unknown = FoundMac::Unknown("no network interface: the device is on vfio-pci".into());
        // (pin, found, matches)
        let table = [
            // ids alone
            (pin(None, None), found(0x8086, 0x1572, None, FoundMac::NotRead), true),
            (pin(None, None), found(0x8086, 0x1572, Some((1, 2)), FoundMac::NotRead), true),
            (pin(None, None), found(0x8086, 0x10d3, None, FoundMac::NotRead), false),
            (pin(None, None), found(0x15ad, 0x1572, None, FoundMac::NotRead), false),
            // subsystem
            (pin(sub, None), found(0x8086, 0x1572, sub, FoundMac::NotRead), true),
            (pin(sub, None), found(0x8086, 0x1572, Some((0x8086, 0)), FoundMac::NotRead), false),
            (pin(sub, None), found(0x8086, 0x1572, None, FoundMac::NotRead), false),
            // MAC: equal, other, unknown (no netdev), never read
            (pin(None, Some(MAC)), found(0x8086, 0x1572, None, FoundMac::Address(MAC)), true),
            (pin(None, Some(MAC)), found(0x8086, 0x1572, None, FoundMac::Address(OTHER_MAC)), false),
            (pin(None, Some(MAC)), found(0x8086, 0x1572, None, unknown.clone()), false),
            (pin(None, Some(MAC)), found(0x8086, 0x1572, None, FoundMac::NotRead), false),
            // everything
            (pin(sub, Some(MAC)), found(0x8086, 0x1572, sub, FoundMac::Address(MAC)), true),
            (pin(sub, Some(MAC)), found(0x8086, 0x10d3, sub, FoundMac::Address(MAC)), false),
        ];
        for (i, (p, f, ok)) in table.iter().enumerate() {
            let got = judge(p, f);
            assert_eq!(got.is_ok(), *ok, "row {i}: {p:?} vs {f:?}");
            if let Err(m) = got {
                assert_eq!((&m.expected, &m.found), (p, f), "row {i}");
            }
        }
    }

    #[test]
    fn the_message_names_entry_address_found_and_pin() {
        let m = PinnedMismatch {
            class: HardwareClass::Sfp,
            index: 5,
            address: addr("0000:07:00.0"),
            field: "spec.hardware.sfp[0]".into(),
            mismatch: Mismatch {
                expected: pin(Some((0x8086, 7)), None),
                found: found(0x8086, 0x10d3, Some((0x8086, 0)), FoundMac::NotRead),
            },
        };
        assert_eq!(
            m.to_string(),
            "hardware sfp 5 (0000:07:00.0) is 8086:10d3 (subsystem 8086:0000), the model pins 8086:1572 \
             (subsystem 8086:0007)"
        );
        let mut unknown = m.clone();
        unknown.mismatch = Mismatch {
            expected: pin(None, Some(MAC)),
            found: found(
                0x8086,
                0x1572,
                None,
                FoundMac::Unknown("no network interface: the device is on vfio-pci".into()),
            ),
        };
        assert_eq!(
            unknown.to_string(),
            "hardware sfp 5 (0000:07:00.0) is 8086:1572 (MAC unknown: no network interface: the device is on \
             vfio-pci), the model pins 8086:1572 (MAC 3c:fd:fe:aa:bb:cc)"
        );
        let e = IdentityError::Mismatch(vec![m, unknown]);
        assert_eq!(e.to_string().matches("hardware sfp 5").count(), 2, "{e}");
    }

    /// A NIC at 0000:07:00.0 (8086:1572, subsystem 8086:0007) with interface `fake-eth9`.
    fn nic_tree() -> FakeSysfs {
        let f = FakeSysfs::new();
        f.add_device(FakeDevice::endpoint("0000:07:00.0", 0x8086, 0x1572, 0x020000, 4).driver("i40e"));
        f.add_file("bus/pci/devices/0000:07:00.0/subsystem_vendor", "0x8086\n");
        f.add_file("bus/pci/devices/0000:07:00.0/subsystem_device", "0x0007\n");
        f.add_net_iface("0000:07:00.0", "fake-eth9");
        f.add_file("class/net/fake-eth9/addr_assign_type", "0\n");
        f.add_file("class/net/fake-eth9/address", "3c:fd:fe:aa:bb:cc\n");
        f
    }

    #[test]
    fn reads_ids_subsystem_and_the_permanent_mac_from_sysfs() {
        let f = std::sync::Arc::new(nic_tree());
        let pci = Pci::new(Box::new(f.clone()));
        let r = read(&pci, addr("0000:07:00.0")).unwrap().unwrap();
        assert_eq!(
            r,
            Reading {
                vendor: 0x8086,
                device: 0x1572,
                subsystem: Some((0x8086, 7)),
                driver: Some("i40e".into()),
                netdevs: vec![Netdev { name: "fake-eth9".into(), sysfs_permanent: Some(MAC) }],
            }
        );
        let none = BTreeMap::new();
        assert_eq!(r.found(true, &none).mac, FoundMac::Address(MAC));
        assert_eq!(r.found(false, &none).mac, FoundMac::NotRead);
        assert!(judge(&pin(Some((0x8086, 7)), Some(MAC)), &r.found(true, &none)).is_ok());
        // Netlink's permanent address wins over sysfs's.
        let netlink = BTreeMap::from([("fake-eth9".to_string(), OTHER_MAC)]);
        assert_eq!(r.found(true, &netlink).mac, FoundMac::Address(OTHER_MAC));

        // An address set by software is not the device's: unknown, refused.
        f.add_file("class/net/fake-eth9/addr_assign_type", "3\n");
        let r = read(&pci, addr("0000:07:00.0")).unwrap().unwrap();
        assert_eq!(r.netdevs[0].sysfs_permanent, None);
        let FoundMac::Unknown(why) = r.found(true, &none).mac else { panic!("known") };
        assert!(why.contains("fake-eth9 shows no permanent address"), "{why}");
        assert!(judge(&pin(None, Some(MAC)), &r.found(true, &none)).is_err());

        // No such device: nothing to judge (the passthrough check refuses it).
        assert_eq!(read(&pci, addr("0000:08:00.0")).unwrap(), None);
    }

    #[test]
    fn a_device_without_a_netdev_has_an_unknown_mac() {
        let f = FakeSysfs::new();
        f.add_device(FakeDevice::endpoint("0000:07:00.0", 0x8086, 0x1572, 0x020000, 4).driver("vfio-pci"));
        f.add_device(FakeDevice::endpoint("0000:08:00.0", 0x8086, 0x1572, 0x020000, 5));
        let pci = Pci::new(Box::new(f));
        let none = BTreeMap::new();
        for (a, why) in [("0000:07:00.0", "the device is on vfio-pci"), ("0000:08:00.0", "the device has no driver")] {
            let r = read(&pci, addr(a)).unwrap().unwrap();
            // No subsystem attributes in this tree: none pinned can match.
            assert_eq!(r.subsystem, None);
            assert_eq!(r.found(true, &none).mac, FoundMac::Unknown(format!("no network interface: {why}")), "{a}");
            assert!(judge(&pin(None, Some(MAC)), &r.found(true, &none)).is_err());
            assert!(judge(&pin(None, None), &r.found(false, &none)).is_ok());
        }
    }

    #[test]
    fn a_device_a_vm_holds_is_judged_without_its_mac() {
        let f = FakeSysfs::new();
        f.add_device(FakeDevice::endpoint("0000:07:00.0", 0x8086, 0x1572, 0x020000, 4).driver("vfio-pci"));
        let pci = Pci::new(Box::new(f));
        let r = read(&pci, addr("0000:07:00.0")).unwrap();
        let mut p = PinnedDevice {
            class: HardwareClass::Sfp,
            index: 5,
            address: addr("0000:07:00.0"),
            identity: pin(None, Some(MAC)),
            field: "spec.hardware.sfp[0]".into(),
            held_by: None,
        };
        let none = BTreeMap::new();
        let Judged::Mismatch(m) = judge_pinned(&p, r.as_ref(), &none) else { panic!("matched") };
        assert_eq!(m.field, "spec.hardware.sfp[0]");
        assert!(m.to_string().contains("MAC unknown: no network interface: the device is on vfio-pci"), "{m}");
        p.held_by = Some("sensor1".into());
        assert_eq!(judge_pinned(&p, r.as_ref(), &none), Judged::Matches);
        // The ids are still compared.
        p.identity.device = 0x10d3;
        assert!(matches!(judge_pinned(&p, r.as_ref(), &none), Judged::Mismatch(_)));
        assert_eq!(judge_pinned(&p, None, &none), Judged::Absent);
    }

    #[test]
    fn malformed_subsystem_ids_are_parse_errors() {
        let f = nic_tree();
        f.add_file("bus/pci/devices/0000:07:00.0/subsystem_device", "0x10007\n");
        let pci = Pci::new(Box::new(f));
        assert!(matches!(read(&pci, addr("0000:07:00.0")), Err(PciError::Parse { .. })));
    }

    #[test]
    fn reads_a_real_directory_tree() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let d = root.join("bus/pci/devices/0000:00:05.0");
        std::fs::create_dir_all(d.join("net/ens5")).unwrap();
        for (attr, text) in [
            ("vendor", "0x15ad\n"),
            ("device", "0x07b0\n"),
            ("class", "0x020000\n"),
            ("subsystem_vendor", "0x15ad\n"),
            ("subsystem_device", "0x07b0\n"),
        ] {
            std::fs::write(d.join(attr), text).unwrap();
        }
        std::fs::create_dir_all(root.join("class/net")).unwrap();
        std::os::unix::fs::symlink(d.join("net/ens5"), root.join("class/net/ens5")).unwrap();
        std::fs::write(d.join("net/ens5/addr_assign_type"), "0\n").unwrap();
        std::fs::write(d.join("net/ens5/address"), "52:54:00:12:34:56\n").unwrap();
        let pci = Pci::with_root(root);
        let r = read(&pci, addr("0000:00:05.0")).unwrap().unwrap();
        assert_eq!((r.vendor, r.device, r.subsystem), (0x15ad, 0x07b0, Some((0x15ad, 0x07b0))));
        assert_eq!(
            r.netdevs,
            vec![Netdev { name: "ens5".into(), sysfs_permanent: Some([0x52, 0x54, 0, 0x12, 0x34, 0x56]) }]
        );
    }
}
