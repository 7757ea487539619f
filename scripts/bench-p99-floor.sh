#!/usr/bin/env bash
# What a "p99 during / p99 before" ratio can tell on this machine: the
# live commit's load (70/30 random read/write, 4 KiB, depth 16, one
# connection through three phases) on a served two-layer chain, while,
# in the middle phase, another process
#   idle:   does nothing (the ratio of two quiet phases: the noise floor),
#   copy-R: copies TOTAL MB from one file into a new one at R MB/s
#           (256 KiB blocks through the page cache: the I/O a live
#           commit's copy does, without sqcow2 in it),
# ROUNDS times each. Prints p99 before / during / after and during/before.
#
#   scripts/bench-p99-floor.sh [ROUNDS=3] [DIR=/tmp/sqcow2-p99-floor]
# RATES (default "10 40"), TOTAL_MB (default 400), PHASE_S (default 9),
# SETTLE_S (default 40: an unrecorded phase before "before", so that the
# kernel's write-back of the load, which starts only once its first
# dirty pages are 30 s old, is in every recorded phase alike; see
# begin_phases).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
root=${2:-/tmp/sqcow2-p99-floor}
rates=${RATES:-10 40}
total_mb=${TOTAL_MB:-400}
phase_s=${PHASE_S:-9}
settle_s=${SETTLE_S:-40}
. scripts/lib/live-load.sh
live_bench_init "$root"

copy_at() { # MB/s: TOTAL_MB from src.bin to copy.bin at that rate
  python3 - "$1" "$total_mb" <<'PY'
import sys, time
rate, total = float(sys.argv[1]) * 1e6, int(sys.argv[2]) * 1_000_000
chunk = 256 << 10
src, dst = open("src.bin", "rb", buffering=0), open("copy.bin", "wb", buffering=0)
t0, done = time.time(), 0
while done < total:
    b = src.read(chunk)
    if not b:
        src.seek(0)
        continue
    dst.write(b)
    done += len(b)
    ahead = done / rate - (time.time() - t0)
    if ahead > 0:
        time.sleep(ahead)
PY
}

run() { # CASE ROUND
  local dir=$root/run
  rm -rf "$dir" && mkdir -p "$dir" && cd "$dir"
  "$bin" gen-chain --layers 2 --size 4G --fill 0.25 --seed 7 . >/dev/null
  head -c $((total_mb << 20)) /dev/urandom >src.bin
  sync
  "$bin" serve --socket v.sock --pidfile serve.pid layer0001.qcow2 2>serve.log &
  while [ ! -f serve.pid ]; do sleep 0.1; done
  local loader
  begin_phases v.sock "$1" "$phase_s" 3000 "$settle_s"
  echo during >phase
  case $1 in
    idle) sleep 15 ;;
    copy-*) copy_at "${1#copy-}" ;;
  esac
  echo after >phase
  sleep "$phase_s"
  end_phases
  kill "$(cat serve.pid)"; wait 2>/dev/null || true
  for phase in before during after; do
    record_phase "$1" "$phase" load.json "{\"round\": $2}"
  done
  cd - >/dev/null
  rm -rf "$dir"
}

for r in $(seq 1 "$rounds"); do
  for c in idle $(for x in $rates; do echo "copy-$x"; done); do
    echo "==> $c round $r" >&2
    run "$c" "$r"
  done
done

python3 - "$out" "$total_mb" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
runs = {}
for r in recs:
    runs.setdefault((r["who"], r["round"]), {})[r["phase"]] = r
rows = [{"case": who, "round": n, "errors": ph["before"]["errors"],
         "during_s": ph["during"].get("seconds", 0.0),
         **{f"{p}_p99_us": ph[p]["p99_us"] for p in ("before", "during", "after")}}
        for (who, n), ph in runs.items()]
print(f"70/30 random 4 KiB, depth 16, one connection; middle phase: nothing (idle) or another process copying {sys.argv[2]} MB at R MB/s (copy-R)\n")
print("| case | round | p99 before | during | after | during/before | middle phase |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for r in rows:
    print(f'| {r["case"]} | {r["round"]} | {r["before_p99_us"]} µs | {r["during_p99_us"]} µs | {r["after_p99_us"]} µs | '
          f'{r["during_p99_us"] / max(r["before_p99_us"], 1):.2f}x | {r["during_s"]:.1f} s |')
print(f'\nclient request errors: {sum(r["errors"] for r in rows)}')
PY
