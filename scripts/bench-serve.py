#!/usr/bin/env python3
"""Load generator for `k3-orch serve` (issue 33): N concurrent streaming clients.

    python3 scripts/bench-serve.py --base-url http://127.0.0.1:8080/v1 \\
        --clients 4 --requests 16 [--seed 1] [--prompt-tokens 8:64] [--max-tokens 16:64] \\
        [--model k3] [--api-key KEY] [--chat] [--json FILE] [--timeout S]

`--clients` clients share `--requests` requests (each client takes the next one when its
last ends). Each request's prompt length and max_tokens are drawn from a seeded
distribution (uniform in the given MIN:MAX ranges, `--seed`), so two runs with the same
flags send the same requests. Prompts are token ids to /v1/completions (lengths exact, any
vocabulary) unless `--chat` sends words to /v1/chat/completions. Every request streams.

Prints, per client and overall: requests done and failed, generated tokens, the time to
first token (TTFT) and the inter-token time (ITL) at p50 and p95; and the aggregate decode
rate (every generated token over the wall time from the first request to the last
answer). Failures are listed with their messages. Exit 0 when every request succeeded,
1 otherwise. Needs the `openai` package (`pip install openai`).

This measures; it does not judge. Speed numbers belong in docs/measurements.md with
`uptime` from a quiet machine.
"""
import argparse
import asyncio
import json
import random
import sys
import time


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_n, hi_n = int(lo), int(hi or lo)
    if lo_n < 1 or hi_n < lo_n:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN:MAX with 1 <= MIN <= MAX")
    return lo_n, hi_n


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def plan_requests(args: argparse.Namespace) -> list[dict]:
    """The seeded requests: prompt (ids or words) and max_tokens."""
    rng = random.Random(args.seed)
    words = "the sea ships sailors storms harbour wind night light stars map".split()
    out = []
    for i in range(args.requests):
        n = rng.randint(*args.prompt_tokens)
        m = rng.randint(*args.max_tokens)
        if args.chat:
            prompt = " ".join(rng.choice(words) for _ in range(n))
        else:
            prompt = [rng.randrange(1, args.vocab) for _ in range(n)]
        out.append({"index": i, "prompt": prompt, "max_tokens": m})
    return out


async def one_request(client, args, req: dict) -> dict:
    """Stream one request; its TTFT, inter-token times, tokens, or its error."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    try:
        if args.chat:
            stream = await client.chat.completions.create(
                model=args.model,
                messages=[{"role": "user", "content": req["prompt"]}],
                max_tokens=req["max_tokens"],
                stream=True,
            )
        else:
            stream = await client.completions.create(
                model=args.model,
                prompt=req["prompt"],
                max_tokens=req["max_tokens"],
                stream=True,
            )
        async for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            text = c.delta.content if args.chat else c.text
            if text:
                stamps.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
        return {"index": req["index"], "error": f"{type(e).__name__}: {e}"}
    if not stamps:
        return {"index": req["index"], "error": "no token arrived"}
    return {
        "index": req["index"],
        "ttft": stamps[0] - t0,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        # Text pieces, not ids: a piece held back (a split UTF-8 character) joins the next.
        "tokens": len(stamps),
        "end": stamps[-1],
    }


async def client_loop(cid: int, client, args, queue: asyncio.Queue, results: list) -> None:
    while True:
        try:
            req = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        r = await one_request(client, args, req)
        r["client"] = cid
        results.append(r)


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    return {
        "requests": len(rows),
        "failed": len(rows) - len(ok),
        "tokens": sum(r["tokens"] for r in ok),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p95": percentile(ttft, 0.95),
        "itl_p50": percentile(itl, 0.5),
        "itl_p95": percentile(itl, 0.95),
    }


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--model", default="k3")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=parse_range, default=(8, 64))
    ap.add_argument("--max-tokens", type=parse_range, default=(16, 64))
    ap.add_argument("--vocab", type=int, default=1000, help="ids are drawn below this (default 1000)")
    ap.add_argument("--chat", action="store_true", help="words to /v1/chat/completions")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if args.clients < 1 or args.requests < 1:
        ap.error("--clients and --requests must be at least 1")
    try:
        from openai import AsyncOpenAI
    except ImportError:
        print("bench-serve: needs the openai package (pip install openai)", file=sys.stderr)
        return 2
    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, timeout=args.timeout, max_retries=0)
    queue: asyncio.Queue = asyncio.Queue()
    for r in plan_requests(args):
        queue.put_nowait(r)
    results: list[dict] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(c, client, args, queue, results) for c in range(args.clients)))
    wall = time.perf_counter() - t0
    await client.close()
    overall = summarize(results)
    overall["seconds"] = wall
    overall["tokens_per_second"] = overall["tokens"] / wall if wall > 0 else 0.0
    per_client = {c: summarize([r for r in results if r["client"] == c]) for c in range(args.clients)}
    print(f"{args.clients} clients, {args.requests} requests (seed {args.seed}) against {args.base_url}")
    print(f"{'client':>8} {'done':>5} {'failed':>6} {'tokens':>7} {'TTFT p50':>10} {'TTFT p95':>10} {'ITL p50':>10} {'ITL p95':>10}")
    for c, s in list(per_client.items()) + [("all", overall)]:
        print(
            f"{c:>8} {s['requests'] - s['failed']:>5} {s['failed']:>6} {s['tokens']:>7} "
            f"{ms(s['ttft_p50']):>10} {ms(s['ttft_p95']):>10} {ms(s['itl_p50']):>10} {ms(s['itl_p95']):>10}"
        )
    print(f"aggregate: {overall['tokens']} tokens in {wall:.2f} s = {overall['tokens_per_second']:.2f} tokens/s")
    failures = sorted((r for r in results if "error" in r), key=lambda r: r["index"])
    for r in failures:
        print(f"FAILED request {r['index']} (client {r['client']}): {r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overall": overall, "clients": per_client, "failures": failures}, f, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
