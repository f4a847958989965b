#!/usr/bin/env bash
# k3 and llama.cpp resident on the same slice, alternating round by round (issue 10): the
# machine's memory bandwidth drifts by a third within minutes here, so only ratios of runs
# taken next to each other mean anything.
#
#   scripts/bench-pair.sh [ROUNDS]
#
# Each round: read the slice's shards into the page cache, run k3 `--single-process`
# (resident decode of `--gen 16` after one prompt id: median s/token of the decode steps;
# then a 16-token prompt: one untimed run, then the median prefill step of three runs),
# then read the GGUF into the page cache and run `llama-bench -p 16 -n 16 -r 3 --repack 1`
# (llama-bench's default, warm-up included): its pp16 time and tg16 s/token. The two files
# do not fit the page cache together (27.5 GB against 24 GB here), hence the reads before
# each engine. Prints one line per round with the ratios, and `uptime` at the start and
# the end.
#
# Environment: SLICE (default /work/bench/slice, made by `k3-orch synth --shape slice
# --vocab 163840 --seed 7`), GGUF (default /work/bench/slice.gguf), LLAMA_BIN (default
# /work/llama/src/build/bin; how to build it and convert the slice: scripts/bench-llama.sh),
# THREADS (2), K3 (default target/release/k3-orch, built here), LONG (512: the long prompt,
# one timed k3 run per round after the short ones, and llama-bench's `-p LONG`; 0 skips it).
# The `path` column is the product path k3's report names (`K3_SIMD` selects another).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
SLICE=${SLICE:-/work/bench/slice}
GGUF=${GGUF:-/work/bench/slice.gguf}
LLAMA_BIN=${LLAMA_BIN:-/work/llama/src/build/bin}
THREADS=${THREADS:-2}
K3=${K3:-target/release/k3-orch}
LONG=${LONG:-512}
WORK=$(mktemp -d /tmp/k3-bench-pair.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
[ "$K3" = target/release/k3-orch ] && cargo build --release -q -p k3-orch
for f in "$SLICE/config.json" "$GGUF" "$LLAMA_BIN/llama-bench"; do
    [ -e "$f" ] || { echo "missing $f (see the header of $0)" >&2; exit 2; }
done
# The page cache's large folios (`FileHugePages`, Linux 6.x) slow a mapped model's reads
# on some hosts: 20 against 28-30 GB/s on the VM of 2026-12-07 (docs/measurements.md,
# "Resident weights in one process depend on the page cache's folios"), so print them.
folios() { grep -s FileHugePages /proc/meminfo | tr -s ' ' || true; }
echo "== uptime (start): $(uptime); $(folios)"
printf '%-5s %10s %10s %10s %10s %9s %9s %10s %10s %9s %s\n' round k3_s/tok llama_s/tok \
    k3_pp16 llama_pp16 dec_ratio pp_ratio "k3_pp$LONG" "llama_pp$LONG" "pp${LONG}_rat" path
for r in $(seq "$ROUNDS"); do
    cat "$SLICE"/*.safetensors > /dev/null
    "$K3" "$SLICE" --single-process --incremental --threads "$THREADS" --ids 1 --gen 16 \
        --out "$WORK/dec.json" --quiet > /dev/null
    # The prompt: one untimed run first, then three timed ones (their median), as
    # llama-bench warms up and repeats. Without the warm-up the prompt read part of the
    # slice from disk after llama.cpp's run: the two files do not fit the page cache
    # together, and the `cat` above cannot keep every page of a file read once against
    # the GGUF's pages that llama.cpp used again and again (2026-12-03: 1.28-1.31 s
    # against 0.93-1.13 s in the rounds before).
    for i in 0 1 2 3; do
        "$K3" "$SLICE" --single-process --incremental --threads "$THREADS" \
            --ids "$(seq -s, 1 16)" --gen 1 --out "$WORK/pre$i.json" --quiet > /dev/null
    done
    rm -f "$WORK/long.json"
    if [ "$LONG" -gt 0 ]; then
        "$K3" "$SLICE" --single-process --incremental --threads "$THREADS" \
            --ids "$(seq -s, 1 "$LONG")" --gen 1 --out "$WORK/long.json" --quiet > /dev/null
    fi
    cat "$GGUF" > /dev/null
    pp=16; [ "$LONG" -gt 0 ] && pp="16,$LONG"
    "$LLAMA_BIN/llama-bench" -m "$GGUF" -t "$THREADS" -p "$pp" -n 16 -r 3 --repack 1 -o json \
        > "$WORK/llama.json" 2> "$WORK/llama.log"
    python3 - "$WORK" "$r" "$LONG" <<'PY'
import json, os, statistics, sys
work, r, long_n = sys.argv[1], sys.argv[2], int(sys.argv[3])
dec = json.load(open(f"{work}/dec.json"))
k3_tok = statistics.median(s["seconds"] for s in dec["steps"][1:])
k3_pp = statistics.median(json.load(open(f"{work}/pre{i}.json"))["steps"][0]["seconds"]
                          for i in (1, 2, 3))
ll = json.load(open(f"{work}/llama.json"))
ll_pp = next(t["avg_ns"] for t in ll if t["n_prompt"] == 16 and t["n_gen"] == 0) / 1e9
ll_tok = next(t["avg_ns"] for t in ll if t["n_gen"] == 16 and t["n_prompt"] == 0) / 1e9 / 16
path = dec.get("prefill", {}).get("product_path", "?")
k3_long = ll_long = None
if long_n > 0 and os.path.exists(f"{work}/long.json"):
    k3_long = json.load(open(f"{work}/long.json"))["steps"][0]["seconds"]
    ll_long = next(t["avg_ns"] for t in ll if t["n_prompt"] == long_n and t["n_gen"] == 0) / 1e9
fmt = lambda v: f"{v:>10.3f}" if v is not None else f"{'-':>10}"
ratio = f"{k3_long / ll_long:>9.2f}" if k3_long and ll_long else f"{'-':>9}"
print(f"{r:<5} {k3_tok:>10.3f} {ll_tok:>10.3f} {k3_pp:>10.3f} {ll_pp:>10.3f} "
      f"{k3_tok / ll_tok:>9.2f} {k3_pp / ll_pp:>9.2f} {fmt(k3_long)} {fmt(ll_long)} {ratio} {path}")
PY
done
echo "(ratios are k3 / llama.cpp: below 1 means k3 is faster)"
echo "== uptime (end): $(uptime); $(folios)"
