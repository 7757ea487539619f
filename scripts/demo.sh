#!/usr/bin/env bash
# The main job on an embedded default: builds a 30-layer qcow2 backing
# chain with QEMU's tools, checks that sqcow2 reads every byte as QEMU does,
# indexes it (sQcow2), then serves it as a vhost-user-blk device and prints
# the QEMU and Cloud Hypervisor command lines that attach a guest to it.
#
#   scripts/demo.sh [--boot] [DIR] [LAYERS]
#
# Without --boot the daemon runs in the foreground until Ctrl-C. With
# --boot a Debian cloud kernel is booted once under QEMU against it (the
# guest hashes the disk, which must equal qemu-img's hash), then the demo
# stops the daemon and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh

boot=0
if [ "${1:-}" = "--boot" ]; then
  boot=1
  shift
fi
dir=${1:-demo}
layers=${2:-30}
if [ $boot = 1 ]; then
  ensure_commands qemu-system-x86_64:qemu-system-x86 busybox:busybox-static
fi
ensure_commands cc:gcc qemu-img:qemu-utils qemu-io:qemu-utils

echo "==> building sqcow2 (release)"
cargo build --release --locked -p sqcow2-cli
sqcow2=$PWD/target/release/sqcow2

echo "==> building a ${layers}-layer chain in $dir/ (1 GiB virtual, data in every layer)"
rm -rf "$dir" && mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
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
echo "==> sqcow2 convert -O raw (the whole disk through the engine) vs qemu-img convert"
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
echo
echo "==> sqcow2 upgrade: index the chain in place (direct access, one lookup per read)"
"$sqcow2" upgrade "$top"
"$sqcow2" info "$top" | grep "chain index"
qemu-img check -q "$top" && echo "qemu-img check: the indexed top is clean for QEMU"

sock="$dir/vhost.sock"
cat <<EOT

==> serving $top on $sock

Attach a QEMU guest (shared guest memory is required by vhost-user):

  qemu-system-x86_64 -machine q35,accel=kvm:tcg,memory-backend=mem -m 1G \\
    -object memory-backend-memfd,id=mem,size=1G,share=on \\
    -chardev socket,id=disk0,path=$sock,reconnect=1 \\
    -device vhost-user-blk-pci,chardev=disk0,num-queues=2 \\
    <your usual -kernel/-initrd/-append or boot disk options>

Attach a Cloud Hypervisor guest:

  cloud-hypervisor --cpus boot=2 --memory size=1G,shared=on \\
    --disk vhost_user=true,socket=$sock,num_queues=2 \\
    <your usual --kernel/--cmdline or --firmware options>

EOT

serve=("$sqcow2" serve --socket "$sock" --num-queues 2 --pidfile "$dir/serve.pid" "$top")
if [ $boot = 0 ]; then
  echo "(Ctrl-C stops the daemon; it flushes and removes the socket.)"
  exec "${serve[@]}"
fi

kit=$(scripts/guest-kit.sh)
rm -f "$dir/serve.pid"
"${serve[@]}" 2>"$dir/serve.log" &
daemon=$!
trap 'kill $daemon 2>/dev/null || true' EXIT
while [ ! -f "$dir/serve.pid" ]; do sleep 0.1; done
accel=tcg
if [ -e /dev/kvm ] && timeout 20 qemu-system-x86_64 -accel kvm -m 256M -nodefaults \
    -kernel "$kit/vmlinuz" -initrd "$kit/initrd.img" -display none -serial stdio -no-reboot \
    -append "console=ttyS0 panic=-1 quiet sqcow2.smoke=1" 2>/dev/null | grep -q SQCOW2-GUEST-UP; then
  accel=kvm
fi
echo "==> booting a Debian cloud kernel under QEMU ($accel) on the served chain"
timeout 600 qemu-system-x86_64 -accel $accel -m 512M -nodefaults \
  -object memory-backend-memfd,id=mem,size=512M,share=on -machine q35,memory-backend=mem \
  -kernel "$kit/vmlinuz" -initrd "$kit/initrd.img" -display none -serial stdio -no-reboot \
  -append "console=ttyS0 panic=-1 quiet" \
  -chardev socket,id=disk0,path="$sock" -device vhost-user-blk-pci,chardev=disk0,num-queues=2 \
  | tee "$dir/console.log" | grep --line-buffered SQCOW2-GUEST
guest=$(awk '/SQCOW2-GUEST-SHA256/ {print $2}' "$dir/console.log" | tr -d '\r')
kill -TERM $daemon
wait $daemon
trap - EXIT
echo "guest sha256 of /dev/vda: $guest"
echo "qemu-img sha256:          $theirs"
[ "$guest" = "$theirs" ] || { echo "MISMATCH between the guest and qemu-img" >&2; exit 1; }
echo "identical: the guest read the ${layers}-layer chain through sqcow2 serve as QEMU does"
