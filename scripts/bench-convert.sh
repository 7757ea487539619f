#!/usr/bin/env bash
# Flattening a long chain into one qcow2 image: `sqcow2 convert -O qcow2`
# against `qemu-img convert -O qcow2`, plain and compressed (-c), on the
# same chain in one run; each output checked identical to the chain with
# `qemu-img compare`. qemu-img goes first in every pair (the chain's
# pages are then in the page cache for sqcow2 and qemu-img alike after
# the first pair).
#
#   scripts/bench-convert.sh [LAYERS] [SIZE]   (defaults: 1000, 1G)
#
# Prints a table: seconds and peak RSS of each, and qemu-img / sqcow2.
# Files in $OUT (default /tmp/sqcow2-bench-convert), removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands qemu-img:qemu-utils

layers=${1:-1000}
size=${2:-1G}
out=${OUT:-/tmp/sqcow2-bench-convert}
root=$PWD

echo "==> building (release)" >&2
cargo build --release --locked -p sqcow2-cli >&2
sq=$root/target/release/sqcow2

rm -rf "$out" && mkdir -p "$out/chain"
cd "$out"
echo "==> chain of $layers layers ($size)" >&2
top=$(readlink -f "$("$sq" gen-chain --layers "$layers" --size "$size" chain)")

# timed NAME CMD...: runs CMD, appends "NAME seconds rss_kib" to times.
timed() {
  local name=$1; shift
  /usr/bin/time -f "$name %e %M" -a -o times "$@"
}

for mode in plain compressed; do
  c=(); [ "$mode" = compressed ] && c=(-c)
  echo "==> $mode: qemu-img convert" >&2
  timed "qemu-img-$mode" qemu-img convert "${c[@]}" -O qcow2 "$top" "q-$mode.qcow2"
  echo "==> $mode: sqcow2 convert" >&2
  timed "sqcow2-$mode" "$sq" convert "${c[@]}" -O qcow2 "$top" "s-$mode.qcow2"
  qemu-img compare -q "$top" "s-$mode.qcow2"
  qemu-img compare -q "$top" "q-$mode.qcow2"
  qemu-img check -q "s-$mode.qcow2"
  echo "$mode $(stat -c %s "s-$mode.qcow2") $(stat -c %s "q-$mode.qcow2")" >> sizes
done

python3 - "$layers" "$size" <<'EOF'
import sys
t = {}
for line in open("times"):
    name, secs, rss = line.split()
    t[name] = (float(secs), int(rss))
sizes = {l.split()[0]: (int(l.split()[1]), int(l.split()[2])) for l in open("sizes")}
print(f"Chain: {sys.argv[1]} layers, {sys.argv[2]} (gen-chain, half the clusters written).")
print()
print("| convert -O qcow2 | sqcow2 | qemu-img | qemu-img / sqcow2 | sqcow2 RSS | qemu-img RSS | output bytes (sqcow2 / qemu-img) |")
print("|---|---:|---:|---:|---:|---:|---:|")
for mode in ("plain", "compressed"):
    s, q = t[f"sqcow2-{mode}"], t[f"qemu-img-{mode}"]
    so, qo = sizes[mode]
    print(f"| {mode} | {s[0]:.2f} s | {q[0]:.2f} s | {q[0]/max(s[0], 0.01):.1f}x | {s[1]/1024:.0f} MiB | {q[1]/1024:.0f} MiB | {so:,} / {qo:,} |")
EOF
cd / && rm -rf "$out"
