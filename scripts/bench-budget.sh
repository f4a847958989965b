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
#   equal EXPECT. A rung whose plan does not fit is refused up front (exit 2, no report). The
#   slice's floor is 0.90 GB (`inspect SLICE`): the trunk streams in parts (the tensors the
#   forward uses together; the largest, a KDA attention up to its output projection, is one
#   0.71 GB ring slot), the lm_head in chunks, and a layer's experts through 4 arena slots
#   (each reused as compute gives it back), so the 1.5 GB rung runs (and a 0.96 GB one).
#
# EXPECT: the ids every run must give. When not given, the resident rung is run first and
# its ids are the expectation (slices made before `synth --weights gaussian` have other ids
# than new ones, so no default is hard-coded); without a resident rung EXPECT is required.
#
# Codec rows (issue 37): with CODED_TRUNK=DIR (the same slice packed with `pack-trunk
# --codec bf16-zstd`; packed there once if DIR has no trunk.json), every numeric rung runs
# twice, the raw TRUNK and the coded trunk back to back (rows `L` and `L/coded`), the order
# alternating from round to round (ROUNDS, default 1), and prints beside the row the stored
# bytes the coded trunk read per token (the trunk's decoded bytes per token times the run's
# stored/decoded share, from the trunk-loader's summary) and s/token against the same
# round's raw run at that rung (known beside the row in odd rounds; every round's ratios
# are printed at the end, since in even rounds the raw run comes last).
#
# CODED_RESIDENT=MODE,... (with CODED_TRUNK; issue 37's second mode) runs the coded trunk
# once per `--trunk-resident` MODE (raw, coded, auto) at each numeric rung instead of once
# with the default (auto): rows `L/coded-MODE`, after the raw row in odd rounds and in the
# reverse order before it in even ones. The coded rows also print the layers the plan kept
# coded in memory and their bytes. For example, beside the raw trunk:
#   CODED_TRUNK=/work/bench/slice-coded CODED_RESIDENT=raw,coded,auto ROUNDS=2 \
#       scripts/bench-budget.sh /tmp/k3-bench-budget 5.5,resident
#
# CODED_HEAD=MODE,... (with CODED_TRUNK) runs the coded trunk once per `--lm-head-read`
# MODE (raw, coded, auto): rows `L/head-MODE`, ordered as CODED_RESIDENT's (after them when
# both are given). `head-raw` is the coded trunk with the lm_head streamed raw from the
# checkpoint, as before the lm_head was coded; `head-auto` is the default. For example:
#   CODED_TRUNK=/work/bench/slice-coded CODED_HEAD=raw,auto ROUNDS=2 \
#       scripts/bench-budget.sh /tmp/k3-bench-budget 5.5
#
# RATE_MB=N throttles every numeric rung's reads of the disk that holds the trunks to N MB/s
# (a cgroup v1 `blkio.throttle.read_bps_device` the rungs run in, beside their memory
# cgroup): a slower drive beside the same cores, where the disk rather than the decoding is
# the floor. The runs' own drive probes then measure the throttled rate, as on such a drive.
#
# DRY_RUN=1 checks the arguments and prints the runs it would make, in order, then exits
# (no root, no k3-orch, nothing written).
# Needs root (cgroups, drop_caches). Environment: K3 (default target/release/k3-orch),
# SLICE, TRUNK, CODED_TRUNK, CODED_RESIDENT, CODED_HEAD, RATE_MB, GEN (default 8), IDS (default 1), EXPECT, ROUNDS,
# DRY_RUN.
set -euo pipefail
cd "$(dirname "$0")/.."
K3=${K3:-target/release/k3-orch}
WORK=${1:-/tmp/k3-bench-budget}
LIMITS=${2:-1.5,5.5,resident}
GEN=${GEN:-8}
IDS=${IDS:-1}
EXPECT=${EXPECT:-}
ROUNDS=${ROUNDS:-1}
CODED_TRUNK=${CODED_TRUNK:-}
CODED_RESIDENT=${CODED_RESIDENT:-}
CODED_HEAD=${CODED_HEAD:-}
RATE_MB=${RATE_MB:-}
DRY_RUN=${DRY_RUN:-}

# The rungs: numbers (GB) or `resident`; the resident rung first when it sets EXPECT.
IFS=, read -ra LS <<< "$LIMITS"
HAVE_RESIDENT=
NUMERIC=()
for L in "${LS[@]}"; do
    if [ "$L" = resident ]; then
        HAVE_RESIDENT=1
    elif [[ "$L" =~ ^[0-9]+([.][0-9]+)?$ ]] && python3 -c "import sys; sys.exit(0 if float('$L') > 0 else 1)"; then
        NUMERIC+=("$L")
    else
        echo "bench-budget: limit '$L' is neither a positive number of GB nor 'resident'" >&2
        exit 2
    fi
done
if ! [[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]]; then
    echo "bench-budget: ROUNDS=$ROUNDS is not a positive whole number" >&2
    exit 2
fi
if [ -z "$EXPECT" ] && [ -z "$HAVE_RESIDENT" ]; then
    echo "bench-budget: give EXPECT (the resident run's ids for IDS=$IDS GEN=$GEN) or include the 'resident' rung" >&2
    exit 2
fi
if [ -n "$EXPECT" ] && ! [[ "$EXPECT" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
    echo "bench-budget: EXPECT=$EXPECT is not a comma-separated list of ids" >&2
    exit 2
fi
# The coded kinds of a rung: `coded` (the default placement), or one `coded-MODE` per
# CODED_RESIDENT mode and one `head-MODE` per CODED_HEAD mode.
# add_kinds VAR PREFIX WHAT: one kind PREFIX-MODE per mode in $VAR (raw, coded or auto).
add_kinds() {
    local var=$1 prefix=$2 what=$3 M MODES
    if [ -z "$CODED_TRUNK" ]; then
        echo "bench-budget: $var needs CODED_TRUNK (the coded trunk $what)" >&2
        exit 2
    fi
    IFS=, read -ra MODES <<< "${!var}"
    for M in "${MODES[@]}"; do
        case "$M" in
            raw|coded|auto) CODED_KINDS+=("$prefix-$M") ;;
            *) echo "bench-budget: $var mode '$M' is not raw, coded or auto" >&2; exit 2 ;;
        esac
    done
}
CODED_KINDS=(coded)
if [ -n "$CODED_RESIDENT$CODED_HEAD" ]; then
    CODED_KINDS=()
fi
[ -z "$CODED_RESIDENT" ] || add_kinds CODED_RESIDENT coded "it places"
[ -z "$CODED_HEAD" ] || add_kinds CODED_HEAD head "whose lm_head it reads"
if [ -n "$RATE_MB" ] && ! [[ "$RATE_MB" =~ ^[1-9][0-9]*$ ]]; then
    echo "bench-budget: RATE_MB=$RATE_MB is not a positive whole number of MB/s" >&2
    exit 2
fi
# The runs in order: "rung trunk-kind" (kind raw, coded or resident).
PLAN=()
[ -n "$HAVE_RESIDENT" ] && PLAN+=("resident resident 0")
for ((round = 1; round <= ROUNDS; round++)); do
    for L in "${NUMERIC[@]}"; do
        if [ -z "$CODED_TRUNK" ]; then
            PLAN+=("$L raw $round")
        elif ((round % 2)); then
            PLAN+=("$L raw $round")
            for K in "${CODED_KINDS[@]}"; do PLAN+=("$L $K $round"); done
        else
            for ((k = ${#CODED_KINDS[@]} - 1; k >= 0; k--)); do PLAN+=("$L ${CODED_KINDS[k]} $round"); done
            PLAN+=("$L raw $round")
        fi
    done
done
if [ -n "$DRY_RUN" ]; then
    echo "bench-budget (dry run): ${#PLAN[@]} runs, ROUNDS=$ROUNDS, EXPECT=${EXPECT:-from the resident rung}, CODED_TRUNK=${CODED_TRUNK:-none}"
    for p in "${PLAN[@]}"; do read -r L KIND _ <<< "$p"; echo "run: $L $KIND"; done
    exit 0
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
if [ -n "$CODED_TRUNK" ]; then
    echo "coded trunk: $CODED_TRUNK"
    [ -f "$CODED_TRUNK/trunk.json" ] || "$K3" pack-trunk "$SLICE" "$CODED_TRUNK" --codec bf16-zstd
fi

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
# RATE_MB: a blkio cgroup that throttles reads of the disk holding the trunks.
BLK=
if [ -n "$RATE_MB" ]; then
    [ -d /sys/fs/cgroup/blkio ] || { echo "bench-budget: RATE_MB needs the cgroup v1 blkio controller" >&2; exit 2; }
    BLK=/sys/fs/cgroup/blkio/k3-bench-$$
    mkdir -p "$BLK"
    majmin=$(findmnt -n -o MAJ:MIN -T "$TRUNK" | tr -d ' ')
    echo "$majmin $((RATE_MB * 1000 * 1000))" > "$BLK/blkio.throttle.read_bps_device"
    trap 'rmdir "$BLK" 2>/dev/null || true' EXIT
    echo "reads of $majmin throttled to $RATE_MB MB/s in the numeric rungs (blkio $BLK)"
fi
peak_of() { if [ $CG = v2 ]; then cat "$1/memory.peak" 2>/dev/null || echo 0; else cat "$1/memory.max_usage_in_bytes"; fi; }

printf '%-14s %10s %12s %8s %8s %9s %10s %10s %6s  %s\n' limit s/token bytes/tok devbw ratio disk_busy cg_peak peak exit ids
# s/token of every run, by "round rung kind": a coded row's ratio beside it (its round's
# raw run, when that came first) and the ratios at the end.
declare -A SPTS=()
ORDER=()
for p in "${PLAN[@]}"; do
    read -r L KIND R <<< "$p"
    NAME=$L
    if [ "$KIND" = resident ]; then
        d=$(make_cg "k3-bench-$$-$L" max)
        RUN=("$K3" "$SLICE")
        LGB=0
    else
        B=$(python3 -c "print(int($L * 1e9))")
        d=$(make_cg "k3-bench-$$-$L-$KIND" "$B")
        DIR=$TRUNK
        PLACE=()
        case "$KIND" in
            coded) DIR=$CODED_TRUNK; NAME=$L/coded ;;
            coded-*) DIR=$CODED_TRUNK; NAME=$L/$KIND; PLACE=(--trunk-resident "${KIND#coded-}") ;;
            head-*) DIR=$CODED_TRUNK; NAME=$L/$KIND; PLACE=(--lm-head-read "${KIND#head-}") ;;
        esac
        RUN=("$K3" "$SLICE" --trunk "$DIR" --mem-gb "$L" "${PLACE[@]}")
        LGB=$L
    fi
    sync; echo 3 > /proc/sys/vm/drop_caches
    TAG=${NAME//\//-}
    OUT=$WORK/rung-$TAG.json
    rm -f "$OUT"
    set +e
    ( echo $BASHPID > "$d/cgroup.procs" 2>/dev/null || echo $BASHPID > "$d/tasks"
      if [ -n "$BLK" ] && [ "$KIND" != resident ]; then echo $BASHPID > "$BLK/cgroup.procs"; fi
      exec "${RUN[@]}" --ids "$IDS" --gen "$GEN" --incremental --quiet --out "$OUT" ) \
        > "$WORK/rung-$TAG.log" 2>&1
    rc=$?
    set -e
    PEAK=$(peak_of "$d")
    if [ -f "$OUT" ]; then
        LINE=$(python3 - "$OUT" "$LGB" "$S" "$DEVBW" "$PEAK" "$rc" "$NAME" "$EXPECT" "${SPTS[$R $L raw]:-}" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
L, S, devbw, cg, rc = float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
name, expect, raw_spt = sys.argv[7], sys.argv[8], sys.argv[9]
steps = r["steps"][1:] or r["steps"]
spt = sum(s["seconds"] for s in steps) / len(steps)
trunk = sum(s["trunk_read_bytes"] for s in steps) / len(steps)
bpt = trunk + sum(s["expert_read_bytes"] for s in steps) / len(steps)
floor = max(0.0, S - L * 1e9 + 0.5e9) if L > 0 else 0.0
ratio = f"{bpt / floor:.2f}" if floor > 0 else "-"
peak = r["totals"].get("peak_bytes") or 0
db = r["totals"].get("disk_busy")
busy = f"{100 * db['busy_share']:.1f}%" if db else "-"
ids = ",".join(map(str, r["generated_ids"]))
same = "" if not expect else ("  (= expected)" if ids == expect else f"  (DIFFERENT: expected {expect})")
codec = ((r.get("stage_summaries") or {}).get("trunk-loader") or {}).get("codec")
extra = ""
if codec and codec.get("decoded_bytes"):
    share = codec["stored_bytes_read"] / codec["decoded_bytes"]
    extra = f"  [coded: trunk {trunk/1e9:.3f}GB decoded, {trunk*share/1e9:.3f}GB stored per token"
    extra += f"; {codec.get('kept_layers', 0)} layers kept coded ({codec.get('kept_bytes', 0)/1e9:.3f}GB)"
    if raw_spt:
        extra += f"; s/token {spt / float(raw_spt):.2f}x raw"
    extra += "]"
print(f"{name:<14} {spt:>10.3f} {bpt/1e9:>10.3f}GB {devbw:>8} {ratio:>8} {busy:>9} {cg/1e9:>8.3f}GB {peak/1e9:>8.3f}GB {rc:>6}  {ids}{same}{extra}")
print(f"@@ {spt} {ids}")
PY
)
        echo "$LINE" | grep -v '^@@ '
        read -r _ SPT GOT <<< "$(echo "$LINE" | grep '^@@ ')"
        SPTS[$R $L $KIND]=$SPT
        ORDER+=("$R $L $KIND")
        if [ "$KIND" = resident ] && [ -z "$EXPECT" ]; then
            EXPECT=$GOT
            echo "EXPECT (from the resident rung): $EXPECT"
        fi
    else
        printf '%-14s %10s %12s %8s %8s %9s %8.3fGB %10s %6s  %s\n' "$NAME" - - "$DEVBW" - - \
            "$(python3 -c "print($PEAK/1e9)")" - "$rc" "(no report: $(tail -1 "$WORK/rung-$TAG.log"))"
        if [ "$KIND" = resident ] && [ -z "$EXPECT" ]; then
            echo "bench-budget: the resident rung gave no ids and EXPECT is not set: nothing to compare against" >&2
            rmdir "$d" 2>/dev/null || true
            exit 1
        fi
    fi
    rmdir "$d" 2>/dev/null || true
done
if [ -n "$CODED_TRUNK" ]; then
    # Each coded run against the raw run of its own round at its rung (alternated back to
    # back; in even rounds the raw run comes after the coded ones).
    echo "== coded s/token over the same round's raw"
    for k in "${ORDER[@]}"; do
        read -r R L KIND <<< "$k"
        raw=${SPTS[$R $L raw]:-}
        [ "$KIND" = raw ] || [ "$KIND" = resident ] || [ -z "$raw" ] && continue
        echo "round $R  $L/$KIND  $(python3 -c "print(f'{${SPTS[$k]} / $raw:.2f}x')") (${SPTS[$k]} against $raw s/token)"
    done
fi
echo "== $(date -u +%FT%TZ)  uptime: $(uptime)"
