#!/usr/bin/env bash
# Two (or more) k3 binaries on the resident slice, alternating round by round (issue 10):
# this machine's memory bandwidth and the host's page-cache reclaim drift within minutes,
# so only runs taken next to each other compare.
#
#   scripts/bench-ab.sh ROUNDS BIN_A BIN_B [BIN ...]
#
# Each round, for each binary: read the slice into the page cache, run its 16-token prompt
# (`--gen 1`: the prefill step's seconds) and a `--ids 1 --gen 16` decode (median of the
# steps after the first), both `--single-process --threads THREADS`; print one line with
# the first ids of each, so a changed id shows. `uptime` at the start and the end.
#
# Environment: SLICE (default /work/bench/slice, made by `k3-orch synth --shape slice
# --vocab 163840 --seed 7`), THREADS (2).
set -euo pipefail
ROUNDS=${1:?rounds}
shift
[ $# -ge 2 ] || { echo "usage: $0 ROUNDS BIN_A BIN_B [BIN ...]" >&2; exit 2; }
SLICE=${SLICE:-/work/bench/slice}
THREADS=${THREADS:-2}
[ -e "$SLICE/config.json" ] || { echo "missing $SLICE (see the header of $0)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/k3-bench-ab.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
# The page cache's large folios (`FileHugePages`, Linux 6.x) slow a mapped model's reads
# on some hosts: 20 against 28-30 GB/s on the VM of 2026-12-07 (docs/measurements.md,
# "Resident weights in one process depend on the page cache's folios"), so print them.
folios() { grep -s FileHugePages /proc/meminfo | tr -s ' ' || true; }
echo "== uptime (start): $(uptime); $(folios)"
for r in $(seq "$ROUNDS"); do
    for b in "$@"; do
        cat "$SLICE"/*.safetensors > /dev/null
        "$b" "$SLICE" --single-process --incremental --threads "$THREADS" \
            --ids "$(seq -s, 1 16)" --gen 1 --out "$WORK/pre.json" --quiet > /dev/null
        "$b" "$SLICE" --single-process --incremental --threads "$THREADS" \
            --ids 1 --gen 16 --out "$WORK/dec.json" --quiet > /dev/null
        python3 - "$WORK" "$r" "$b" <<'PY'
import json, statistics, sys
work, r, b = sys.argv[1:4]
p = json.load(open(f"{work}/pre.json"))
d = json.load(open(f"{work}/dec.json"))
dec = statistics.median(s["seconds"] for s in d["steps"][1:])
print(f"{r:<3} {b:<40} prompt {p['steps'][0]['seconds']:.3f} s  decode {dec:.3f} s/token  "
      f"ids {p['generated_ids'][0]} {d['generated_ids'][:4]}")
PY
    done
done
echo "== uptime (end): $(uptime); $(folios)"
