#!/usr/bin/env bash
# Fetch the released Kimi K3 checkpoint into DIR and verify it:
#
#   scripts/download-model.sh DIR [REPO]        (REPO default moonshotai/Kimi-K3)
#
# Runs `hf download REPO --local-dir DIR` (huggingface_hub; resumable: re-run it after an
# interruption), installing huggingface_hub with pip when the `hf` command is missing. A
# token for gated access is read from HF_TOKEN in the environment by `hf` itself; this
# script never prints it. Then `k3-orch verify --hashes DIR` checks every shard's size
# against the release table and its sha256 against the hub's download metadata
# (DIR/.cache/huggingface/download/*.metadata). Exit status: that of the first failing step.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || "$1" == -* ]]; then
    echo "usage: $0 DIR [REPO]" >&2
    exit 2
fi
dir=$1
repo=${2:-moonshotai/Kimi-K3}

if ! command -v hf >/dev/null 2>&1; then
    echo "hf (huggingface_hub) not found: installing it with pip" >&2
    python3 -m pip install --user --upgrade 'huggingface_hub[cli]>=0.34' >&2
    export PATH="$HOME/.local/bin:$PATH"
fi
if [[ -n "${HF_TOKEN:-}" ]]; then
    echo "using the token in HF_TOKEN" >&2
fi

mkdir -p -- "$dir"
hf download "$repo" --local-dir "$dir"

here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
if command -v k3-orch >/dev/null 2>&1; then
    k3=(k3-orch)
elif [[ -x "$here/target/release/k3-orch" ]]; then
    k3=("$here/target/release/k3-orch")
else
    k3=(cargo run --release --manifest-path "$here/Cargo.toml" -p k3-orch --)
fi
"${k3[@]}" verify --hashes "$dir"
