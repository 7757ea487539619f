#!/usr/bin/env bash
# A real S3-compatible object store on loopback, for the tests and
# benchmarks of layers kept in a bucket (issue 48): Garage, an object
# store people run in production, as one node.
#
#   scripts/object-store.sh start DIR   installs garage where missing
#                                        (`cargo install` from crates.io,
#                                        once: GARAGE_ROOT), starts it
#                                        with its data in DIR, makes a key
#                                        and a bucket, and prints
#                                        `endpoint=URL bucket=NAME`
#   scripts/object-store.sh stop DIR    stops it (DIR is kept)
#
# DIR/env exports the usual variables (AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL) and
# SQCOW2_S3_BUCKET: `. DIR/env`. The secret is written there (mode 0600)
# and nowhere else; it is never printed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh

GARAGE_VERSION=${GARAGE_VERSION:-2.1.0}
GARAGE_ROOT=${GARAGE_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/sqcow2-tools/garage-$GARAGE_VERSION-sqlite}
BUCKET=${BUCKET:-sqcow2}

usage() {
  echo "usage: $0 start DIR | stop DIR" >&2
  exit 2
}

[ $# -eq 2 ] || usage
cmd=$1
dir=$2

# garage: the binary, built once from crates.io.
garage_bin() {
  local bin=$GARAGE_ROOT/bin/garage
  if [ ! -x "$bin" ]; then
    ensure_commands cc:gcc pkg-config:pkg-config
    echo "==> building garage $GARAGE_VERSION from crates.io (once, into $GARAGE_ROOT)" >&2
    # S3 and SQLite only (no K2V, metrics or LMDB): ~5 min on 2 CPUs.
    cargo install --locked --quiet --root "$GARAGE_ROOT" garage --version "$GARAGE_VERSION" \
      --no-default-features --features bundled-libs,sqlite >&2
  fi
  echo "$bin"
}

# free_port: a TCP port nothing listens on now.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
  ensure_commands curl:curl python3:python3
  local garage
  garage=$(garage_bin)
  mkdir -p "$dir/meta" "$dir/data"
  dir=$(cd "$dir" && pwd)
  if [ -f "$dir/garage.pid" ] && kill -0 "$(cat "$dir/garage.pid")" 2>/dev/null; then
    echo "garage already runs for $dir (pid $(cat "$dir/garage.pid"))" >&2
    exit 1
  fi
  umask 077
  # A store started before in DIR keeps its configuration (ports, secret).
  if [ ! -f "$dir/garage.toml" ]; then
    local s3_port rpc_port admin_port web_port
    s3_port=$(free_port)
    web_port=$(free_port)
    rpc_port=$(free_port)
    admin_port=$(free_port)
    cat > "$dir/garage.toml" <<EOF
metadata_dir = "$dir/meta"
data_dir = "$dir/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$rpc_port"
rpc_public_addr = "127.0.0.1:$rpc_port"
rpc_secret = "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$s3_port"
root_domain = ".s3.garage.localhost"

# Anonymous reads of buckets made websites, as http://BUCKET.web.garage.localhost:PORT/KEY
# (the form QEMU's curl driver can follow: it sends no signature).
[s3_web]
bind_addr = "127.0.0.1:$web_port"
root_domain = ".web.garage.localhost"
index = "index.html"

[admin]
api_bind_addr = "127.0.0.1:$admin_port"
EOF
  fi
  local g=("$garage" -c "$dir/garage.toml")
  "${g[@]}" server > "$dir/garage.log" 2>&1 &
  echo $! > "$dir/garage.pid"
  # Up once it answers over RPC (`node id` reads only the key on disk).
  local node="" up=0
  for _ in $(seq 300); do
    if "${g[@]}" status >/dev/null 2>&1; then
      up=1
      break
    fi
    sleep 0.1
  done
  node=$("${g[@]}" node id -q 2>/dev/null | cut -d@ -f1)
  if [ "$up" != 1 ] || [ -z "$node" ]; then
    echo "garage did not start; its log:" >&2
    cat "$dir/garage.log" >&2
    exit 1
  fi
  # One node holding everything.
  # (`layout show` names nodes by their first 16 digits.)
  if ! "${g[@]}" layout show 2>/dev/null | grep -q "${node:0:16}"; then
    "${g[@]}" layout assign -z dc1 -c 10G "$node" >/dev/null
    "${g[@]}" layout apply --version 1 >/dev/null
  fi
  local key_out key_id secret
  key_out=$("${g[@]}" key info --show-secret sqcow2 2>/dev/null || "${g[@]}" key create sqcow2)
  key_id=$(awk -F': *' '/Key ID/ {print $2; exit}' <<<"$key_out")
  secret=$(awk -F': *' '/Secret key/ {print $2; exit}' <<<"$key_out")
  if [ -z "$key_id" ] || [ -z "$secret" ]; then
    echo "could not read garage's key" >&2
    exit 1
  fi
  "${g[@]}" bucket info "$BUCKET" >/dev/null 2>&1 || "${g[@]}" bucket create "$BUCKET" >/dev/null
  "${g[@]}" bucket allow --read --write --owner "$BUCKET" --key sqcow2 >/dev/null
  local endpoint
  endpoint=http://$(awk '/^\[s3_api\]/ {s = 1} s && /^api_bind_addr/ {gsub(/"/, "", $3); print $3; exit}' "$dir/garage.toml")
  # The bucket readable without credentials (the website endpoint), where
  # the configuration has one.
  local web="" web_addr
  web_addr=$(awk '/^\[s3_web\]/ {s = 1} s && /^bind_addr/ {gsub(/"/, "", $3); print $3; exit}' "$dir/garage.toml")
  if [ -n "$web_addr" ]; then
    "${g[@]}" bucket website --allow "$BUCKET" >/dev/null
    web=http://$BUCKET.web.garage.localhost:${web_addr##*:}/
  fi
  cat > "$dir/env" <<EOF
export AWS_ACCESS_KEY_ID=$key_id
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_REGION=garage
export AWS_DEFAULT_REGION=garage
export AWS_ENDPOINT_URL=$endpoint
export SQCOW2_S3_BUCKET=$BUCKET
EOF
  if [ -n "$web" ]; then
    echo "export SQCOW2_S3_PUBLIC_URL=$web" >> "$dir/env"
  fi
  # A signed PUT and GET through the S3 API, as a client makes them.
  local probe=$dir/probe.$$
  echo "sqcow2 object store probe" > "$probe"
  local sig=(--aws-sigv4 "aws:amz:garage:s3" --user "$key_id:$secret" -fsS
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD")
  curl "${sig[@]}" -T "$probe" "$endpoint/$BUCKET/probe" >/dev/null
  if ! curl "${sig[@]}" "$endpoint/$BUCKET/probe" | cmp -s - "$probe"; then
    echo "the store does not give back what was put" >&2
    exit 1
  fi
  if [ -n "$web" ] && ! curl -fsS "${web}probe" | cmp -s - "$probe"; then
    echo "the bucket is not readable at $web" >&2
    exit 1
  fi
  curl "${sig[@]}" -X DELETE "$endpoint/$BUCKET/probe" >/dev/null
  rm -f "$probe"
  echo "endpoint=$endpoint bucket=$BUCKET"
}

stop() {
  local pidfile=$dir/garage.pid
  [ -f "$pidfile" ] || { echo "no garage runs for $dir" >&2; return 0; }
  local pid
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

case $cmd in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
