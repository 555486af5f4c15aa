# Lab scenario (tests/tests/lab.rs lab_host_runs_vmhostd_and_a_nested_vm):
# vmhostd in the lab starts a nested TCG VM from the test guest; then the lab kernel
# shows what this machine's kernel cannot do (802.1Q links, dummy links, bridge VLAN
# filtering, VFIO modules).
. /lab/lib.sh

say "scenario nested-vm: kernel $(uname -r), $(nproc) CPUs, $(awk '/MemTotal/ {print $2 / 1024}' /proc/meminfo) MiB"

# --- vmhostd and a nested VM ---------------------------------------------------------
start_vmhostd
check host-check ctl check
LAB_VERBOSE=1 check sandbox-in-force sandbox_in_force

t_create=$(lab_uptime)
require vm-create create_vm g1 "console=ttyS0 panic=-1 quiet"
t_created=$(lab_uptime)
say "TIMING vm.create returned after $(elapsed "$t_create" "$t_created") s"
if wait_serial g1 "$LAB_GUEST_READY" 900; then
    echo "CHECK PASS nested-guest-ready"
    say "TIMING nested guest ready $(elapsed "$t_create" "$(lab_uptime)") s after vm.create"
    say "nested guest says: $(grep -F "$LAB_GUEST_READY" "$(serial_log g1)")"
else
    check nested-guest-ready false
fi
check vm-list-running vm_listed g1 running
check vm-get-running wait_status g1 running 10

# --- what this machine's kernel lacks --------------------------------------------------
# busybox ip first (what a minimal image has; it cannot set bridge options, sysfs can),
# then iproute2 ("$IP", "$BRIDGE"; lib.sh), which also shows the bridge VLAN table.
check bb-dummy busybox ip link add d0 type dummy
check bb-vlan busybox ip link add link d0 name d0.10 type vlan id 10
check vlan-id-10 grep -q "VID: 10" /proc/net/vlan/d0.10
check bb-bridge busybox ip link add br0 type bridge
check bridge-vlan-filtering-sysfs sh -c 'echo 1 >/sys/class/net/br0/bridge/vlan_filtering &&
    test "$(cat /sys/class/net/br0/bridge/vlan_filtering)" = 1'

check ip-vlan "$IP" link add link d0 name d0.20 type vlan id 20
check ip-vlan-details sh -c '"$IP" -d link show d0.20 | grep -q "vlan protocol 802.1Q id 20"'
check ip-bridge-filtering "$IP" link add br1 type bridge vlan_filtering 1
check ip-bridge-filtering-on sh -c '"$IP" -d link show br1 | grep -q "vlan_filtering 1"'
check port-dummy "$IP" link add d1 type dummy
check port-enslave "$IP" link set d1 master br1
check tap-create "$IP" tuntap add dev tap0 mode tap
check tap-enslave "$IP" link set tap0 master br1
check port-pvid "$BRIDGE" vlan add dev tap0 vid 10 pvid untagged
check port-trunk "$BRIDGE" vlan add dev d1 vid 20
check bridge-vlan-table sh -c '"$BRIDGE" vlan show dev tap0 | grep -Eq "10 PVID (Egress )?Untagged" &&
    "$BRIDGE" vlan show dev d1 | grep -Eq "\b20\b"'
check links-up sh -c '"$IP" link set d0 up && "$IP" link set d0.10 up && "$IP" link set br1 up'
LAB_VERBOSE=1 check show-links sh -c '"$IP" -br link; "$BRIDGE" vlan show'

check vfio-modules sh -c 'lsmod | grep -q "^vfio_pci " && test -c /dev/vfio/vfio'

finish
