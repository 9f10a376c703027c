"""Two builds of engine/native's C side by side in one process: an earlier commit's and this tree's.

    python -m bench.kernel_ab --baseline REV [--prefill 256,1024,2000] [--rows 255,256,512] [--rounds 5]
                              [--decode 1,16] [--decode-turns 100] [--decode-context 64]
    python -m bench.kernel_ab --old PATH/TO/_ops_avx512....so

On a shared machine whose speed moves from one minute to the next, two kernel versions compare fairly only when
they take turns call by call. `--baseline REV` extracts REV (`bench.baseline.source_tree`), builds its C
there (`setup.py build_ext --inplace`), and loads the build of this process's variant next to this tree's
library with ctypes; `engine.native`'s wrappers call whichever library is swapped in. Measured, old then new in
turn: the long-chunk matmuls on the default model's four shapes (bfloat16 panels and int8 activations, each where
both builds have it: AVX-512 BF16, VNNI; GFLOP/s, and whether both give the same bits), the attention of a
long chunk (float32, and bfloat16 where both have BF16),
whole prompts through the engine (prompt tok/s, on the fastest kernel path both builds have), and decode steps
of a batch (the libraries taking turns step by step, on this process's kernel path). Only the C
differs: the Python is this tree's, so the old library must export what this tree declares
(`engine.native.dispatch.SIGNATURES`) with the same meaning.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

import engine.native as native
from bench.baseline import source_tree
from bench.engine_turns import DECODE_PROMPT, DecodeRun, decode_step_budget, engine_prefill
from engine.engine import EngineConfig, LLMEngine
from engine.loader import load_model
from engine.model_files import DEFAULT_MODEL
from engine.native import dispatch
from engine.native.build import VARIANTS
from engine.quant import Int4Weight

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # the default model's linear layers (n, k)
HEADS, KV_HEADS, D, BLOCK = 9, 3, 64, 16  # its attention


def build_of(rev: str) -> Path:
    """The library of this process's variant built from `rev`'s C (built once per commit)."""
    tree = source_tree(rev)
    variant = next(v for v in VARIANTS if v.name == native.variant())
    lib = tree / "engine" / "native" / f"{variant.module}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not lib.exists():
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, check=True,
                       capture_output=True)
    if not lib.exists():
        raise SystemExit(f"bench.kernel_ab: {rev} did not build {lib.name}")
    return lib


def load(path: Path) -> ctypes.CDLL:
    """A library with this tree's signatures, on the kernel path this process runs."""
    lib = dispatch.declare(ctypes.CDLL(str(path)))
    lib.tq_set_row_invariant(int(native.row_invariant()))
    return lib


@contextmanager
def swapped(lib: ctypes.CDLL) -> Iterator[None]:
    """engine.native's calls go to `lib` inside."""
    real = native.library
    native.library = lambda: lib
    try:
        yield
    finally:
        native.library = real


def turns(libs: dict[str, ctypes.CDLL], run: Callable[[], object], rounds: int) -> dict[str, tuple[float, object]]:
    """Each library's median seconds of `run` over `rounds` turns (after one each to warm up), and its last
    result."""
    times: dict[str, list[float]] = {name: [] for name in libs}
    last: dict[str, object] = {}
    for r in range(rounds + 1):
        for name, lib in libs.items():
            with swapped(lib):
                t = time.perf_counter()
                last[name] = run()
                if r:
                    times[name].append(time.perf_counter() - t)
    return {name: (statistics.median(times[name]), last[name]) for name in libs}


#: a long chunk's matmul -> what a library needs for it, and what says the library's CPU instructions are built in
MATMULS = {"bfloat16": ("tq_bf16_matmul", "tq_has_bf16"), "int8": ("tq_i8_pack", "tq_has_i8")}


def _matmul(kind: str, x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    if kind == "int8":  # packed by whichever library ran first: the layout is part of what both must share
        return native.i8_matmul(x, w.i8_panels(), 1)
    return native.bf16_matmul("int4", x, w.qs, w.dm)


def _both_run(libs: dict[str, ctypes.CDLL], precision: str) -> bool:
    symbol, built = MATMULS[precision]
    return all(hasattr(lib, symbol) and getattr(lib, built)() for lib in libs.values())


def _attend(qkv: torch.Tensor, context: int, table: torch.Tensor, keys: torch.Tensor,
            values: torch.Tensor, bf16: bool) -> torch.Tensor:
    out = torch.zeros(qkv.shape[0], HEADS * D)
    native.chunk_attention(qkv, 0, qkv.shape[0], context, table, keys, values, HEADS, 0.125, 0, out, bf16)
    return out


def _prefill(engine: LLMEngine, n: int, seeds: Iterator[int]) -> float:
    return engine_prefill(engine, n, next(seeds))


def matmuls(libs: dict[str, ctypes.CDLL], rows: list[int], rounds: int) -> list[str]:
    lines = []
    for kind, m in [(kind, m) for kind in MATMULS if _both_run(libs, kind) for m in rows]:
        took = {name: 0.0 for name in libs}
        same, flops = True, 0
        for n, k in SHAPES:
            w, x = Int4Weight.quantize(torch.randn(n, k) * 0.05), torch.randn(m, k)
            got = turns(libs, partial(_matmul, kind, x, w), rounds)
            for name in libs:
                took[name] += got[name][0]
            same &= torch.equal(got["old"][1], got["new"][1])
            flops += 2 * m * n * k
        lines.append(f"| {kind} matmul, {m} rows (GFLOP/s) | {flops / took['old'] / 1e9:,.0f} | "
                     f"{flops / took['new'] / 1e9:,.0f} | {took['old'] / took['new']:.3f}x | {'yes' if same else 'no'} |")
    return lines


def attention(libs: dict[str, ctypes.CDLL], chunks: list[tuple[int, int]], rounds: int) -> list[str]:
    lines: list[str] = []
    if not all(hasattr(lib, "tq_chunk_attention") and lib.tq_has_chunk_attention() for lib in libs.values()):
        return lines
    precisions = [("float32", False)] + ([("bfloat16", True)] if _both_run(libs, "bfloat16") else [])
    for (precision, bf16), (length, context) in [(p, c) for p in precisions for c in chunks]:
        blocks = (context + BLOCK - 1) // BLOCK
        keys = torch.randn(blocks, BLOCK, KV_HEADS, D).half()
        values = torch.randn(blocks, BLOCK, KV_HEADS, D).half()
        qkv, table = torch.randn(length, (HEADS + 2 * KV_HEADS) * D), torch.randperm(blocks)
        got = turns(libs, partial(_attend, qkv, context, table, keys, values, bf16), rounds)
        (old, a), (new, b) = got["old"], got["new"]
        lines.append(f"| {precision} attention, {length} rows over {context} tokens (ms) | {old * 1e3:.2f} | "
                     f"{new * 1e3:.2f} | {old / new:.3f}x | {'yes' if torch.equal(a, b) else 'no'} |")
    return lines


def prefills(libs: dict[str, ctypes.CDLL], lengths: list[int], rounds: int) -> list[str]:
    engine = LLMEngine(load_model(DEFAULT_MODEL, "float32", "auto"),
                       EngineConfig(num_blocks=1024, enable_prefix_cache=False, speculative="off"))
    lines = []
    path = next((p for p, precision in native.PANEL_PRECISION.items() if _both_run(libs, precision)),
                native.kernel_path())
    here = native.kernel_path()
    native.use_kernel_path(path)
    for n in lengths:
        got = turns(libs, partial(_prefill, engine, n, iter(range(10**6))), rounds)
        old, new = (n / got[name][0] for name in ("old", "new"))
        lines.append(f"| prefill on {path}, {n} tokens (prompt tok/s) | {old:,.0f} | {new:,.0f} | {new / old:.3f}x | |")
    native.use_kernel_path(here)
    return lines


def decodes(libs: dict[str, ctypes.CDLL], batches: list[int], turns_each: int, context: int) -> list[str]:
    """Median seconds of a decode step of each batch over prompts of `context` tokens, the libraries taking turns a
    step each."""
    steps = (turns_each + 1) * len(libs)
    blocks = max(batches) * ((context + steps + 8) // BLOCK + 2) + 64
    engine = LLMEngine(load_model(DEFAULT_MODEL, "float32", "auto"),
                       EngineConfig(num_blocks=max(1024, blocks), enable_prefix_cache=False, speculative="off",
                                    max_batch=max(batches), max_step_tokens=decode_step_budget(batches, [], context)))
    lines = []
    for b in batches:
        run = DecodeRun(engine, b, seed=b, steps=steps, prompt=context)
        got = turns(libs, run.step, turns_each)
        run.close()
        old, new = (got[name][0] for name in ("old", "new"))
        lines.append(f"| decode batch {b} over {context} tokens on {native.kernel_path()} (ms a step) | {old * 1e3:.3f} | "
                     f"{new * 1e3:.3f} | {old / new:.3f}x | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.kernel_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    old = ap.add_mutually_exclusive_group(required=True)
    old.add_argument("--baseline", metavar="REV", help="the commit whose C to compare")
    old.add_argument("--old", metavar="PATH", help="a built library to compare (of this process's variant)")
    ap.add_argument("--rows", default="255,256,512", help="matmul rows (default 255,256,512; 0: none)")
    ap.add_argument("--chunks", default="256:256,512:1024,512:2000",
                    help="attention chunks as rows:context (default 256:256,512:1024,512:2000; 0: none)")
    ap.add_argument("--prefill", default="256,1024,2000", help="prompt lengths (default 256,1024,2000; 0: none)")
    ap.add_argument("--decode", default="1", help="decode batch sizes (default 1; 0: none)")
    ap.add_argument("--decode-turns", type=int, default=100, help="decode steps each library takes (default 100)")
    ap.add_argument("--decode-context", type=int, default=DECODE_PROMPT,
                    help=f"tokens of each decode row's prompt (default {DECODE_PROMPT})")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if native.library() is None:
        raise SystemExit("bench.kernel_ab: engine.native is not built here")
    libs = {"old": load(build_of(args.baseline) if args.baseline else Path(args.old)), "new": native.library()}
    print(f"`python -m bench.kernel_ab {' '.join(argv if argv is not None else sys.argv[1:])}`: "
          f"{native.variant()} build, {args.threads} threads, medians of {args.rounds} turns each, one process\n")
    print("| measure | old | new | new / old speed | same bits |")
    print("|---|---:|---:|---:|---|")
    for line in matmuls(libs, [int(r) for r in args.rows.split(",") if int(r)], args.rounds):
        print(line, flush=True)
    chunks = [tuple(int(v) for v in c.split(":")) for c in args.chunks.split(",") if c != "0"]
    for line in attention(libs, chunks, args.rounds):
        print(line, flush=True)
    lengths = [int(n) for n in args.prefill.split(",") if int(n)]
    for line in prefills(libs, lengths, args.rounds) if lengths else []:
        print(line, flush=True)
    batches = [int(b) for b in args.decode.split(",") if int(b)]
    for line in decodes(libs, batches, args.decode_turns, args.decode_context) if batches else []:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
