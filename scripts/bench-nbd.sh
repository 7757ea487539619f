#!/usr/bin/env bash
# nbdcopy of a whole disk from `sqcow2 serve --nbd` and from qemu-nbd
# on the same chains of 1 and 1000 layers (`sqcow2 gen-chain`, SIZE
# default 1G, half the clusters written), ROUNDS rounds with the two in
# turn; what a backup tool's full backup costs. Then, on the same
# server, `nbdinfo --map=qemu:allocation-depth` of the whole disk (page
# cache dropped again; qemu-nbd with -A), timed, and whether both
# servers' maps are equal.
#
#   scripts/bench-nbd.sh [ROUNDS]   (default 3)
#
# qemu-nbd at its best for this: read-only, `--aio=io_uring`, its
# default writeback cache, `--shared` as nbdcopy's connections
# (4); sqcow2 serves read-only exports with every connection on one
# chain. The page cache of the images is dropped before each copy.
# Prints MB/s medians and sqcow2/qemu-nbd; raw results in $OUT (default
# /tmp/sqcow2-bench-nbd).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
. scripts/lib/bench.sh
ensure_commands qemu-img:qemu-utils qemu-nbd:qemu-utils nbdcopy:libnbd-bin nbdinfo:libnbd-bin

rounds=${1:-3}
out=${OUT:-/tmp/sqcow2-bench-nbd}
size=${SIZE:-1G}
root=$PWD

echo "==> building (release)" >&2
cargo build --release --locked -p sqcow2-cli >&2
sq=$root/target/release/sqcow2

rm -rf "$out" && mkdir -p "$out"
cd "$out"

# copy SERVER LAYERS ROUND
copy() {
  local server=$1 layers=$2 round=$3 dir top t0 t1 mbs
  dir=$PWD/chain$layers
  top=$(cat "$dir/top")
  rm -f n.sock v.sock
  drop_cache "$dir"
  if [ "$server" = sqcow2 ]; then
    "$sq" serve --socket v.sock --nbd "unix:$PWD/n.sock" "$top" 2>>sqcow2.log &
  else
    qemu-nbd -r -t -A --aio=io_uring --shared=8 -f qcow2 -k "$PWD/n.sock" "$top" 2>>qemu-nbd.log &
  fi
  local pid=$!
  wait_socket n.sock
  t0=$(date +%s.%N)
  nbdcopy "nbd+unix:///?socket=$PWD/n.sock" null:
  t1=$(date +%s.%N)
  # The allocation-depth map, the images' page cache dropped again.
  drop_cache "$dir"
  local m0 m1 msecs
  m0=$(date +%s.%N)
  nbdinfo --map=qemu:allocation-depth "nbd+unix:///?socket=$PWD/n.sock" >"map-$server-$layers.txt"
  m1=$(date +%s.%N)
  kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  mbs=$(python3 -c "print(round($(numfmt --from=iec "$size") / 1e6 / ($t1 - $t0), 1))")
  msecs=$(python3 -c "print(round($m1 - $m0, 3))")
  printf '%s\t%s\t%s\t%s\n' "$server" "$layers" "$round" "$mbs" >> results.tsv
  printf '%s\t%s\t%s\t%s\n' "$server" "$layers" "$round" "$msecs" >> maps.tsv
  echo "  $server $layers layers round $round: $mbs MB/s, depth map $msecs s" >&2
}

for layers in 1 1000; do
  echo "==> chain of $layers layers ($size)" >&2
  mkdir -p "chain$layers"
  "$sq" gen-chain --layers "$layers" --size "$size" "chain$layers" |
    xargs readlink -f > "chain$layers/top"
  # The index written (a first serve), so that no build runs during a copy.
  rm -f v.sock
  "$sq" upgrade "$(cat "chain$layers/top")" >/dev/null
done

for round in $(seq "$rounds"); do
  for layers in 1 1000; do
    if [ $((round % 2)) = 1 ]; then order="sqcow2 qemu-nbd"; else order="qemu-nbd sqcow2"; fi
    for s in $order; do copy "$s" "$layers" "$round"; done
  done
done

python3 - <<'EOF'
import statistics


def medians(path):
    med = {}
    for line in open(path).read().split("\n"):
        if line:
            server, layers, _, value = line.split("\t")
            med.setdefault((server, layers), []).append(float(value))
    return {k: statistics.median(v) for k, v in med.items()}


copy, maps = medians("results.tsv"), medians("maps.tsv")
print("| layers | sqcow2 MB/s | qemu-nbd MB/s | sqcow2 / qemu-nbd |")
print("| ---: | ---: | ---: | ---: |")
for layers in ("1", "1000"):
    a, b = copy[("sqcow2", layers)], copy[("qemu-nbd", layers)]
    print(f"| {layers} | {a:.0f} | {b:.0f} | {a / b:.2f} |")
print()
print("| layers | depth map, sqcow2 s | qemu-nbd s | qemu-nbd / sqcow2 |")
print("| ---: | ---: | ---: | ---: |")
for layers in ("1", "1000"):
    a, b = maps[("sqcow2", layers)], maps[("qemu-nbd", layers)]
    print(f"| {layers} | {a:.3f} | {b:.3f} | {b / a:.1f} |")
EOF
for layers in 1 1000; do
  if cmp -s "map-sqcow2-$layers.txt" "map-qemu-nbd-$layers.txt"; then same=yes; else same=NO; fi
  echo "allocation-depth maps equal at $layers layers: $same"
done
