# Shared by the benchmark scripts: the qemu-storage-daemon binaries a run
# may compare with. QEMU releases differ in speed on the same machine (on
# the 2-vCPU VMs here QEMU 10.0's vhost-user-blk export reached 0.6x of
# QEMU 7.2's random-read rate at depth 32), so the suite tries each and
# compares with the fastest.
#
#   qsd_candidates   prints a comma-separated list: the installed
#                    qemu-storage-daemon and, when that is not Debian 12's
#                    QEMU 7.2, Debian 12's build unpacked (not installed)
#                    under $SQCOW2_CACHE (default ~/.cache/sqcow2).
#
# Set QSD_CANDIDATES to choose the list yourself (e.g. one binary only).

qsd_unpacked_bookworm() {
  # Debian 12's QEMU 7.2 qemu-storage-daemon (package qemu-system-common),
  # unpacked with dpkg -x: nothing on the system changes.
  local cache=${SQCOW2_CACHE:-$HOME/.cache/sqcow2}
  local version
  bookworm_version() {
    apt-cache madison qemu-system-common 2>/dev/null |
      awk -F'|' '{gsub(/ /, "", $2); print $2}' | grep '^1:7\.2' | head -1
  }
  version=$(bookworm_version)
  if [ -z "$version" ] && [ "${APT_UPDATED:-0}" != 1 ]; then
    as_root apt-get update -qq >&2 || return 1
    APT_UPDATED=1
    version=$(bookworm_version)
  fi
  [ -n "$version" ] || return 1
  local dir="$cache/qsd-${version//:/_}"
  local bin="$dir/root/usr/bin/qemu-storage-daemon"
  if [ ! -x "$bin" ]; then
    echo "==> unpacking qemu-system-common $version (qemu-storage-daemon of Debian 12) into $dir" >&2
    rm -rf "$dir"
    mkdir -p "$dir"
    (cd "$dir" && apt-get download "qemu-system-common=$version" >/dev/null 2>&1) || return 1
    dpkg -x "$dir"/qemu-system-common_*.deb "$dir/root" || return 1
    rm -f "$dir"/qemu-system-common_*.deb
  fi
  "$bin" --version >/dev/null 2>&1 || return 1
  echo "$bin"
}

qsd_candidates() {
  if [ -n "${QSD_CANDIDATES:-}" ]; then
    echo "$QSD_CANDIDATES"
    return 0
  fi
  local list=qemu-storage-daemon
  if ! qemu-storage-daemon --version 2>/dev/null | head -1 | grep -q 'version 7\.2\.'; then
    local other
    if other=$(qsd_unpacked_bookworm); then
      list="$list,$other"
    else
      echo "==> Debian 12's qemu-storage-daemon not available; comparing with the installed one only" >&2
    fi
  fi
  echo "$list"
}
