#!/bin/bash
# Builds the test guest with the real guest agent inside: the static, stripped vmhost-agent
# (target/guest-agent/vmhost-agent) packed as /bin/vmhost-agent into
# OUT_DIR/initramfs-agent.cpio.gz by build.sh. One recipe for the demo, the agent's own guest test
# and the end-to-end harness. Usage: tests/guest/build-agent-guest.sh [OUT_DIR, default target/guest]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-target/guest}
target=${CARGO_TARGET_DIR:-$PWD/target}
# Static glibc: the guest's initramfs has no libc of its own.
RUSTFLAGS="-C target-feature=+crt-static" "${CARGO:-cargo}" build --quiet --release -p vmhost-agent \
    --target x86_64-unknown-linux-gnu
mkdir -p "$target/guest-agent"
strip -o "$target/guest-agent/vmhost-agent" "$target/x86_64-unknown-linux-gnu/release/vmhost-agent"
EXTRA_FILES="$target/guest-agent/vmhost-agent:/bin/vmhost-agent" INITRAMFS_NAME=initramfs-agent.cpio.gz \
    tests/guest/build.sh "$out"
