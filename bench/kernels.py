"""Where dequantize + MKL overtakes the weight-only kernel, per linear shape of the model.

    python -m bench.kernels [--model M] [--quantization auto] [--write]

For each distinct linear layer shape of layer 0 (and the LM head), times the weight-only kernel and
the dequantize + float32 GEMM path (`engine.quant`) at 1..512 rows, min of repeated runs, and reports
the smallest row count at which dequantizing wins. `KERNELS.kernel_max_chunk` is set from this and
from the C attention's cost (engine/quant.py `KernelChoice`).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.engine import EngineConfig, LLMEngine
from engine.linear_paths import dense_matmul
from engine.loader import load_model
from engine.model_files import DEFAULT_MODEL
from engine.quant import DenseWeight

ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512)


def best_of(fn, repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--write", action="store_true", help="update the section in docs/benchmarks.md")
    args = p.parse_args(argv)
    engine = LLMEngine(load_model(args.model, "float32", args.quantization), EngineConfig(num_blocks=4))
    layer = engine.model.layers[0]
    weights = {"wqkv": layer.wqkv, "wo": layer.wo, "w_gate_up": layer.w_gate_up, "w_down": layer.w_down,
               "lm_head": engine.model.lm_head}
    lines = [
        "## Engine: kernel per step shape",
        "",
        f"`python -m bench.kernels --quantization {args.quantization}`, {torch.get_num_threads()} threads: "
        "microseconds per call (min of 9) of the weight-only kernel / dequantize + float32 GEMM / a dense "
        "float32 GEMM of the same shape, by rows in the step.",
        "",
        "| weight | kind | shape | " + " | ".join(str(r) for r in ROWS) + " | dequantize wins from |",
        "|---|---|---|" + "---:|" * (len(ROWS) + 1),
    ]
    for name, w in weights.items():
        if isinstance(w, DenseWeight):
            continue
        dense = w.dequantize().contiguous()
        cells, wins = [], None
        for m in ROWS:
            x = torch.randn(m, w.in_features)
            k = best_of(lambda w=w, x=x: w(x, 0))
            d = best_of(lambda w=w, x=x, m=m: w(x, m))
            f = best_of(lambda x=x, dense=dense: dense_matmul(x, dense))
            cells.append(f"{k * 1e6:,.0f} / {d * 1e6:,.0f} / {f * 1e6:,.0f}")
            if wins is None and d < k:
                wins = m
        lines.append(f"| {name} | {w.kind} | {w.out_features}x{w.in_features} | " + " | ".join(cells)
                     + f" | {wins or '-'} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.write:
        from bench.report import write_section

        write_section("engine-kernels", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
