#!/bin/sh
# /init of the vmhost test guest: runs as PID 1 from the initramfs, under busybox sh.
# Boot the kernel with console=ttyS0 so that everything below reaches the serial log.
#
# Console protocol (tests match on these):
#   VMHOST-TPM absent|present reset_count=<n>              once, before FIRMWARE (below)
#   VMHOST-FIRMWARE efi|bios                               once, just before READY: how it booted
#   VMHOST-SECUREBOOT 0|1                                  after it, UEFI with efivarfs only: Secure Boot
#   VMHOST-GUEST-READY <kernel-version> <uptime-seconds>   once, when the guest is up
#   VMHOST-GUEST-POWEROFF                                  ACPI power button pressed
#   VMHOST-GUEST-SELF-POWEROFF                             powering off on its own (vmhost.poweroff)
# With vmhost.shell on the kernel command line, an interactive shell runs on ttyS0.
#   VMHOST-WROTE <serial> <word>, VMHOST-DISK ...         vmhost.writemark, vmhost.disks (below)
#   VMHOST-USERDATA-BEGIN <dev>                            a cloud-init seed's user-data (below)
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
# A task stuck in the kernel is reported (with its stack) after 5 s rather than 120 s.
echo 5 >/proc/sys/kernel/hung_task_timeout_secs 2>/dev/null || true
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
# Test hook: vmhost.noacpi makes a guest that ignores the power button, as many
# real ones do, so tests can exercise the stop timeout and the kill.
if [ -e /dev/input/event0 ] && ! grep -qw vmhost.noacpi /proc/cmdline; then
    acpid -c /etc/acpi -l /run/acpid.log
fi

# Guest addresses. The cloud kernel has no CONFIG_IP_PNP, so an ip= parameter
# (dracut/klibc syntax, as vmhostd writes it for direct-kernel VMs) is applied
# here: ip=<client>::<gateway>:<netmask>:<hostname>:<device>:off:<dns0>:<dns1>
# or ip=<device>:dhcp.
mask2prefix() {
    prefix=0
    for octet in $(echo "$1" | tr . ' '); do
        case $octet in
            255) prefix=$((prefix + 8)) ;; 254) prefix=$((prefix + 7)) ;;
            252) prefix=$((prefix + 6)) ;; 248) prefix=$((prefix + 5)) ;;
            240) prefix=$((prefix + 4)) ;; 224) prefix=$((prefix + 3)) ;;
            192) prefix=$((prefix + 2)) ;; 128) prefix=$((prefix + 1)) ;;
        esac
    done
    echo "$prefix"
}
apply_ip() {
    old_ifs=$IFS
    IFS=:
    # shellcheck disable=SC2086 # splitting on ':' is the point
    set -- $1
    IFS=$old_ifs
    if [ "${2:-}" = dhcp ]; then
        ip link set "$1" up
        udhcpc -i "$1" -q -n -t 5 -s /etc/udhcpc.script >/dev/null 2>&1 &&
            echo "VMHOST-IP $1 dhcp" || echo "VMHOST-IP $1 dhcp-failed"
        return
    fi
    client=$1 gw=$3 mask=$4 name=$5 dev=$6 dns0=${8:-} dns1=${9:-}
    [ -n "$name" ] && hostname "$name"
    ip link set "$dev" up
    ip addr add "$client/$(mask2prefix "$mask")" dev "$dev"
    [ -n "$gw" ] && ip route add default via "$gw" dev "$dev"
    for d in $dns0 $dns1; do echo "nameserver $d" >>/etc/resolv.conf; done
    echo "VMHOST-IP $dev $client/$(mask2prefix "$mask") gw=${gw:-none}"
}
ping_targets=""
# Test hook: vmhost.skipip leaves the declared addresses unapplied, a guest whose network is
# not what the host declared (vm.check must say so).
skip_ip=0
grep -qw vmhost.skipip /proc/cmdline && skip_ip=1
for arg in $(cat /proc/cmdline); do
    case $arg in
        ip=*) [ "$skip_ip" = 1 ] || apply_ip "${arg#ip=}" ;;
        vmhost.ping=*) ping_targets=$(echo "${arg#vmhost.ping=}" | tr , ' ') ;;
        vmhost.dns_search=*) [ "$skip_ip" = 1 ] || echo "search $(echo "${arg#vmhost.dns_search=}" | tr , ' ')" >>/etc/resolv.conf ;;
    esac
done

# A TPM (the VM's `tpm: true`, swtpm on the host): the cloud kernel has tpm_crb and tpm_tis built
# in, so /dev/tpm0 is there when QEMU gave the guest one. Reported once, before READY:
#   VMHOST-TPM absent
#   VMHOST-TPM present reset_count=<n>
# reset_count is the TPM's resetCount (TPM2_ReadClock, no authorisation needed): the TPM keeps it
# in its persistent state and adds one at every TPM reset (each boot), so a second boot of the
# same VM shows a larger count only when the host kept the TPM's state; a new state starts at 1.
# (printf writes the 10-byte command in one write; the answer is read on the same descriptor.)
if [ -e /dev/tpm0 ]; then
    exec 3<>/dev/tpm0
    printf '\200\001\000\000\000\012\000\000\001\201' >&3
    answer=$(dd bs=64 count=1 <&3 2>/dev/null | od -An -v -tx1 | tr -d ' \n')
    exec 3<&-
    # Header (tag, size, response code: 10 bytes), time (8), clock (8), then resetCount (4).
    rc=$(echo "$answer" | cut -c13-20)
    count=$(echo "$answer" | cut -c53-60)
    if [ "$rc" = 00000000 ] && [ ${#count} = 8 ]; then
        echo "VMHOST-TPM present reset_count=$((0x$count))"
    else
        echo "VMHOST-TPM present reset_count=unreadable answer=$answer"
    fi
else
    echo "VMHOST-TPM absent"
fi

# The kernel has /sys/firmware/efi only when UEFI firmware (OVMF) started it through its EFI
# stub; under SeaBIOS it was loaded the legacy way (boot.firmware, docs/images.md).
if [ -d /sys/firmware/efi ]; then echo "VMHOST-FIRMWARE efi"; else echo "VMHOST-FIRMWARE bios"; fi
# Under UEFI, with efivarfs in the image: what the firmware says of Secure Boot, the value byte
# of its SecureBoot variable (after four bytes of attributes). Unmounted again, so a program that
# mounts efivarfs itself finds it as before.
if [ -d /sys/firmware/efi ] && modprobe -q efivarfs 2>/dev/null &&
    mount -t efivarfs efivarfs /sys/firmware/efi/efivars 2>/dev/null; then
    sb=/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c
    [ -f "$sb" ] && echo "VMHOST-SECUREBOOT $(od -An -tu1 "$sb" | awk '{ v = $NF } END { print v }')"
    umount /sys/firmware/efi/efivars
fi
read -r uptime _ </proc/uptime
echo "VMHOST-GUEST-READY $(uname -r) $uptime"
# Test hook: vmhost.poweroff makes a guest that powers itself off once it is up (a guest-initiated
# shutdown, which the restart policy tells apart from a crash).
if grep -qw vmhost.poweroff /proc/cmdline; then
    echo "VMHOST-GUEST-SELF-POWEROFF"
    poweroff -f
fi

# cloud-init seeds: each virtio disk whose FAT volume label is CIDATA (the NoCloud seed vmhostd
# attaches to an image-booted VM, or a direct-kernel VM with user_data) is mounted read-only and
# its user-data printed, every line behind a prefix so that no line of it can pass for a marker:
#   VMHOST-USERDATA-BEGIN <dev>
#   VMHOST-USERDATA| <line>                                  one per line of the file, as it is
#   VMHOST-USERDATA-END <dev> bytes=<size> newline=yes|no    newline: the file ends with one
# (VMHOST-USERDATA-NONE <dev> when the volume has no user-data, -NOMOUNT when it cannot be
# mounted). The label is read from the boot sector (FAT12/16 at byte 43, FAT32 at 71) rather than
# by mounting, so no other disk (the storage tests' data disks) is ever mounted; the FAT modules
# are loaded only when a seed is there.
fat_label() {
    for offset in 43 71; do
        dd if="$1" bs=1 skip=$offset count=11 2>/dev/null | tr -d ' ' | tr a-z A-Z
        echo
    done
}
print_user_data() {
    file=$1
    while IFS= read -r line || [ -n "$line" ]; do
        printf 'VMHOST-USERDATA| %s\n' "$line"
    done <"$file"
    newline=no
    [ "$(tail -c 1 "$file" | wc -l)" = 1 ] && newline=yes
    echo "VMHOST-USERDATA-END $2 bytes=$(wc -c <"$file") newline=$newline"
}
for dev in /sys/block/vd*; do
    [ -e "$dev" ] || continue
    dev=${dev##*/}
    fat_label "/dev/$dev" | grep -qx CIDATA || continue
    for m in fat vfat nls_cp437 nls_ascii nls_iso8859-1 nls_utf8; do
        modprobe -q "$m" 2>/dev/null
    done
    mkdir -p "/run/seed-$dev"
    if ! mount -t vfat -o ro "/dev/$dev" "/run/seed-$dev"; then
        echo "VMHOST-USERDATA-NOMOUNT $dev"
        continue
    fi
    if [ -f "/run/seed-$dev/user-data" ]; then
        echo "VMHOST-USERDATA-BEGIN $dev"
        print_user_data "/run/seed-$dev/user-data" "$dev"
    else
        echo "VMHOST-USERDATA-NONE $dev"
    fi
    umount "/run/seed-$dev"
done

# Test hook: vmhost.ping=A,B,... pings each address (up to 60 tries, the peers
# may still be booting) and reports VMHOST-PING <addr> ok|fail on the console.
for target in $ping_targets; do
    (
        n=0
        while [ $n -lt 60 ]; do
            if ping -c 1 -W 1 "$target" >/dev/null 2>&1; then
                echo "VMHOST-PING $target ok"
                exit 0
            fi
            n=$((n + 1))
        done
        echo "VMHOST-PING $target fail"
    ) &
done

# Test hook: vmhost.writemark=SERIAL:WORD writes "VMHOSTMARK:WORD" at the start of the virtio
# disk with that serial (a data disk's name); vmhost.disks then reports every virtio disk as
#   VMHOST-DISK <dev> serial=<serial> sectors=<512-byte sectors> mark=<marker or ->
# and then VMHOST-DISKS-DONE, then VMHOST-DISK-SIZES <dev>=<sectors> ... at every later change,
# so the storage tests see what the guest sees: order, serials, sizes and what survived.
for arg in $(cat /proc/cmdline); do
    case $arg in
        vmhost.writemark=*:*)
            want=${arg#vmhost.writemark=}
            for dev in /sys/block/vd*; do
                [ "$(cat "$dev/serial" 2>/dev/null)" = "${want%%:*}" ] || continue
                printf 'VMHOSTMARK:%s\n' "${want#*:}" | dd of="/dev/${dev##*/}" bs=512 conv=sync,notrunc,fsync 2>/dev/null &&
                    echo "VMHOST-WROTE ${want%%:*} ${want#*:}"
            done
            ;;
    esac
done
if grep -qw vmhost.disks /proc/cmdline; then
    for dev in /sys/block/vd*; do
        [ -e "$dev" ] || continue
        mark=$(dd if="/dev/${dev##*/}" bs=512 count=1 2>/dev/null | head -n 1 | tr -cd 'A-Za-z0-9:._-')
        case $mark in VMHOSTMARK:*) mark=${mark#VMHOSTMARK:} ;; *) mark=- ;; esac
        echo "VMHOST-DISK ${dev##*/} serial=$(cat "$dev/serial" 2>/dev/null) sectors=$(cat "$dev/size") mark=$mark"
    done
    # Then a watch: every change of the disks (a live grow, a hot-plug, an unplug) is reported
    # as it happens: VMHOST-DISK-SIZES with every disk's size, and VMHOST-DISK-ADDED <dev>
    # serial=<serial> or VMHOST-DISK-REMOVED <dev> for a disk that came or went. A disk is known
    # by its name and its PCI path (another slot for a hot-plugged disk), so an unplug and a
    # hot-plug between two looks that reuse a name are both seen. What it compares against is
    # taken before VMHOST-DISKS-DONE: a test acts on the disks as soon as it reads that line.
    disk_ids() {
        for dev in /sys/block/vd*; do
            [ -e "$dev" ] && printf ' %s@%s' "${dev##*/}" "$(readlink -f "$dev" | tr ' ' _)"
        done
    }
    disk_sizes() {
        for dev in /sys/block/vd*; do
            [ -e "$dev" ] && printf ' %s=%s' "${dev##*/}" "$(cat "$dev/size")"
        done
    }
    known=" $(disk_ids) " sizes=$(disk_sizes)
    echo "VMHOST-DISKS-DONE"
    (
        # Through the kernel's log (level 2, shown despite `quiet`): each report is one record,
        # never split by other console output.
        exec >/dev/kmsg
        say() { printf '<2>%s\n' "$*"; }
        while true; do
            now=$(disk_sizes)
            ids=" $(disk_ids) "
            if [ "$ids" != "$known" ]; then
                for id in $known; do
                    case $ids in *" $id "*) ;; *) say "VMHOST-DISK-REMOVED ${id%@*}" ;; esac
                done
                for id in $ids; do
                    case $known in
                        *" $id "*) ;;
                        *) say "VMHOST-DISK-ADDED ${id%@*} serial=$(cat "/sys/block/${id%@*}/serial" 2>/dev/null)" ;;
                    esac
                done
                known=$ids
            fi
            if [ "$now" != "$sizes" ]; then
                say "VMHOST-DISK-SIZES$now"
            fi
            sizes=$now
            sleep 0.5
        done
    ) &
fi

# Test hook: vmhost.shell runs an interactive shell on the serial console, as many real guests
# run a getty there (the console tests type into it through vmhostd). setsid gives it ttyS0 as
# its controlling terminal; it is started again when it exits.
if grep -qw vmhost.shell /proc/cmdline; then
    (
        while true; do
            setsid sh -c 'exec sh -i </dev/ttyS0 >/dev/ttyS0 2>&1'
        done
    ) &
fi

# The guest agent, when the image was built with one (EXTRA_FILES in build.sh), and the same
# binary's exec-port server (commands, files, clock, shutdown, SSH keys: issue 29), as a real
# guest runs them under vmhost-agent.service and vmhost-agent-exec.service. A hostile stand-in
# packed as /bin/vmhost-agent is started both ways too (tests/guest/hostile/).
# Their output goes to the serial console, next to the kernel's.
if [ -x /bin/vmhost-agent ]; then
    /bin/vmhost-agent &
    /bin/vmhost-agent --exec &
fi

# PID 1 must never exit (the kernel would panic). Console input goes to the
# vmhost.shell shell, if any, so just idle; ash's wait also reaps orphans reparented to us.
while true; do
    sleep 3600
done
