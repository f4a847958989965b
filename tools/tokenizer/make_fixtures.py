#!/usr/bin/env python3
"""Build the tokenizer parity fixtures under tests/fixtures/tokenizer/ (the oracle).

1. Assemble a multilingual corpus (corpus.py), pre-split it with a simple word rule and train
   a small byte-level BPE on it; ranks = merge order after the 256 single bytes (cl100k byte
   order: "!" = 0, "a" = 64, "\\n" = 198, " " = 220), plus a few adversarial entries (whole
   tokens whose sub-merges are absent, an invalid-UTF-8 token). Written as tiktoken.model.
2. Write tokenizer_config.json with K3's 16 named specials at ids n_ranks + offset.
3. Build >= 200 cases and their expected ids from pip `tiktoken` (tiktoken.Encoding with the
   Kimi pat_str and all 256 specials) wrapped in Kimi's long-input guards (kimi_pat.py).
   Byte cases (invalid UTF-8) are written to a file and read back, then split with Python's
   UTF-8 decoder: valid runs as text, each invalid run as one BPE piece (tiktoken's
   `_encode_single_piece`).

Usage: python3 tools/tokenizer/make_fixtures.py [OUT_DIR]   (needs `pip install tiktoken`)
Not needed by `cargo test`: the outputs are committed.
"""

import base64
import collections
import hashlib
import heapq
import json
import os
import random
import re
import sys
import tempfile

import tiktoken

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus as corpus_mod  # noqa: E402
import kimi_pat  # noqa: E402
import chat_cases  # noqa: E402

N_MERGES = 3000
TRAIN_BYTES = 400_000


def byte_order():
    """cl100k / GPT-2 single-byte rank order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    rest = [b for b in range(256) if b not in bs]
    return bs + rest


def train_bpe(text, n_merges):
    """Plain byte-level BPE: repeatedly merge the most frequent adjacent pair (ties: smallest
    pair of token bytes). Returns the list of merged tokens (bytes) in merge order."""
    words = collections.Counter(re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    vocab = [bytes([b]) for b in range(256)]
    seqs = [list(w.encode("utf-8")) for w in words]
    freqs = list(words.values())
    pair_count = collections.Counter()
    where = collections.defaultdict(set)
    for wi, s in enumerate(seqs):
        for a, b in zip(s, s[1:]):
            pair_count[(a, b)] += freqs[wi]
            where[(a, b)].add(wi)

    def key(p):
        return (-pair_count[p], vocab[p[0]] + vocab[p[1]])

    heap = [(key(p), p) for p in pair_count]
    heapq.heapify(heap)
    merged = []
    seen = set(vocab)
    while len(merged) < n_merges and heap:
        k, p = heapq.heappop(heap)
        if pair_count.get(p, 0) <= 0 or k != key(p):
            continue
        new_bytes = vocab[p[0]] + vocab[p[1]]
        new_id = len(vocab)
        vocab.append(new_bytes)
        if new_bytes not in seen:
            seen.add(new_bytes)
            merged.append(new_bytes)
        touched = set()
        for wi in list(where[p]):
            s = seqs[wi]
            f = freqs[wi]
            for a, b in zip(s, s[1:]):
                pair_count[(a, b)] -= f
                touched.add((a, b))
            out = []
            i = 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == p[0] and s[i + 1] == p[1]:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[wi] = out
            for a, b in zip(out, out[1:]):
                pair_count[(a, b)] += f
                where[(a, b)].add(wi)
                touched.add((a, b))
        for q in touched:
            if pair_count.get(q, 0) > 0:
                heapq.heappush(heap, (key(q), q))
    return merged


def build_ranks(text):
    ranks = {}
    for b in byte_order():
        ranks[bytes([b])] = len(ranks)
    for tok in train_bpe(text, N_MERGES):
        if tok not in ranks:
            ranks[tok] = len(ranks)
    # Adversarial entries: whole pre-tokens whose intermediate merges are absent (reachable
    # only through tiktoken's "whole piece is a token" lookup), and an invalid-UTF-8 token.
    for extra in [b" zyxwvut", b"qqqqqqqq", "\u6f22\u5b57\u6f22".encode(), b"\xff\xfe", b"\xe4\xb8", b"!!!!"]:
        if extra not in ranks:
            ranks[extra] = len(ranks)
    return ranks


def write_rank_file(path, ranks):
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {r}\n")


def cases(n_ranks, rng, corpus_text):
    """(name, kind, allow_special, input) where input is str (kind text) or bytes."""
    out = []

    def t(name, s, allow=True):
        out.append((name, "text", allow, s))

    def b(name, data, allow=True):
        out.append((name, "bytes", allow, data))

    # Spec 5.2 reference strings.
    for i, s in enumerate(["Hello world", "Hello, world!", "你好世界", "1234567890", "中文English混合", "a", " ", "\n\n\n", "[BOS][EOS]", "<|end_of_msg|> literal special token usage", ""]):
        t(f"spec_ref_{i}", s, True)
        t(f"spec_ref_{i}_nospecial", s, False)
    # Every corpus snippet.
    for pi, pool in enumerate(corpus_mod.POOLS):
        for si, s in enumerate(pool):
            t(f"snippet_{pi}_{si}", s)
    # Mixed-case contractions.
    for s in ["I'M here", "You'RE right", "they'Ve gone", "it'S", "WE'LL see", "he'D", "'s'S'", "don't DON'T DoN'T",
              "o'clock", "rock'n'roll", "'tis", "x'sy", "ǅ'S", "ÉTÉ'S été's", "Straße'LL", "I'm", "'M", " 'LL", "A'", "abc'D'd",
              "Привет's", "中文's", "1's", "foo’s curly"]:
        t(f"contraction_{s!r}", s)
    # Han / Latin / other boundaries.
    for s in ["中文abc", "abc中文", "A中B", "中A", "中1", "1中", "漢字カタカナ", "中。文", "中 文", " 中文", "中\n文", "a中b中c",
              "〇一二三", "々", "⺀⺁ radicals", "中e\u0301", "Ab中Cd", "中ABC", "ABC中", "中ǅ", "中ʰ", "ｶﾀｶﾅ中", "中😀", "😀中",
              "한국어中文日本語", "ﾞ中", "𠀀𠀁 ext-b"]:
        t(f"boundary_{s!r}", s)
    # Digit runs.
    for k in list(range(1, 13)) + [16, 25, 40]:
        t(f"digits_{k}", "".join(str((i * 7 + 3) % 10) for i in range(k)))
    for s in ["١٢٣٤٥", "Ⅻ roman", "½ ¾", "123abc456", "3.14159", "1,000,000", "v1.2.3", "x12345y", "٣4٥6", "²³", "0000000"]:
        t(f"numeric_{s!r}", s)
    # Trailing / leading whitespace.
    for s in ["a ", "a  ", "a   \n", "x\t ", "   ", "\n \n ", "a \r\n ", "end\n\n \n", " ", "  ", "\t", "\r", "\r\n",
              "\r\n\r\n", "\r\r\n\n", " \r\n", "\u00a0\u00a0x", "\u3000中", "a\u2003 b", "x \u00a0", "  \n\n  x", "a\n ", "\x0b\x0c",
              "\x1c\x1d split", "tab\tend\t"]:
        t(f"space_{s!r}", s)
    # Marks and unusual letters.
    for s in ["e\u0301", "\u0301abc", "\u0301", " \u0301", "Ǆǅǆ", "ʰa", "a\u0308B", "ABCdef", "abcDEF", "ΑΒΓαβγ", "ǅa", "ǅA",
              "ﬁ ligature", "x\u200dy", "\u200b", "\ufeffbom", "a\u0300\u0301\u0302"]:
        t(f"marks_{s!r}", s)
    # Specials, allowed and not.
    names = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", f"<|reserved_token_{n_ranks + 10}|>", "[PAD]"]
    for s in ["[BOS]hello[EOS]", "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>",
              f"x<|reserved_token_{n_ranks + 10}|>y", f"<|reserved_token_{n_ranks + 300}|>", "<|open|", "[BOS", "[[BOS]]", "<|<|sep|>|>",
              " [EOS] ", "[BOS][BOS][BOS]", "<osagent_mode>on"]:
        t(f"special_{s!r}", s, True)
        t(f"special_{s!r}_off", s, False)
    for nm in names:
        t(f"special_name_{nm}", nm, True)
    # Emoji.
    for s in ["👨\u200d👩\u200d👧", "🏳️\u200d🌈", "👍🏽👍🏿", "🇯🇵", "a😀b", "😀😀😀", "1️⃣"]:
        t(f"emoji_{s!r}", s)
    # Repeats (leftmost tie-breaking inside one piece).
    for s in ["aaaa", "aaaaa", "aaaaaaa", "ababab", "!!!!!", "!!!!!!!", "qqqqqqqq", "qqqqqqqqq", " zyxwvut", "zyxwvut", "漢字漢", "漢字漢字"]:
        t(f"repeat_{s!r}", s)
    # Corpus windows.
    for i in range(60):
        n = rng.randint(1, 400)
        st = rng.randint(0, len(corpus_text) - n)
        t(f"window_{i}", corpus_text[st : st + n])
    # Random strings from a pool of classes.
    pool = list("aZé\u0301ǅʰ中文カ한Я١2 \t\n\r\u00a0'!.,😀\u200d") + ["'s", "'LL", "[BOS]", "<|sep|>"]
    for i in range(40):
        s = "".join(rng.choice(pool) for _ in range(rng.randint(1, 30)))
        t(f"random_{i}", s, rng.random() < 0.5)
    # Invalid UTF-8 (byte path, read back from a file).
    for i, data in enumerate([b"\xff", b"abc\xffdef", b"\xe4\xb8", b"\xe4\xb8\xad\xe4", b"\xc0\x80", b"\xed\xa0\x80",
                              b"\xf4\x90\x80\x80", b"\xff\xfe", b"\xff\xfe\xff", b"Hi \xff\xfe there", b"\x80\x80\x80",
                              "中".encode()[:2] + "文".encode(), b"[BOS]\xff[EOS]", b"\xf0\x9f\x98", b" \xe4\xb8  \n\xff",
                              b"caf\xe9 latin-1", b"\xef\xbb\xbf BOM ok"]):
        b(f"bytes_{i}", data, True)
    for i in range(15):
        data = bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 60)))
        b(f"bytes_random_{i}", data, rng.random() < 0.5)
    return out


def long_cases():
    """Inputs too large to store: generated from (unit, times, prefix, suffix) on both sides."""
    return [
        ("long_alpha_run", {"unit": "a", "times": 25_001}, True),
        ("long_alpha_run_exact", {"unit": "b", "times": 25_000}, True),
        ("long_space_run", {"unit": " ", "times": 30_000, "suffix": "x"}, True),
        ("long_mixed_nonspace", {"unit": "ab中", "times": 9_000}, True),
        ("long_slice_special", {"unit": " a", "times": 199_999, "suffix": "[BOS] b"}, True),
        ("long_slice_words", {"unit": "word ", "times": 90_000}, False),
    ]


def gen_input(g):
    return g.get("prefix", "") + g["unit"] * g["times"] + g.get("suffix", "")


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "tokenizer")
    os.makedirs(out_dir, exist_ok=True)
    text = corpus_mod.corpus(TRAIN_BYTES, seed=1)
    ranks = build_ranks(text)
    n = len(ranks)
    write_rank_file(os.path.join(out_dir, "tiktoken.model"), ranks)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(kimi_pat.tokenizer_config(n), f, indent=2, ensure_ascii=False)
        f.write("\n")
    enc = tiktoken.Encoding("k3-test", pat_str=kimi_pat.PAT_STR, mergeable_ranks=ranks, special_tokens=kimi_pat.special_tokens(n))
    rng = random.Random(7)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kind, allow, inp in cases(n, rng, corpus_mod.corpus(50_000, seed=2)):
            if kind == "text":
                data = inp.encode("utf-8")
                ids = kimi_pat.kimi_encode(enc, inp, allow)
            else:
                p = os.path.join(tmp, "case.bin")
                with open(p, "wb") as f:
                    f.write(inp)
                with open(p, "rb") as f:
                    data = f.read()
                ids = kimi_pat.kimi_encode_bytes(enc, data, allow)
            assert enc.decode_bytes(ids) == data, name
            rows.append({"name": name, "kind": kind, "allow_special": allow, "input_b64": base64.b64encode(data).decode(), "ids": ids})
        for name, g, allow in long_cases():
            s = gen_input(g)
            ids = kimi_pat.kimi_encode(enc, s, allow)
            joined = ",".join(map(str, ids)).encode()
            rows.append({"name": name, "kind": "text", "allow_special": allow, "gen": g, "n_ids": len(ids), "ids_sha256": hashlib.sha256(joined).hexdigest()})
    with open(os.path.join(out_dir, "cases.jsonl"), "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=True) + "\n")
    with open(os.path.join(out_dir, "chat_cases.jsonl"), "w", encoding="utf-8", newline="\n") as f:
        for name, request, segments in chat_cases.CASES:
            ids = []
            for text, allow in segments:
                ids.extend(kimi_pat.kimi_encode(enc, text, allow))
            f.write(json.dumps({"name": name, "request": request, "segments": segments, "ids": ids}, ensure_ascii=True) + "\n")
    meta = {"n_ranks": n, "n_cases": len(rows), "n_chat_cases": len(chat_cases.CASES), "tiktoken_version": tiktoken.__version__, "pat_str": kimi_pat.PAT_STR}
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"wrote {len(rows)} cases, {n} ranks, tiktoken {tiktoken.__version__} -> {out_dir}")


if __name__ == "__main__":
    main()
