#!/usr/bin/env bash
# An incremental backup over NBD: what it moves after 2 % of a disk
# changed, sqcow2 against QEMU on the same image and the same writes.
#
#   scripts/bench-backup.sh        (SIZE default 1G)
#
# For each pattern (64k: 2 % of the disk in random 64 KiB-aligned
# 64 KiB writes, bitmap granularity 64 KiB; 4k: 2 % in random 4 KiB
# writes, granularity 4 KiB) and each server: a fresh image wholly
# written, a bitmap added (the checkpoint), the writes, then the
# incremental: `nbdinfo --map=qemu:dirty-bitmap:b` for the dirty ranges
# and each range read over NBD (one qemu-io, a read per range).
# sqcow2: `sqcow2 serve --nbd --nbd-writable`, the writes through
# qemu-io over that export (the served path keeps the bitmap).
# QEMU: the writes through qemu-io on the image (QEMU's own writer
# keeps the bitmap: qemu-nbd refuses an enabled bitmap on a writable
# export), then `qemu-nbd -r -B b` (--aio=io_uring) for the map and the
# reads. Prints, per pattern and server, the bytes the incremental moves
# (and % of the disk), its ranges, and the seconds the map and the reads
# took; whether both servers' maps are equal. Raw results in $OUT
# (default /tmp/sqcow2-bench-backup).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
. scripts/lib/bench.sh
ensure_commands qemu-img:qemu-utils qemu-nbd:qemu-utils qemu-io:qemu-utils nbdinfo:libnbd-bin

out=${OUT:-/tmp/sqcow2-bench-backup}
size=${SIZE:-1G}
root=$PWD

echo "==> building (release)" >&2
cargo build --release --locked -p sqcow2-cli >&2
sq=$root/target/release/sqcow2

rm -rf "$out" && mkdir -p "$out"
cd "$out"
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null || true' EXIT
bytes=$(qemu-img create -q -f qcow2 probe.qcow2 "$size" && qemu-img info --output=json probe.qcow2 |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["virtual-size"])')
rm -f probe.qcow2

# writes PATTERN: the qemu-io write commands (seeded: the same for both).
writes() {
  python3 - "$1" "$bytes" <<'PY'
import random, sys
pattern, size = sys.argv[1], int(sys.argv[2])
block = 65536 if pattern == "64k" else 4096
rng = random.Random(46)
offsets = rng.sample(range(size // block), size * 2 // 100 // block)
for i, b in enumerate(offsets):
    print(f"write -P {0x40 + i % 64} {b * block} {block}")
PY
}

# fresh NAME GRANULARITY: a wholly written image with bitmap b.
fresh() {
  qemu-img create -q -f qcow2 -o cluster_size=65536 "$1" "$size"
  local at fill=()
  for ((at = 0; at < bytes; at += 64 << 20)); do fill+=(-c "write -P 1 $at $((64 << 20))"); done
  qemu-io -f qcow2 "${fill[@]}" "$1" >/dev/null
  qemu-img bitmap --add -g "$2" "$1" b
}

# cmd_args FILE ARRAY: ARRAY set to "-c LINE" for each line of FILE.
cmd_args() {
  local -n into=$2
  into=()
  while IFS= read -r line; do into+=(-c "$line"); done <"$1"
}

# incremental URI PATTERN SERVER: the map and the reads of its ranges.
incremental() {
  local uri=$1 pattern=$2 server=$3 t0 t1 t2
  t0=$(date +%s.%N)
  nbdinfo --map=qemu:dirty-bitmap:b "$uri" >"map-$pattern-$server.txt"
  t1=$(date +%s.%N)
  awk '$3 == 1 { print "read " $1 " " $2 }' "map-$pattern-$server.txt" >"reads-$pattern-$server.txt"
  local args
  cmd_args "reads-$pattern-$server.txt" args
  if [ "${#args[@]}" -gt 0 ]; then
    qemu-io -r -f raw "${args[@]}" "$uri" >/dev/null
  fi
  t2=$(date +%s.%N)
  python3 - "$pattern" "$server" "$bytes" "$t0" "$t1" "$t2" "map-$pattern-$server.txt" <<'PY' | tee -a results.tsv
import sys
pattern, server, size, t0, t1, t2, path = sys.argv[1:]
moved = ranges = 0
for line in open(path):
    f = line.split()
    if len(f) >= 3 and f[2] == "1":
        moved += int(f[1]); ranges += 1
print(f"{pattern}\t{server}\t{moved}\t{100 * moved / int(size):.2f}\t{ranges}\t"
      f"{float(t1) - float(t0):.2f}\t{float(t2) - float(t1):.2f}")
PY
}

printf 'pattern\tserver\tmoved-bytes\tmoved-%%\tranges\tmap-s\tread-s\n' | tee results.tsv
for pattern in 64k 4k; do
  gran=$([ "$pattern" = 64k ] && echo 65536 || echo 4096)
  writes "$pattern" >"writes-$pattern.txt"
  declare -a wargs
  cmd_args "writes-$pattern.txt" wargs

  # sqcow2: written and read through its NBD export.
  fresh "sq-$pattern.qcow2" "$gran"
  rm -f n.sock v.sock
  "$sq" serve --socket v.sock --nbd "unix:$PWD/n.sock" --nbd-writable "sq-$pattern.qcow2" 2>>sqcow2.log &
  pid=$!
  wait_socket n.sock
  uri="nbd+unix:///?socket=$PWD/n.sock"
  qemu-io -f raw "${wargs[@]}" "$uri" >/dev/null
  incremental "$uri" "$pattern" sqcow2 >/dev/null
  kill "$pid"; wait "$pid" || true

  # QEMU: written by qemu-io, read through qemu-nbd.
  fresh "q-$pattern.qcow2" "$gran"
  qemu-io -f qcow2 "${wargs[@]}" "q-$pattern.qcow2" >/dev/null
  rm -f n.sock
  qemu-nbd -r -t --aio=io_uring -B b -f qcow2 -k "$PWD/n.sock" "q-$pattern.qcow2" 2>>qemu-nbd.log &
  pid=$!
  wait_socket n.sock
  incremental "nbd+unix:///?socket=$PWD/n.sock" "$pattern" qemu-nbd >/dev/null
  kill "$pid"; wait "$pid" || true
  if cmp -s "map-$pattern-sqcow2.txt" "map-$pattern-qemu-nbd.txt"; then same=yes; else same=NO; fi
  echo "$pattern: dirty maps equal: $same" | tee -a results.txt
  rm -f "sq-$pattern.qcow2" "q-$pattern.qcow2"
done
column -t results.tsv
cat results.txt
