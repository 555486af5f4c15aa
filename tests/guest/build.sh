#!/bin/bash
# Build the guest image used by vmhost's integration tests and the demo:
# Debian's cloud kernel plus a tiny busybox-static initramfs.
#
# Usage: tests/guest/build.sh OUTDIR
#
# Output (see tests/guest/README.md):
#   OUTDIR/vmlinuz               the kernel (boot with console=ttyS0)
#   OUTDIR/kernel-version        e.g. "6.1.0-57-cloud-amd64" (no trailing text)
#   OUTDIR/modules -> kernel-root/lib/modules/VERSION   full module tree, depmod'ed
#   OUTDIR/kernel-root/          the kernel package, unpacked
#   OUTDIR/initramfs.cpio.gz     busybox + modules + /init (tests/guest/init.sh)
#
# Environment:
#   EXTRA_FILES="src:dst src:dst"  extra host files to copy into the initramfs
#                   (dst is an absolute path inside the guest, e.g.
#                   "target/debug/vmhost-agent:/bin/vmhost-agent"). Paths must not
#                   contain spaces or colons. File modes are kept.
#   INITRAMFS_NAME  file name of the initramfs inside OUTDIR (default
#                   initramfs.cpio.gz). Required when EXTRA_FILES is set, so that an
#                   image with extras never replaces the plain cached one.
#   MODULES         kernel modules to put into the initramfs (their dependencies are
#                   added automatically). Default: see DEFAULT_MODULES below.
#
# Properties:
#   - idempotent and cheap when OUTDIR is already complete: the kernel is fetched
#     once, and an initramfs is only rebuilt when its inputs (this script, init.sh,
#     the module list, the extra files' names and contents) change;
#   - safe to run concurrently for the same OUTDIR (flock on OUTDIR/.lock);
#   - outputs are written to a temporary name and renamed, so a QEMU started by
#     someone not holding the lock never sees a half-written file.
# To pick up a newer kernel from the archive, delete OUTDIR.
set -euo pipefail

# virtio_*: devices the daemon gives its VMs (console = agent channel, net, disk).
# 8021q, bridge, tun, dummy: needed when the guest acts as a "lab host" for the
# network tests (the host kernel here lacks VLANs, VLAN filtering and dummy links).
# vfio_pci, vfio_iommu_type1: same, for the VFIO lab.
# button, evdev: ACPI power button -> input event, so busybox acpid can power off.
# vfat (with fat), nls_*: mounting a cloud-init seed (init.sh prints its user-data); the
# kernel's FAT defaults are codepage 437 and iocharset ascii (utf8 on), hence cp437 and ascii.
DEFAULT_MODULES="virtio_pci virtio_console virtio_net virtio_blk 8021q bridge tun dummy
vfio_pci vfio_iommu_type1 button evdev vfat nls_cp437 nls_ascii nls_iso8859-1 nls_utf8"

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF="$HERE/$(basename "${BASH_SOURCE[0]}")"
INIT_SH="$HERE/init.sh"

log() { echo "guest/build.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -eq 1 ] || die "usage: $0 OUTDIR"
MODULES=${MODULES:-$DEFAULT_MODULES}
EXTRA_FILES=${EXTRA_FILES:-}
INITRAMFS_NAME=${INITRAMFS_NAME:-initramfs.cpio.gz}
case $INITRAMFS_NAME in */*|.*|'') die "INITRAMFS_NAME must be a plain file name" ;; esac
if [ -n "$EXTRA_FILES" ] && [ "$INITRAMFS_NAME" = initramfs.cpio.gz ]; then
    die "EXTRA_FILES is set: also set INITRAMFS_NAME so the default image is not replaced"
fi

# Wait for a dpkg/apt lock held by someone else instead of failing at once.
APT_OPTS=(-o DPkg::Lock::Timeout=300 -o APT::Sandbox::User=root -q)
export DEBIAN_FRONTEND=noninteractive
APT_UPDATED=
apt_update_once() {
    [ -n "$APT_UPDATED" ] && return 0
    log "apt-get update"
    apt-get "${APT_OPTS[@]}" update >&2
    APT_UPDATED=1
}

# --- host tools ---------------------------------------------------------------
# Only touch apt when something is missing: apt is slow and may be locked.
ensure_tools() {
    local missing=()
    command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
    # The initramfs needs the *static* busybox: the dynamic one (package
    # "busybox") would need a libc inside the guest.
    [ "$(dpkg-query -W -f='${Status}' busybox-static 2>/dev/null)" = "install ok installed" ] \
        || missing+=(busybox-static)
    command -v cpio >/dev/null || missing+=(cpio)
    { command -v depmod && command -v modprobe; } >/dev/null || missing+=(kmod)
    command -v socat >/dev/null || missing+=(socat)
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing ${missing[*]}"
    apt_update_once
    # QEMU and qemu-utils from the release itself, as a pair (see tests/setup.sh): a preinstalled
    # qemu-utils backport would otherwise block QEMU 7.2 or be removed, and qemu-img is gone.
    local codename
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
    apt-get "${APT_OPTS[@]}" install -y --allow-downgrades "qemu-system-x86/$codename" "qemu-utils/$codename" \
        busybox-static cpio kmod socat >&2
}

# apt-get download needs package lists; on a fresh machine there are none yet.
apt_download() {
    apt-get "${APT_OPTS[@]}" download "$@" >&2 && return 0
    apt_update_once
    apt-get "${APT_OPTS[@]}" download "$@" >&2
}

ensure_tools

mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
exec 9>"$OUTDIR/.lock"
flock 9

# --- kernel -------------------------------------------------------------------
# kernel-version is written last, so its presence means the kernel step finished.
build_kernel() {
    local work meta pkg deb version
    work=$(mktemp -d "$OUTDIR/.kernel.XXXXXX")
    (
        cd "$work"
        # The metapackage only exists to depend on the current ABI's package;
        # its Depends names the real one, e.g. linux-image-6.1.0-57-cloud-amd64.
        apt_download linux-image-cloud-amd64
        meta=$(ls linux-image-cloud-amd64_*.deb)
        pkg=$(dpkg-deb -f "$meta" Depends | tr ',|' '\n' | sed 's/(.*//; s/ //g' \
              | grep -m1 '^linux-image-[0-9].*-cloud-amd64$') \
            || die "no linux-image-*-cloud-amd64 in Depends of $meta"
        log "kernel package: $pkg"
        apt_download "$pkg"
        deb=$(ls "${pkg}"_*.deb)
        dpkg -x "$deb" root
    )
    version=$(ls "$work/root/lib/modules")
    if [ -z "$version" ] || [ "$(echo "$version" | wc -l)" -ne 1 ]; then
        die "expected exactly one module tree, found: $version"
    fi
    [ -f "$work/root/boot/vmlinuz-$version" ] || die "no vmlinuz-$version in package"
    # modules.dep etc. are generated by the package's postinst, which dpkg -x skips.
    depmod -b "$work/root" "$version"

    rm -rf "$OUTDIR/kernel-root"
    mv "$work/root" "$OUTDIR/kernel-root"
    rm -rf "$work"
    cp "$OUTDIR/kernel-root/boot/vmlinuz-$version" "$OUTDIR/vmlinuz.tmp"
    mv "$OUTDIR/vmlinuz.tmp" "$OUTDIR/vmlinuz"
    ln -sfn "kernel-root/lib/modules/$version" "$OUTDIR/modules"
    echo "$version" >"$OUTDIR/kernel-version.tmp"
    mv "$OUTDIR/kernel-version.tmp" "$OUTDIR/kernel-version"
    log "kernel $version ready"
}

if [ -s "$OUTDIR/kernel-version" ] && [ -f "$OUTDIR/vmlinuz" ] &&
   [ -f "$OUTDIR/modules/modules.dep" ]; then
    :
else
    # Clean up after an interrupted earlier run.
    rm -rf "$OUTDIR"/.kernel.* "$OUTDIR/kernel-version"
    build_kernel
fi
VERSION=$(cat "$OUTDIR/kernel-version")

# --- initramfs ----------------------------------------------------------------
TARGET="$OUTDIR/$INITRAMFS_NAME"
STAMP="$OUTDIR/.$INITRAMFS_NAME.inputs"

# A digest of everything the image is made from. Contents are hashed rather than
# compared by mtime so that rebuilding the agent with identical output, or a
# fresh checkout, does not force a rebuild, while any real change does.
inputs_digest() {
    local spec
    {
        echo "kernel $VERSION"
        echo "modules $MODULES"
        echo "busybox $(sha256sum </bin/busybox)"
        echo "build.sh $(sha256sum <"$SELF")"
        echo "init.sh $(sha256sum <"$INIT_SH")"
        for spec in $EXTRA_FILES; do
            [ -f "${spec%%:*}" ] || die "EXTRA_FILES: no such file: ${spec%%:*}"
            echo "extra $spec $(stat -c %a "${spec%%:*}") $(sha256sum <"${spec%%:*}")"
        done
    } | sha256sum | cut -d' ' -f1
}

DIGEST=$(inputs_digest)
if [ -f "$TARGET" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$DIGEST" ]; then
    log "$TARGET is up to date"
    exit 0
fi

STAGE=$(mktemp -d "$OUTDIR/.stage.XXXXXX")
trap 'rm -rf "$STAGE" "$TARGET.tmp"' EXIT

mkdir -p "$STAGE"/{bin,sbin,usr/bin,usr/sbin,dev,proc,sys,run,tmp,root,var/log,etc/acpi/PWRF}
chmod 1777 "$STAGE/tmp"

# busybox with one symlink per applet, made here rather than with
# "busybox --install" at boot: the kernel needs /bin/sh for /init's shebang, and
# every boot under TCG would pay for creating ~270 links.
cp /bin/busybox "$STAGE/bin/busybox"
busybox --list-full | while read -r applet; do
    case $applet in bin/busybox|linuxrc) continue ;; esac
    mkdir -p "$STAGE/$(dirname "$applet")"
    ln -sf /bin/busybox "$STAGE/$applet"
done

# Kernel modules: resolve each requested module to itself plus its dependencies
# with the host's modprobe run against the unpacked tree (-C /dev/null: ignore the
# host's modprobe.d). Built-in modules print "builtin NAME" and need no file.
MODDIR="lib/modules/$VERSION"
mkdir -p "$STAGE/$MODDIR"
for m in $MODULES; do
    modprobe -C /dev/null -d "$OUTDIR/kernel-root" -S "$VERSION" --show-depends "$m" \
        || die "module $m not found in $VERSION"
done | while read -r kind path _; do
    case $kind in
    builtin) log "module $path is built into the kernel" ; continue ;;
    insmod) ;;
    *) die "unexpected modprobe output: $kind $path" ;;
    esac
    rel=${path#"$OUTDIR/kernel-root/$MODDIR/"}
    dst="$STAGE/$MODDIR/${rel%.ko*}.ko"
    [ -f "$dst" ] && continue
    mkdir -p "$(dirname "$dst")"
    # Busybox modprobe cannot read compressed modules; this package ships plain
    # .ko files, but other kernel builds may not.
    case $path in
    *.ko) cp "$path" "$dst" ;;
    *.ko.xz) xz -dc "$path" >"$dst" ;;
    *.ko.zst) zstd -qdc "$path" >"$dst" ;;
    *.ko.gz) gzip -dc "$path" >"$dst" ;;
    *) die "unknown module file type: $path" ;;
    esac
done
# modules.builtin lets modprobe treat built-in names as present; then regenerate
# modules.dep & co. for exactly the subset we copied.
cp "$OUTDIR/kernel-root/$MODDIR"/modules.{builtin,builtin.modinfo,order} "$STAGE/$MODDIR/"
depmod -b "$STAGE" "$VERSION"
log "modules: $(find "$STAGE/$MODDIR" -name '*.ko' -printf '%f\n' | sed 's/\.ko$//' | sort | tr '\n' ' ')"

# ACPI power button -> power off. Busybox acpid maps the power button's input
# event to the action "PWRF/00000080" and runs /etc/acpi/PWRF/00000080.
# poweroff -f: a plain poweroff would signal PID 1, which is our shell script.
cat >"$STAGE/etc/acpi/PWRF/00000080" <<'EOF'
#!/bin/sh
echo "VMHOST-GUEST-POWEROFF" >/dev/console
sync
poweroff -f
EOF
chmod 755 "$STAGE/etc/acpi/PWRF/00000080"

# udhcpc hook for ip=<dev>:dhcp: configure what the DHCP server offered.
cat >"$STAGE/etc/udhcpc.script" <<'EOF'
#!/bin/sh
case $1 in
    bound|renew)
        ip addr flush dev "$interface"
        ip addr add "$ip/${mask:-24}" dev "$interface"
        [ -n "$router" ] && ip route replace default via "${router%% *}" dev "$interface"
        for d in $dns; do echo "nameserver $d" >>/etc/resolv.conf; done
        ;;
esac
exit 0
EOF
chmod 755 "$STAGE/etc/udhcpc.script"

install -m 755 "$INIT_SH" "$STAGE/init"

for spec in $EXTRA_FILES; do
    src=${spec%%:*} dst=${spec#*:}
    case $dst in /*) ;; *) die "EXTRA_FILES: destination must be absolute: $spec" ;; esac
    mkdir -p "$STAGE$(dirname "$dst")"
    cp -L --preserve=mode "$src" "$STAGE$dst"
done

# newc is the only cpio format the kernel unpacks. Everything owned by root; a
# sorted list and --reproducible make identical inputs give identical images.
(cd "$STAGE" && find . -mindepth 1 -print0 | LC_ALL=C sort -z \
    | cpio --null -o -H newc -R 0:0 --reproducible --quiet) | gzip -9n >"$TARGET.tmp"
mv "$TARGET.tmp" "$TARGET"
echo "$DIGEST" >"$STAMP"
log "built $TARGET ($(du -h "$TARGET" | cut -f1))"
