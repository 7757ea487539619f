#!/usr/bin/env python3
"""Live snapshots through qemu-storage-daemon's QMP: the peer of
`sqcow2 snapshot --live` in scripts/bench-live-snapshot.sh.

    qmp_snapshots.py QMP_SOCKET NODE N GAP_S OUT_JSONL

Takes N external snapshots (`blockdev-snapshot-sync`, qcow2 overlays
live1.qcow2 ... in the working directory), each on the node the previous
one made, GAP_S seconds apart (the caller stops the daemon). QEMU drains the node and creates and opens
the overlay inside the command, so the command's time is an upper bound
of the guest's pause. Writes one JSON line per snapshot with the same
fields the sqcow2 replies carry (`started_unix_us`, `paused_unix_us`,
`pause_ms`)."""
import json
import socket
import sys
import time


def main():
    path, node, n, gap, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    sock = socket.socket(socket.AF_UNIX)
    for _ in range(100):
        try:
            sock.connect(path)
            break
        except OSError:
            time.sleep(0.1)
    f = sock.makefile("rw")

    def reply():
        while True:
            line = f.readline()
            if not line:
                sys.exit("QMP connection closed")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    def execute(cmd, **args):
        f.write(json.dumps({"execute": cmd, "arguments": args}) + "\n")
        f.flush()
        r = reply()
        if "error" in r:
            sys.exit(f"{cmd}: {r['error']}")
        return r

    reply()  # greeting
    execute("qmp_capabilities")
    with open(out, "w") as o:
        for i in range(1, n + 1):
            start_us = time.time_ns() // 1000
            t0 = time.monotonic()
            execute("blockdev-snapshot-sync", **{
                "node-name": node,
                "snapshot-file": f"live{i}.qcow2",
                "snapshot-node-name": f"live{i}",
                "format": "qcow2",
            })
            ms = (time.monotonic() - t0) * 1000
            o.write(json.dumps({"started_unix_us": start_us, "paused_unix_us": start_us,
                                "pause_ms": ms}) + "\n")
            node = f"live{i}"
            time.sleep(gap)


if __name__ == "__main__":
    main()
