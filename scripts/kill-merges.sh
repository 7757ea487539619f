#!/usr/bin/env bash
# kill -9 of the daemon at random moments of live merges, many rounds (the
# test run does 4): tests/live_merge.rs
# `kills_during_live_merges_leave_the_old_chain_or_the_new_one`. After
# every restart the daemon serves the chain from before the merge or the
# one after it and each completed write reads back; at the end every file
# is clean for qemu-img check, QEMU reads the reference's bytes, and the
# rebuilt index agrees with a walk of the chain.
#
#   scripts/kill-merges.sh [ROUNDS=50] [SEED=41]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands cc:gcc qemu-img:qemu-utils
export SQCOW2_MERGE_KILLS=${1:-50}
export SQCOW2_MERGE_SEED=${2:-41}
cargo build --workspace --locked
cargo test --locked --test live_merge kills_during_live_merges -- --nocapture 2>&1 \
  | grep -E "kills during|^test |test result|panicked|failed"
