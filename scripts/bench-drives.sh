#!/usr/bin/env bash
# Experts over one drive against several (issue 35): DRIVES (2) block devices backed by files (loop
# devices with direct I/O, each under a dm-linear target when dmsetup works), each with an
# ext4 file system, each throttled to the same read rate with the cgroup v1
# `blkio.throttle.read_bps_device` of the cgroup the runs are started in. The routed
# experts are packed (`pack-experts`) once over device A alone and once over A and B, then
# the same `--mem-gb` run reads them with `--experts`; printed per run: s/token (whole run,
# and the mean of the decode steps after the first, which loads the pinned trunk and runs
# the prompt),
# totals.disk_busy (the busiest watched disk's busy seconds per decode step, and its share
# of the step time; the time a read waits in the throttle is not busy time) and the ids,
# which must be identical. The backing files sit on the local disk, which the --trunk and
# the lm_head stream from as well: where those streams are large (--mem-gb 5.5 on the
# slice) the devices share that disk's bandwidth. With FAIL_RUN=1 a third run over
# A and B has B's table swapped for a dm `error` target FAIL_AFTER seconds into the run:
# it must exit 4, naming the device.
#
# The layouts: "one" (every expert on device A), "two" (striped round-robin over the
# DRIVES devices: A and B, or A to D) and, with MIRROR=1, "mirror" (`pack-experts --copies
# 2` over the same devices: every expert on two of them, each read from the less busy)
# and, with SPLIT=1, "split" (`pack-experts --split` over the same devices: every expert
# cut into one page-aligned part a device, each read from all of them at once).
#
# With TRUNK_COPIES=1 the layouts are the trunk's instead: "tone" (the TRUNK directory
# copied onto device A, --trunk A/trunk) and "ttwo" (copied onto every device, --trunk
# A/trunk,B/trunk...: the trunk-loader reads each unit's 8 MiB pieces from the copies in
# turn); the routed experts come from the model's shards on the unthrottled disk, and the
# lm_head streams from there too. Needs TRUNK.
#
# With WHOLE=1 everything a token reads but the lm_head moves with the drives: "wone"
# (the trunk copied onto A and the experts packed on A) against "wmirror" (the trunk
# copied onto every device, --trunk A/trunk,B/trunk..., and the experts in two copies over
# them, as MIRROR=1's). Needs TRUNK. A coded TRUNK (`pack-trunk --codec`) carries the
# lm_head coded, and EXTRA="--lm-head-read coded" moves the lm_head with the drives too.
#
# BASE=BINARY (another k3-orch build) runs every layout with it as well, just before the
# same layout with K3, in the same round: "NAME-base" beside "NAME", ids checked alike.
#
# ROUNDS=N alternates the layouts N times (one, two[, mirror], one, ...) over the same packs.
# After the runs, `k3-orch project` is asked for each layout, in the throttled cgroup (so
# its drive probes read at the throttled rate, 3 s each) with the same --mem-gb, --experts
# and the trunk as its probe file: its predicted decode s/token, the experts' part of it
# and the busiest drive's share (`stripe_balance`) print beside the measured decode steps.
#
#   sudo scripts/bench-drives.sh
#   sudo MODEL=tests/fixtures/tiny-mxfp4/sharded N=2 FAIL_RUN=1 FAIL_AFTER=0 \
#        scripts/bench-drives.sh          # smoke test on the tiny model
#
# Environment: MODEL (default $SLICE, default /work/bench/slice, made when missing with
# `k3-orch synth --shape slice --vocab 163840 --seed 7`), N (tokens, default 8), IDS
# (prompt ids, default 77,198,74), K3 (a k3-orch binary; default target/release/k3-orch,
# built first), MEM_GB (default 5.5), TRUNK (a `pack-trunk` directory
# on the unthrottled disk, given as --trunk: a 5.5 GB run of the slice needs one), RATE_MB (per device, default
# 400), EXTRA (more flags for every run, split on spaces: e.g. EXTRA="--cache-gb 0.8424"
# for a 48-slot arena), WORK (backing files and mounts, default /var/tmp/k3-bench-drives: needs about 2x
# the model's size, sparse, 3x with MIRROR=1; NAME.json reports and NAME.ids stay there),
# DRIVES (2, 3 or 4 devices for the striped and mirror layouts), MIRROR (0), SPLIT (0), FAIL_RUN (0),
# FAIL_AFTER (seconds, default 10; 0 swaps before the run starts). Needs root, loop devices, mkfs.ext4, jq, and the cgroup v1 blkio
# controller. Only meaningful on a quiet machine: `uptime` is printed at start and end.
# Everything it sets up is torn down on exit (trap), also after a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "bench-drives.sh: needs root (loop devices, mounts, blkio cgroups)" >&2
  exit 2
fi
SLICE=${SLICE:-/work/bench/slice}
MODEL=${MODEL:-$SLICE}
N=${N:-8}
IDS=${IDS:-77,198,74}
MEM_GB=${MEM_GB:-5.5}
TRUNK=${TRUNK:-}
RATE_MB=${RATE_MB:-400}
WORK=${WORK:-/var/tmp/k3-bench-drives}
FAIL_RUN=${FAIL_RUN:-0}
FAIL_AFTER=${FAIL_AFTER:-10}
ROUNDS=${ROUNDS:-1}
MIRROR=${MIRROR:-0}
SPLIT=${SPLIT:-0}
DRIVES=${DRIVES:-2}
TRUNK_COPIES=${TRUNK_COPIES:-0}
WHOLE=${WHOLE:-0}
[ "$WHOLE" = 1 ] && MIRROR=1
[[ "$DRIVES" =~ ^[2-4]$ ]] || { echo "bench-drives.sh: DRIVES=$DRIVES: 2, 3 or 4" >&2; exit 2; }
NAMES=(a b c d)
NAMES=("${NAMES[@]:0:$DRIVES}")
LAYOUTS=(one two)
[ "$MIRROR" = 1 ] && LAYOUTS+=(mirror)
[ "$SPLIT" = 1 ] && LAYOUTS+=(split)
if [ "$TRUNK_COPIES" = 1 ] || [ "$WHOLE" = 1 ]; then
  [ -n "$TRUNK" ] || { echo "bench-drives.sh: TRUNK_COPIES=1 and WHOLE=1 need TRUNK" >&2; exit 2; }
fi
[ "$TRUNK_COPIES" = 1 ] && LAYOUTS=(tone ttwo)
[ "$WHOLE" = 1 ] && LAYOUTS=(wone wmirror)
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "bench-drives.sh: ROUNDS=$ROUNDS is not a positive whole number" >&2; exit 2; }
BLKIO=/sys/fs/cgroup/blkio
CG=$BLKIO/k3-bench-drives-$$
BIN=${K3:-target/release/k3-orch}
BASE=${BASE:-}
[ -z "$BASE" ] || [ -x "$BASE" ] || { echo "bench-drives.sh: BASE=$BASE is not an executable" >&2; exit 2; }

[ -d "$BLKIO" ] || { echo "bench-drives.sh: no cgroup v1 blkio controller at $BLKIO" >&2; exit 2; }
for t in losetup mkfs.ext4 jq; do
  command -v "$t" > /dev/null || { echo "bench-drives.sh: $t is missing" >&2; exit 2; }
done
[ -n "${K3:-}" ] || cargo build --release -q -p k3-orch
if [ ! -f "$MODEL/config.json" ]; then
  if [ "$MODEL" = "$SLICE" ]; then
    "$BIN" synth --shape slice --vocab 163840 --seed 7 "$SLICE"
  else
    echo "bench-drives.sh: $MODEL is not a model directory" >&2
    exit 2
  fi
fi

LOOPS=()
DMS=()
MOUNTS=()
teardown() {
  set +e
  for m in "${MOUNTS[@]}"; do umount "$m" 2> /dev/null || umount -l "$m"; done
  for d in "${DMS[@]}"; do dmsetup remove --retry "$d" 2> /dev/null; done
  for l in "${LOOPS[@]}"; do losetup -d "$l"; done
  if [ -d "$CG" ]; then
    # Leave the cgroup before removing it.
    echo $$ > "$BLKIO/cgroup.procs" 2> /dev/null
    rmdir "$CG"
  fi
  # Only what this script made: the backing files and the mount points (the reports and
  # ids stay in $WORK).
  for n in a b c d; do rm -f "$WORK/$n.img"; done
  for m in "${MOUNTS[@]}"; do rmdir "$m" 2> /dev/null; done
}
trap teardown EXIT
trap 'exit 130' INT TERM

echo "== uptime (start): $(uptime)"
echo "== cpu: $(lscpu 2> /dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs"
mkdir -p "$WORK"
MODEL_BYTES=$(du -sbL "$MODEL" | cut -f1)
USE_DM=0
if command -v dmsetup > /dev/null && dmsetup version > /dev/null 2>&1; then USE_DM=1; fi

# make_dev NAME BYTES: a file-backed device with ext4 mounted at $WORK/NAME; sets DEV to
# the device node the reads go through (the dm target when there is one, else the loop).
# Not in a $(...) subshell: the teardown lists must keep what it sets up.
make_dev() {
  local name=$1 bytes=$(( ($2 + 1048575) / 1048576 * 1048576 )) loop dev
  truncate -s "$bytes" "$WORK/$name.img"
  loop=$(losetup --direct-io=on --find --show "$WORK/$name.img")
  [ -n "$loop" ] || { echo "bench-drives.sh: losetup failed" >&2; exit 1; }
  LOOPS+=("$loop")
  dev=$loop
  if [ "$USE_DM" = 1 ]; then
    dmsetup create "k3bd-$$-$name" --table "0 $(blockdev --getsz "$loop") linear $loop 0"
    DMS+=("k3bd-$$-$name")
    dev=/dev/mapper/k3bd-$$-$name
  fi
  mkfs.ext4 -q -F "$dev"
  mkdir -p "$WORK/$name"
  mount "$dev" "$WORK/$name"
  MOUNTS+=("$WORK/$name")
  DEV=$dev
}
# Device A holds the one-drive pack and its share of the striped one; the others their
# shares; with MIRROR=1 each also holds its share of two copies, with SPLIT=1 its parts (sizes are sparse files'
# upper bounds: the model's size stands for its experts').
SLACK=$((512 << 20))
DEVS=()
TRUNK_BYTES=0
if [ "$TRUNK_COPIES" = 1 ] || [ "$WHOLE" = 1 ]; then
  TRUNK_BYTES=$(du -sbL "$TRUNK" | cut -f1)
fi
for n in "${NAMES[@]}"; do
  share=$((MODEL_BYTES * (1 + 2 * MIRROR + SPLIT) / DRIVES + TRUNK_BYTES))
  [ "$n" = a ] && share=$((share + MODEL_BYTES))
  make_dev "$n" $((share + SLACK))
  DEVS+=("$DEV")
done

mkdir "$CG"
RATE=$((RATE_MB * 1000 * 1000))
for dev in "${DEVS[@]}"; do
  majmin=$(lsblk -dno MAJ:MIN "$(readlink -f "$dev")" | tr -d ' ')
  echo "$majmin $RATE" > "$CG/blkio.throttle.read_bps_device"
done
echo "== devices: ${DEVS[*]} (A to ${NAMES[-1]^^}), each throttled to $RATE_MB MB/s (cgroup $CG)"

# over LAYOUT: the layout's directory on every device.
over() { for n in "${NAMES[@]}"; do echo "$WORK/$n/$1"; done; }
if [ "$TRUNK_COPIES" = 1 ] || [ "$WHOLE" = 1 ]; then
  for n in "${NAMES[@]}"; do cp -r "$TRUNK" "$WORK/$n/trunk"; done
fi
if [ "$WHOLE" = 1 ]; then
  mkdir -p "$WORK/a/one"
  "$BIN" pack-experts "$MODEL" --to "$WORK/a/one"
elif [ "$TRUNK_COPIES" != 1 ]; then
  mkdir -p "$WORK/a/one" $(over two)
  "$BIN" pack-experts "$MODEL" --to "$WORK/a/one"
  # shellcheck disable=SC2046 # one directory per line, no spaces in $WORK.
  "$BIN" pack-experts "$MODEL" --to $(over two)
fi
if [ "$MIRROR" = 1 ] && [ "$TRUNK_COPIES" != 1 ]; then
  mkdir -p $(over mirror)
  # shellcheck disable=SC2046
  "$BIN" pack-experts "$MODEL" --copies 2 --to $(over mirror)
fi
if [ "$SPLIT" = 1 ] && [ "$TRUNK_COPIES" != 1 ] && [ "$WHOLE" != 1 ]; then
  mkdir -p $(over split)
  # shellcheck disable=SC2046
  "$BIN" pack-experts "$MODEL" --split --to $(over split)
fi
# dirs LAYOUT: its --experts directories.
dirs() {
  case $1 in
    one | wone) echo "$WORK/a/one" ;;
    wmirror) over mirror | paste -sd, ;;
    tone | ttwo) echo "" ;;
    *) over "$1" | paste -sd, ;;
  esac
}
# trunk LAYOUT: its --trunk (TRUNK, or the copies on the devices).
trunk() {
  case $1 in
    tone | wone) echo "$WORK/a/trunk" ;;
    ttwo | wmirror) over trunk | paste -sd, ;;
    *) echo "$TRUNK" ;;
  esac
}

# run NAME DIRS: one throttled run (in $CG) over the pack in DIRS; its ids go to NAME.ids.
run() {
  sync
  echo 3 > /proc/sys/vm/drop_caches
  sh -c 'echo $$ > "$0/cgroup.procs"; shift; exec "$@"' "$CG" _ \
    "${RUN_BIN:-$BIN}" "$MODEL" --ids "$IDS" --gen "$N" --mem-gb "$MEM_GB" ${2:+--experts "$2"} \
    ${3:+--trunk "$3"} ${EXTRA:-} --out "$WORK/$1.json" --quiet > "$WORK/$1.ids"
}
report() { # NAME
  jq -r --arg n "$1" '.totals as $t | ([.steps[1:][].seconds] | if length > 0 then add / length else null end) as $d
    | "\($n): \($t.s_per_token | . * 1000 | round / 1000) s/token (decode steps \(if $d then $d * 1000 | round / 1000 else "-" end)), "
    + (if $t.disk_busy then "disk busy \(($t.disk_busy.busy_seconds / ([$t.disk_busy.steps, 1] | max)) * 1000 | round / 1000) s/step "
    + "(\(($t.disk_busy.busy_share * 100) | round)% of the step time, \($t.disk_busy.devices))" else "no disk watched" end)
    + ", experts read \($t.expert_read_bytes / 1e9 * 100 | round / 100) GB"' "$WORK/$1.json"
}
# Round r's runs are named one, two, mirror (round 1) and one-r, two-r, mirror-r.
sfx() { if [ "$1" -gt 1 ]; then echo "-$1"; fi; }
for r in $(seq 1 "$ROUNDS"); do
  for l in "${LAYOUTS[@]}"; do
    if [ -n "$BASE" ]; then
      RUN_BIN=$BASE run "$l-base$(sfx "$r")" "$(dirs "$l")" "$(trunk "$l")"
    fi
    run "$l$(sfx "$r")" "$(dirs "$l")" "$(trunk "$l")"
  done
done
echo "== results ($N tokens, --mem-gb $MEM_GB, $DRIVES devices at $RATE_MB MB/s each, $ROUNDS round(s))"
decode() { jq '[.steps[1:][].seconds] | if length > 0 then add / length else 0 end' "$WORK/$1.json"; }
for r in $(seq 1 "$ROUNDS"); do
  o=${LAYOUTS[0]}$(sfx "$r")
  report "$o"
  S1=$(jq .totals.s_per_token "$WORK/$o.json")
  D1=$(decode "$o")
  for l in "${LAYOUTS[@]:1}"; do
    t=$l$(sfx "$r")
    report "$t"
    S2=$(jq .totals.s_per_token "$WORK/$t.json")
    D2=$(decode "$t")
    echo "speedup $l/${LAYOUTS[0]}, round $r: $(echo "$S1 $S2" | awk '{ printf "%.2fx", $1 / $2 }') (whole run: the first step loads the pinned trunk and runs the prompt), decode steps $(echo "$D1 $D2" | awk '{ printf "%.2fx", ($2 > 0 ? $1 / $2 : 0) }')"
  done
  if [ -n "$BASE" ]; then
    for l in "${LAYOUTS[@]}"; do
      b=$l-base$(sfx "$r")
      report "$b"
      echo "  $l: base decode steps $(decode "$b" | awk '{ printf "%.3f", $1 }') s, K3 $(decode "$l$(sfx "$r")" | awk '{ printf "%.3f", $1 }') s"
    done
  fi
  for l in "${LAYOUTS[@]}"; do
    for x in "$l$(sfx "$r")" ${BASE:+"$l-base$(sfx "$r")"}; do
      if ! cmp -s "$WORK/${LAYOUTS[0]}.ids" "$WORK/$x.ids"; then
        echo "ids DIFFER ($x against ${LAYOUTS[0]}):"; cat "$WORK/${LAYOUTS[0]}.ids" "$WORK/$x.ids"
        exit 1
      fi
    done
  done
done
echo "ids: identical in every run ($(tr '\n' ' ' < "$WORK/${LAYOUTS[0]}.ids"))"
# project NAME DIRS: the projection for one layout, in the throttled cgroup.
project() {
  sh -c 'echo $$ > "$0/cgroup.procs"; shift; exec "$@"' "$CG" _ \
    "$BIN" project "$MODEL" --ram-gb "$MEM_GB" --experts "$2" \
    ${TRUNK:+--probe-file "$TRUNK/trunk.bin"} --seconds 3 --json | head -1 > "$WORK/$1.project.json"
  jq -r --arg n "$1" --argjson d "$(decode "$1")" '"projected \($n): \(.s_per_token * 1000 | round / 1000) s/token against \($d * 1000 | round / 1000) measured (\(($d / .s_per_token) * 100 | round / 100)x); experts \(.expert_disk_s * 1000 | round / 1000) s of it, the busiest drive \(.stripe_balance * 100 | round / 100)x its share; floor \(.floor)"' "$WORK/$1.project.json"
}
if [ "$TRUNK_COPIES" = 1 ] || [ "$WHOLE" = 1 ]; then
  echo "== not projected: the trunk's copies and the experts sit on devices of other rates"
else
  for l in "${LAYOUTS[@]}"; do
    project "$l" "$(dirs "$l")" || echo "projected $l: project failed"
  done
fi

if [ "$FAIL_RUN" = 1 ]; then
  if [ "$USE_DM" != 1 ]; then
    echo "== fail run skipped: dmsetup does not work here"
  else
    name=k3bd-$$-b
    sectors=$(blockdev --getsz "/dev/mapper/$name")
    fail_b() { dmsetup suspend --noflush "$name"; dmsetup load "$name" --table "0 $sectors error"; dmsetup resume "$name"; }
    [ "$FAIL_AFTER" = 0 ] && fail_b
    set +e
    run fail "$(dirs two)" 2> "$WORK/fail.err" &
    pid=$!
    if [ "$FAIL_AFTER" != 0 ]; then sleep "$FAIL_AFTER"; fail_b; fi
    wait "$pid"
    code=$?
    set -e
    echo "== fail run (device B swapped for a dm error target): exit $code"
    grep -m3 -i "device" "$WORK/fail.err" || true
    [ "$code" = 4 ] || { echo "expected exit 4"; cat "$WORK/fail.err"; exit 1; }
  fi
fi
echo "== uptime (end): $(uptime)"
