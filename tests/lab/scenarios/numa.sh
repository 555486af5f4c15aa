# Lab scenario (tests/tests/lab.rs numa_placement_in_the_lab): the NUMA lab. The lab is a q35
# machine with 4 vCPUs in two NUMA nodes (node 0: CPUs 0-1, node 1: CPUs 2-3, 1536 MiB each),
# an emulated IOMMU (intel-iommu, kernel-irqchip=split, intel_iommu=on) and a vmxnet3 behind a
# PCIe expander bus (pxb-pcie, numa_node=1) and its root port: the passthrough NIC sits on
# node 1, as a capture NIC on a real two-socket host. vhost_net is loaded (lab.modules).
#
# Phase 1 checks the lab itself: the nodes and their CPUs, the NIC's node, IOMMU group and
# driver, 2 MiB hugepages reserved on each node, /dev/vhost-net.
. /lab/lib.sh

# Per-node hugepage reservation (2 MiB pages): 96 pages = 192 MiB on each node.
HP_PAGES=96
NODES=/sys/devices/system/node
hp_dir() { echo "$NODES/node$1/hugepages/hugepages-2048kB"; }
# hp_free N: free 2 MiB pages on node N (the kernel's count, sysfs).
hp_free() { cat "$(hp_dir "$1")/free_hugepages"; }
# meminfo_hp_free N: HugePages_Free of node N's meminfo (the same count, another file).
meminfo_hp_free() { awk '$3 == "HugePages_Free:" { print $4 }' "$NODES/node$1/meminfo"; }

# The vmxnet3 (PCI 15ad:07b0) is the only one in the lab: find its address.
NIC=
for d in /sys/bus/pci/devices/*; do
    if [ "$(cat "$d/vendor")" = 0x15ad ] && [ "$(cat "$d/device")" = 0x07b0 ]; then
        NIC=${d##*/}
    fi
done
drv() {
    _l=$(readlink "/sys/bus/pci/devices/$1/driver" 2>/dev/null) && basename "$_l" || echo none
}

# --- lab facts (printed for the docs) -----------------------------------------------
say "scenario numa: kernel $(uname -r), cpus online $(cat /sys/devices/system/cpu/online)"
for n in "$NODES"/node[0-9]*; do
    say "FACT $n/cpulist = $(cat "$n/cpulist"); $(awk '$3 == "MemTotal:" { print "MemTotal " $4 " kB" }' "$n/meminfo")"
done
for d in /sys/bus/pci/devices/*; do
    _g=$(readlink "$d/iommu_group" 2>/dev/null) && _g=${_g##*/} || _g=-
    say "FACT pci ${d##*/} $(cat "$d/vendor"):$(cat "$d/device") numa_node=$(cat "$d/numa_node") iommu_group=$_g driver=$(drv "${d##*/}")"
done

nodes_are() {
    _got=$(cd "$NODES" && echo node[0-9]*)
    test "$_got" = "node0 node1" || { echo "nodes: $_got"; return 1; }
}
cpulist_is() {
    _got=$(cat "$NODES/node$1/cpulist")
    test "$_got" = "$2" || { echo "node$1 cpulist: $_got, not $2"; return 1; }
}
require two-nodes nodes_are
check node0-cpus cpulist_is 0 0-1
check node1-cpus cpulist_is 1 2-3

require nic-found test -n "$NIC"
say "FACT NIC $NIC: numa_node $(cat "/sys/bus/pci/devices/$NIC/numa_node")"
nic_node_is() {
    _got=$(cat "/sys/bus/pci/devices/$NIC/numa_node")
    test "$_got" = "$1" || { echo "$NIC numa_node: $_got"; return 1; }
}
check nic-on-node1 nic_node_is 1
nic_group() {
    _g=$(readlink "/sys/bus/pci/devices/$NIC/iommu_group") || { echo "$NIC has no IOMMU group"; return 1; }
    echo "group ${_g##*/}: $(ls "/sys/bus/pci/devices/$NIC/iommu_group/devices" | tr '\n' ' ')"
}
LAB_VERBOSE=1 check nic-iommu-group nic_group
is_drv() { test "$(drv "$1")" = "$2" || { echo "$1 is on $(drv "$1"), not $2"; return 1; }; }
check nic-on-vmxnet3 is_drv "$NIC" vmxnet3

# --- hugepages on each node ---------------------------------------------------------
for n in 0 1; do
    echo "$HP_PAGES" >"$(hp_dir "$n")/nr_hugepages"
done
hp_reserved() {
    _nr=$(cat "$(hp_dir "$1")/nr_hugepages")
    _free=$(hp_free "$1")
    _mi=$(meminfo_hp_free "$1")
    echo "node$1: nr_hugepages $_nr free_hugepages $_free meminfo HugePages_Free $_mi"
    test "$_nr" = "$HP_PAGES" && test "$_free" = "$HP_PAGES" && test "$_mi" = "$HP_PAGES"
}
LAB_VERBOSE=1 check hugepages-node0 hp_reserved 0
LAB_VERBOSE=1 check hugepages-node1 hp_reserved 1
say "FACT $(grep -E '^HugePages_(Total|Free)' /proc/meminfo | tr '\n' ' ')"

# --- vhost-net ----------------------------------------------------------------------
vhost_dev() {
    grep -qw vhost_net /proc/modules || { echo "vhost_net not loaded"; return 1; }
    test -c /dev/vhost-net || { ls -l /dev/vhost* 2>&1; return 1; }
    ls -l /dev/vhost-net
}
LAB_VERBOSE=1 check vhost-net-dev vhost_dev

finish
