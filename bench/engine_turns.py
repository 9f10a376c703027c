"""Engines taking turns in `bench.engine` and `bench.kernel_ab`: a whole prompt each, or a decode step each (every
engine holding its own batch), so that a minute of a slower shared machine slows every engine alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from engine import native
from engine.engine import LLMEngine
from engine.native import peaks
from engine.params import SamplingParams

DECODE_PROMPT = 64
DECODE_STEPS = 16
PROBE_EVERY = 8  # decode steps between two reads of memory (bench.engine's second read roofline)


def random_prompt(n: int, offset: int) -> list[int]:
    """`n` token ids, the same for the same `offset`."""
    g = torch.Generator().manual_seed(offset)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def engine_prefill(engine: LLMEngine, n: int, seed: int) -> float:
    """Prompt tokens per second of a whole-prompt prefill (time to the first token)."""
    t = time.perf_counter()
    engine.generate([random_prompt(n, seed)], SamplingParams(max_tokens=1, temperature=0.0))
    return n / (time.perf_counter() - t)


def on_path(path: str | None, fn: Callable[[int], float]) -> Callable[[int], float]:
    """`fn` run on kernel path `path` (engine.native.use_kernel_path; None: as it is)."""
    def run(r: int) -> float:
        if path:
            native.use_kernel_path(path)
        return fn(r)
    return run


class DecodeRun:
    """`batch` prompts of `prompt` tokens (64) prefilled on `engine` (its matmuls on kernel path `path`, when
    given), then decoded one timed step at a time."""

    def __init__(self, engine: LLMEngine, batch: int, seed: int, path: str | None = None, steps: int = DECODE_STEPS,
                 prompt: int = DECODE_PROMPT):
        self.engine, self.path = engine, path
        if path:
            native.use_kernel_path(path)
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        self.seqs = [engine.add_request(f"d{batch}-{seed}-{i}", random_prompt(prompt, seed * 1000 + i), params)
                     for i in range(batch)]
        while any(s.num_computed < len(s.prompt_ids) for s in self.seqs):  # one step, with decode_step_budget
            engine.step()
            if not engine.last_plan_size:
                raise RuntimeError(f"a batch of {batch} does not fit the engine's KV blocks or max_batch")
        engine.step()

    def step(self) -> float:
        """Seconds of one decode step of the whole batch."""
        if self.path:
            native.use_kernel_path(self.path)
        t = time.perf_counter()
        out = self.engine.step()
        elapsed = time.perf_counter() - t
        if len(out) != len(self.seqs) or any(o.finish_reason for o in out):
            raise RuntimeError(f"a decode step of {len(out)} rows, not the batch's {len(self.seqs)}")
        return elapsed

    def close(self) -> None:
        for s in self.seqs:
            self.engine.abort(s.request_id)


def decode_step_budget(batches: list[int], prefills: list[int], prompt: int = DECODE_PROMPT) -> int:
    """max_step_tokens for the bench's engines: the longest prompt measured, or every decode batch's prompts
    (of `prompt` tokens) in one step. (Prefilled in chunks, the first rows would decode while the last were still
    prefilling, and finish before the timed steps ended: the "batch 32" steps were of fewer rows.)"""
    return max([*prefills, *(b * prompt for b in batches)])


def interleaved(runners: dict[str, Callable[[int], float]], rounds: int) -> dict[str, float]:
    """Median of `rounds` runs of each runner, the runners taking turns (one warm-up each first)."""
    for fn in runners.values():
        fn(-1)
    got: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(rounds):
        for name, fn in runners.items():
            got[name].append(fn(r))
    return {name: statistics.median(v) for name, v in got.items()}


def interleaved_decode(starts: dict[str, Callable[[int], DecodeRun]], whole: dict[str, Callable[[int], float]],
                        batch: int, rounds: int, probe: peaks.ReadProbe | None = None,
                        bandwidth: list[float] | None = None) -> dict[str, float]:
    """Output tok/s of each engine over `rounds` x DECODE_STEPS steps, the engines taking turns step by step
    (each holding its own batch), so that a minute of a slower machine slows every engine alike; `whole`
    runners (llama-server: one call decodes every step) take their turn after each round. A warm-up round first.
    With `probe`, a read of memory takes its turn after every PROBE_EVERY steps of every engine, its rate added
    to `bandwidth` (after every step, it made the steps after it ~1.1x slower: it leaves the caches and the TLB
    colder than a step leaves them for the next)."""
    times: dict[str, list[float]] = {name: [] for name in starts}
    got: dict[str, list[float]] = {name: [] for name in whole}
    for r in [-1, *range(rounds)]:
        runs = {name: fn(r) for name, fn in starts.items()}
        try:
            for i in range(DECODE_STEPS):
                for name, run in runs.items():
                    t = run.step()
                    if r >= 0:
                        times[name].append(t)
                if probe is not None and bandwidth is not None and i % PROBE_EVERY == PROBE_EVERY - 1:
                    rate = probe.rate()
                    if r >= 0:
                        bandwidth.append(rate)
        finally:
            for run in runs.values():
                run.close()
        for name, fn in whole.items():
            value = fn(r)
            if r >= 0:
                got[name].append(value)
    return {**{name: batch / statistics.median(t) for name, t in times.items()},
            **{name: statistics.median(v) for name, v in got.items()}}
