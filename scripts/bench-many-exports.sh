#!/usr/bin/env bash
# One daemon for many disks (issue 47), side by side in one run: N
# exports whose 100-layer chains share a 95-layer base (each with its own
# 5 layers on top), served by one `sqcow2 serve --export ...` daemon, by N
# separate `sqcow2 serve` processes, and by one qemu-storage-daemon
# (aio=io_uring, the exports spread over 2 polling iothreads), to N
# libblkio clients (`sqcow2-bench load`, random 4 KiB reads at depth 4,
# all exports at once). Then, on the one daemon: a second export's cold
# random reads once another has read the disk, I/O limit accuracy from
# 1k to 100k IOPS, and an unthrottled neighbour's p99 beside a hammered
# (throttled) export.
#
#   scripts/bench-many-exports.sh [SECONDS]   (default 5)
#
# EXPORTS (default "16 64"), SIZE (default 1G). Every export is
# read-only (the loads read; no server changes the images). Raw results
# in $OUT (default /tmp/sqcow2-bench-many-exports).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
. scripts/lib/bench.sh
ensure_commands qemu-img:qemu-utils qemu-storage-daemon:qemu-system-x86

secs=${1:-5}
# PARTS: which measurements (default all three).
parts=${PARTS:-scale cold limits}
# ROUNDS: rounds of the neighbour's p99 (default 3).
rounds=${ROUNDS:-3}
want() { [[ " $parts " == *" $1 "* ]]; }
out=${OUT:-/tmp/sqcow2-bench-many-exports}
size=${SIZE:-1G}
counts=${EXPORTS:-16 64}
qsd=${QSD:-qemu-storage-daemon}
root=$PWD
max=0
for n in $counts; do [ "$n" -gt "$max" ] && max=$n; done
# 100 layers a chain, opened once per chain by N processes or qsd.
ulimit -n "$(ulimit -Hn)"

echo "==> building (release)" >&2
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
sq=$root/target/release/sqcow2
load=$root/target/release/sqcow2-bench

rm -rf "$out" && mkdir -p "$out/img"
cd "$out"
echo "==> a 95-layer base ($size) and $max chains of 5 layers over it" >&2
base=$("$sq" gen-chain --layers 95 --size "$size" img | xargs readlink -f)
clusters=$(($(numfmt --from=iec "$size") / 65536))
for i in $(seq 0 $((max - 1))); do
  below=$base
  for k in 1 2 3 4 5; do
    top=$PWD/img/e$i-l$k.qcow2
    "$sq" snapshot "$below" "$top" >/dev/null
    cmds=()
    for w in 1 2 3 4; do
      cmds+=(-c "write -P $(((i * 5 + k) % 250 + 1)) $(((RANDOM * 32768 + RANDOM) % clusters * 65536)) 64k")
    done
    "$sq" io "${cmds[@]}" "$top" >/dev/null
    below=$top
  done
  # The top's own index, as a writable daemon writes it in the
  # background (a read-only one serves through the base's, walking the
  # 5 layers above it).
  "$sq" upgrade "$below" >/dev/null
  echo "$below" > "img/e$i.top"
done
# The physical limit of cold reads: a raw file of the disk's size.
python3 - "$size" <<'EOF'
import os, subprocess, sys
n = int(subprocess.check_output(["numfmt", "--from=iec", sys.argv[1]]))
with open("raw.img", "wb") as f:
    chunk = os.urandom(1 << 20)
    for _ in range(n >> 20):
        f.write(chunk)
EOF

# rss_kib PID: resident set now; hwm_kib PID: its peak.
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
hwm_kib() { awk '/^VmHWM/ {print $2}' "/proc/$1/status"; }


pids=()
stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap stop_all EXIT

# WALK="--walk": chains walked layer by layer (as chains QEMU made are
# served read-only), not through their index.
walk=()

# serve_one N: one sqcow2 daemon with exports e0..eN-1.
serve_one() {
  local args=() i
  for i in $(seq 0 $(($1 - 1))); do
    args+=(--export "socket=$PWD/e$i.sock,image=$(cat img/e$i.top),id=e$i,read-only=on")
  done
  rm -f ./*.sock
  "$sq" serve "${walk[@]}" --control ctl.sock --cache-size 1M --shared-cache-size 32M "${args[@]}" 2>>sqcow2.log &
  pids=($!)
  wait_socket ctl.sock
  for i in $(seq 0 $(($1 - 1))); do wait_socket "e$i.sock"; done
}

# serve_each N: N sqcow2 daemons, one export each.
serve_each() {
  local i
  rm -f ./*.sock
  pids=()
  for i in $(seq 0 $(($1 - 1))); do
    "$sq" serve "${walk[@]}" --read-only --cache-size 1M --socket "e$i.sock" "$(cat img/e$i.top)" 2>>sqcow2-each.log &
    pids+=($!)
  done
  for i in $(seq 0 $(($1 - 1))); do wait_socket "e$i.sock"; done
}

# serve_qsd N: one qemu-storage-daemon with N exports over 2 iothreads.
serve_qsd() {
  local args=(--object iothread,id=iot0,poll-max-ns=32000 --object iothread,id=iot1,poll-max-ns=32000) i
  for i in $(seq 0 $(($1 - 1))); do
    args+=(--blockdev "driver=file,node-name=f$i,filename=$(cat img/e$i.top),aio=io_uring,read-only=on")
    args+=(--blockdev "driver=qcow2,node-name=d$i,file=f$i,read-only=on")
    args+=(--export "type=vhost-user-blk,id=x$i,node-name=d$i,addr.type=unix,addr.path=$PWD/e$i.sock,writable=off,iothread=iot$((i % 2))")
  done
  rm -f ./*.sock
  "$qsd" "${args[@]}" 2>>qsd.log &
  pids=($!)
  for i in $(seq 0 $(($1 - 1))); do wait_socket "e$i.sock"; done
}

# loads N TAG: N clients at once; their JSON in TAG-eI.json.
loads() {
  local i lp=()
  for i in $(seq 0 $(($1 - 1))); do
    "$load" load --socket "e$i.sock" --pattern rand-read --bs 4k --iodepth 4 \
      --duration "$secs" --output json > "$2-e$i.json" &
    lp+=($!)
  done
  for p in "${lp[@]}"; do wait "$p"; done
}

# total_kib: resident sets of the servers now, summed.
total_kib() {
  local s=0 p
  for p in "${pids[@]}"; do s=$((s + $(rss_kib "$p"))); done
  echo $s
}

: > scale.tsv
want scale && for n in $counts; do
  for server in one each qsd; do
    echo "==> $n exports, $server" >&2
    drop_cache img all
    case $server in
      one) serve_one "$n" ;;
      each) serve_each "$n" ;;
      qsd) serve_qsd "$n" ;;
    esac
    loads "$n" "$server-$n"
    rss=$(total_kib)
    hwm=0
    for p in "${pids[@]}"; do hwm=$((hwm + $(hwm_kib "$p"))); done
    if [ "$server" = one ]; then
      "$sq" stats --export-id e0 ctl.sock --output json > "one-$n-stats.json"
    fi
    stop_all
    python3 - "$server" "$n" "$rss" "$hwm" "$server-$n" >> scale.tsv <<'EOF'
import json, sys
server, n, rss, hwm, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
runs = [json.load(open(f"{tag}-e{i}.json")) for i in range(n)]
iops = [r["iops"] for r in runs]
errors = sum(r["errors"] for r in runs)
p99 = sorted(r["lat_p99_us"] for r in runs)
print("\t".join(map(str, [server, n, sum(iops), min(iops), max(iops), p99[len(p99) // 2], rss, hwm, errors])))
EOF
    tail -1 scale.tsv >&2
  done
done

# Cold reads: export e0 reads at random on a dropped page cache (the
# first export, nothing warm); then reads the whole disk; then e1 (its
# first I/O ever) reads at random: the same load, over a warmed base.
cold() {
  drop_cache img all
  "$load" load --socket e0.sock --pattern rand-read --bs 4k --iodepth 1 --duration "$secs" --timeline-ms 10 --output json > "cold-$1-first.json"
  "$load" load --socket e0.sock --pattern seq-read --bs 1M --iodepth 4 --duration 30 --output json > /dev/null
  "$load" load --socket e1.sock --pattern rand-read --bs 4k --iodepth 1 --duration "$secs" --timeline-ms 10 --output json > "cold-$1-second.json"
}
if want cold; then
echo "==> cold reads" >&2
# The same loads on the raw file (io_uring, no server): the storage's own
# cold/warm ratio.
drop_cache . all
"$load" load --file raw.img --pattern rand-read --bs 4k --iodepth 1 --duration "$secs" --timeline-ms 10 --output json > cold-raw-first.json
"$load" load --file raw.img --pattern seq-read --bs 1M --iodepth 4 --duration 30 --output json > /dev/null
"$load" load --file raw.img --pattern rand-read --bs 4k --iodepth 1 --duration "$secs" --timeline-ms 10 --output json > cold-raw-second.json
serve_one 2; cold one; stop_all
serve_each 2; cold each; stop_all
serve_qsd 2; cold qsd; stop_all
# Walked: a cold read loads a table of each layer that may hold it.
walk=(--walk)
serve_one 2; cold one-walk; stop_all
serve_each 2; cold each-walk; stop_all
walk=()
fi

# Limits: e0 limited live to each rate at depth 32; then e1's p99 at
# depth 1 alone, and beside e0 hammered at depth 32 (limited to 5k IOPS).
if want limits; then
echo "==> limits" >&2
serve_one 2
"$load" load --socket e0.sock --pattern rand-read --bs 4k --iodepth 32 --duration "$secs" --output json > limit-none.json
for rate in 1000 10000 100000; do
  "$sq" set-io-throttle --export-id e0 ctl.sock "iops-total=$rate" > /dev/null
  "$load" load --socket e0.sock --pattern rand-read --bs 4k --iodepth 32 --duration "$secs" --output json > "limit-$rate.json"
done
"$sq" set-io-throttle --export-id e0 ctl.sock "iops-total=5000" > /dev/null
for round in $(seq "$rounds"); do
  "$load" load --socket e1.sock --pattern rand-read --bs 4k --iodepth 1 --duration "$secs" --output json > "neighbour-alone-$round.json"
  "$load" load --socket e0.sock --pattern rand-read --bs 4k --iodepth 32 --duration "$((secs + 2))" --output json > "hammer-$round.json" &
  hp=$!
  sleep 1
  "$load" load --socket e1.sock --pattern rand-read --bs 4k --iodepth 1 --duration "$secs" --output json > "neighbour-beside-$round.json"
  wait "$hp"
done
stop_all
fi

python3 - <<'EOF'
import json, statistics
def j(p): return json.load(open(p))
import os
names = {"one": "sqcow2, one daemon", "each": "sqcow2, a process each", "qsd": "qemu-storage-daemon"}
if os.path.getsize("scale.tsv"):
  print("### Many exports: total IOPS and memory (random 4 KiB reads, depth 4, every export at once)\n")
  print("| exports | server | total IOPS | per export min / max | median p99 µs | RSS MiB (sum) | peak RSS MiB | errors |")
  print("|---:|---|---:|---:|---:|---:|---:|---:|")
  rows = [l.split("\t") for l in open("scale.tsv")]
  by = {(r[0], r[1]): r for r in rows}
  for r in rows:
      s, n, tot, lo, hi, p99, rss, hwm, err = r
      print(f"| {n} | {names[s]} | {float(tot):,.0f} | {float(lo):,.0f} / {float(hi):,.0f} | {float(p99):.0f} | {int(rss)/1024:.1f} | {int(hwm)/1024:.1f} | {err.strip()} |")
  print()
  for n in sorted({r[1] for r in rows}, key=int):
      one, each, q = (float(by[(s, n)][2]) for s in ("one", "each", "qsd"))
      print(f"{n} exports: one daemon / a process each {one/each:.2f}x, / qemu-storage-daemon {one/q:.2f}x; "
            f"RSS one daemon {int(by[('one', n)][6])/1024:.1f} MiB vs {int(by[('each', n)][6])/1024:.1f} and {int(by[('qsd', n)][6])/1024:.1f} MiB")
if os.path.exists("cold-one-first.json"):
  print("\n### A second export's cold random reads (depth 1) once another has read the disk\n")
  print("Reads a second over the first 50 ms (the first reads: what is cold is loaded then) and over the whole window.\n")
  print("| server | first export, first 50 ms | second export, first 50 ms | ratio | first export, window | second export, window | ratio |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  names["raw"] = "the raw file itself (no server: the storage's limit)"
  names["one-walk"] = "sqcow2, one daemon, chains walked (--walk)"
  names["each-walk"] = "sqcow2, a process each, chains walked (--walk)"
  def early(d):
      t = d.get("timeline_iops") or [d["iops"]]
      return statistics.mean(t[:5])
  for s in ("one", "each", "qsd", "raw", "one-walk", "each-walk"):
      a, b = j(f"cold-{s}-first.json"), j(f"cold-{s}-second.json")
      ea, eb = early(a), early(b)
      print(f"| {names[s]} | {ea:,.0f} | {eb:,.0f} | {eb/ea:.1f}x | {a['iops']:,.0f} | {b['iops']:,.0f} | {b['iops']/a['iops']:.1f}x |")
if os.path.exists("limit-none.json"):
  print("\n### Limits (one export, depth 32)\n")
  print(f"Unlimited: {j('limit-none.json')['iops']:,.0f} IOPS.\n")
  print("| iops-total | achieved | achieved / limit |")
  print("|---:|---:|---:|")
  for rate in (1000, 10000, 100000):
      got = j(f"limit-{rate}.json")["iops"]
      print(f"| {rate:,} | {got:,.0f} | {got/rate:.3f} |")
  print("\n### An unthrottled neighbour's p99 (depth 1) beside an export hammered at depth 32, limited to 5k IOPS\n")
  print("| round | alone p99 µs | beside p99 µs | ratio | hammered export IOPS |")
  print("|---:|---:|---:|---:|---:|")
  ratios = []
  r = 1
  while os.path.exists(f"neighbour-alone-{r}.json"):
      a, b = j(f"neighbour-alone-{r}.json")["lat_p99_us"], j(f"neighbour-beside-{r}.json")["lat_p99_us"]
      ratios.append(b / a)
      print(f"| {r} | {a:.0f} | {b:.0f} | {b/a:.2f}x | {j(f'hammer-{r}.json')['iops']:,.0f} |")
      r += 1
  print(f"\nMedian ratio {statistics.median(ratios):.2f}x.")
EOF
