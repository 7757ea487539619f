#!/usr/bin/env bash
# The benchmark suite: sqcow2 (indexed and walk mode) and
# qemu-storage-daemon (defaults, aio=io_uring, io_uring + polling
# iothread, and sqcow2's cache budget) serving the same generated chains
# of 1 to 10000 layers over vhost-user-blk, the limits (raw file in
# process, and exported by qemu-storage-daemon), and a write and queue
# matrix on one layer; a libblkio client measures.
# Writes bench-results/results.json, plots (SVG) and the section of
# docs/measured.md between its bench-suite markers.
#
#   scripts/bench-suite.sh [--quick] [sqcow2-bench suite options]
#
# --quick: lengths 1, 100, 1000 on 256 MiB, one repetition; default:
# lengths 1, 50, 100, 500, 1000, 10000 on 1 GiB, 3 repetitions, plus the
# write matrix (docs/benchmarks.md). Compares with the fastest of the
# installed qemu-storage-daemon and Debian 12's (QEMU 7.2, unpacked under
# ~/.cache/sqcow2, not installed); QSD_CANDIDATES=path[,path] chooses.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
. scripts/lib/qsd.sh

# qemu-storage-daemon comes with qemu-system-common; installing it may
# replace a qemu-utils from another release, which the next line restores.
ensure_commands qemu-storage-daemon:qemu-system-x86
ensure_commands cc:gcc qemu-img:qemu-utils
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || {
  echo "==> installing fonts-dejavu-core (plot labels)" >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends fonts-dejavu-core >&2
}

echo "==> building sqcow2 and sqcow2-bench (release)"
cargo build --release --locked -p sqcow2-cli -p sqcow2-bench
# Every qemu-storage-daemon at hand is tried; the run compares with the
# fastest (scripts/lib/qsd.sh; QSD_CANDIDATES=path[,path] chooses).
qsds=$(qsd_candidates)
exec target/release/sqcow2-bench suite --out bench-results --doc docs/measured.md --qsd "$qsds" "$@"
