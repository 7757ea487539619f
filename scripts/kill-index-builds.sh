#!/usr/bin/env bash
# kill -9 of the daemon during live snapshots and their background index
# builds, many rounds (the test run does 4 and 6): tests/live_snapshot.rs
# `kills_during_background_index_builds_lose_nothing` (kills after the
# snapshot's reply) and `kills_at_any_moment_of_a_live_snapshot_lose_nothing`
# (kills from the command on: new top created, prepared, the pause, the old
# top's close after the switch). After every restart each completed write
# must read back; at the end every layer is clean for qemu-img check, QEMU
# reads the reference's bytes, and the rebuilt index agrees with a walk of
# the chain.
#
#   scripts/kill-index-builds.sh [ROUNDS=50]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands cc:gcc qemu-img:qemu-utils
export SQCOW2_BUILD_KILLS=${1:-50}
export SQCOW2_SNAPSHOT_KILLS=${1:-50}
cargo build --workspace --locked
cargo test --locked --test live_snapshot kills_ -- --nocapture --test-threads 1 2>&1 \
  | grep -E "kills[,:]|^test |test result|panicked|failed"
