#!/bin/bash
# Build the vmhost "lab host": Debian's cloud kernel plus an initramfs that holds
# busybox, the kernel modules, QEMU (with every shared library and runtime file it
# needs), vmhostd, vmhostctl, iproute2 and the test guest for nested VMs. Booted under
# QEMU/TCG it runs a scenario script (fw_cfg) and reports on its serial console; see
# tests/lab/README.md.
#
# Usage: tests/lab/build-lab.sh OUTDIR
#
# Output:
#   OUTDIR/vmlinuz                the lab kernel (same as the test guest's)
#   OUTDIR/initramfs-lab.cpio     uncompressed: the base layer (busybox + modules,
#                                 built by tests/guest/build.sh) followed by the lab
#                                 layer; the kernel unpacks concatenated archives in
#                                 order, so the lab layer's /init replaces the guest's
#   OUTDIR/kernel-version
#   OUTDIR/.lab.inputs            digest of the inputs; rebuilt only when it changes
#   OUTDIR/.lock                  flock target
#
# Environment:
#   GUEST_DIR        test guest build dir (default: REPO/target/guest); must differ
#                    from OUTDIR. The lab reuses its kernel and module tree and boots
#                    its initramfs.cpio.gz as the nested VMs' guest.
#   VMHOST_BIN_DIR   where vmhostd and vmhostctl are (default: REPO/target/debug).
#   LAB_EXTRA_FILES  "src:dst src:dst": more host files for the lab (ELF files get
#                    their shared libraries too). No spaces or colons in paths.
#   LAB_EXTRA_MODULES  more kernel modules to put in (loaded with lab.modules=a,b).
#
# Idempotent (about 2 s when nothing changed: it hashes its inputs) and safe to run
# concurrently (flock on OUTDIR/.lock; the guest build locks GUEST_DIR).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SELF="$HERE/$(basename "${BASH_SOURCE[0]}")"

log() { echo "lab/build-lab.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -eq 1 ] || die "usage: $0 OUTDIR"
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
GUEST_DIR=${GUEST_DIR:-$REPO/target/guest}
mkdir -p "$GUEST_DIR"
GUEST_DIR=$(cd "$GUEST_DIR" && pwd)
[ "$GUEST_DIR" != "$OUTDIR" ] || die "OUTDIR must not be the guest dir ($GUEST_DIR)"
BIN_DIR=${VMHOST_BIN_DIR:-$REPO/target/debug}
LAB_EXTRA_FILES=${LAB_EXTRA_FILES:-}
LAB_EXTRA_MODULES=${LAB_EXTRA_MODULES:-}

for b in vmhostd vmhostctl; do
    [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b not found: run \`cargo build --workspace --bins\` first"
done

# The guest's module list plus fw_cfg (the scenario channel), vmxnet3 (the one
# emulated NIC besides virtio-net that this kernel drives: a passthrough candidate
# with a host driver to give back to; it has no e1000/e1000e/igb) and vhost_net
# (/dev/vhost-net for nested VMs' NICs; pulls in vhost, vhost_iotlb and tap; loaded
# with lab.modules=vhost_net).
# Capture NICs (scenarios/capture.sh) add tc's clsact (sch_ingress), classic-BPF filters
# (cls_bpf), mirred (act_mirred), veth pairs for the wires and bonding for a bond source.
LAB_MODULES="virtio_pci virtio_console virtio_net virtio_blk 8021q bridge tun dummy
vfio_pci vfio_iommu_type1 button evdev qemu_fw_cfg vmxnet3 vhost_net
sch_ingress cls_bpf act_mirred veth bonding $LAB_EXTRA_MODULES"

exec 9>"$OUTDIR/.lock"
flock 9

# --- base layer: kernel, busybox, modules (tests/guest/build.sh) -------------------
# The default image is the nested VMs' guest; the lab base is a variant with more modules.
# GUEST_DIR is shared by worktrees whose module lists may differ: the base's name carries
# a digest of the list, so one build never replaces the base another is about to read.
"$REPO/tests/guest/build.sh" "$GUEST_DIR"
# shellcheck disable=SC2086  # word splitting normalizes the list's whitespace
BASE_NAME="initramfs-labbase-$(echo $LAB_MODULES | sha256sum | cut -c1-12).cpio.gz"
MODULES="$LAB_MODULES" INITRAMFS_NAME=$BASE_NAME "$REPO/tests/guest/build.sh" "$GUEST_DIR"
BASE="$GUEST_DIR/$BASE_NAME"
VERSION=$(cat "$GUEST_DIR/kernel-version")

# --- tools needed here ---------------------------------------------------------------
# iproute2 gives the lab `ip` with every link type and `bridge` (busybox ip lacks
# bridge VLAN commands); binutils' strip shrinks the debug binaries ~8x; socat talks
# to QMP sockets.
need=()
command -v ip >/dev/null && command -v bridge >/dev/null || need+=(iproute2)
command -v strip >/dev/null || need+=(binutils)
command -v ldconfig >/dev/null || need+=(libc-bin)
command -v socat >/dev/null || need+=(socat)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 -q update >&2
    apt-get -o DPkg::Lock::Timeout=300 -q install -y "${need[@]}" >&2
fi

# --- the lab layer's file list -----------------------------------------------------
# FILES[dst]=src. ELF files pull in what ldd lists, at the same absolute paths (the
# lab gets its own ld.so.cache, made by ldconfig -r).
declare -A FILES=()
add() { FILES[$2]=$1; }
add_elf() {
    local src=$1 dst=$2 lib
    [ -e "$src" ] || die "missing $src"
    add "$src" "$dst"
    # ldd prints "name => /path (addr)" and "/lib64/ld-linux-x86-64.so.2 (addr)".
    while read -r lib; do
        [ -n "$lib" ] && add "$lib" "$lib"
    done < <(ldd "$src" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
}

QEMU=$(command -v qemu-system-x86_64) || die "qemu-system-x86_64 not installed"
add_elf "$QEMU" /usr/bin/qemu-system-x86_64
command -v qemu-img >/dev/null && add_elf "$(command -v qemu-img)" /usr/bin/qemu-img
# TCG is a loadable module in Debian's QEMU (dlopen'ed from the compiled-in module dir).
add_elf /usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so /usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so
# Firmware QEMU 7.2 looks for in /usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu.
# SeaBIOS, the option ROMs of -kernel boot (linuxboot_dma) and the APIC helper; the NIC
# boot ROMs every -device NIC loads unless romfile="" (virtio-net-pci: efi-virtio.rom).
for f in /usr/share/seabios/bios-256k.bin /usr/share/qemu/kvmvapic.bin \
         /usr/share/qemu/linuxboot.bin /usr/share/qemu/linuxboot_dma.bin \
         /usr/share/qemu/multiboot_dma.bin /usr/share/qemu/pvh.bin \
         /usr/lib/ipxe/qemu/efi-virtio.rom /usr/lib/ipxe/qemu/efi-e1000e.rom \
         /usr/lib/ipxe/qemu/efi-e1000.rom /usr/lib/ipxe/qemu/efi-vmxnet3.rom \
         /usr/lib/ipxe/qemu/efi-rtl8139.rom; do
    if [ -e "$f" ]; then add "$f" "$f"; else log "note: $f not on this host, left out"; fi
done
add_elf "$BIN_DIR/vmhostd" /usr/bin/vmhostd
add_elf "$BIN_DIR/vmhostctl" /usr/bin/vmhostctl
[ -x "$BIN_DIR/vmhost-agent" ] && add "$BIN_DIR/vmhost-agent" /lab/bin/vmhost-agent
# socat: QMP and agent sockets of nested VMs (busybox nc has no Unix sockets).
add_elf "$(command -v socat)" /usr/bin/socat
add_elf "$(command -v ip)" /usr/local/sbin/ip
add_elf "$(command -v bridge)" /usr/local/sbin/bridge
# tc: scenarios look at (and make foreign) qdiscs and filters; vmhostd itself never runs it.
add_elf "$(command -v tc)" /usr/local/sbin/tc
add "$GUEST_DIR/vmlinuz" /lab/guest/vmlinuz
add "$GUEST_DIR/initramfs.cpio.gz" /lab/guest/initramfs.cpio.gz
add "$HERE/init.sh" /init
add "$HERE/lib.sh" /lab/lib.sh
for spec in $LAB_EXTRA_FILES; do
    src=${spec%%:*} dst=${spec#*:}
    case $dst in /*) ;; *) die "LAB_EXTRA_FILES: destination must be absolute: $spec" ;; esac
    if head -c4 "$src" 2>/dev/null | grep -q ELF; then add_elf "$src" "$dst"; else add "$src" "$dst"; fi
done

# --- up to date? -------------------------------------------------------------------
TARGET="$OUTDIR/initramfs-lab.cpio"
STAMP="$OUTDIR/.lab.inputs"
mapfile -t DSTS < <(printf '%s\n' "${!FILES[@]}" | LC_ALL=C sort)
DIGEST=$(
    {
        echo "kernel $VERSION"
        echo "build-lab.sh $(sha256sum <"$SELF")"
        echo "base $(sha256sum <"$BASE")"
        for d in "${DSTS[@]}"; do
            echo "$d ${FILES[$d]} $(stat -L -c %a "${FILES[$d]}")"
        done
        # One sha256sum process over all contents (about 150 MB, under a second).
        for d in "${DSTS[@]}"; do printf '%s\0' "${FILES[$d]}"; done \
            | xargs -0 sha256sum | cut -d' ' -f1
    } | sha256sum | cut -d' ' -f1
)
if [ -f "$TARGET" ] && [ -f "$OUTDIR/vmlinuz" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$DIGEST" ]; then
    log "$TARGET is up to date"
    exit 0
fi

# --- build -------------------------------------------------------------------------
STAGE=$(mktemp -d "$OUTDIR/.stage.XXXXXX")
trap 'rm -rf "$STAGE" "$TARGET.tmp" "$OUTDIR/.layer.tmp"' EXIT
for d in "${DSTS[@]}"; do
    src=${FILES[$d]}
    mkdir -p "$STAGE$(dirname "$d")"
    case $d in
    /usr/bin/vmhostd|/usr/bin/vmhostctl|/lab/bin/vmhost-agent)
        # Debug builds are ~60 MB each, nearly all DWARF; the symbol table stays, so
        # panics still show function names.
        strip --strip-debug -o "$STAGE$d" "$src" ;;
    *) cp -L --preserve=mode "$src" "$STAGE$d" ;;
    esac
done
mkdir -p "$STAGE"/{etc,root,lab/files,usr/local/bin}
cat >"$STAGE/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
vmhost-qemu:x:992:992:vmhost QEMU processes:/nonexistent:/bin/false
EOF
cat >"$STAGE/etc/group" <<'EOF'
root:x:0:
vmhost:x:990:
vmhost-ro:x:991:
vmhost-qemu:x:992:
nogroup:x:65534:
EOF
printf 'passwd: files\ngroup: files\nhosts: files\n' >"$STAGE/etc/nsswitch.conf"
printf '127.0.0.1 localhost vmhost-lab\n' >"$STAGE/etc/hosts"
printf '/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n' >"$STAGE/etc/ld.so.conf"
ldconfig -r "$STAGE" 2>/dev/null || ldconfig -r "$STAGE"
echo "$VERSION" >"$STAGE/lab/kernel-version"

# The image is left uncompressed (about 100 MB): gzip -6 would make it 42 MB but costs
# 5 s per build and 0.6 s per lab boot (measured: kernel to LAB-SCENARIO-START 3.3 s
# plain, 3.9 s gzip).
(cd "$STAGE" && find . -mindepth 1 -print0 | LC_ALL=C sort -z \
    | cpio --null -o -H newc -R 0:0 --reproducible --quiet) >"$OUTDIR/.layer.tmp"
# The kernel unpacks concatenated cpio archives in order, later files replacing
# earlier ones (so the lab's /init wins). The base is inflated here rather than
# appended as gzip: an uncompressed archive right after a gzip member fails with
# "Initramfs unpacking failed: invalid magic at start of compressed archive".
{ gzip -dc "$BASE"; cat "$OUTDIR/.layer.tmp"; } >"$TARGET.tmp"
rm -f "$OUTDIR/.layer.tmp"
mv "$TARGET.tmp" "$TARGET"
cp "$GUEST_DIR/vmlinuz" "$OUTDIR/vmlinuz.tmp" && mv "$OUTDIR/vmlinuz.tmp" "$OUTDIR/vmlinuz"
echo "$VERSION" >"$OUTDIR/kernel-version.tmp" && mv "$OUTDIR/kernel-version.tmp" "$OUTDIR/kernel-version"
echo "$DIGEST" >"$STAMP"
log "built $TARGET ($(du -h "$TARGET" | cut -f1)): ${#DSTS[@]} files in the lab layer"
