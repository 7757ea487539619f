#!/usr/bin/env bash
# What persistent dirty bitmaps cost the guest's writes: `sqcow2 serve`
# of the same 1 GiB disk with no bitmap, with one enabled bitmap (64 KiB
# granules, libvirt's default) and with four (512 B, 4 KiB, 64 KiB,
# 1 MiB), random 4 KiB writes at depth 32 (sqcow2-bench load, one
# queue), ROUNDS rounds with the three in turn.
#
#   scripts/bench-bitmaps.sh [ROUNDS] [SECONDS]   (defaults: 3, 4)
#
# Two disks: "in-place", every cluster allocated first (writes go
# straight to the file: the cheapest write, where tracking weighs most),
# the bitmaps cleared before each load; "allocating", a fresh empty
# 64 GiB image each load (rand-write-new: every write allocates a
# cluster). Everything is synced before each load: dirty pages of an
# earlier step written back during it would slow its writes.
# CACHE (default none) is serve's --cache: with writeback, in-place
# random writes into a cached file run at 13-60k IOPS depending on the
# file's page cache history (ext4_block_write_begin in io_uring's
# workers), whatever the bitmaps, which drowns what they cost.
# Prints each case's median IOPS and the ratios to no bitmap; raw
# results in $OUT (default /tmp/sqcow2-bench-bitmaps).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
. scripts/lib/bench.sh
ensure_commands qemu-img:qemu-utils qemu-io:qemu-utils

rounds=${1:-3}
secs=${2:-4}
out=${OUT:-/tmp/sqcow2-bench-bitmaps}
cache=${CACHE:-none}
root=$PWD

echo "==> building (release)" >&2
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
sq=$root/target/release/sqcow2
load=$root/target/release/sqcow2-bench

rm -rf "$out" && mkdir -p "$out"
cd "$out"

# add_bitmaps IMAGE CASE
add_bitmaps() {
  case $2 in
    none) ;;
    one) "$sq" bitmap --add -g 64K "$1" b64k ;;
    four)
      for g in 512 4K 64K 1M; do "$sq" bitmap --add -g "$g" "$1" "b$g"; done ;;
  esac
}

echo "==> in-place disks (1 GiB, every cluster written)" >&2
for c in none one four; do
  qemu-img create -q -f qcow2 "inplace-$c.qcow2" 1G
  qemu-io -f qcow2 -c "write -P 1 0 1G" "inplace-$c.qcow2" >/dev/null
  add_bitmaps "inplace-$c.qcow2" "$c"
done

# run DISK CASE ROUND
run() {
  local disk=$1 c=$2 round=$3 image pattern json iops
  if [ "$disk" = in-place ]; then
    image=inplace-$c.qcow2 pattern=rand-write
    case $c in
      one) "$sq" bitmap --clear "$image" b64k ;;
      four) for g in 512 4K 64K 1M; do "$sq" bitmap --clear "$image" "b$g"; done ;;
    esac
  else
    image=fresh-$c-$round.qcow2 pattern=rand-write-new
    qemu-img create -q -f qcow2 "$image" 64G
    add_bitmaps "$image" "$c"
  fi
  sync
  rm -f v.sock
  "$sq" serve --cache "$cache" --socket v.sock "$image" 2>>serve.log &
  local pid=$!
  wait_socket v.sock
  json=$("$load" load --socket v.sock --pattern "$pattern" --bs 4k --iodepth 32 \
    --duration "$secs" --output json)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  iops=$(echo "$json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["iops"])')
  printf '%s\t%s\t%s\t%s\n' "$disk" "$c" "$round" "$iops" >> results.tsv
  echo "  $disk $c round $round: $iops IOPS" >&2
  [ "$disk" = allocating ] && rm -f "$image" "$image".sq*
  return 0
}

for round in $(seq "$rounds"); do
  for disk in in-place allocating; do
    # The order turns each round.
    case $((round % 3)) in
      1) order="none one four" ;;
      2) order="one four none" ;;
      0) order="four none one" ;;
    esac
    for c in $order; do run "$disk" "$c" "$round"; done
  done
done

python3 - results.tsv <<'EOF'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().split("\n") if l]
med = {}
for disk, c, _, iops in rows:
    med.setdefault((disk, c), []).append(float(iops))
print("| disk | no bitmap | one (64 KiB) | four (512 B - 1 MiB) | one / none | four / none |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for disk in ("in-place", "allocating"):
    m = {c: statistics.median(med[(disk, c)]) for c in ("none", "one", "four")}
    print(f"| {disk} | {m['none']:.0f} | {m['one']:.0f} | {m['four']:.0f} | "
          f"{m['one'] / m['none']:.3f} | {m['four'] / m['none']:.3f} |")
EOF
