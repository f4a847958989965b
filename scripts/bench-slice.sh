#!/usr/bin/env bash
# Resident compute on the synthetic slice (released per-layer dims and the released
# vocabulary, so the lm_head is the real 2.35 GB): decode s/token and prompt (prefill) time
# beside the memory read bandwidth measured in the same run, then the kernel table.
#
#   scripts/bench-slice.sh [WORK_DIR] [THREADS]
#
# WORK_DIR defaults to ./bench-work (the slice is ~9.5 GB on disk and is made once with
# `synth --shape slice --vocab 163840`). Every weight is in RAM: the runs are
# `--single-process` over mmapped shards after a warm-up run has paged them in. Only
# meaningful on a quiet machine: `uptime` is printed at the start and the end.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-bench-work}
THREADS=${2:-2}
BIN=target/release/k3-orch
cargo build --release -q -p k3-orch
cargo build --release -q -p k3-layer-compute --example gemv_bench
BENCH=target/release/examples/gemv_bench
mkdir -p "$WORK"
[ -f "$WORK/slice/config.json" ] || "$BIN" synth --shape slice --vocab 163840 --seed 7 "$WORK/slice"

echo "== uptime (start): $(uptime)"
membw() { "$BENCH" --membw | grep 'memory read bandwidth'; }
BW0=$(membw)
echo "$BW0"

IDS1=1
IDS16=$(seq -s, 1 16)
run() { # name, ids, gen
  "$BIN" "$WORK/slice" --single-process --incremental --threads "$THREADS" \
    --ids "$2" --gen "$3" --out "$WORK/$1.json" --quiet
}
run warmup "$IDS1" 4 # pages every trunk tensor and the routed experts it touches in
run decode "$IDS1" 12
run prefill "$IDS16" 1
BW1=$(membw)
echo "$BW1"
echo "== uptime (end of runs): $(uptime)"

python3 - "$WORK" "$BW0" "$BW1" "$THREADS" <<'PY'
import json, re, statistics, sys
work, bw0, bw1, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = json.load(open(f"{work}/slice/config.json"))
tc = cfg.get("text_config", cfg)
dec = json.load(open(f"{work}/decode.json"))
pre = json.load(open(f"{work}/prefill.json"))
# Weight bytes one decode token reads: every trunk tensor, the lm_head, and top-k routed
# experts per MoE layer (the embedding row is negligible).
plan = {i["what"]: i["bytes"] for i in dec["plan"]["items"]}
trunk = plan["trunk (resident)"]
vocab, hidden = tc["vocab_size"], tc["hidden_size"]
lm_head = vocab * hidden * 2
layers = tc["num_hidden_layers"]
first_dense = tc.get("first_k_dense_replace", 1)
topk = tc["num_experts_per_token"]
# One routed expert of the released geometry (design.md §5: exactly 17,547,264 bytes).
expert = 17_547_264
moe_layers = layers - first_dense
per_token = trunk + lm_head + moe_layers * topk * expert
steps = [s["seconds"] for s in dec["steps"][1:]]
s_tok = statistics.median(steps)
bw = [float(x) for x in re.findall(r"([0-9.]+) GB/s", bw0 + " " + bw1)]
bw2 = max(bw[1], bw[3]) if len(bw) >= 4 else max(bw)
floor = per_token / 1e9 / bw2
print()
print(f"slice: {layers} layers, vocab {vocab}, top-{topk}, {threads} threads, --single-process, resident")
print(f"{'weight GB/token':>16} {'s/token':>8} {'GB/s':>6} {'mem GB/s':>8} {'floor s':>8} {'ratio':>6} {'16-token prompt s':>18}")
print(f"{per_token/1e9:16.2f} {s_tok:8.3f} {per_token/1e9/s_tok:6.1f} {bw2:8.1f} {floor:8.3f} {s_tok/floor:6.2f} {pre['steps'][0]['seconds']:18.3f}")
print(f"decode ids {dec['generated_ids']}")
PY

echo
echo "== kernel table"
"$BENCH"
echo "== uptime (end): $(uptime)"
