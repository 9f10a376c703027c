"""Load generator: streaming chat completions against a running gateway (or a `tandem up` it starts).

    python -m bench.serve [--url http://127.0.0.1:8000] [--concurrency 1 4 16] [--write]
    python -m bench.serve --step-tokens 512 128 [--rounds 2] [--write]

Each request is a ~255-token chat prompt with 64 output tokens (ignore_eos), as in the peer
figures of DESIGN §6. Reports output tok/s, TTFT p50/p99 and ITL p50 per concurrency level,
after a warm-up. Without --url it starts `tandem up` (disaggregated: 1 prefill + 1 decode, and
with --aggregated one prefill_and_decode worker) on free ports and stops it afterwards.

--step-tokens compares engine step token budgets (`--max-step-tokens`, how many prompt tokens
one step may compute next to the running decodes) on an aggregated worker: the budgets take
turns for --rounds rounds and the table shows each figure's median over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.cluster import TandemUp

MODEL = "smollm2-135m-instruct"
FILLER = ("Tandem serves language models with prefill and decode on separate workers that talk over "
          "a message bus. ")


def prompt(i: int) -> str:
    # ~255 tokens after the chat template; the leading number keeps prompts distinct (no shared prefix
    # beyond the system prompt).
    return f"Request {i}. " + FILLER * 11 + "Summarize the text above in one paragraph."


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt(i)}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
            if d.get("choices") and d["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                stamps.append(now)
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": (first or end) - t0, "gaps": gaps, "tokens": tokens, "start": t0, "end": end}


async def level(url: str, concurrency: int, requests: int, max_tokens: int, offset: int) -> dict:
    async with httpx.AsyncClient() as client:
        sem = asyncio.Semaphore(concurrency)

        async def run(i: int) -> dict:
            async with sem:
                return await one(client, url, offset + i, max_tokens)

        t0 = time.perf_counter()
        res = await asyncio.gather(*[run(i) for i in range(requests)])
        wall = time.perf_counter() - t0
    gaps = [g for r in res for g in r["gaps"]]
    return {
        "concurrency": concurrency, "requests": requests,
        "output_tok_s": sum(r["tokens"] for r in res) / wall,
        "ttft_p50": percentile([r["ttft"] for r in res], 0.5), "ttft_p99": percentile([r["ttft"] for r in res], 0.99),
        "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99),
    }


def start_up(aggregated: bool, log_dir: Path, env: dict[str, str] | None = None) -> TandemUp:
    """`tandem up` (disaggregated, or one aggregated worker) on free ports, ready."""
    args = ["--quiet"] + (["--aggregated", "--decode", "1"] if aggregated else [])
    return TandemUp(log_dir, *args, env=env).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.serve", description=__doc__)
    p.add_argument("--url", default=None)
    p.add_argument("--aggregated", action="store_true")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--write", action="store_true")
    p.add_argument("--step-tokens", type=int, nargs="+", default=None,
                   help="compare these engine step token budgets (aggregated worker)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if args.step_tokens:
        return compare_step_budgets(args)
    rows = run_levels(args, args.url) if args.url else measure(args, args.aggregated)
    mode = "external gateway" if args.url else ("aggregated (1 prefill_and_decode)" if args.aggregated
                                                else "disaggregated (1 prefill_only + 1 decode_only)")
    lines = [f"### Serving: {mode}", "",
             f"`python -m bench.serve{' --aggregated' if args.aggregated else ''}`: streaming chat, ~255 prompt "
             f"tokens, {args.max_tokens} output tokens, greedy, {os.cpu_count()} cores, one machine.", "",
             "| concurrency | requests | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['concurrency']} | {r['requests']} | {r['output_tok_s']:.1f} | {r['ttft_p50']:.2f} s | "
              f"{r['ttft_p99']:.2f} s | {r['itl_p50'] * 1000:.0f} ms | {r['itl_p99'] * 1000:.0f} ms |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        from bench.report import write_section

        write_section("serve-aggregated" if args.aggregated else "serve-disagg", text)
    return 0


def run_levels(args: argparse.Namespace, url: str) -> list[dict]:
    """Warm up, then every concurrency level against the gateway at ``url``."""
    asyncio.run(level(url, 2, 4, 16, 10_000))
    rows = []
    for i, c in enumerate(args.concurrency):
        rows.append(asyncio.run(level(url, c, max(2 * c, 4), args.max_tokens, 1000 * (i + 1))))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def measure(args: argparse.Namespace, aggregated: bool, env: dict[str, str] | None = None) -> list[dict]:
    """Start `tandem up`, run every concurrency level against it, stop it."""
    up = start_up(aggregated, Path(tempfile.mkdtemp(prefix="tandem-serve-")), env)
    try:
        return run_levels(args, up.url)
    finally:
        up.stop(60)


def compare_step_budgets(args: argparse.Namespace) -> int:
    runs: dict[tuple[int, int], list[dict]] = {}
    for r in range(args.rounds):
        for budget in args.step_tokens:
            print(f"round {r}, max_step_tokens {budget}", flush=True)
            for row in measure(args, True, {"TANDEM_MAX_STEP_TOKENS": str(budget)}):
                runs.setdefault((budget, row["concurrency"]), []).append(row)

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(x[key] for x in rows)

    lines = ["### Serving: step token budget (aggregated)", "",
             f"`python -m bench.serve --step-tokens {' '.join(map(str, args.step_tokens))} --rounds {args.rounds}`: "
             f"one prefill_and_decode worker, ~255 prompt tokens, {args.max_tokens} output tokens; the budgets "
             f"took turns, medians of {args.rounds} rounds, {os.cpu_count()} cores.", "",
             "| max step tokens | concurrency | output tok/s | TTFT p50 | ITL p50 | ITL p99 |",
             "|---:|---:|---:|---:|---:|---:|"]
    for (budget, c), rows in sorted(runs.items(), key=lambda kv: (kv[0][1], -kv[0][0])):
        lines.append(f"| {budget} | {c} | {med(rows, 'output_tok_s'):.1f} | {med(rows, 'ttft_p50'):.2f} s | "
                     f"{med(rows, 'itl_p50') * 1000:.0f} ms | {med(rows, 'itl_p99') * 1000:.0f} ms |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        from bench.report import write_section

        write_section("serve-step-budget", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
