"""What a streamed token costs between the engine and the client (issue 32): the served inter-token latency at
concurrency 1 against the engine's own decode step at the same context, cores and threads, and the CPU each
process spends per token.

    python -m bench.stream_cost [--layouts aggregated,disaggregated] [--requests 16] [--rounds 2] [--write]

Each round, for each layout (bench.peers's): ``tandem up --speculative off`` (one token a step on both
sides), then ``tandem bench`` at concurrency 1 (the ``random`` prompts of bench.peers, ``--input-len`` tokens
in, ``--output-len`` out) while /proc counts the CPU seconds of nats-server, the gateway and each worker and
``getrusage`` the client's; then the engine alone, in a process on the decode worker's cores with its
threads, decodes prompts of the served length one at a time and times every step. On a machine whose cores
the decode worker fills, every millisecond another process spends per token is taken from its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster import TandemUp
from bench.peers import layouts
from engine.model_files import DEFAULT_MODEL

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def engine_step(model: str, cores: list[int], threads: int, prompt_len: int, output_len: int, prompts: int
                ) -> list[float]:
    """Seconds of each batch-1 decode step of ``prompts`` prompts of ``prompt_len`` tokens (run in a child:
    the cores and the thread pool are the process's)."""
    os.sched_setaffinity(0, cores)
    import torch

    from bench.engine_turns import random_prompt
    from engine.engine import EngineConfig, LLMEngine
    from engine.loader import load_model
    from engine.params import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine(load_model(model, "float32", "auto"),
                       EngineConfig(num_blocks=64, enable_prefix_cache=False, speculative="off"))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    steps: list[float] = []
    for i in range(prompts + 1):  # the first warms up
        seq = engine.add_request(f"s{i}", random_prompt(prompt_len, 7000 + i), params)
        while seq.num_computed < len(seq.prompt_ids):
            engine.step()
        times = []
        while True:
            t = time.perf_counter()
            out = engine.step()
            times.append(time.perf_counter() - t)
            if not out or out[0].finish_reason:
                break
        if i:
            steps += times[:-1]  # the last step also frees the sequence
    return steps


def served(model: str, layout: list[str], args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """ITL p50 at concurrency 1, the prompt length served, CPU ms per token by process, the decode cores."""
    up = TandemUp(log_dir, "--quiet", "--model", model, "--speculative", "off", *layout).start()
    info = up.info
    pids = {"nats-server": info["nats_pid"], "tandem up": info["pid"], **{c["name"]: c["pid"] for c in info["children"]}}
    try:
        decoder = next(c for c in info["children"] if c["role"] in ("decode_only", "prefill_and_decode"))
        cores = sorted(os.sched_getaffinity(decoder["pid"]))
        cmd = [sys.executable, "-m", "tandem.cli", "bench", "--base-url", up.url, "--dataset", "random",
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--concurrency", "1",
               "--tokenizer", model, "--no-progress"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        warm, out = log_dir / "warm.json", log_dir / "bench.json"
        warm_cpu = _client_cpu([*cmd, "--requests", "2", "--warmup", "0", "--json", str(warm)], env)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        client_cpu = _client_cpu([*cmd, "--requests", str(args.requests), "--warmup", "0", "--json", str(out)], env)
        cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        run = json.loads(out.read_text())["runs"][0]
        tokens = run["tokens"]["output"]
        # the client's own start (imports, tokenizer) cancels out of the difference with the 2-request run
        cpu["client"] = (client_cpu - warm_cpu) * tokens / max(1, tokens - json.loads(warm.read_text())["runs"][0]["tokens"]["output"])
        return {"itl_p50_ms": run["latency_ms"]["itl"]["p50"], "prompt_len": round(run["tokens"]["input"] / run["requests"]["completed"]),
                "cpu_ms_per_token": {k: round(v * 1000 / tokens, 3) for k, v in cpu.items()},
                "cores": cores, "threads": len(cores)}
    finally:
        up.stop()
        _wait_gone(list(pids.values()))


def _client_cpu(cmd: list[str], env: dict[str, str]) -> float:
    """CPU seconds of the command, run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def _wait_gone(pids: list[int], timeout: float = 20.0) -> None:
    """Until none of ``pids`` runs (the engine's own step is timed on a quiet machine)."""
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)


def step_ms(model: str, cores: list[int], threads: int, prompt_len: int, args: argparse.Namespace) -> float:
    """Median batch-1 decode step (ms) of the engine alone, in a child process on ``cores``."""
    res = subprocess.run([sys.executable, "-m", "bench.stream_cost", "--engine-step", "--model", model,
                          "--cores", ",".join(map(str, cores)), "--threads", str(threads),
                          "--input-len", str(prompt_len), "--output-len", str(args.output_len),
                          "--prompts", str(args.step_prompts)],
                         check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return statistics.median(json.loads(res.stdout.strip().splitlines()[-1])) * 1000


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    names = sorted({k for r in rows for k in r["cpu_ms_per_token"]})
    lines = [
        "## Served: what a streamed token costs beyond the engine's step",
        "",
        f"`python -m bench.stream_cost --layouts {args.layouts} --requests {args.requests} --rounds {args.rounds}`: "
        f"concurrency 1, {args.input_len}-token prompts, {args.output_len} out, `--speculative off`. ITL p50 from "
        "`tandem bench`; the engine's batch-1 step (median) at the served prompt length, on the decode worker's "
        "cores and threads, measured after each served run; CPU milliseconds each process spent per output token.",
        "",
        "| layout | round | ITL p50 (ms) | engine step (ms) | ITL - step (ms) | " + " | ".join(names) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(names),
    ]
    for r in rows:
        cpu = r["cpu_ms_per_token"]
        lines.append(f"| {r['layout']} | {r['round']} | {r['itl_p50_ms']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['itl_p50_ms'] - r['step_ms']:+.2f} | " + " | ".join(f"{cpu.get(n, 0):.3f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.stream_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--layouts", default="aggregated,disaggregated")
    p.add_argument("--requests", type=int, default=16, help="served requests per round (default 16)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=255)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--step-prompts", type=int, default=6, help="prompts the engine alone decodes (default 6)")
    p.add_argument("--write", action="store_true", help="update the section in docs/benchmarks.md")
    p.add_argument("--engine-step", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cores", default="", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=int, default=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine_step:
        steps = engine_step(args.model, [int(c) for c in args.cores.split(",")], args.threads, args.input_len,
                            args.output_len, args.prompts)
        print(json.dumps(steps))
        return 0
    known = layouts()
    rows = []
    with tempfile.TemporaryDirectory(prefix="stream-cost-") as tmp:
        for rnd in range(1, args.rounds + 1):
            for name in args.layouts.split(","):
                log_dir = Path(tmp) / f"{name}-{rnd}"
                log_dir.mkdir()
                s = served(args.model, known[name], args, log_dir)
                s.update(layout=name, round=rnd, step_ms=step_ms(args.model, s["cores"], s["threads"], s["prompt_len"], args))
                print(json.dumps(s), flush=True)
                rows.append(s)
    report = markdown(rows, args)
    print(report)
    if args.write:
        from bench.report import write_section

        write_section("stream-cost", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
