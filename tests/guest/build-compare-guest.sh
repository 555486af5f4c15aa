#!/bin/bash
# Builds vmhost-compare's agent guest: the test guest's kernel and busybox with both guest agents
# inside, so their RSS is measured the same way, in the same guest: the static vmhost-agent
# (/bin/vmhost-agent) and Debian 12's qemu-guest-agent (/usr/sbin/qemu-ga, unpacked from its .deb)
# with the shared libraries it links and the dynamic loader, copied from this Debian 12 host (the
# same builds the package depends on). Its init is tests/compare/agents-init.sh, packed as
# /compare-init; boot with `rdinit=/compare-init` (the image's /init stays the test guest's).
#
# Usage: tests/guest/build-compare-guest.sh [OUT_DIR, default target/guest]
# Output: OUT_DIR/initramfs-compare.cpio.gz; OUT_DIR/qga/qemu-guest-agent.deb (the package) and
# OUT_DIR/qga/root (unpacked), fetched once: delete OUT_DIR/qga for a newer package.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-target/guest}
target=${CARGO_TARGET_DIR:-$PWD/target}
log() { echo "guest/build-compare-guest.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

# The static agent (and the kernel, via build.sh).
tests/guest/build-agent-guest.sh "$out"

qga=$out/qga
if [ ! -x "$qga/root/usr/sbin/qemu-ga" ] || [ ! -f "$qga/qemu-guest-agent.deb" ]; then
    rm -rf "$qga"
    mkdir -p "$qga/dl"
    (cd "$qga/dl" && apt-get -q -o APT::Sandbox::User=root download qemu-guest-agent >&2) ||
        die "apt-get download qemu-guest-agent failed (run apt-get update?)"
    mv "$qga"/dl/qemu-guest-agent_*.deb "$qga/qemu-guest-agent.deb.tmp"
    dpkg-deb -x "$qga/qemu-guest-agent.deb.tmp" "$qga/root.tmp"
    mv "$qga/root.tmp" "$qga/root"
    # Last, so its presence means the unpacking finished.
    mv "$qga/qemu-guest-agent.deb.tmp" "$qga/qemu-guest-agent.deb"
    rm -rf "$qga/dl"
fi

# ldd prints "name => /path (addr)" for libraries and "/path (addr)" for the loader.
ldd_out=$(ldd "$qga/root/usr/sbin/qemu-ga")
if grep -q 'not found' <<<"$ldd_out"; then
    die "qemu-ga needs libraries this host lacks: $(grep 'not found' <<<"$ldd_out" | tr -s ' \t\n' ' ')"
fi
extra="$target/guest-agent/vmhost-agent:/bin/vmhost-agent"
extra+=" $qga/root/usr/sbin/qemu-ga:/usr/sbin/qemu-ga"
extra+=" $PWD/tests/compare/agents-init.sh:/compare-init"
while read -r lib; do
    extra+=" $lib:$lib"
done < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$ldd_out")

EXTRA_FILES=$extra INITRAMFS_NAME=initramfs-compare.cpio.gz tests/guest/build.sh "$out"
