"""Engine micro-benchmark: prefill and decode throughput, KV bytes per token, decode vs roofline.

    python -m bench.engine [--model M] [--dtype D] [--write]

Runs in one process, warms up first, reports medians. The roofline is the weight bytes that
one decode step must read, divided by the single-process copy bandwidth measured in this run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from engine.engine import EngineConfig, LLMEngine
from engine.loader import DEFAULT_MODEL, load_model
from engine.sampling import SamplingParams


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of a warm single-process memcpy (torch copy_), median of `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def _prompt(n: int, offset: int) -> list[int]:
    g = torch.Generator().manual_seed(offset)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def bench_prefill(engine: LLMEngine, n: int, repeats: int = 3) -> float:
    """Prompt tokens per second of a whole-prompt prefill (time to the first token)."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for w in range(2):  # warm-up at this size: the first passes fault in fresh activation memory
        engine.generate([_prompt(n, 500 + w)], params)
    times = []
    for r in range(repeats):
        t = time.perf_counter()
        engine.generate([_prompt(n, 1000 + r)], params)
        times.append(time.perf_counter() - t)
    return n / statistics.median(times)


def bench_decode(engine: LLMEngine, batch: int, steps: int = 24, prompt_len: int = 64) -> float:
    """Output tokens per second across the batch, timed over pure decode steps."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", _prompt(prompt_len, i), params)
            for i in range(batch)]
    while any(s.num_computed < len(s.prompt_ids) for s in seqs):  # prefill everyone first
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for s in seqs:
        engine.abort(s.request_id)
    return batch / statistics.median(times)


def start_times(model: str, dtype: str) -> tuple[float, float]:
    """Seconds to load the model with an empty weight cache (parse + dequantize) and with a warm one."""
    import tempfile

    old = os.environ.get("TANDEM_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TANDEM_CACHE_DIR"] = tmp
        try:
            t = time.perf_counter()
            load_model(model, dtype)
            cold = time.perf_counter() - t
            t = time.perf_counter()
            load_model(model, dtype)
            warm = time.perf_counter() - t
        finally:
            if old is None:
                del os.environ["TANDEM_CACHE_DIR"]
            else:
                os.environ["TANDEM_CACHE_DIR"] = old
    return cold, warm


def run(model: str, dtype: str, device: str) -> str:
    cold, warm = start_times(model, dtype)
    loaded = load_model(model, dtype)
    engine = LLMEngine(loaded, EngineConfig(dtype=dtype, device=device, num_blocks=600, max_batch=32,
                                            max_step_tokens=4096, enable_prefix_cache=False))
    weight_bytes = sum(t.numel() * t.element_size() for t in loaded.weights.values())
    bw = copy_bandwidth()
    roofline = bw / weight_bytes
    rows = []
    for n in (128, 512, 2048):
        rows.append((f"prefill {n} tokens", bench_prefill(engine, n), "prompt tok/s"))
    decode = {}
    for b in (1, 8, 32):
        decode[b] = bench_decode(engine, b)
        rows.append((f"decode batch {b}", decode[b], "output tok/s"))
    engine.blocks.check_idle()
    lines = [
        "## Engine",
        "",
        f"`python -m bench.engine --model {model} --dtype {dtype}` on {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}. "
        "Medians after warm-up.",
        "",
        "| measure | value | unit |",
        "|---|---:|---|",
    ]
    lines += [f"| {name} | {value:,.1f} | {unit} |" for name, value, unit in rows]
    lines += [
        f"| KV cache per token | {engine.layout.bytes_per_token:,} | bytes ({dtype}) |",
        f"| weight bytes read per decode step | {weight_bytes / 1e6:,.1f} | MB |",
        f"| single-process copy bandwidth | {bw / 1e9:,.2f} | GB/s |",
        f"| decode roofline at batch 1 (bandwidth / weight bytes) | {roofline:,.1f} | tok/s |",
        f"| decode batch 1 as share of roofline | {100 * decode[1] / roofline:,.0f} | % |",
        f"| model load, cold (parse + dequantize + write cache) | {cold:,.2f} | s |",
        f"| model load, warm (weights cache memory-mapped) | {warm:,.2f} | s |",
        "",
        "The roofline divides the bytes one decode step must read by the bandwidth of a single-process copy; "
        "a copy reads and writes every byte, so a pure read stream (a matrix product) can run faster than "
        "that and land above 100%.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.engine", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--write", action="store_true", help="update the Engine section of docs/benchmarks.md")
    args = p.parse_args(argv)
    report = run(args.model, args.dtype, args.device)
    print(report)
    if args.write:
        from bench.report import write_section

        write_section(f"engine-{args.device.split(':')[0]}-{args.dtype}", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
