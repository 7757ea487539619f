#!/usr/bin/env bash
# Layers in an object store (issue 48): a 1000-layer chain whose layers
# below the top are pushed to Garage on loopback (started here by
# scripts/object-store.sh), served by `sqcow2 serve` through a proxy that
# adds 0, 5 and 20 ms round trips. Cold and warm random 4 KiB reads and
# cold sequential 1 MiB reads against the same chain on local disk, the
# store's own single-object throughput, and qemu-storage-daemon reading
# the chain through QEMU's curl driver. Rewrites docs/measured.md's
# object-store section.
#
#   scripts/bench-object-store.sh [sqcow2-bench object-store options]
#       (--layers 1000 --size 4G --fill 0.25 --rtt-ms 0,5,20 --seconds 5
#        by default)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh

ensure_commands qemu-storage-daemon:qemu-system-x86
ensure_qemu_block_modules
ensure_commands cc:gcc qemu-img:qemu-utils curl:curl

echo "==> building sqcow2 and sqcow2-bench (release)"
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench
store=$(mktemp -d)
trap 'scripts/object-store.sh stop "$store"; rm -rf "$store"' EXIT
scripts/object-store.sh start "$store"
# shellcheck disable=SC1091
. "$store/env"
target/release/sqcow2-bench object-store --out bench-results/object-store --doc docs/measured.md "$@"
