#!/usr/bin/env bash
# Batching side by side (issue 33): `k3-orch serve --parallel 4` with one client, then
# with 4 concurrent clients (each its own 16-token prompt and 64 generated tokens),
# alternated ROUNDS times on one server; then llama.cpp's `llama-batched-bench` at
# npl = 1 and 4 with the same prompt and generation lengths on the same weights (GGUF).
#
#   scripts/bench-serve-pair.sh SLICE [GGUF]
#
# SLICE: `k3-orch synth --shape slice --vocab 163840` (resident: the whole model held).
# With MEM_GB=X (and TRUNK=packed trunk) the server runs `--mem-gb X --trunk TRUNK` inside
# a fresh v1 memory cgroup of X GB (needs root), the cgroup's peak printed at the end.
# Environment: K3 (default target/release/k3-orch), THREADS (2), ROUNDS (2), LLAMA_BIN
# (directory of llama-batched-bench; skipped when absent), GEN (64), PROMPT (16), CTX (1024),
# EXTRA (more `serve` flags, e.g. EXTRA=--single-process), SERVE_LOG (a file that keeps the
# server's stderr, e.g. its `K3_PROFILE=1` lines: one per pass).
# Prints `uptime`, the CPU model and flags; do not record numbers from a loaded machine.
set -euo pipefail
cd "$(dirname "$0")/.."
SLICE=${1:?usage: bench-serve-pair.sh SLICE [GGUF]}
GGUF=${2:-}
K3=${K3:-target/release/k3-orch}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
GEN=${GEN:-64}
PROMPT=${PROMPT:-16}
LLAMA_BIN=${LLAMA_BIN:-/work/llama/src/build/bin}
WORK=$(mktemp -d /tmp/k3-bench-serve.XXXXXX)
SERVER_PID=
CGDIR=
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
    if [ -n "$CGDIR" ] && [ -d "$CGDIR" ]; then rmdir "$CGDIR" 2>/dev/null || true; fi
    if [ -n "${SERVE_LOG:-}" ] && [ -f "$WORK/serve.err" ]; then cp "$WORK/serve.err" "$SERVE_LOG"; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

echo "== $(date -u +%FT%TZ) $(uptime)"
lscpu | grep -E 'Model name|^Flags' | sed 's/^Flags: */Flags: /' | cut -c1-400

flags=(--parallel 4 --threads "$THREADS" --port 0 --ctx ${CTX:-1024})
# shellcheck disable=SC2206 # EXTRA is split into flags on purpose.
[ -n "${EXTRA:-}" ] && flags+=($EXTRA)
if [ -n "${MEM_GB:-}" ]; then
    flags+=(--mem-gb "$MEM_GB")
    [ -n "${TRUNK:-}" ] && flags+=(--trunk "$TRUNK")
    CGDIR=/sys/fs/cgroup/memory/k3-bench-serve-$$
    mkdir "$CGDIR"
    # %.0f, not %d: mawk's %d stops at 2^31 - 1, which made a 5.5 GB limit 2 GiB.
    awk -v g="$MEM_GB" 'BEGIN { printf "%.0f\n", g * 1e9 }' > "$CGDIR/memory.limit_in_bytes"
    sync; echo 3 > /proc/sys/vm/drop_caches
fi
(
    if [ -n "$CGDIR" ]; then echo $BASHPID > "$CGDIR/cgroup.procs"; fi
    exec "$K3" serve "$SLICE" "${flags[@]}"
) > "$WORK/serve.out" 2> "$WORK/serve.err" &
SERVER_PID=$!
url=
for _ in $(seq 1 600); do
    url=$(sed -n 's/.*listening on \(http[^ ]*\).*/\1/p' "$WORK/serve.out" | head -1)
    if [ -n "$url" ] && curl -sf "$url/health" > /dev/null 2>&1; then break; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then cat "$WORK/serve.err" >&2; exit 1; fi
    sleep 1
done
echo "server: $url (${flags[*]})"

bench() {
    python3 scripts/bench-serve.py --base-url "$url/v1" --clients "$1" --requests "$1" \
        --seed "$2" --prompt-tokens "$PROMPT:$PROMPT" --max-tokens "$GEN:$GEN" \
        --json "$WORK/b$1-$2.json" > "$WORK/b$1-$2.txt"
    echo "clients $1: $(grep aggregate "$WORK/b$1-$2.txt")"
}
# Warm-up (first-touch of the weights), not recorded.
bench 1 99 > /dev/null
for r in $(seq 1 "$ROUNDS"); do
    echo "-- round $r"
    bench 1 "$r"
    bench 4 "$r"
done
echo "== per client (1 client, round 1)"; cat "$WORK/b1-1.txt"
echo "== per client (4 clients, round 1)"; cat "$WORK/b4-1.txt"
if [ -n "$CGDIR" ]; then
    echo "cgroup peak: $(cat "$CGDIR/memory.max_usage_in_bytes") bytes (limit $(cat "$CGDIR/memory.limit_in_bytes"))"
fi
kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=

if [ -n "$GGUF" ] && [ -x "$LLAMA_BIN/llama-batched-bench" ]; then
    echo "== llama-batched-bench (npp $PROMPT, ntg $GEN, npl 1,4, $THREADS threads)"
    LD_LIBRARY_PATH=$LLAMA_BIN "$LLAMA_BIN/llama-batched-bench" -m "$GGUF" -c 2048 -b 512 \
        -ub 512 -npp "$PROMPT" -ntg "$GEN" -npl 1,4 -t "$THREADS" -tb "$THREADS" 2>&1 \
        | grep -E '^\|' || true
fi
echo "== $(date -u +%FT%TZ) $(uptime)"
