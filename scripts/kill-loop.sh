#!/usr/bin/env bash
# Kill loop (issue 5, item 6): N random SIGKILLs of a stage during a run (default 50; CI
# runs 20 inside `cargo test --test e2e`), then a tally: which stage, exit code and
# seconds from the kill to k3-orch's exit. Each kill also checks for orphans and leaks.
# Usage: scripts/kill-loop.sh [N]   (K3_KILL_SEED=... repeats a sequence)
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-50}"
log="$(mktemp)"
K3_KILLS="$N" cargo test -p k3-orch --test e2e faults::random_sigkill_loop -- --nocapture \
    2>&1 | tee "$log" | grep -E '^kill' || true
status="${PIPESTATUS[0]}"
echo "---- tally ----"
grep -E '^kill +[0-9]+:' "$log" | awk '{n[$3]++; code[$5]++; t=$7; if (t>max) max=t; sum+=t}
  END {for (s in n) printf "  %-15s %d kills\n", s, n[s];
       for (c in code) printf "  exit %-10s %d\n", c, code[c];
       if (NR) printf "  %d kills, mean %.3f s, max %.3f s from kill to exit\n", NR, sum/NR, max}'
grep -E '^kill loop: .* kills, all' "$log" || { echo "kill loop FAILED (see $log)"; exit 1; }
exit "$status"
