#!/usr/bin/env bash
# Restart loop with a real guest (tests/guest_restart.rs): a QEMU guest
# writes, flushes, reads back and verifies blocks on a served 20-layer
# chain while the daemon is killed with kill -9 (then restarted) and
# upgraded (SIGTERM, another binary started on the same socket). The test
# run does 10 kills and 4 upgrades; this does RESTARTS of each.
#
#   scripts/guest-restart.sh [RESTARTS=50] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands qemu-system-x86_64:qemu-system-x86 busybox:busybox-static
ensure_commands cc:gcc qemu-img:qemu-utils qemu-io:qemu-utils
SQCOW2_GUEST_KIT=$(scripts/guest-kit.sh)
export SQCOW2_GUEST_KIT
export SQCOW2_RESTARTS=${1:-50}
export SQCOW2_RESTART_SEED=${2:-$RANDOM}
echo "guest restart loop: $SQCOW2_RESTARTS kills and $SQCOW2_RESTARTS upgrades, seed $SQCOW2_RESTART_SEED"
cargo build --workspace --locked
cargo test --locked --test guest_restart -- --nocapture --test-threads 1 2>&1 |
  tee "${SQCOW2_RESTART_LOG_FILE:-/dev/null}" |
  grep -E "^(guest restart loop|test result)|panicked|failed|differs|saw errors"
