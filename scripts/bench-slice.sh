#!/usr/bin/env bash
# Resident compute on the synthetic slice (released per-layer dims and the released
# vocabulary, so the lm_head is the real 2.35 GB): decode s/token and prompt (prefill) time
# beside the memory read bandwidth measured in the same run, then the kernel table.
# The decode's floor is paired: with K3_FLOOR=1 the run reads the very weight bytes a
# decode token multiplies (the same mappings) right before each step, and the ratio is
# the median of step time over the floor read just before it (this host's read bandwidth
# moves by a third within a minute, so one probe per run is not a step's floor). The
# 1 GiB probe before and after the runs is printed for reference.
# Rows: resident decode `--single-process` (the kernels alone), resident decode in the
# staged default mode (stage processes, `--mem-gb 20` so every weight stays resident;
# its first steps while the expert cache fills, and its steps after 16),
# and the 16-token prompt (prefill, batched GEMM; the median of three runs).
#
#   scripts/bench-slice.sh [WORK_DIR] [THREADS]
#
# WORK_DIR defaults to ./bench-work (the slice is 13.75 GB on disk and is made once with
# `synth --shape slice --vocab 163840`). Every weight is in RAM: the runs are
# `--single-process` over mmapped shards, read into the page cache first and prefaulted at
# each run's load (so the prompt's time is the forward's, as llama-bench's pp is). The
# timed runs go without K3_PROFILE; the per-phase profile comes from separate runs. Only
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

# Resident means in RAM: read every shard once so the page cache holds the whole slice
# (a build or another run may have evicted part of it; the warm-up run below only touches
# the experts its own tokens route to, and a later run's first touch of another expert
# would otherwise read it from disk).
cat "$WORK"/slice/*.safetensors > /dev/null
echo "== uptime (start): $(uptime)"
# Machines differ between sessions (Zen 5, an Intel Xeon): say which one this table is.
echo "== cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs"
# The read probe: AVX-512 loads over 1 GiB with 1, 4 and 8 interleaved streams per task
# on the kernels' rayon pools; the best variant is the floor ("memory read bandwidth").
membw() { "$BENCH" --membw | grep -E 'memory read bandwidth|read probe' | tee /dev/stderr | grep 'memory read bandwidth'; }
BW0=$(membw)

IDS1=1
IDS16=$(seq -s, 1 16)
run() { # name, ids, gen: timed without the profile (K3_PROFILE costs decode about 10%)
  "$BIN" "$WORK/slice" --single-process --incremental --threads "$THREADS" \
    --ids "$2" --gen "$3" --out "$WORK/$1.json" --quiet
}
floor() { # name, ids, gen: timed, each decode step after its paired floor (NAME.floor)
  K3_FLOOR=1 "$BIN" "$WORK/slice" --single-process --incremental --threads "$THREADS" \
    --ids "$2" --gen "$3" --out "$WORK/$1.json" --quiet 2> "$WORK/$1.floor"
}
profile() { # name, ids, gen: the per-phase profile (K3_PROFILE, observation only) to NAME.prof
  K3_PROFILE=1 "$BIN" "$WORK/slice" --single-process --incremental --threads "$THREADS" \
    --ids "$2" --gen "$3" --out "$WORK/$1-prof.json" --quiet 2> "$WORK/$1.prof"
}
staged() { # name, ids, gen: the product's default (staged) mode, everything resident
  "$BIN" "$WORK/slice" --mem-gb 20 --incremental --threads "$THREADS" \
    --ids "$2" --gen "$3" --out "$WORK/$1.json" --quiet
}
run warmup "$IDS1" 4
floor decode "$IDS1" 24
# The prompt routes to nearly every expert (one decode token touches 48 of 192): one
# untimed prompt first, as llama-bench warms up, so the timed one reads experts from
# RAM. Without it the first prompt after the decode runs took 3.1 s against 1.1-1.35 s
# for the next ones (2026-12-02): the host had let the untouched experts' pages go cold.
run warmup-prefill "$IDS16" 1
# Three timed prompts, one process each (a prompt is one sample, and the host's speed
# drifts between runs): the table gives their median and range.
run prefill "$IDS16" 1
run prefill2 "$IDS16" 1
run prefill3 "$IDS16" 1
# The 512-token prompt (issue 32; llama-bench's pp512): one timed run after the short ones.
run prefill512 "$(seq -s, 1 512)" 1
# Staged runs 28 tokens: its expert-fetcher fills its cache as tokens first route to an
# expert (a process tree per run, nothing carried over), so the first dozen steps still
# read a few experts from disk; the steps after 16 are the resident speed.
staged staged "$IDS1" 28
profile decode "$IDS1" 12
profile prefill "$IDS16" 1
BW1=$(membw)
echo "== uptime (end of runs): $(uptime)"

python3 - "$WORK" "$BW0" "$BW1" "$THREADS" <<'PY'
import json, re, statistics, sys
work, bw0, bw1, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = json.load(open(f"{work}/slice/config.json"))
tc = cfg.get("text_config", cfg)
dec = json.load(open(f"{work}/decode.json"))
pres = [json.load(open(f"{work}/{n}.json")) for n in ("prefill", "prefill2", "prefill3")]
pre_s = sorted(p["steps"][0]["seconds"] for p in pres)
stg = json.load(open(f"{work}/staged.json"))
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
def s_per_token(rep, lo=1, hi=None):
    return statistics.median([s["seconds"] for s in rep["steps"][lo:hi]])
bw = [float(x) for x in re.findall(r"([0-9.]+) GB/s", bw0 + " " + bw1)]
# The paired floors: `k3 floor: step S read B bytes in T ms` before each decode step.
pairs = {}
for m in re.finditer(r"k3 floor: step (\d+) read (\d+) bytes in ([0-9.]+) ms",
                     open(f"{work}/decode.floor").read()):
    pairs[int(m.group(1))] = (int(m.group(2)), float(m.group(3)) / 1e3)
secs = {s["step"]: s["seconds"] for s in dec["steps"]}
# The probe counts every bound non-expert tensor by the checkpoint's headers; the plan's
# trunk figure leaves out a few model-level vectors (31 KB on the slice).
if not pairs or any(abs(b - per_token) > per_token / 1000 for b, _ in pairs.values()):
    sys.exit(f"the floor probe read {sorted({b for b, _ in pairs.values()})} bytes per step, "
             f"not the {per_token} a decode token multiplies")
ratios = [secs[k] / f for k, (_, f) in pairs.items() if k in secs]
floor = statistics.median(f for _, f in pairs.values())
print()
print(f"slice: {layers} layers, vocab {vocab}, top-{topk}, {threads} threads, resident")
print(f"floor: the token's own {per_token/1e9:.2f} GB read before each decode step, median "
      f"{floor:.3f} s ({per_token/1e9/floor:.1f} GB/s); 1 GiB probe before / after: "
      f"{bw[1]:.1f} / {bw[3]:.1f} GB/s" if len(bw) >= 4 else "")
print(f"{'mode':<28} {'weight GB/token':>16} {'s/token':>8} {'GB/s':>6} {'floor s':>8} {'ratio':>6}")
st = s_per_token(dec)
print(f"{'decode --single-process':<28} {per_token/1e9:16.2f} {st:8.3f} {per_token/1e9/st:6.1f} "
      f"{floor:8.3f} {statistics.median(ratios):6.2f}  (median of {len(ratios)} paired "
      f"steps, {min(ratios):.2f}-{max(ratios):.2f})")
rows = (
    ("staged, steps 2-12 (warming)", stg, 1, 12),
    ("staged --mem-gb 20, 17-28", stg, 16, None),
)
for name, rep, lo, hi in rows:
    st = s_per_token(rep, lo, hi)
    print(f"{name:<28} {per_token/1e9:16.2f} {st:8.3f} {per_token/1e9/st:6.1f} {floor:8.3f} "
          f"{st/floor:6.2f}  (against the decode run's median floor)")
path = pres[0].get("prefill", {}).get("product_path", "?")
print(f"{'16-token prompt (prefill)':<28} {pre_s[1]:>34.3f} s (goal <= 0.8 s; median of 3, "
      f"{pre_s[0]:.3f}-{pre_s[2]:.3f}; path {path})")
long = json.load(open(f"{work}/prefill512.json"))
ls = long["steps"][0]["seconds"]
print(f"{'512-token prompt (prefill)':<28} {ls:>34.3f} s ({512 / ls:.1f} tokens/s; one run; "
      f"path {long.get('prefill', {}).get('product_path', '?')})")
if len({tuple(p["generated_ids"]) for p in pres}) != 1:
    print("WARNING: the three prompts' ids differ")
print(f"decode ids {dec['generated_ids']}, staged ids {stg['generated_ids']}")
if dec["generated_ids"] != stg["generated_ids"][: len(dec["generated_ids"])]:
    print("WARNING: staged and single-process ids differ")
PY
echo "== where the time goes (K3_PROFILE, separate runs: ms per forward call, summed over layers)"
echo "decode, last 3 steps:"; grep 'k3 profile' "$WORK/decode.prof" | tail -3
echo "16-token prompt:"; grep 'k3 profile' "$WORK/prefill.prof" | head -1

echo
echo "== kernel table (GB/s of weight bytes; % read: the case's own bytes read by the probe just before, median of reps)"
"$BENCH"
echo
echo "== decode tuning sweep (lm_head GEMV, 2 threads; rows side by side x prefetch bytes)"
# Results never depend on the tuning; the fastest row may become the default
# (kernels::tuning::R1 and the formats' PF) or be set per run with K3_GEMV_ROWS / K3_GEMV_PF.
"$BENCH" --sweep --only lm_head --th 2 --path avx512 | grep -E 'lm_head|read bandwidth' \
  | awk '/lm_head/ {print; if ($(NF-3)+0 > best) {best=$(NF-3)+0; line=$0}} END {print "fastest: " line}'
echo "== uptime (end): $(uptime)"
