#!/usr/bin/env bash
# The benchmark suite: sqcow2 (indexed and walk mode) and
# qemu-storage-daemon (QEMU's default caches, and sqcow2's cache budget)
# serving the same generated chains of 1 to 1000 layers over
# vhost-user-blk, plus the raw-file limit; a libblkio client measures.
# Writes bench-results/results.json, plots (PNG, SVG) and the README's
# benchmark section.
#
#   scripts/bench-suite.sh [--quick] [sqcow2-bench suite options]
#
# --quick: lengths 1, 100, 1000 on 256 MiB, one repetition (< 3 minutes);
# default: lengths 1, 50, 100, 500, 1000 on 1 GiB, 3 repetitions (< 30
# minutes on a 2-core machine).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh

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
exec target/release/sqcow2-bench suite --out bench-results --readme README.md "$@"
