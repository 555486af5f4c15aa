# Lab scenario (tests/tests/lab.rs vfio_crash_between_devices_in_the_lab): vmhostd is killed
# with SIGKILL by its debug-build crash points (docs/lifecycle.md) between two passthrough
# devices, once while binding (create) and once while releasing (destroy), then restarted.
# The lab is q35 with an emulated IOMMU and two devices in different IOMMU groups:
#   0000:00:05.0 vmxnet3  (host driver vmxnet3)  copper 1
#   0000:00:06.0 nvme     (host driver nvme)     disk 1
# A VM asking for both gets them in class order, disk before copper (validate.rs
# requested_devices): the NVMe is the first device bound and the first released.
# The VM also has a NIC, so a leftover tap would show.
. /lab/lib.sh

say "scenario vfio-crash: kernel $(uname -r), iommu groups: $(ls /sys/kernel/iommu_groups | wc -l)"
NIC=0000:00:05.0
NVME=0000:00:06.0
drv() {
    _l=$(readlink "/sys/bus/pci/devices/$1/driver" 2>/dev/null) && basename "$_l" || echo none
}
is_drv() { test "$(drv "$1")" = "$2" || { echo "$1 is on $(drv "$1"), not $2"; return 1; }; }
no_override() {
    _o=$(cat "/sys/bus/pci/devices/$1/driver_override")
    [ "$_o" = "(null)" ] || { echo "$1 has driver_override $_o"; return 1; }
}
no_overrides() { no_override $NVME && no_override $NIC; }
group_of() { basename "$(readlink "/sys/bus/pci/devices/$1/iommu_group")"; }
other_groups() {
    echo "groups: $NIC $(group_of $NIC), $NVME $(group_of $NVME)"
    [ -n "$(group_of $NIC)" ] && [ "$(group_of $NIC)" != "$(group_of $NVME)" ]
}
start_vmhostd '
[hardware.copper]
1 = "0000:00:05.0"
[hardware.disk]
1 = "0000:00:06.0"
[networks.pcnet]
bridge = "br-pc"
create = true
subnet = "10.0.20.0/24"
# Autostart off: the checks look at what a restart settles (failed, devices back) before
# anything starts the VM again.
[lifecycle]
autostart = false
'
LAB_VERBOSE=1 check different-groups other_groups
check orig-vmxnet3 is_drv $NIC vmxnet3
check orig-nvme is_drv $NVME nvme
# The crash points work under the sandbox (Landlock lets the daemon read RUN/crashpoint,
# seccomp lets it kill itself).
LAB_VERBOSE=1 check sandbox-in-force sandbox_in_force

# pt_vm NAME: a kernel VM with both devices and a NIC (it need not boot far: QEMU running
# is what counts).
pt_vm() {
    cat >"$LAB_DIR/$1.json" <<JSON
{"name": "$1", "cpu": 1, "memory_mib": 128, "hardware": {"copper": [1], "disk": [1]},
 "nics": [{"network": "pcnet", "ipv4": {"mode": "static", "address": "10.0.20.5/24"}}],
 "boot": {"kernel": "$LAB_GUEST_KERNEL", "initrd": "$LAB_GUEST_INITRD", "cmdline": "console=ttyS0 quiet"}}
JSON
    ctl create "$LAB_DIR/$1.json"
}

# qemu_of VM: pids of live (not zombie) QEMUs whose command line names the VM (-name guest=VM,
# the only vmhostd in the lab makes names unique).
qemu_of() {
    for _d in /proc/[0-9]*; do
        [ "$(awk '/^State:/ { print $2 }' "$_d/status" 2>/dev/null)" = Z ] && continue
        _c=$(tr '\0' ' ' <"$_d/cmdline" 2>/dev/null) || continue
        case "$_c" in *qemu-system*"guest=$1,"*) echo "${_d#/proc/}" ;; esac
    done
}
# qemu_count VM N: exactly N QEMUs of the VM.
qemu_count() {
    _p=$(qemu_of "$1")
    _n=$(echo "$_p" | wc -w)
    [ "$_n" -eq "$2" ] || { echo "$_n QEMU(s) of $1 (want $2): $_p"; return 1; }
}
has_tap() { "$IP" -o link show | grep "alias vmhost:vm=$1"; }
no_tap() { ! has_tap "$1"; }
no_run_dir() { [ ! -e "$LAB_RUN/$1" ] || { ls -la "$LAB_RUN/$1"; return 1; }; }
no_sockets() {
    _s=$(find "$LAB_RUN" -type s)
    [ -z "$_s" ] || { echo "sockets left: $_s"; return 1; }
}
record() { echo "$LAB_STATE/vms/$1.json"; }
# rec_has VM TEXT...: the VM's record file contains every TEXT (fixed strings).
rec_has() {
    _f=$(record "$1")
    shift
    for _t in "$@"; do
        grep -qF -- "$_t" "$_f" || { echo "no '$_t' in $_f:"; cat "$_f"; return 1; }
    done
}
no_record() { [ ! -e "$(record "$1")" ] || { cat "$(record "$1")"; return 1; }; }
not_listed() { ! ctl get "$1" 2>/dev/null; }

# arm STEP / disarm: the crash point file in the daemon's run dir.
arm() { echo "$1" >"$LAB_RUN/crashpoint"; }
disarm() { rm -f "$LAB_RUN/crashpoint"; }
# died_at STEP: vmhostd is gone or a zombie within 30 s, and its log says the crash point
# STEP killed it.
died_at() {
    _n=300
    while [ -d "/proc/$LAB_VMHOSTD_PID" ] &&
        [ "$(awk '/^State:/ { print $2 }' "/proc/$LAB_VMHOSTD_PID/status" 2>/dev/null)" != Z ]; do
        [ "$_n" -gt 0 ] || { echo "vmhostd (pid $LAB_VMHOSTD_PID) still alive after 30 s"; return 1; }
        sleep 0.1
        _n=$((_n - 1))
    done
    grep 'crash point reached' "$LAB_DAEMON_LOG" | grep -qF -- "$1" ||
        { echo "no 'crash point reached' for $1:"; tail -n 20 "$LAB_DAEMON_LOG"; return 1; }
}
# reap: collects the dead daemon's exit status into $DAEMON_RC (137: SIGKILL).
reap() {
    wait "$LAB_VMHOSTD_PID"
    DAEMON_RC=$?
    LAB_VMHOSTD_PID=
}

# --- kill -9 after the first device was bound (create) --------------------------------------
arm vfio:bound:1
expect_fail bind-crash-create-unanswered pt_vm pc
require bind-crash-daemon-died died_at vfio:bound:1
reap
check bind-crash-sigkill test "$DAEMON_RC" -eq 137
# What the crash left: the first device on vfio-pci, the second untouched, both in the record.
check bind-crash-first-bound is_drv $NVME vfio-pci
check bind-crash-second-untouched is_drv $NIC vmxnet3
check bind-crash-second-no-override no_override $NIC
check bind-crash-intent-recorded rec_has pc '"status": "creating"' "\"$NVME\"" "\"$NIC\""
check bind-crash-no-qemu qemu_count pc 0
disarm
restart_vmhostd
# The interrupted create is undone (docs/lifecycle.md, Daemon restarts): record `failed`,
# reservation released, every device back on its original driver and out of the record.
check bind-recovered-nvme is_drv $NVME nvme
check bind-recovered-vmxnet3 is_drv $NIC vmxnet3
check bind-recovered-overrides no_overrides
check bind-recovered-failed wait_status pc failed 10
check bind-recovered-record rec_has pc '"status": "failed"' '"reserved": false' '"vfio": []' \
    'create interrupted by a vmhostd restart'
check bind-recovered-no-qemu qemu_count pc 0
check bind-recovered-no-tap no_tap pc
check bind-recovered-no-run-dir no_run_dir pc
check bind-recovered-no-sockets no_sockets

# The failed record goes; a fresh create of the same VM gets both devices and one QEMU.
check bind-failed-destroyed ctl destroy pc
require fresh-create pt_vm pc
check fresh-running wait_status pc running 10
check fresh-nvme-bound is_drv $NVME vfio-pci
check fresh-vmxnet3-bound is_drv $NIC vfio-pci
check fresh-one-qemu qemu_count pc 1
check fresh-has-tap has_tap pc
# The same find that must come back empty after each crash sees the running VM's sockets.
check fresh-has-sockets sh -c "find '$LAB_RUN' -type s | grep -q '$LAB_RUN/pc/qmp'"

# --- kill -9 after the first device was released (destroy) ----------------------------------
arm vfio:released:1
expect_fail release-crash-destroy-unanswered ctl destroy pc
require release-crash-daemon-died died_at vfio:released:1
reap
check release-crash-sigkill test "$DAEMON_RC" -eq 137
# QEMU was killed before the release; the first device is back, the second still on vfio-pci.
check release-crash-no-qemu qemu_count pc 0
check release-crash-first-back is_drv $NVME nvme
check release-crash-second-held is_drv $NIC vfio-pci
check release-crash-destroying rec_has pc '"status": "destroying"' "\"$NVME\"" "\"$NIC\""
disarm
restart_vmhostd
# The interrupted destroy is finished at start: the record is gone, both devices are back.
check release-recovered-vmxnet3 is_drv $NIC vmxnet3
check release-recovered-nvme is_drv $NVME nvme
check release-recovered-overrides no_overrides
check release-recovered-gone not_listed pc
check release-recovered-no-record no_record pc
check release-recovered-no-qemu qemu_count pc 0
check release-recovered-no-tap no_tap pc
check release-recovered-no-run-dir no_run_dir pc
check release-recovered-no-sockets no_sockets

# And once more from scratch: create, then destroy gives both devices back.
require again-create pt_vm pc
check again-running wait_status pc running 10
check again-nvme-bound is_drv $NVME vfio-pci
check again-vmxnet3-bound is_drv $NIC vfio-pci
check again-one-qemu qemu_count pc 1
check again-destroy ctl destroy pc
check again-back-vmxnet3 is_drv $NIC vmxnet3
check again-back-nvme is_drv $NVME nvme
check again-no-qemu qemu_count pc 0
check again-no-tap no_tap pc
# What the daemon said about the crashes and its recoveries, for the test's output.
grep -E 'crash point reached|restoring passthrough|vfio released|interrupted|after restart' "$LAB_DAEMON_LOG" |
    while read -r _line; do say "DAEMON $_line"; done
finish
