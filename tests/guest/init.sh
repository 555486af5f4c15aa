#!/bin/sh
# /init of the vmhost test guest: runs as PID 1 from the initramfs, under busybox sh.
# Boot the kernel with console=ttyS0 so that everything below reaches the serial log.
#
# Console protocol (tests match on these):
#   VMHOST-GUEST-READY <kernel-version> <uptime-seconds>   once, when the guest is up
#   VMHOST-GUEST-POWEROFF                                  ACPI power button pressed
#
# ACPI shutdown: busybox acpid watches the power button (ACPI "button" driver ->
# evdev input device) and runs /etc/acpi/PWRF/00000080, which does `poweroff -f`.
# So QMP `system_powerdown` makes the guest power off and QEMU exit. Verified
# with tests/guest/boot-check.sh (q35, TCG).

export PATH=/sbin:/bin:/usr/sbin:/usr/bin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
# The kernel opened the console on the initramfs's own /dev before devtmpfs
# covered it; reopen so we do not depend on that node existing.
exec </dev/console >/dev/console 2>&1

# No udev here, so nothing loads drivers for the devices found: do it by hand.
# Order matters for the virtio stack (virtio_ring before virtio before the
# transport, transport before the device drivers). modprobe resolves these from
# modules.dep anyway; listing them keeps the order explicit. Missing modules
# (or ones built into a different kernel) are skipped quietly.
for m in virtio_ring virtio virtio_pci virtio_console virtio_net virtio_blk button evdev; do
    modprobe -q "$m" 2>/dev/null
done

# What kmod's static-nodes does on a full system: create the device nodes of
# modules that are not loaded yet (e.g. /dev/net/tun), so that opening one makes
# the kernel load its module on demand. Other modules (dummy, 8021q, bridge)
# load on demand through /sbin/modprobe when a link of their type is created.
while read -r mod node dev; do
    case $mod in '#'*|'') continue ;; esac
    [ -e "/dev/$node" ] && continue
    mkdir -p "/dev/${node%/*}"
    majmin=${dev#?}
    mknod "/dev/$node" "${dev%"$majmin"}" "${majmin%:*}" "${majmin#*:}"
done <"/lib/modules/$(uname -r)/modules.devname"

hostname vmhost-guest
ip link set lo up 2>/dev/null

# acpid opens /dev/input/event* when it starts, so button and evdev must be
# loaded first (done above). It daemonizes itself.
if [ -e /dev/input/event0 ]; then
    acpid -c /etc/acpi -l /run/acpid.log
fi

read -r uptime _ </proc/uptime
echo "VMHOST-GUEST-READY $(uname -r) $uptime"

# The guest agent, when the image was built with one (EXTRA_FILES in build.sh).
# Its output goes to the serial console, next to the kernel's.
if [ -x /bin/vmhost-agent ]; then
    /bin/vmhost-agent &
fi

# PID 1 must never exit (the kernel would panic). There is no console input to
# run a shell on, so just idle; ash's wait also reaps orphans reparented to us.
while true; do
    sleep 3600
done
