#!/bin/sh
# PID 1 of vmhost-compare's agent guest (tests/guest/build-compare-guest.sh packs it as
# /compare-init; boot with rdinit=/compare-init console=ttyS0). Starts both guest agents on their
# virtio-serial ports, org.vmhost.agent.0 and org.qemu.guest_agent.0, and then prints, once a
# second, each agent's resident set size in KiB as the guest's kernel counts it:
#
#   VMHOST-AGENTS-RSS vmhost-agent.rss=N vmhost-agent.vmrss=N qemu-ga.rss=N qemu-ga.vmrss=N
#
# rss is `Rss:` of /proc/PID/smaps_rollup, which walks the page tables; vmrss is `VmRSS:` of
# /proc/PID/status, which this 6.1 kernel updates from per-thread counters only every 64 page
# faults, so for a process as small as vmhost-agent it can read a few KiB. A value is "gone" once
# its process has exited.
#
# The host reads the line printed after it has had one answer from each agent. A separate init
# rather than the test guest's /init: that one starts vmhost-agent only, and the figures should
# not depend on what else it runs.

export PATH=/sbin:/bin:/usr/sbin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
exec </dev/console >/dev/console 2>&1

for m in virtio_ring virtio virtio_pci virtio_console; do
    modprobe -q "$m" 2>/dev/null
done

# No udev: find the /dev/vportNpM node of a port by its name in sysfs.
port() {
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name" 2>/dev/null)" = "$1" ] && echo "/dev/${p##*/}" && return 0
    done
    return 1
}
n=0
until qga_port=$(port org.qemu.guest_agent.0) && [ -c "$qga_port" ]; do
    n=$((n + 1))
    if [ $n -gt 100 ]; then
        echo "VMHOST-AGENTS-ERROR no virtio-serial port org.qemu.guest_agent.0"
        break
    fi
    sleep 0.1
done

read -r uptime _ </proc/uptime
echo "VMHOST-GUEST-READY $(uname -r) $uptime"

/bin/vmhost-agent &
vmhost_agent=$!
mkdir -p /run/qemu-ga
/usr/sbin/qemu-ga -m virtio-serial -p "$qga_port" -t /run/qemu-ga &
qemu_ga=$!

# kib FILE KEY: the number of the line "KEY:   N kB".
kib() {
    v=$(sed -n "s/^$2:[[:space:]]*\\([0-9]*\\) kB\$/\\1/p" "$1" 2>/dev/null)
    echo "${v:-gone}"
}
rss() {
    echo "$1.rss=$(kib "/proc/$2/smaps_rollup" Rss) $1.vmrss=$(kib "/proc/$2/status" VmRSS)"
}
# PID 1 must not exit; the loop also keeps the report current.
while true; do
    sleep 1
    echo "VMHOST-AGENTS-RSS $(rss vmhost-agent $vmhost_agent) $(rss qemu-ga $qemu_ga)"
done
