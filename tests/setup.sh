#!/bin/bash
# Installs what vmhost's tests and demo need on a fresh Debian 12 machine, then builds the test
# guest (Debian's cloud kernel + busybox initramfs) into target/guest, and the plugins' tools:
# Puppet 7 and rubocop from Debian, Salt 3007 and ruff from PyPI in a venv (target/salt-venv).
# Idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pair in qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils busybox:busybox-static ip:iproute2 strip:binutils \
    cpio:cpio depmod:kmod socat:socat puppet:puppet rubocop:rubocop systemd-analyze:systemd \
    systemd-socket-activate:systemd systemd-nspawn:systemd-container adduser:adduser; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/bin/${pair%%:*}" ] || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${missing[@]}" >/dev/null
fi
# Test hosts run QEMU as this user (tests/src/lib.rs QEMU_USER); vmhost-qemu itself belongs to
# the Debian package, which the packaging test installs and purges.
if ! getent passwd vmhost-test-qemu >/dev/null; then
    adduser --system --group --no-create-home --home /nonexistent --shell /usr/sbin/nologin \
        --quiet vmhost-test-qemu
fi
# Salt 3008 pins a certifi PyPI does not have here; 3007 is the supported line.
if [ ! -x target/salt-venv/bin/salt-call ] || [ ! -x target/salt-venv/bin/ruff ]; then
    echo "setup: installing salt 3007 and ruff into target/salt-venv"
    python3 -m venv target/salt-venv
    target/salt-venv/bin/pip install -q --disable-pip-version-check "salt==3007.*" ruff
fi
tests/guest/build.sh target/guest
