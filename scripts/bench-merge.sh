#!/usr/bin/env bash
# Shortening a long chain while the guest runs: a LAYERS-layer chain of
# SIZE (gen-chain, FILL of the clusters written) merged down to one layer
# below the top while a libblkio client runs a 70/30 random read/write
# load (4 KiB, depth 16, one queue): client IOPS and p99 before, during
# and after, the merge's duration and pause, the daemon's peak RSS.
#   sqcow2 merge --live (no limit), and with --max-p99-ratio 1.2;
#   qemu-storage-daemon (aio=io_uring, polling iothread) running QMP
#   block-stream of the whole chain into the top, as the anchor.
#
#   scripts/bench-merge.sh [LAYERS=1000] [SIZE=10G] [FILL=0.05] [DIR=/tmp/sqcow2-merge]
# Prints a markdown table; raw results in DIR/results.jsonl. QSD=path runs
# another qemu-storage-daemon than the installed one.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands qemu-storage-daemon:qemu-system-x86
ensure_commands qemu-img:qemu-utils
qsd_bin=${QSD:-qemu-storage-daemon}
layers=${1:-1000}
size=${2:-10G}
fill=${3:-0.05}
root=${4:-/tmp/sqcow2-merge}
phase_s=${PHASE_S:-10}
slice_s=${SLICE_S:-3}
timeout_s=${TIMEOUT_S:-900}

. scripts/lib/live-load.sh
live_bench_init "$root"

fresh_chain() { # DIR -> top
  rm -rf "$1" && mkdir -p "$1"
  (cd "$1" && "$bin" gen-chain --layers "$layers" --size "$size" --fill "$fill" --seed 7 . | tail -1)
}

run_sqcow2() { # WHO [merge options...]
  local who=$1; shift
  local dir=$root/$who
  echo "==> $who: generating $layers layers of $size" >&2
  local top; top=$(fresh_chain "$dir")
  cd "$dir"
  "$bin" serve --socket v.sock --control c.sock --pidfile serve.pid "$top" 2>serve.log &
  while [ ! -f serve.pid ]; do sleep 0.1; done
  local pid; pid=$(cat serve.pid)
  while "$bin" stats c.sock --output json | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["index"]["building"] or d["index"]["pending-layers"] else 1)'; do sleep 0.5; done
  echo "==> $who: before" >&2
  load v.sock "$phase_s" >before.jsonl
  record "$who" before before.jsonl "{}"
  echo "==> $who: merging layers 0..$((layers - 2))" >&2
  local t0; t0=$(date +%s.%N)
  : >during.jsonl
  # The load runs before the merge starts: a latency-paced merge measures
  # the guest's p99 over its first second.
  load v.sock "$slice_s" >>during.jsonl &
  local first=$!
  sleep 0.5
  "$bin" merge --live c.sock 0 $((layers - 2)) "$dir/merged.qcow2" --no-wait "$@" >/dev/null
  wait "$first"
  while :; do
    local state
    state=$("$bin" stats c.sock --output json | python3 -c 'import json,sys; print(json.load(sys.stdin)["merge"]["state"])')
    case $state in done|failed|cancelled) break ;; esac
    load v.sock "$slice_s" >>during.jsonl
  done
  local merge_json; merge_json=$("$bin" stats c.sock --output json | python3 -c 'import json,sys; m=json.load(sys.stdin)["merge"]; print(json.dumps({"state": m["state"], "merge_ms": m["elapsed-ms"], "pause-ms": m["pause-ms"], "written-bytes": m["written-bytes"], "throttled-ms": m["throttled-ms"], "baseline-p99-us": m["baseline-p99-us"], "layers-after": m["layers-after"]}))')
  record "$who" during during.jsonl "$merge_json"
  while "$bin" stats c.sock --output json | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["index"]["building"] or d["index"]["pending-layers"] else 1)'; do sleep 0.2; done
  echo "==> $who: after" >&2
  load v.sock "$phase_s" >after.jsonl
  record "$who" after after.jsonl "{\"peak_rss_kib\": $(peak_rss_kib "$pid")}"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  qemu-img check -q "$dir/merged.qcow2"
  cd - >/dev/null
  rm -rf "$dir"
}

run_qsd() {
  local who=qsd-stream dir=$root/qsd-stream
  echo "==> $who: generating $layers layers of $size" >&2
  local top; top=$(fresh_chain "$dir")
  cd "$dir"
  ulimit -n "$(ulimit -Hn)"
  "$qsd_bin" \
    --object iothread,id=iot0,poll-max-ns=32768 \
    --chardev socket,id=qmp,path=qmp.sock,server=on,wait=off --monitor chardev=qmp \
    --blockdev "driver=file,node-name=file,filename=$top,aio=io_uring" \
    --blockdev "driver=qcow2,node-name=disk,file=file" \
    --export "type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path=v.sock,writable=on,iothread=iot0" \
    --pidfile qsd.pid 2>qsd.log &
  while [ ! -S v.sock ] || [ ! -f qsd.pid ]; do sleep 0.1; done
  local pid; pid=$(cat qsd.pid)
  echo "==> $who: before" >&2
  load v.sock "$phase_s" >before.jsonl
  record "$who" before before.jsonl "{}"
  echo "==> $who: block-stream of the whole chain" >&2
  local t0; t0=$(date +%s.%N)
  qmp qmp.sock '{"execute": "block-stream", "arguments": {"job-id": "s", "device": "disk"}}' >stream.json
  : >during.jsonl
  local state=running
  while :; do
    if ! qmp qmp.sock '{"execute": "query-block-jobs"}' | grep -q '"device": "s"'; then state=done; break; fi
    if python3 -c "import sys,time; sys.exit(0 if time.time() - $t0 > $timeout_s else 1)"; then state=timeout; break; fi
    load v.sock "$slice_s" >>during.jsonl
  done
  local ms; ms=$(python3 -c "import time; print((time.time() - $t0) * 1000)")
  record "$who" during during.jsonl "{\"state\": \"$state\", \"merge_ms\": $ms, \"pause-ms\": null}"
  if [ "$state" = done ]; then
    echo "==> $who: after" >&2
    load v.sock "$phase_s" >after.jsonl
    record "$who" after after.jsonl "{\"peak_rss_kib\": $(peak_rss_kib "$pid")}"
  fi
  kill "$pid"; wait "$pid" 2>/dev/null || true
  cd - >/dev/null
  rm -rf "$dir"
}

run_sqcow2 sqcow2
run_sqcow2 sqcow2-p99-1.2 --max-p99-ratio 1.2
[ -n "${SKIP_QSD:-}" ] || run_qsd

python3 - "$out" "$layers" "$size" "$fill" <<'PY'
import json, sys
path, layers, size, fill = sys.argv[1:5]
rows = [json.loads(l) for l in open(path)]
by = {}
for r in rows:
    by.setdefault(r["who"], {})[r["phase"]] = r
print(f"{layers} layers, {size}, {float(fill)*100:g} % of clusters written; load: 70/30 random read/write, 4 KiB, depth 16, 1 queue\n")
print("| server | merge | duration | pause | IOPS before | during | after | p99 before | during | after | peak RSS |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for who, ph in by.items():
    b, d, a = ph.get("before", {}), ph.get("during", {}), ph.get("after", {})
    how = {"sqcow2": "merge --live", "sqcow2-p99-1.2": "merge --live --max-p99-ratio 1.2", "qsd-stream": "block-stream"}.get(who, who)
    pause = f'{d["pause-ms"]:.1f} ms' if d.get("pause-ms") is not None else "–"
    rss = f'{a["peak_rss_kib"]/1024:.1f} MiB' if "peak_rss_kib" in a else "–"
    f = lambda r, k, fmt: (fmt.format(r[k]) if k in r else "–")
    print(f'| {who} | {how} ({d.get("state", "?")}) | {d.get("merge_ms", 0)/1000:.1f} s | {pause} | '
          f'{f(b, "iops", "{:,.0f}")} | {f(d, "iops", "{:,.0f}")} | {f(a, "iops", "{:,.0f}")} | '
          f'{f(b, "p99_us", "{:,.0f} µs")} | {f(d, "p99_us", "{:,.0f} µs")} | {f(a, "p99_us", "{:,.0f} µs")} | {rss} |')
errors = sum(r.get("errors", 0) for r in rows)
print(f"\nclient request errors: {errors}")
PY
