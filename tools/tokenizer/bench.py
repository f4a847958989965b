#!/usr/bin/env python3
"""Encode-speed comparison: k3-tokenizer (Rust, examples/tok_bench.rs) vs pip tiktoken.

Same rank file (tests/fixtures/tokenizer), same text (corpus.py, default 2 MB), same run,
one thread each, specials off. tiktoken's time is `Encoding.encode_ordinary` on the whole
text; the ids are compared against the Rust ids with Kimi's guards applied (identical here:
the corpus has no 25k-char runs, and the guards only cut at 400k-char slice boundaries,
which the comparison uses too). Prints a table and the ratio.

Usage: python3 tools/tokenizer/bench.py [--mb 2] [--iters 5]
"""

import argparse
import base64
import os
import subprocess
import sys
import tempfile
import time

import tiktoken

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import corpus as corpus_mod  # noqa: E402
import kimi_pat  # noqa: E402


def load_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f.read().splitlines():
            if line.strip():
                tok, r = line.split()
                ranks[base64.b64decode(tok)] = int(r)
    return ranks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--tok", default=os.path.join(ROOT, "tests", "fixtures", "tokenizer"))
    a = ap.parse_args()
    text = corpus_mod.corpus(int(a.mb * 1e6), seed=3)
    data = text.encode("utf-8")
    ranks = load_ranks(os.path.join(a.tok, "tiktoken.model"))
    enc = tiktoken.Encoding("k3-bench", pat_str=kimi_pat.PAT_STR, mergeable_ranks=ranks, special_tokens=kimi_pat.special_tokens(len(ranks)))
    enc.encode_ordinary("warm up")
    times = []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        py_ids = enc.encode_ordinary(text)
        times.append(time.perf_counter() - t0)
    times.sort()
    mb = len(data) / 1e6
    kimi_ids = kimi_pat.kimi_encode(enc, text, False)

    env = dict(os.environ)
    env.setdefault("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "k3-tokenizer", "--example", "tok_bench"], cwd=ROOT, check=True, env=env)
    exe = os.path.join(env["CARGO_TARGET_DIR"], "release", "examples", "tok_bench")
    with tempfile.TemporaryDirectory() as tmp:
        tf = os.path.join(tmp, "corpus.txt")
        idf = os.path.join(tmp, "ids.txt")
        with open(tf, "wb") as f:
            f.write(data)
        out = subprocess.run([exe, "--tok", a.tok, "--file", tf, "--iters", str(a.iters), "--ids-out", idf], check=True, capture_output=True, text=True).stdout
        with open(idf) as f:
            rust_ids = [int(x) for x in f.read().split(",") if x]
    best = float(out.split("best ")[1].split(" MB/s")[0])
    median = float(out.split("median ")[1].split(" MB/s")[0])
    print(f"text: {mb:.3f} MB multilingual corpus, {len(ranks)} ranks, tiktoken {tiktoken.__version__}, 1 thread each")
    print(f"{'encoder':<26}{'best MB/s':>12}{'median MB/s':>14}{'ids':>10}")
    print(f"{'tiktoken encode_ordinary':<26}{mb / times[0]:>12.2f}{mb / times[len(times) // 2]:>14.2f}{len(py_ids):>10}")
    print(f"{'k3-tokenizer encode':<26}{best:>12.2f}{median:>14.2f}{len(rust_ids):>10}")
    print(f"ratio (k3 / tiktoken, best): {best / (mb / times[0]):.2f}x; median: {median / (mb / times[len(times) // 2]):.2f}x")
    print(out.strip())
    same = rust_ids == kimi_ids
    print(f"ids identical to tiktoken (Kimi guards): {same}; to plain encode_ordinary: {rust_ids == py_ids}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
