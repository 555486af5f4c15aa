//! What the host itself is using: the facts a passthrough request is checked against.
//!
//! A NIC with an address, a default route or a bridge/bond membership, and a disk with a mounted
//! filesystem, belong to the host: handing them to a VM would cut the host off its network or
//! pull a filesystem from under it. [`gather`] reads links, addresses and routes over netlink
//! and mounts from `/proc/self/mountinfo`; [`mounted_block_devices`] is the pure part.

use crate::net::link::Netlink;
use crate::net::NetError;
use std::collections::BTreeSet;
use std::path::Path;

pub use crate::pci::check::HostUsage;

/// The `major:minor` of every mounted block device in a mountinfo text (field 3).
pub fn mounted_dev_numbers(mountinfo: &str) -> BTreeSet<String> {
    mountinfo
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|mm| {
            mm.split_once(':').is_some_and(|(a, b)| a != "0" && a.parse::<u32>().is_ok() && b.parse::<u32>().is_ok())
        })
        .map(str::to_string)
        .collect()
}

/// Names of the mounted block devices: `major:minor` resolved through `SYS/dev/block/MAJ:MIN`
/// (a link whose last component is the device name).
pub fn mounted_block_devices(mountinfo: &str, sys_root: &Path) -> BTreeSet<String> {
    mounted_dev_numbers(mountinfo)
        .into_iter()
        .filter_map(|mm| std::fs::read_link(sys_root.join("dev/block").join(&mm)).ok())
        .filter_map(|target| target.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect()
}

/// Reads the host's usage from the kernel.
///
/// # Errors
/// A netlink dump fails. An unreadable mountinfo counts as no mounts only when the file is
/// missing; other read errors are returned as I/O errors.
pub async fn gather(nl: &Netlink) -> Result<HostUsage, NetError> {
    let links = nl.links().await?;
    let routes = nl.default_route_links().await?;
    let mut usage = HostUsage::default();
    for l in &links {
        if l.master.is_some() {
            usage.enslaved_ifaces.insert(l.name.clone());
        }
        if routes.contains(&l.index) {
            usage.default_route_ifaces.insert(l.name.clone());
        }
        // An IPv6 link-local address comes with every link that is up; it is not a sign of use.
        let addrs = nl.addresses(l.index).await?;
        let used = addrs.iter().any(|(a, _)| match a {
            std::net::IpAddr::V4(_) => true,
            std::net::IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
        });
        if used {
            usage.ifaces_with_address.insert(l.name.clone());
        }
    }
    let mountinfo = match std::fs::read_to_string("/proc/self/mountinfo") {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(NetError::Io { op: "read /proc/self/mountinfo", source: e }),
    };
    usage.mounted_block_devs = mounted_block_devices(&mountinfo, Path::new("/sys"));
    Ok(usage)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
23 22 0:21 / /proc rw,nosuid shared:12 - proc proc rw
24 22 259:1 / /boot/efi rw,relatime shared:2 - vfat /dev/nvme0n1p1 rw
25 22 8:16 / /data rw - xfs /dev/sdb rw
26 22 0:5 / /dev rw - devtmpfs udev rw
";

    #[test]
    fn only_real_block_devices_count() {
        let got: Vec<String> = mounted_dev_numbers(MOUNTINFO).into_iter().collect();
        assert_eq!(got, vec!["259:1", "259:2", "8:16"]);
    }

    #[test]
    fn numbers_resolve_to_names_through_sys() {
        let d = tempfile::tempdir().unwrap();
        let blk = d.path().join("dev/block");
        std::fs::create_dir_all(&blk).unwrap();
        let dev = "../../devices/pci0000:00/0000:00:05.0/nvme/nvme0/nvme0n1";
        std::os::unix::fs::symlink(format!("{dev}/nvme0n1p1"), blk.join("259:1")).unwrap();
        std::os::unix::fs::symlink(format!("{dev}/nvme0n1p2"), blk.join("259:2")).unwrap();
        let got: Vec<String> = mounted_block_devices(MOUNTINFO, d.path()).into_iter().collect();
        assert_eq!(got, vec!["nvme0n1p1", "nvme0n1p2"], "8:16 has no entry and is skipped");
    }

    #[test]
    fn gathers_links_addresses_and_routes_in_a_netns() {
        crate::net::testing::in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let ip = |args: &[&str]| assert!(std::process::Command::new("ip").args(args).status().unwrap().success());
            ip(&["link", "add", "eth9", "type", "veth", "peer", "name", "eth8"]);
            ip(&["link", "add", "br9", "type", "bridge"]);
            ip(&["link", "set", "eth8", "master", "br9"]);
            for l in ["eth9", "eth8", "br9"] {
                ip(&["link", "set", l, "up"]);
            }
            ip(&["addr", "add", "192.0.2.2/24", "dev", "eth9"]);
            ip(&["route", "add", "default", "via", "192.0.2.1", "dev", "eth9"]);
            let u = gather(&nl).await.unwrap();
            assert!(u.ifaces_with_address.contains("eth9"));
            assert!(!u.ifaces_with_address.contains("eth8"));
            assert_eq!(u.default_route_ifaces.iter().collect::<Vec<_>>(), vec!["eth9"]);
            assert_eq!(u.enslaved_ifaces.iter().collect::<Vec<_>>(), vec!["eth8"]);
        });
    }
}
