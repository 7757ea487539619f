#!/usr/bin/env bash
# The file system's floor under the live-snapshot benchmark's load: random
# 4 KiB writes at depth 16 (`sqcow2-bench load`, a libblkio client) on a
# fresh sparse raw file of each size, no format and no snapshot, served by
# qemu-storage-daemon at its best (an iothread polling up to 32 µs). The
# longest request bounds from below what any server on this file system
# can promise under this load. Cache modes: buffered (aio=io_uring, the
# page cache, as sqcow2 serves) and direct (cache.direct=on, aio=native:
# no page cache, no write-back throttling). Rounds alternate the modes.
#
#   scripts/bench-floor.sh [SIZES] [SECONDS] [MODES] [ROUNDS] [DIR]
#   (default "10G 50G 1T" 36 "buffered direct" 1 /tmp/sqcow2-floor;
#   one JSON line per run on stdout: size, cache, longest_ms, p999_us,
#   iops)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands qemu-storage-daemon:qemu-system-x86
qsd_bin=${QSD:-qemu-storage-daemon}
sizes=${1:-10G 50G 1T}
seconds=${2:-36}
modes=${3:-buffered direct}
rounds=${4:-1}
dir=${5:-/tmp/sqcow2-floor}
cargo build --release --locked -p sqcow2-bench >&2
bench=$PWD/target/release/sqcow2-bench
rm -rf "$dir" && mkdir -p "$dir"
trap 'rm -rf "$dir"' EXIT
for size in $sizes; do
  for round in $(seq "$rounds"); do
    for mode in $modes; do
      case $mode in
        buffered) cache=aio=io_uring ;;
        direct) cache=aio=native,cache.direct=on ;;
        *) echo "bench-floor: unknown mode $mode (buffered or direct)" >&2; exit 2 ;;
      esac
      echo "==> $size: the floor, $mode, round $round" >&2
      run=$dir/$size-$mode && rm -rf "$run" && mkdir -p "$run"
      (
        cd "$run"
        truncate -s "$size" disk.raw
        "$qsd_bin" \
          --object iothread,id=iot0,poll-max-ns=32768 \
          --blockdev "driver=file,node-name=disk,filename=disk.raw,$cache" \
          --export type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path=v.sock,writable=on,iothread=iot0 \
          >qsd.log 2>&1 &
        qsd=$!
        echo "$qsd" >qsd.pid
        trap 'kill -TERM $qsd 2>/dev/null || true' EXIT
        while [ ! -S v.sock ]; do sleep 0.1; done
        "$bench" load --socket v.sock --pattern rand-write --iodepth 16 \
          --duration "$seconds" --slow-us 1000 --output json >load.json
        kill -TERM "$qsd"
        wait "$qsd" || true
        python3 - "$size" "$mode" <<'PY'
import json, sys
load = json.load(open("load.json"))
longest = max((s["latency_us"] for s in load.get("slow", [])), default=0) / 1000
print(json.dumps({"size": sys.argv[1], "cache": sys.argv[2], "longest_ms": longest,
                  "p999_us": load["lat_p999_us"], "iops": load["iops"]}))
PY
      )
      rm -rf "$run"
    done
  done
done
