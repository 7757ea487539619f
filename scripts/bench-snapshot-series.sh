#!/usr/bin/env bash
# IOPS over time through a series of live snapshots (issue 43, point 3):
# allocating 4 KiB random writes at depth 16 (rand-write-new: each write
# into a cluster not written before) into a fresh top over a chain of
# LAYERS layers (default 100; `gen-chain --size 10G --fill 0.05`), and N
# live snapshots GAP seconds apart while the load runs. After each
# snapshot sqcow2 builds the new top's index in the background; the
# question is whether the writes dip meanwhile. The load generator counts
# completions per 100 ms (`--timeline-ms`).
#
# The peer: qemu-storage-daemon at its best (aio=io_uring, a polling
# iothread) on a copy of the chain, the same snapshots through QMP
# (`blockdev-snapshot-sync`, scripts/lib/qmp_snapshots.py). PEER=none
# skips it.
#
#   [SQCOW2=path] scripts/bench-snapshot-series.sh [N] [GAP] [DIR]
#   (defaults: 10, 2 s, /tmp/sqcow2-snapshot-series)
#
# Prints per server (medians over the snapshots): IOPS over the whole
# run, the median 100 ms bucket in the second before each snapshot and
# in the second after its pause (sqcow2 builds the new top's index
# then), the lowest bucket from the pause on, how long the rate stayed
# under half of the rate before, and when sqcow2's new index was in use.
# Each 4 KiB write takes a 64 KiB cluster: a run writes tens of GB at
# sqcow2's rates (the disk needs the room).
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD
. scripts/lib/deps.sh
ensure_commands qemu-img:qemu-utils
peer=${PEER:-qsd}
[ "$peer" = none ] || ensure_commands qemu-storage-daemon:qemu-system-x86
n=${1:-10}
gap=${2:-2}
root=${3:-/tmp/sqcow2-snapshot-series}
layers=${LAYERS:-100}
size=${SIZE:-10G}
fill=${FILL:-0.05}
secs=$(python3 -c "print($n * $gap + 4)")

cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
# SQCOW2=path serves with another build (the load generator stays this one).
# SERVE_ARGS adds options to `sqcow2 serve` (e.g. "--cache-size 64M").
sq=${SQCOW2:-$here/target/release/sqcow2}
load=$here/target/release/sqcow2-bench
rm -rf "$root" && mkdir -p "$root/chain"
# Servers and loads still running stop with the script, whatever ended it.
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -n "${KEEP:-}" ] || rm -rf "$root/chain" "$root/qsd"
}
trap cleanup EXIT
# Each 4 KiB write takes a 64 KiB cluster: at sqcow2's rates a run writes
# tens of GB. Refuse to start without MIN_FREE_GB (default 60) free.
free_gb=$(df -P -BG "$root" | awk 'NR == 2 {sub("G", "", $4); print $4}')
if [ "$free_gb" -lt "${MIN_FREE_GB:-60}" ]; then
  echo "bench-snapshot-series: $free_gb GB free in $root, ${MIN_FREE_GB:-60} wanted (MIN_FREE_GB=)" >&2
  exit 1
fi
cd "$root"

echo "==> chain of $layers layers ($size, fill $fill)" >&2
below=$("$sq" gen-chain --layers "$layers" --size "$size" --fill "$fill" chain | xargs readlink -f)

indexed() {
  "$sq" stats c.sock --output json | python3 -c '
import json, sys
i = json.load(sys.stdin)["index"]
sys.exit(0 if i["pending-layers"] == 0 and not i["building"] and i["walking-because"] is None else 1)'
}

echo "==> sqcow2: $n live snapshots $gap s apart under the load" >&2
"$sq" snapshot "$below" chain/top.qcow2 >/dev/null
# shellcheck disable=SC2086 # SERVE_ARGS is a list of options
"$sq" serve ${SERVE_ARGS:-} --socket v.sock --control c.sock chain/top.qcow2 2>sqcow2.log &
pid=$!
pids+=("$pid")
for _ in $(seq 600); do [ -S c.sock ] && indexed && break; sleep 0.1; done
"$load" load --socket v.sock --pattern rand-write-new --bs 4k --iodepth 16 \
  --duration "$secs" --timeline-ms 100 --output json >sqcow2-load.json &
lp=$!
pids+=("$lp")
sleep 2
: >sqcow2-snapshots.jsonl
for i in $(seq "$n"); do
  t0=$(date +%s%6N)
  reply=$("$sq" snapshot --live c.sock "chain/live$i.qcow2" --output json | tr -d '\n ')
  # When the new top's index is in use is read from the daemon's log
  # afterwards: polling `stats` meanwhile (a process or two every 20 ms)
  # took a quarter of this 2-core VM's CPU in the second after each
  # pause, the very second measured.
  echo "{\"at_unix_us\": $t0, \"reply\": $reply}" >>sqcow2-snapshots.jsonl
  now=$(date +%s%6N)
  # (awk, not python3: a python start is tens of ms of CPU here.)
  sleep "$(awk -v g="$gap" -v n="$now" -v t="$t0" 'BEGIN { d = g - (n - t) / 1e6; print (d > 0 ? d : 0) }')"
done
wait "$lp"
kill "$pid"; wait "$pid" 2>/dev/null || true
python3 - <<'EOF'
import datetime, json, re
built = {}
for line in open("sqcow2.log"):
    m = re.match(r"(\S+Z)\s.*chain index built index=(\S+)\.sqidx", line)
    if m:
        t = datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
        built.setdefault(m.group(2), int(t.timestamp() * 1e6))
rows = [json.loads(l) for l in open("sqcow2-snapshots.jsonl") if l.strip()]
with open("sqcow2-snapshots.jsonl", "w") as f:
    for r in rows:
        r["indexed_unix_us"] = built.get(r["reply"].get("path"))
        f.write(json.dumps(r) + "\n")
EOF

if [ "$peer" != none ]; then
  echo "==> qemu-storage-daemon: the same through QMP" >&2
  mkdir qsd
  (
    cd qsd
    qemu-img create -q -f qcow2 -u -b "$below" -F qcow2 top.qcow2 "$size"
    qemu-storage-daemon --object iothread,id=iot0,poll-max-ns=32768 \
      --blockdev driver=file,node-name=file,filename=top.qcow2,aio=io_uring \
      --blockdev driver=qcow2,node-name=disk,file=file \
      --export type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path=v.sock,writable=on,iothread=iot0 \
      --chardev socket,id=qmp,path=qmp.sock,server=on,wait=off \
      --monitor chardev=qmp 2>qsd.log &
    qp=$!
    trap 'kill "$qp" ${lp:-} 2>/dev/null || true' EXIT
    while [ ! -S v.sock ]; do sleep 0.1; done
    "$load" load --socket v.sock --pattern rand-write-new --bs 4k --iodepth 16 \
      --duration "$secs" --timeline-ms 100 --output json >../qsd-load.json &
    lp=$!
    sleep 2
    python3 "$here/scripts/lib/qmp_snapshots.py" qmp.sock disk "$n" "$gap" ../qsd-snapshots.jsonl
    wait "$lp"
    kill "$qp"; wait "$qp" 2>/dev/null || true
  )
fi

python3 - "$n" "$gap" "$layers" <<'EOF'
import json, os, statistics, sys
n, gap, layers = sys.argv[1:4]
print(f"{n} live snapshots {gap} s apart under 4 KiB allocating writes at depth 16, "
      f"fresh top over {layers} layers; 100 ms buckets")
print()
print("| server | IOPS (whole run) | median bucket in the second before a pause | in the second after it | lowest bucket from the pause on | time under half the rate before (median / max) | index in use after (median) |")
print("|---|---:|---:|---:|---:|---:|---:|")
med = lambda v: statistics.median(v) if v else float("nan")
for server in ["sqcow2", "qsd"]:
    if not os.path.exists(f"{server}-load.json") or not os.path.exists(f"{server}-snapshots.jsonl"):
        continue
    load = json.load(open(f"{server}-load.json"))
    t = load["timeline_iops"]
    start = load["start_unix_us"]
    before, after, lowest, under, built = [], [], [], [], []
    for line in open(f"{server}-snapshots.jsonl"):
        if not line.strip():
            continue
        s = json.loads(line)
        reply = s.get("reply", s)
        at = s.get("at_unix_us", reply["started-unix-us"])
        b = int((at - start) / 100_000)
        p = int((reply["paused-unix-us"] - start) / 100_000)
        if b < 10 or p + 15 > len(t):
            continue
        rate = statistics.median(t[b - 10:b])
        before.append(rate)
        after.append(statistics.median(t[p + 1:p + 11]))
        lowest.append(min(t[p:p + 11]))
        under.append(100 * sum(1 for x in t[p:p + 15] if x < rate / 2))
        if s.get("indexed_unix_us"):
            built.append((s["indexed_unix_us"] - at) / 1000)
    b = f"{med(built):.0f} ms" if built else "-"
    print(f"| {server} | {load['iops']:,.0f} | {med(before):,.0f} | {med(after):,.0f} | {med(lowest):,.0f}"
          f" | {med(under):.0f} / {max(under, default=0):.0f} ms | {b} |")
EOF
