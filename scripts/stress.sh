#!/usr/bin/env bash
# Concurrency stress (tests/stress.rs and the deadlock test of
# tests/hazards.rs), longer than in the test run: live snapshots, control
# flushes, discards and in-place writes racing on the same clusters with
# guest flushes, every block verified, every layer checked by qemu-img.
#
#   scripts/stress.sh [SECONDS=300] [SEED=7] [SNAPSHOTS=500]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands cc:gcc qemu-img:qemu-utils
export SQCOW2_STRESS_SECONDS=${1:-300}
export SQCOW2_STRESS_SEED=${2:-7}
export SQCOW2_HAZARD_SNAPSHOTS=${3:-500}
cargo build --workspace --locked
cargo test --locked --test stress --test hazards -- --nocapture --test-threads 1 2>&1 \
  | grep -E "requests,|snapshots under|^test |test result|panicked|failed"
