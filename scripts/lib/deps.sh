# Shared by the scripts: installs what a fresh Debian machine lacks.
# Usage: ensure_commands "cmd:debian-package" ...

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    echo "need root to run: $*" >&2
    return 1
  fi
}

APT_UPDATED=${APT_UPDATED:-0}

ensure_commands() {
  local missing=()
  local spec cmd pkg
  for spec in "$@"; do
    cmd=${spec%%:*}
    pkg=${spec#*:}
    if ! command -v "$cmd" >/dev/null 2>&1; then
      missing+=("$pkg")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  # Several commands may come from one package.
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  echo "==> installing ${missing[*]}" >&2
  if [ "$APT_UPDATED" != 1 ]; then
    as_root apt-get update -qq
    APT_UPDATED=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# Usage: ensure_packages debian-package ... (for packages that bring no
# command: libraries, QEMU's block modules).
ensure_packages() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "==> installing ${missing[*]}" >&2
  if [ "$APT_UPDATED" != 1 ]; then
    as_root apt-get update -qq
    APT_UPDATED=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# QEMU's block modules (curl, ...) at the version of the qemu-utils
# installed (a backport's qemu-img loads only its own modules; the
# default candidate would pull qemu-utils back to the release's version).
ensure_qemu_block_modules() {
  dpkg-query -W -f='${Status}' qemu-block-extra 2>/dev/null | grep -q "install ok installed" && return 0
  local version
  version=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
  if [ -n "$version" ]; then
    if [ "$APT_UPDATED" != 1 ]; then
      as_root apt-get update -qq
      APT_UPDATED=1
    fi
    echo "==> installing qemu-block-extra=$version" >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "qemu-block-extra=$version" >&2 && return 0
  fi
  ensure_packages qemu-block-extra
}

ensure_rust_components() {
  local comp
  for comp in "$@"; do
    if ! cargo "$comp" --version >/dev/null 2>&1; then
      echo "==> adding rustup component $comp" >&2
      rustup component add "$comp"
    fi
  done
}
