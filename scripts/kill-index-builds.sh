#!/usr/bin/env bash
# kill -9 of the daemon during background index builds, many rounds (the
# test run does 4): tests/live_snapshot.rs
# `kills_during_background_index_builds_lose_nothing`. After every restart
# each completed write must read back; at the end every layer is clean for
# qemu-img check, QEMU reads the reference's bytes, and the rebuilt index
# agrees with a walk of the chain.
#
#   scripts/kill-index-builds.sh [ROUNDS=50]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands cc:gcc qemu-img:qemu-utils
export SQCOW2_BUILD_KILLS=${1:-50}
cargo build --workspace --locked
cargo test --locked --test live_snapshot kills_during_background_index_builds -- --nocapture 2>&1 \
  | grep -E "kills,|^test |test result|panicked|failed"
