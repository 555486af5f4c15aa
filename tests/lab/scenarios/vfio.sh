# Lab scenario (tests/tests/lab.rs vfio_passthrough_in_the_lab): the lab is a q35 machine with
# an emulated IOMMU (intel-iommu, kernel-irqchip=split, intel_iommu=on) and emulated devices:
#   0000:00:05.0 vmxnet3  (host driver vmxnet3)  copper 1
#   0000:00:06.0 nvme     (host driver nvme)     disk 1
#   0000:00:07.0 virtio-net, function 0 of a multifunction slot whose function 1 (another
#                virtio-net, driver virtio-pci) shares its IOMMU group  sfp 5
#   0000:00:1f.2 ICH9 SATA: shares its group with 00:1f.0 and 00:1f.3; the cloud kernel has
#                no driver for any of them, so the group is viable  sfp 6
# vmhostd binds what a VM needs to vfio-pci, QEMU gets it, and everything goes back to its
# original driver on destroy and after a daemon crash. A model entry pinning a wrong identity
# refuses the VM (3006) before anything is bound; the right one (id and MAC) lets it start.
. /lab/lib.sh

say "scenario vfio: kernel $(uname -r), iommu groups: $(ls /sys/kernel/iommu_groups | wc -l)"
drv() {
    _l=$(readlink "/sys/bus/pci/devices/$1/driver" 2>/dev/null) && basename "$_l" || echo none
}
is_drv() { test "$(drv "$1")" = "$2" || { echo "$1 is on $(drv "$1"), not $2"; return 1; }; }
HW='
[hardware.copper]
1 = "0000:00:05.0"
[hardware.disk]
1 = "0000:00:06.0"
[hardware.sfp]
5 = "0000:00:07.0"
6 = "0000:00:1f.2"
# Autostart off: after the crash below, the check is that the restart settles p4 as failed with
# its device back, before anything starts it again.
[lifecycle]
autostart = false
'
# The sandbox probe (debug builds): the daemon opens sysfs files for writing and reports each
# outcome (it writes nothing). Landlock grants exactly driver_override and the drivers' bind
# files passthrough writes, never a modelled device's remove or config.
export VMHOST_TEST_SANDBOX_PROBE="$LAB_DIR/escaped"
D=/sys/bus/pci/devices/0000:00:05.0
export VMHOST_TEST_SANDBOX_PROBE_OPEN="$D/remove,$D/config,$D/driver_override,/sys/bus/pci/drivers/vmxnet3/bind"
start_vmhostd "$HW"
unset VMHOST_TEST_SANDBOX_PROBE VMHOST_TEST_SANDBOX_PROBE_OPEN
probe_said() { grep -F "sandbox-probe: open-for-write $1: $2" "$LAB_DAEMON_LOG"; }
check sysfs-remove-refused probe_said "$D/remove" 'errno 13'
check sysfs-config-refused probe_said "$D/config" 'errno 13'
check sysfs-override-granted probe_said "$D/driver_override" ok
check sysfs-original-bind-granted probe_said /sys/bus/pci/drivers/vmxnet3/bind ok
check orig-vmxnet3 is_drv 0000:00:05.0 vmxnet3
check orig-nvme is_drv 0000:00:06.0 nvme
LAB_VERBOSE=1 check host-check sh -c 'vmhostctl --socket '"$LAB_SOCKET"' check; true'
LAB_VERBOSE=1 check sandbox-in-force sandbox_in_force

# pt_vm NAME HARDWARE_JSON: a kernel VM (it need not boot far: QEMU running is what counts).
pt_vm() {
    cat >"$LAB_DIR/$1.json" <<JSON
{"name": "$1", "cpu": 1, "memory_mib": 128, "hardware": $2,
 "boot": {"kernel": "$LAB_GUEST_KERNEL", "initrd": "$LAB_GUEST_INITRD", "cmdline": "console=ttyS0 quiet"}}
JSON
    ctl create "$LAB_DIR/$1.json"
}

# --- two devices into one VM ---------------------------------------------------------
# Baseline: the same VM without devices, for the passthrough share of a start.
t0=$(lab_uptime)
require create-p0 pt_vm p0 '{}'
say "TIMING create without passthrough: $(elapsed "$t0" "$(lab_uptime)") s"
check destroy-p0 ctl destroy p0
t0=$(lab_uptime)
require create-p1 pt_vm p1 '{"copper": [1], "disk": [1]}'
say "TIMING create with 2 passthrough devices: $(elapsed "$t0" "$(lab_uptime)") s"
check bound-vmxnet3 is_drv 0000:00:05.0 vfio-pci
check bound-nvme is_drv 0000:00:06.0 vfio-pci
# The nested QEMU sees them (vendor 0x15ad = 5549 vmxnet3, 0x1b36 = 6966 QEMU's nvme).
pci_json=$(qmp "$LAB_RUN/p1/qmp" query-pci)
has() { echo "$pci_json" | grep -Eq "$1" || { echo "$pci_json"; return 1; }; }
check qemu-sees-vmxnet3 has '"vendor": ?5549'
check qemu-sees-nvme has '"vendor": ?6966'
# ... while QEMU runs as vmhost-qemu (uid 992 in the lab), which may open the two group
# devices because vmhostd gave them to its group.
qemu_pid_of() {
    for d in /proc/[0-9]*; do
        tr '\0' ' ' <"$d/cmdline" 2>/dev/null | grep -q "guest=$1," && { basename "$d"; return 0; }
    done
    return 1
}
qemu_unprivileged() {
    _p=$(qemu_pid_of "$1") || { echo "no QEMU for $1"; return 1; }
    _ids=$(awk '/^(Uid|Gid|CapEff):/ {printf "%s %s ", $1, $2}' "/proc/$_p/status")
    test "$_ids" = "Uid: 992 Gid: 992 CapEff: 0000000000000000 " || { echo "QEMU of $1: $_ids"; return 1; }
}
groups_for_qemu() {
    for _n in /dev/vfio/[0-9]*; do
        test "$(stat -c %g:%a "$_n")" = 992:660 || { ls -ln /dev/vfio; return 1; }
    done
}
check qemu-unprivileged qemu_unprivileged p1
check vfio-groups-for-qemu groups_for_qemu

# --- refusals -------------------------------------------------------------------------
said() { echo "$1" | grep -q -- "$2" || { echo "$1"; return 1; }; }
check sibling-on-virtio is_drv 0000:00:07.1 virtio-pci
shared=$(pt_vm p2 '{"sfp": [5]}' 2>&1)
check group-not-viable said "$shared" 'error 3004'
check group-lists-sibling said "$shared" '0000:00:07.1'
check group-names-driver said "$shared" 'virtio-pci'
check group-untouched is_drv 0000:00:07.0 virtio-pci
check group-no-record sh -c "! vmhostctl --socket $LAB_SOCKET get p2 >/dev/null 2>&1"
# ICH9's group is viable here (its other functions have no driver): the VM runs and the
# function goes back to having no driver on destroy.
# A sibling put on vfio-pci by hand keeps the group's node after the VM releases 1f.2: the node
# must be back to root's 0600 then, not left to QEMU's group.
sib=0000:00:1f.3
echo vfio-pci >/sys/bus/pci/devices/$sib/driver_override
echo $sib >/sys/bus/pci/drivers_probe
check ich9-sibling-on-vfio is_drv $sib vfio-pci
node=/dev/vfio/$(basename "$(readlink /sys/bus/pci/devices/$sib/iommu_group)")
node_is() { test "$(stat -c %u:%g:%a "$node")" = "$1" || { ls -ln /dev/vfio; return 1; }; }
check ich9-node-root-before node_is 0:0:600
require create-ich9 pt_vm p5 '{"sfp": [6]}'
check ich9-bound is_drv 0000:00:1f.2 vfio-pci
check ich9-node-for-qemu node_is 0:992:660
check destroy-ich9 ctl destroy p5
check ich9-driverless-again is_drv 0000:00:1f.2 none
check ich9-node-put-back node_is 0:0:600
echo $sib >/sys/bus/pci/drivers/vfio-pci/unbind
echo >/sys/bus/pci/devices/$sib/driver_override
held=$(pt_vm p3 '{"copper": [1]}' 2>&1)
check held-device-refused said "$held" 'error 3003'

# --- release on destroy ---------------------------------------------------------------
t0=$(lab_uptime)
check destroy-p1 ctl destroy p1
say "TIMING destroy with 2 passthrough devices: $(elapsed "$t0" "$(lab_uptime)") s"
say "TIMING $(grep -o 'vfio bound.*' "$LAB_DAEMON_LOG" | head -n 1)"
say "TIMING $(grep -o 'vfio released vm=p1.*' "$LAB_DAEMON_LOG" | head -n 1)"
check back-vmxnet3 is_drv 0000:00:05.0 vmxnet3
check back-nvme is_drv 0000:00:06.0 nvme

# --- identity pins ---------------------------------------------------------------------
# copper 1 pinned to a wrong id (the vmxnet3 is 15ad:07b0): host.check names the mismatch and a
# VM asking for it is refused with 3006, the device left on vmxnet3 with no driver_override.
# Pinned to its real id and the permanent MAC of its netdev (read here, before it is bound), it
# passes: the VM starts with it, and host.check judges it by its ids while p7 holds it.
mac=$(cat /sys/bus/pci/devices/0000:00:05.0/net/*/address)
say "vmxnet3 MAC $mac (addr_assign_type $(cat /sys/bus/pci/devices/0000:00:05.0/net/*/addr_assign_type))"
pin_copper1() {
    kill_vmhostd
    sed -i "s|^1 = .*0000:00:05.0.*|1 = $1|" "$LAB_CONFIG"
    grep -F 0000:00:05.0 "$LAB_CONFIG"
    restart_vmhostd
}
check_item() { ctl check 2>&1 | grep -E "^hardware_identity +$1" || { ctl check 2>&1; return 1; }; }
pin_copper1 '{ pci = "0000:00:05.0", id = "8086:10d3" }'
LAB_VERBOSE=1 check identity-check-fails check_item 'error +hardware copper 1 \(0000:00:05.0\) is 15ad:07b0, the model pins 8086:10d3'
wrong=$(pt_vm p6 '{"copper": [1]}' 2>&1)
LAB_VERBOSE=1 check identity-mismatch-refused said "$wrong" 'error 3006'
check identity-mismatch-names-both said "$wrong" 'is 15ad:07b0, the model pins 8086:10d3'
check identity-mismatch-untouched is_drv 0000:00:05.0 vmxnet3
no_override() { test "$(cat /sys/bus/pci/devices/0000:00:05.0/driver_override)" = "(null)"; }
check identity-mismatch-no-override no_override
check identity-mismatch-no-record sh -c "! vmhostctl --socket $LAB_SOCKET get p6 >/dev/null 2>&1"
pin_copper1 "{ pci = \"0000:00:05.0\", id = \"15ad:07b0\", mac = \"$mac\" }"
LAB_VERBOSE=1 check identity-check-ok check_item 'ok +all 1 pinned devices match'
check identity-pinned-create pt_vm p7 '{"copper": [1]}'
check identity-pinned-bound is_drv 0000:00:05.0 vfio-pci
LAB_VERBOSE=1 check identity-held-ids-only check_item 'ok .*on vfio-pci for p7'
check identity-pinned-destroy ctl destroy p7
check identity-pinned-back is_drv 0000:00:05.0 vmxnet3

# --- kill -9 of vmhostd after binding, before QEMU starts --------------------------------
# A QEMU wrapper that takes 30 s to start gives the window; QEMU never starts (the wrapper
# is killed with the daemon), as if the daemon died right after binding.
cat >/run/slow-qemu <<'SH'
#!/bin/sh
sleep 30
exec /usr/bin/qemu-system-x86_64 "$@"
SH
chmod 755 /run/slow-qemu
kill_vmhostd
sed -i 's|^binary = .*|binary = "/run/slow-qemu"|' "$LAB_CONFIG"
restart_vmhostd
pt_vm p4 '{"copper": [1]}' >/dev/null 2>&1 &
n=0
while [ "$(drv 0000:00:05.0)" != vfio-pci ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
check bound-before-crash is_drv 0000:00:05.0 vfio-pci
kill_vmhostd KILL
pkill -KILL -f /run/slow-qemu
sed -i 's|^binary = .*|binary = "/usr/bin/qemu-system-x86_64"|' "$LAB_CONFIG"
restart_vmhostd
check restored-after-crash is_drv 0000:00:05.0 vmxnet3
check p4-failed wait_status p4 failed 10
finish
