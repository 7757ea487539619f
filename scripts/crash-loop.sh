#!/usr/bin/env bash
# Crash loop: kill -9 of the daemon at random moments during a libblkio
# write/flush workload on a 100-layer indexed chain, then check and verify
# (tests/crash_loop.rs). The test run does 5 rounds; this does more.
#
#   scripts/crash-loop.sh [ITERATIONS=100] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands cc:gcc qemu-img:qemu-utils
export SQCOW2_CRASH_ITERATIONS=${1:-100}
export SQCOW2_CRASH_SEED=${2:-$RANDOM}
echo "crash loop: $SQCOW2_CRASH_ITERATIONS rounds, seed $SQCOW2_CRASH_SEED"
cargo build --workspace --locked
cargo test --locked --test crash_loop -- --nocapture 2>&1 | tee "${SQCOW2_CRASH_LOG:-/dev/null}" | grep -E "^(round|crash loop|test result)|panicked|failed|after reopening"
