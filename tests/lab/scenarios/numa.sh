# Lab scenario (tests/tests/lab.rs numa_placement_in_the_lab): the NUMA lab. The lab is a q35
# machine with 4 vCPUs in two NUMA nodes (node 0: CPUs 0-1, node 1: CPUs 2-3, 1536 MiB each),
# an emulated IOMMU (intel-iommu, kernel-irqchip=split, intel_iommu=on) and a vmxnet3 behind a
# PCIe expander bus (pxb-pcie, numa_node=1) and its root port: the passthrough NIC sits on
# node 1, as a capture NIC on a real two-socket host. vhost_net is loaded (lab.modules).
#
# Phase 1 checks the lab itself: the nodes and their CPUs, the NIC's node, IOMMU group and
# driver, 2 MiB hugepages reserved on each node, /dev/vhost-net.
# Phase 2 runs vmhostd with vm_cpus = "1-3" (CPU 0 for the host) and the node-1 NIC modelled
# with its identity, and checks placement (issue 30 item 6): a dedicated numa-auto VM with the
# NIC and hugepages lands on node 1 (vCPU thread affinity, numa_maps, per-node hugepages,
# vm.get, host.info); dedicated VMs never share a CPU; requests beyond what is free are 3002;
# pins survive a daemon restart (a tampered one is put back) and go at stop; a swapped device
# at a pinned index is 3006; bridged NICs get vhost-net, also with 2 queues; shared VMs follow
# the shared pool.
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

# ===================== phase 2: vmhostd places VMs ===================================
# The NIC's model entry pins its identity (hw_toml ID); the swap check below rewrites it.
NIC_ID=15ad:07b0
WRONG_ID=8086:10d3
hw_toml() {
    cat <<EOF
vm_cpus = "1-3"
[hardware.copper]
1 = { pci = "$NIC", id = "$1" }
[networks.lab]
bridge = "br-lab"
create = true
[lifecycle]
autostart = false
EOF
}
# net_ready: the lab network's bridge is up (host.info says ready), waited for ~30 s.
net_ready() {
    _n=0
    until ctl --json info | grep -q '"ready": *true'; do
        _n=$((_n + 1))
        [ $_n -le 60 ] || { ctl --json info; return 1; }
        sleep 0.5
    done
}
# Under TCG vhost-net cannot start (virtio-pci has no ioeventfds without KVM) and vmhostd does
# not use it (checked at the end); the debug builds' override lets the lab prove that the
# descriptors reach QEMU, one per queue.
export VMHOST_TEST_VHOST_UNDER_TCG=1
start_vmhostd "$(hw_toml "$NIC_ID")"
check network-ready net_ready
LAB_VERBOSE=1 check host-check sh -c "vmhostctl --socket $LAB_SOCKET check; true"
# check_item ITEM REGEX: `vmhostctl check` shows ITEM with a status and detail matching REGEX.
check_item() {
    _c=$(ctl check 2>&1)
    echo "$_c" | grep -E "^$1 " || { echo "$_c"; echo "(no $1 item)"; return 1; }
    echo "$_c" | grep -Eq "^$1 +$2"
}
check identity-ok check_item hardware_identity 'ok '
# vhost_net is always ok (VMs start either way); the detail says whether NICs get vhost-net.
check vhost-usable check_item vhost_net 'ok +/dev/vhost-net opens read-write'

# pvm NAME CPUS MIB 'EXTRA_JSON_FIELDS,': a kernel VM (QEMU running is what counts, the guest
# need not boot far).
pvm() {
    cat >"$LAB_DIR/$1.json" <<JSON
{"name": "$1", "cpu": $2, "memory_mib": $3, $4
 "boot": {"kernel": "$LAB_GUEST_KERNEL", "initrd": "$LAB_GUEST_INITRD", "cmdline": "console=ttyS0 quiet"}}
JSON
    ctl create "$LAB_DIR/$1.json"
}
DEDICATED='"cpu_policy": "dedicated",'
# node_of CPU: the lab's node of a CPU (node 0: 0-1, node 1: 2-3).
node_of() { if [ "$1" -lt 2 ]; then echo 0; else echo 1; fi; }
# one_cpu_of LIST SET: LIST is a single CPU and one of SET ("2 3").
one_cpu_of() {
    for _c in $2; do [ "$1" = "$_c" ] && return 0; done
    echo "Cpus_allowed_list \"$1\", not one CPU of: $2"
    return 1
}
# memory_bound VM NODE [huge]: VM's guest RAM (QEMU's memfd backend, shown as
# file=/memfd:memory-backend-memfd) in /proc/PID/numa_maps is bound to NODE (bind:NODE), has
# pages only there, and is hugetlb when asked.
memory_bound() {
    _p=$(vm_qemu_pid "$1") || return 1
    _m=$(grep '/memfd:memory-backend-memfd' "/proc/$_p/numa_maps")
    echo "$_m"
    [ -n "$_m" ] || { grep -v ' default ' "/proc/$_p/numa_maps" | head -n 20; return 1; }
    echo "$_m" | grep -q " bind:$2 " || return 1
    ! echo "$_m" | grep -q " N$((1 - $2))=" || return 1
    if [ "${3:-}" = huge ]; then echo "$_m" | grep -q ' huge ' || return 1; fi
}
# hp_are FREE0 FREE1: free 2 MiB pages of node 0 and node 1 (sysfs), waited for ~10 s.
hp_are() {
    _n=0
    while [ "$(hp_free 0) $(hp_free 1)" != "$1 $2" ] && [ $_n -lt 20 ]; do
        sleep 0.5
        _n=$((_n + 1))
    done
    echo "free_hugepages node0 $(hp_free 0) node1 $(hp_free 1) (want $1 $2)"
    test "$(hp_free 0) $(hp_free 1)" = "$1 $2"
}
# said TEXT PATTERN...: TEXT matches every extended regex PATTERN.
said() {
    _t=$1
    shift
    for _pat in "$@"; do
        echo "$_t" | grep -Eq -- "$_pat" || { echo "$_t"; echo "(no match for $_pat)"; return 1; }
    done
}
# placement_shows VM PATTERN...: vm.get of VM (blanks removed) has a placement, and each PATTERN.
placement_shows() {
    _v=$(flat_json get "$1") || return 1
    _vm=$1
    shift
    said "$_v" '"placement":\{' "$@" || { echo "(vm.get $_vm)"; return 1; }
}
# no_placement VM: vm.get of VM shows no placement (or VM has no record).
no_placement() { ! flat_json get "$1" 2>/dev/null | grep -q '"placement":{'; }
# node_holds NODE VM: host.info's numa entry for NODE lists VM among its holders.
node_holds() {
    _i=$(flat_json info) || return 1
    _n=$(echo "$_i" | sed -n 's/.*"numa":\[//p' | sed "s/.*{\"node\":$1,//" | sed 's/{"node":[0-9]*,.*//')
    said "$_n" "\"holders\":\[[^]]*\"vm\":\"$2\"" || { echo "host.info: $_i"; return 1; }
}
# cpus_are VM LIST: VM's vCPU 0 thread may run on exactly LIST (waited for ~60 s).
cpus_are() {
    _n=0
    while [ "$(vcpu_cpus "$1")" != "$2" ]; do
        _n=$((_n + 1))
        [ $_n -le 120 ] || { echo "$1 vCPU 0 on $(vcpu_cpus "$1"), not $2"; return 1; }
        sleep 0.5
    done
}
# all_on VM LIST: every thread of VM's QEMU may run on exactly LIST (waited for ~30 s).
all_on() {
    _n=0
    while qemu_threads "$1" | awk -v w="$2" '$2 != w { bad = 1 } END { exit !bad }'; do
        _n=$((_n + 1))
        [ $_n -le 60 ] || { qemu_threads "$1"; echo "(not all on $2)"; return 1; }
        sleep 0.5
    done
}
# others_on VM LIST: QEMU's threads other than vCPUs run on LIST.
others_on() {
    qemu_threads "$1" | awk -v w="$2" '{ print } $3 != "CPU" && $2 != w { bad = 1 } END { exit bad }'
}

# --- a sensor: dedicated, numa auto, the node-1 NIC, hugepages ----------------------
t0=$(lab_uptime)
require d1-create pvm d1 1 128 "$DEDICATED"' "numa": "auto", "hugepages": "2M", "hardware": {"copper": [1]},'
say "TIMING create dedicated + 2M hugepages (64 pages) + passthrough NIC: $(elapsed "$t0" "$(lab_uptime)") s"
LAB_VERBOSE=1 check d1-threads qemu_threads d1
d1_cpus=$(vcpu_cpus d1)
say "FACT d1 vCPU 0 Cpus_allowed_list $d1_cpus"
check d1-vcpu-on-node1 one_cpu_of "$d1_cpus" "2 3"
check d1-other-threads-housekeeping others_on d1 0
LAB_VERBOSE=1 check d1-memory-bind-node1 memory_bound d1 1 huge
check d1-hugepages-from-node1 hp_are "$HP_PAGES" $((HP_PAGES - 64))
check d1-get-placement placement_shows d1 "\"vcpus\":\[$d1_cpus\]" '"nodes":\[1\]' '"hugepages":"2M"'
check d1-host-info-node1 node_holds 1 d1
LAB_VERBOSE=1 check d1-host-info sh -c "vmhostctl --socket $LAB_SOCKET info"
say "FACT d1 QEMU argv: $(tr '\0' ' ' <"/proc/$(vm_qemu_pid d1)/cmdline" | grep -oE '(memory-backend-memfd|memory-backend=)[^ ]*' | tr '\n' ' ')"
say "FACT d1 vm.get: $(flat_json get d1 | grep -oE '"placement":\{[^}]*\}[^}]*\}')"
say "FACT host.info: $(flat_json info)"

# --- a second dedicated VM, no devices, normal memory ----------------------------------
t0=$(lab_uptime)
require d2-create pvm d2 1 128 "$DEDICATED"
say "TIMING create dedicated, normal memory: $(elapsed "$t0" "$(lab_uptime)") s"
d2_cpus=$(vcpu_cpus d2)
say "FACT d2 vCPU 0 Cpus_allowed_list $d2_cpus"
check d2-one-vm-cpu one_cpu_of "$d2_cpus" "1 2 3"
check d2-not-sharing test "$d2_cpus" != "$d1_cpus"
d2_node=$(node_of "${d2_cpus:-0}")
LAB_VERBOSE=1 check d2-memory-bound memory_bound d2 "$d2_node"
check d2-get-placement placement_shows d2 "\"vcpus\":\[$d2_cpus\]" "\"nodes\":\[$d2_node\]"

# --- more than is free: 3002 with the numbers ---------------------------------------------
# A create the allocator refuses records nothing (placement is checked before the record is
# written), like any admission refusal. A record left behind fails the check and is destroyed,
# so the next refusal is judged alone.
# refused NAME OUT PATTERN...: OUT matches each PATTERN and NAME has no record.
refused() {
    _name=$1
    shift
    echo "$1"
    said "$@" || return 1
    if ctl get "$_name" >/dev/null 2>&1; then
        echo "$_name left recorded: $(vm_status "$_name")"
        no_placement "$_name" || echo "$_name holds a placement"
        ctl destroy "$_name" >/dev/null
        return 1
    fi
}
out=$(pvm d3a 2 128 "$DEDICATED" 2>&1)
LAB_VERBOSE=1 check d3-too-many-cpus refused d3a "$out" 'error 3002' '"requested":2' '"available":1'
# A node both dedicated VMs filled (node 0 has one VM CPU, 1; node 1 has 2 and 3).
if [ "$(node_of "$d1_cpus")" = "$d2_node" ]; then full=$d2_node; else full=0; fi
out=$(pvm d3b 1 128 "$DEDICATED"' "numa": '"$full"',' 2>&1)
LAB_VERBOSE=1 check d3-node-full refused d3b "$out" 'error 3002' '"resource":"cpu"' "\"node\":$full" '"requested":1' '"available":0'
# 256 MiB of 2 MiB pages (128) is more than any node has free (96 and 32).
out=$(pvm d3c 1 256 "$DEDICATED"' "hugepages": "2M",' 2>&1)
LAB_VERBOSE=1 check d3-hugepages-short refused d3c "$out" 'error 3002' '"resource":"hugepages"' '"requested":128'
check d3-hugepages-untouched hp_are "$HP_PAGES" $((HP_PAGES - 64))
pins_unchanged() { test "$(vcpu_cpus d1) $(vcpu_cpus d2)" = "$d1_cpus $d2_cpus"; }
check d3-pins-untouched pins_unchanged

# --- the pins survive a daemon restart; a changed one is put back -------------------
kill_vmhostd KILL
# While the daemon is down d2's vCPU thread is moved by hand: the restart must see and fix it.
d2_tid=$(qemu_threads d2 | awk '$3 == "CPU" && $4 == "0/TCG" { print $1 }')
taskset -p -c 0-3 "$d2_tid" >/dev/null
say "d2's vCPU thread $d2_tid moved to $(vcpu_cpus d2) while vmhostd is down"
restart_vmhostd
check restart-d1-running wait_status d1 running 60
check restart-d2-running wait_status d2 running 60
check restart-d1-pin-kept cpus_are d1 "$d1_cpus"
check restart-d2-pin-restored cpus_are d2 "$d2_cpus"
# repin_logged VM: the restart's recovery said it found VM's thread elsewhere and re-pinned it.
repin_logged() { grep 'not where the placement says' "$LAB_DAEMON_LOG" | grep -E "vm=\"?$1\"?( |$)"; }
LAB_VERBOSE=1 check restart-d2-repin-logged repin_logged d2
# d1's pins were kept, not redone: no such line for it.
expect_fail restart-d1-not-repinned repin_logged d1
check restart-d1-placement placement_shows d1 "\"vcpus\":\[$d1_cpus\]" '"nodes":\[1\]'
check restart-hugepages-unchanged hp_are "$HP_PAGES" $((HP_PAGES - 64))

# --- the pins go at stop: pages back, another VM takes the CPU ---------------------------
check d1-stop ctl stop d1 --force
check d1-hugepages-back hp_are "$HP_PAGES" "$HP_PAGES"
check d1-no-placement no_placement d1
t0=$(lab_uptime)
check d4-create pvm d4 1 128 "$DEDICATED"' "hugepages": "2M",'
say "TIMING create dedicated + 2M hugepages (64 pages), no device: $(elapsed "$t0" "$(lab_uptime)") s"
check d4-takes-freed-cpu cpus_are d4 "$d1_cpus"
check d4-hugepages hp_are "$HP_PAGES" $((HP_PAGES - 64))

# --- a swapped device at a pinned index: 3006, nothing bound ---------------------------
check d1-destroy ctl destroy d1
kill_vmhostd TERM
sed -i "s/id = \"$NIC_ID\"/id = \"$WRONG_ID\"/" "$LAB_CONFIG"
restart_vmhostd
LAB_VERBOSE=1 check identity-mismatch-reported check_item hardware_identity 'error .*15ad:07b0'
out=$(pvm d5 1 128 "$DEDICATED"' "hardware": {"copper": [1]},' 2>&1)
LAB_VERBOSE=1 check swapped-refused-3006 said "$out" 'error 3006' "$NIC_ID" "$WRONG_ID"
check swapped-nic-stays is_drv "$NIC" vmxnet3
check swapped-no-placement no_placement d5
ctl destroy d5 >/dev/null 2>&1
kill_vmhostd TERM
sed -i "s/id = \"$WRONG_ID\"/id = \"$NIC_ID\"/" "$LAB_CONFIG"
restart_vmhostd
check network-ready-again net_ready

# --- vhost-net on a bridged NIC, 1 and 2 queues; shared VMs on the shared pool ---------
check d2-destroy ctl destroy d2
check d4-destroy ctl destroy d4
check all-hugepages-back hp_are "$HP_PAGES" "$HP_PAGES"
require v1-create pvm v1 1 128 '"nics": [{"network": "lab"}],'
require v2-create pvm v2 1 128 '"nics": [{"network": "lab", "queues": 2}],'
# nic_shows VM PATTERN...: vm.get of VM (blanks removed) has NICs, and each PATTERN.
nic_shows() {
    _v=$(flat_json get "$1") || return 1
    shift
    said "$_v" '"nics":\[\{' "$@"
}
check v1-nic-vhost nic_shows v1 '"vhost":true'
check v2-nic-vhost-2-queues nic_shows v2 '"vhost":true' '"queues":2'
# vhost_fds VM N: VM's QEMU holds N descriptors of /dev/vhost-net.
vhost_fds() {
    _p=$(vm_qemu_pid "$1") || return 1
    _n=0
    for _f in /proc/"$_p"/fd/*; do
        [ "$(readlink "$_f")" = /dev/vhost-net ] && _n=$((_n + 1))
    done
    echo "QEMU of $1 holds $_n /dev/vhost-net descriptors (want $2)"
    test "$_n" = "$2"
}
LAB_VERBOSE=1 check v1-qemu-vhost-fd vhost_fds v1 1
LAB_VERBOSE=1 check v2-qemu-vhost-fds vhost_fds v2 2
check v1-shared-pool all_on v1 1-3
require d6-create pvm d6 1 128 "$DEDICATED"
d6_cpus=$(vcpu_cpus d6)
pool=$(for c in 1 2 3; do [ "$c" = "$d6_cpus" ] || echo "$c"; done | tr '\n' ',' | sed 's/,$//; s/^1,2$/1-2/; s/^2,3$/2-3/')
say "FACT d6 vCPU 0 on $d6_cpus; shared pool now $pool"
check v1-repinned-off-dedicated all_on v1 "$pool"
check v2-repinned-off-dedicated all_on v2 "$pool"

# --- without the override: TCG gets no vhost-net, and says so --------------------------
check v-destroy sh -c "vmhostctl --socket $LAB_SOCKET destroy v1 && vmhostctl --socket $LAB_SOCKET destroy v2"
kill_vmhostd TERM
unset VMHOST_TEST_VHOST_UNDER_TCG
restart_vmhostd
check tcg-vhost-not-used check_item vhost_net 'ok +not usable.*accel is tcg'
require v3-create pvm v3 1 128 '"nics": [{"network": "lab"}],'
check v3-nic-no-vhost nic_shows v3 '"vhost":false'
LAB_VERBOSE=1 check v3-qemu-no-vhost-fd vhost_fds v3 0

finish
