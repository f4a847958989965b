#!/usr/bin/env bash
# Benchmark `k3-orch pack-trunk` against a plain copy of the same bytes, in the same run.
#
#   scripts/bench-pack-trunk.sh [SLICE_DIR] [WORK_DIR]
#
# SLICE_DIR (default /tmp/k3-slice) is synthesised with `k3-orch synth --shape slice` when it
# holds no config.json (4 layers x 64 experts at the released per-layer dimensions, ~9.3 GB)
# and reused otherwise. WORK_DIR (default /tmp/k3-bench-pack) receives the trunk and the copy
# and is removed at the end. Page caches are dropped before each timed step when we may
# (root); otherwise the script says so, and the numbers include cached reads.
#
# The plain copy reads exactly the byte ranges pack-trunk copies (from trunk.json: shard,
# source_offset, length per layer) with dd (8 MiB blocks) into one file at the same offsets,
# then fsyncs it, as pack-trunk does. Environment: K3 = path of k3-orch
# (default target/release/k3-orch), KEEP=1 keeps WORK_DIR.
set -euo pipefail

K3=${K3:-target/release/k3-orch}
SLICE=${1:-/tmp/k3-slice}
WORK=${2:-/tmp/k3-bench-pack}

if [ ! -x "$K3" ]; then
    echo "k3-orch not found at $K3 (build with: cargo build --release -p k3-orch)" >&2
    exit 2
fi

drop_caches() {
    sync
    if [ -w /proc/sys/vm/drop_caches ]; then
        echo 3 > /proc/sys/vm/drop_caches
        echo "(page cache dropped)"
    else
        echo "(cannot drop the page cache: not root; numbers include cached reads)"
    fi
}

now() { date +%s.%N; }

if [ ! -f "$SLICE/config.json" ]; then
    echo "== synthesising the slice into $SLICE"
    t0=$(now)
    "$K3" synth --shape slice "$SLICE"
    t1=$(now)
    bytes=$(du -sb "$SLICE" | cut -f1)
    awk -v b="$bytes" -v a="$t0" -v z="$t1" \
        'BEGIN { printf "synth: %.2f GB in %.1f s (%.0f MB/s)\n", b/1e9, z-a, b/1e6/(z-a) }'
else
    echo "== reusing the slice in $SLICE"
fi

rm -rf "$WORK"
mkdir -p "$WORK"

echo "== pack-trunk"
drop_caches
t0=$(now)
"$K3" pack-trunk "$SLICE" "$WORK/trunk"
t1=$(now)
pack_s=$(awk -v a="$t0" -v z="$t1" 'BEGIN { print z-a }')
total=$(sed -n 's/^  "total_bytes": \([0-9]*\),$/\1/p' "$WORK/trunk/trunk.json")

# Layer runs: shard, source_offset, length, in layer order (layer-level keys only; tensor
# entries use "len" and have no "shard").
sed -n 's/^      "\(shard\|source_offset\|length\|offset\)": "\{0,1\}\([^",]*\)"\{0,1\},$/\1 \2/p' \
    "$WORK/trunk/trunk.json" > "$WORK/runs.txt"

echo "== plain copy of the same byte ranges (dd, 8 MiB blocks, fsync)"
drop_caches
t0=$(now)
awk '
    $1 == "offset" { off = $2 }
    $1 == "length" { len = $2 }
    $1 == "shard" { shard = $2 }
    $1 == "source_offset" { print shard, $2, len, off }
' "$WORK/runs.txt" | while read -r shard src len dst; do
    dd if="$SLICE/$shard" of="$WORK/copy.bin" bs=8M iflag=skip_bytes,count_bytes \
        oflag=seek_bytes skip="$src" count="$len" seek="$dst" conv=notrunc status=none
done
sync -f "$WORK/copy.bin" 2>/dev/null || sync
t1=$(now)
cp_s=$(awk -v a="$t0" -v z="$t1" 'BEGIN { print z-a }')
copied=$(awk '$1 == "length" { s += $2 } END { print s }' "$WORK/runs.txt")

echo
echo "== result ($(date -u +%FT%TZ), $(nproc) CPUs)"
awk -v b="$total" -v p="$pack_s" -v c="$cp_s" -v cb="$copied" 'BEGIN {
    printf "  pack-trunk : %.2f GB in %6.2f s = %6.0f MB/s\n", b/1e9, p, b/1e6/p
    printf "  dd copy    : %.2f GB in %6.2f s = %6.0f MB/s\n", cb/1e9, c, cb/1e6/c
    printf "  ratio      : pack-trunk runs at %.0f%% of the plain copy\n", 100*c/p
}'

"$K3" pack-trunk "$SLICE" "$WORK/trunk" --verify | tail -1

if [ "${KEEP:-0}" != 1 ]; then
    rm -rf "$WORK"
fi
