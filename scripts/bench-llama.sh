#!/usr/bin/env bash
# llama.cpp on the same synthetic slice, side by side with k3 (issues 10 and 11).
#
#   scripts/bench-llama.sh [WORK_DIR]
#
# Two parts, each row once per REPACK value (llama.cpp's CPU "repack" of the MXFP4 expert
# tensors into an interleaved layout: 1 is llama-bench's default, and copies every expert
# of the file into anonymous memory at load; 0 leaves them in the mmap):
#  (a) resident: the GGUF in a warm page cache (read once with cat, then one llama-bench
#      warm-up run), mmap, THREADS threads: `llama-bench -p PP -n TG -r REPS` (llama-bench
#      also warms up each test itself). Prints the PP-token prompt time (s, mean ± sd over
#      REPS) and decode s/token (the TG-token run's mean / TG), and the weight bandwidth
#      S / (s/token) where S (default 8.88e9) is the bytes one slice token touches (issue 10).
#  (b) inside a LIMIT_GB memory cgroup (v1: memory.limit_in_bytes, and memsw when present;
#      v2: memory.max, swap.max 0), from a cold page cache (sync; drop_caches before each
#      run), no llama-bench warm-up: two runs, one decoding 1 token and one decoding
#      1 + CG_GEN tokens, each a fresh process in a fresh cgroup. The difference of the two
#      runs is the steady decode: s/token = (t[1+N] - t[1]) / N from llama-bench's own
#      timing, and bytes/token = (R[1+N] - R[1]) / N, where R is read_bytes of
#      /proc/<pid>/io of the subshell that ran llama-bench, read after it reaped it (the
#      kernel adds a reaped child's I/O counters to its parent's; so R counts the storage
#      reads of llama-bench and all its threads, page-cache misses of the mmap included,
#      and nothing from other processes). The difference removes the model load (mmap with
#      MAP_POPULATE reads the whole file once, even in the cgroup) and the first, fully cold
#      token. The device's sectors read (/sys/class/block/DEV/stat, the disk under GGUF;
#      includes every other process) are printed beside it as a cross-check, and the
#      cold first-token time t[1]. The cgroup's memory.max_usage_in_bytes (v1) /
#      memory.peak (v2) is read after each run; the cgroup is removed afterwards.
# `uptime` is printed before and after: record nothing from a loaded machine.
#
# Environment: LLAMA_BIN (dir holding llama-bench; default /work/llama/src/build/bin),
# GGUF (default /work/bench/slice.gguf), THREADS (2), PP (16), TG (16), REPS (5),
# LIMIT_GB (5.5), CG_GEN (8), REPACK ("1 0"), S (8.88e9), PARTS ("resident cgroup").
# Needs root (cgroups, drop_caches). Raw llama-bench JSON and logs go to WORK_DIR
# (default /tmp/k3-bench-llama).
#
# ---- How the llama.cpp build and the GGUF were made (reproduce on a fresh machine) ----
# llama.cpp: the copy vendored in the llama-cpp-python sdist (0.3.36 here, ggml 0.25.3,
# llama-bench reports build 1652066; it has src/models/kimi-k3.cpp and conversion/kimi_k3.py).
#   mkdir -p /work/llama && cd /work/llama
#   pip download --no-deps --no-binary :all: llama-cpp-python
#       # the sdist lands first; pip then builds its build deps from source (cmake
#       # included) only to read metadata, which can be interrupted once the .tar.gz is here
#   tar xzf llama_cpp_python-0.3.36.tar.gz
#   ln -sfn llama_cpp_python-0.3.36/vendor/llama.cpp src
#   mv src/.git src/.git.sdist-gitlink
#       # the sdist keeps the submodule's gitlink file; its target does not exist, and
#       # llama.cpp's cmake then re-runs itself forever (build.ninja depends on the
#       # missing .git/.../index)
#   python3 -m venv venv && venv/bin/pip install cmake ninja
#   cd src && PATH=/work/llama/venv/bin:$PATH
#   nice -n 19 cmake -S . -B build -G Ninja -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON \
#       -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VNNI=ON \
#       -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
#       # on a CPU without AVX-512 use -DGGML_AVX512=OFF and drop the two after it (with
#       # GGML_NATIVE=OFF the flags above decide the instructions the build uses)
#   nice -n 19 cmake --build build -j2 --target llama-bench llama-simple llama-completion llama-gguf
# Converter venv (torch is imported by every converter module; the PyPI wheel, since
# download.pytorch.org is not reachable here, pulls the CUDA libraries too):
#   /work/llama/venv/bin/pip install -e ./gguf-py "numpy~=2.2.6" "torch==2.11.0" \
#       "transformers==4.57.6" "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0"
# Convert (the slice has no real tokenizer; scripts/llama-convert-slice.py says why it
# swaps only the vocabulary step for the converter's own "no vocab" one):
#   nice -n 19 /work/llama/venv/bin/python scripts/llama-convert-slice.py /work/llama/src \
#       /work/bench/slice --outtype bf16 --outfile /work/bench/slice.gguf
#   # --outtype bf16 keeps the trunk BF16; the experts are repacked losslessly to ggml MXFP4
#   # (no requantisation). Check: python3 /work/llama/src/gguf-py/gguf/scripts/gguf_dump.py
# Result here: 13,754,897,952 bytes, 107 tensors: 51 BF16 (trunk, token_embd, output),
# 9 MXFP4 (ffn_{gate,up,down}_exps of layers 1-3, 64 experts each), 47 F32 (norms and other
# 1-D tensors, which the converter always writes as F32; ~8 MB). Smoke: llama-bench -t 2
# -p 4 -n 2 -r 1 runs (loaded machine, numbers meaningless). The cgroup part (b) has not
# been run yet: check its first run.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_BIN=${LLAMA_BIN:-/work/llama/src/build/bin}
GGUF=${GGUF:-/work/bench/slice.gguf}
WORK=${1:-/tmp/k3-bench-llama}
THREADS=${THREADS:-2}
PP=${PP:-16}
TG=${TG:-16}
REPS=${REPS:-5}
LIMIT_GB=${LIMIT_GB:-5.5}
CG_GEN=${CG_GEN:-8}
REPACK=${REPACK:-1 0}
S=${S:-8.88e9}
PARTS=${PARTS:-resident cgroup}
BENCH=$LLAMA_BIN/llama-bench

if [ ! -x "$BENCH" ]; then
    echo "llama-bench not found at $BENCH (see the build steps at the top of $0)" >&2
    exit 2
fi
if [ ! -f "$GGUF" ]; then
    echo "GGUF not found at $GGUF (see the convert step at the top of $0)" >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "bench-llama needs root (memory cgroups and drop_caches)" >&2
    exit 2
fi
mkdir -p "$WORK"
echo "== $(date -u +%FT%TZ)  cpus: $(nproc)  uptime: $(uptime)"
echo "llama-bench: $BENCH  gguf: $GGUF ($(stat -c %s "$GGUF") bytes)  threads: $THREADS  repack: $REPACK"

# s/token, bytes, etc. from one llama-bench JSON file: prints "<pp mean> <pp sd> <tg mean/token> <tg sd/token> <commit>"
summarize() {
    python3 - "$1" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
pp = next((r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0), None)
tg = next((r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0), None)
f = lambda x: f"{x:.4f}"
out = [f(pp["avg_ns"] / 1e9) if pp else "-", f(pp["stddev_ns"] / 1e9) if pp else "-",
       f(tg["avg_ns"] / 1e9 / tg["n_gen"]) if tg else "-",
       f(tg["stddev_ns"] / 1e9 / tg["n_gen"]) if tg else "-", rows[0].get("build_commit", "?")]
print(" ".join(out))
PY
}

for part in $PARTS; do
case $part in
resident)
    echo
    echo "-- (a) resident: mmap, warm page cache, -t $THREADS, pp$PP and tg$TG, $REPS reps"
    cat "$GGUF" > /dev/null
    printf '%-7s %12s %10s %12s %10s %10s  %s\n' repack "pp$PP s" sd "s/token" sd "GB/s" commit
    for rp in $REPACK; do
        "$BENCH" -m "$GGUF" -t "$THREADS" -p "$PP" -n 2 -r 1 --repack "$rp" -o json \
            > "$WORK/resident-warmup-r$rp.json" 2> "$WORK/resident-warmup-r$rp.log"
        "$BENCH" -m "$GGUF" -t "$THREADS" -p "$PP" -n "$TG" -r "$REPS" --repack "$rp" -o json \
            > "$WORK/resident-r$rp.json" 2> "$WORK/resident-r$rp.log"
        read -r ppm pps tgm tgs commit <<< "$(summarize "$WORK/resident-r$rp.json")"
        gbs=$(python3 -c "print(f'{$S / $tgm / 1e9:.1f}')")
        printf '%-7s %12s %10s %12s %10s %10s  %s\n' "$rp" "$ppm" "$pps" "$tgm" "$tgs" "$gbs" "$commit"
    done
    ;;
cgroup)
    echo
    echo "-- (b) inside a $LIMIT_GB GB memory cgroup, cold page cache, -t $THREADS, decode 1 vs 1+$CG_GEN tokens"
    # The cgroup nests under the one this script runs in (its limits still apply above), as
    # in scripts/bench-budget.sh.
    if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        CG=v2; BASE=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)
    else
        CG=v1; BASE=/sys/fs/cgroup/memory$(sed -n 's/^[0-9]*:memory://p' /proc/self/cgroup)
    fi
    CGD=$BASE/k3-llama-$LIMIT_GB
    LIMIT_B=$(python3 -c "print(int($LIMIT_GB * 1e9))")
    trap 'rmdir "$CGD" 2>/dev/null || true' EXIT
    make_cg() {
        rmdir "$CGD" 2>/dev/null || true
        mkdir -p "$CGD"
        if [ $CG = v2 ]; then
            echo "$LIMIT_B" > "$CGD/memory.max"
            echo 0 > "$CGD/memory.swap.max" 2>/dev/null || true
        else
            echo "$LIMIT_B" > "$CGD/memory.limit_in_bytes"
            echo "$LIMIT_B" > "$CGD/memory.memsw.limit_in_bytes" 2>/dev/null || true
        fi
    }
    peak_of() { if [ $CG = v2 ]; then cat "$CGD/memory.peak" 2>/dev/null || echo 0; else cat "$CGD/memory.max_usage_in_bytes"; fi; }
    DEV=$(basename "$(df --output=source "$GGUF" | tail -1)")
    devsec() { awk '{print $3}' "/sys/class/block/$DEV/stat" 2>/dev/null || echo 0; }
    echo "cgroup $CG: $CGD (limit $LIMIT_B bytes)  disk: $DEV"
    # one cold run decoding $1 tokens: prints "<tg seconds total> <read_bytes> <device bytes> <cg peak> <wall s> <rc>"
    cold_run() {
        local n=$1 rp=$2 tag=cg-r$2-n$1 rc d0 d1 w0 w1 rb
        make_cg
        sync; echo 3 > /proc/sys/vm/drop_caches
        d0=$(devsec); w0=$(date +%s.%N)
        set +e
        rb=$(
            echo $BASHPID > "$CGD/cgroup.procs" 2>/dev/null || echo $BASHPID > "$CGD/tasks"
            "$BENCH" -m "$GGUF" -t "$THREADS" -p 0 -n "$n" -r 1 --no-warmup --repack "$rp" -o json \
                > "$WORK/$tag.json" 2> "$WORK/$tag.log"
            r=$?
            # the reaped llama-bench's counters are now part of this subshell's
            while read -r k v; do [ "$k" = read_bytes: ] && echo "$v $r"; done < /proc/$BASHPID/io
        )
        set -e
        w1=$(date +%s.%N); d1=$(devsec)
        rc=${rb#* }; rb=${rb% *}
        local t=-
        [ "$rc" = 0 ] && t=$(python3 -c "import json; print(json.load(open('$WORK/$tag.json'))[0]['avg_ns'] / 1e9)")
        echo "$t $rb $(( (d1 - d0) * 512 )) $(peak_of) $(python3 -c "print(f'{$w1 - $w0:.1f}')") $rc"
        rmdir "$CGD" 2>/dev/null || true
    }
    printf '%-7s %9s %10s %12s %12s %10s %10s %8s  %s\n' repack "t[1] s" "s/token" "read/token" "dev/token" cg_peak_1 cg_peak_N wall_N exit
    for rp in $REPACK; do
        read -r t1 r1 dv1 p1 w1 rc1 <<< "$(cold_run 1 "$rp")"
        read -r tn rn dvn pn wn rcn <<< "$(cold_run $((1 + CG_GEN)) "$rp")"
        if [ "$rc1" = 0 ] && [ "$rcn" = 0 ]; then
            python3 - "$rp" "$t1" "$tn" "$r1" "$rn" "$dv1" "$dvn" "$p1" "$pn" "$wn" "$CG_GEN" <<'PY'
import sys
rp, t1, tn, r1, rn, dv1, dvn, p1, pn, wn, n = sys.argv[1:]
t1, tn, n = float(t1), float(tn), int(n)
spt = (tn - t1) / n
rpt = (int(rn) - int(r1)) / n
dpt = (int(dvn) - int(dv1)) / n
print(f"{rp:<7} {t1:>9.2f} {spt:>10.3f} {rpt/1e9:>10.3f}GB {dpt/1e9:>10.3f}GB "
      f"{int(p1)/1e9:>8.3f}GB {int(pn)/1e9:>8.3f}GB {float(wn):>8.1f}  0")
PY
        else
            printf '%-7s %9s %10s %12s %12s %10s %10s %8s  %s\n' "$rp" - - - - - - - \
                "$rc1/$rcn (see $WORK/cg-r$rp-n*.log)"
        fi
    done
    rmdir "$CGD" 2>/dev/null || true
    trap - EXIT
    ;;
*) echo "unknown part $part (resident, cgroup)" >&2; exit 2 ;;
esac
done
echo
echo "== $(date -u +%FT%TZ)  uptime: $(uptime)"
