#!/bin/bash
# Builds a real distribution guest image for vmhost's tests: a Debian cloud-style qcow2 made
# offline from the distribution's own packages, the way a user's image is made, with the
# project's vmhost-agent package installed.
#
# Usage: tests/guest/build-real-guest.sh DIST OUTDIR AGENT_DEB
#   DIST       bookworm (Debian 12: ifupdown + resolvconf, cloud-init 22.4) or
#              trixie   (Debian 13: netplan + systemd-networkd + systemd-resolved, cloud-init 25)
#   OUTDIR     e.g. target/real-guests
#   AGENT_DEB  the vmhost-agent .deb (packaging/build-debs.sh) installed into the image
#
# Output:
#   OUTDIR/DIST-tree/     the installed root tree (cached: rebuilt only when the package list or
#                         this script's tree recipe changes; delete it to pick up new packages)
#   OUTDIR/DIST.qcow2     a 3 GiB disk: MBR, partition 1 an EFI system partition, partition 2 the
#                         ext4 root; GRUB's BIOS boot code in the MBR and its core image in the
#                         gap after it. The ESP holds Debian's Secure Boot chain as
#                         `grub-install --removable` lays it out: \EFI\BOOT\BOOTX64.EFI is the
#                         Microsoft-signed shim (shim-signed), grubx64.efi beside it the
#                         Debian-signed GRUB (grub-efi-amd64-signed), grub.cfg beside them finds
#                         the root; the kernel is Debian's signed cloud kernel. Boots under
#                         SeaBIOS, OVMF, and OVMF with Secure Boot and Microsoft's keys.
#                         Rebuilt when the tree, the agent package or this script change.
#
# What is in the image: the cloud kernel, systemd, udev, dbus (logind turns the ACPI power
# button into a clean power-off), cloud-init, OpenSSH, GRUB, shim, growpart, the vmhost-agent
# package; in bookworm also a `salt-minion` (Salt 3007 from PyPI in /opt/saltstack/salt, wrapped
# in a local package named salt-minion so cloud-init's salt_minion module finds it installed).
# No apt sources are left in the image (the guests have no internet): a module that installs a
# package finds it installed or fails. machine-id and SSH host keys are left for first boot.
#
# Properties: idempotent; safe to run concurrently (flock OUTDIR/.lock-DIST); outputs are
# written under a temporary name and renamed.
set -euo pipefail

log() { echo "build-real-guest: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -eq 3 ] || die "usage: $0 DIST OUTDIR AGENT_DEB"
dist=$1 outdir=$2 agent_deb=$3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF="$HERE/$(basename "${BASH_SOURCE[0]}")"
[ -f "$agent_deb" ] || die "no agent package at $agent_deb"
agent_deb=$(cd "$(dirname "$agent_deb")" && pwd)/$(basename "$agent_deb")

common="systemd systemd-sysv udev dbus linux-image-cloud-amd64 initramfs-tools cloud-init locales
openssh-server cloud-guest-utils e2fsprogs fdisk grub-pc-bin grub-efi-amd64-bin grub-common
shim-signed grub-efi-amd64-signed iproute2 iputils-ping sudo ca-certificates util-linux"
case $dist in
bookworm) packages="$common ifupdown resolvconf isc-dhcp-client python3-venv" ;;
trixie) packages="$common netplan.io systemd-resolved" ;;
*) die "unknown DIST $dist (bookworm or trixie)" ;;
esac
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

for cmd in debootstrap mkfs.ext4 mkfs.fat mcopy sfdisk qemu-img; do
    command -v "$cmd" >/dev/null || die "$cmd missing (tests/setup.sh installs it)"
done

mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
exec 9>"$outdir/.lock-$dist"
flock 9

tree="$outdir/$dist-tree"
# The tree's key: the recipe between the TREE markers of this script, and the package list.
tree_key=$( (sed -n '/^# TREE-BEGIN/,/^# TREE-END/p' "$SELF"; echo "$dist $packages $mirror") | sha256sum | cut -c1-16)

mounted=()
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
    mounted=()
}
trap cleanup EXIT
bind_mounts() {
    local root=$1
    mount -t proc proc "$root/proc" && mounted+=("$root/proc")
    mount -t sysfs sysfs "$root/sys" && mounted+=("$root/sys")
    mount --bind /dev "$root/dev" && mounted+=("$root/dev")
    mount -t devpts devpts "$root/dev/pts" -o newinstance,ptmxmode=0666 && mounted+=("$root/dev/pts")
}
in_tree() { chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 "${@:2}"; }

# TREE-BEGIN (a change between these markers rebuilds the cached tree)
build_tree() {
    local tmp="$outdir/.$dist-tree.tmp"
    rm -rf "$tmp"
    log "debootstrap $dist (minbase), then apt-get install of the guest's packages"
    # debootstrap only lays the base: its resolver does not follow virtual packages (cloud-init's
    # python3-cryptography needs python3-cffi-backend-api-*), apt inside the tree does.
    debootstrap --variant=minbase "$dist" "$tmp" "$mirror" >"$outdir/.$dist-debootstrap.log" 2>&1 ||
        { tail -n 30 "$outdir/.$dist-debootstrap.log" >&2; die "debootstrap $dist failed"; }
    # Before the kernel's package: initramfs-tools puts fsck into the initramfs for the root
    # file system fstab names (the disk's root is made with this label).
    echo "LABEL=root / ext4 errors=remount-ro 0 1" >"$tmp/etc/fstab"
    # cloud-init's locale module sets en_US.UTF-8, which must exist (as in Debian's images).
    echo "en_US.UTF-8 UTF-8" >"$tmp/etc/locale.gen"
    printf '#!/bin/sh\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d"
    chmod 0755 "$tmp/usr/sbin/policy-rc.d"
    cp /etc/resolv.conf "$tmp/etc/resolv.conf"
    bind_mounts "$tmp"
    # shellcheck disable=SC2086
    in_tree "$tmp" apt-get -q update >/dev/null
    # shellcheck disable=SC2086
    in_tree "$tmp" apt-get -q -y --no-install-recommends install $packages >"$outdir/.$dist-apt.log" 2>&1 ||
        { tail -n 30 "$outdir/.$dist-apt.log" >&2; die "apt-get install in the $dist tree failed"; }
    if [ "$dist" = bookworm ]; then
        log "salt-minion 3007 from PyPI into /opt/saltstack/salt"
        in_tree "$tmp" python3 -m venv /opt/saltstack/salt
        # The host's CA bundle: this machine may reach PyPI through a proxy with its own CA (the
        # variable, not --cert: pip's build-isolation subprocesses read it too).
        cp /etc/ssl/certs/ca-certificates.crt "$tmp/tmp/host-ca.crt"
        in_tree "$tmp" PIP_CERT=/tmp/host-ca.crt /opt/saltstack/salt/bin/pip install -q --disable-pip-version-check \
            "salt==3007.*" >"$outdir/.$dist-pip.log" 2>&1 || { tail -n 30 "$outdir/.$dist-pip.log" >&2; die "pip install salt failed"; }
        rm -f "$tmp/tmp/host-ca.crt"
        # A package named salt-minion owning the unit and the command, as Salt's own packages
        # install them (/opt/saltstack/salt, salt-minion.service).
        local pkg="$tmp/tmp/salt-minion-pkg"
        mkdir -p "$pkg/DEBIAN" "$pkg/usr/bin" "$pkg/lib/systemd/system" "$pkg/etc/salt"
        ln -s /opt/saltstack/salt/bin/salt-minion "$pkg/usr/bin/salt-minion"
        ln -s /opt/saltstack/salt/bin/salt-call "$pkg/usr/bin/salt-call"
        cat >"$pkg/lib/systemd/system/salt-minion.service" <<'EOF'
[Unit]
Description=The Salt Minion
After=network.target

[Service]
Type=notify
NotifyAccess=all
KillMode=process
ExecStart=/opt/saltstack/salt/bin/salt-minion
Restart=on-failure

[Install]
WantedBy=multi-user.target
EOF
        cat >"$pkg/DEBIAN/control" <<'EOF'
Package: salt-minion
Version: 3007.0-0vmhosttest
Architecture: all
Maintainer: vmhost tests <root@localhost>
Description: Salt minion from PyPI in /opt/saltstack/salt (vmhost test image)
EOF
        in_tree "$tmp" dpkg-deb --root-owner-group --build /tmp/salt-minion-pkg /tmp/salt-minion.deb >/dev/null
        in_tree "$tmp" dpkg -i /tmp/salt-minion.deb >/dev/null
        rm -rf "$pkg" "$tmp/tmp/salt-minion.deb"
    fi
    in_tree "$tmp" apt-get clean
    cleanup
    # What an image is made of, not what this machine is: no apt sources (no internet in the
    # guests), no host resolver, an empty machine-id and no SSH host keys (made at first boot).
    rm -f "$tmp/etc/apt/sources.list" "$tmp"/etc/apt/sources.list.d/* "$tmp/usr/sbin/policy-rc.d"
    rm -rf "$tmp"/var/lib/apt/lists/*
    rm -f "$tmp"/etc/ssh/ssh_host_*
    : >"$tmp/etc/machine-id"
    rm -f "$tmp/var/lib/dbus/machine-id"
    if [ "$dist" = bookworm ]; then
        # resolvconf kept the host's resolv.conf (copied in for apt) as its "original" part.
        rm -f "$tmp/etc/resolvconf/resolv.conf.d/original" "$tmp/etc/resolvconf/resolv.conf.d/tail"
        ln -sf ../run/resolvconf/resolv.conf "$tmp/etc/resolv.conf"
        # ifupdown: cloud-init writes interfaces.d/50-cloud-init.
        printf 'auto lo\niface lo inet loopback\n\nsource /etc/network/interfaces.d/*\n' >"$tmp/etc/network/interfaces"
    else
        ln -sf ../run/systemd/resolve/stub-resolv.conf "$tmp/etc/resolv.conf"
    fi
    echo "localhost" >"$tmp/etc/hostname"
    rm -rf "$tree"
    mv "$tmp" "$tree"
    echo "$tree_key" >"$tree/.vmhost-tree-key"
}
# TREE-END

if [ ! -f "$tree/.vmhost-tree-key" ] || [ "$(cat "$tree/.vmhost-tree-key")" != "$tree_key" ]; then
    build_tree
fi

image="$outdir/$dist.qcow2"
# The package by what it holds (its md5sums and control), not its bytes: a rebuilt package of the
# same files has other timestamps.
disk_key=$( (cat "$tree/.vmhost-tree-key" "$SELF"; dpkg-deb -I "$agent_deb" control md5sums) | sha256sum | cut -c1-16)
if [ -f "$image" ] && [ "$(cat "$outdir/.$dist.key" 2>/dev/null)" = "$disk_key" ]; then
    exit 0
fi

log "installing $(basename "$agent_deb") and making $dist.qcow2"
cp "$agent_deb" "$tree/tmp/vmhost-agent.deb"
bind_mounts "$tree"
in_tree "$tree" dpkg -i /tmp/vmhost-agent.deb >/dev/null
cleanup
rm -f "$tree/tmp/vmhost-agent.deb"
[ -L "$tree/etc/systemd/system/multi-user.target.wants/vmhost-agent.service" ] || die "vmhost-agent.service not enabled by its package"
[ -L "$tree/etc/systemd/system/multi-user.target.wants/vmhost-agent-exec.service" ] || die "vmhost-agent-exec.service not enabled by its package"

kver=$(basename "$(ls -d "$tree"/lib/modules/*/ | sort -V | tail -n 1)")
[ -f "$tree/boot/vmlinuz-$kver" ] && [ -f "$tree/boot/initrd.img-$kver" ] || die "no kernel or initrd for $kver in the tree"
root_uuid=$(cat /proc/sys/kernel/random/uuid)
# GRUB reads this file for both firmwares; its embedded early config finds the root by UUID.
mkdir -p "$tree/boot/grub"
cat >"$tree/boot/grub/grub.cfg" <<EOF
set timeout=0
linux /boot/vmlinuz-$kver root=UUID=$root_uuid ro console=tty0 console=ttyS0,115200
initrd /boot/initrd.img-$kver
boot
EOF

work=$(mktemp -d "$outdir/.$dist-disk.XXXXXX")
trap 'cleanup; rm -rf "$work"' EXIT
cat >"$tree/tmp/early.cfg" <<EOF
search --no-floppy --fs-uuid --set=root $root_uuid
set prefix=(\$root)/boot/grub
configfile \$prefix/grub.cfg
EOF
mods="part_msdos ext2 fat search search_fs_uuid normal configfile linux echo test"
# shellcheck disable=SC2086
in_tree "$tree" grub-mkimage -O i386-pc -o /tmp/core.img -p /boot/grub -c /tmp/early.cfg biosdisk $mods
mv "$tree/tmp/core.img" "$work/"
# UEFI boots Debian's signed binaries, never an image made here: a GRUB built by grub-mkimage is
# unsigned and Secure Boot would refuse it. Debian's signed GRUB is monolithic (its modules are
# inside, as lockdown forbids loading more) and reads grub.cfg from the directory it was started
# from when its built-in \EFI\debian does not exist; the early config above is that file.
shim="$tree/usr/lib/shim/shimx64.efi.signed"
grub_efi="$tree/usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed"
[ -f "$shim" ] && [ -f "$grub_efi" ] || die "no signed shim or GRUB in the tree (packages shim-signed, grub-efi-amd64-signed)"
cp "$shim" "$work/BOOTX64.EFI"
cp "$grub_efi" "$work/grubx64.efi"
mv "$tree/tmp/early.cfg" "$work/grub.cfg"

# Layout (512-byte sectors): 0 MBR; 1..2047 GRUB's core image; 2048.. ESP (63 MiB); then root.
size_mib=3072 esp_start=2048 esp_sectors=$((63 * 2048))
root_start=$((esp_start + esp_sectors))
root_sectors=$((size_mib * 2048 - root_start))
[ "$(stat -c %s "$work/core.img")" -le $(((esp_start - 1) * 512)) ] || die "GRUB's core image does not fit the post-MBR gap"

mkfs.fat -F 32 -n ESP -C "$work/esp.img" $((esp_sectors / 2)) >/dev/null
MTOOLS_SKIP_CHECK=1 mmd -i "$work/esp.img" ::/EFI ::/EFI/BOOT
# No fbx64.efi (shim-helpers' fallback): shim started as BOOTX64.EFI would run it to write boot
# entries and reset the VM; without it shim starts grubx64.efi at once.
MTOOLS_SKIP_CHECK=1 mcopy -i "$work/esp.img" "$work/BOOTX64.EFI" "$work/grubx64.efi" "$work/grub.cfg" ::/EFI/BOOT/
mkfs.ext4 -q -F -U "$root_uuid" -L root -d "$tree" -E root_owner=0:0 "$work/root.img" $((root_sectors / 2))k

truncate -s "${size_mib}M" "$work/disk.raw"
sfdisk -q --no-reread --no-tell-kernel "$work/disk.raw" <<EOF
label: dos
start=$esp_start, size=$esp_sectors, type=ef
start=$root_start, size=$root_sectors, type=83, bootable
EOF
# GRUB's boot.img fills the MBR's 440 code bytes (the partition table after them stays); its
# default block list points at sector 1, where the core image goes.
dd if="$tree/usr/lib/grub/i386-pc/boot.img" of="$work/disk.raw" bs=440 count=1 conv=notrunc status=none
dd if="$work/core.img" of="$work/disk.raw" bs=512 seek=1 conv=notrunc status=none
dd if="$work/esp.img" of="$work/disk.raw" bs=512 seek=$esp_start conv=notrunc,sparse status=none
dd if="$work/root.img" of="$work/disk.raw" bs=1M seek=$((root_start / 2048)) conv=notrunc,sparse status=none
qemu-img convert -q -f raw -O qcow2 "$work/disk.raw" "$work/disk.qcow2"
chmod 0644 "$work/disk.qcow2"
mv "$work/disk.qcow2" "$image"
echo "$disk_key" >"$outdir/.$dist.key"
log "$image ready ($(du -h "$image" | cut -f1) allocated)"
