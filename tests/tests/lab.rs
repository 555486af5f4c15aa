//! Lab host tests: vmhostd inside a QEMU/TCG VM running Debian's cloud kernel, with nested
//! TCG VMs, for what this machine's kernel cannot do (tests/lab/README.md).

use std::time::Duration;
use vmhost_tests::lab::{run_lab, LabOptions};

/// The lab runs vmhostd, which starts a nested VM from the test guest (VMHOST-GUEST-READY in its
/// serial log, `running` in `vmhostctl list`); then the lab kernel creates a dummy link, an
/// 802.1Q VLAN on it and a bridge with VLAN filtering and per-port VLANs, and has VFIO.
#[test]
fn lab_host_runs_vmhostd_and_a_nested_vm() {
    let opts = LabOptions { timeout: Duration::from_secs(25 * 60), ..LabOptions::default() };
    let out = run_lab(include_str!("../lab/scenarios/nested-vm.sh"), &opts);
    let timing = |marker: &str| out.log.lines().find(|l| l.contains(marker)).unwrap_or("-").to_string();
    eprintln!(
        "lab: {} after {:.1?} (lab boot to scenario start {:.1?}); {}; {}",
        out.result,
        out.elapsed,
        out.boot_time.unwrap_or_default(),
        timing("TIMING vm.create"),
        timing("TIMING nested guest ready"),
    );
    // What the sandbox achieves on the lab's kernel (Debian 6.1: Landlock ABI 2).
    for line in out
        .log
        .lines()
        .filter(|l| ["| sandbox ", "| capabilities ", "| landlock ", "| seccomp "].iter().any(|item| l.contains(item)))
    {
        eprintln!("lab sandbox: {}", line.trim_start_matches([' ', '|']).trim());
    }
    assert!(out.passed, "lab scenario failed: {}\n----- lab console -----\n{}", out.result, out.log);
    let checks = out.checks();
    for name in [
        "sandbox-in-force",
        "nested-guest-ready",
        "vm-list-running",
        "bb-vlan",
        "ip-bridge-filtering-on",
        "bridge-vlan-table",
    ] {
        assert!(checks.contains(&format!("CHECK PASS {name}").as_str()), "no PASS for {name}:\n{}", out.log);
    }
}

/// VLAN isolation through bridge VLAN filtering, which this machine's kernel lacks: in the lab,
/// vmhostd makes the filtering bridge and the access-port taps; two nested VMs on VLAN 10 ping
/// each other, one on VLAN 20 (same subnet) reaches neither.
#[test]
fn vlans_isolate_vms_in_the_lab() {
    let opts = LabOptions { timeout: Duration::from_secs(40 * 60), ..LabOptions::default() };
    let out = run_lab(include_str!("../lab/scenarios/vlan.sh"), &opts);
    eprintln!("lab vlan: {} after {:.1?}", out.result, out.elapsed);
    assert!(out.passed, "lab scenario failed: {}\n----- lab console -----\n{}", out.result, out.log);
    let checks = out.checks();
    for name in
        ["pvid-va", "pvid-vc", "no-vlan1-va", "a-reaches-b", "b-reaches-a", "c-isolated-from-a", "c-isolated-from-b"]
    {
        assert!(checks.contains(&format!("CHECK PASS {name}").as_str()), "no PASS for {name}:\n{}", out.log);
    }
}

/// VFIO passthrough on a real kernel with an IOMMU (the lab: q35 + intel-iommu, emulated vmxnet3
/// and NVMe, and ICH9's shared group): a VM gets two devices (QMP `query-pci` of its QEMU shows
/// them), destroy gives them back to their drivers, a device whose IOMMU group holds a sibling on
/// a host driver is refused with 3004 naming it, ICH9's group (siblings driverless here) is
/// viable, a held device is refused with 3003, and a daemon killed after binding but
/// before QEMU started leaves the devices restored after its restart.
#[test]
fn vfio_passthrough_in_the_lab() {
    let args = [
        "-M",
        "kernel-irqchip=split",
        "-device",
        "intel-iommu,intremap=on,caching-mode=on",
        "-device",
        "vmxnet3,addr=05.0",
        "-drive",
        "if=none,id=nvm0,driver=null-co,size=64M",
        "-device",
        "nvme,addr=06.0,serial=labnvme,drive=nvm0",
        "-device",
        "virtio-net-pci,addr=07.0,multifunction=on",
        "-device",
        "virtio-net-pci,addr=07.1",
    ];
    let opts = LabOptions {
        timeout: Duration::from_secs(25 * 60),
        extra_qemu_args: args.iter().map(|s| s.to_string()).collect(),
        extra_cmdline: "intel_iommu=on".into(),
        ..LabOptions::default()
    };
    let out = run_lab(include_str!("../lab/scenarios/vfio.sh"), &opts);
    eprintln!("lab vfio: {} after {:.1?}", out.result, out.elapsed);
    for line in out.log.lines().filter(|l| l.contains("TIMING")) {
        eprintln!("  {line}");
    }
    assert!(out.passed, "lab scenario failed: {}\n----- lab console -----\n{}", out.result, out.log);
    let checks = out.checks();
    for name in [
        "sandbox-in-force",
        "bound-vmxnet3",
        "bound-nvme",
        "qemu-sees-vmxnet3",
        "qemu-sees-nvme",
        "qemu-unprivileged",
        "vfio-groups-for-qemu",
        "group-not-viable",
        "group-lists-sibling",
        "group-untouched",
        "ich9-bound",
        "ich9-driverless-again",
        "held-device-refused",
        "back-vmxnet3",
        "back-nvme",
        "restored-after-crash",
    ] {
        assert!(checks.contains(&format!("CHECK PASS {name}").as_str()), "no PASS for {name}:\n{}", out.log);
    }
}
