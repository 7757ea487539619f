#!/usr/bin/env bash
# Pause of live snapshots while a client writes: generates a chain of
# SIZE (sparse), serves it with a control socket, runs a random-write load
# at depth 16 and takes N live snapshots; prints each reply and the
# p50/p99 pause.
#
#   scripts/bench-live-snapshot.sh [SIZE] [N] [DIR]   (default 10G 20 /tmp/sqcow2-live)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-10G}
n=${2:-20}
dir=${3:-/tmp/sqcow2-live}
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
bin=$PWD/target/release/sqcow2
bench=$PWD/target/release/sqcow2-bench
rm -rf "$dir" && mkdir -p "$dir" && cd "$dir"
top=$("$bin" gen-chain --layers 10 --size "$size" --fill 0.02 .)
"$bin" serve --socket v.sock --control c.sock --pidfile serve.pid "$top" 2>serve.log &
while [ ! -f serve.pid ]; do sleep 0.1; done
"$bench" load --socket v.sock --pattern rand-write --iodepth 16 --duration $((n / 2 + 5)) > load.txt &
sleep 1
for i in $(seq 1 "$n"); do
  "$bin" snapshot --live c.sock "live$i.qcow2" --output json | tr -d '\n ' | tee -a replies.jsonl
  echo | tee -a replies.jsonl
  sleep 0.4
done
wait %2 || true
cat load.txt
kill -TERM "$(cat serve.pid)"
python3 - <<'PY'
import json
p = sorted(json.loads(l)["pause_ms"] for l in open("replies.jsonl") if l.strip())
q = lambda f: p[round((len(p) - 1) * f)]
print(f"{len(p)} live snapshots: pause p50 {q(0.5):.1f} ms, p99 {q(0.99):.1f} ms, max {p[-1]:.1f} ms")
PY
