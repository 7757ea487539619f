#!/usr/bin/env bash
# Allocating writes into a fresh top over chains of 1, 100 and 1000 layers
# (LAYERS="1 100 1000 10000" for more), sqcow2 against qemu-storage-daemon
# at its best (aio=io_uring, the export in a polling iothread), measured
# side by side in one run, ROUNDS rounds with the servers' order
# alternating; one libblkio client (sqcow2-bench load) drives both.
#
#   scripts/bench-chain-writes.sh [ROUNDS] [SECONDS]   (defaults: 2, 5)
#
# Chains: `sqcow2 gen-chain --size $SIZE --fill $FILL` (default 10G, 0.05:
# the issue's chains). Each load gets a fresh top: `sqcow2 snapshot` for
# sqcow2 (served once the daemon has written the top's index), `qemu-img
# create -b` for QEMU. Loads (1 queue; every write into a cluster not
# written before, `rand-write-new`, so every write allocates and copies
# the rest of its cluster from below):
#   new-4k-1   4 KiB at depth 1      new-4k-16  4 KiB at depth 16
#   new-64k-16 64 KiB at depth 16
# Prints a table of medians: IOPS of each server, sqcow2/qsd, sqcow2 at N
# layers / sqcow2 at 1 layer, and the server's CPU time per write (µs).
# Raw results in $OUT (default /tmp/sqcow2-bench-chain-writes).
# SERVERS=sqcow2 leaves qemu-storage-daemon out (it opens every layer at
# start: minutes at 10,000 layers).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
. scripts/lib/bench.sh
ensure_commands qemu-img:qemu-utils qemu-storage-daemon:qemu-system-x86

rounds=${1:-2}
secs=${2:-5}
out=${OUT:-/tmp/sqcow2-bench-chain-writes}
size=${SIZE:-10G}
fill=${FILL:-0.05}
qsd=${QSD:-qemu-storage-daemon}
root=$PWD

echo "==> building (release)" >&2
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
sq=$root/target/release/sqcow2
load=$root/target/release/sqcow2-bench

rm -rf "$out" && mkdir -p "$out"
cd "$out"

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# serve_sqcow2 TOP: starts sqcow2 serve on a fresh top, waits for its index
serve_sqcow2() {
  rm -f v.sock c.sock
  "$sq" serve --socket v.sock --control c.sock "$1" 2>>sqcow2.log &
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
  "$qsd" --object iothread,id=iot0,poll-max-ns=32768 \
    --blockdev "driver=file,node-name=file,filename=$1,aio=io_uring" \
    --blockdev driver=qcow2,node-name=disk,file=file \
    --export type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path=v.sock,writable=on,iothread=iot0 \
    2>>qsd.log &
  pid=$!
  wait_socket v.sock
}

# run SERVER LAYERS LOAD ROUND: one measurement, appended to results.tsv
run() {
  local server=$1 layers=$2 name=$3 round=$4 bs depth top
  case $name in
    new-4k-1) bs=4k depth=1 ;;
    new-4k-16) bs=4k depth=16 ;;
    new-64k-16) bs=64k depth=16 ;;
  esac
  top=$PWD/chain$layers/fresh-$server-$name-$round.qcow2
  local below
  below=$(cat "chain$layers/top")
  if [ "$server" = sqcow2 ]; then
    "$sq" snapshot "$below" "$top" >/dev/null
    serve_sqcow2 "$top"
  else
    # -u with the size: qemu-img would otherwise open the whole chain
    # (over 11 minutes of CPU for 10,000 layers).
    qemu-img create -q -f qcow2 -u -b "$below" -F qcow2 "$top" "$size"
    serve_qsd "$top"
  fi
  local t0 t1 json iops ios
  t0=$(cpu_ticks "$pid")
  json=$("$load" load --socket v.sock --pattern rand-write-new --bs "$bs" \
    --iodepth "$depth" --duration "$secs" --output json)
  t1=$(cpu_ticks "$pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$json" > "$server-$layers-$name-$round.json"
  iops=$(echo "$json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["iops"])')
  ios=$(echo "$json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ios"])')
  local hz; hz=$(getconf CLK_TCK)
  local cpu_us; cpu_us=$(python3 -c "print(($t1-$t0)/$hz*1e6/max($ios,1))")
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$server" "$layers" "$name" "$round" "$iops" "$cpu_us" >> results.tsv
  echo "  $server $layers layers $name round $round: $iops IOPS, $cpu_us µs CPU/write" >&2
  rm -f "$top" "$top".sq*
}

loads=${LOADS:-new-4k-1 new-4k-16 new-64k-16}
lengths=${LAYERS:-1 100 1000}
for layers in $lengths; do
  echo "==> chain of $layers layers ($size, fill $fill)" >&2
  mkdir -p "chain$layers"
  "$sq" gen-chain --layers "$layers" --size "$size" --fill "$fill" "chain$layers" |
    xargs readlink -f > "chain$layers/top"
done
# Chain lengths interleaved within a round, so that the machine's drift
# over the run (page cache, the disk freeing earlier tops) falls on all.
for round in $(seq "$rounds"); do
  for name in $loads; do
    for layers in $lengths; do
      servers=${SERVERS:-sqcow2 qsd}
      order=$servers
      [ $((round % 2)) = 1 ] || order=$(echo "$servers" | tr ' ' '\n' | tac | tr '\n' ' ')
      for server in $order; do run "$server" "$layers" "$name" "$round"; done
    done
  done
done
for layers in $lengths; do rm -rf "chain$layers"; done

python3 - "$out/results.tsv" <<'EOF'
import sys, statistics, collections
rows = collections.defaultdict(list)
cpu = collections.defaultdict(list)
for line in open(sys.argv[1]):
    server, layers, name, _, iops, cpu_us = line.split("\t")
    rows[(server, int(layers), name)].append(float(iops))
    cpu[(server, int(layers), name)].append(float(cpu_us))
med = {k: statistics.median(v) for k, v in rows.items()}
cmed = {k: statistics.median(v) for k, v in cpu.items()}
layers = sorted({k[1] for k in med})
names = sorted({k[2] for k in med}, key=lambda n: ["new-4k-1", "new-4k-16", "new-64k-16"].index(n))
print("| load | layers | sqcow2 IOPS | qsd IOPS | sqcow2/qsd | sqcow2 vs 1 layer | sqcow2 CPU µs/write | vs 1 layer | qsd CPU µs/write |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for n in names:
    for l in layers:
        s, q = med.get(("sqcow2", l, n)), med.get(("qsd", l, n))
        one = med.get(("sqcow2", min(layers), n))
        c, c1, cq = cmed.get(("sqcow2", l, n)), cmed.get(("sqcow2", min(layers), n)), cmed.get(("qsd", l, n))
        qs = f"{q:,.0f}" if q else "-"
        ratio = f"{s/q:.2f}x" if q else "-"
        cqs = f"{cq:.1f}" if cq else "-"
        print(f"| {n} | {l} | {s:,.0f} | {qs} | {ratio} | {s/one:.2f}x | {c:.1f} | {c/c1:.2f}x | {cqs} |")
EOF
