#!/usr/bin/env bash
# Live snapshots under a random-write load (depth 16, libblkio client) at
# several disk sizes: for each size a 10-layer chain (sparse, 2 % filled)
# is generated and served, N live snapshots are taken 0.4 s apart, and the
# pause (p50, p99, max, over the snapshots paused while the load ran) and the longest client request that overlapped a
# snapshot (from the load generator's own timestamps) are reported. Then
# the offline snapshot of a fully allocated 50 GiB top (metadata
# preallocated) against `qemu-img create -b`.
#
# The peer: qemu-storage-daemon (aio=io_uring, an iothread that polls: its
# best configuration) serving a copy of the same chain under the same load,
# taking the same number of live snapshots through QMP
# (`blockdev-snapshot-sync`, scripts/lib/qmp_snapshots.py); its pause is
# the command's time (an upper bound). PEER=none skips it. With the
# peer, each size also measures the file system's floor: the same load,
# no snapshot, on a fresh sparse raw file served by qemu-storage-daemon
# the same way (scripts/bench-floor.sh; FLOOR=0 skips it, FLOOR_MODES=
# "buffered direct" adds the file without the page cache). SERVE_ARGS
# adds options to `sqcow2 serve` (e.g. "--engine-threads 2"); QSD=path
# runs another qemu-storage-daemon than the installed one.
#
#   scripts/bench-live-snapshot.sh [SIZES] [N] [DIR]
#   (default "10G 50G 1T" 20 /tmp/sqcow2-live; prints a markdown table and
#   writes DIR/results.json, each size's replies and daemon log next to it)
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD
. scripts/lib/deps.sh
ensure_commands qemu-img:qemu-utils
peer=${PEER:-qsd}
[ "$peer" = none ] || ensure_commands qemu-storage-daemon:qemu-system-x86 qemu-img:qemu-utils
qsd_bin=${QSD:-qemu-storage-daemon}
sizes=${1:-10G 50G 1T}
n=${2:-20}
root=${3:-/tmp/sqcow2-live}
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
bin=$PWD/target/release/sqcow2
bench=$PWD/target/release/sqcow2-bench
rm -rf "$root" && mkdir -p "$root"
: >"$root/runs.jsonl"
: >"$root/floor.jsonl"
cat >"$root/analyse.py" <<'PY'
import json, sys
server, size = sys.argv[1], sys.argv[2]
replies = [json.loads(l) for l in open("replies.jsonl") if l.strip()]
load = json.load(open("load.json"))
# Only pauses that fell while the load ran count (a flush before a
# snapshot can outlast the load).
load_end = int(open("load.start").read()) + load["seconds"] * 1e6
under_load = [r for r in replies if r["paused-unix-us"] < load_end]
total = len(replies)
replies = under_load or replies
pauses = sorted(r["pause-ms"] for r in replies)
q = lambda f: pauses[round((len(pauses) - 1) * f)]
# A snapshot lasts from its start to the old top's close after the pause
# (the reply; QMP's command time for the peer).
windows = [(r["started-unix-us"],
            r["paused-unix-us"] + (r["pause-ms"] + (r.get("steps") or {}).get("close-ms", 0)) * 1000)
           for r in replies]
overlapping = [s["latency_us"] for s in load.get("slow", [])
               if any(s["start_unix_us"] < b and s["start_unix_us"] + s["latency_us"] > a
                      for a, b in windows)]
# The same, in windows of the same lengths without a snapshot: each
# snapshot's window moved to halfway between its end and the next one's
# start (the load's own tail on this machine, the floor of the above).
def longest_in(ws):
    return max((s["latency_us"] for s in load.get("slow", [])
                if any(s["start_unix_us"] < b and s["start_unix_us"] + s["latency_us"] > a
                       for a, b in ws)), default=0) / 1000
quiet = []
for (a, b), nxt in zip(windows, windows[1:]):
    mid, half = (b + nxt[0]) / 2, (b - a) / 2
    if mid - half > b and mid + half < nxt[0]:
        quiet.append((mid - half, mid + half))
# Where the long requests of the snapshots' windows fall: the
# preparation (new top, write-back rounds), the pause, the old top's close
# after it (a request spanning two counts in both; sqcow2 only).
def longest_over(phases):
    return max((s["latency_us"] for s in load.get("slow", [])
                if any(s["start_unix_us"] < b and s["start_unix_us"] + s["latency_us"] > a
                       for a, b in phases)), default=0) / 1000
by_phase = None
if all(r.get("steps") for r in replies):
    paused_end = [r["paused-unix-us"] + r["pause-ms"] * 1000 for r in replies]
    by_phase = {
        "prepare": longest_over([(r["started-unix-us"], r["paused-unix-us"]) for r in replies]),
        "pause": longest_over([(r["paused-unix-us"], e) for r, e in zip(replies, paused_end)]),
        "close": longest_over([(e, e + r["steps"].get("close-ms", 0) * 1000)
                               for r, e in zip(replies, paused_end)]),
    }
worst = max(replies, key=lambda r: r["pause-ms"])
try:
    index = json.load(open("stats.json"))["index"]
except FileNotFoundError:
    index = {"builds": None, "last-build-ms": None}
print(json.dumps({
    "server": server, "size": size, "snapshots": total, "under_load": len(under_load),
    "pause_p50_ms": q(0.5), "pause_p99_ms": q(0.99), "pause_max_ms": pauses[-1],
    "longest_overlapping_ms": max(overlapping, default=0) / 1000,
    "longest_without_snapshot_ms": longest_in(quiet), "quiet_windows": len(quiet),
    "longest_overlapping_by_phase_ms": by_phase,
    "client_iops": load["iops"], "client_p999_us": load["lat_p999_us"],
    "worst_steps": worst.get("steps"), "index_builds": index["builds"],
    "last-build-ms": index["last-build-ms"],
}))
PY
# The write load on v.sock in the background (its pid in $load), its
# start time in load.start; a second to settle. It lasts long enough for
# every snapshot to fall under it (a snapshot takes 0.4 s apart plus its
# preparation, up to ~0.5 s at 10 GiB; QMP's up to ~0.35 s).
start_load() {
  date +%s%6N >load.start
  "$bench" load --socket v.sock --pattern rand-write --iodepth 16 \
    --duration $((n * 3 / 2 + 6)) --slow-us 1000 --output json >load.json &
  load=$!
  echo "$load" >load.pid
  sleep 1
}
# Each size needs its chain (2 % of the disk, plus what the load and the
# snapshots write) and, with the peer, a copy: refuse to start rather than
# fill the disk halfway (a full disk ends the run with no result).
need=0
for size in $sizes; do
  bytes=$(numfmt --from=iec "${size%B}")
  per=$((bytes / 50 + (2 << 30)))
  [ "$peer" = none ] || per=$((per * 2))
  if [ -n "${KEEP:-}" ]; then
    need=$((need + per))
  elif [ "$per" -gt "$need" ]; then
    need=$per
  fi
done
avail=$(df --output=avail -B1 "$root" | tail -1)
if [ "$avail" -lt "$need" ]; then
  echo "bench-live-snapshot: $root has $(numfmt --to=iec "$avail") free, the run needs about $(numfmt --to=iec "$need") ($sizes${KEEP:+, KEEP=1})" >&2
  exit 1
fi
# What the load writes is not known ahead (each 4 KiB write into a new
# top allocates a 64 KiB cluster: 10-40 GB over a run, more with KEEP=1,
# which keeps every size's tops): a watchdog stops the servers, and so
# the run, when less than 4 GiB is left, before a full disk takes the
# machine's other programs down with it (it did once). MIN_FREE sets
# the floor (default 4G).
floor=$(numfmt --from=iec "${MIN_FREE:-4G}")
(
  while sleep 0.5; do
    left=$(df --output=avail -B1 "$root" | tail -1)
    if [ "$left" -lt "$floor" ]; then
      echo "bench-live-snapshot: $(numfmt --to=iec "$left") left on $root: stopping the run (results so far in $root/runs.jsonl)" >&2
      : >"$root/disk-low"
      for f in "$root"/*/load.pid "$root"/*/serve.pid "$root"/*/qsd.pid; do
        [ -f "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null
      done
      exit 0
    fi
  done
) &
watchdog=$!
# On the way out (a failure too) the chains go unless KEEP is set; the
# results stay.
cleanup() {
  kill "$watchdog" 2>/dev/null || true
  [ -n "${KEEP:-}" ] || rm -rf "$root"/*/
  [ ! -e "$root/disk-low" ] || echo "bench-live-snapshot: cut short: the disk was almost full" >&2
}
trap cleanup EXIT
for size in $sizes; do
  dir=$root/$size
  mkdir -p "$dir"
  (
    cd "$dir"
    echo "==> $size: generating a 10-layer chain (2 % filled)" >&2
    top=$("$bin" gen-chain --layers 10 --size "$size" --fill 0.02 .)
    if [ "$peer" != none ]; then
      echo "==> $size: a copy of the chain for qemu-storage-daemon" >&2
      rm -rf ../"$size-qsd" && mkdir ../"$size-qsd"
      cp --sparse=always layer*.qcow2 ../"$size-qsd"/
    fi
    "$bin" serve ${SERVE_ARGS:-} --socket v.sock --control c.sock --pidfile serve.pid "$top" 2>serve.log &
    while [ ! -f serve.pid ]; do sleep 0.1; done
    start_load
    : >replies.jsonl
    for i in $(seq 1 "$n"); do
      "$bin" snapshot --live c.sock "live$i.qcow2" --output json | tr -d '\n ' >>replies.jsonl
      echo >>replies.jsonl
      sleep 0.4
    done
    wait "$load"
    # Background index builds finish before the daemon stops.
    for _ in $(seq 1 600); do
      "$bin" stats c.sock --output json | python3 -c '
import json, sys
i = json.load(sys.stdin)["index"]
sys.exit(0 if i["pending-layers"] == 0 and not i["building"] else 1)' && break
      sleep 0.1
    done
    "$bin" stats c.sock --output json >stats.json
    kill -TERM "$(cat serve.pid)"
    wait
    python3 "$root/analyse.py" sqcow2 "$size" >>"$root/runs.jsonl"
    tail -1 "$root/runs.jsonl" >&2
    # Each snapshot's reply and the daemon's log (slow steps) stay.
    cp replies.jsonl "$root/$size-replies.jsonl"
    cp serve.log "$root/$size-serve.log"
  )
  [ -n "${KEEP:-}" ] || rm -rf "$dir"
  [ "$peer" != none ] || continue
  (
    cd "$root/$size-qsd"
    echo "==> $size: qemu-storage-daemon, $n live snapshots through QMP" >&2
    top=layer0009.qcow2
    "$qsd_bin" \
      --object iothread,id=iot0,poll-max-ns=32768 \
      --blockdev "driver=file,node-name=file,filename=$top,aio=io_uring" \
      --blockdev driver=qcow2,node-name=disk,file=file \
      --export type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path=v.sock,writable=on,iothread=iot0 \
      --chardev socket,id=qmp,path=qmp.sock,server=on,wait=off \
      --monitor chardev=qmp 2>qsd.log &
    qsd=$!
    echo "$qsd" >qsd.pid
    while [ ! -S v.sock ]; do sleep 0.1; done
    start_load
    python3 "$here/scripts/lib/qmp_snapshots.py" qmp.sock disk "$n" 0.4 replies.jsonl
    wait "$load"
    kill -TERM "$qsd"
    wait "$qsd" || true
    python3 "$root/analyse.py" "qemu-storage-daemon $("$qsd_bin" --version | head -1 | awk '{print $3}')" "$size" >>"$root/runs.jsonl"
    tail -1 "$root/runs.jsonl" >&2
  )
  [ -n "${KEEP:-}" ] || rm -rf "$root/$size-qsd"
  [ "${FLOOR:-1}" != 0 ] || continue
  # The file system's floor: the same load for as long on a fresh sparse
  # raw file of the same size (no format, no snapshot), served by
  # qemu-storage-daemon at its best; its longest request bounds from
  # below what any server on this file system can promise.
  echo "==> $size: the floor, a raw file under the same load" >&2
  QSD=$qsd_bin scripts/bench-floor.sh "$size" $((n * 3 / 2 + 6)) "${FLOOR_MODES:-buffered}" 1 \
    "$root/$size-raw" >>"$root/floor.jsonl"
  tail -1 "$root/floor.jsonl" >&2
done

echo "==> offline snapshot of a fully allocated 50 GiB top" >&2
off=$root/offline
mkdir -p "$off"
(
  cd "$off"
  qemu-img create -q -f qcow2 -o preallocation=metadata top.qcow2 50G
  times() {
    for i in 1 2 3 4 5; do
      rm -f new.qcow2 new.qcow2.sqidx
      s=$(date +%s%N)
      "$@" >/dev/null
      e=$(date +%s%N)
      echo $(((e - s) / 1000))
    done | sort -n | sed -n 3p
  }
  q=$(times qemu-img create -q -f qcow2 -b top.qcow2 -F qcow2 new.qcow2)
  d=$(times "$bin" snapshot top.qcow2 new.qcow2)
  now=$(times "$bin" snapshot --index now top.qcow2 new.qcow2)
  echo "{\"qemu_img_create_ms\": $q.0e-3, \"sqcow2_snapshot_ms\": $d.0e-3, \"sqcow2_snapshot_index_now_ms\": $now.0e-3}" >offline.json
)
python3 - "$root" "$n" <<'PY'
import json, sys
root, n = sys.argv[1], sys.argv[2]
runs = [json.loads(l) for l in open(f"{root}/runs.jsonl") if l.strip()]
off = json.load(open(f"{root}/offline/offline.json"))
try:
    floor = [json.loads(l) for l in open(f"{root}/floor.jsonl") if l.strip()]
except FileNotFoundError:
    floor = []
json.dump({"live": runs, "offline": off, "floor": floor}, open(f"{root}/results.json", "w"), indent=1)
print(f"Live snapshots, {n} per size, random 4 KiB writes at depth 16 during them "
      "(10-layer chain, 2 % filled):\n")
print("| disk | server | snapshots under load | pause p50 | pause p99 | pause max | longest overlapping request (in the preparation / pause / close) | the same without snapshots | client IOPS | steps of the longest pause (drain / switch) |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
for r in runs:
    s = r["worst_steps"]
    steps = f"{s['drain-ms']:.2f} / {s['switch-ms']:.2f} ms" if s else "- (QMP command time)"
    if s and "cpu-wait-ms" in s:
        steps += f", of the pause {s['cpu-wait-ms']:.2f} ms waiting for a CPU"
    if s and "drain-jobs" in s:
        steps += (f"; drained {s['drain-jobs']} engine jobs ({s.get('drain-jobs-raised', 0)} raised), "
                  f"their CPU wait {max(0.0, s['drain-jobs-cpu-wait-ms']):.2f} ms")
    if s and "close-ms" in s:
        steps += f" (old top closed after it: {s['close-ms']:.2f} ms)"
    lo = r["longest_overlapping_ms"]
    lo = f"{lo:.1f} ms" if lo else "< 1 ms"
    ph = r.get("longest_overlapping_by_phase_ms")
    if ph:
        lo += " ({})".format(" / ".join(f"{ph[k]:.1f}" if ph[k] else "<1" for k in ("prepare", "pause", "close")))
    quiet = r.get("longest_without_snapshot_ms")
    quiet = f"{quiet:.1f} ms" if quiet else "< 1 ms"
    print(f"| {r['size']} | {r.get('server', 'sqcow2')} | {r.get('under_load', r['snapshots'])} of {r['snapshots']} | {r['pause_p50_ms']:.2f} ms | {r['pause_p99_ms']:.2f} ms | "
          f"{r['pause_max_ms']:.2f} ms | {lo} | {quiet} | {r['client_iops']:.0f} | {steps} |")
ours = [r for r in runs if r.get("server", "sqcow2") == "sqcow2"]
p99 = max(r["pause_p99_ms"] for r in ours)
lo = max(r["longest_overlapping_ms"] for r in ours)
print()
print(f"Goals: pause p99 <= 5 ms at every size: worst {p99:.2f} ms — "
      f"{'met' if p99 <= 5 else 'missed by %.2f ms' % (p99 - 5)}; "
      f"longest overlapping request <= 10 ms: {lo:.1f} ms — "
      f"{'met' if lo <= 10 else 'missed by %.1f ms' % (lo - 10)}.")
if floor:
    print()
    print("The file system's floor (the same load on a fresh sparse raw file of each size, "
          "no format, no snapshot; qemu-storage-daemon, polling iothread; buffered: aio=io_uring, "
          "direct: cache.direct=on, aio=native): "
          + "; ".join(f"{f['size']} ({f.get('cache', 'buffered')}): longest request {f['longest_ms']:.1f} ms, p99.9 "
                      f"{f['p999_us'] / 1000:.1f} ms, {f['iops']:.0f} IOPS" for f in floor) + ".")
peers = [r for r in runs if r.get("server", "sqcow2") != "sqcow2"]
for p in peers:
    o = next((r for r in ours if r["size"] == p["size"]), None)
    if o:
        print(f"\n{p['size']}: pause p99 sqcow2 {o['pause_p99_ms']:.2f} ms vs {p['server']} "
              f"{p['pause_p99_ms']:.2f} ms; longest overlapping request "
              f"{o['longest_overlapping_ms']:.1f} vs {p['longest_overlapping_ms']:.1f} ms; "
              f"client IOPS {o['client_iops']:.0f} vs {p['client_iops']:.0f}.")
ratio = off["sqcow2_snapshot_ms"] / off["qemu_img_create_ms"]
print()
print(f"Offline snapshot of a fully allocated 50 GiB top (median of 5): sqcow2 snapshot "
      f"{off['sqcow2_snapshot_ms']:.1f} ms (index deferred), qemu-img create -b "
      f"{off['qemu_img_create_ms']:.1f} ms: {ratio:.2f}x — goal <= 2x "
      f"{'met' if ratio <= 2 else 'missed'}; with --index now "
      f"{off['sqcow2_snapshot_index_now_ms']:.1f} ms.")
PY
