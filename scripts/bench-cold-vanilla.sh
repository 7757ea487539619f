#!/usr/bin/env bash
# A chain QEMU could have made (vanilla: no index), served cold by
# `sqcow2 serve`, which indexes it in the background: random 4 KiB reads
# at depth 32 second by second from the first request, against the same
# chain indexed beforehand (`sqcow2 upgrade`), measured in the same run.
#
#   scripts/bench-cold-vanilla.sh [SECONDS]   (default 30)
#
# Chain: `sqcow2 gen-chain --no-index --layers $LAYERS --size $SIZE --fill
# $FILL` (defaults 100, 1G, 0.5: the read suite's chains); both copies in
# the page cache. Prints IOPS per second of the cold chain, each as a
# ratio of the indexed chain's median, and the first second at >= 0.9x.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
. scripts/lib/bench.sh
ensure_commands qemu-img:qemu-utils

secs=${1:-30}
layers=${LAYERS:-100}
out=${OUT:-/tmp/sqcow2-bench-cold-vanilla}
root=$PWD

echo "==> building (release)" >&2
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
sq=$root/target/release/sqcow2
load=$root/target/release/sqcow2-bench

rm -rf "$out" && mkdir -p "$out/vanilla"
cd "$out"
top=$("$sq" gen-chain --no-index --layers "$layers" --size "${SIZE:-1G}" \
  --fill "${FILL:-0.5}" vanilla | xargs readlink -f)
cp -a vanilla indexed
itop=$PWD/indexed/$(basename "$top")
"$sq" upgrade "$itop" >/dev/null
cat vanilla/* indexed/* > /dev/null

# one_second: IOPS of a 1 s random-read load on v.sock
one_second() {
  "$load" load --socket v.sock --pattern rand-read --iodepth 32 --duration 1 \
    --output json | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["iops"]))'
}

echo "==> indexed chain (upgraded beforehand)" >&2
rm -f v.sock
"$sq" serve --socket v.sock "$itop" 2>indexed.log & pid=$!
wait_socket v.sock
ref=()
for _ in $(seq 5); do ref+=("$(one_second)"); done
kill "$pid"; wait "$pid" 2>/dev/null || true
median=$(printf '%s\n' "${ref[@]}" | sort -n | sed -n 3p)
echo "indexed: ${ref[*]} IOPS (median $median)"

echo "==> vanilla chain, served cold" >&2
rm -f v.sock
"$sq" serve --socket v.sock --control c.sock "$top" 2>cold.log & pid=$!
wait_socket v.sock
first=""
for s in $(seq "$secs"); do
  iops=$(one_second)
  ratio=$(python3 -c "print(f'{$iops/$median:.2f}')")
  mode=$("$sq" stats c.sock --output json | python3 -c 'import json,sys; print(json.load(sys.stdin)["index-mode"])')
  echo "second $s: $iops IOPS ($ratio x indexed; $mode)"
  if [ -z "$first" ] && python3 -c "import sys; sys.exit(0 if $iops >= 0.9 * $median else 1)"; then
    first=$s
  fi
done
kill "$pid"; wait "$pid" 2>/dev/null || true
grep "chain index built" cold.log | sed 's/^/  /' || true
echo "first second at >= 0.9x the indexed chain: ${first:-none within $secs s}"
