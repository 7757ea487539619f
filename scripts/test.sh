#!/usr/bin/env bash
# The whole test suite: installs what it needs, checks formatting and lints,
# builds, then runs every test against QEMU's own tools as the oracle.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh

# qemu-system-x86 first: on a machine whose qemu-utils comes from another
# release, installing it replaces qemu-utils, which the next line restores.
ensure_commands qemu-system-x86_64:qemu-system-x86 busybox:busybox-static
# QEMU's curl driver: it reads chains pushed to an object store
# (crates/sqcow2-cli/tests/remote_layers.rs).
ensure_qemu_block_modules
ensure_commands cc:gcc c++:g++ qemu-img:qemu-utils qemu-io:qemu-utils fincore:util-linux-extra strace:strace
# The NBD export's clients (crates/sqcow2-cli/tests/nbd.rs).
ensure_commands nbdinfo:libnbd-bin nbdcopy:libnbd-bin
ensure_commands man:man-db groff:groff systemd-analyze:systemd losetup:mount
ensure_rust_components fmt clippy
# Kernel and initramfs of the QEMU guest test (crates/sqcow2-cli/tests/qemu_guest.rs).
echo "==> guest kit"
SQCOW2_GUEST_KIT=$(scripts/guest-kit.sh)
export SQCOW2_GUEST_KIT

echo "==> cargo fmt --check"
cargo fmt --all -- --check
(cd fuzz && cargo fmt -- --check)
echo "==> cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "==> cargo build"
# A few tests run the sqcow2-bench binary, which cargo builds only for its
# own package's tests: built first (the sqcow2 binary cargo builds itself).
cargo build --workspace --locked
echo "==> cargo test"
cargo test --workspace --locked "$@"
echo "==> crash and restart tests again with serve --cache none"
SQCOW2_TEST_CACHE=none cargo test -p sqcow2-cli --locked --test crash_loop \
    --test guest_restart --test vhost_inflight --test live_snapshot --test live_commit "$@"
echo "==> fuzzing (seeds, regressions, then ${SQCOW2_FUZZ_SECONDS:-15} s per target)"
scripts/fuzz.sh "${SQCOW2_FUZZ_SECONDS:-15}"
