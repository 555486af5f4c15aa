#!/bin/sh
# Packed into a test guest as /bin/vmhost-agent (tests/tests/snapshots.rs builds it with
# tests/guest/build.sh, the real agent beside it as /bin/vmhost-agent-real), so the guest's init
# starts it: it gives the guest file systems on its data disks, then runs the real agent, which
# then has something to freeze. The test guest's own root is its initramfs, which no freeze
# covers.
#
# vmhost.fs=SERIAL:TYPE:DIR on the kernel command line: the virtio disk with that serial (a data
# disk's name) is formatted (TYPE ext4: an ext2 layout by busybox's mke2fs, mounted by the
# kernel's ext4 driver, which freezes it; TYPE vfat: mkdosfs, which the kernel cannot freeze) and
# mounted read-write at DIR; "VMHOST-MOUNTED SERIAL TYPE DIR" (or VMHOST-MOUNT-FAILED) on the
# console says so.
#
# init.sh also starts it with --exec (the exec ports' server, issue 29): that start only runs the
# real agent's exec mode, so the disks are formatted and mounted once.
if [ "${1:-}" = --exec ]; then
    exec /bin/vmhost-agent-real --exec
fi
for m in fat vfat nls_cp437 nls_ascii; do
    modprobe -q "$m" 2>/dev/null
done
for arg in $(cat /proc/cmdline); do
    case $arg in
        vmhost.fs=*:*:*)
            spec=${arg#vmhost.fs=}
            serial=${spec%%:*}
            rest=${spec#*:}
            type=${rest%%:*}
            dir=${rest#*:}
            for dev in /sys/block/vd*; do
                [ "$(cat "$dev/serial" 2>/dev/null)" = "$serial" ] || continue
                node=/dev/${dev##*/}
                case $type in
                    ext4) mke2fs "$node" >/dev/null 2>&1 ;;
                    vfat) mkdosfs "$node" >/dev/null 2>&1 ;;
                esac
                mkdir -p "$dir"
                if mount -t "$type" -o rw "$node" "$dir"; then
                    echo "VMHOST-MOUNTED $serial $type $dir"
                else
                    echo "VMHOST-MOUNT-FAILED $serial $type $dir"
                fi
            done
            ;;
    esac
done
exec /bin/vmhost-agent-real
