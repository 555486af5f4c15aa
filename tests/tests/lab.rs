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
    assert!(out.passed, "lab scenario failed: {}\n----- lab console -----\n{}", out.result, out.log);
    let checks = out.checks();
    for name in ["nested-guest-ready", "vm-list-running", "bb-vlan", "ip-bridge-filtering-on", "bridge-vlan-table"] {
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
