#!/bin/sh
# The UEFI live-migration test's guest program (tests/tests/migration.rs), packed as
# /bin/vmhost-agent into initramfs-efivar.cpio.gz (init.sh starts that path twice, once with
# --exec: that one has nothing to do). At boot it says what its UEFI variable VmhostMark holds
# (the boot id of the boot that wrote it, or none); when there is none it writes its own boot
# id into it (into the VM's variables store, through OVMF's runtime services); then it counts
# as migration-counter.sh does:
#   VMHOST-BOOT-ID <boot id>
#   VMHOST-EFIVAR-SEEN <boot id that wrote it | none>
#   VMHOST-EFIVAR-WROTE <boot id>
#   VMHOST-COUNT <boot id> <n>
# A guest restarted after a move must see the variable its boot before the move wrote. (It is
# written once: efivarfs makes a variable of an unknown vendor immutable once it exists, and
# busybox has no chattr.)
[ "$1" = --exec ] && exit 0
boot=$(cat /proc/sys/kernel/random/boot_id)
echo "VMHOST-BOOT-ID $boot"
vars=/sys/firmware/efi/efivars
var=$vars/VmhostMark-5d9c1f3e-6a61-4b0e-9c57-766d686f7374
modprobe -q efivarfs
mount -t efivarfs efivarfs "$vars"
if [ -f "$var" ]; then
    # The first four bytes are the attributes.
    echo "VMHOST-EFIVAR-SEEN $(tail -c +5 "$var")"
else
    echo "VMHOST-EFIVAR-SEEN none"
    # One write (efivarfs takes a variable whole): attributes NON_VOLATILE |
    # BOOTSERVICE_ACCESS | RUNTIME_ACCESS, then the value.
    if { printf '\007\000\000\000'; printf '%s' "$boot"; } | dd of="$var" bs=4096 2>/dev/null; then
        echo "VMHOST-EFIVAR-WROTE $boot"
    else
        echo "VMHOST-EFIVAR-FAILED"
    fi
fi
n=0
while true; do
    echo "VMHOST-COUNT $boot $n"
    n=$((n + 1))
    sleep 0.1
done
