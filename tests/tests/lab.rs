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

/// The VFIO lab: q35 with an emulated IOMMU (intel-iommu, kernel-irqchip=split, intel_iommu=on),
/// a vmxnet3 at 00:05.0 and an NVMe at 00:06.0, each in a group of its own, plus `extra` QEMU
/// arguments.
fn iommu_lab(extra: &[&str]) -> LabOptions {
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
    ];
    LabOptions {
        timeout: Duration::from_secs(25 * 60),
        extra_qemu_args: args.iter().chain(extra).map(|s| s.to_string()).collect(),
        extra_cmdline: "intel_iommu=on".into(),
        ..LabOptions::default()
    }
}

/// VFIO passthrough on a real kernel with an IOMMU (the lab: q35 + intel-iommu, emulated vmxnet3
/// and NVMe, and ICH9's shared group): a VM gets two devices (QMP `query-pci` of its QEMU shows
/// them), destroy gives them back to their drivers, a device whose IOMMU group holds a sibling on
/// a host driver is refused with 3004 naming it, ICH9's group (siblings driverless here) is
/// viable, a held device is refused with 3003, and a daemon killed after binding but
/// before QEMU started leaves the devices restored after its restart. The sandboxed daemon
/// cannot open a modelled device's `remove` or `config` for writing (Landlock grants only
/// `driver_override` and the drivers' bind files), and passthrough still works. A VFIO group
/// node that outlives the release (a sibling left on vfio-pci) is put back to root's 0600. A
/// model entry pinning the vmxnet3 to a wrong id refuses the VM with 3006 and leaves the device
/// on vmxnet3; pinned to its real id and permanent MAC, the VM starts with it.
#[test]
fn vfio_passthrough_in_the_lab() {
    let opts =
        iommu_lab(&["-device", "virtio-net-pci,addr=07.0,multifunction=on", "-device", "virtio-net-pci,addr=07.1"]);
    let out = run_lab(include_str!("../lab/scenarios/vfio.sh"), &opts);
    eprintln!("lab vfio: {} after {:.1?}", out.result, out.elapsed);
    for line in out.log.lines().filter(|l| l.contains("TIMING")) {
        eprintln!("  {line}");
    }
    assert!(out.passed, "lab scenario failed: {}\n----- lab console -----\n{}", out.result, out.log);
    let checks = out.checks();
    for name in [
        "sysfs-remove-refused",
        "sysfs-config-refused",
        "sysfs-override-granted",
        "sysfs-original-bind-granted",
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
        "ich9-sibling-on-vfio",
        "ich9-node-root-before",
        "ich9-bound",
        "ich9-node-for-qemu",
        "ich9-driverless-again",
        "ich9-node-put-back",
        "held-device-refused",
        "back-vmxnet3",
        "back-nvme",
        "identity-check-fails",
        "identity-mismatch-refused",
        "identity-mismatch-names-both",
        "identity-mismatch-untouched",
        "identity-mismatch-no-override",
        "identity-mismatch-no-record",
        "identity-check-ok",
        "identity-pinned-create",
        "identity-pinned-bound",
        "identity-held-ids-only",
        "identity-pinned-destroy",
        "identity-pinned-back",
        "restored-after-crash",
    ] {
        assert!(checks.contains(&format!("CHECK PASS {name}").as_str()), "no PASS for {name}:\n{}", out.log);
    }
}

/// vmhostd killed with SIGKILL by its crash points between two passthrough devices (in different
/// IOMMU groups), then restarted: after the first device was bound during a create, the create
/// is undone (record `failed`, reservation and devices given back, no QEMU, tap or run dir) and
/// a fresh create of the same VM gets both devices and one QEMU; after the first device was
/// released during a destroy, the destroy is finished (record gone, both devices back).
#[test]
fn vfio_crash_between_devices_in_the_lab() {
    let out = run_lab(include_str!("../lab/scenarios/vfio-crash.sh"), &iommu_lab(&[]));
    eprintln!("lab vfio-crash: {} after {:.1?}", out.result, out.elapsed);
    for line in out.log.lines().filter(|l| l.contains("DAEMON")) {
        eprintln!("  {line}");
    }
    assert!(out.passed, "lab scenario failed: {}\n----- lab console -----\n{}", out.result, out.log);
    let checks = out.checks();
    for name in [
        "different-groups",
        "orig-vmxnet3",
        "orig-nvme",
        "sandbox-in-force",
        "bind-crash-create-unanswered",
        "bind-crash-daemon-died",
        "bind-crash-sigkill",
        "bind-crash-first-bound",
        "bind-crash-second-untouched",
        "bind-crash-second-no-override",
        "bind-crash-intent-recorded",
        "bind-crash-no-qemu",
        "bind-recovered-nvme",
        "bind-recovered-vmxnet3",
        "bind-recovered-overrides",
        "bind-recovered-failed",
        "bind-recovered-record",
        "bind-recovered-no-qemu",
        "bind-recovered-no-tap",
        "bind-recovered-no-run-dir",
        "bind-recovered-no-sockets",
        "bind-failed-destroyed",
        "fresh-create",
        "fresh-running",
        "fresh-nvme-bound",
        "fresh-vmxnet3-bound",
        "fresh-one-qemu",
        "fresh-has-tap",
        "fresh-has-sockets",
        "release-crash-destroy-unanswered",
        "release-crash-daemon-died",
        "release-crash-sigkill",
        "release-crash-no-qemu",
        "release-crash-first-back",
        "release-crash-second-held",
        "release-crash-destroying",
        "release-recovered-vmxnet3",
        "release-recovered-nvme",
        "release-recovered-overrides",
        "release-recovered-gone",
        "release-recovered-no-record",
        "release-recovered-no-qemu",
        "release-recovered-no-tap",
        "release-recovered-no-run-dir",
        "release-recovered-no-sockets",
        "again-create",
        "again-running",
        "again-nvme-bound",
        "again-vmxnet3-bound",
        "again-one-qemu",
        "again-destroy",
        "again-back-vmxnet3",
        "again-back-nvme",
        "again-no-qemu",
        "again-no-tap",
    ] {
        assert!(checks.contains(&format!("CHECK PASS {name}").as_str()), "no PASS for {name}:\n{}", out.log);
    }
}

/// The NUMA lab: 4 vCPUs in two NUMA nodes (node 0: CPUs 0-1, node 1: CPUs 2-3; 1536 MiB of RAM
/// each), the VFIO lab's IOMMU, and a vmxnet3 behind a PCIe expander bus on node 1 (`pxb-pcie`,
/// `numa_node=1`, and a root port), so the lab kernel sees a passthrough NIC on node 1 as on a
/// two-socket host; vhost_net is loaded. Lab memory is the sum of the two nodes' backends (QEMU
/// refuses any other `-m`).
fn numa_lab() -> LabOptions {
    let args = [
        "-M",
        "kernel-irqchip=split",
        "-object",
        "memory-backend-ram,id=m0,size=1536M",
        "-object",
        "memory-backend-ram,id=m1,size=1536M",
        "-numa",
        "node,nodeid=0,cpus=0-1,memdev=m0",
        "-numa",
        "node,nodeid=1,cpus=2-3,memdev=m1",
        "-device",
        "intel-iommu,intremap=on,caching-mode=on",
        "-device",
        "pxb-pcie,id=pxb1,bus_nr=0x80,numa_node=1,bus=pcie.0",
        "-device",
        "pcie-root-port,id=rp1,bus=pxb1,chassis=1,slot=1",
        "-device",
        "vmxnet3,bus=rp1",
    ];
    LabOptions {
        memory_mib: 3072,
        cpus: 4,
        timeout: Duration::from_secs(40 * 60),
        extra_qemu_args: args.iter().map(|s| s.to_string()).collect(),
        extra_cmdline: "intel_iommu=on lab.modules=vhost_net".into(),
        ..LabOptions::default()
    }
}

/// NUMA placement on a two-node host (the NUMA lab above; issue 30 item 6). The lab shows two
/// nodes with their CPUs, the vmxnet3 on node 1 in an IOMMU group of its own and on its driver,
/// 2 MiB hugepages reserved on each node (sysfs and the node's meminfo agree) and
/// /dev/vhost-net. vmhostd runs with `vm_cpus = "1-3"` and the NIC modelled with its identity:
/// a dedicated `numa: auto` VM with the NIC and `hugepages: "2M"` lands on node 1 (its vCPU
/// thread's `Cpus_allowed_list` is a node-1 CPU, QEMU's other threads on housekeeping CPU 0, its
/// RAM `bind:1` and `huge` in numa_maps, node 1's free pages down by 64 and node 0's not;
/// vm.get and host.info show it); a second dedicated VM gets another CPU and its node's memory;
/// asking more CPUs, a full node or more hugepages than are free is 3002 with the numbers,
/// records nothing and changes no pin or pool; after
/// `kill -9` of vmhostd and a restart the pins are unchanged and a vCPU moved by hand meanwhile
/// is put back; stop gives the pages and the CPU back (another VM takes it); a wrong pinned
/// identity is reported by `host.check` and refused with 3006, the NIC left on its driver;
/// bridged NICs get vhost-net (one descriptor per queue, 1 and 2 queues), and shared VMs run on
/// the shared pool and are moved off a CPU a dedicated VM takes.
#[test]
fn numa_placement_in_the_lab() {
    let out = run_lab(include_str!("../lab/scenarios/numa.sh"), &numa_lab());
    eprintln!("lab numa: {} after {:.1?} (boot {:.1?})", out.result, out.elapsed, out.boot_time.unwrap_or_default());
    // The facts (sysfs paths and values) and timings for docs/performance-tuning.md, with the
    // verbose checks' output.
    for line in out.log.lines().filter(|l| l.contains("TIMING") || l.contains("FACT") || l.starts_with("  | ")) {
        eprintln!("  {line}");
    }
    assert!(out.passed, "lab scenario failed: {}\n----- lab console -----\n{}", out.result, out.log);
    let checks = out.checks();
    for name in [
        "two-nodes",
        "node0-cpus",
        "node1-cpus",
        "nic-found",
        "nic-on-node1",
        "nic-iommu-group",
        "nic-on-vmxnet3",
        "hugepages-node0",
        "hugepages-node1",
        "vhost-net-dev",
        "network-ready",
        "identity-ok",
        "vhost-usable",
        "d1-create",
        "d1-vcpu-on-node1",
        "d1-other-threads-housekeeping",
        "d1-memory-bind-node1",
        "d1-hugepages-from-node1",
        "d1-get-placement",
        "d1-host-info-node1",
        "d2-create",
        "d2-one-vm-cpu",
        "d2-not-sharing",
        "d2-memory-bound",
        "d2-get-placement",
        "d3-too-many-cpus",
        "d3-node-full",
        "d3-hugepages-short",
        "d3-pins-untouched",
        "d3-hugepages-untouched",
        "restart-d1-running",
        "restart-d2-running",
        "restart-d1-pin-kept",
        "restart-d2-pin-restored",
        "restart-d2-repin-logged",
        "restart-d1-not-repinned",
        "restart-d1-placement",
        "restart-hugepages-unchanged",
        "d1-stop",
        "d1-hugepages-back",
        "d1-no-placement",
        "d4-create",
        "d4-takes-freed-cpu",
        "d4-hugepages",
        "identity-mismatch-reported",
        "swapped-refused-3006",
        "swapped-nic-stays",
        "swapped-no-placement",
        "all-hugepages-back",
        "v1-create",
        "v2-create",
        "v1-nic-vhost",
        "v2-nic-vhost-2-queues",
        "v1-qemu-vhost-fd",
        "v2-qemu-vhost-fds",
        "v1-shared-pool",
        "d6-create",
        "v1-repinned-off-dedicated",
        "v2-repinned-off-dedicated",
        "tcg-vhost-not-used",
        "v3-nic-no-vhost",
        "v3-qemu-no-vhost-fd",
    ] {
        assert!(checks.contains(&format!("CHECK PASS {name}").as_str()), "no PASS for {name}:\n{}", out.log);
    }
}

/// Capture NICs and trunks (issue 31) on the lab kernel: a bridge NIC with `vlans: [10, 20]` and
/// one with `trunk: true` on a VLAN-filtering bridge receive exactly their VLANs' tagged frames
/// (and the untagged native VLAN 1); a monitor NIC of an 802.1Q sub-interface and one of a bond
/// receive every frame their source does; after stop no filter, clsact or promiscuous flag of
/// vmhost's is left, and a foreign clsact and filter are. The nested guests run the agent from
/// this tree (`agent_guest()`), which sets the monitor NICs promiscuous and reads the counters
/// for `vm.exec`.
#[test]
fn capture_nics_and_trunks_in_the_lab() {
    let agent = vmhost_tests::agent_guest();
    let opts = LabOptions {
        timeout: Duration::from_secs(40 * 60),
        files: vec![("initramfs-agent".into(), agent.initrd)],
        ..LabOptions::default()
    };
    let out = run_lab(include_str!("../lab/scenarios/capture.sh"), &opts);
    eprintln!("lab capture: {} after {:.1?}", out.result, out.elapsed);
    assert!(out.passed, "lab scenario failed: {}\n----- lab console -----\n{}", out.result, out.log);
    let checks = out.checks();
    for name in [
        "tv-tagged-10",
        "tt-tagged-4094",
        "vlan-trk0p.10-tv",
        "vlan-trk0p.30-tv",
        "vlan-trk0p.30-tt",
        "monitor-vlan-source",
        "monitor-bond-source",
        "ms-vm-check",
        "vlan-source-no-vmhost-filter",
        "bond-foreign-filter-kept",
        "vlan-source-promisc-back",
    ] {
        assert!(checks.contains(&format!("CHECK PASS {name}").as_str()), "no PASS for {name}:\n{}", out.log);
    }
}
