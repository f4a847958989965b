"""Kimi K3's pre-tokenizer pattern, special-token layout and long-input guards (spec section 5).

Shared by the oracle (`make_fixtures.py`) and the benchmark (`bench.py`). This module is the
Python side of the parity contract: it drives pip `tiktoken` exactly the way Kimi's
`tokenization_kimi.py` does, so the ids it produces are the reference the Rust crate
`k3-tokenizer` must reproduce byte for byte.
"""

import codecs

# Spec section 5.2, alternatives joined with "|" (tiktoken / fancy-regex syntax; `&&` is
# character-class intersection).
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Named special slots of K3 (offset from the first special id = number of ranks).
K3_NAMED = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
NUM_SPECIAL = 256

TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def special_tokens(n_ranks):
    """All 256 slots: named ones from K3_NAMED, the rest `<|reserved_token_<id>|>`."""
    out = {}
    for k in range(NUM_SPECIAL):
        i = n_ranks + k
        out[K3_NAMED.get(k, f"<|reserved_token_{i}|>")] = i
    return out


def tokenizer_config(n_ranks):
    """A tokenizer_config.json with K3's 16 named entries at ids relative to n_ranks."""
    dec = {}
    for k, name in sorted(K3_NAMED.items()):
        dec[str(n_ranks + k)] = {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": name not in ("<|open|>", "<|close|>", "<|sep|>"),
        }
    return {
        "added_tokens_decoder": dec,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer",
    }


def _split_ws_runs(s, max_len):
    """Kimi's guard: cut runs of more than max_len consecutive (non-)whitespace chars."""
    cur_len = 0
    cur_space = s[0].isspace() if s else False
    start = 0
    for i in range(len(s)):
        now_space = s[i].isspace()
        if cur_space ^ now_space:
            cur_len = 1
            cur_space = now_space
        else:
            cur_len += 1
            if cur_len > max_len:
                yield s[start:i]
                start = i
                cur_len = 1
    yield s[start:]


def kimi_encode(enc, text, allow_special):
    """tokenization_kimi.py's encode: 400k-char slices, 25k-run splits, then tiktoken."""
    allowed = "all" if allow_special else set()
    ids = []
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        for sub in _split_ws_runs(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS):
            ids.extend(enc.encode(sub, allowed_special=allowed, disallowed_special=()))
    return ids


def utf8_chunks(data):
    """Split bytes into ('text', str) and ('bytes', b) runs using Python's own UTF-8 decoder
    error ranges (maximal subparts), independently of Rust's `utf8_chunks`."""
    errors = []

    def record(exc):
        errors.append((exc.start, exc.end))
        return ("", exc.end)

    name = "k3_record_errors"
    try:
        codecs.lookup_error(name)
    except LookupError:
        pass
    codecs.register_error(name, record)
    data.decode("utf-8", errors=name)
    out = []
    pos = 0
    for s, e in errors:
        if s > pos:
            out.append(("text", data[pos:s].decode("utf-8")))
        out.append(("bytes", data[s:e]))
        pos = e
    if pos < len(data):
        out.append(("text", data[pos:].decode("utf-8")))
    return out


def kimi_encode_bytes(enc, data, allow_special):
    """The byte path: valid UTF-8 runs as text, each invalid run as one BPE piece."""
    ids = []
    for kind, part in utf8_chunks(data):
        if kind == "text":
            ids.extend(kimi_encode(enc, part, allow_special))
        else:
            ids.extend(enc._encode_single_piece(part))
    return ids
