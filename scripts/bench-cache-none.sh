#!/usr/bin/env bash
# cache=none side by side: `sqcow2 serve --cache none` against
# qemu-storage-daemon with cache.direct=on, aio=io_uring and the export
# in a polling iothread (QEMU at its best for O_DIRECT), on the same
# chains of 1 and 1000 layers, ROUNDS rounds with the servers' order
# alternating; one libblkio client (sqcow2-bench load) drives both.
#
#   scripts/bench-cache-none.sh [ROUNDS] [SECONDS]   (defaults: 2, 4)
#
# Chains: `sqcow2 gen-chain --size $SIZE` (default 1G, half the clusters
# written, spread over the layers). Each load gets a fresh empty top
# (`sqcow2 snapshot` for sqcow2, served once its index is written;
# `qemu-img create -b` for QEMU), so writes land in a new layer: the
# first write of a cluster allocates it (copying the rest from below),
# later ones overwrite. Every image's page cache is dropped before each
# load and counted (fincore) after it.
# Loads (1 queue): rr-4k-1 / rr-4k-32 random 4 KiB reads at depth 1 / 32,
# rw-4k-1 / rw-4k-32 random 4 KiB writes, seq-1m sequential 1 MiB reads
# at depth 4.
# Prints a table of medians: IOPS (MB/s for seq-1m) of each server,
# sqcow2/qsd, each server's CPU time per request (user + system, all its
# threads, over the load) and the pages of the images cached after it.
# Raw results in $OUT (default /tmp/sqcow2-bench-cache-none).
# POLL_US (default 32) is the longest adaptive poll of both servers
# (sqcow2 `--poll-max-us`, the iothread's `poll-max-ns`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
. scripts/lib/bench.sh
ensure_commands qemu-img:qemu-utils qemu-storage-daemon:qemu-system-x86 fincore:util-linux-extra

rounds=${1:-2}
secs=${2:-4}
out=${OUT:-/tmp/sqcow2-bench-cache-none}
size=${SIZE:-1G}
qsd=${QSD:-qemu-storage-daemon}
poll_us=${POLL_US:-32}
root=$PWD

echo "==> building (release)" >&2
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
sq=$root/target/release/sqcow2
load=$root/target/release/sqcow2-bench

rm -rf "$out" && mkdir -p "$out"
cd "$out"

# Writes back and drops the page cache of every image in DIR.
# User + system clock ticks of process PID, all its threads.
cpu_ticks() {
  awk '{print $14 + $15}' "/proc/$1/stat"
}

cached_pages() {
  fincore --raw --noheadings --output PAGES "$1"/*.qcow2 | awk '{s += $1} END {print s + 0}'
}

serve_sqcow2() {
  rm -f v.sock c.sock
  "$sq" serve --cache none --poll-max-us "$poll_us" --socket v.sock --control c.sock "$1" 2>>sqcow2.log &
  pid=$!
  wait_socket c.sock
  for _ in $(seq 1200); do
    "$sq" stats c.sock --output json | python3 -c '
import json, sys
i = json.load(sys.stdin)["index"]
sys.exit(0 if i["pending-layers"] == 0 and not i["building"] and i["walking-because"] is None else 1)' \
      && return 0
    sleep 0.1
  done
  echo "sqcow2 never indexed $1" >&2; return 1
}

serve_qsd() {
  rm -f v.sock
  "$qsd" --object iothread,id=iot0,poll-max-ns=$((poll_us * 1000)) \
    --blockdev "driver=file,node-name=file,filename=$1,aio=io_uring,cache.direct=on" \
    --blockdev driver=qcow2,node-name=disk,file=file,cache.direct=on \
    --export type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path=v.sock,writable=on,iothread=iot0 \
    2>>qsd.log &
  pid=$!
  wait_socket v.sock
}

# run SERVER LAYERS LOAD ROUND: one measurement, appended to results.tsv
run() {
  local server=$1 layers=$2 name=$3 round=$4 pattern bs depth top dir
  case $name in
    rr-4k-1) pattern=rand-read bs=4k depth=1 ;;
    rr-4k-32) pattern=rand-read bs=4k depth=32 ;;
    rw-4k-1) pattern=rand-write bs=4k depth=1 ;;
    rw-4k-32) pattern=rand-write bs=4k depth=32 ;;
    seq-1m) pattern=seq-read bs=1M depth=4 ;;
  esac
  dir=$PWD/chain$layers
  top=$dir/fresh-$server-$name-$round.qcow2
  local below
  below=$(cat "$dir/top")
  if [ "$server" = sqcow2 ]; then
    "$sq" snapshot "$below" "$top" >/dev/null
  else
    qemu-img create -q -f qcow2 -u -b "$below" -F qcow2 "$top" "$size"
  fi
  drop_cache "$dir"
  if [ "$server" = sqcow2 ]; then serve_sqcow2 "$top"; else serve_qsd "$top"; fi
  # What starting the server cached (metadata read at open) is not the
  # load's.
  local before after json iops mbs
  before=$(cached_pages "$dir")
  local t0 t1
  t0=$(cpu_ticks "$pid")
  json=$("$load" load --socket v.sock --pattern "$pattern" --bs "$bs" \
    --iodepth "$depth" --duration "$secs" --output json)
  after=$(cached_pages "$dir")
  t1=$(cpu_ticks "$pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$json" > "$server-$layers-$name-$round.json"
  iops=$(echo "$json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["iops"])')
  mbs=$(echo "$json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["mb_per_s"])')
  local cpu_us
  cpu_us=$(python3 -c "print(($t1 - $t0) * 1e6 / $(getconf CLK_TCK) / ($iops * $secs))")
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$server" "$layers" "$name" "$round" "$iops" "$mbs" "$((after - before))" "$cpu_us" >> results.tsv
  echo "  $server $layers layers $name round $round: $iops IOPS, $mbs MB/s, CPU $cpu_us us per request, pages cached by the load: $((after - before))" >&2
  rm -f "$top" "$top".sq*
}

loads=${LOADS:-rr-4k-1 rr-4k-32 rw-4k-1 rw-4k-32 seq-1m}
lengths=${LAYERS:-1 1000}
for layers in $lengths; do
  echo "==> chain of $layers layers ($size)" >&2
  mkdir -p "chain$layers"
  "$sq" gen-chain --layers "$layers" --size "$size" "chain$layers" |
    xargs readlink -f > "chain$layers/top"
done
for round in $(seq "$rounds"); do
  for name in $loads; do
    for layers in $lengths; do
      order="sqcow2 qsd"
      [ $((round % 2)) = 1 ] || order="qsd sqcow2"
      for server in $order; do run "$server" "$layers" "$name" "$round"; done
    done
  done
done
for layers in $lengths; do rm -rf "chain$layers"; done

python3 - "$out/results.tsv" <<'EOF'
import sys, statistics, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    server, layers, name, _, iops, mbs, pages, cpu = line.split("\t")
    rows[(server, int(layers), name)].append((float(iops), float(mbs), int(pages), float(cpu)))
def med(k, i):
    v = rows.get(k)
    return statistics.median(x[i] for x in v) if v else None
order = ["rr-4k-1", "rr-4k-32", "rw-4k-1", "rw-4k-32", "seq-1m"]
names = sorted({k[2] for k in rows}, key=order.index)
layers = sorted({k[1] for k in rows})
print("| load | layers | sqcow2 --cache none | qsd cache.direct=on | sqcow2/qsd | CPU µs per request: sqcow2 | qsd | pages cached: sqcow2 | qsd |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for n in names:
    i = 1 if n == "seq-1m" else 0
    unit = " MB/s" if i else ""
    for l in layers:
        s, q = med(("sqcow2", l, n), i), med(("qsd", l, n), i)
        ps, pq = med(("sqcow2", l, n), 2), med(("qsd", l, n), 2)
        cs, cq = med(("sqcow2", l, n), 3), med(("qsd", l, n), 3)
        print(f"| {n} | {l} | {s:,.0f}{unit} | {q:,.0f}{unit} | {s/q:.2f}x | {cs:.1f} | {cq:.1f} | {ps:.0f} | {pq:.0f} |")
EOF
