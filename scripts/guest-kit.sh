#!/usr/bin/env bash
# Prepares what the QEMU guest test boots: a Debian cloud kernel and a
# busybox-static initramfs that loads the virtio modules. Installs
# qemu-system-x86 and busybox-static when missing; downloads the kernel
# package with `apt-get download` (nothing is installed from it).
#
# Usage: scripts/guest-kit.sh [DIR]   (default: target/guest-kit)
# Prints DIR; DIR holds vmlinuz, initrd.img and kit.ok when done.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh

KIT=${1:-target/guest-kit}
mkdir -p "$KIT"
KIT=$(cd "$KIT" && pwd)
# A kit is reused only if this script made it as it is now.
STAMP=$(cat scripts/guest-kit.sh scripts/lib/guest-loop.sh | sha256sum | cut -d" " -f1)
if [ "$(cat "$KIT/kit.ok" 2>/dev/null)" = "$STAMP" ] && [ -f "$KIT/vmlinuz" ] &&
  [ -f "$KIT/initrd.img" ]; then
  echo "$KIT"
  exit 0
fi

ensure_commands qemu-system-x86_64:qemu-system-x86 busybox:busybox-static \
  cpio:cpio xz:xz-utils dpkg-deb:dpkg

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
chmod 755 "$WORK"

# The cloud kernel metapackage names the versioned image package.
META=linux-image-cloud-amd64
PKG=$(apt-cache depends "$META" 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')
if [ -z "$PKG" ]; then
  as_root apt-get update -qq
  PKG=$(apt-cache depends "$META" | awk '/Depends: linux-image-/ {print $2; exit}')
fi
# The package is kept in the kit: a changed init script needs no download.
if ! ls "$KIT"/"$PKG"_*.deb >/dev/null 2>&1; then
  echo "==> downloading $PKG" >&2
  rm -f "$KIT"/linux-image-*.deb
  (cd "$WORK" && apt-get download -q "$PKG" >&2)
  mv "$WORK"/"$PKG"_*.deb "$KIT"/
fi
dpkg-deb -x "$KIT"/"$PKG"_*.deb "$WORK/kernel"
cp "$WORK"/kernel/boot/vmlinuz-* "$KIT/vmlinuz"
MODDIR=$(echo "$WORK"/kernel/lib/modules/*)

ROOT="$WORK/initramfs"
mkdir -p "$ROOT"/{bin,dev,proc,sys,lib,tmp}
cp "$(command -v busybox)" "$ROOT/bin/busybox"
# Dependency order (the init script also retries in passes).
MODS="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk"
for m in $MODS; do
  f=$(find "$MODDIR" -name "$m.ko*" | head -1)
  if [ -z "$f" ]; then
    echo "module $m not found in $PKG" >&2
    exit 1
  fi
  case "$f" in
    *.ko.xz) xz -dc "$f" > "$ROOT/lib/$m.ko" ;;
    *.ko.zst) zstd -dcq "$f" > "$ROOT/lib/$m.ko" ;;
    *.ko) cp "$f" "$ROOT/lib/$m.ko" ;;
  esac
done
echo "$MODS" > "$ROOT/lib/modules.order"

cat > "$ROOT/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "SQCOW2-GUEST-UP"
. /lib/loop.sh
grep -q sqcow2.smoke /proc/cmdline && poweroff -f
# Load in passes: a module whose dependencies are not in yet is retried.
left=$(cat /lib/modules.order)
for pass in 1 2 3 4 5 6; do
  next=""
  for m in $left; do
    insmod /lib/$m.ko 2>/dev/null || next="$next $m"
  done
  left=$next
  [ -z "$left" ] && break
done
[ -n "$left" ] && echo "SQCOW2-GUEST-FAIL insmod$left"
# The test's instructions come on the kernel command line.
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    sqcow2.pattern_offset=*) PATTERN_OFFSET=${arg#*=} ;;
    sqcow2.pattern_len=*) PATTERN_LEN=${arg#*=} ;;
    sqcow2.loop=*) LOOP=${arg#*=} ;;
    sqcow2.grow=*) GROW=${arg#*=} ;;
  esac
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
if [ ! -b /dev/vda ]; then
  echo "SQCOW2-GUEST-FAIL no /dev/vda"
  poweroff -f
fi
echo "SQCOW2-GUEST-SIZE $(blockdev --getsize64 /dev/vda)"
echo "SQCOW2-GUEST-RO $(blockdev --getro /dev/vda)"
echo "SQCOW2-GUEST-SHA256 $(sha256sum /dev/vda | cut -d' ' -f1)"
if [ -n "${PATTERN_OFFSET:-}" ]; then
  # 0x5a bytes, written with O_DIRECT and flushed (fsync -> FLUSH).
  blocks=$((PATTERN_LEN / 65536))
  dd if=/dev/zero bs=65536 count=$blocks 2>/dev/null | tr '\000' 'Z' > /tmp/pattern
  if dd if=/tmp/pattern of=/dev/vda bs=65536 seek=$((PATTERN_OFFSET / 65536)) conv=fsync,notrunc 2>/dev/null; then
    echo "SQCOW2-GUEST-WROTE"
  else
    echo "SQCOW2-GUEST-FAIL write"
  fi
  sync
  echo "SQCOW2-GUEST-REREAD $(dd if=/dev/vda bs=65536 skip=$((PATTERN_OFFSET / 65536)) count=$blocks 2>/dev/null | sha256sum | cut -d' ' -f1)"
fi
if [ -n "${GROW:-}" ]; then
  # A live resize to GROW bytes: reads keep the disk busy until the
  # size changes (looked at every 20 ms, at most 60 s), then the last
  # MiB of the new space is written with O_DIRECT, flushed, read back
  # and compared.
  echo "SQCOW2-GUEST-WAITING-GROW"
  i=0
  while [ "$(blockdev --getsize64 /dev/vda)" != "$GROW" ] && [ $i -lt 3000 ]; do
    dd if=/dev/vda of=/dev/null bs=65536 count=4 skip=$((i % 256 * 4)) iflag=direct 2>/dev/null ||
      echo "SQCOW2-GUEST-FAIL read while waiting"
    sleep 0.02
    i=$((i + 1))
  done
  echo "SQCOW2-GUEST-GREW $(blockdev --getsize64 /dev/vda) $(cat /sys/block/vda/size)"
  last=$((GROW / 65536 - 16))
  dd if=/dev/zero bs=65536 count=16 2>/dev/null | tr '\000' 'G' > /tmp/grow
  if dd if=/tmp/grow of=/dev/vda bs=65536 seek=$last oflag=direct conv=fsync,notrunc 2>/dev/null &&
    dd if=/dev/vda of=/tmp/grow.back bs=65536 skip=$last count=16 iflag=direct 2>/dev/null &&
    cmp -s /tmp/grow /tmp/grow.back; then
    echo "SQCOW2-GUEST-GROW-WROTE ok"
  else
    echo "SQCOW2-GUEST-GROW-WROTE fail"
  fi
  echo "SQCOW2-GUEST-IOERRORS $(dmesg | grep -c -i 'I/O error')"
fi
if [ -n "${LOOP:-}" ]; then
  loop_main $(echo "$LOOP" | tr ',' ' ')
fi
echo "SQCOW2-GUEST-DONE"
poweroff -f
INIT
chmod +x "$ROOT/init"
cp scripts/lib/guest-loop.sh "$ROOT/lib/loop.sh"
(cd "$ROOT" && find . | cpio -o -H newc --quiet | gzip -1) > "$KIT/initrd.img"
echo "$PKG" > "$KIT/kernel-package"
echo "$STAMP" > "$KIT/kit.ok"
echo "$KIT"
