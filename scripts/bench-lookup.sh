#!/usr/bin/env bash
# Criterion lookup benchmarks (walk vs indexed at 1, 10, 100, 1000 layers),
# then a Markdown table of the mean latencies (docs/measured.md).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/deps.sh
ensure_commands cc:gcc python3:python3
cargo bench --locked -p sqcow2-format --bench lookup -- "$@"
python3 - <<'PY'
import json, glob, os
rows = {}
for f in glob.glob("target/criterion/lookup/*/*/new/estimates.json"):
    parts = f.split(os.sep)
    kind, layers = parts[-4], int(parts[-3])
    ns = json.load(open(f))["mean"]["point_estimate"]
    rows.setdefault(kind, {})[layers] = ns
def fmt(ns):
    return f"{ns/1000:.2f} µs" if ns >= 1000 else f"{ns:.0f} ns"
print("\nChain length in files (layers), the top included: 2 = one backing file.\n")
print("| lookup | mode | 1 | 2 | 10 | 100 | 1000 | 1000 vs 1 | 1000 vs 2 |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for kind in ["hit", "hit_unallocated", "cold", "cold_busy"]:
    for mode in ["indexed", "walk"]:
        r = rows.get(f"{kind}_{mode}", {})
        if not r:
            continue
        cells = [fmt(r[n]) if n in r else "-" for n in (1, 2, 10, 100, 1000)]
        r1 = f"{r[1000]/r[1]:.2f}x" if 1 in r and 1000 in r else "-"
        r2 = f"{r[1000]/r[2]:.2f}x" if 2 in r and 1000 in r else "-"
        print(f"| {kind} | {mode} | " + " | ".join(cells) + f" | {r1} | {r2} |")
PY
