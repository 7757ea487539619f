#!/usr/bin/env bash
# Regenerates the committed seed corpora (fuzz/seeds/<target>/) from
# images that qemu-img and `sqcow2 gen-chain` write. Needs qemu-img,
# qemu-io, python3 and a built `sqcow2` (cargo build).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
sqcow2=${SQCOW2:-$here/../target/debug/sqcow2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

qimg() { qemu-img create -q -f qcow2 "$@"; }
qio() { local f=$1; shift; qemu-io "${@/#/-c}" "$f" >/dev/null; }

qimg -o cluster_size=512 a.qcow2 256K
qemu-io -c "write -P 0x11 0 2K" -c "write -P 0x22 64K 512" -c "write -z 100K 1K" a.qcow2 >/dev/null
qimg -o cluster_size=512,compat=0.10 b.qcow2 128K
qemu-io -c "write -P 0x33 4K 1K" b.qcow2 >/dev/null
qimg -o cluster_size=512,refcount_bits=1,lazy_refcounts=on c.qcow2 128K
qemu-io -c "write -P 0x44 0 1K" c.qcow2 >/dev/null
qimg -o cluster_size=512,refcount_bits=64 d.qcow2 128K
qemu-io -c "write -P 0x55 8K 1K" d.qcow2 >/dev/null
qimg -o cluster_size=16K,extended_l2=on e.qcow2 256K
qemu-io -c "write -P 0x66 2K 2K" -c "write -z 64K 16K" e.qcow2 >/dev/null
head -c 4096 /dev/urandom > raw
qemu-img convert -c -f raw -O qcow2 -o cluster_size=4K raw f.qcow2
printf 'x%.0s' $(seq 8192) > raw2
qemu-img convert -c -f raw -O qcow2 -o cluster_size=4K,compression_type=zstd raw2 g.qcow2
qimg -o cluster_size=512 -b a.qcow2 -F qcow2 h.qcow2
qemu-io -c "write -P 0x77 1K 512" h.qcow2 >/dev/null

mkdir -p c3 c10
"$sqcow2" gen-chain --layers 3 --size 1M --fill 0.3 c3 >/dev/null
"$sqcow2" gen-chain --layers 10 --size 4M --fill 0.5 --cluster-size 4K c10 >/dev/null

python3 - "$here/seeds" <<'PY'
import json, os, struct, sys, glob
out = sys.argv[1]
def put(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, name), "wb").write(data)

# image_io: [flags][n][n x (kind, offset u32 LE sectors, len u16 LE)][image]
def op(kind, sector, length):
    return struct.pack("<BIH", kind, sector, length - 1)
reads = [op(0, 0, 4096), op(0, 2, 512), op(0, 128, 1024)]
writes = [op(0, 0, 4096), op(1, 2, 512), op(6, 16, 1024), op(3, 32, 512)]
for img in sorted(glob.glob("*.qcow2")):
    data = open(img, "rb").read()
    stem = img[:-6]
    put("image_io", stem + "-ro", bytes([0, len(reads)]) + b"".join(reads) + data)
    put("image_io", stem + "-rw", bytes([1, len(writes)]) + b"".join(writes) + data)

# chain_index: [flags][index]
for idx in sorted(glob.glob("c*/*.sqidx")):
    data = open(idx, "rb").read()
    name = os.path.dirname(idx)
    put("chain_index", name, bytes([0]) + data)
    put("chain_index", name + "-checked", bytes([1]) + data)

# virtio_request: [n][head][n x (sel, addr u32, len u32, flags, next u16, 0)][payload]
NEXT, WRITE, INDIRECT = 1, 2, 4
def desc(addr, length, flags, nxt):
    return struct.pack("<BIIBHB", 0, addr, length, flags, nxt, 0)
def header(kind, sector):
    return struct.pack("<IIQ", kind, 0, sector)
def request(kind, sector, data_len, data_write, extra=b""):
    payload = bytearray(0x3000)
    payload[0:16] = header(kind, sector)
    payload[0x100:0x100 + len(extra)] = extra
    ds = [desc(0, 16, NEXT, 1)]
    if data_len:
        ds.append(desc(0x100, data_len, NEXT | (WRITE if data_write else 0), 2))
    ds.append(desc(0x2000, 1, WRITE, 0))
    return bytes([len(ds) - 1, 0]) + b"".join(ds) + bytes(payload)
put("virtio_request", "in", request(0, 8, 4096, True))
put("virtio_request", "out", request(1, 0, 512, False, b"\x5a" * 512))
put("virtio_request", "flush", request(4, 0, 0, False))
put("virtio_request", "get-id", request(8, 0, 20, True))
seg = struct.pack("<QII", 8, 8, 0)
put("virtio_request", "discard", request(11, 0, 16, False, seg))
put("virtio_request", "write-zeroes", request(13, 0, 16, False, struct.pack("<QII", 16, 8, 1)))
# An indirect table at 0x1000 holding header, data and status.
payload = bytearray(0x3000)
payload[0:16] = header(0, 0)
raw = b"".join(struct.pack("<QIHH", a, l, f, n) for (a, l, f, n) in
               [(0x10000 + 0, 16, NEXT, 1), (0x10000 + 0x100, 512, NEXT | WRITE, 2), (0x10000 + 0x2000, 1, WRITE, 0)])
payload[0x1000:0x1000 + len(raw)] = raw
put("virtio_request", "indirect", bytes([0, 0]) + desc(0x1000, len(raw), INDIRECT, 0) + bytes(payload))

# control_line: one request per file
lines = {
    "stats": {"id": 1, "command": "stats"},
    "stats-prometheus": {"id": 2, "command": "stats", "format": "prometheus"},
    "info": {"id": "x", "command": "info"},
    "flush": {"command": "flush"},
    "snapshot": {"id": 3, "command": "snapshot", "path": "next.qcow2"},
    "unknown": {"command": "reboot"},
}
for name, req in lines.items():
    put("control_line", name, json.dumps(req).encode())
put("control_line", "not-json", b"{\"command\": ")
put("control_line", "array", b"[1, 2, 3]")
PY
echo "seeds in $here/seeds"
