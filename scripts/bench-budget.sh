#!/usr/bin/env bash
# The slice at 1.5, 5.5 and 8 GB, each run inside a memory cgroup of that size (the whole
# run: the orchestrator and its four stages), from a cold page cache (issue 11).
#
#   scripts/bench-budget.sh [WORK_DIR] [LIMITS_GB]
#
# WORK_DIR (default /tmp/k3-bench-budget) holds the slice (`synth --shape slice --vocab
# 163840`: the released vocabulary, so the lm_head is 2.35 GB; ~9-10 GB on disk, minutes to
# write) and its packed trunk; both are reused when present. LIMITS_GB defaults to
# "1.5,5.5,8". Each rung runs `k3-orch SLICE --trunk TRUNK --mem-gb L --incremental` inside a
# fresh cgroup (v2 memory.max, or v1 memory.limit_in_bytes + memsw when present) after the
# page cache is dropped, and prints:
#   decode s/token (steps after the prefill), bytes read per token (decode), devbw at QD16
#   on trunk.bin, the ratio of the bytes to the floor max(0, S - L + 0.5 GB) (S: the bytes a
#   token touches, from inspect: trunk + lm_head + top-k experts per MoE layer), the
#   cgroup's peak and the report's own true peak, and the ids (they must be equal).
# Expect the 1.5 GB rung to be refused up front (exit 2) until the trunk streams below layer
# granularity: layer 0 of the slice (2.34 GB) needs one whole ring slot, so the slice's floor
# is about 2.9 GB (slot + lm_head chunk buffers + 16 expert slots + state, plus the 5%
# reserve); `inspect SLICE` prints it.
# Needs root (cgroups, drop_caches). Environment: K3 (default target/release/k3-orch),
# GEN (default 8), IDS (default 1,2,3,4,5,6,7,8).
set -euo pipefail
cd "$(dirname "$0")/.."
K3=${K3:-target/release/k3-orch}
WORK=${1:-/tmp/k3-bench-budget}
LIMITS=${2:-1.5,5.5,8}
GEN=${GEN:-8}
IDS=${IDS:-1,2,3,4,5,6,7,8}

if [ ! -x "$K3" ]; then
    echo "k3-orch not found at $K3 (build with: cargo build --release -p k3-orch)" >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "bench-budget needs root (memory cgroups and drop_caches)" >&2
    exit 2
fi
echo "== $(date -u +%FT%TZ)  load: $(cut -d' ' -f1-3 /proc/loadavg)  cpus: $(nproc)"
mkdir -p "$WORK"
SLICE=$WORK/slice
TRUNK=$WORK/trunk
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
        d=$BASE/$n; mkdir -p "$d"; echo "$b" > "$d/memory.limit_in_bytes"
        echo "$b" > "$d/memory.memsw.limit_in_bytes" 2>/dev/null || true
    fi
    echo "$d"
}
peak_of() { if [ $CG = v2 ]; then cat "$1/memory.peak" 2>/dev/null || echo 0; else cat "$1/memory.max_usage_in_bytes"; fi; }

printf '%-7s %10s %12s %8s %8s %10s %10s %6s  %s\n' limit s/token bytes/tok devbw ratio cg_peak peak exit ids
IFS=, read -ra LS <<< "$LIMITS"
for L in "${LS[@]}"; do
    B=$(python3 -c "print(int($L * 1e9))")
    d=$(make_cg "k3-bench-$$-$L" "$B")
    sync; echo 3 > /proc/sys/vm/drop_caches
    OUT=$WORK/rung-$L.json
    rm -f "$OUT"
    set +e
    ( echo $BASHPID > "$d/cgroup.procs" 2>/dev/null || echo $BASHPID > "$d/tasks"
      exec "$K3" "$SLICE" --trunk "$TRUNK" --mem-gb "$L" --ids "$IDS" --gen "$GEN" \
          --incremental --quiet --out "$OUT" ) > "$WORK/rung-$L.log" 2>&1
    rc=$?
    set -e
    PEAK=$(peak_of "$d")
    if [ -f "$OUT" ]; then
        python3 - "$OUT" "$L" "$S" "$DEVBW" "$PEAK" "$rc" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
L, S, devbw, cg, rc = float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
steps = r["steps"][1:] or r["steps"]
spt = sum(s["seconds"] for s in steps) / len(steps)
bpt = sum(s["trunk_read_bytes"] + s["expert_read_bytes"] for s in steps) / len(steps)
floor = max(0.0, S - L * 1e9 + 0.5e9)
ratio = f"{bpt / floor:.2f}" if floor > 0 else "-"
peak = r["totals"].get("peak_bytes") or 0
ids = ",".join(map(str, r["generated_ids"]))
print(f"{L:<7} {spt:>10.3f} {bpt/1e9:>10.3f}GB {devbw:>8} {ratio:>8} {cg/1e9:>8.3f}GB {peak/1e9:>8.3f}GB {rc:>6}  {ids}")
PY
    else
        printf '%-7s %10s %12s %8s %8s %8.3fGB %10s %6s  %s\n' "$L" - - "$DEVBW" - \
            "$(python3 -c "print($PEAK/1e9)")" - "$rc" "(no report: $(tail -1 "$WORK/rung-$L.log"))"
    fi
    rmdir "$d" 2>/dev/null || true
done
