#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer through cargo-fuzz, on the stable
# toolchain: no sanitizer, Rust's own checks catch memory errors).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Default: 15 s for each of the five targets (what .ci/run uses). A long
# run: scripts/fuzz.sh 3600. Each target starts from its committed seeds
# (fuzz/seeds/<target>) and regression inputs (fuzz/regressions/<target>,
# every crash found so far), and grows a working corpus in
# fuzz/corpus/<target> (not committed). A crash stops the run with the
# input saved under fuzz/artifacts/<target>/; fix it and add the input
# to fuzz/regressions/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
# libFuzzer is C++, built by libfuzzer-sys.
ensure_commands cc:gcc c++:g++
seconds=${1:-15}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(image_io chain_index virtio_request control_line nbd_session)

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi
cd fuzz
echo "== building fuzz targets"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! cargo fuzz build --sanitizer none --debug-assertions >"$log" 2>&1; then
    grep -E -A 12 "^error" "$log" | head -n 60 || tail -n 40 "$log"
    echo "fuzz targets failed to build"
    exit 1
fi
tail -n 1 "$log"
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t" "regressions/$t"
    echo "== fuzzing $t for ${seconds}s"
    status=0
    cargo fuzz run --sanitizer none --debug-assertions "$t" "corpus/$t" "seeds/$t" "regressions/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        >"$log" 2>&1 || status=$?
    grep -E "^(Done|stat::number_of_executed_units|stat::new_units_added|stat::peak_rss_mb)|INITED|panicked|deadly signal|ERROR|Test unit written" "$log" || true
    if [ "$status" -ne 0 ]; then
        tail -n 40 "$log"
        echo "fuzz target $t failed (exit $status)"
        exit 1
    fi
done
echo "fuzzing: all targets ran ${seconds}s without a crash"
