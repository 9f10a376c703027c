"""Engine micro-benchmark: weight formats side by side, and llama.cpp's server on the same GGUF.

    python -m bench.engine [--quantization none,auto] [--batches 1,8,32,64] [--prefill 128,512,2048]
                           [--threads N] [--rounds 3] [--kernels avx512_bf16,avx2] [--torch-ops] [--plain-pages]
                           [--baseline REV] [--write]

For each measure, every engine (one per `--quantization`; with `--torch-ops` a second one per format that runs
torch's operations in place of `engine.native`'s; with `--plain-pages` one whose packed weights are on 4 KiB pages,
not the 2 MiB ones of `engine.native.huge_pages`) and `llama-server` (when it can be started,
see bench/llama_server.py) and, with `--baseline REV`, the engine of an earlier commit (its float32 weights,
see bench/baseline.py) run in turn, `--rounds` times, after a warm-up; the table gives medians,
so drift on a shared machine hits every column alike. Prefill tok/s is a whole prompt to its first token,
the engines taking turns a prompt each. Decode tok/s is timed over pure decode steps of a batch of 64-token
prompts, the engines taking turns a step each (every engine holds its own batch), so that even a drift of
seconds falls on all of them. llama-server reports its own `timings` (decode: the rates of concurrent
requests added up) and takes its turn once a round. Beside the figures: this CPU's peaks, measured in the
same run (`engine.native.peaks`), and what each engine would do at them: a prompt token's matmul FLOPs at
the peak of the precision its kernel path multiplies in, and a batch-1 step reading every weight once at the
measured read bandwidth: the peaks' (the best of five reads), and the median of reads that take their turn
between the batch-1 steps (the bandwidth this machine's neighbours left at the moments the steps ran: the two
differ by up to 1.7x here, from one minute to the next).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from bench.engine_turns import (
    DECODE_PROMPT,
    DECODE_STEPS,
    DecodeRun,
    decode_step_budget,
    engine_prefill,
    interleaved,
    interleaved_decode,
    on_path,
    random_prompt,
)
from engine import native
from engine.engine import EngineConfig, LLMEngine
from engine.linear_paths import split_call
from engine.loader import load_model
from engine.model_files import DEFAULT_MODEL, model_name, resolve_model_path
from engine.native import huge_pages, peaks
from engine.quant import Int4Weight, Q8Weight

HUGE_ROW = "packed weights in 2 MiB pages (MB)"
READ_ROOF = "roofline: decode batch 1 at read bandwidth (tok/s)"  # the peaks' read: the best of five
BETWEEN_ROOF = "roofline: decode batch 1 at the read bandwidth between its steps (tok/s)"  # the median


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of weights the engine holds (each tensor once; the tied embedding is the LM head)."""
    m = engine.model
    seen = {id(w): w.nbytes for w in [m.embed, m.lm_head, *engine.model.linears]}
    norms = [m.norm] + [t for layer in m.layers for t in (layer.attn_norm, layer.ffn_norm)]
    return sum(seen.values()) + sum(t.numel() * t.element_size() for t in norms)


def panels_in_huge_pages(engine: LLMEngine) -> int:
    """Bytes in 2 MiB pages of the mappings holding the engine's packed int8 panels (0 off the panels' path)."""
    if not (native.available() and native.packs_i8()):
        return 0
    coded = [w for w in [engine.model.lm_head, *engine.model.linears] if isinstance(w, Int4Weight | Q8Weight)]
    return huge_pages.huge_page_bytes(w.i8_panels().data for w in coded)


def start_times(model: str, dtype: str, quantization: str) -> tuple[float, float]:
    """Seconds to load the model with an empty weight cache (parse + repack) and with a warm one."""
    import tempfile

    old = os.environ.get("TANDEM_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TANDEM_CACHE_DIR"] = tmp
        try:
            t = time.perf_counter()
            load_model(model, dtype, quantization)
            cold = time.perf_counter() - t
            t = time.perf_counter()
            load_model(model, dtype, quantization)
            warm = time.perf_counter() - t
        finally:
            if old is None:
                del os.environ["TANDEM_CACHE_DIR"]
            else:
                os.environ["TANDEM_CACHE_DIR"] = old
    return cold, warm


CHUNK_ROWS = 256
CHUNK_RATE = f"a {CHUNK_ROWS}-row chunk's matmuls (G op/s, of the peak)"


def linear_flops(engine: LLMEngine) -> int:
    """Floating-point operations of a prompt token's matmuls (2 per weight; the LM head left out: a prompt
    takes its logits at one token)."""
    return sum(2 * w.out_features * w.in_features for w in engine.model.linears)


def chunk_matmul_rate(engine: LLMEngine, rows: int = CHUNK_ROWS, repeats: int = 10) -> float:
    """Operations per second of a prompt chunk's matmuls on the engine's long-chunk path: layer 0's four linear
    layers on `rows` rows, each the median of `repeats` calls after one to warm up."""
    layer = engine.model.layers[0]
    ops = took = 0.0
    for w in layer.linears:
        x = torch.randn(rows, w.in_features)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            split_call(w, x, rows)
            times.append(time.perf_counter() - t)
        took += statistics.median(times[1:])
        ops += 2 * rows * w.in_features * w.out_features
    return ops / took


def variants(torch_ops: bool, plain_pages: bool) -> list[tuple[bool, bool]]:
    """(engine.native's operations, weights on 4 KiB pages) of each engine a weight format gets."""
    return [(True, False)] + ([(False, False)] if torch_ops else []) + ([(True, True)] if plain_pages else [])


def run(model: str, dtype: str, modes: list[str], batches: list[int], prefills: list[int], rounds: int,
        peer: bool, plot: bool = False, torch_ops: bool = False, baseline: str | None = None,
        kernel_paths: list[str] | None = None, plain_pages: bool = False) -> str:
    engines: dict[str, LLMEngine] = {}
    paths: dict[str, str | None] = {}  # column -> the kernel path its engine runs on (None: the process's)
    on_kernels: dict[str, bool] = {}  # column -> its matmuls run on engine.native's int4/Q8_0 kernels
    budget = decode_step_budget(batches, prefills)
    facts: dict[str, dict[str, str]] = {}
    for mode in modes:
        cold, warm = start_times(model, dtype, mode)
        loaded = load_model(model, dtype, mode)
        name = f"{mode} ({loaded.quantization})" if loaded.quantization != mode else mode
        for path in (kernel_paths or [None]) if loaded.quantized else [None]:
            for native_ops, plain in variants(torch_ops, plain_pages and loaded.quantized):
                with huge_pages.plain_pages() if plain else contextlib.nullcontext():  # packed at construction
                    e = LLMEngine(loaded, EngineConfig(dtype=dtype, num_blocks=64 * 8 + 160, max_batch=max(batches),
                                                       max_step_tokens=budget, enable_prefix_cache=False,
                                                       speculative="off"))  # a plain step (bench.speculation: drafts)
                e.model.native = e.model.native and native_ops
                column = name + (f" {path}" if path else "") + ("" if native_ops else ", torch ops") \
                    + (", 4 KiB pages" if plain else "")
                engines[column], paths[column] = e, path
                on_kernels[column] = loaded.quantized and native.available()  # torch ops: the same matmul kernels
                facts[column] = {"weights (MB)": f"{weight_bytes(e) / 1e6:,.1f}",
                                 HUGE_ROW: f"{on_path(path, lambda _, e=e: panels_in_huge_pages(e))(0) / 1e6:,.1f}",
                                 "load cold / warm (s)": f"{cold:.1f} / {warm:.2f}"}
    old = None
    if baseline:
        from bench.baseline import Baseline

        old = Baseline(baseline, model, dtype, torch.get_num_threads(), 64 * 8 + 160, max(batches), budget)
    old_column = f"float32 at {baseline}"
    llama = None
    rows: list[tuple[str, dict[str, float]]] = []
    between: list[float] = []  # read bandwidth, measured between batch-1 decode steps
    try:
        llama = _start_llama(model, peer)
        columns = list(engines) + ([old_column] if old else []) + (["llama-server"] if llama else [])
        for n in prefills:
            runners = {name: on_path(paths[name], lambda r, e=e, n=n: engine_prefill(e, n, 10 + r))
                       for name, e in engines.items()}
            if old:
                runners[old_column] = lambda r, n=n: old.prefill(n, 10 + r)
            if llama:
                runners["llama-server"] = lambda r, n=n: llama.prefill_tok_s(random_prompt(n, 10 + r))
            rows.append((f"prefill {n} tokens (prompt tok/s)", interleaved(runners, rounds)))
        for b in batches:
            starts: dict[str, Callable[[int], DecodeRun]] = {
                name: (lambda r, e=e, b=b, p=paths[name]: DecodeRun(e, b, 20 + r, p)) for name, e in engines.items()}
            if old:
                starts[old_column] = lambda r, b=b: old.start_decode(b, 20 + r)
            whole = {}
            if llama:
                whole["llama-server"] = lambda r, b=b: llama.decode_tok_s(
                    [random_prompt(DECODE_PROMPT, (20 + r) * 1000 + i) for i in range(b)], DECODE_STEPS + 8)
            probe = peaks.ReadProbe(torch.get_num_threads()) if b == 1 else None  # the bandwidth beside the steps
            rows.append((f"decode batch {b} (output tok/s)",
                         interleaved_decode(starts, whole, b, rounds, probe, between)))
            del probe
        if llama:
            facts["llama-server"] = {"weights (MB)": f"{resolve_model_path(model).stat().st_size / 1e6:,.1f} (file)",
                                     "load cold / warm (s)": "", "RSS (MB)": f"{llama.rss_bytes() / 1e6:,.0f}"}
    finally:
        if llama:
            llama.stop()
        if old:
            old.stop()
    for e in engines.values():
        e.blocks.check_idle()
    rates = {column: on_path(paths[column], lambda _, e=e: chunk_matmul_rate(e))(0)
             for column, e in engines.items() if on_kernels[column]}  # measured beside the peaks
    if kernel_paths:
        native.use_kernel_path(kernel_paths[0])
    threads = torch.get_num_threads()
    peak = peaks.measure(threads)
    peak_one = peaks.measure(1) if threads > 1 else peak
    for column, e in engines.items():  # what each engine could do at this machine's peaks
        path = paths[column] or native.kernel_path()
        precision = native.PANEL_PRECISION.get(path, "float32") if on_kernels[column] else "float32"
        flops = {"int8": peak.int8_ops, "bfloat16": peak.bf16_flops, "float32": peak.fp32_flops}[precision]
        facts[column]["roofline: prefill at the matmul peak (tok/s)"] = f"{flops / linear_flops(e):,.0f} ({precision})"
        if column in rates and flops:
            facts[column][CHUNK_RATE] = f"{rates[column] / 1e9:,.0f} ({rates[column] / flops:.0%})"
        facts[column][READ_ROOF] = f"{peak.read_bytes / weight_bytes(e):,.1f}"
        if between:
            facts[column][BETWEEN_ROOF] = f"{statistics.median(between) / weight_bytes(e):,.1f}"
    own = "" if model == DEFAULT_MODEL else f" --model {model}"
    lines = [
        "## Engine: weight formats" + (f" ({model})" if own else ""),
        "",
        f"`python -m bench.engine{own} --quantization {','.join(modes)}{' --torch-ops' if torch_ops else ''}"
        f"{' --baseline ' + baseline if baseline else ''}` on "
        f"{platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {threads} threads, dtype {dtype}, kernel path "
        f"{', '.join(kernel_paths) if kernel_paths else native.kernel_path()}. This CPU's peaks (`engine.native.peaks`) "
        f"this run, {peak.describe()}" + (f"; {peak_one.describe()}" if threads > 1 else "") + ". "
        f"Medians of {rounds} rounds after a warm-up, engines taking turns: "
        f"prefill a prompt each, decode a step each (of {rounds} x {DECODE_STEPS} steps; llama-server a round each)"
        + (f"; between batch-1 steps, reads at a median {statistics.median(between) / 1e9:.1f} GB/s"
           if between else "") + "."
        + (" `, torch ops`: the same weights and matmul kernels with torch's operations in place of "
           "`engine.native`'s RMSNorm, RoPE + K/V write, attention and SiLU gate (and of its one call per layer)."
           if torch_ops else ""),
        "",
        "| measure | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for label, values in rows:
        lines.append(f"| {label} | " + " | ".join(f"{values[c]:,.1f}" for c in columns) + " |")
    for key in ("roofline: prefill at the matmul peak (tok/s)", CHUNK_RATE,
                READ_ROOF, BETWEEN_ROOF, "weights (MB)", HUGE_ROW,
                "load cold / warm (s)", "RSS (MB)"):
        if any(key in facts.get(c, {}) for c in columns):
            lines.append(f"| {key} | " + " | ".join(facts.get(c, {}).get(key, "") for c in columns) + " |")
    if plot:
        from bench.report import plot_lines

        series = {c: [(b, dict(rows)[f"decode batch {b} (output tok/s)"][c]) for b in batches] for c in columns}
        lines += ["", plot_lines("engine_decode" if not own else f"engine_decode_{model_name(model)}", "Decode throughput by weight format", "batch size",
                                 "output tok/s", series).rstrip()]
    return "\n".join(lines) + "\n"


def _start_llama(model: str, wanted: bool):
    from bench import llama_server

    if not wanted:
        return None
    binary = llama_server.find()
    path = resolve_model_path(model)
    if binary is None or path.suffix != ".gguf":
        print("llama-server: skipped (" + ("set TANDEM_LLAMA_SERVER or put llama-server on PATH; DESIGN §8 says "
              "how to build it" if binary is None else "the model is not a GGUF file") + ")")
        return None
    server = llama_server.LlamaServer(binary, path, threads=torch.get_num_threads())
    server.wait_ready()
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias, .gguf or HF directory (default: the built-in model)")
    p.add_argument("--dtype", default="float32", help="activations and KV cache (default float32)")
    p.add_argument("--quantization", default="none,auto", help="weight formats to compare (default none,auto)")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes (default 1,8,32,64)")
    p.add_argument("--prefill", default="128,512,2048", help="prefill prompt lengths (default 128,512,2048)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    p.add_argument("--rounds", type=int, default=3, help="runs per measure and engine (default 3)")
    p.add_argument("--no-llama-server", dest="peer", action="store_false", help="do not start llama-server")
    p.add_argument("--torch-ops", action="store_true",
                   help="also run each format with torch's operations in place of engine.native's C ones")
    p.add_argument("--kernels", default="",
                   help="kernel paths to compare for quantized weights, e.g. avx512_bf16,avx2 (default: the best here)")
    p.add_argument("--baseline", metavar="REV", help="also run the engine of commit REV (float32), side by side")
    p.add_argument("--plain-pages", action="store_true",
                   help="also run each quantized format with its packed weights on 4 KiB pages, not 2 MiB ones")
    p.add_argument("--write", action="store_true", help="update the section in docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.model, args.dtype, args.quantization.split(","), [int(b) for b in args.batches.split(",")],
                 [int(n) for n in args.prefill.split(",")], args.rounds, args.peer, plot=args.write,
                 torch_ops=args.torch_ops, baseline=args.baseline,
                 kernel_paths=[k for k in args.kernels.split(",") if k], plain_pages=args.plain_pages)
    print(report)
    if args.write:
        from bench.report import write_section

        write_section("engine-formats" if args.model == DEFAULT_MODEL else f"engine-formats-{model_name(args.model)}",
                      report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
