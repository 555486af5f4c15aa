#!/bin/bash
# Lint and unit tests of the Puppet module (no daemon needed: the tests use a fake socket
# server). Needs ruby, rubocop and puppet (Debian: apt-get install puppet rubocop).
# The end-to-end tests with a real vmhostd are in tests/tests/puppet.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
rubocop
for t in tests/test_*.rb; do
    echo "== $t"
    ruby "$t"
done
