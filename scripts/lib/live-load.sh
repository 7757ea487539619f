# Helpers of the benchmarks that change a chain under a guest's load
# (bench-merge.sh, bench-live-commit.sh): a 70/30 random read/write load
# (libblkio, 4 KiB, depth 16, one queue) in slices, results recorded as
# JSON lines, QMP calls to a qemu-storage-daemon. `live_bench_init ROOT`
# sets $bin, $bench (the release binaries, built) and $out (the results
# file, in ROOT made afresh), which the others use.

live_bench_init() { # ROOT
  cargo build --release --locked -p sqcow2-cli -p sqcow2-bench >&2
  bin=$PWD/target/release/sqcow2
  bench=$PWD/target/release/sqcow2-bench
  rm -rf "$1" && mkdir -p "$1"
  out=$1/results.jsonl
  : >"$out"
}

load() { # SOCKET SECONDS -> one JSON line
  "$bench" load --socket "$1" --pattern mixed --iodepth 16 --duration "$2" --output json | tr -d '\n'
  echo
}

load_slices() { # SOCKET SECONDS SLICE -> JSON lines, one per slice
  local left=$2
  while [ "$left" -gt 0 ]; do
    load "$1" "$(( left < $3 ? left : $3 ))"
    left=$(( left - $3 ))
  done
}

phased_load() { # SOCKET MAX-SECONDS PHASE-FILE SLICE-MS -> one JSON object
  # One connection throughout; the phase is the word in PHASE-FILE
  # (`end` stops the load): latencies kept per phase (`phases`).
  "$bench" load --socket "$1" --pattern mixed --iodepth 16 --duration "$2" \
    --phase-file "$3" --slice-ms "$4" --output json | tr -d '\n'
  echo
}

begin_phases() { # SOCKET WHO SECONDS SLICE-MS [SETTLE-SECONDS]: warm, then
  # one phased load (load.json, its pid in $loader) SECONDS into its
  # "before" phase, which SETTLE-SECONDS (default 0) of a "settle" phase
  # precede. The warm-up's disconnect makes the daemon write the image
  # back and sync it; the kernel writes it back again only once the new
  # load's first dirtied page is vm.dirty_expire_centisecs old (30 s),
  # then every 6-30 s (measured, /proc/vmstat nr_written: bursts of
  # ~260k pages, the whole 1 GiB top, ~2 s each, none in the first 30 s
  # after the reconnect). A "before" phase right after the reconnect
  # flattered the load: with nothing else running, its p99 113-119 us,
  # that of each 40 s after it 130-187 us.
  load "$1" "$3" >/dev/null # page cache, metadata: unrecorded
  local settle=${5:-0}
  if [ "$settle" -gt 0 ]; then echo settle >phase; else echo before >phase; fi
  phased_load "$1" 86400 phase "$4" >load.json &
  loader=$!
  if [ "$settle" -gt 0 ]; then
    echo "==> $2: settling" >&2
    sleep "$settle"
    echo before >phase
  fi
  echo "==> $2: before" >&2
  sleep "$3"
}

end_phases() { # the phased load stopped and waited for
  echo end >phase
  wait "$loader"
}

record_phase() { # WHO PHASE JSON-FILE-OF-A-PHASED-LOAD EXTRA-JSON
  # p99: over every request of the phase; worst_p99: the largest p99 of
  # the phase's slices.
  python3 - "$@" >>"$out" <<'PY'
import json, sys
who, phase, path, extra = sys.argv[1:5]
load = json.load(open(path))
ph = [p for p in load.get("phases", []) if p["name"] == phase]
rec = {"who": who, "phase": phase, "slices": 0, "iops": 0.0, "p99_us": 0.0,
       "worst_p99_us": 0.0, "errors": load["errors"] if phase == "before" else 0}
if ph:
    p = ph[0]
    rec.update({"iops": p["iops"], "p99_us": p["lat_p99_us"],
                "worst_p99_us": p["worst_slice_p99_us"], "seconds": p["seconds"]})
rec.update(json.loads(extra))
print(json.dumps(rec))
PY
}

peak_rss_kib() { awk '/VmHWM/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }

record() { # WHO PHASE JSON-FILE-OF-SLICES EXTRA-JSON
  # p99: the largest of the slices' (the same statistic in every phase).
  python3 - "$@" >>"$out" <<'PY'
import json, sys
who, phase, path, extra = sys.argv[1:5]
slices = [json.loads(l) for l in open(path) if l.strip()]
ops = sum(s["ios"] for s in slices)
secs = sum(s["seconds"] for s in slices)
rec = {"who": who, "phase": phase, "slices": len(slices),
       "iops": ops / secs if secs else 0.0,
       "p99_us": max((s["lat_p99_us"] for s in slices), default=0.0),
       "errors": sum(s["errors"] for s in slices)}
rec.update(json.loads(extra))
print(json.dumps(rec))
PY
}

qmp() { # SOCKET COMMAND-JSON... -> replies
  python3 - "$@" <<'PY'
import json, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile("rw")
f.readline()
def call(c):
    f.write(c + "\n"); f.flush()
    while True:
        r = json.loads(f.readline())
        if "return" in r or "error" in r:
            return r
call('{"execute": "qmp_capabilities"}')
for c in sys.argv[2:]:
    print(json.dumps(call(c)))
PY
}
