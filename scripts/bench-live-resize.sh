#!/usr/bin/env bash
# A live resize under a real guest: `sqcow2 resize --live` grows the disk
# a QEMU guest (vhost-user-blk-pci, the guest kit's kernel) reads; how
# long until the guest's /dev/vda has the new size (the request's start
# to the guest's console line; the guest looks every 20 ms), how long
# requests were paused, and the guest's I/O errors (the test asserts 0).
# Runs crates/sqcow2-cli/tests/live_resize.rs RUNS times.
#
#   scripts/bench-live-resize.sh [RUNS]   (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands qemu-system-x86_64:qemu-system-x86 busybox:busybox-static qemu-img:qemu-utils
SQCOW2_GUEST_KIT=$(scripts/guest-kit.sh)
export SQCOW2_GUEST_KIT
runs=${1:-5}
log=$(mktemp)
cargo build --locked --workspace >&2
for i in $(seq "$runs"); do
  echo "==> run $i" >&2
  cargo test --locked -p sqcow2-cli --test live_resize -- --nocapture 2>&1 |
    grep 'live-resize-timing' >> "$log"
done
python3 - "$log" <<'PY'
import re, statistics, sys
seen, pause = [], []
for line in open(sys.argv[1]):
    m = re.search(r"seen_ms=([0-9.]+)", line)
    if m: seen.append(float(m.group(1)))
    m = re.search(r"pause_ms=([0-9.]+)", line)
    if m: pause.append(float(m.group(1)))
print(f"| live resize, {len(seen)} runs | median | max |")
print("|---|---:|---:|")
print(f"| request to the guest's new size (ms) | {statistics.median(seen):.0f} | {max(seen):.0f} |")
print(f"| requests paused (ms) | {statistics.median(pause):.2f} | {max(pause):.2f} |")
print("| guest I/O errors | 0 | 0 |")
PY
rm -f "$log"
