#!/bin/sh
# /init of the vmhost lab host: PID 1 of a QEMU/TCG VM running Debian's cloud kernel.
# It prepares the system, fetches the scenario from fw_cfg, runs it and powers off.
#
# Console protocol (ttyS0; tests/src/lab.rs matches on these):
#   LAB-INIT <uptime>                 init started (kernel boot finished)
#   LAB-SCENARIO-START <uptime>       modules loaded, scenario about to run
#   LAB-RESULT PASS                   printed once, last, by `finish` (lib.sh)
#   LAB-RESULT FAIL <reason>          likewise; also printed here when the scenario is
#                                     missing, exits without `finish`, or overruns
#                                     lab.timeout=SECONDS (kernel command line)
# After LAB-RESULT the lab powers off (poweroff -f), so QEMU exits.
#
# The scenario is a busybox sh script passed by the host as
#   -fw_cfg name=opt/vmhost/scenario,file=PATH
# and read from /sys/firmware/qemu_fw_cfg/by_name/opt/vmhost/scenario/raw (module
# qemu_fw_cfg, CONFIG_FW_CFG_SYSFS=m in the cloud kernel). Further host files may be
# passed the same way as opt/vmhost/files/NAME; they are copied to /lab/files/NAME.

export PATH=/usr/local/sbin:/usr/local/bin:/sbin:/bin:/usr/sbin:/usr/bin
export HOME=/root

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
exec </dev/console >/dev/console 2>&1

uptime_s() { read -r u _ </proc/uptime; echo "$u"; }
echo "LAB-INIT $(uptime_s)"

lab_poweroff() {
    # Give the UART time to drain the last lines before the machine goes away.
    sync
    sleep 1
    poweroff -f
}

# The virtio stack first (ring -> virtio -> transport -> drivers), then fw_cfg for the
# scenario, then what vmhostd and the tests need. vfio_pci etc. load fine without an
# IOMMU; they only matter when the lab runs with intel-iommu (lab.rs extra args).
for m in virtio_ring virtio virtio_pci virtio_console virtio_net virtio_blk button evdev \
         qemu_fw_cfg tun bridge 8021q dummy vfio vfio_iommu_type1 vfio_pci vmxnet3; do
    # numdummies=0: no stray dummy0; a scenario creates the links it wants.
    case $m in dummy) set -- numdummies=0 ;; *) set -- ;; esac
    modprobe -q "$m" "$@" 2>/dev/null || echo "lab-init: module $m not loaded"
done
# Extra modules named on the command line: lab.modules=a,b,c
# shellcheck disable=SC2013  # words, not lines
for arg in $(cat /proc/cmdline); do
    case $arg in
    lab.modules=*)
        for m in $(echo "${arg#lab.modules=}" | tr ',' ' '); do
            modprobe "$m" || echo "lab-init: module $m not loaded"
        done ;;
    lab.timeout=*) LAB_TIMEOUT=${arg#lab.timeout=} ;;
    esac
done

# Device nodes of modules that are not loaded (kmod static-nodes), as the guest's init does.
while read -r mod node dev; do
    case $mod in '#'*|'') continue ;; esac
    [ -e "/dev/$node" ] && continue
    mkdir -p "/dev/${node%/*}"
    majmin=${dev#?}
    mknod "/dev/$node" "${dev%"$majmin"}" "${majmin%:*}" "${majmin#*:}"
done <"/lib/modules/$(uname -r)/modules.devname"

hostname vmhost-lab
ip link set lo up 2>/dev/null
# VFIO pins all guest memory; nested QEMUs inherit this from vmhostd.
# shellcheck disable=SC3045  # busybox ash has ulimit -l
ulimit -l unlimited 2>/dev/null
mkdir -p /lab/files /var/lib /var/log

FWCFG=/sys/firmware/qemu_fw_cfg/by_name/opt/vmhost
if [ ! -r "$FWCFG/scenario/raw" ]; then
    echo "LAB-RESULT FAIL no scenario: $FWCFG/scenario/raw missing (run the lab with -fw_cfg name=opt/vmhost/scenario,file=...)"
    lab_poweroff
fi
cat "$FWCFG/scenario/raw" >/lab/scenario.sh
if [ -d "$FWCFG/files" ]; then
    for f in "$FWCFG"/files/*/raw; do
        [ -e "$f" ] || continue
        name=${f%/raw}
        cat "$f" >"/lab/files/${name##*/}"
    done
fi

# Watchdog: a scenario that hangs still ends with a LAB-RESULT line and a powered-off
# machine, well before the host's own timeout kills QEMU.
if [ -n "${LAB_TIMEOUT:-}" ]; then
    (
        sleep "$LAB_TIMEOUT"
        echo "LAB-RESULT FAIL lab timeout: scenario still running after ${LAB_TIMEOUT}s"
        lab_poweroff
    ) &
fi

echo "LAB-SCENARIO-START $(uptime_s)"
(cd /tmp && exec sh /lab/scenario.sh) &
scenario=$!
# wait returns when the scenario exits; PID 1's wait also reaps reparented orphans
# (nested QEMUs are daemonized and their parent is vmhostd, so that matters little).
wait "$scenario"
rc=$?
# `finish` powers off and never returns; reaching this line means it was not called.
echo "LAB-RESULT FAIL scenario exited with status $rc without calling finish"
lab_poweroff
# PID 1 must never exit.
while true; do sleep 3600; done
