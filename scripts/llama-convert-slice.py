#!/usr/bin/env python3
"""Convert the synthetic Kimi K3 slice to GGUF with llama.cpp's own converter.

    python3 scripts/llama-convert-slice.py LLAMA_SRC SLICE_DIR --outtype bf16 --outfile OUT.gguf

LLAMA_SRC is a llama.cpp source tree (convert_hf_to_gguf.py, conversion/, gguf-py/); every
argument after it goes to convert_hf_to_gguf.py unchanged. Nothing of llama.cpp is copied
here: this imports the converter and replaces one step before running it.

Why a wrapper: the slice (`k3-orch synth --shape slice`) has random weights and no real
tokenizer. llama.cpp's Kimi K3 converter takes its vocabulary from the Hugging Face
tokenizer (transformers AutoTokenizer with trust_remote_code, then a hash of its output
must match the released "kimi-k2" pre-tokenizer), which a synthetic tiktoken.model cannot
satisfy. Speed does not depend on the vocabulary's strings, only on its size, which the
converter writes anyway from config.json (`kimi-k3.vocab_size` = 163840, so token_embd and
output keep the released 163840 rows). So the vocabulary step is replaced by the
converter's own `_set_vocab_none` (tokenizer.ggml.model = "none"); llama.cpp then creates
163840 dummy tokens, and llama-bench feeds random token ids, as it always does. Everything
else (tensor mapping, the kv_b split, the residual fusions, the lossless MXFP4 repack of
the experts, BF16 passthrough of the trunk with --outtype bf16) is the unmodified converter.
Such a GGUF cannot tokenize text: use llama-bench, not llama-cli with a text prompt.
"""
import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    src = Path(sys.argv.pop(1)).resolve()
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        sys.exit(f"{script} not found")
    sys.path.insert(0, str(src))
    sys.path.insert(1, str(src / "gguf-py"))

    from conversion import kimi_k3  # the converter's module, the same object it registers

    kimi_k3.KimiK3Model.set_vocab = lambda self: self._set_vocab_none()
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
