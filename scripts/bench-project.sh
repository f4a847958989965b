#!/usr/bin/env bash
# Calibrate `k3-orch project` against measured runs (issue 35): the slice resident, at
# --mem-gb 5.5 and at 1.5 (each inside a memory cgroup of that size, from a cold page
# cache, as scripts/bench-budget.sh runs them), and for each the measured decode s/token
# beside `project`'s prediction for the same model directory, budget and machine, and
# measured / predicted. The issue's bar: within 15% (a ratio in 0.87..1.15).
#
#   scripts/bench-project.sh [WORK_DIR] [LIMITS]
#
# Run it on a quiet machine (it prints `uptime` before and after). Needs root (cgroups,
# drop_caches). LIMITS defaults to "resident,5.5,1.5". The machine figures `project` uses
# are measured here by `project` itself, the way the engine uses them: the drive with devbw
# (O_DIRECT) on TRUNK/trunk.bin as the expert-fetcher reads (4 MiB x QD16) and as the
# trunk-loader reads (8 MiB x QD8), the products' streaming rate with k3's GEMV over bf16
# and MXFP4 weights larger than the caches, the MAC rate with k3's GEMV in cache; each can
# be given instead through PROJECT_FLAGS (e.g. "--drive-gbps 3.2"). THREADS, when set, is
# passed to the runs (--threads) and to project (--cores). After the table, each limit's
# model line shows the terms and how they combine, and its measured disk busy time per
# decode token (`totals.disk_busy`) beside the predicted disk term.
#
# The resident rung runs with the slice in the page cache (its files are read once before
# it, as a resident run on a machine with the RAM has them): a cold cache would make its
# decode steps read the routed experts' first touches from the disk, which the projection
# (rightly) does not count, and so do the staged run's first steps, whose expert-fetcher
# reads each routed expert's first touch into its slots: the resident rung generates
# RESIDENT_GEN tokens (default 32) and its measured s/token is the mean of the decode steps
# that read nothing. The numeric rungs start from a cold page cache.
#
# RATE_MB=N throttles the numeric rungs' reads of the disk that holds TRUNK (and the
# projection's drive probes, which then read 3 s each) to N MB/s with a cgroup v1
# `blkio.throttle.read_bps_device`, as `bench-budget.sh` does: a drive of known speed
# beside the same cores. A virtual disk backed by the host's page cache measures
# differently from one probe to the next; a throttled one does not.
#
# Environment: K3 (default target/release/k3-orch), SLICE (default /work/bench/slice:
# `k3-orch synth --shape slice --vocab 163840 --seed 7`), TRUNK (default
# /work/bench/slice-trunk, else WORK_DIR/trunk, packed once), GEN (default 8), IDS
# (default 1), RESIDENT_GEN (default 32), PROJECT_FLAGS, THREADS, RATE_MB. Any model directory works as SLICE (a tiny model
# smokes the script's logic in seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
K3=${K3:-target/release/k3-orch}
WORK=${1:-/tmp/k3-bench-project}
LIMITS=${2:-resident,5.5,1.5}
GEN=${GEN:-8}
RESIDENT_GEN=${RESIDENT_GEN:-32}
IDS=${IDS:-1}
PROJECT_FLAGS=${PROJECT_FLAGS:-}
THREADS=${THREADS:-}
RATE_MB=${RATE_MB:-}
if [ -n "$RATE_MB" ] && ! [[ "$RATE_MB" =~ ^[1-9][0-9]*$ ]]; then
    echo "bench-project: RATE_MB=$RATE_MB is not a positive whole number of MB/s" >&2
    exit 2
fi

if [ ! -x "$K3" ]; then
    echo "k3-orch not found at $K3 (build with: cargo build --release -p k3-orch)" >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "bench-project needs root (memory cgroups and drop_caches)" >&2
    exit 2
fi
SLICE=${SLICE:-/work/bench/slice}
[ -f "$SLICE/config.json" ] || { echo "missing $SLICE (see the header of $0)" >&2; exit 2; }
mkdir -p "$WORK"
if [ -z "${TRUNK:-}" ]; then
    if [ "$SLICE" = /work/bench/slice ] && [ -f /work/bench/slice-trunk/trunk.json ]; then
        TRUNK=/work/bench/slice-trunk
    else
        TRUNK=$WORK/trunk
    fi
fi
[ -f "$TRUNK/trunk.json" ] || "$K3" pack-trunk "$SLICE" "$TRUNK" > /dev/null 2>&1
echo "== $(date -u +%FT%TZ)  cpus: $(nproc)  uptime: $(uptime)"
echo "model: $SLICE  trunk: $TRUNK  ids: $IDS  gen: $GEN"

TFLAGS=()
PFLAGS=(--probe-file "$TRUNK/trunk.bin")
if [ -n "$THREADS" ]; then TFLAGS=(--threads "$THREADS"); PFLAGS+=(--cores "$THREADS"); fi
if [ -n "$RATE_MB" ]; then PFLAGS+=(--seconds 3); fi
# shellcheck disable=SC2206
PFLAGS+=($PROJECT_FLAGS)

if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    CG=v2; BASE=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)
else
    CG=v1; BASE=/sys/fs/cgroup/memory$(sed -n 's/^[0-9]*:memory://p' /proc/self/cgroup)
fi
make_cg() { # name bytes -> path
    local n=$1 b=$2 d
    d=$BASE/$n; mkdir -p "$d"
    if [ $CG = v2 ]; then
        echo "$b" > "$d/memory.max"; echo 0 > "$d/memory.swap.max" 2>/dev/null || true
    else
        [ "$b" = max ] && b=-1
        echo "$b" > "$d/memory.limit_in_bytes"
        echo "$b" > "$d/memory.memsw.limit_in_bytes" 2>/dev/null || true
    fi
    echo "$d"
}

# RATE_MB: a blkio cgroup that throttles reads of the disk holding the trunk.
BLK=
if [ -n "$RATE_MB" ]; then
    [ -d /sys/fs/cgroup/blkio ] || { echo "bench-project: RATE_MB needs the cgroup v1 blkio controller" >&2; exit 2; }
    BLK=/sys/fs/cgroup/blkio/k3-bench-project-$$
    mkdir -p "$BLK"
    majmin=$(findmnt -n -o MAJ:MIN -T "$TRUNK" | tr -d ' ')
    echo "$majmin $((RATE_MB * 1000 * 1000))" > "$BLK/blkio.throttle.read_bps_device"
    trap 'rmdir "$BLK" 2>/dev/null || true' EXIT
    echo "reads of $majmin throttled to $RATE_MB MB/s in the numeric rungs and their probes (blkio $BLK)"
fi
# Reads every file of the model directory once, so a resident run finds it in the page cache.
warm() { find "$SLICE" -type f -exec cat {} + > /dev/null; }

printf '%-9s %12s %12s %8s %-8s %12s %12s  %s\n' \
    limit measured predicted ratio floor "read/tok" "pred read" "ids"
IFS=, read -ra LS <<< "$LIMITS"
for L in "${LS[@]}"; do
    if [ "$L" = resident ]; then
        d=$(make_cg "k3-bench-project-$$-$L" max)
        RUN=("$K3" "$SLICE")
        PROJ=("$K3" project "$SLICE" --json "${PFLAGS[@]}")
    else
        d=$(make_cg "k3-bench-project-$$-$L" "$(python3 -c "print(int($L * 1e9))")")
        RUN=("$K3" "$SLICE" --trunk "$TRUNK" --mem-gb "$L")
        PROJ=("$K3" project "$SLICE" --ram-gb "$L" --json "${PFLAGS[@]}")
    fi
    # Throttled (RATE_MB) for a numeric rung, in its cgroup, from the shell that execs it.
    THROTTLE=
    if [ -n "$BLK" ] && [ "$L" != resident ]; then THROTTLE=$BLK/cgroup.procs; fi
    # The projection first (its probes read the drive and memory; nothing else runs).
    ( if [ -n "$THROTTLE" ]; then echo $BASHPID > "$THROTTLE"; fi
      exec "${PROJ[@]}" ) > "$WORK/project-$L.json" 2> "$WORK/project-$L.log" || true
    if [ "$L" = resident ]; then
        warm
    else
        sync; echo 3 > /proc/sys/vm/drop_caches
    fi
    OUT=$WORK/run-$L.json
    rm -f "$OUT"
    set +e
    ( echo $BASHPID > "$d/cgroup.procs" 2>/dev/null || echo $BASHPID > "$d/tasks"
      if [ -n "$THROTTLE" ]; then echo $BASHPID > "$THROTTLE"; fi
      G=$GEN; if [ "$L" = resident ]; then G=$RESIDENT_GEN; fi
      exec "${RUN[@]}" --ids "$IDS" --gen "$G" --incremental --quiet "${TFLAGS[@]}" \
          --out "$OUT" ) > "$WORK/run-$L.log" 2>&1
    rc=$?
    set -e
    rmdir "$d" 2>/dev/null || true
    python3 - "$L" "$OUT" "$WORK/project-$L.json" "$rc" <<'PY'
import json, os, sys
name, run, proj, rc = sys.argv[1:5]
p = None
try:
    p = json.loads(open(proj).readline())
except (OSError, ValueError):
    pass
if not os.path.exists(run):
    print(f"{name:<9} {'-':>12} {'-':>12} {'-':>8} {'-':<8} {'-':>12} {'-':>12}  (run exit {rc}, no report)")
    sys.exit(0)
r = json.load(open(run))
steps = r["steps"][1:] or r["steps"]
bpt = sum(s["trunk_read_bytes"] + s["expert_read_bytes"] for s in steps) / len(steps)
note = ""
if name == "resident":
    # The steady state the projection models: the decode steps that read nothing. The
    # first steps read each routed expert's first touch into the fetcher's slots.
    quiet = [s for s in steps if s["trunk_read_bytes"] + s["expert_read_bytes"] == 0]
    note = f"  ({len(quiet)} of {len(steps)} decode steps read nothing: their mean)"
    steps = quiet or steps
spt = sum(s["seconds"] for s in steps) / len(steps)
ids = ",".join(map(str, r["generated_ids"]))
if not p or "refused" in p:
    why = p.get("refused") if p else f"no projection (see project-{name}.log)"
    print(f"{name:<9} {spt:>10.3f} s {'-':>12} {'-':>8} {'-':<8} {bpt/1e9:>10.3f}GB {'-':>12}  {ids}  ({why})")
    sys.exit(0)
pred = p["s_per_token"]
ratio = spt / pred if pred > 0 else float("inf")
mark = "" if 0.87 <= ratio <= 1.15 else "  OUTSIDE 15%"
print(f"{name:<9} {spt:>10.3f} s {pred:>10.3f} s {ratio:>8.2f} {p['floor']:<8} "
      f"{bpt/1e9:>10.3f}GB {p['disk_bytes_per_token']/1e9:>10.3f}GB  {ids}{mark}{note}")
PY
done
for L in "${LS[@]}"; do
    python3 - "$L" "$WORK/project-$L.json" "$WORK/run-$L.json" "$RATE_MB" <<'PY' || true
import json, sys
name, proj, run, rate = sys.argv[1:5]
try:
    p = json.loads(open(proj).readline())
except (OSError, ValueError):
    sys.exit(0)
print(f"machine ({name}): {p.get('machine', '-')}")
if "model" in p:
    print(f"model   ({name}): s/token = {p['model']}")
try:
    r = json.load(open(run))
    busy = r["totals"]["disk_busy"]
    steps = max(busy["steps"], 1)
    print(f"disk    ({name}): busy {busy['busy_seconds'] / steps:.3f} s per decode token measured, "
          f"{p.get('disk_s', 0):.3f} s predicted"
          + (f" (reads throttled to {rate} MB/s: the device is busy only while a read is"
             " let through, so its busy time is not the drive's)" if rate and name != "resident" else ""))
except (OSError, ValueError, KeyError, TypeError):
    pass
PY
done
echo "== $(date -u +%FT%TZ)  uptime: $(uptime)"
