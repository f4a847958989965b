#!/usr/bin/env bash
# A long prompt under a memory budget, k3 beside llama.cpp (issue 32, "Prefill under a
# budget"): each run inside a fresh v1 memory cgroup of MEM_GB × 10^9 bytes, the page cache
# dropped before it, rounds alternating k3 and llama.cpp.
#
#   scripts/bench-prefill-budget.sh SLICE TRUNK [GGUF]
#
# SLICE: `k3-orch synth --shape slice --vocab 163840 --seed 7`; TRUNK: its `pack-trunk`
# directory; GGUF: the slice converted for llama.cpp (scripts/bench-llama.sh says how;
# without it only k3 runs). k3 runs `SLICE --trunk TRUNK --mem-gb MEM_GB --incremental
# --threads THREADS --ids 1..PROMPT --gen 1` (staged processes: every byte it reads is in
# its prefill figure); llama.cpp `llama-bench -p PROMPT -n 0 -t THREADS -r 1` (mmap: its
# load is not in its figure). Per round: k3's prefill seconds, bytes read and path, the
# time its prompt waited for the trunk and for the lm_head's read (`K3_PROFILE`), its floor
# (the report's `prefill floor:` line: the disk's busy time, its compute and the ratio),
# llama.cpp's time, their ratio, each cgroup's peak, and k3's next id (the same in every
# round, or the script says so).
#
# Environment: K3 (default target/release/k3-orch), LLAMA_BIN (default
# /work/llama/src/build/bin), MEM_GB (5.5), PROMPT (512), THREADS (2), ROUNDS (2), and
# K3_SIMD (the product path; unset: automatic). Needs root (cgroups, drop_caches). Prints
# `uptime` and the CPU model and flags; do not record numbers from a loaded machine.
set -euo pipefail

SLICE=${1:?usage: $0 SLICE TRUNK [GGUF]}
TRUNK=${2:?usage: $0 SLICE TRUNK [GGUF]}
GGUF=${3:-}
K3=${K3:-target/release/k3-orch}
LLAMA_BIN=${LLAMA_BIN:-/work/llama/src/build/bin}
MEM_GB=${MEM_GB:-5.5}
PROMPT=${PROMPT:-512}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
ids=$(seq -s, 1 "$PROMPT")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "== $(date -u +%FT%TZ) $(uptime)"
lscpu | grep -E 'Model name|^Flags' | sed 's/^/   /'

# Run "$@" in a fresh cgroup of MEM_GB; prints the peak into $WORK/peak.
in_cgroup() {
    local cg=/sys/fs/cgroup/memory/k3-bench-prefill-$$-$RANDOM
    mkdir "$cg"
    # %.0f, not %d: mawk's %d stops at 2^31 - 1.
    awk -v g="$MEM_GB" 'BEGIN { printf "%.0f\n", g * 1e9 }' > "$cg/memory.limit_in_bytes"
    sync
    echo 3 > /proc/sys/vm/drop_caches
    local rc=0
    (
        echo $BASHPID > "$cg/cgroup.procs"
        exec "$@"
    ) || rc=$?
    cat "$cg/memory.max_usage_in_bytes" > "$WORK/peak"
    rmdir "$cg"
    return $rc
}

first_id=
printf '%-5s %9s %9s %10s %9s %8s %9s %9s %9s %11s %8s %10s %10s %s\n' round k3_s read_GB \
    trunk_wait head_s busy_s compute_s k3/floor llama_s llama/k3 next_id k3_peak_GB ll_peak_GB path
for r in $(seq 1 "$ROUNDS"); do
    in_cgroup env K3_PROFILE=1 "$K3" "$SLICE" --trunk "$TRUNK" --mem-gb "$MEM_GB" \
        --incremental --threads "$THREADS" --ids "$ids" --gen 1 > "$WORK/k3.out" 2>&1 || {
        tail -5 "$WORK/k3.out" >&2
        exit 1
    }
    k3_peak=$(awk '{ printf "%.2f", $1 / 1e9 }' "$WORK/peak")
    pre=$(grep -m1 '^prefill:' "$WORK/k3.out")
    k3_s=$(sed -n 's/.* in \([0-9.]*\) s,.*/\1/p' <<< "$pre")
    read_gb=$(sed -n 's/.* s, [0-9.]* tokens\/s, \([0-9.]*\) GB read.*/\1/p' <<< "$pre")
    path=$(sed -n 's/.*path \([^ ]*\).*/\1/p' <<< "$pre")
    # The report's floor line: max(disk busy, compute) and the prefill over it.
    fl=$(grep -m1 '^prefill floor:' "$WORK/k3.out" || true)
    busy=$(sed -n 's/.*disk busy \([0-9.]*\) s.*/\1/p' <<< "$fl")
    compute=$(sed -n 's/.*compute \([0-9.]*\) s).*/\1/p' <<< "$fl")
    over=$(sed -n 's/.*prefill took \([0-9.]*\)x.*/\1/p' <<< "$fl")
    prof=$(grep -m1 "k3 profile: ntok $PROMPT " "$WORK/k3.out" || true)
    trunk_wait=$(sed -n 's/.*trunk-wait \([0-9.]*\).*/\1/p' <<< "$prof")
    head_ms=$(sed -n 's/.*| head \([0-9.]*\).*/\1/p' <<< "$prof")
    next=$(sed -n 's/^ids: \([0-9]*\).*/\1/p' "$WORK/k3.out")
    [ -z "$first_id" ] && first_id=$next
    [ "$next" = "$first_id" ] || echo "round $r: next id $next, not $first_id" >&2
    llama_s=- ratio=- ll_peak=-
    if [ -n "$GGUF" ]; then
        in_cgroup "$LLAMA_BIN/llama-bench" -m "$GGUF" -p "$PROMPT" -n 0 -t "$THREADS" -r 1 \
            > "$WORK/ll.out" 2>&1 || {
            tail -5 "$WORK/ll.out" >&2
            exit 1
        }
        ll_peak=$(awk '{ printf "%.2f", $1 / 1e9 }' "$WORK/peak")
        # The pp row's tokens/s column.
        tps=$(grep "pp$PROMPT" "$WORK/ll.out" | awk -F'|' '{ print $(NF - 1) }' | awk '{ print $1 }')
        llama_s=$(awk -v p="$PROMPT" -v t="$tps" 'BEGIN { printf "%.2f", p / t }')
        ratio=$(awk -v a="$llama_s" -v b="$k3_s" 'BEGIN { printf "%.2f", a / b }')
    fi
    printf '%-5s %9s %9s %10s %9s %8s %9s %9s %9s %11s %8s %10s %10s %s\n' "$r" "$k3_s" \
        "$read_gb" "$(awk -v m="${trunk_wait:-0}" 'BEGIN { printf "%.2f", m / 1000 }')" \
        "$(awk -v m="${head_ms:-0}" 'BEGIN { printf "%.2f", m / 1000 }')" \
        "${busy:--}" "${compute:--}" "${over:--}" \
        "$llama_s" "$ratio" "$next" "$k3_peak" "$ll_peak" "$path"
done
echo "(trunk_wait, head_s: seconds the prompt waited for trunk parts and for the lm_head's read;"
echo " busy_s, compute_s: the busiest disk's busy seconds and the prefill less its read waits;"
echo " k3/floor: the prefill over max(busy_s, compute_s), the report's 'prefill floor:' line;"
echo " llama/k3 above 1 means k3 is faster)"
echo "== $(date -u +%FT%TZ) $(uptime)"
