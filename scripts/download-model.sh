#!/usr/bin/env bash
# Fetch the released Kimi K3 checkpoint into DIR and verify it:
#
#   scripts/download-model.sh [--trunk-dir TRUNK_DIR] [--no-space-check] DIR [REPO]
#
# REPO defaults to moonshotai/Kimi-K3. Before anything is fetched the script checks free
# space: the release (1,560,936,091,448 bytes) less what DIR already holds, plus the packed
# trunk `k3-orch pack-trunk` writes next (109 GB) on TRUNK_DIR's file system (default: next
# to DIR, the same file system). Too little is refused (exit 2) with the numbers.
#
# Runs `hf download REPO --local-dir DIR` (huggingface_hub), which resumes: after an
# interruption run the same command again. When the `hf` command is missing it installs
# huggingface_hub into a virtual environment under DIR (DIR/.hf-venv; never `pip install
# --user`, which PEP 668 forbids on Debian 12 and Ubuntu 24.04), needing python3 with its
# venv module (Debian: apt install python3-venv). A token for gated access is read from
# HF_TOKEN in the environment by `hf` itself; this script never prints it. Then
# `k3-orch verify --hashes DIR` checks every shard's size against the release table and its
# sha256 against the hub's download metadata (DIR/.cache/huggingface/download/*.metadata).
#
# Environment: K3 (the k3-orch command; default k3-orch on PATH, else target/release/k3-orch,
# else cargo run). Exit status: 2 for usage or too little space, else that of the first
# failing step.
set -euo pipefail

RELEASE_BYTES=1560936091448
PACK_BYTES=109000000000

usage() {
    echo "usage: $0 [--trunk-dir TRUNK_DIR] [--no-space-check] DIR [REPO]" >&2
    exit 2
}

trunk_dir=
check_space=1
while [[ $# -gt 0 && "$1" == -* ]]; do
    case "$1" in
        --trunk-dir) [[ $# -ge 2 ]] || usage; trunk_dir=$2; shift 2 ;;
        --no-space-check) check_space=0; shift ;;
        *) usage ;;
    esac
done
if [[ $# -lt 1 || $# -gt 2 ]]; then
    usage
fi
dir=$1
repo=${2:-moonshotai/Kimi-K3}

# Bytes as TB/GB for the messages.
human() {
    awk -v b="$1" 'BEGIN { if (b >= 1e12) printf "%.2f TB", b / 1e12; else printf "%.1f GB", b / 1e9 }'
}

# The nearest existing directory at or above a path (df needs one).
existing() {
    local p=$1
    while [[ ! -d "$p" ]]; do
        p=$(dirname -- "$p")
    done
    printf '%s\n' "$p"
}

# Free bytes and the device of the file system holding a path.
free_bytes() { df -P -B1 -- "$(existing "$1")" | awk 'NR == 2 { print $4 }'; }
device_of() { df -P -B1 -- "$(existing "$1")" | awk 'NR == 2 { print $1 }'; }

if [[ $check_space == 1 ]]; then
    have=0
    if [[ -d "$dir" ]]; then
        have=$(du -s -B1 -- "$dir" 2>/dev/null | awk '{ print $1 }')
    fi
    need=$((RELEASE_BYTES > have ? RELEASE_BYTES - have : 0))
    tdir=${trunk_dir:-$dir}
    if [[ "$(device_of "$tdir")" == "$(device_of "$dir")" ]]; then
        need=$((need + PACK_BYTES))
        free=$(free_bytes "$dir")
        if ((free < need)); then
            echo "download-model.sh: REFUSING: $dir needs $(human "$need") free (the release $(human "$RELEASE_BYTES")" \
                 "less $(human "$have") already there, plus $(human "$PACK_BYTES") for the packed trunk)," \
                 "and its file system has $(human "$free") free." >&2
            echo "Free space, put the release on a larger drive, or pack the trunk on another one" \
                 "(--trunk-dir DIR2). --no-space-check skips this check." >&2
            exit 2
        fi
    else
        free=$(free_bytes "$dir")
        if ((free < need)); then
            echo "download-model.sh: REFUSING: $dir needs $(human "$need") free (the release $(human "$RELEASE_BYTES")" \
                 "less $(human "$have") already there), and its file system has $(human "$free") free." >&2
            exit 2
        fi
        tfree=$(free_bytes "$tdir")
        if ((tfree < PACK_BYTES)); then
            echo "download-model.sh: REFUSING: the packed trunk needs $(human "$PACK_BYTES") free on $tdir's" \
                 "file system, which has $(human "$tfree") free." >&2
            exit 2
        fi
    fi
    echo "free space: enough for the release and the packed trunk" >&2
fi

mkdir -p -- "$dir"
hf=(hf)
if ! command -v hf >/dev/null 2>&1; then
    venv="$dir/.hf-venv"
    if [[ ! -x "$venv/bin/hf" ]]; then
        echo "hf (huggingface_hub) not found: installing it into $venv" >&2
        if ! python3 -m venv -- "$venv"; then
            echo "download-model.sh: cannot create a virtual environment with python3 -m venv" \
                 "(Debian/Ubuntu: apt install python3-venv), or install hf yourself" \
                 "(pipx install 'huggingface_hub[cli]')" >&2
            exit 1
        fi
        "$venv/bin/pip" install --quiet --upgrade 'huggingface_hub[cli]>=0.34' >&2
    fi
    hf=("$venv/bin/hf")
fi
if [[ -n "${HF_TOKEN:-}" ]]; then
    echo "using the token in HF_TOKEN" >&2
fi

# Resumable: files already complete are skipped, partial ones continue.
"${hf[@]}" download "$repo" --local-dir "$dir"

here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n "${K3:-}" ]]; then
    read -r -a k3 <<<"$K3"
elif command -v k3-orch >/dev/null 2>&1; then
    k3=(k3-orch)
elif [[ -x "$here/target/release/k3-orch" ]]; then
    k3=("$here/target/release/k3-orch")
else
    k3=(cargo run --release --manifest-path "$here/Cargo.toml" -p k3-orch --)
fi
"${k3[@]}" verify --hashes "$dir"
