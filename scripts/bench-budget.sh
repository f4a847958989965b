#!/usr/bin/env bash
# The slice at 1.5 GB, 5.5 GB and resident, each run inside a memory cgroup of that size
# (the whole run: the orchestrator and its four stages), from a cold page cache (issue 11).
#
#   scripts/bench-budget.sh [WORK_DIR] [LIMITS]
#
# The slice (`synth --shape slice --vocab 163840`: 4 layers at the released per-layer dims,
# the released vocabulary, so the lm_head is 2.35 GB; ~13.7 GB on disk) and its packed trunk
# are SLICE and TRUNK; by default /work/bench/slice and /work/bench/slice-trunk when they
# exist (never regenerated or deleted here), else WORK_DIR/slice and WORK_DIR/trunk, made
# once and reused. LIMITS defaults to "1.5,5.5,resident": a number is a rung
# `k3-orch SLICE --trunk TRUNK --mem-gb L --incremental` inside a fresh cgroup of L GB (v2
# memory.max, or v1 memory.limit_in_bytes + memsw when present); `resident` is the whole
# model held (no --trunk, no budget) in an unlimited cgroup, for its peak and its compute
# time. The page cache is dropped before each rung. It prints `uptime` before and after
# (do not record results from a loaded machine), and per rung:
#   decode s/token (steps after the prefill), bytes read per token (decode), devbw at QD16
#   on trunk.bin, the ratio of the bytes to the floor max(0, S - L + 0.5 GB) (S: the bytes a
#   token touches, from inspect: trunk + lm_head + top-k experts per MoE layer), the
#   cgroup's peak and the report's own true peak, how busy the disk was during the decode
#   steps (the report's `totals.disk_busy`: the kernel's io_ticks over the steps' wall
#   time; 100% means the disk never waited for compute), the exit code and the ids, which must
#   equal EXPECT (the resident run's ids for IDS/GEN; the default is those of `--ids 1
#   --gen 8`). A rung whose plan does not fit is refused up front (exit 2, no report). The
#   slice's floor is 0.90 GB (`inspect SLICE`): the trunk streams in parts (the tensors the
#   forward uses together; the largest, a KDA attention up to its output projection, is one
#   0.71 GB ring slot), the lm_head in chunks, and a layer's experts through 4 arena slots
#   (each reused as compute gives it back), so the 1.5 GB rung runs (and a 0.96 GB one).
# Needs root (cgroups, drop_caches). Environment: K3 (default target/release/k3-orch),
# SLICE, TRUNK, GEN (default 8), IDS (default 1), EXPECT.
set -euo pipefail
cd "$(dirname "$0")/.."
K3=${K3:-target/release/k3-orch}
WORK=${1:-/tmp/k3-bench-budget}
LIMITS=${2:-1.5,5.5,resident}
GEN=${GEN:-8}
IDS=${IDS:-1}
if [ "$IDS" = 1 ] && [ "$GEN" = 8 ]; then
    EXPECT=${EXPECT:-101883,10879,110240,69507,56170,141799,66690,130240}
else
    EXPECT=${EXPECT:-}
fi

if [ ! -x "$K3" ]; then
    echo "k3-orch not found at $K3 (build with: cargo build --release -p k3-orch)" >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "bench-budget needs root (memory cgroups and drop_caches)" >&2
    exit 2
fi
echo "== $(date -u +%FT%TZ)  cpus: $(nproc)  uptime: $(uptime)"
mkdir -p "$WORK"
if [ -z "${SLICE:-}" ]; then
    if [ -f /work/bench/slice/config.json ]; then SLICE=/work/bench/slice; else SLICE=$WORK/slice; fi
fi
if [ -z "${TRUNK:-}" ]; then
    if [ -f /work/bench/slice-trunk/trunk.json ]; then TRUNK=/work/bench/slice-trunk; else TRUNK=$WORK/trunk; fi
fi
echo "slice: $SLICE  trunk: $TRUNK  ids: $IDS  gen: $GEN"
[ -f "$SLICE/config.json" ] || "$K3" synth --shape slice --vocab 163840 "$SLICE"
[ -f "$TRUNK/trunk.json" ] || "$K3" pack-trunk "$SLICE" "$TRUNK"

# S: bytes one token touches (trunk, lm_head, top-k experts in every MoE layer).
S=$("$K3" inspect "$SLICE" | python3 -c '
import json, re, sys
t = sys.stdin.read()
num = lambda s: int(s.replace(",", ""))
trunk = num(re.search(r"^trunk\s+: .*?\(([0-9,]+) bytes", t, re.M).group(1))
emb = num(re.search(r"^embed\+lm_head\s+: .*?\(([0-9,]+) bytes", t, re.M).group(1))
m = re.search(r"^routed experts : [0-9,]+ \((\d+) MoE layers\) x ([0-9,]+) bytes", t, re.M)
cfg = json.load(open(sys.argv[1]))
tc = cfg.get("text_config", cfg)
k = tc.get("num_experts_per_token") or tc.get("num_experts_per_tok")
print(trunk + emb // 2 + int(m.group(1)) * k * num(m.group(2)))
' "$SLICE/config.json")
echo "bytes a token touches (S): $S"

DEVBW=$("$K3" devbw --seconds 2 --json "$TRUNK/trunk.bin" | tail -1 | python3 -c '
import json, sys
cells = json.loads(sys.stdin.read())
qd16 = [c["bytes"] / c["seconds"] / 1e6 for c in cells if c["queue_depth"] == 16 and c["seconds"] > 0]
print(f"{max(qd16):.0f}" if qd16 else "?")
' 2>/dev/null || echo "?")
echo "devbw QD16 on trunk.bin: $DEVBW MB/s"

# Rung cgroups nest under the cgroup this script runs in (its limits still apply above).
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    CG=v2; BASE=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)
else
    CG=v1; BASE=/sys/fs/cgroup/memory$(sed -n 's/^[0-9]*:memory://p' /proc/self/cgroup)
fi
make_cg() { # name bytes -> path
    local n=$1 b=$2 d
    if [ $CG = v2 ]; then
        d=$BASE/$n; mkdir -p "$d"; echo "$b" > "$d/memory.max"
        echo 0 > "$d/memory.swap.max" 2>/dev/null || true
    else
        [ "$b" = max ] && b=-1
        d=$BASE/$n; mkdir -p "$d"; echo "$b" > "$d/memory.limit_in_bytes"
        echo "$b" > "$d/memory.memsw.limit_in_bytes" 2>/dev/null || true
    fi
    echo "$d"
}
peak_of() { if [ $CG = v2 ]; then cat "$1/memory.peak" 2>/dev/null || echo 0; else cat "$1/memory.max_usage_in_bytes"; fi; }

printf '%-8s %10s %12s %8s %8s %9s %10s %10s %6s  %s\n' limit s/token bytes/tok devbw ratio disk_busy cg_peak peak exit ids
IFS=, read -ra LS <<< "$LIMITS"
for L in "${LS[@]}"; do
    if [ "$L" = resident ]; then
        d=$(make_cg "k3-bench-$$-$L" max)
        RUN=("$K3" "$SLICE")
        LGB=0
    else
        B=$(python3 -c "print(int($L * 1e9))")
        d=$(make_cg "k3-bench-$$-$L" "$B")
        RUN=("$K3" "$SLICE" --trunk "$TRUNK" --mem-gb "$L")
        LGB=$L
    fi
    sync; echo 3 > /proc/sys/vm/drop_caches
    OUT=$WORK/rung-$L.json
    rm -f "$OUT"
    set +e
    ( echo $BASHPID > "$d/cgroup.procs" 2>/dev/null || echo $BASHPID > "$d/tasks"
      exec "${RUN[@]}" --ids "$IDS" --gen "$GEN" --incremental --quiet --out "$OUT" ) \
        > "$WORK/rung-$L.log" 2>&1
    rc=$?
    set -e
    PEAK=$(peak_of "$d")
    if [ -f "$OUT" ]; then
        python3 - "$OUT" "$LGB" "$S" "$DEVBW" "$PEAK" "$rc" "$L" "$EXPECT" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
L, S, devbw, cg, rc = float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
name, expect = sys.argv[7], sys.argv[8]
steps = r["steps"][1:] or r["steps"]
spt = sum(s["seconds"] for s in steps) / len(steps)
bpt = sum(s["trunk_read_bytes"] + s["expert_read_bytes"] for s in steps) / len(steps)
floor = max(0.0, S - L * 1e9 + 0.5e9) if L > 0 else 0.0
ratio = f"{bpt / floor:.2f}" if floor > 0 else "-"
peak = r["totals"].get("peak_bytes") or 0
db = r["totals"].get("disk_busy")
busy = f"{100 * db['busy_share']:.1f}%" if db else "-"
ids = ",".join(map(str, r["generated_ids"]))
same = "" if not expect else ("  (= expected)" if ids == expect else f"  (DIFFERENT: expected {expect})")
print(f"{name:<8} {spt:>10.3f} {bpt/1e9:>10.3f}GB {devbw:>8} {ratio:>8} {busy:>9} {cg/1e9:>8.3f}GB {peak/1e9:>8.3f}GB {rc:>6}  {ids}{same}")
PY
    else
        printf '%-8s %10s %12s %8s %8s %9s %8.3fGB %10s %6s  %s\n' "$L" - - "$DEVBW" - - \
            "$(python3 -c "print($PEAK/1e9)")" - "$rc" "(no report: $(tail -1 "$WORK/rung-$L.log"))"
    fi
    rmdir "$d" 2>/dev/null || true
done
echo "== $(date -u +%FT%TZ)  uptime: $(uptime)"
