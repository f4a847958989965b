#!/usr/bin/env bash
# Reads before the router decides (issue 35): the slice at --mem-gb 5.5 with --speculate
# off and on, alternated, each run inside a 5.5 GB memory cgroup from a cold page cache.
#
#   scripts/bench-spec.sh [ROUNDS] [WORK_DIR]
#
# ROUNDS (default 2) rounds of `k3-orch SLICE --trunk TRUNK --mem-gb MEM --ids IDS -n GEN
# --incremental --speculate off|on`, off then on in each round (only runs taken next to
# each other compare). Per run it prints: decode s/token (the steps after the prefill),
# the disk's busy time per decode token (`totals.disk_busy`) and their ratio, the guesses'
# precision and recall, guess reads, the bytes read for guesses never used, reads saved,
# guess reads a request took the slot of (`taken_over`), the exit code
# and whether the ids equal the first run's (they must: speculation never changes an id).
# `uptime` and the CPU model at the start and the end: do not record results from a
# loaded machine.
#
# Needs root (cgroups, drop_caches). Environment: K3 (default target/release/k3-orch),
# SLICE (default /work/bench/slice), TRUNK (default /work/bench/slice-trunk; packed once
# under WORK_DIR when missing), MEM (5.5), GEN (8), IDS (1), EXTRA (more flags for every
# run, split on spaces: e.g. EXTRA="--cache-gb 0.5616" for a 32-slot arena at 5.5 GB).
# Smoke it on the tiny model with e.g. SLICE=tests/fixtures/tiny-mxfp4/sharded TRUNK=/tmp/tiny-trunk MEM=0.0315.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
WORK=${2:-/tmp/k3-bench-spec}
K3=${K3:-target/release/k3-orch}
SLICE=${SLICE:-/work/bench/slice}
TRUNK=${TRUNK:-/work/bench/slice-trunk}
MEM=${MEM:-5.5}
GEN=${GEN:-8}
IDS=${IDS:-1}
[ -x "$K3" ] || { echo "k3-orch not found at $K3 (cargo build --release -p k3-orch)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "bench-spec needs root (memory cgroups, drop_caches)" >&2; exit 2; }
[ -f "$SLICE/config.json" ] || { echo "missing $SLICE (k3-orch synth --shape slice --vocab 163840)" >&2; exit 2; }
mkdir -p "$WORK"
[ -f "$TRUNK/trunk.json" ] || { TRUNK=$WORK/trunk; [ -f "$TRUNK/trunk.json" ] || "$K3" pack-trunk "$SLICE" "$TRUNK"; }
cpu() { lscpu | sed -n 's/^Model name: *//p'; }
echo "== $(date -u +%FT%TZ)  cpu: $(cpu)  cpus: $(nproc)  uptime: $(uptime)"
echo "slice: $SLICE  trunk: $TRUNK  mem: $MEM GB  ids: $IDS  gen: $GEN  rounds: $ROUNDS  extra: ${EXTRA:-none}"

if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    CG=v2; BASE=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)
else
    CG=v1; BASE=/sys/fs/cgroup/memory$(sed -n 's/^[0-9]*:memory://p' /proc/self/cgroup)
fi
make_cg() { # name bytes -> path
    local d=$BASE/$1
    mkdir -p "$d"
    if [ $CG = v2 ]; then
        echo "$2" > "$d/memory.max"; echo 0 > "$d/memory.swap.max" 2>/dev/null || true
    else
        echo "$2" > "$d/memory.limit_in_bytes"
        echo "$2" > "$d/memory.memsw.limit_in_bytes" 2>/dev/null || true
    fi
    echo "$d"
}

BYTES=$(python3 -c "print(int($MEM * 1e9))")
FIRST_IDS=""
printf '%-5s %-4s %9s %11s %7s %9s %7s %6s %10s %6s %6s %5s  %s\n' \
    round spec s/token busy/token ratio precision recall reads wasted saved taken exit ids
for r in $(seq "$ROUNDS"); do
    for spec in off on; do
        d=$(make_cg "k3-bench-spec-$$-$r-$spec" "$BYTES")
        OUT=$WORK/run-$r-$spec.json
        rm -f "$OUT"
        sync; echo 3 > /proc/sys/vm/drop_caches
        set +e
        ( echo $BASHPID > "$d/cgroup.procs" 2>/dev/null || echo $BASHPID > "$d/tasks"
          exec "$K3" "$SLICE" --trunk "$TRUNK" --mem-gb "$MEM" --ids "$IDS" -n "$GEN" \
              --incremental --speculate "$spec" ${EXTRA:-} --quiet --out "$OUT" ) \
            > "$WORK/run-$r-$spec.log" 2>&1
        rc=$?
        set -e
        rmdir "$d" 2>/dev/null || true
        if [ ! -f "$OUT" ]; then
            printf '%-5s %-4s %9s  (no report, exit %s: %s)\n' "$r" "$spec" - "$rc" \
                "$(tail -1 "$WORK/run-$r-$spec.log")"
            continue
        fi
        line=$(python3 - "$OUT" "$r" "$spec" "$rc" "$FIRST_IDS" <<'PY'
import json, sys
path, r, spec, rc, first = sys.argv[1:6]
rep = json.load(open(path))
t = rep["totals"]
steps = rep["steps"][1:] or rep["steps"]
spt = sum(s["seconds"] for s in steps) / len(steps)
db = t.get("disk_busy")
busy = db["busy_seconds"] / db["steps"] if db and db["steps"] else None
g = t.get("speculation") or {}
ids = ",".join(map(str, rep["generated_ids"]))
same = "" if not first else (" (= first)" if ids == first else " (DIFFERENT from the first run)")
pct = lambda k: f"{100 * g[k]:.1f}%" if k in g else "-"
print(f"{r:<5} {spec:<4} {spt:>9.3f} "
      + (f"{busy:>10.3f}s {spt / busy:>7.2f}" if busy else f"{'-':>11} {'-':>7}")
      + f" {pct('precision'):>9} {pct('recall'):>7} {g.get('reads', 0):>6}"
      + f" {g.get('wasted_bytes', 0) / 1e6:>8.1f}MB {g.get('saved', 0):>6}"
      + f" {g.get('taken_over', 0):>6} {rc:>5}  {ids}{same}")
print(ids)
PY
)
        echo "$line" | head -1
        [ -n "$FIRST_IDS" ] || FIRST_IDS=$(echo "$line" | tail -1)
    done
done
echo "== $(date -u +%FT%TZ)  cpu: $(cpu)  uptime: $(uptime)"
