#!/bin/bash
# Runs a private libvirt (Debian 12: monolithic libvirtd 9.0 + virtlogd) for vmhost-compare,
# without touching the host's own libvirt state or network: it lives in new mount and network
# namespaces, with DIR/root/... bound over its config, state and log dirs and tmpfs over its cache
# and run dirs, so nothing it defines or starts (domains, the "default" network, capability
# caches) outlives it or touches the host's libvirt. Its API socket is DIR/libvirt-sock (connect
# with qemu:///system?socket=DIR/libvirt-sock).
#
# Usage: tests/compare/libvirt-private.sh DIR
# Writes DIR/libvirtd.conf; virtlogd's pid goes to DIR/virtlogd.pid; then execs libvirtd in the
# foreground (so the caller's child pid is libvirtd's). Its QEMUs run as root (DIR/qemu.conf,
# bound over /etc/libvirt/qemu.conf inside). Kill libvirtd and virtlogd to stop it; the
# namespaces and mounts vanish with their last process, the files with DIR.
set -euo pipefail

if [ "${1:-}" != --inside ]; then
    dir=${1:?usage: libvirt-private.sh DIR}
    cat >"$dir/libvirtd.conf" <<CONF
unix_sock_dir = "$dir"
unix_sock_group = "root"
unix_sock_rw_perms = "0700"
auth_unix_ro = "none"
auth_unix_rw = "none"
CONF
    exec unshare --mount --net --propagation private -- "$0" --inside "$dir"
fi

# Inside the new namespaces.
dir=$2
# What a real host keeps on disk stays on disk (DIR's file system, like vmhostd's state in
# vmhost-compare), so defining domains costs what it costs there; run and cache on tmpfs.
for d in /etc/libvirt/qemu /var/lib/libvirt /var/log/libvirt; do
    mkdir -p "$d" "$dir/root$d"
    mount --bind "$dir/root$d" "$d"
done
for d in /var/cache/libvirt /run/libvirt; do
    mkdir -p "$d"
    mount -t tmpfs -o mode=0755 libvirt-private "$d"
done
ip link set lo up
# libvirt's QEMU runs as root (vmhostd's runs as an unprivileged user). With Debian's default user (libvirt-qemu) libvirt finds
# /dev/kvm (root-only here) unusable while QEMU's own probe reports KVM enabled, so it throws its
# capability cache away at every lookup and re-probes QEMU about 17 times (over a minute) per
# domain start. The domains are type qemu (TCG) either way.
printf 'user = "root"\ngroup = "root"\n' >"$dir/qemu.conf"
mount --bind "$dir/qemu.conf" /etc/libvirt/qemu.conf
virtlogd --pid-file "$dir/virtlogd.pid" &
# libvirtd connects to virtlogd's socket when it starts a domain; wait for it.
for _ in $(seq 100); do
    [ -S /run/libvirt/virtlogd-sock ] && break
    sleep 0.05
done
exec libvirtd --config "$dir/libvirtd.conf" --pid-file "$dir/libvirtd.pid"
