#!/bin/bash
# Installs what vmhost's tests and demo need on a fresh Debian 12 machine, then builds the test
# guest (Debian's cloud kernel + busybox initramfs) into target/guest, and the plugins' tools:
# Puppet 7 and rubocop from Debian, Salt 3007 and ruff from PyPI in a venv (target/salt-venv).
# With --real-guests (tests/run.sh) also the Debian packages (target/deb) and the real Debian 12
# and 13 guest images with the agent package installed (target/real-guests, docs/guests.md).
# Idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

# Every command the tests and the demo need, with the Debian package that provides it; an
# absolute path is a file instead (OVMF: the UEFI test's firmware, vmhostd's [firmware] default).
# sbsigntool, openssl and OVMF's snakeoil pair: signing the Secure Boot test's kernels
# (tests/tests/secure_boot.rs). curl: image.import from a URL (tests/tests/images.rs).
# swtpm, swtpm_setup: a VM's TPM (`tpm: true`, tests/tests/tpm.rs).
# debootstrap, dosfstools, mtools, fdisk: the real guest images (tests/guest/build-real-guest.sh);
# openssh-client: logging in to them.
required=(qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils busybox:busybox-static ip:iproute2
    strip:binutils cpio:cpio depmod:kmod socat:socat puppet:puppet rubocop:rubocop
    systemd-analyze:systemd systemd-socket-activate:systemd systemd-nspawn:systemd-container
    adduser:adduser curl:curl sha256sum:coreutils /usr/share/OVMF/OVMF_CODE_4M.fd:ovmf
    /usr/share/OVMF/OVMF_VARS_4M.fd:ovmf
    /usr/share/OVMF/OVMF_CODE_4M.secboot.fd:ovmf /usr/share/OVMF/OVMF_VARS_4M.snakeoil.fd:ovmf
    /usr/share/ovmf/PkKek-1-snakeoil.key:ovmf sbsign:sbsigntool sbattach:sbsigntool openssl:openssl
    swtpm:swtpm swtpm_setup:swtpm-tools
    debootstrap:debootstrap mkfs.fat:dosfstools mcopy:mtools sfdisk:fdisk mkfs.ext4:e2fsprogs
    ssh:openssh-client ssh-keygen:openssh-client)

# Sets `missing_commands` to the required commands not found and `missing` to their packages
# (each once). QEMU and qemu-utils are a pair: when either is needed both are installed in one
# transaction, qemu-utils by name, so that apt cannot satisfy qemu-system-x86 (and its Recommends,
# such as qemu-block-extra of the same version) by removing a qemu-utils it did not install.
find_missing() {
    local pair cmd pkg
    missing_commands=()
    missing=()
    hash -r
    for pair in "${required[@]}"; do
        cmd=${pair%%:*} pkg=${pair#*:}
        if [[ $cmd == /* ]]; then
            [ -f "$cmd" ] && continue
        elif command -v "$cmd" >/dev/null 2>&1 || [ -x "/bin/$cmd" ]; then
            continue
        fi
        missing_commands+=("$cmd")
        [[ " ${missing[*]} " == *" $pkg "* ]] || missing+=("$pkg")
    done
    if [[ " ${missing[*]} " == *" qemu-system-x86 "* || " ${missing[*]} " == *" qemu-utils "* ]]; then
        for pkg in qemu-system-x86 qemu-utils; do
            [[ " ${missing[*]} " == *" $pkg "* ]] || missing+=("$pkg")
        done
    fi
}

# Quiet unless apt-get fails: then its whole output (unmet dependencies are on stdout) and exit 1.
apt_install() {
    local out
    if ! out=$(DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q --allow-downgrades "$@" 2>&1); then
        printf '%s\n' "$out" >&2
        echo "setup: FAILED: apt-get install $* failed (output above)" >&2
        exit 1
    fi
}

# QEMU and qemu-utils come from the distribution's own release, as a pair: a machine may have a
# qemu-utils backport (10.x) preinstalled, which Breaks qemu-system-common < 8.0, and apt will
# neither install QEMU 7.2 beside it nor downgrade it unasked. `pkg/CODENAME` picks the release's
# version of both and --allow-downgrades lets apt replace the backport.
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
apt_packages() {
    local pkg
    for pkg in "$@"; do
        case $pkg in
        qemu-system-x86 | qemu-utils) echo "$pkg/$codename" ;;
        *) echo "$pkg" ;;
        esac
    done
}

find_missing
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq
    mapfile -t missing < <(apt_packages "${missing[@]}")
    apt_install "${missing[@]}"
    # An installation can remove what provided a command found before it: apt once satisfied
    # qemu-system-x86 7.2 by removing a preinstalled qemu-utils 10 (a backport), and qemu-img was
    # gone. So every command is checked again, and what is missing now is installed once more.
    find_missing
    if [ ${#missing[@]} -gt 0 ]; then
        echo "setup: ${missing_commands[*]} missing after installing (removed by it?); installing ${missing[*]} again" >&2
        mapfile -t missing < <(apt_packages "${missing[@]}")
        apt_install "${missing[@]}"
        find_missing
        if [ ${#missing[@]} -gt 0 ]; then
            echo "setup: FAILED: still missing after two installations: ${missing_commands[*]} (packages ${missing[*]})" >&2
            exit 1
        fi
    fi
fi
# Test hosts run QEMU as this user (tests/src/lib.rs QEMU_USER); vmhost-qemu itself belongs to
# the Debian package, which the packaging test installs and purges.
if ! getent passwd vmhost-test-qemu >/dev/null; then
    adduser --system --group --no-create-home --home /nonexistent --shell /usr/sbin/nologin \
        --quiet vmhost-test-qemu
fi
# As the package does for vmhost-qemu: QEMU keeps, of its supplementary groups, only the one
# owning /dev/kvm, and only when its user is a member; kvm is that group on Debian.
getent group kvm >/dev/null || addgroup --system --quiet kvm
[[ " $(id -nG vmhost-test-qemu) " == *" kvm "* ]] || adduser --quiet vmhost-test-qemu kvm
# Salt 3008 pins a certifi PyPI does not have here; 3007 is the supported line.
if [ ! -x target/salt-venv/bin/salt-call ] || [ ! -x target/salt-venv/bin/ruff ]; then
    echo "setup: installing salt 3007 and ruff into target/salt-venv"
    python3 -m venv target/salt-venv
    target/salt-venv/bin/pip install -q --disable-pip-version-check "salt==3007.*" ruff
fi
# The Prometheus text-format parser the metrics test checks `vmhostctl stats --prometheus` with.
# `python -m pip`: a venv copied from another checkout keeps that checkout's path in its scripts.
if ! target/salt-venv/bin/python -c "import prometheus_client.parser" 2>/dev/null; then
    echo "setup: installing prometheus_client into target/salt-venv"
    target/salt-venv/bin/python -m pip install -q --disable-pip-version-check "prometheus_client==0.21.1"
fi
tests/guest/build.sh target/guest
if [ "${1:-}" = --real-guests ]; then
    # The agent package the images install, then the images (each cached: its tree is rebuilt
    # only when its package list or recipe changes, its disk when the agent package changes).
    agent_deb=$(packaging/build-debs.sh target/deb | grep '/vmhost-agent_.*\.deb$')
    for dist in bookworm trixie; do
        tests/guest/build-real-guest.sh "$dist" target/real-guests "$agent_deb"
    done
fi
