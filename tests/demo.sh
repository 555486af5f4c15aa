#!/bin/bash
# The vmhost demo: start vmhostd (TCG, in a temp dir and its own network namespace), boot a VM
# with a NIC on a bridge vmhostd creates and the guest agent inside, show it running and the guest
# agent's check of its network against the spec (vmhostctl check demo), then clean up.
# KEEP=1 leaves daemon and VM up.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/setup.sh
cargo build --workspace --bins --quiet
tests/guest/build-agent-guest.sh target/guest
root=$(pwd)
ctl="$root/target/debug/vmhostctl"
dir=$(mktemp -d /tmp/vmhdemo.XXXX)   # 0700: QEMU gets every file as a descriptor
mkdir -p "$dir/images"
cat >"$dir/vmhostd.toml" <<TOML
[paths]
state = "$dir/state"
run = "$dir/run"
images = "$dir/images"
socket = "$dir/vmhostd.sock"
boot = ["$root/target/guest"]   # the only directory the demo VM's kernel and initrd may come from
[qemu]
accel = "tcg"   # this machine has no usable KVM; the product default is kvm
user = "vmhost-test-qemu"   # QEMU's unprivileged user, created by tests/setup.sh
[hardware]
cpu = 4
memory_gib = 4
reserved_cpu = 1
reserved_memory_gib = 1
[networks.lan]
bridge = "br-demo"
create = true
address = "10.77.0.1/24"
subnet = "10.77.0.0/24"
TOML
export VMHOST_SOCKET="$dir/vmhostd.sock"

# A network namespace of its own, so the demo's bridge and taps never touch this host's network.
netns=vmhdemo$$
ip netns add "$netns"
ip netns exec "$netns" "$root/target/debug/vmhostd" --config "$dir/vmhostd.toml" 2>"$dir/vmhostd.log" &
daemon=$!
cleanup() {
    if [ "${KEEP:-0}" = 1 ]; then
        echo "KEEP=1: vmhostd (pid $daemon) and the VM stay up; socket $VMHOST_SOCKET"
        return
    fi
    "$ctl" destroy demo >/dev/null 2>&1 || true
    kill "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
    ip netns del "$netns" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$VMHOST_SOCKET" ] && break; sleep 0.1; done

echo "== vmhostctl check (the host's readiness)"
"$ctl" check || true
cat >"$dir/demo.json" <<JSON
{"name": "demo", "role": "sensor", "cpu": 1, "memory_mib": 256,
 "boot": {"kernel": "$root/target/guest/vmlinuz", "initrd": "$root/target/guest/initramfs-agent.cpio.gz",
          "cmdline": "console=ttyS0 panic=-1 quiet vmhost.ping=10.77.0.1"},
 "nics": [{"network": "lan", "ipv4": {"mode": "static", "address": "10.77.0.10/24",
           "gateway": "10.77.0.1", "dns": ["10.77.0.1"]}}]}
JSON
echo "== vmhostctl create demo.json"
"$ctl" create "$dir/demo.json"
log="$dir/state/logs/demo.serial.log"
for _ in $(seq 900); do grep -q "VMHOST-PING" "$log" 2>/dev/null && break; sleep 0.1; done
echo "== the guest's network, from its console: address applied, host bridge reachable"
grep VMHOST "$log" || { echo "guest did not come up"; exit 1; }
echo "== vmhostctl list"
"$ctl" list
echo "== vmhostctl info"
"$ctl" info
echo "== host side: the VM's tap on the bridge vmhostd created"
ip -n "$netns" -br link show master br-demo
echo "== waiting for the guest agent"
for _ in $(seq 600); do
    "$ctl" --json get demo | grep -q '"connected": true' && break
    sleep 0.2
done
echo "== vmhostctl check demo: the guest agent checks the VM's network against its spec"
"$ctl" check demo
