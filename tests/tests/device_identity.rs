//! Device identity pins end to end, on this machine's real PCI devices: `host.check`'s
//! `hardware_identity` item judges what real sysfs and the daemon's netlink say (ids, and the
//! permanent MAC of a real NIC), and a VM asking for a pinned index whose device has other ids
//! is refused with 3006 before any other host check, with nothing recorded and the device's
//! `driver_override` and driver untouched. This machine has no IOMMU, so nothing is ever bound
//! here; the bind path with a pin is proven in the lab (tests/tests/lab.rs, vfio scenario).

use serde_json::json;
use std::fs;
use std::path::{Path, PathBuf};
use vmhost_tests::{HostOptions, TestHost};

const PCI: &str = "/sys/bus/pci/devices";

/// `vvvv:dddd` of a PCI device directory.
fn id_of(dev: &Path) -> String {
    let hex = |attr: &str| {
        let t = fs::read_to_string(dev.join(attr)).unwrap_or_default();
        t.trim().trim_start_matches("0x").to_string()
    };
    format!("{}:{}", hex("vendor"), hex("device"))
}

/// A NIC of this host: its PCI address, id and permanent MAC (its address, when sysfs says it
/// is the permanent one). `None` on a machine without one.
fn host_nic() -> Option<(String, String, String)> {
    for entry in fs::read_dir("/sys/class/net").ok()?.flatten() {
        let net = entry.path();
        if fs::read_to_string(net.join("addr_assign_type")).ok()?.trim() != "0" {
            continue;
        }
        let Ok(mut dir) = fs::canonicalize(net.join("device")) else { continue };
        // A virtio NIC's device is the virtio device below the PCI function.
        loop {
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if Path::new(PCI).join(&name).exists() && dir.join("vendor").exists() {
                let mac = fs::read_to_string(net.join("address")).ok()?.trim().to_string();
                return Some((name, id_of(&dir), mac));
            }
            if !dir.pop() {
                break;
            }
        }
    }
    None
}

/// Another PCI device than `not`, and its id.
fn other_device(not: &str) -> (String, String) {
    let mut names: Vec<String> =
        fs::read_dir(PCI).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    let name = names.into_iter().find(|n| n != not).expect("a second PCI device");
    let id = id_of(&PathBuf::from(PCI).join(&name));
    (name, id)
}

/// The same id with the device id's last bit flipped: surely not the device.
fn wrong(id: &str) -> String {
    let (v, d) = id.split_once(':').unwrap();
    format!("{v}:{:04x}", u16::from_str_radix(d, 16).unwrap() ^ 1)
}

fn identity_item(host: &TestHost) -> serde_json::Value {
    let check = host.call("host.check", json!({}));
    check["items"].as_array().unwrap().iter().find(|i| i["name"] == "hardware_identity").unwrap().clone()
}

#[test]
fn pinned_devices_are_judged_on_the_real_host() {
    let Some((nic, nic_id, mac)) = host_nic() else {
        eprintln!("SKIP: this machine has no PCI NIC with a permanent address");
        return;
    };
    let (other, other_id) = other_device(&nic);
    let bad = wrong(&other_id);
    eprintln!("NIC {nic} {nic_id} {mac}; pinned wrong: {other} is {other_id}, pinned {bad}");
    let override_before = fs::read_to_string(Path::new(PCI).join(&other).join("driver_override")).unwrap();
    let driver_before = fs::read_link(Path::new(PCI).join(&other).join("driver")).ok();

    let extra = format!(
        "[hardware.copper]\n1 = {{ pci = \"{nic}\", id = \"{}\", mac = \"{}\" }}\n2 = {{ pci = \"{other}\", id = \"{bad}\" }}\n",
        nic_id.to_uppercase(),
        mac.to_uppercase()
    );
    let host = TestHost::start(HostOptions { extra, ..HostOptions::default() });
    let item = identity_item(&host);
    assert_eq!(item["status"], "error", "{item}");
    let detail = item["detail"].as_str().unwrap();
    assert!(detail.contains(&format!("hardware copper 2 ({other}) is {other_id}, the model pins {bad}")), "{detail}");
    assert!(!detail.contains("copper 1"), "the NIC's ids and permanent MAC match: {detail}");

    // A VM asking for the wrong one: 3006 before any other check (no IOMMU here would be
    // 3004), nothing recorded, the device untouched.
    let mut spec = host.kernel_spec("pinned");
    spec["hardware"] = json!({"copper": [2]});
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert_eq!(code, 3006, "{e:?}");
    assert_eq!(e.field.as_deref(), Some("spec.hardware.copper[0]"));
    assert_eq!(e.details["class"], "copper");
    assert_eq!(e.details["index"], 2);
    assert_eq!(e.details["pci"], other);
    assert_eq!(e.details["expected"]["id"], bad);
    assert_eq!(e.details["found"]["id"], other_id);
    assert_eq!(e.details["mismatches"].as_array().map(Vec::len), Some(1));
    let (code, _) = host.call_err("vm.get", json!({"name": "pinned"}));
    assert_eq!(code, 4040, "nothing was recorded");
    assert_eq!(fs::read_to_string(Path::new(PCI).join(&other).join("driver_override")).unwrap(), override_before);
    assert_eq!(fs::read_link(Path::new(PCI).join(&other).join("driver")).ok(), driver_before);

    // The right one passes the identity check (its MAC read over netlink) and meets the next
    // ones: the host uses the NIC (3005), or there is no IOMMU (3004).
    spec["hardware"] = json!({"copper": [1]});
    let (code, e) = host.call_err("vm.create", json!({ "spec": spec }));
    assert!(code == 3005 || code == 3004, "{code} {e:?}");
}

#[test]
fn host_check_is_ok_when_every_pin_matches_and_skipped_without_pins() {
    let Some((nic, nic_id, mac)) = host_nic() else {
        eprintln!("SKIP: this machine has no PCI NIC with a permanent address");
        return;
    };
    let extra = format!("[hardware.sfp]\n5 = {{ pci = \"{nic}\", id = \"{nic_id}\", mac = \"{mac}\" }}\n");
    let host = TestHost::start(HostOptions { extra, ..HostOptions::default() });
    let item = identity_item(&host);
    assert_eq!(item["status"], "ok", "{item}");
    assert_eq!(item["detail"], "all 1 pinned devices match");
    drop(host);

    let host =
        TestHost::start(HostOptions { extra: format!("[hardware.sfp]\n5 = \"{nic}\"\n"), ..HostOptions::default() });
    let item = identity_item(&host);
    assert_eq!(
        (item["status"].as_str(), item["detail"].as_str()),
        (Some("ok"), Some("no device identity pinned (skipped)"))
    );
}
