#!/usr/bin/env bash
# The suite's long runs: the same tests as `scripts/test.sh` runs (in
# crates/sqcow2-cli/tests/), for longer or for more rounds.
#
#   scripts/long-test.sh soak [SECONDS=600] [SIZE=1G]
#       4 queues x depth 32, 70/30 random read/write with verification on
#       a 100-layer indexed chain (soak.rs): zero errors, RSS at the end
#       within 5 % of RSS after the first minute, the content at the end
#       through the daemon and qemu-img. The test run does 20 s on 256 MiB.
#   scripts/long-test.sh stress [SECONDS=300] [SEED=7] [SNAPSHOTS=500]
#       Live snapshots, control flushes, discards and in-place writes racing
#       on the same clusters with guest flushes (stress.rs, and the deadlock
#       test of hazards.rs), every block verified, every layer checked by
#       qemu-img.
#   scripts/long-test.sh crash-loop [ITERATIONS=100] [SEED]
#       kill -9 of the daemon at random moments of a libblkio write/flush
#       workload on a 100-layer indexed chain, then check and verify
#       (crash_loop.rs; the test run does 5 rounds). SQCOW2_CRASH_LOG=FILE
#       keeps the whole output.
#   scripts/long-test.sh kill-index-builds [ROUNDS=50]
#       kill -9 during live snapshots and their background index builds
#       (live_snapshot.rs `kills_during_background_index_builds_lose_nothing`
#       and `kills_at_any_moment_of_a_live_snapshot_lose_nothing`; the test
#       run does 4 and 6): every completed write reads back after each
#       restart; at the end qemu-img check is clean, QEMU reads the
#       reference's bytes, the rebuilt index agrees with a walk.
#   scripts/long-test.sh kill-merges [ROUNDS=50] [SEED=41]
#       kill -9 at random moments of live merges (live_merge.rs
#       `kills_during_live_merges_leave_the_old_chain_or_the_new_one`; the
#       test run does 4): the chain from before the merge or after it, each
#       completed write read back, the same checks at the end.
#   scripts/long-test.sh kill-commits [ROUNDS=50] [SEED=43]
#       kill -9 at random moments of live commits (live_commit.rs
#       `kills_during_live_commits_lose_no_completed_write`; the test run
#       does 8): the top the log names has every completed write.
#   scripts/long-test.sh guest-restart [RESTARTS=50] [SEED]
#       A QEMU guest writes, flushes, reads back and verifies blocks on a
#       served 20-layer chain while the daemon is killed with kill -9 and
#       upgraded (SIGTERM, another binary on the same socket)
#       (guest_restart.rs; the test run does 10 kills and 4 upgrades).
#       SQCOW2_RESTART_LOG_FILE=FILE keeps the whole output.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh

usage() {
  sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//' >&2
  exit 2
}
name=${1:-}
[ -n "$name" ] || usage
shift

ensure_commands cc:gcc qemu-img:qemu-utils
# cargo test of the sqcow2 package, its output filtered to what matters.
run_tests() { # FILTER -- CARGO TEST ARGS...
  local filter=$1
  shift
  cargo build --workspace --locked
  cargo test --locked -p sqcow2-cli "$@" 2>&1 |
    tee "${LOG_FILE:-/dev/null}" | grep -E "$filter"
}

case $name in
  soak)
    export SQCOW2_SOAK_SECONDS=${1:-600} SQCOW2_SOAK_SIZE=${2:-1G}
    run_tests "^(soak|test result)|panicked|failed" --test soak -- --nocapture ;;
  stress)
    export SQCOW2_STRESS_SECONDS=${1:-300} SQCOW2_STRESS_SEED=${2:-7}
    export SQCOW2_HAZARD_SNAPSHOTS=${3:-500}
    run_tests "requests,|snapshots under|^test |test result|panicked|failed" \
      --test stress --test hazards -- --nocapture --test-threads 1 ;;
  crash-loop)
    export SQCOW2_CRASH_ITERATIONS=${1:-100} SQCOW2_CRASH_SEED=${2:-$RANDOM}
    echo "crash loop: $SQCOW2_CRASH_ITERATIONS rounds, seed $SQCOW2_CRASH_SEED"
    LOG_FILE=${SQCOW2_CRASH_LOG:-} run_tests \
      "^(round|crash loop|test result)|panicked|failed|after reopening" \
      --test crash_loop -- --nocapture ;;
  kill-index-builds)
    export SQCOW2_BUILD_KILLS=${1:-50} SQCOW2_SNAPSHOT_KILLS=${1:-50}
    run_tests "kills[,:]|^test |test result|panicked|failed" \
      --test live_snapshot kills_ -- --nocapture --test-threads 1 ;;
  kill-merges)
    export SQCOW2_MERGE_KILLS=${1:-50} SQCOW2_MERGE_SEED=${2:-41}
    run_tests "kills during|^test |test result|panicked|failed" \
      --test live_merge kills_during_live_merges -- --nocapture ;;
  kill-commits)
    export SQCOW2_COMMIT_KILLS=${1:-50} SQCOW2_COMMIT_SEED=${2:-43}
    run_tests "kills during|^test |test result|panicked|failed" \
      --test live_commit kills_during_live_commits -- --nocapture ;;
  guest-restart)
    ensure_commands qemu-system-x86_64:qemu-system-x86 busybox:busybox-static
    ensure_commands qemu-img:qemu-utils qemu-io:qemu-utils
    SQCOW2_GUEST_KIT=$(scripts/guest-kit.sh)
    export SQCOW2_GUEST_KIT
    export SQCOW2_RESTARTS=${1:-50} SQCOW2_RESTART_SEED=${2:-$RANDOM}
    echo "guest restart loop: $SQCOW2_RESTARTS kills and $SQCOW2_RESTARTS upgrades, seed $SQCOW2_RESTART_SEED"
    LOG_FILE=${SQCOW2_RESTART_LOG_FILE:-} run_tests \
      "^(guest restart loop|test result)|panicked|failed|differs|saw errors" \
      --test guest_restart -- --nocapture --test-threads 1 ;;
  *) usage ;;
esac
