# Lab scenario (tests/tests/lab.rs vlans_isolate_vms_in_the_lab): vmhostd creates a bridge
# with VLAN filtering; three nested VMs share one subnet, two on VLAN 10 and one on VLAN 20.
# The two on VLAN 10 reach each other; the one on VLAN 20 reaches neither. Everything on the
# host side (bridge, taps, PVIDs) is made by vmhostd through netlink.
. /lab/lib.sh

say "scenario vlan: kernel $(uname -r), $(nproc) CPUs"
start_vmhostd '
[networks.vl]
bridge = "br-vl"
create = true
vlan_filtering = true
subnet = "10.0.10.0/24"
'
net_ready() { ctl --json info | grep -q '"ready": true'; }
check network-ready net_ready

# nic_vm NAME VLAN ADDRESS PING_TARGETS
nic_vm() {
    cat >"$LAB_DIR/$1.json" <<JSON
{"name": "$1", "cpu": 1, "memory_mib": 160,
 "boot": {"kernel": "$LAB_GUEST_KERNEL", "initrd": "$LAB_GUEST_INITRD",
          "cmdline": "console=ttyS0 panic=-1 quiet vmhost.ping=$4"},
 "nics": [{"network": "vl", "vlan": $2, "ipv4": {"mode": "static", "address": "$3/24"}}]}
JSON
    ctl create "$LAB_DIR/$1.json"
}
require create-a nic_vm va 10 10.0.10.5 10.0.10.6
require create-b nic_vm vb 10 10.0.10.6 10.0.10.5
require create-c nic_vm vc 20 10.0.10.7 10.0.10.5,10.0.10.6

# The host side as vmhostd built it: each tap an access port of its VLAN, VLAN 1 gone.
tap_of() { ctl --json get "$1" | sed -n 's/.*"tap": *"\([^"]*\)".*/\1/p' | head -n 1; }
filtering_on() { "$IP" -d link show br-vl | grep -q "vlan_filtering 1"; }
# has_pvid TAP VID: VID is the port's PVID, egress untagged (bridge vlan show prints it).
has_pvid() { "$BRIDGE" vlan show dev "$1" | grep -Eq "(^|[[:space:]])$2 PVID (Egress )?Untagged"; }
no_vlan1() { ! "$BRIDGE" vlan show dev "$1" | grep -Eq "(^|[[:space:]])1( |$)"; }
LAB_VERBOSE=1 check bridge-vlans "$BRIDGE" vlan show
check bridge-filtering filtering_on
for pair in va:10 vb:10 vc:20; do
    vm=${pair%%:*} vid=${pair#*:}
    check "pvid-$vm" has_pvid "$(tap_of "$vm")" "$vid"
    check "no-vlan1-$vm" no_vlan1 "$(tap_of "$vm")"
done

for vm in va vb vc; do
    wait_serial "$vm" "$LAB_GUEST_READY" 900 || check "$vm-ready" false
done
check a-reaches-b wait_serial va "VMHOST-PING 10.0.10.6 ok" 600
check b-reaches-a wait_serial vb "VMHOST-PING 10.0.10.5 ok" 600
check c-isolated-from-a wait_serial vc "VMHOST-PING 10.0.10.5 fail" 900
check c-isolated-from-b wait_serial vc "VMHOST-PING 10.0.10.6 fail" 900

# Destroy removes the taps with their VLAN settings; the bridge stays.
tap_c=$(tap_of vc)
check destroy-c ctl destroy vc
gone() { ! "$IP" link show "$1" >/dev/null 2>&1 && ! "$BRIDGE" vlan show | grep -Eq "(^|[[:space:]])20( |$)"; }
check tap-gone gone "$tap_c"
check bridge-stays "$IP" link show br-vl
finish
