#!/usr/bin/env bash
# The memory ladder on the synthetic slice: synthesise (or reuse) it, pack its trunk, run the
# same generation at >= 8 budgets from the floor to all-resident (each rung a staged run with
# per-stage cgroups), print the table, and plot it when matplotlib is available.
#
#   scripts/ladder.sh [WORK_DIR] [RUNGS_GB]
#
# WORK_DIR defaults to ./ladder-work (the slice is ~13 GB on disk). Every row must show the
# same ids; the script exits non-zero otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-ladder-work}
RUNGS=${2:-}
BIN=target/release/k3-orch
cargo build --release -p k3-orch >/dev/null
mkdir -p "$WORK"
[ -f "$WORK/slice/config.json" ] || "$BIN" synth --shape slice --seed 7 "$WORK/slice"
[ -f "$WORK/trunk/trunk.json" ] || "$BIN" pack-trunk "$WORK/slice" "$WORK/trunk"
if [ -z "$RUNGS" ]; then
  # Rungs are --mem-gb totals for the whole run: from just above inspect's streaming floor
  # to the top row of its one-total-budget table (everything pinned, every expert cached).
  RUNGS=$("$BIN" inspect "$WORK/slice" | python3 -c '
import re, sys
t = sys.stdin.read()
floor = float(re.search(r"streaming floor: ([0-9.]+) GB", t).group(1))
rows = [float(m) for m in re.findall(r"^\s+([0-9.]+) GB\s+\d+/\d+", t, re.M)]
top = max(rows)
lo = floor * 1.02
print(",".join(f"{lo + (top - lo) * i / 7:.3f}" for i in range(8)))
')
fi
"$BIN" ladder "$WORK/slice" --trunk "$WORK/trunk" --ids 1,2,3,4 --gen 4 \
  --rungs-gb "$RUNGS" --out "$WORK/out"
if python3 -c "import matplotlib" 2>/dev/null; then
  python3 tools/plot_ladder.py "$WORK/out/ladder.tsv" "$WORK/out/ladder.png"
else
  echo "(matplotlib not installed: pip install matplotlib for the PNG plot)"
fi
