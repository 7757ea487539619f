#!/usr/bin/env bash
# The main job on an embedded default: builds a 30-layer qcow2 backing chain
# with QEMU's tools, shows what sqcow2 reads from it and checks that every
# byte equals what QEMU reads, then indexes the chain (sQcow2) and checks
# again.
#
#   scripts/demo.sh [DIR] [LAYERS]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh

dir=${1:-demo}
layers=${2:-30}
ensure_commands cc:gcc qemu-img:qemu-utils qemu-io:qemu-utils

echo "==> building sqcow2 (release)"
cargo build --release --locked -p sqcow2-cli
sqcow2=$PWD/target/release/sqcow2

echo "==> building a ${layers}-layer chain in $dir/ (1 GiB virtual, data in every layer)"
rm -rf "$dir" && mkdir -p "$dir"
qemu-img create -q -f qcow2 -o compression_type=zstd "$dir/layer0.qcow2" 1G
qemu-io -f qcow2 -c "write -P 1 0 64M" -c "write -c -P 2 128M 4M" "$dir/layer0.qcow2" >/dev/null
for i in $(seq 1 $((layers - 1))); do
  qemu-img create -q -f qcow2 -b "layer$((i - 1)).qcow2" -F qcow2 "$dir/layer$i.qcow2"
  off=$(( (i * 7919 % 1000) * 1024 * 1024 ))
  qemu-io -f qcow2 -c "write -P $((i % 250 + 3)) $off 1M" -c "write -z $((off / 2)) 64k" \
    "$dir/layer$i.qcow2" >/dev/null
done
top="$dir/layer$((layers - 1)).qcow2"

echo "==> sqcow2 info $top"
"$sqcow2" info "$top"
echo
echo "==> sqcow2 map $top (first lines)"
"$sqcow2" map "$top" | head -8
echo
echo "==> sqcow2 convert -O raw (the whole disk through the engine)"
"$sqcow2" convert -p -O raw "$top" "$dir/sqcow2.raw"
qemu-img convert -O raw "$top" "$dir/qemu.raw"
ours=$(sha256sum "$dir/sqcow2.raw" | cut -d' ' -f1)
theirs=$(sha256sum "$dir/qemu.raw" | cut -d' ' -f1)
rm -f "$dir/sqcow2.raw" "$dir/qemu.raw"
echo "sqcow2:   $ours"
echo "qemu-img: $theirs"
if [ "$ours" != "$theirs" ]; then
  echo "MISMATCH: sqcow2 and QEMU read different bytes" >&2
  exit 1
fi
echo "identical: sqcow2 reads every byte of the ${layers}-layer chain as QEMU does"
echo
echo "==> sqcow2 upgrade: index the chain in place (direct access, one lookup per read)"
"$sqcow2" upgrade "$top"
"$sqcow2" info "$top" | grep "chain index"
"$sqcow2" convert -O raw "$top" "$dir/indexed.raw"
indexed=$(sha256sum "$dir/indexed.raw" | cut -d' ' -f1)
rm -f "$dir/indexed.raw"
[ "$indexed" = "$theirs" ] || { echo "MISMATCH in indexed mode" >&2; exit 1; }
echo "indexed:  $indexed (identical)"
qemu-img check -q "$top" && echo "qemu-img check: the indexed top is clean for QEMU"
