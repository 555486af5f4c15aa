#!/bin/bash
# The whole test suite: lint, unit tests, and end-to-end tests against real QEMU (TCG).
# This is the README's test command; .ci/run runs it on a clean machine.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/setup.sh --real-guests
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
# The plugins: lint and unit tests against a fake socket server (their end-to-end tests against
# a real vmhostd are cargo tests in tests/tests/).
plugins/salt/tests/check.sh
plugins/puppet/tests/check.sh
# The end-to-end tests run the real binaries from target/debug.
cargo build --workspace --bins
# The end-to-end tests make real disks (raw ones fully allocated) and backups of them: say how
# much room they start with, so that a run that fills the disk says so.
df -h "${TMPDIR:-/tmp}" target | sed 's/^/tests\/run.sh: /'
cargo test --workspace
