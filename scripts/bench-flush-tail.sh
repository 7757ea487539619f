#!/usr/bin/env bash
# The flush tail (issue 43, point 4): random 4 KiB allocating writes at
# depth 16 with a guest flush every 100 ms, into a fresh top over a 50 GiB
# 10-layer chain (`gen-chain --layers 10 --size 50G --fill 0.02`), images
# on tmpfs so that the disk's own stalls are out of the picture. Servers,
# measured side by side in one run, ROUNDS rounds with their order
# alternating:
#   sqcow2   sqcow2 serve
#   qsd      qemu-storage-daemon at its best (aio=io_uring, the export in a
#            polling iothread) on the same chain
#   raw      the same qemu-storage-daemon serving a raw file (the floor)
#   base     sqcow2 serve of another build, BASE_BIN=path (before/after;
#            SERVERS="base sqcow2 qsd raw")
# One libblkio client (sqcow2-bench load --flush-interval-ms) drives each.
#
#   scripts/bench-flush-tail.sh [ROUNDS] [SECONDS]   (defaults: 3, 10)
#
# DIR (default /dev/shm/sqcow2-flush-tail) holds the images; SIZE, LAYERS,
# FILL, DEPTH and INTERVAL_MS change the load. Prints a table of medians
# over the rounds: IOPS, write p99, longest request, flush p50/p99/max,
# and the machine's own latency meanwhile (`sqcow2-bench wakeup-latency`
# beside the load: how late a real-time thread sleeping 1 ms at a time
# wakes up, a floor under any request's latency there).
# SERVE_ARGS adds options to both sqcow2 serves (e.g. "--cache-size 128M"
# for disks whose tables under change outgrow the default cache's share).
# Raw results in $OUT (default /tmp/sqcow2-bench-flush-tail).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
. scripts/lib/bench.sh
ensure_commands qemu-img:qemu-utils qemu-storage-daemon:qemu-system-x86

rounds=${1:-3}
secs=${2:-10}
dir=${DIR:-/dev/shm/sqcow2-flush-tail}
out=${OUT:-/tmp/sqcow2-bench-flush-tail}
size=${SIZE:-50G}
layers=${LAYERS:-10}
fill=${FILL:-0.02}
depth=${DEPTH:-16}
interval=${INTERVAL_MS:-100}
servers=${SERVERS:-sqcow2 qsd raw}
qsd=${QSD:-qemu-storage-daemon}
root=$PWD

echo "==> building (release)" >&2
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
sq=$root/target/release/sqcow2
load=$root/target/release/sqcow2-bench

rm -rf "$out" "$dir" && mkdir -p "$out" "$dir"
trap 'rm -rf "$dir"' EXIT
cd "$dir"

serve_sqcow2() { # TOP [BINARY]
  rm -f v.sock c.sock
  # shellcheck disable=SC2086 # SERVE_ARGS is a list of options
  "${2:-$sq}" serve ${SERVE_ARGS:-} --socket v.sock --control c.sock "$1" 2>>"$out/sqcow2.log" &
  pid=$!
  wait_socket c.sock
  # The top's index is written by the daemon right after start.
  for _ in $(seq 1200); do
    "$sq" stats c.sock --output json | python3 -c '
import json, sys
i = json.load(sys.stdin)["index"]
sys.exit(0 if i["pending-layers"] == 0 and not i["building"] else 1)' && return 0
    sleep 0.1
  done
  echo "sqcow2 never indexed $1" >&2; return 1
}

serve_qsd() { # IMAGE FORMAT
  rm -f v.sock
  "$qsd" --object iothread,id=iot0,poll-max-ns=32768 \
    --blockdev "driver=file,node-name=file,filename=$1,aio=io_uring" \
    --blockdev "driver=$2,node-name=disk,file=file" \
    --export type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path=v.sock,writable=on,iothread=iot0 \
    2>>"$out/qsd.log" &
  pid=$!
  wait_socket v.sock
}

echo "==> chain: $layers layers, $size, fill $fill, in $dir" >&2
mkdir chain
below=$("$sq" gen-chain --layers "$layers" --size "$size" --fill "$fill" chain | xargs readlink -f)

for round in $(seq "$rounds"); do
  order=$servers
  [ $((round % 2)) = 0 ] && order=$(echo "$servers" | tr ' ' '\n' | tac | tr '\n' ' ')
  for server in $order; do
    case $server in
      sqcow2)
        "$sq" snapshot "$below" top.qcow2 >/dev/null
        serve_sqcow2 "$dir/top.qcow2" ;;
      base)
        "$sq" snapshot "$below" top.qcow2 >/dev/null
        serve_sqcow2 "$dir/top.qcow2" "${BASE_BIN:?BASE_BIN names the other build}" ;;
      qsd)
        qemu-img create -q -f qcow2 -u -b "$below" -F qcow2 top.qcow2 "$size"
        serve_qsd "$dir/top.qcow2" qcow2 ;;
      raw)
        truncate -s "$size" top.raw
        serve_qsd "$dir/top.raw" raw ;;
    esac
    "$load" wakeup-latency --duration "$secs" --output json >"$out/wakeup.json" &
    probe=$!
    json=$("$load" load --socket v.sock --pattern rand-write-new --bs 4k \
      --iodepth "$depth" --flush-interval-ms "$interval" --duration "$secs" --output json)
    wait "$probe"
    kill "$pid"; wait "$pid" 2>/dev/null || true
    echo "$json" | python3 -c '
import json, sys
r = json.load(sys.stdin)
w = json.load(open(sys.argv[3]))
r["server"], r["round"] = sys.argv[1], int(sys.argv[2])
r["wakeup_late_p99_us"], r["wakeup_late_max_us"] = w["late_p99_us"], w["late_max_us"]
print(json.dumps(r))' "$server" "$round" "$out/wakeup.json" >> "$out/results.jsonl"
    echo "$json" | python3 -c '
import json, sys
r = json.load(sys.stdin)
print("  %s round %s: %.0f IOPS, longest %.1f ms, flush p99 %.1f ms (%d flushes, %d errors)" % (
    sys.argv[1], sys.argv[2], r["iops"], r["lat_max_us"] / 1000, r["flush_lat_p99_us"] / 1000, r["flushes"], r["errors"]))' "$server" "$round" >&2
    rm -f top.qcow2 top.qcow2.sq* top.raw
  done
done

python3 - "$out/results.jsonl" "$secs" "$rounds" "$size" "$layers" "$fill" "$depth" "$interval" <<'EOF'
import json, statistics, sys
path, secs, rounds, size, layers, fill, depth, interval = sys.argv[1:]
rows = [json.loads(l) for l in open(path)]
servers = []
for r in rows:
    if r["server"] not in servers:
        servers.append(r["server"])
print(f"{rounds} rounds of {secs} s: 4 KiB allocating writes at depth {depth}, a flush every {interval} ms,"
      f" fresh top over {layers} layers of {size} (fill {fill}); medians over rounds (worst round in brackets)")
print()
print("| server | IOPS | write p99 ms | longest request ms | flush p50 ms | flush p99 ms | flush max ms | errors | machine: wake-up late p99 / max ms |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for s in servers:
    rs = [r for r in rows if r["server"] == s]
    m = lambda k: statistics.median(r[k] for r in rs)
    w = lambda k: max(r[k] for r in rs)
    print(f"| {s} | {m('iops'):,.0f} | {m('lat_p99_us')/1000:.2f} | {m('lat_max_us')/1000:.1f} ({w('lat_max_us')/1000:.1f})"
          f" | {m('flush_lat_p50_us')/1000:.2f} | {m('flush_lat_p99_us')/1000:.1f} ({w('flush_lat_p99_us')/1000:.1f})"
          f" | {m('flush_lat_max_us')/1000:.1f} | {sum(r['errors'] for r in rs)}"
          f" | {m('wakeup_late_p99_us')/1000:.2f} / {m('wakeup_late_max_us')/1000:.1f} ({w('wakeup_late_max_us')/1000:.1f}) |")
EOF
