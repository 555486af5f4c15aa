#!/bin/bash
# The vmhost demo: start vmhostd (TCG, in a temp dir), boot a VM from the test guest through the
# API, show it running and what the guest printed, then clean up. KEEP=1 leaves daemon and VM up.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/setup.sh
cargo build --workspace --bins --quiet
root=$(pwd)
ctl="$root/target/debug/vmhostctl"
dir=$(mktemp -d /tmp/vmhdemo.XXXX)
chmod 755 "$dir"
mkdir -p "$dir/images"
cat >"$dir/vmhostd.toml" <<TOML
[paths]
state = "$dir/state"
run = "$dir/run"
images = "$dir/images"
socket = "$dir/vmhostd.sock"
[qemu]
accel = "tcg"   # this machine has no usable KVM; the product default is kvm
[hardware]
cpu = 4
memory_gib = 4
reserved_cpu = 1
reserved_memory_gib = 1
TOML
export VMHOST_SOCKET="$dir/vmhostd.sock"

"$root/target/debug/vmhostd" --config "$dir/vmhostd.toml" 2>"$dir/vmhostd.log" &
daemon=$!
cleanup() {
    if [ "${KEEP:-0}" = 1 ]; then
        echo "KEEP=1: vmhostd (pid $daemon) and the VM stay up; socket $VMHOST_SOCKET"
        return
    fi
    "$ctl" destroy demo >/dev/null 2>&1 || true
    kill "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$VMHOST_SOCKET" ] && break; sleep 0.1; done

echo "== vmhostctl check"
"$ctl" check || true
cat >"$dir/demo.json" <<JSON
{"name": "demo", "role": "sensor", "cpu": 1, "memory_mib": 256,
 "boot": {"kernel": "$root/target/guest/vmlinuz", "initrd": "$root/target/guest/initramfs.cpio.gz",
          "cmdline": "console=ttyS0 panic=-1 quiet"}}
JSON
echo "== vmhostctl create demo.json"
"$ctl" create "$dir/demo.json"
log="$dir/state/logs/demo.serial.log"
for _ in $(seq 600); do grep -q VMHOST-GUEST-READY "$log" 2>/dev/null && break; sleep 0.1; done
echo "== guest console (serial log)"
grep VMHOST "$log" || { echo "guest did not come up"; exit 1; }
echo "== vmhostctl list"
"$ctl" list
echo "== vmhostctl info"
"$ctl" info
echo "(the guest agent's network check arrives with the agent; see docs/)"
