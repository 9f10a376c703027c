"""Reliability under load, against a `tandem up` it starts (1 prefill + 1 decode worker).

    python -m bench.reliability overload [--requests 48] [--write]    # shed load instead of timing out
    python -m bench.reliability soak [--minutes 5] [--write]          # ~80 % of capacity, figures flat?

overload: N concurrent ~1,000-token streaming chats (64 output tokens) with a client timeout of
120 s. Reports how each ended (completed, 429, 503, client timeout), how fast the refusals came,
and the KV blocks in use once the clients are gone.

soak: first measures capacity (completed requests per second with 8 clients in a closed loop),
then sends requests at 80 % of that rate (Poisson arrivals, ~255-token prompts, 32 output tokens)
for --minutes, sampling every child's private and shared resident memory and open file descriptors
and the workers' used blocks every 10 s. Reports errors and the first, last and highest samples.

--write puts the table into docs/operations.md between its markers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.cluster import MODEL, TandemUp
from bench.report import write_section

OPERATIONS_DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
FILLER = "Tandem serves language models with prefill and decode on separate workers over a message bus. "


def chat(i: int, repeats: int, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Request {i}. " + FILLER * repeats}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"outcome": str(r.status_code), "seconds": time.perf_counter() - t0}
            error = None
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    error = json.loads(line[6:])["error"]["code"]
            return {"outcome": f"error {error}" if error else "completed", "seconds": time.perf_counter() - t0}
    except httpx.TimeoutException:
        return {"outcome": "client timeout", "seconds": time.perf_counter() - t0}


def used_blocks(url: str) -> int:
    return sum(w["total_blocks"] - w["free_blocks"] for w in httpx.get(f"{url}/ready", timeout=10).json()["workers"])


def wait_blocks_free(url: str, timeout: float = 120.0) -> tuple[int, float]:
    """(blocks in use at the end, seconds it took to get there)."""
    t0 = time.monotonic()
    used = used_blocks(url)
    while used and time.monotonic() - t0 < timeout:
        time.sleep(1.0)
        used = used_blocks(url)
    return used, time.monotonic() - t0


def overload(args: argparse.Namespace, up: TandemUp) -> str:
    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            return await asyncio.gather(*(one(client, up.url, chat(i, 60, 64)) for i in range(args.requests)))

    results = asyncio.run(go())
    used, took = wait_blocks_free(up.url)
    lines = [f"`python -m bench.reliability overload --requests {args.requests}`: {args.requests} concurrent "
             "~1,000-token streaming chats, 64 output tokens, client timeout 120 s, `tandem up` with one "
             "prefill and one decode worker (defaults: --max-queue-wait 30).", "",
             "| outcome | requests | seconds to the answer (median, max) |", "|---|---:|---:|"]
    for outcome in sorted({r["outcome"] for r in results}):
        secs = [r["seconds"] for r in results if r["outcome"] == outcome]
        lines.append(f"| {outcome} | {len(secs)} | {statistics.median(secs):.1f}, {max(secs):.1f} |")
    lines += ["", f"KV blocks in use after the clients were gone: {used} (after {took:.0f} s)."]
    return "\n".join(lines)


def proc_figures(pid: int) -> tuple[int, int, int]:
    """(private resident memory in KiB, shared-memory pages resident in KiB, open file descriptors).

    Shared pages are kept apart: a prefill worker writes KV into its decode peer's shared-memory
    pool, so those pages count in its resident memory as it touches more of them (at most the
    peer's pool size), without being a leak.
    """
    fields = {line.split(":")[0]: line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
              if line.startswith(("RssAnon:", "RssShmem:"))}
    return int(fields["RssAnon"]), int(fields["RssShmem"]), len(list(Path(f"/proc/{pid}/fd").iterdir()))


def soak(args: argparse.Namespace, up: TandemUp) -> str:
    async def closed_loop(seconds: float) -> float:
        done = 0
        stop = time.monotonic() + seconds
        async with httpx.AsyncClient(timeout=120) as client:
            async def client_loop(k: int) -> None:
                nonlocal done
                i = 0
                while time.monotonic() < stop:
                    r = await one(client, up.url, chat(10_000 * k + i, 15, 32))
                    done += r["outcome"] == "completed"
                    i += 1

            await asyncio.gather(*(client_loop(k) for k in range(8)))
        return done / seconds

    capacity = asyncio.run(closed_loop(60.0))
    rate = 0.8 * capacity
    samples: list[dict[str, Any]] = []
    pids = {c["name"]: c["pid"] for c in up.info["children"]}

    def sample() -> None:
        row: dict[str, Any] = {"t": time.monotonic(), "used_blocks": used_blocks(up.url)}
        for name, pid in pids.items():
            row[name] = proc_figures(pid)
        samples.append(row)

    async def open_loop() -> list[dict[str, Any]]:
        rng = random.Random(1)
        tasks = []
        end = time.monotonic() + 60 * args.minutes
        next_sample = 0.0
        async with httpx.AsyncClient(timeout=120) as client:
            i = 0
            while time.monotonic() < end:
                if time.monotonic() >= next_sample:
                    await asyncio.to_thread(sample)
                    next_sample = time.monotonic() + 10
                tasks.append(asyncio.create_task(one(client, up.url, chat(i, 15, 32))))
                i += 1
                await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
        await asyncio.to_thread(sample)
        return results

    results = asyncio.run(open_loop())
    errors = [r for r in results if r["outcome"] != "completed"]
    lines = [f"`python -m bench.reliability soak --minutes {args.minutes}`: capacity measured first "
             f"({capacity:.2f} requests/s completed with 8 closed-loop clients, ~255-token prompts, 32 output "
             f"tokens), then Poisson arrivals at {rate:.2f}/s (80 %) for {args.minutes} minutes: {len(results)} "
             f"requests, {len(errors)} errors"
             + (f" ({', '.join(sorted({e['outcome'] for e in errors}))})" if errors else "") + ".", "",
             "| process | private resident memory first / last / max (MiB) | shared memory resident first / last "
             "(MiB) | open fds first / last / max |",
             "|---|---:|---:|---:|"]
    for name in pids:
        rss = [s[name][0] / 1024 for s in samples]
        shm = [s[name][1] / 1024 for s in samples]
        fds = [s[name][2] for s in samples]
        lines.append(f"| {name} | {rss[0]:.0f} / {rss[-1]:.0f} / {max(rss):.0f} | {shm[0]:.0f} / {shm[-1]:.0f} | "
                     f"{fds[0]} / {fds[-1]} / {max(fds)} |")
    used = [s["used_blocks"] for s in samples]
    lines += ["", f"KV blocks in use (both workers), sampled every 10 s: first {used[0]}, last {used[-1]}, "
                  f"max {max(used)}, median {statistics.median(used):.0f}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.reliability", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["overload", "soak"])
    p.add_argument("--requests", type=int, default=48, help="overload: concurrent requests (default 48)")
    p.add_argument("--minutes", type=float, default=5.0, help="soak: minutes at 80 %% of capacity (default 5)")
    p.add_argument("--write", action="store_true", help="write the table into docs/operations.md")
    args = p.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix=f"tandem-{args.what}-"))
    up = TandemUp(log_dir, "--quiet").start()
    try:
        text = overload(args, up) if args.what == "overload" else soak(args, up)
    finally:
        up.stop(120)
    print(text)
    if args.write:
        write_section(f"reliability-{args.what}", text, OPERATIONS_DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
