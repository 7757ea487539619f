#!/usr/bin/env bash
# Before/after of the data path: the `sqcow2 serve` of a baseline revision
# and of this tree serve the same images, interleaved, ROUNDS rounds; one
# libblkio client (this tree's load generator) measures both.
#
#   scripts/bench-write-path.sh [BASELINE_REV] [ROUNDS] [SECONDS]
#       (defaults: b10fc02, 3, 5; LOADS="..." picks loads)
#
# Loads (1 queue, 4 KiB random):
#   alloc-write-32  writes at depth 32 into a fresh overlay (32 GiB virtual,
#                   base 2 % filled): allocation and copy-on-write
#   alloc-write-1   the same at depth 1
#   alloc-write-32-flush32  the same at depth 32 with a guest flush after
#                   every 32 writes (fio's fsync=32)
#   alloc-new-1, alloc-new-32  writes at depth 1 / 32 into a fresh overlay of
#                   the 32 GiB base, each into a cluster not written before
#                   (load pattern rand-write-new): every write allocates,
#                   nearly always over zeros
#   cow-new-1, cow-new-32  the same over an 8 GiB fully allocated base:
#                   every write allocates and copies the rest of its
#                   cluster from the data below (a disk after a snapshot)
#   overwrite-32    writes at depth 32 into a fully allocated 1 GiB top
#   read-32, read-1 reads at depth 32 and 1 of a 1 GiB one-layer image
#   drain-under-writes  live snapshots (10) under allocating writes at
#                   depth 32 into a fresh overlay of a 4 GiB base: the
#                   drain step of each (ms; median over the snapshots)
# Within a round the order of the two servers alternates, so that neither
# always runs first.
# Prints a table of medians and after/before ratios; raw results in
# $OUT (default /tmp/sqcow2-bench-write-path).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands cc:gcc qemu-img:qemu-utils

rev=${1:-b10fc02}
rounds=${2:-3}
secs=${3:-5}
out=${OUT:-/tmp/sqcow2-bench-write-path}
root=$PWD

echo "==> building this tree (release)" >&2
cargo build --release --locked -p sqcow2-cli >&2
if cargo metadata --no-deps --format-version 1 | grep -q '"name":"sqcow2-bench"'; then
  cargo build --release --locked -p sqcow2-bench >&2
  load=("$root/target/release/sqcow2-bench" load)
else
  load=("$root/target/release/sqcow2" bench load)
fi
after=$root/target/release/sqcow2

base_tree=${BASELINE_TREE:-/tmp/sqcow2-baseline-$rev}
if [ ! -x "$base_tree/target/release/sqcow2" ]; then
  echo "==> building baseline $rev in $base_tree (release)" >&2
  rm -rf "$base_tree"
  git worktree prune
  git worktree add --detach "$base_tree" "$rev" >&2
  (cd "$base_tree" && CARGO_TARGET_DIR="$base_tree/target" cargo build --release --locked -p sqcow2-cli >&2)
fi
before=$base_tree/target/release/sqcow2

rm -rf "$out" && mkdir -p "$out/img"
cd "$out/img"
echo "==> images" >&2
mkdir big small full ro data
big=$("$after" gen-chain --layers 1 --size 32G --fill 0.02 big)
case " ${LOADS:-cow-new} " in
  *" cow-new"*) data=$("$after" gen-chain --layers 1 --size 8G --fill 1.0 data) ;;
esac
base4=$("$after" gen-chain --layers 1 --size 4G --fill 0.02 small)
full=$("$after" gen-chain --layers 1 --size 1G --fill 1.0 full)
small=$("$after" gen-chain --layers 1 --size 1G --fill 1.0 ro)

serve() { # bin image extra... ; starts a daemon, sets $pid
  local bin=$1 img=$2; shift 2
  rm -f v.sock serve.pid c.sock
  "$bin" serve --socket v.sock --pidfile serve.pid "$@" "$img" 2>>serve.log &
  pid=$!
  for _ in $(seq 200); do [ -f serve.pid ] && return 0; sleep 0.05; done
  echo "server did not start" >&2; cat serve.log >&2; exit 1
}
stop() { kill -TERM "$pid"; wait "$pid" || true; }

measure() { # who bin load
  local who=$1 bin=$2 name=$3
  case $name in
    alloc-write-*)
      local depth=${name#alloc-write-} every=0
      case $depth in *-flush*) every=${depth#*-flush}; depth=${depth%%-*} ;; esac
      rm -f over.qcow2 over.qcow2.sqidx
      qemu-img create -q -f qcow2 -b "$big" -F qcow2 over.qcow2
      serve "$bin" over.qcow2
      "${load[@]}" --socket v.sock --pattern rand-write --bs 4096 --iodepth "$depth" \
        --flush-every "$every" --duration "$secs" --output json >r.json ;;
    alloc-new-*|cow-new-*)
      local depth=${name##*-} base=$big
      case $name in cow-*) base=$data ;; esac
      rm -f over.qcow2 over.qcow2.sqidx over.qcow2.sqjournal
      qemu-img create -q -f qcow2 -b "$base" -F qcow2 over.qcow2
      serve "$bin" over.qcow2
      "${load[@]}" --socket v.sock --pattern rand-write-new --bs 4096 --iodepth "$depth" \
        --duration "$secs" --output json >r.json ;;
    overwrite-32)
      serve "$bin" "$full"
      "${load[@]}" --socket v.sock --pattern rand-write --bs 4096 --iodepth 32 --duration "$secs" --output json >r.json ;;
    read-32|read-1)
      serve "$bin" "$small" --read-only
      "${load[@]}" --socket v.sock --pattern rand-read --bs 4096 --iodepth "${name#read-}" --duration "$secs" --output json >r.json ;;
    drain-under-writes)
      rm -f over.qcow2 over.qcow2.sqidx live*.qcow2 live*.sqidx
      qemu-img create -q -f qcow2 -b "$base4" -F qcow2 over.qcow2
      serve "$bin" over.qcow2 --control c.sock
      "${load[@]}" --socket v.sock --pattern rand-write --bs 4096 --iodepth 32 --duration 30 --output json >load.json &
      local lp=$! drains=()
      sleep 1
      for i in $(seq 1 10); do
        d=$("$bin" snapshot --live c.sock "live$i.qcow2" --output json 2>/dev/null \
          | python3 -c 'import json,sys; print(json.load(sys.stdin)["steps"]["drain-ms"])' || echo NaN)
        drains+=("$d")
        sleep 0.5
        kill -0 $lp 2>/dev/null || break
      done
      kill -INT $lp 2>/dev/null || true
      wait $lp || true
      printf '{"drain-ms": [%s]}\n' "$(IFS=,; echo "${drains[*]}")" >r.json ;;
  esac
  stop
  python3 - "$who" "$name" r.json >>"$out/results.jsonl" <<'PY'
import json, sys
who, name, path = sys.argv[1:4]
r = json.load(open(path))
if "drain-ms" in r:
    d = sorted(x for x in r["drain-ms"] if x == x)
    v = d[len(d) // 2] if d else float("nan")
    print(json.dumps({"who": who, "load": name, "value": v, "unit": "ms (median drain)", "all": d}))
else:
    print(json.dumps({"who": who, "load": name, "value": r["iops"], "unit": "IOPS",
                      "p99_us": r["lat_p99_us"], "errors": r["errors"]}))
PY
}

loads=(${LOADS:-alloc-write-32 alloc-write-1 alloc-write-32-flush32 alloc-new-1 alloc-new-32 cow-new-1 cow-new-32 overwrite-32 read-32 read-1 drain-under-writes})
for r in $(seq 1 "$rounds"); do
  order=(before after)
  [ $((r % 2)) -eq 0 ] && order=(after before)
  for name in "${loads[@]}"; do
    for who in "${order[@]}"; do
      if [ "$who" = before ]; then bin=$before; else bin=$after; fi
      echo "==> round $r: $name ($who)" >&2
      measure "$who" "$bin" "$name"
    done
  done
done

python3 - "$out/results.jsonl" "$rev" "$(git -C "$root" rev-parse --short HEAD)" "$rounds" "$secs" <<'PY'
import json, sys, statistics
path, rev, head, rounds, secs = sys.argv[1:6]
rows = [json.loads(l) for l in open(path)]
loads = []
for r in rows:
    if r["load"] not in loads:
        loads.append(r["load"])
print(f"before = {rev}, after = {head} (+ working tree); {rounds} interleaved rounds of {secs} s; medians")
print()
print("| load | unit | before | after | after/before |")
print("| --- | --- | ---: | ---: | ---: |")
for l in loads:
    b = statistics.median(r["value"] for r in rows if r["load"] == l and r["who"] == "before")
    a = statistics.median(r["value"] for r in rows if r["load"] == l and r["who"] == "after")
    unit = next(r["unit"] for r in rows if r["load"] == l)
    fmt = (lambda v: f"{v:,.0f}") if unit == "IOPS" else (lambda v: f"{v:.1f}")
    print(f"| {l} | {unit} | {fmt(b)} | {fmt(a)} | {a / b:.2f} |")
errors = sum(r.get("errors", 0) for r in rows)
print()
print(f"request errors: {errors}")
PY
