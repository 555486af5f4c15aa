#!/bin/bash
# Installs what vmhost's tests and demo need on a fresh Debian 12 machine, then builds the test
# guest (Debian's cloud kernel + busybox initramfs) into target/guest. Idempotent and quick when
# everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pair in qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils busybox:busybox-static ip:iproute2 strip:binutils \
    cpio:cpio depmod:kmod socat:socat; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/bin/${pair%%:*}" ] || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${missing[@]}" >/dev/null
fi
tests/guest/build.sh target/guest
