"""A long prompt's first token while streams decode beside it, per layout: issue 24 part 3 without a Poisson load.

    python -m bench.long_beside_streams [--layouts disaggregated,aggregated-512] [--streams 4] [--prompts 6]
                                        [--long-words 690]

For each layout (``bench.pd_vs_aggregated.layouts``: a fresh ``tandem up`` on the machine's first two cores),
``--streams`` clients each stream completions of 300 tokens (35-word prompts, ``ignore_eos``) back to back;
once they run, ``--prompts`` long prompts (``--long-words`` random words, ~2,000 tokens at 690) go one at a time,
each with ``max_tokens`` 2, 1.5 s apart. The table gives the long prompts' TTFT median and, over the seconds those
prompts were being computed, the streams' inter-token gaps (p50, p99, max): what the split and the aggregated
worker each trade. For a split whose prefill worker borrows the decode core, a second table says, over the same
seconds (the workers' metrics before and after each prompt), how the core was shared: the share of the prefill
worker's layer seconds that ran on both cores, the seconds decode lent per second of those prompts, how much of
that the borrower used, and the mean wait of a decode step for a borrowed layer. With ``--env NAME=VALUE`` (repeatable) every process of the cluster gets that variable
(a ``TANDEM_*`` setting for an experiment). The streams' client shares the two cores with the server.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.cluster import MODEL, TandemUp
from bench.pd_vs_aggregated import layouts
from bench.report import metric_samples

WORDS = "alpha beta gamma delta river stone cloud paper light green music table window garden".split()


def words(seed: int, n: int) -> str:
    """``n`` random words with numbers: distinct per seed, so no prompt hits another's cached prefix."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(n))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Streams:
    """``n`` clients streaming completions back to back; the gaps between their tokens while `recording`."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.stopped, self.recording = url, False, False
        self.gaps: list[float] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(n)]
        for t in self.threads:
            t.start()

    def _client(self, k: int) -> None:
        i = 0
        while not self.stopped:
            i += 1
            body = {"model": MODEL, "prompt": words(1000 * k + i, 35), "max_tokens": 300, "stream": True,
                    "ignore_eos": True}
            last = None
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            now = time.perf_counter()
                            if last is not None and self.recording:
                                self.gaps.append(now - last)
                            last = now
            except httpx.HTTPError as e:
                self.failures.append(f"stream {k}: {e!r}")
                return

    def stop(self) -> None:
        self.stopped = True
        for t in self.threads:
            t.join(timeout=150)


def first_token_s(url: str, prompt: str) -> float:
    """Seconds from sending a streamed completion of ``prompt`` to its first event."""
    t0 = time.perf_counter()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without an event")


LENDING = {("tandem_worker_layer_seconds_total", "own"): "own_s", ("tandem_worker_layer_seconds_total", "borrowed"):
           "borrowed_s", ("tandem_decode_lent_seconds_total", None): "lent_s",
           ("tandem_decode_take_wait_seconds_sum", None): "wait_s",
           ("tandem_decode_take_wait_seconds_count", None): "waits"}


def lending(ports: list[int]) -> dict[str, float]:
    """The workers' lending counters now, summed over ``ports`` (their metrics endpoints)."""
    totals = dict.fromkeys(LENDING.values(), 0.0)
    for port in ports:
        for s in metric_samples(f"http://127.0.0.1:{port}/metrics"):
            key = LENDING.get((s.name, s.labels.get("cores")))
            if key:
                totals[key] += s.value
    return totals


def measure(up_args: list[str], args: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    up = TandemUp(Path(tempfile.mkdtemp(prefix="long-beside-")), "--quiet", *up_args, env=env).start()
    try:
        url = up.url
        tokens = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": words(-1, args.long_words),
                                                           "max_tokens": 1}, timeout=120).json()["usage"]
        streams = Streams(url, args.streams)
        time.sleep(3.0)
        ports = [c["metrics_port"] for c in up.info["children"]
                 if c["role"] in ("prefill_only", "decode_only") and c["metrics_port"]]
        ttfts, shared = [], dict.fromkeys(LENDING.values(), 0.0)
        for i in range(args.prompts):
            before = lending(ports)
            streams.recording = True
            ttfts.append(first_token_s(url, words(i, args.long_words)))
            streams.recording = False
            for key, value in lending(ports).items():
                shared[key] += value - before[key]
            time.sleep(1.5)
        streams.stop()
        if streams.failures:
            raise RuntimeError("; ".join(streams.failures))
        gaps = streams.gaps
        return {"prompt_tokens": tokens["prompt_tokens"], "ttft_ms": 1000 * statistics.median(ttfts),
                "gap_p50_ms": 1000 * quantile(gaps, 0.5), "gap_p99_ms": 1000 * quantile(gaps, 0.99),
                "gap_max_ms": 1000 * max(gaps, default=float("nan")), "gaps": len(gaps),
                "prompts_s": sum(ttfts), **shared}
    finally:
        up.child.stop(30)


def table(results: dict[str, dict[str, float]]) -> str:
    """Markdown rows, each layout's TTFT also as a ratio to the last layout's (the aggregated reference)."""
    ref = list(results.values())[-1]["ttft_ms"]
    rows = ["| layout | long prompt (tokens) | TTFT median | vs last | streams' gap p50 | p99 | max |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        gaps = (f"{r['gap_p50_ms']:.1f} ms | {r['gap_p99_ms']:.0f} ms | {r['gap_max_ms']:.0f} ms" if r["gaps"]
                else "- | - | -")
        rows.append(f"| {name} | {r['prompt_tokens']} | {r['ttft_ms']:,.0f} ms | {r['ttft_ms'] / ref:.2f}x | {gaps} |")
    return "\n".join(rows)


def lending_table(results: dict[str, dict[str, float]]) -> str:
    """Markdown rows of how the layouts whose prefill worker borrowed shared the decode core ('' if none did)."""
    rows = ["| layout | layer seconds on both cores | decode lent (s per prompt second) | of that, borrowed | "
            "a step's wait for a borrowed layer (mean) |", "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        if r["borrowed_s"] > 0:
            rows.append(f"| {name} | {r['borrowed_s'] / (r['borrowed_s'] + r['own_s']):.0%} | "
                        f"{r['lent_s'] / r['prompts_s']:.2f} | {r['borrowed_s'] / max(r['lent_s'], 1e-9):.0%} | "
                        f"{1000 * r['wait_s'] / max(r['waits'], 1):.1f} ms |")
    return "\n".join(rows) if len(rows) > 2 else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.long_beside_streams", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="disaggregated,aggregated-512",
                   help="from bench.pd_vs_aggregated's (default disaggregated,aggregated-512; the last is the ratios' "
                        "reference)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--long-words", type=int, default=690, help="words of each long prompt (690: ~2,000 tokens)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.streams < 0 or args.long_words < 1:
        p.error("--prompts and --long-words must be at least 1, --streams at least 0")
    known = layouts()
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    if unknown := [n for n in names if n not in known]:
        p.error(f"unknown layouts {unknown}; known: {sorted(known)}")
    if bad := [e for e in args.env if "=" not in e]:
        p.error(f"--env wants NAME=VALUE, got {bad}")
    env = dict(e.split("=", 1) for e in args.env)
    results = {}
    for name in names:
        print(f"== {name}: tandem up {' '.join(known[name])}", file=sys.stderr, flush=True)
        results[name] = measure(known[name], args, {**os.environ, **env})
    print(table(results))
    if shared := lending_table(results):
        print("\n" + shared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
