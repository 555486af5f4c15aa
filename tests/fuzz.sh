#!/bin/bash
# Fuzzes the parsers untrusted input reaches, for a bounded time each:
#   daemon/fuzz      agent_frame  the daemon reading what a guest writes (vmhost::fuzz::agent_frame)
#   daemon/fuzz      request      a line a client sends on the API socket (vmhost::fuzz::request)
#   daemon/fuzz      spec         VM specs and desired sets from clients (vmhost::fuzz::spec)
#   daemon/fuzz      config       vmhostd.toml (vmhost::fuzz::config)
#   daemon/fuzz      manifest     a backup's manifest.json, which vm.import reads (vmhost::fuzz::manifest)
#   daemon/fuzz      migration_wire  what a peer sends on the migration port (vmhost::fuzz::migration_wire)
#   guest-agent/fuzz agent_request the agent reading what the host writes (vmhost_agent::fuzz)
# Usage: tests/fuzz.sh [SECONDS per target, default 120] [TARGET...]
# Not part of CI (tests/run.sh replays the committed corpora and past crashes as unit tests).
# New interesting inputs go to target/fuzz/corpus/TARGET (the committed corpus only seeds);
# a crash ends that target's run (the others still run; the script exits 1) with its input under
# target/fuzz/artifacts/TARGET: copy it into
# CRATE/fuzz/regressions/TARGET/, fix the bug, and the unit test replays it from then on.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-120}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(agent_frame request spec config manifest migration_wire agent_request)

command -v cargo-fuzz >/dev/null 2>&1 || cargo install --locked cargo-fuzz
# cargo fuzz passes -Z flags (sanitizer, coverage); the machine's toolchain is stable.
export RUSTC_BOOTSTRAP=1
root=$PWD
work=$root/target/fuzz
# Every target runs even when an earlier one finds a crash: one finding must not hide the others.
# Each target's outcome (executions, corpus, crash input) is summarised at the end.
declare -A outcome
failed=0
for target in "${targets[@]}"; do
    case $target in
        agent_frame | request | spec | config | manifest | migration_wire) crate=daemon ;;
        agent_request) crate=guest-agent ;;
        *) echo "fuzz.sh: unknown target $target" >&2; exit 2 ;;
    esac
    # libFuzzer refuses a missing corpus dir; the regressions dir exists once a crash was kept.
    mkdir -p "$work/corpus/$target" "$work/artifacts/$target" "$crate/fuzz/regressions/$target"
    log=$work/$target.log
    echo "fuzz.sh: $target for ${secs}s (log: $log)"
    if (cd "$crate" && cargo fuzz run --target-dir "$work/build" "$target" \
        "$work/corpus/$target" "fuzz/corpus/$target" "fuzz/regressions/$target" -- \
        -max_total_time="$secs" -max_len=140000 -rss_limit_mb=2048 -timeout=10 \
        -dict="fuzz/$target.dict" -artifact_prefix="$work/artifacts/$target/" -print_final_stats=1) \
        >"$log" 2>&1; then
        status=ok
    else
        status="FAILED: $(grep -m1 -o 'Test unit written to .*' "$log" || tail -n1 "$log")"
        failed=1
    fi
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    corpus=$(find "$work/corpus/$target" -type f | wc -l)
    outcome[$target]="$status; executions $runs; corpus $corpus new inputs"
    echo "fuzz.sh: $target: ${outcome[$target]}"
done
echo "fuzz.sh: summary (${secs}s per target)"
for target in "${targets[@]}"; do echo "  $target: ${outcome[$target]}"; done
exit $failed
