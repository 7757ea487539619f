#!/usr/bin/env bash
# Deleting the newest snapshot while the guest runs: the top of a
# two-layer chain (SIZE disk, FILL of its clusters written in each layer;
# the warm-up's random writes leave nearly all of the disk in the top:
# 1 GiB by default) committed into its backing file, which is then
# served, while a libblkio client runs a 70/30 random
# read/write load (4 KiB, depth 16, one queue), warmed first, then one
# connection throughout whose phases (before, during, after the commit)
# the script names: client IOPS and p99 of each phase (over all its
# requests, and the largest of its 3 s slices'), the commit's duration
# and pause, bytes the guest's own writes mirrored, the daemon's peak RSS.
#   sqcow2 commit --live (no limit), and with --max-p99-ratio 1.2;
#   qemu-storage-daemon (aio=io_uring, polling iothread): QMP block-commit
#   of the active layer, block-job-complete once the job is ready (the
#   pivot), as libvirt's blockcommit --active --pivot does.
#
#   scripts/bench-live-commit.sh [SIZE=1G] [FILL=0.5] [DIR=/tmp/sqcow2-commit]
# Prints a markdown table; raw results in DIR/results.jsonl. QSD=path runs
# another qemu-storage-daemon than the installed one; SKIP_QSD=1 leaves
# it out; PHASE_S (40) is the length of the warm-up and of the phases
# before and after (shorter, the load has not settled: with 4 s, its p99
# rose 2-4x between two phases with nothing else running), SETTLE_S (40)
# that of the load's first phase, unrecorded (see begin_phases: without
# it the "before" phase flattered the load by 1.3-1.6x);
# EXTRA="OPTIONS" adds a run of `commit --live OPTIONS`. The first row
# ("no commit") is the same run with nothing in its "during" phase
# (PHASE_S long): its during/before is this machine's noise.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands qemu-storage-daemon:qemu-system-x86
ensure_commands qemu-img:qemu-utils
qsd_bin=${QSD:-qemu-storage-daemon}
layers=2
size=${1:-1G}
fill=${2:-0.5}
root=${3:-/tmp/sqcow2-commit}
phase_s=${PHASE_S:-40}
settle_s=${SETTLE_S:-40}
slice_ms=${SLICE_MS:-3000}
timeout_s=${TIMEOUT_S:-300}

. scripts/lib/live-load.sh
live_bench_init "$root"

fresh_chain() { # DIR -> top
  rm -rf "$1" && mkdir -p "$1"
  (cd "$1" && "$bin" gen-chain --layers "$layers" --size "$size" --fill "$fill" --seed 7 . | tail -1)
  # A chain at rest: its writing back does not land in the "before" phase.
  sync
}

run_sqcow2() { # WHO [commit options...] (WHO "no-commit": a sleep instead)
  local who=$1; shift
  local dir=$root/$who
  echo "==> $who: generating $layers layers of $size" >&2
  local top; top=$(fresh_chain "$dir")
  cd "$dir"
  local base; base=$(qemu-img info --output json "$top" | python3 -c 'import json,sys; print(json.load(sys.stdin)["full-backing-filename"])')
  "$bin" serve --socket v.sock --control c.sock --pidfile serve.pid "$top" 2>serve.log &
  while [ ! -f serve.pid ]; do sleep 0.1; done
  local pid; pid=$(cat serve.pid)
  while "$bin" stats c.sock --output json | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["index"]["building"] or d["index"]["pending-layers"] else 1)'; do sleep 0.5; done
  # One load throughout, its phases named in a file.
  local loader
  begin_phases v.sock "$who" "$phase_s" "$slice_ms" "$settle_s"
  echo "==> $who: committing the top" >&2
  echo during >phase
  if [ "$who" = no-commit ]; then
    sleep "$phase_s"
  else
    # Followed by the CLI itself (a stats request every 100 ms on its
    # socket): a loop spawning `sqcow2 stats` and python3 every 100 ms
    # took, with no commit at all, the load's IOPS from 306k to 196k and
    # its p99 from 136 to 452 us on this 2-core VM.
    "$bin" commit --live "$@" c.sock >/dev/null 2>&1 || true
  fi
  echo after >phase
  echo "==> $who: after" >&2
  local commit_json='{"state": "none", "merge_ms": '"$phase_s"'000, "pause-ms": null}'
  [ "$who" = no-commit ] || commit_json=$("$bin" stats c.sock --output json | python3 -c 'import json,sys; m=json.load(sys.stdin)["merge"]; print(json.dumps({"state": m["state"], "merge_ms": m["elapsed-ms"], "pause-ms": m["pause-ms"], "written-bytes": m["written-bytes"], "mirrored-bytes": m["mirrored-bytes"], "throttled-ms": m["throttled-ms"], "baseline-p99-us": m["baseline-p99-us"], "layers-after": m["layers-after"]}))')
  sleep "$phase_s"
  end_phases
  record_phase "$who" before load.json "{}"
  record_phase "$who" during load.json "$commit_json"
  record_phase "$who" after load.json "{\"peak_rss_kib\": $(peak_rss_kib "$pid")}"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  qemu-img check -q "$base"
  grep "live commit" serve.log | sed 's/\x1b\[[0-9;]*m//g' >&2 || true
  cd - >/dev/null
  rm -rf "$dir"
}

run_qsd() {
  local who=qsd-commit dir=$root/qsd-commit
  echo "==> $who: generating $layers layers of $size" >&2
  local top; top=$(fresh_chain "$dir")
  cd "$dir"
  local base; base=$(qemu-img info --output json "$top" | python3 -c 'import json,sys; print(json.load(sys.stdin)["full-backing-filename"])')
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
  # One load throughout, its phases named in a file.
  local loader
  begin_phases v.sock "$who" "$phase_s" "$slice_ms" "$settle_s"
  echo "==> $who: block-commit of the active layer, then block-job-complete" >&2
  echo during >phase
  local t0; t0=$(date +%s.%N)
  qmp qmp.sock '{"execute": "block-commit", "arguments": {"job-id": "c", "device": "disk"}}' >commit.json
  local state=running
  while :; do
    local jobs; jobs=$(qmp qmp.sock '{"execute": "query-block-jobs"}')
    if ! grep -q '"device": "c"' <<<"$jobs"; then state=done; break; fi
    if grep -q '"ready": true' <<<"$jobs"; then
      qmp qmp.sock '{"execute": "block-job-complete", "arguments": {"device": "c"}}' >complete.json
    fi
    if python3 -c "import sys,time; sys.exit(0 if time.time() - $t0 > $timeout_s else 1)"; then state=timeout; break; fi
    sleep 0.5
  done
  local ms; ms=$(python3 -c "import time; print((time.time() - $t0) * 1000)")
  if [ "$state" = done ]; then
    echo after >phase
    echo "==> $who: after" >&2
    sleep "$phase_s"
  fi
  end_phases
  record_phase "$who" before load.json "{}"
  record_phase "$who" during load.json "{\"state\": \"$state\", \"merge_ms\": $ms, \"pause-ms\": null}"
  [ "$state" != done ] || record_phase "$who" after load.json "{\"peak_rss_kib\": $(peak_rss_kib "$pid")}"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  [ "$state" != done ] || qemu-img check -q "$base"
  cd - >/dev/null
  rm -rf "$dir"
}

run_sqcow2 no-commit
run_sqcow2 sqcow2
run_sqcow2 sqcow2-p99-1.2 --max-p99-ratio 1.2
# EXTRA="-r 10M": one more run with these commit options.
[ -z "${EXTRA:-}" ] || run_sqcow2 "sqcow2 $EXTRA" $EXTRA
[ -n "${SKIP_QSD:-}" ] || run_qsd

python3 - "$out" "$size" "$fill" <<'PY'
import json, sys
path, size, fill = sys.argv[1:4]
rows = [json.loads(l) for l in open(path)]
by = {}
for r in rows:
    by.setdefault(r["who"], {})[r["phase"]] = r
print(f"two layers of {size}, {float(fill)*100:g} % of the clusters written in each; load: 70/30 random read/write, 4 KiB, depth 16, 1 queue, one connection throughout; p99: over every request of the phase (in brackets: the largest of its 3 s slices')\n")
print("| server | commit | duration | pause | mirrored | IOPS before | during | after | p99 before | during | after | during/before | peak RSS |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for who, ph in by.items():
    b, d, a = ph.get("before", {}), ph.get("during", {}), ph.get("after", {})
    how = {"sqcow2": "commit --live", "sqcow2-p99-1.2": "commit --live --max-p99-ratio 1.2", "qsd-commit": "block-commit + block-job-complete", "no-commit": "none (a sleep)"}.get(who, who)
    pause = f'{d["pause-ms"]:.2f} ms' if d.get("pause-ms") is not None else "–"
    mirrored = f'{d["mirrored-bytes"]/2**20:,.0f} MiB' if "mirrored-bytes" in d else "–"
    rss = f'{a["peak_rss_kib"]/1024:.1f} MiB' if "peak_rss_kib" in a else "–"
    f = lambda r, k, fmt: (fmt.format(r[k]) if k in r else "–")
    p99 = lambda r: (f'{r["p99_us"]:,.0f} µs ({r["worst_p99_us"]:,.0f})' if "p99_us" in r else "–")
    ratio = lambda b, d: (f'{d["p99_us"] / b["p99_us"]:.2f}x' if b.get("p99_us") and "p99_us" in d else "–")
    print(f'| {who} | {how} ({d.get("state", "?")}) | {d.get("merge_ms", 0)/1000:.1f} s | {pause} | {mirrored} | '
          f'{f(b, "iops", "{:,.0f}")} | {f(d, "iops", "{:,.0f}")} | {f(a, "iops", "{:,.0f}")} | '
          f'{p99(b)} | {p99(d)} | {p99(a)} | {ratio(b, d)} | {rss} |')
errors = sum(r.get("errors", 0) for r in rows)
print(f"\nclient request errors: {errors}")
PY
