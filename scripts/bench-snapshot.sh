#!/usr/bin/env bash
# Snapshot time of a fully allocated 50 GiB-virtual top (metadata
# preallocation: every cluster mapped, the file sparse): `sqcow2 snapshot`
# (new top + its chain index) beside `qemu-img create -b` on the same chain.
#
#   scripts/bench-snapshot.sh [DIR] [SIZE] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands cc:gcc qemu-img:qemu-utils
dir=${1:-$(mktemp -d)}
size=${2:-50G}
runs=${3:-5}
cargo build --release --locked -p sqcow2-cli >/dev/null
sqcow2=$PWD/target/release/sqcow2
mkdir -p "$dir"
qemu-img create -q -f qcow2 "$dir/base.qcow2" "$size"
# QEMU refuses preallocation together with a backing file: preallocate,
# then attach the backing file.
qemu-img create -q -f qcow2 -o preallocation=metadata "$dir/top.qcow2" "$size"
qemu-img rebase -u -b base.qcow2 -F qcow2 "$dir/top.qcow2"
"$sqcow2" upgrade "$dir/top.qcow2" >/dev/null
ms() { echo $(( ($2 - $1) / 1000000 )); }
s_times=(); q_times=()
for i in $(seq 1 "$runs"); do
  rm -f "$dir/new.qcow2" "$dir/new.qcow2.sqidx" "$dir/q.qcow2"
  sync
  t0=$(date +%s%N); "$sqcow2" snapshot "$dir/top.qcow2" "$dir/new.qcow2" >/dev/null; t1=$(date +%s%N)
  qemu-img create -q -f qcow2 -b top.qcow2 -F qcow2 "$dir/q.qcow2"; t2=$(date +%s%N)
  s_times+=("$(ms "$t0" "$t1")"); q_times+=("$(ms "$t1" "$t2")")
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo "top: $size virtual, $(qemu-img map --output json "$dir/top.qcow2" | grep -c '"data": true') data extents, index $(stat -c %s "$dir/new.qcow2.sqidx") bytes"
echo "sqcow2 snapshot (new top + index): median $(median "${s_times[@]}") ms over $runs runs (${s_times[*]})"
echo "qemu-img create -b:                median $(median "${q_times[@]}") ms over $runs runs (${q_times[*]})"
"$sqcow2" info "$dir/new.qcow2" | grep "chain index"
