# Lab scenario (tests/tests/lab.rs capture_nics_and_trunks_in_the_lab): trunks and monitor NICs on
# the lab kernel, which has what this machine's lacks (bridge VLAN filtering, 802.1Q links,
# bonding).
#
#   netns gen (the wire)            lab (vmhostd's host)                      nested VMs
#   trk0p.10/.20/.30, trk0p  ──veth── trk0 ∈ br-tr (vlan_filtering, 10/20/30 tagged, 1 pvid)
#                                     br-tr ─ tap ─ "tv": vlans [10, 20]        eth0
#                                     br-tr ─ tap ─ "tt": trunk: true           eth0
#   cap0p.100 ────────────────veth── cap0 ─ cap0.100 (802.1Q) ══mirror══ "ms"  eth0
#   bnd0p     ────────────────veth── bnd0 ∈ bond0            ══mirror══ "ms"  eth1
#
# Frames are busybox arping bursts (ARP requests: broadcast, so a guest NIC takes them without
# being promiscuous), a different count per VLAN so a guest's receive delta says which it got:
# 3 tagged 10, 4 tagged 20, 5 tagged 30, 2 untagged. The guests run the agent (the lab file
# initramfs-agent); the scenario reads /sys/class/net/ethN/statistics/rx_packets by vm.exec.
# IPv6 is off everywhere here (sysctl default before any link is made), so nothing but the
# bursts is on these wires once the guests are up.
. /lab/lib.sh

TC=/usr/local/sbin/tc
# Where vmhostd's [paths] boot allows initrds from (start_vmhostd lists /lab/guest).
AGENT_INITRD=/lab/guest/initramfs-agent.cpio.gz
say "scenario capture: kernel $(uname -r), $(nproc) CPUs"
cp /lab/files/initramfs-agent "$AGENT_INITRD"
for m in sch_ingress cls_bpf act_mirred veth bonding 8021q bridge; do
    modprobe "$m" || say "module $m not loaded"
done
check agent-initrd test -s "$AGENT_INITRD"
echo 1 >/proc/sys/net/ipv6/conf/default/disable_ipv6
echo 1 >/proc/sys/net/ipv6/conf/all/disable_ipv6

# The wire side: a namespace holding every sender.
require netns "$IP" netns add gen
gen() { "$IP" netns exec gen "$@"; }
gen sh -c 'echo 1 >/proc/sys/net/ipv6/conf/default/disable_ipv6; echo 1 >/proc/sys/net/ipv6/conf/all/disable_ipv6'
require veth-trunk "$IP" link add trk0 type veth peer name trk0p netns gen
require veth-vlan "$IP" link add cap0 type veth peer name cap0p netns gen
require veth-bond "$IP" link add bnd0 type veth peer name bnd0p netns gen
require vlan-source "$IP" link add link cap0 name cap0.100 type vlan id 100
# Loading bonding makes bond0 by itself (max_bonds=1); make it only where it did not.
"$IP" link show bond0 >/dev/null 2>&1 || "$IP" link add bond0 type bond
require bond "$IP" link show bond0
require bond-slave "$IP" link set bnd0 master bond0
for l in cap0 cap0.100 bnd0 bond0 trk0; do "$IP" link set "$l" up; done
gen "$IP" link set lo up
for l in trk0p cap0p bnd0p; do gen "$IP" link set "$l" up; done
gen "$IP" link add link trk0p name trk0p.10 type vlan id 10
gen "$IP" link add link trk0p name trk0p.20 type vlan id 20
gen "$IP" link add link trk0p name trk0p.30 type vlan id 30
gen "$IP" link add link cap0p name cap0p.100 type vlan id 100
# subnet_of IFACE: the third octet of the sender's own /24 on IFACE (arping needs a source
# address and a route to its target).
subnet_of() {
    case $1 in
        trk0p) echo 1 ;; trk0p.10) echo 2 ;; trk0p.20) echo 3 ;; trk0p.30) echo 4 ;;
        cap0p.100) echo 5 ;; bnd0p) echo 6 ;;
    esac
}
for l in trk0p trk0p.10 trk0p.20 trk0p.30 cap0p.100 bnd0p; do
    gen "$IP" link set "$l" up
    gen "$IP" addr add "10.77.$(subnet_of "$l").1/24" dev "$l"
done
# A foreign tc setup on the bond, made before vmhostd: its clsact and its filter must survive.
require foreign-clsact "$TC" qdisc add dev bond0 clsact
require foreign-filter "$TC" filter add dev bond0 ingress prio 7 bpf da bytecode '1,6 0 0 0,'
promisc_of() { "$IP" link show "$1" | head -n 1 | grep -q PROMISC; }
expect_fail vlan-source-not-promisc promisc_of cap0.100

start_vmhostd '
[agent]
allow_exec = true

[capture]
interfaces = ["cap0.100", "bond0"]

[networks.tr]
bridge = "br-tr"
create = true
vlan_filtering = true
'
net_ready() { ctl --json info | grep -q '"ready": true'; }
check network-ready net_ready
require trunk-port "$IP" link set trk0 master br-tr
for vid in 10 20 30; do "$BRIDGE" vlan add dev trk0 vid "$vid"; done
LAB_VERBOSE=1 check bridge-vlans "$BRIDGE" vlan show

# vm NAME NICS_JSON
vm() {
    cat >"$LAB_DIR/$1.json" <<JSON
{"name": "$1", "cpu": 1, "memory_mib": 192,
 "boot": {"kernel": "$LAB_GUEST_KERNEL", "initrd": "$AGENT_INITRD",
          "cmdline": "console=ttyS0 panic=-1 quiet ipv6.disable=1"},
 "nics": $2}
JSON
    ctl create "$LAB_DIR/$1.json"
}
require create-tv vm tv '[{"network": "tr", "vlans": [10, 20]}]'
require create-tt vm tt '[{"network": "tr", "trunk": true}]'
require create-ms vm ms '[{"mode": "monitor", "source": "cap0.100"},
                          {"mode": "monitor", "source": "bond0", "direction": "ingress"}]'

tap_of() { ctl --json get "$1" | sed -n 's/.*"tap": *"\([^"]*\)".*/\1/p' | sed -n "${2:-1}p"; }
# tagged TAP VID: VID on the port, tagged (no PVID, no Untagged on its line).
tagged() { "$BRIDGE" vlan show dev "$1" | grep -E "(^|[[:space:]])$2( |$)" | grep -qv -e PVID -e Untagged; }
check tv-tagged-10 tagged "$(tap_of tv)" 10
check tv-tagged-20 tagged "$(tap_of tv)" 20
expect_fail tv-not-30 sh -c "$BRIDGE vlan show dev $(tap_of tv) | grep -Eq '(^|[[:space:]])30( |\$)'"
check tt-tagged-30 tagged "$(tap_of tt)" 30
check tt-tagged-4094 tagged "$(tap_of tt)" 4094
check vlan-source-promisc promisc_of cap0.100
check bond-promisc promisc_of bond0
LAB_VERBOSE=1 check tc-vlan-source "$TC" -s filter show dev cap0.100 ingress
LAB_VERBOSE=1 check tc-bond "$TC" -s filter show dev bond0 ingress
# The monitor taps are nobody's bridge ports.
no_master() { ! "$IP" link show "$1" | grep -q master; }
check ms-tap0-unbridged no_master "$(tap_of ms 1)"
check ms-tap1-unbridged no_master "$(tap_of ms 2)"

for v in tv tt ms; do
    wait_serial "$v" "$LAB_GUEST_READY" 900 || check "$v-ready" false
done
agent_up() { ctl --json get "$1" | tr -d ' \n' | grep -q '"connected":true'; }
for v in tv tt ms; do
    t=0
    while ! agent_up "$v" && [ $t -lt 300 ]; do sleep 2; t=$((t + 2)); done
    check "$v-agent" agent_up "$v"
done
# retry SECS CMD...: CMD until it succeeds, for at most SECS seconds (a loaded lab drops agent
# sessions whose ping took over 3 s; they reconnect).
retry() {
    _s=$1
    shift
    _t=0
    until "$@"; do
        [ $_t -ge "$_s" ] && return 1
        sleep 2
        _t=$((_t + 2))
    done
}
# The agent set the monitor NICs up and promiscuous, no address: vm.check says so.
LAB_VERBOSE=1 check ms-vm-check retry 180 ctl check ms

# rx VM IFACE: the guest's receive counter (-1 when no exec answered within 120 s).
rx() {
    _t=0
    while :; do
        _v=$(ctl exec "$1" -- cat "/sys/class/net/$2/statistics/rx_packets" 2>/dev/null | tr -dc 0-9)
        [ -n "$_v" ] && { echo "$_v"; return 0; }
        [ $_t -ge 120 ] && { echo -1; return 1; }
        sleep 2
        _t=$((_t + 2))
    done
}
# burst IFACE COUNT: COUNT ARP requests from gen's IFACE (one a second), waiting for all.
burst() {
    _n=$(subnet_of "$1")
    gen busybox arping -c "$2" -w $(($2 + 2)) -I "$1" -s "10.77.$_n.1" "10.77.$_n.99" >/dev/null 2>&1 || true
}
# delta VM IFACE BEFORE EXPECTED NAME
delta_is() {
    now=$(rx "$1" "$2")
    say "$1 $2 rx $3 -> $now (want +$4)"
    [ $((now - $3)) -eq "$4" ]
}
# measure IFACE COUNT WANT_TV WANT_TT
measure() {
    tv0=$(rx tv eth0) tt0=$(rx tt eth0)
    burst "$1" "$2"
    check "vlan-$1-tv" delta_is tv eth0 "$tv0" "$3"
    check "vlan-$1-tt" delta_is tt eth0 "$tt0" "$4"
}
# A trunk NIC has no address, so nothing in the guest brings it up: do it, promiscuous (a
# sensor's own setup would), or the guest's driver counts nothing. QEMU's virtio-net drops a
# tagged frame of a VLAN the guest's driver did not register (no VLAN interface for it) unless
# the NIC is promiscuous; what the bridge forwards is what this measures.
for v in tv tt; do
    check "$v-eth0-up" retry 120 ctl exec "$v" -- ip link set eth0 up promisc on
done
measure trk0p.10 3 3 3
measure trk0p.20 4 4 4
measure trk0p.30 5 0 5
measure trk0p 2 2 2

ms0=$(rx ms eth0) ms1=$(rx ms eth1)
burst cap0p.100 6
check monitor-vlan-source delta_is ms eth0 "$ms0" 6
burst bnd0p 7
check monitor-bond-source delta_is ms eth1 "$ms1" 7

# Stop: nothing of vmhost's is left on the sources; the foreign setup on the bond is.
check stop-ms ctl stop ms
vmhost_filter() { "$TC" -s filter show dev "$1" ingress | grep -q "cookie 766d6863"; }
vmhost_filter_egress() { "$TC" -s filter show dev "$1" egress | grep -q "cookie 766d6863"; }
# gone CMD...: CMD fails within 30 s (the give-back runs on the stop's release path).
gone() {
    _t=0
    while "$@" && [ $_t -lt 30 ]; do sleep 1; _t=$((_t + 1)); done
    ! "$@"
}
check vlan-source-no-vmhost-filter gone vmhost_filter cap0.100
check vlan-source-no-vmhost-egress gone vmhost_filter_egress cap0.100
check bond-no-vmhost-filter gone vmhost_filter bond0
check vlan-source-no-clsact gone sh -c "$TC qdisc show dev cap0.100 | grep -q clsact"
check bond-clsact-kept sh -c "$TC qdisc show dev bond0 | grep -q clsact"
check bond-foreign-filter-kept sh -c "$TC filter show dev bond0 ingress | grep -q 'pref 7'"
check vlan-source-promisc-back gone promisc_of cap0.100
check bond-promisc-back gone promisc_of bond0
check no-ledgers gone sh -c "ls $LAB_STATE/capture/*.json >/dev/null 2>&1"
for v in tv tt; do check "stop-$v" ctl stop "$v"; done
finish
