//! Adding and removing a data disk in a running QEMU, over QMP, on descriptors.
//!
//! QEMU runs as `qemu.user` and opens nothing by path, so a hot-plugged disk reaches it like the
//! disks on its command line: as descriptors the daemon opened, handed over the control monitor
//! (`add-fd` with `SCM_RIGHTS`) into a new fd set. Steps, in this order:
//!
//! 1. [`attach`]: the read-write and read-only descriptors into one fd set (opaque
//!    [`fdset_opaque`]), `blockdev-add` of node `data-NAME` on `/dev/fdset/N` ([`blockdev_args`]),
//!    then `device_add` of a `virtio-blk-pci` with id `data-NAME` and the disk's serial on a free
//!    root port ([`free_port`]; QEMU starts with one per data disk, which can thus be unplugged,
//!    and `qemu.hotplug_ports` spare ones, [`root_port_args`]). A step that fails undoes the
//!    ones before it.
//! 2. [`detach`]: `device_del`, then the guest must release the device (QEMU reports
//!    `DEVICE_DELETED`); only then are the node and the fd set removed. A guest that does not
//!    release it in time keeps it, and nothing else is removed.
//! 3. After a daemon restart, [`attached`] says which data disks QEMU really has, and
//!    [`clear_half_attached`] removes nodes and fd sets no device uses (a crash between steps).
//!
//! Names are fixed by the daemon: a disk's name is 1-20 of `[a-z0-9-]` (validate.rs), so
//! `data-NAME` is a valid QEMU id and node name.

use crate::api::DataDiskSpec;
use crate::qemu::qmp::{Qmp, QmpError};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::os::fd::AsFd;
use std::time::Duration;

/// QEMU's drive and device id of data disk `name` (`data-NAME`): on the command line
/// ([`super::argv`]) and when hot-plugged alike.
pub fn data_drive(name: &str) -> String {
    format!("data-{name}")
}

/// The PCI slot of the first root port: they fill slots from here up, eight functions each,
/// far above the slots QEMU gives the other devices in command-line order from slot 1.
const FIRST_PORT_SLOT: usize = 0x1b;

/// QEMU id of root port `i`: a data disk's bus on a PCIe machine.
pub fn port_id(i: usize) -> String {
    format!("hp{i}")
}

/// Whether QEMU machine type `machine` is PCI Express (q35): a device that can be unplugged
/// must then sit behind a root port (the root complex cannot unplug); on `pc` every device is
/// on the root bus, which hot-plugs through ACPI.
pub fn is_pcie(machine: &str) -> bool {
    machine.starts_with("q35") || machine.contains("-q35")
}

/// The `-device` values of the root ports of a VM with `disks` data disks: one per data disk
/// (port `i` for disk `i`) and `spare` more (`qemu.hotplug_ports`; none for a machine without
/// PCIe). They sit at fixed addresses, eight to a slot (multifunction, as libvirt packs them),
/// so they take no slot another device had and 16 disks and 8 spares need three slots.
pub fn root_port_args(machine: &str, disks: usize, spare: usize) -> Vec<String> {
    if !is_pcie(machine) {
        return Vec::new();
    }
    (0..disks + spare)
        .map(|i| {
            let (slot, function) = (FIRST_PORT_SLOT + i / 8, i % 8);
            let multifunction = if function == 0 { ",multifunction=on" } else { "" };
            // Each port needs its own chassis number (QEMU refuses two ports on one chassis and slot).
            format!(
                "pcie-root-port,id={},bus=pcie.0,chassis={},addr={slot:#x}.{function:#x}{multifunction}",
                port_id(i),
                i + 1
            )
        })
        .collect()
}

/// QEMU id of the root port the cloud-init seed sits behind on a PCIe machine.
pub const SEED_PORT: &str = "seedport";

/// The `-device` value of the seed's own root port on a PCIe machine (none on `pc`), at slot
/// 0x1e, after every data disk port: Linux binds the drivers of the root bus's devices first
/// (the boot disk: vda) and then those behind each bridge in slot order, so the data disks are
/// the next disks and the seed the last one. On the root bus itself the seed would come before
/// every data disk. Its id does not start with `hp`: it never takes a hot-plugged disk.
pub fn seed_port_arg(machine: &str) -> Option<String> {
    is_pcie(machine).then(|| format!("pcie-root-port,id={SEED_PORT},bus=pcie.0,chassis=64,addr=0x1e.0x0"))
}

/// The description of a hot-plugged disk's descriptors in QEMU's fd set table.
pub fn fdset_opaque(disk: &str) -> String {
    format!("hotplug:{}", data_drive(disk))
}

/// The block node of data disk `disk` on fd set `fdset`, as `blockdev-add` (hot-plug) and
/// `-blockdev` (argv.rs, at start) take it: format, cache, aio, discard, no image locking, and
/// for a qcow2 `backing: null`: QEMU opens no backing file whatever the image's header names
/// (a data disk never has one; a header that names `/etc/...` must not make QEMU open it).
pub fn blockdev_args(disk: &DataDiskSpec, fdset: u64) -> Value {
    let direct = disk.cache == crate::api::DiskCache::None;
    let cache = json!({ "direct": direct, "no-flush": false });
    let mut node = json!({
        "driver": disk.format.as_str(),
        "node-name": data_drive(&disk.name),
        "discard": "unmap",
        "cache": cache,
        "file": {
            "driver": "file",
            "filename": format!("/dev/fdset/{fdset}"),
            "aio": disk.effective_aio().as_str(),
            "locking": "off",
            "discard": "unmap",
            "cache": cache,
        },
    });
    if disk.format == crate::api::DiskFormat::Qcow2 {
        node["backing"] = Value::Null;
    }
    node
}

/// `device_add` arguments for `disk` on bus `bus` (a root port), or QEMU's choice.
pub fn device_args(disk: &DataDiskSpec, bus: Option<&str>) -> Value {
    let id = data_drive(&disk.name);
    let mut args = json!({ "driver": "virtio-blk-pci", "id": id, "drive": id, "serial": disk.name });
    if let Some(bus) = bus {
        args["bus"] = json!(bus);
    }
    args
}

/// The root ports (`hpN`) in `query-pci`'s answer, each with the `qdev_id`s of the devices
/// behind it.
fn root_ports(query_pci: &Value) -> Vec<(&str, Vec<&str>)> {
    query_pci
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|bus| bus.get("devices").and_then(Value::as_array).into_iter().flatten())
        .filter_map(|dev| {
            let id = dev.get("qdev_id").and_then(Value::as_str).filter(|id| id.starts_with("hp"))?;
            let behind = dev.pointer("/pci_bridge/devices").and_then(Value::as_array).into_iter().flatten();
            Some((id, behind.filter_map(|d| d.get("qdev_id").and_then(Value::as_str)).collect()))
        })
        .collect()
}

/// The highest-numbered root port without a device, from `query-pci`'s answer: the spare ones
/// first, and a port a disk was just unplugged from last (a Linux guest was seen to hang when
/// a new device came into the slot it was still tearing down).
pub fn free_port(query_pci: &Value) -> Option<String> {
    root_ports(query_pci)
        .into_iter()
        .filter(|(_, behind)| behind.is_empty())
        .max_by_key(|(id, _)| id[2..].parse::<usize>().unwrap_or(0))
        .map(|(id, _)| id.to_string())
}

/// Why a disk could not be attached or detached.
#[derive(Debug, thiserror::Error)]
pub enum HotplugError {
    /// Every spare root port holds a device (or the VM was started without them).
    #[error(
        "no free hot-plug slot (a VM starts with qemu.hotplug_ports of them; a restart attaches the disk instead)"
    )]
    NoFreeSlot,
    /// The guest did not release the device in time; it stays attached until it does.
    #[error("the guest did not release the disk within {0:?}")]
    NotReleased(Duration),
    /// `device_add` got no answer (a timeout or a lost connection): QEMU may have the device.
    #[error("device_add: no answer ({0}); QEMU may have attached the disk")]
    Uncertain(QmpError),
    /// A QMP step failed.
    #[error("{step}: {source}")]
    Qmp {
        /// The QMP command.
        step: &'static str,
        /// What QEMU or the connection said.
        #[source]
        source: QmpError,
    },
}

fn step(step: &'static str) -> impl FnOnce(QmpError) -> HotplugError {
    move |source| HotplugError::Qmp { step, source }
}

/// The descriptors of a disk to hot-plug: read-write and read-only on the same file (QEMU may
/// open a disk read-only first, as at start).
pub struct DiskFds {
    /// Opened read-write.
    pub rw: std::os::fd::OwnedFd,
    /// Opened read-only.
    pub ro: std::os::fd::OwnedFd,
}

/// Attaches `disk` (its descriptors `fds`) to the running QEMU behind `q`: fd set, block node,
/// device on a free root port (`pcie`) or the root bus. Undoes its own steps when a later one
/// fails.
///
/// # Errors
/// [`HotplugError::NoFreeSlot`], or the failing step's QMP error.
pub async fn attach(q: &mut Qmp, disk: &DataDiskSpec, fds: &DiskFds, pcie: bool) -> Result<(), HotplugError> {
    let bus = if pcie {
        let pci = q.execute("query-pci", None).await.map_err(step("query-pci"))?;
        Some(free_port(&pci).ok_or(HotplugError::NoFreeSlot)?)
    } else {
        None
    };
    let opaque = fdset_opaque(&disk.name);
    let set = q.add_fd(fds.rw.as_fd(), None, &opaque).await.map_err(step("add-fd"))?;
    let node = data_drive(&disk.name);
    let result = async {
        q.add_fd(fds.ro.as_fd(), Some(set), &opaque).await.map_err(step("add-fd"))?;
        q.execute("blockdev-add", Some(blockdev_args(disk, set))).await.map_err(step("blockdev-add"))?;
        match q.execute("device_add", Some(device_args(disk, bus.as_deref()))).await {
            Ok(_) => Ok(()),
            // Refused: nothing of the device exists; the node goes with the fd set below.
            Err(e @ QmpError::Command { .. }) => {
                let _ = q.execute("blockdev-del", Some(json!({ "node-name": node }))).await;
                Err(step("device_add")(e))
            }
            Err(e) => Err(HotplugError::Uncertain(e)),
        }
    }
    .await;
    if matches!(result, Err(HotplugError::Qmp { .. })) {
        let _ = q.execute("remove-fd", Some(json!({ "fdset-id": set }))).await;
    }
    result
}

/// Unplugs data disk `name` from the running QEMU behind `q`: `device_del` (a device already
/// gone counts as released: an earlier unplug the guest finished late), waits up to `release`
/// for the guest to let go (`DEVICE_DELETED`), then removes its block node (a hot-plugged
/// disk's; a drive attached at start goes with its device) and its fd set: the hot-plug one, or
/// the start's, whose description is the disk's path `file` (so QEMU keeps no descriptor on a
/// file about to be deleted). Failures of that cleanup are logged: the device is gone.
///
/// # Errors
/// [`HotplugError::NotReleased`] (the device stays until the guest lets go), or a QMP error
/// of `device_del`.
pub async fn detach(q: &mut Qmp, name: &str, file: &str, release: Duration) -> Result<(), HotplugError> {
    let id = data_drive(name);
    match q.execute("device_del", Some(json!({ "id": id }))).await {
        Ok(_) => {
            let deleted = |e: &Value| {
                e.get("event").and_then(Value::as_str) == Some("DEVICE_DELETED")
                    && e.pointer("/data/device").and_then(Value::as_str) == Some(id.as_str())
            };
            if q.wait_event(deleted, release).await.map_err(step("device_del"))?.is_none() {
                return Err(HotplugError::NotReleased(release));
            }
        }
        Err(QmpError::Command { class, .. }) if class == "DeviceNotFound" => {}
        Err(e) => return Err(step("device_del")(e)),
    }
    if let Err(e) = remove_nodes(q, |disk| disk == name, Some(file)).await {
        tracing::warn!(disk = name, error = %e, "unplugged; its node or descriptors stay in QEMU until it exits");
    }
    Ok(())
}

/// How much of a live disk change the QEMU behind `q` can take: free root ports (any number on
/// a machine without PCIe), and whether each of `remove` sits where it can be unplugged (behind
/// a root port; a VM started before disks had ports has them on the root complex).
///
/// # Errors
/// The QMP error of `query-pci`.
pub async fn can_change(q: &mut Qmp, pcie: bool, add: usize, remove: &[&str]) -> Result<bool, HotplugError> {
    if !pcie {
        return Ok(true);
    }
    let pci = q.execute("query-pci", None).await.map_err(step("query-pci"))?;
    let ports = root_ports(&pci);
    let free = ports.iter().filter(|(_, behind)| behind.is_empty()).count();
    let behind_port = |id: &str| ports.iter().any(|(_, behind)| behind.contains(&id));
    Ok(free >= add && remove.iter().all(|d| behind_port(&data_drive(d))))
}

/// The data disks (by name) that have a device in the QEMU behind `q`.
///
/// # Errors
/// The QMP error of `qom-list`.
pub async fn attached(q: &mut Qmp) -> Result<BTreeSet<String>, HotplugError> {
    let list = q.execute("qom-list", Some(json!({ "path": "/machine/peripheral" }))).await.map_err(step("qom-list"))?;
    Ok(list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.get("name").and_then(Value::as_str))
        .filter_map(|n| n.strip_prefix("data-"))
        .map(str::to_string)
        .collect())
}

/// Removes hot-plug block nodes and fd sets of data disks that have no device (`devices`: the
/// disks that do, from [`attached`]).
///
/// # Errors
/// The QMP error of a query or a removal.
pub async fn clear_half_attached(q: &mut Qmp, devices: &BTreeSet<String>) -> Result<(), HotplugError> {
    remove_nodes(q, |disk| !devices.contains(disk), None).await
}

/// Removes the hot-plug block nodes and fd sets of the data disks `orphan` names, and the fd
/// set described `file` (a disk attached at start: its drive went with its device).
async fn remove_nodes(q: &mut Qmp, orphan: impl Fn(&str) -> bool, file: Option<&str>) -> Result<(), HotplugError> {
    let nodes = q.execute("query-named-block-nodes", Some(json!({ "flat": true }))).await;
    let nodes = nodes.map_err(step("query-named-block-nodes"))?;
    let node_names: BTreeSet<String> = nodes
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.get("node-name").and_then(Value::as_str))
        .filter(|n| n.strip_prefix("data-").is_some_and(&orphan))
        .map(str::to_string)
        .collect();
    for node in node_names {
        q.execute("blockdev-del", Some(json!({ "node-name": node }))).await.map_err(step("blockdev-del"))?;
    }
    let sets = q.execute("query-fdsets", None).await.map_err(step("query-fdsets"))?;
    for set in sets.as_array().into_iter().flatten() {
        let hot = set.get("fds").and_then(Value::as_array).into_iter().flatten().any(|fd| {
            let opaque = fd.get("opaque").and_then(Value::as_str);
            opaque.and_then(|o| o.strip_prefix("hotplug:data-")).is_some_and(&orphan)
                || (opaque.is_some() && opaque == file)
        });
        if let (true, Some(id)) = (hot, set.get("fdset-id").and_then(Value::as_u64)) {
            q.execute("remove-fd", Some(json!({ "fdset-id": id }))).await.map_err(step("remove-fd"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{DiskCache, DiskFormat};

    fn disk(name: &str, format: DiskFormat, cache: DiskCache) -> DataDiskSpec {
        DataDiskSpec {
            name: name.into(),
            size_gib: 1,
            format,
            preallocate: false,
            cache,
            aio: None,
            keep_on_destroy: false,
            snapshot: true,
        }
    }

    #[test]
    fn a_port_per_disk_and_spares_only_on_pcie_machines_eight_to_a_slot() {
        let ports = root_port_args("q35", 5, 4);
        assert_eq!(ports.len(), 5 + 4);
        assert_eq!(ports[0], "pcie-root-port,id=hp0,bus=pcie.0,chassis=1,addr=0x1b.0x0,multifunction=on");
        assert_eq!(ports[7], "pcie-root-port,id=hp7,bus=pcie.0,chassis=8,addr=0x1b.0x7");
        assert_eq!(ports[8], "pcie-root-port,id=hp8,bus=pcie.0,chassis=9,addr=0x1c.0x0,multifunction=on");
        assert_eq!(
            root_port_args("q35", 16, 4).last().map(String::as_str),
            Some("pcie-root-port,id=hp19,bus=pcie.0,chassis=20,addr=0x1d.0x3")
        );
        // The most of both still fits the three slots below the seed's port (0x1e).
        let most = crate::api::disks::MAX_DATA_DISKS;
        assert_eq!(
            root_port_args("q35", most, crate::config::MAX_HOTPLUG_PORTS).last().map(String::as_str),
            Some("pcie-root-port,id=hp23,bus=pcie.0,chassis=24,addr=0x1d.0x7")
        );
        assert_eq!(root_port_args("pc-q35-7.2", 0, 4).len(), 4);
        // qemu.hotplug_ports = 0: only the disks' own ports.
        assert_eq!(root_port_args("q35", 2, 0).len(), 2);
        assert!(root_port_args("pc", 3, 4).is_empty() && root_port_args("pc-i440fx-7.2", 0, 4).is_empty());
    }

    #[test]
    fn blockdev_and_device_carry_the_drive_options_on_the_fd_set() {
        let raw = blockdev_args(&disk("nsm", DiskFormat::Raw, DiskCache::None), 12);
        assert_eq!(raw["driver"], "raw");
        assert_eq!(raw["node-name"], "data-nsm");
        assert_eq!(raw["file"]["filename"], "/dev/fdset/12");
        assert_eq!((raw["file"]["aio"].as_str(), raw["file"]["locking"].as_str()), (Some("native"), Some("off")));
        assert_eq!(raw["cache"]["direct"], true);
        let qcow = blockdev_args(&disk("logs", DiskFormat::Qcow2, DiskCache::Writeback), 3);
        assert_eq!((qcow["driver"].as_str(), qcow["file"]["aio"].as_str()), (Some("qcow2"), Some("threads")));
        assert_eq!(qcow["file"]["cache"]["direct"], false);
        // No qcow2 header can name a backing file QEMU opens; a raw node has no such option.
        assert_eq!(qcow.get("backing"), Some(&Value::Null));
        assert_eq!(raw.get("backing"), None);
        let dev = device_args(&disk("nsm", DiskFormat::Raw, DiskCache::None), Some("hp1"));
        assert_eq!(
            dev,
            json!({"driver": "virtio-blk-pci", "id": "data-nsm", "drive": "data-nsm", "serial": "nsm", "bus": "hp1"})
        );
        assert!(device_args(&disk("x", DiskFormat::Raw, DiskCache::None), None).get("bus").is_none());
    }

    #[test]
    fn the_free_port_is_the_highest_empty_one() {
        let port =
            |id: &str, devices: Value| json!({"qdev_id": id, "pci_bridge": {"bus": {"number": 1}, "devices": devices}});
        let pci = json!([{"bus": 0, "devices": [
            {"qdev_id": "", "class_info": {"desc": "Host bridge"}},
            port("hp2", json!([])),
            port("hp0", json!([{"qdev_id": "data-a"}])),
            port("hp1", json!([])),
            port("other", json!([])),
        ]}]);
        assert_eq!(free_port(&pci).as_deref(), Some("hp2"));
        let full = json!([{"bus": 0, "devices": [port("hp0", json!([{"qdev_id": "data-a"}]))]}]);
        assert_eq!(free_port(&full), None);
        assert_eq!(free_port(&json!([{"bus": 0, "devices": []}])), None, "a VM started without spare ports");
        assert_eq!(free_port(&json!({"not": "a list"})), None);
    }
}
