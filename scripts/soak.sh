#!/usr/bin/env bash
# Soak: 4 queues x depth 32, 70/30 random read/write with verification on
# a 100-layer indexed chain (tests/soak.rs); checks zero errors, RSS at the
# end within 5 % of RSS after the first minute, and the content at the end
# through the daemon and qemu-img. The test run does 20 s on 256 MiB.
#
#   scripts/soak.sh [SECONDS=600] [SIZE=1G]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands cc:gcc qemu-img:qemu-utils
export SQCOW2_SOAK_SECONDS=${1:-600}
export SQCOW2_SOAK_SIZE=${2:-1G}
cargo build --workspace --locked
cargo test --locked --test soak -- --nocapture 2>&1 | grep -E "^(soak|test result)|panicked|failed"
