"""A step in load against ``tandem up --autoscale``: how fast it scales up, what that does to TTFT, and back.

    python -m bench.autoscale [--low 1 --high 8] [--low-seconds 40 --high-seconds 90 --tail-seconds 50] [--write]

One ``tandem up --autoscale prefill=0..2,decode=1..2`` on this machine (placement as ``tandem up``
chooses it); closed-loop streaming chats with long prompts, first ``--low`` at a time, then
``--high`` at a time, then none. Every ``--sample`` seconds it reads the scaler's own metrics
(``tandem_autoscale_demand``, ``tandem_autoscale_workers``). It reports the time from the step to
the first scale-up, TTFT (median) at the low level, in the step before the first new worker, and
after the last one was up, errors, and when the scaler was back at the minimum; it draws demand,
workers and each request's TTFT over time into docs/autoscale.png. ``--write`` puts the section
into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.cluster import MODEL, TandemUp
from bench.report import BENCH_DOC, metric_samples, write_section

FILLER = "Tandem serves language models with prefill and decode on separate workers over a message bus. "
ROLES = ("prefill", "decode")


def scaler_sample(url: str) -> dict[str, float]:
    """``demand.<role>`` and ``workers.<role>`` from the scaler's /metrics."""
    out: dict[str, float] = {}
    for s in metric_samples(url, timeout=5):
        if s.name in ("tandem_autoscale_demand", "tandem_autoscale_workers"):
            out[f"{s.name.rsplit('_', 1)[1]}.{s.labels['role']}"] = s.value
    return out


async def chat(client: httpx.AsyncClient, url: str, i: int, repeats: int, max_tokens: int, t0: float) -> dict:
    """One streaming chat: start (s since t0), TTFT, outcome."""
    body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {i}. " + FILLER * repeats + "Summarize it."}]}
    start = time.monotonic()
    out: dict[str, Any] = {"start": start - t0, "ttft": None, "outcome": "completed"}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                out["outcome"] = str(r.status_code)
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    out["outcome"] = f"error {d['error'].get('code')}"
                elif out["ttft"] is None and d["choices"] and d["choices"][0]["delta"].get("content"):
                    out["ttft"] = time.monotonic() - start
    except httpx.HTTPError as e:
        out["outcome"] = f"client {type(e).__name__}"
    return out


async def load(url: str, args: argparse.Namespace, t0: float) -> list[dict[str, Any]]:
    """``--low`` closed-loop clients, then ``--high``, then none."""
    results: list[dict[str, Any]] = []
    counter = iter(range(1_000_000))

    async def client_loop(client: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            results.append(await chat(client, url, next(counter), args.prompt_repeats, args.max_tokens, t0))

    async with httpx.AsyncClient(timeout=600) as client:
        low_end = time.monotonic() + args.low_seconds
        high_end = low_end + args.high_seconds
        low = [asyncio.create_task(client_loop(client, low_end)) for _ in range(args.low)]
        await asyncio.sleep(max(0.0, low_end - time.monotonic()))
        high = [asyncio.create_task(client_loop(client, high_end)) for _ in range(args.high - args.low)]
        await asyncio.gather(*low, *high)
    return results


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fmt(x: float | None, unit: str = " s") -> str:
    return "—" if x is None else f"{x:.2f}{unit}"


def plot(samples: list[dict[str, float]], results: list[dict[str, Any]], step: float, out: Path) -> str:
    """Demand, workers and TTFT over time; '' without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(plot skipped: matplotlib is not installed)\n"
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.0), dpi=110, sharex=True)
    ts = [s["t"] for s in samples]
    for role in ROLES:
        axes[0].plot(ts, [s.get(f"demand.{role}", 0) for s in samples], label=f"{role} demand")
        axes[1].step(ts, [s.get(f"workers.{role}", 0) for s in samples], where="post", label=f"{role} workers")
    done = [r for r in results if r["ttft"] is not None]
    axes[2].scatter([r["start"] for r in done], [r["ttft"] for r in done], s=10, label="TTFT (by request start)")
    failed = [r for r in results if r["outcome"] != "completed"]
    if failed:
        axes[2].scatter([r["start"] for r in failed], [0] * len(failed), marker="x", color="red", label="failed")
    for ax, label in zip(axes, ("demand", "workers", "TTFT (s)")):
        ax.axvline(step, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    axes[2].set_xlabel("seconds since the load began (dashed: the step)")
    fig.suptitle("tandem up --autoscale prefill=0..2,decode=1..2: a step in load")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return f"![autoscale step]({out.name})\n"


def prompt_tokens(repeats: int) -> int:
    """Tokens of one request's prompt, chat template included."""
    from engine.model_files import load_text

    text = load_text(MODEL)
    content = "Request 0. " + FILLER * repeats + "Summarize it."
    return len(text.tokenizer.encode(text.chat_template.render([{"role": "user", "content": content}])))


def run(args: argparse.Namespace) -> str:
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()[0]
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-autoscale-"))
    up = TandemUp(log_dir, "--quiet", "--autoscale", args.autoscale, "--autoscale-cooldown", f"{args.cooldown:g}",
                  "--autoscale-interval", "1", "--gateway-args", "--max-queue-wait 300").start()
    samples: list[dict[str, float]] = []
    stop = threading.Event()
    try:
        scaler = up.info["autoscale_metrics"]
        # warm-up: one request, so every later one meets warm weights and caches
        asyncio.run(_warm(up.url, args))
        t0 = time.monotonic()

        def sampler() -> None:
            while not stop.is_set():
                try:
                    samples.append({"t": time.monotonic() - t0, **scaler_sample(scaler)})
                except httpx.HTTPError:
                    pass
                stop.wait(args.sample)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        results = asyncio.run(load(up.url, args, t0))
        end_load = time.monotonic() - t0
        base = samples[0] if samples else {}
        minimum = {r: base.get(f"workers.{r}", 0) for r in ROLES}
        deadline = time.monotonic() + args.tail_seconds
        back_at = None
        while time.monotonic() < deadline:
            time.sleep(args.sample)
            last = samples[-1] if samples else {}
            if last.get("t", 0) > end_load and all(last.get(f"workers.{r}") == minimum[r] for r in ROLES):
                back_at = last["t"]
                break
        stop.set()
        thread.join(timeout=10)
        output = up.output()
    finally:
        stop.set()
        up.stop(180)
    step = args.low_seconds

    def total(s: dict[str, float]) -> float:
        return sum(s.get(f"workers.{r}", 0) for r in ROLES)

    first_up = next((s["t"] for s in samples if s["t"] >= step and total(s) > total(base)), None)
    peak = max((total(s) for s in samples), default=0)
    all_up = next((s["t"] for s in samples if s["t"] >= step and total(s) == peak), None)
    ok = [r for r in results if r["outcome"] == "completed" and r["ttft"] is not None]
    ttft_low = median([r["ttft"] for r in ok if r["start"] < step])
    ttft_step = median([r["ttft"] for r in ok if step <= r["start"] < (first_up or float("inf"))])
    ttft_after = median([r["ttft"] for r in ok if all_up is not None and all_up <= r["start"]])
    errors = [r["outcome"] for r in results if r["outcome"] != "completed"]
    decisions = [line.split("tandem up: ", 1)[1] for line in output.splitlines()
                 if "tandem up: autoscale " in line and "->" in line]
    picture = plot(samples, results, step, BENCH_DOC.parent / "autoscale.png")
    lines = [
        f"`python -m bench.autoscale`: `tandem up --autoscale {args.autoscale} --autoscale-cooldown {args.cooldown:g}`; "
        f"closed-loop streaming chats ({prompt_tokens(args.prompt_repeats)} prompt tokens, {args.max_tokens} output tokens), "
        f"{args.low} at a time for {args.low_seconds:g} s, then {args.high} at a time for {args.high_seconds:g} s, "
        "then none. Demand and workers sampled from the scaler's metrics every "
        f"{args.sample:g} s. Started {started}; load average then {load_before:.1f} on {os.cpu_count()} cores"
        + (" (above the core count: the machine was shared, and the figures are loose)."
           if load_before > (os.cpu_count() or 1) else "."),
        "",
        "| figure | value |",
        "|---|---:|",
        f"| requests (completed / failed) | {len(results) - len(errors)} / {len(errors)} |",
        f"| time from the step to the first new worker | {fmt(None if first_up is None else first_up - step)} |",
        f"| time from the step to the most workers ({peak:g}) | {fmt(None if all_up is None else all_up - step)} |",
        f"| TTFT median, {args.low} client(s) | {fmt(ttft_low)} |",
        f"| TTFT median, {args.high} clients, before the first new worker | {fmt(ttft_step)} |",
        f"| TTFT median, {args.high} clients, once all workers were up | {fmt(ttft_after)} |",
        f"| back at the minimum, after the load ended | "
        f"{fmt(None if back_at is None else back_at - end_load)} |",
        "",
        "Scaler decisions (one log line each):",
        "",
        *[f"- `{d}`" for d in decisions],
        "",
        *([f"Failures: {', '.join(sorted(set(errors)))}", ""] if errors else []),
        picture,
    ]
    return "\n".join(lines)


async def _warm(url: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        await chat(client, url, -1, args.prompt_repeats, 4, time.monotonic())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.autoscale", description=__doc__.splitlines()[0])
    p.add_argument("--autoscale", default="prefill=0..2,decode=1..2", help="tandem up --autoscale (default: that)")
    p.add_argument("--cooldown", type=float, default=20.0, help="--autoscale-cooldown (default 20)")
    p.add_argument("--low", type=int, default=1, help="concurrent clients before the step (default 1)")
    p.add_argument("--high", type=int, default=8, help="concurrent clients after the step (default 8)")
    p.add_argument("--low-seconds", type=float, default=40.0, help="seconds at --low (default 40)")
    p.add_argument("--high-seconds", type=float, default=90.0, help="seconds at --high (default 90)")
    p.add_argument("--tail-seconds", type=float, default=90.0,
                   help="at most this long after the load to see the scaler back at the minimum (default 90)")
    p.add_argument("--prompt-repeats", type=int, default=30, help="filler sentences per prompt (default 30)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    p.add_argument("--sample", type=float, default=0.5, help="seconds between two samples (default 0.5)")
    p.add_argument("--write", action="store_true", help="write the section into docs/benchmarks.md")
    args = p.parse_args(argv)
    if not 0 < args.low < args.high:
        p.error("--low must be at least 1 and below --high")
    text = run(args)
    print(text)
    if args.write:
        write_section("autoscale", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
