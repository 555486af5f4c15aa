#!/bin/bash
# Manual smoke test for the guest image built by tests/guest/build.sh:
#   1. boot it under QEMU/TCG (no usable nested KVM on our machines) and wait, at
#      most 60 s, for VMHOST-GUEST-READY on the serial console;
#   2. press the ACPI power button via QMP (system_powerdown, what vmhost's
#      graceful stop does) and check that QEMU exits on its own within 20 s.
#
# Usage: tests/guest/boot-check.sh OUTDIR [INITRAMFS_NAME]
# Exit status: 0 both passed, 1 boot failed, 2 booted but powerdown did not stop it.
set -euo pipefail

OUTDIR=${1:?usage: $0 OUTDIR [INITRAMFS_NAME]}
INITRD="$OUTDIR/${2:-initramfs.cpio.gz}"
BOOT_TIMEOUT=60
POWERDOWN_TIMEOUT=20

for f in "$OUTDIR/vmlinuz" "$INITRD"; do
    [ -f "$f" ] || { echo "missing $f (run tests/guest/build.sh $OUTDIR)" >&2; exit 1; }
done

TMP=$(mktemp -d /tmp/guest-boot-check.XXXXXX)
LOG="$TMP/serial.log"
QMP="$TMP/qmp.sock"
QEMU_PID=

# shellcheck disable=SC2317  # only reached through the EXIT trap
cleanup() {
    if [ -n "$QEMU_PID" ] && alive "$QEMU_PID"; then
        kill "$QEMU_PID" 2>/dev/null || true
        wait "$QEMU_PID" 2>/dev/null || true
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT

# A process that exited but was not reaped yet is a zombie and still answers kill -0.
alive() {
    local state
    state=$(awk '/^State:/ {print $2}' "/proc/$1/status" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# -no-reboot: with panic=-1 a kernel panic then ends QEMU instead of looping.
# No -no-shutdown: a guest poweroff must make QEMU exit, which is what we test.
START=$(now)
qemu-system-x86_64 -accel tcg -M q35 -m 256 -nodefaults -display none -no-reboot \
    -serial "file:$LOG" \
    -qmp "unix:$QMP,server=on,wait=off" \
    -kernel "$OUTDIR/vmlinuz" -initrd "$INITRD" \
    -append "console=ttyS0 panic=-1" &
QEMU_PID=$!

deadline=$(( $(date +%s) + BOOT_TIMEOUT ))
until grep -q VMHOST-GUEST-READY "$LOG" 2>/dev/null; do
    if ! alive "$QEMU_PID"; then
        echo "FAIL: QEMU exited before the guest was ready; serial log:" >&2
        cat "$LOG" >&2 || true
        exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "FAIL: no VMHOST-GUEST-READY within ${BOOT_TIMEOUT}s; serial log:" >&2
        cat "$LOG" >&2
        exit 1
    fi
    sleep 0.2
done
echo "boot: guest ready after $(elapsed "$START")s (wall clock, QEMU start to READY)"
grep -a VMHOST-GUEST-READY "$LOG"

# QMP needs the capabilities handshake before any command. The writer keeps the
# connection open while waiting for QEMU to exit (hanging up at once could lose
# the replies); QEMU exiting closes the socket and ends socat.
START=$(now)
deadline=$(( $(date +%s) + POWERDOWN_TIMEOUT ))
{
    echo '{"execute":"qmp_capabilities"}'
    echo '{"execute":"system_powerdown"}'
    while alive "$QEMU_PID" && [ "$(date +%s)" -lt "$deadline" ]; do
        sleep 0.1
    done
} | socat - "UNIX-CONNECT:$QMP" | sed 's/^/qmp: /' || true

if alive "$QEMU_PID"; then
    echo "FAIL: QEMU still running ${POWERDOWN_TIMEOUT}s after system_powerdown; killing it"
    echo "serial log tail:"; tail -n 20 "$LOG"
    exit 2
fi
wait "$QEMU_PID" && rc=0 || rc=$?
QEMU_PID=
echo "powerdown: QEMU exited on its own (status $rc) $(elapsed "$START")s after system_powerdown"
grep -aq VMHOST-GUEST-POWEROFF "$LOG" && echo "powerdown: guest logged VMHOST-GUEST-POWEROFF"
exit 0
