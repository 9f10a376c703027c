"""What this CPU can do at most, measured: the rooflines benchmarks print beside their figures.

A prefill figure means little without the machine's compute peak for the precision it ran in, nor a decode
step without the bandwidth at which the weights can be read once (the bytes a step reads, not a copy rate,
which counts half of the traffic); ``python -m engine.native.peaks`` prints them alone. Each peak is the best of a few short runs of the probe loops of `csrc/peaks.c`:
independent accumulators of float32 FMAs, bfloat16 dot products (vdpbf16ps) and int8 ones (vpdpbusd), and a
sum over a buffer far larger than the caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import native
from engine.native import huge_pages

READ_BYTES = 256 << 20


@dataclass(frozen=True)
class Peaks:
    """Per second, on `threads` threads; 0 where the CPU or build lacks the instruction."""

    threads: int
    fp32_flops: float
    bf16_flops: float
    int8_ops: float
    read_bytes: float

    def describe(self) -> str:
        parts = [f"float32 FMA {self.fp32_flops / 1e9:,.0f} GFLOP/s"]
        if self.bf16_flops:
            parts.append(f"bfloat16 dot {self.bf16_flops / 1e9:,.0f} GFLOP/s")
        if self.int8_ops:
            parts.append(f"int8 dot {self.int8_ops / 1e9:,.0f} GOP/s")
        parts.append(f"read {self.read_bytes / 1e9:.1f} GB/s")
        return f"{self.threads} thread{'s' * (self.threads > 1)}: " + ", ".join(parts)


def _best_rate(run: Callable[[], float], repeats: int = 5) -> float:
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        done = run()
        best = max(best, done / (time.perf_counter() - t))
    return best


class ReadProbe:
    """One sum over a buffer far larger than the caches (its pages touched once first): the bytes it read, per
    call. `bench.engine` also calls one between decode steps, for the bandwidth at the moments the steps ran.
    The buffer is on the pages the packed weights are on (`huge_pages`: 2 MiB where the kernel gives them): on 4 KiB
    pages this probe read 0.70-0.86x as fast, which put the decode rooflines that far below what the weights' own
    pages allow."""

    def __init__(self, threads: int, nbytes: int = READ_BYTES):
        self.threads = threads
        self.buf = huge_pages.HugePageArena().empty(nbytes // 4 * 4).view(torch.float32).fill_(1.0)
        self()

    def __call__(self) -> float:
        lib = native.library()
        if lib is None:
            return self.buf.sum().item() and self.buf.numel() * 4
        return lib.tq_probe_read(self.buf.data_ptr(), self.buf.numel(), self.threads) and self.buf.numel() * 4

    def rate(self) -> float:
        """Bytes per second of one call."""
        t = time.perf_counter()
        done = self()
        return done / (time.perf_counter() - t)


def measure(threads: int | None = None, iters: int = 2_000_000) -> Peaks:
    """This CPU's peaks on `threads` threads (default: torch's); about a second."""
    threads = threads or torch.get_num_threads()
    lib = native.library()
    read = _best_rate(ReadProbe(threads))
    if lib is None:
        return Peaks(threads, 0.0, 0.0, 0.0, read)
    rates = [_best_rate(lambda probe=probe: probe(iters, threads))
             for probe in (lib.tq_probe_fma, lib.tq_probe_bf16, lib.tq_probe_vnni)]
    return Peaks(threads, *rates, read)


def main() -> None:
    """``python -m engine.native.peaks``: this CPU's peaks on one thread and on torch's threads."""
    threads = torch.get_num_threads()
    print(f"kernel path: {native.kernel_path()} ({native.variant()} build)")
    for n in sorted({1, threads}):
        print(measure(n).describe())


if __name__ == "__main__":
    main()
