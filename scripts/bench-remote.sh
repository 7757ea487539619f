#!/usr/bin/env bash
# Chains on remote storage (the sQemu paper's NFS setting) on one machine:
# each chain behind a FUSE filesystem that answers every read a fixed delay
# later (200 us by default; the mount's page cache cannot hide it). Cold
# random 4 KiB reads over 1, 100 and 1000 layers: sqcow2 (indexed) against
# qemu-storage-daemon in every configuration. Rewrites docs/measured.md's
# remote-storage section.
#
#   scripts/bench-remote.sh [sqcow2-bench remote options]
#       (--lengths 1,100,1000 --size 16G --fill 0.05 --delay-us 200
#        --seconds 5 --repeat 2 by default)
#
# Mounting FUSE needs root and /dev/fuse.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh

ensure_commands qemu-storage-daemon:qemu-system-x86
ensure_commands cc:gcc qemu-img:qemu-utils

echo "==> building sqcow2 and sqcow2-bench (release)"
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench
# QSD=path compares with another qemu-storage-daemon than the installed one.
exec target/release/sqcow2-bench remote --out bench-results/remote --doc docs/measured.md --qsd "${QSD:-qemu-storage-daemon}" "$@"
