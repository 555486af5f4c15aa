//! Which PCI devices carry a host interface's frames: what a monitor NIC's source stops
//! seeing when a VM takes that device by passthrough.
//!
//! The admission check (3003 between passthrough and monitoring, `capacity::check_capture_devices`)
//! is pure and takes a map source -> PCI addresses; [`pci_devices`] reads that map's entries from
//! sysfs before it runs. An interface's own device is `/sys/class/net/NAME/device` (the nearest
//! PCI function on the path it resolves to: a virtio or USB NIC sits below one); a VLAN, bond,
//! team or bridge has no device of its own, and its `lower_*` links name the interfaces it rides
//! on, followed recursively. A veth, a dummy or a tap has neither: no device, nothing to refuse.
//!
//! The read is best effort on purpose: sysfs entries vanish while links change, and an entry
//! that cannot be read names no device; the check is a guard against a mistake, the kernel
//! itself keeps the passthrough device and the capture apart by the time it happens.

use crate::hardware::PciAddress;
use std::collections::BTreeSet;
use std::path::Path;

/// Where the kernel lists network interfaces.
pub const SYS_CLASS_NET: &str = "/sys/class/net";

/// Deepest chain of `lower_*` links followed (a VLAN on a bond on a bridge is 3).
const MAX_DEPTH: usize = 8;

/// The PCI devices interface `name` depends on, read under [`SYS_CLASS_NET`].
pub fn pci_devices(name: &str) -> BTreeSet<PciAddress> {
    pci_devices_in(Path::new(SYS_CLASS_NET), name)
}

/// [`pci_devices`] under another root (tests use a directory that looks like sysfs).
pub fn pci_devices_in(root: &Path, name: &str) -> BTreeSet<PciAddress> {
    let mut out = BTreeSet::new();
    let mut seen = BTreeSet::new();
    walk(root, name, 0, &mut seen, &mut out);
    out
}

fn walk(root: &Path, name: &str, depth: usize, seen: &mut BTreeSet<String>, out: &mut BTreeSet<PciAddress>) {
    // Names come from the spec (validated) and from sysfs entries: never a path.
    if depth > MAX_DEPTH || name.contains('/') || name.starts_with('.') || !seen.insert(name.to_string()) {
        return;
    }
    let dir = root.join(name);
    if let Ok(target) = std::fs::canonicalize(dir.join("device")) {
        // The nearest PCI function on the device's path: the NIC itself, or the controller a
        // virtio or USB NIC sits on.
        if let Some(addr) = target.ancestors().filter_map(|p| p.file_name()?.to_str()).find_map(parse_function) {
            out.insert(addr);
        }
    }
    let Ok(entries) = std::fs::read_dir(&dir) else { return };
    for entry in entries.flatten() {
        let file = entry.file_name();
        if let Some(lower) = file.to_str().and_then(|f| f.strip_prefix("lower_")) {
            walk(root, lower, depth + 1, seen, out);
        }
    }
}

/// A sysfs PCI function directory name (`0000:c7:00.0`), not a bus (`pci0000:00`) or any other
/// component.
fn parse_function(component: &str) -> Option<PciAddress> {
    let b = component.as_bytes();
    let shaped = b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.';
    if !shaped {
        return None;
    }
    PciAddress::parse(component).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A fake sysfs: `devices/` with two PCI NICs (one a virtio device below its function),
    /// `class/net/` with the interfaces and their `lower_*` links.
    fn tree() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        let d1 = r.join("devices/pci0000:00/0000:00:1c.0/0000:c7:00.0");
        let d2 = r.join("devices/pci0000:00/0000:00:03.0/virtio0");
        std::fs::create_dir_all(&d1).unwrap();
        std::fs::create_dir_all(&d2).unwrap();
        let net = r.join("class/net");
        for n in ["eth0", "eth1", "bond0", "bond0.100", "br0", "veth0"] {
            std::fs::create_dir_all(net.join(n)).unwrap();
        }
        symlink(&d1, net.join("eth0/device")).unwrap();
        symlink(&d2, net.join("eth1/device")).unwrap();
        symlink(net.join("eth0"), net.join("bond0/lower_eth0")).unwrap();
        symlink(net.join("eth1"), net.join("bond0/lower_eth1")).unwrap();
        symlink(net.join("bond0"), net.join("bond0.100/lower_bond0")).unwrap();
        // A loop (never in a real sysfs) ends.
        symlink(net.join("br0"), net.join("br0/lower_br0")).unwrap();
        t
    }

    fn addrs(root: &Path, name: &str) -> Vec<String> {
        pci_devices_in(&root.join("class/net"), name).iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_nic_is_its_function_and_a_virtio_nic_its_parent() {
        let t = tree();
        assert_eq!(addrs(t.path(), "eth0"), ["0000:c7:00.0"]);
        assert_eq!(addrs(t.path(), "eth1"), ["0000:00:03.0"]);
    }

    #[test]
    fn vlans_and_bonds_follow_their_lower_links() {
        let t = tree();
        assert_eq!(addrs(t.path(), "bond0"), ["0000:00:03.0", "0000:c7:00.0"]);
        assert_eq!(addrs(t.path(), "bond0.100"), ["0000:00:03.0", "0000:c7:00.0"]);
    }

    #[test]
    fn virtual_absent_and_odd_names_have_none() {
        let t = tree();
        for n in ["veth0", "br0", "nothere", "../devices", ".."] {
            assert!(addrs(t.path(), n).is_empty(), "{n}");
        }
    }

    #[test]
    fn only_function_names_parse() {
        assert!(parse_function("0000:c7:00.0").is_some());
        for c in ["pci0000:00", "virtio0", "c7:00.0", "0000:c7:00.0x", "usb1", "1-1:1.0"] {
            assert!(parse_function(c).is_none(), "{c}");
        }
    }
}
