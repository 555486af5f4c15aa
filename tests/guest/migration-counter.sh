#!/bin/sh
# The migration tests' guest program (tests/tests/migration.rs), packed as /bin/vmhost-agent into
# initramfs-counter.cpio.gz so the test guest's init starts it (init.sh starts that path twice,
# once with --exec: that one has nothing to do). It prints the boot id once, then a counter every
# 100 ms, each line carrying the boot id: a migrated guest's console must go on from where it was
# with the same boot id, and the longest gap between two lines is the downtime the guest saw.
#   VMHOST-BOOT-ID <boot id>
#   VMHOST-COUNT <boot id> <n>
[ "$1" = --exec ] && exit 0
boot=$(cat /proc/sys/kernel/random/boot_id)
echo "VMHOST-BOOT-ID $boot"
n=0
while true; do
    echo "VMHOST-COUNT $boot $n"
    n=$((n + 1))
    sleep 0.1
done
