"""A prefill worker borrowing a decode worker's core: prefill speed beside an emulated decode load, one run.

    python -m bench.borrowed_cores [--prompt 1024] [--prompts 5] [--write]

A prefill engine computes ``--prompts`` prompts of ``--prompt`` tokens (chunks of 256, as a prefill_only
worker steps) on the machine's first two cores while a stand-in for a decode worker, pinned to the second core at
normal priority, alternates busy stretches (steps of 7 ms of computing with 0.2 ms between) and idle ones, of
exponentially distributed lengths; like a decode worker, it takes its core back before each step and lends it
while it idles (``runtime.borrowing.LentCores``). Loads, as mean busy / idle seconds: 0 / always idle, 0.7 / 0.5 (streams
coming and going), 2.0 / 0.3 (mostly busy), always busy. Placements, each in a fresh process that goes
through every load:

- ``own core``: one thread on the first core only (``tandem up --prefill-cpus 0 --decode-cpus 1``);
- ``idle priority``: two threads on both cores at ``SCHED_IDLE`` (``--idle-priority``), left to the kernel;
- ``borrowed``: the same, with ``runtime.borrowing.BorrowedCores`` on the second core only while it is lent, layer
  by layer (``tandem up``'s default).

The table gives median prompt tok/s and each placement's ratio to ``own core`` measured under the same load.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from runtime.placement import available_cpus

LOADS = [(0.0, 1.0), (0.7, 0.5), (2.0, 0.3), (1.0, 0.0)]  # mean busy / idle seconds of the emulated decode
PLACEMENTS = ["own core", "idle priority", "borrowed"]


def emulated_decode(core: int, busy_s: float, idle_s: float, stop: Any, seed: int, namespace: str) -> None:
    """Busy stretches of 7 ms steps, idle stretches between, on ``core`` at normal priority, lending the core
    while idle."""
    from runtime.borrowing import LentCores

    os.sched_setaffinity(0, {core})
    lent = LentCores(namespace, [core])
    rnd = random.Random(seed)
    while not stop.is_set():
        end = time.perf_counter() + (rnd.expovariate(1 / busy_s) if busy_s else 0.0)
        while time.perf_counter() < end:
            lent.take()
            step_end = time.perf_counter() + 0.007
            while time.perf_counter() < step_end:
                pass
            time.sleep(0.0002)
        if idle_s:
            lent.lend()
            time.sleep(rnd.expovariate(1 / idle_s))
    lent.close()


def measure(placement: str, prompt: int, prompts: int, loads: list[tuple[float, float]]) -> list[float]:
    """In this process: place it, load the model, and return median prompt tok/s per load."""
    import torch

    from engine.engine import EngineConfig, LLMEngine
    from engine.loader import load_model
    from engine.model_files import DEFAULT_MODEL
    from engine.params import SamplingParams
    from runtime.borrowing import BorrowedCores
    from runtime.placement import pin_process, run_at_idle_priority

    own, lent = available_cpus()[:2]
    pin_process([own] if placement == "own core" else [own, lent])
    torch.set_num_threads(1 if placement == "own core" else 2)
    if placement != "own core":
        run_at_idle_priority()
    engine = LLMEngine(load_model(DEFAULT_MODEL, "float32", "auto"),
                       EngineConfig(dtype="float32", num_blocks=prompt // 16 + 64, max_batch=4, max_step_tokens=256,
                                    enable_prefix_cache=False))
    namespace = f"bench-borrowed-{os.getpid()}"
    if placement == "borrowed":
        cores = BorrowedCores(namespace, [own], [lent])
        engine.model.before_layer, engine.model.after_layers = cores.before_layer, cores.after_layers
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def tokens(seed: int) -> list[int]:
        return torch.randint(100, 40000, (prompt,), generator=torch.Generator().manual_seed(seed)).tolist()

    engine.generate([tokens(0)], params)  # warm-up
    speeds = []
    for n, (busy, idle) in enumerate(loads):
        stop = mp.Event()
        decode = mp.Process(target=emulated_decode, args=(lent, busy, idle, stop, 7, namespace))
        decode.start()
        time.sleep(0.3)
        runs = []
        for i in range(prompts):
            started = time.perf_counter()
            engine.generate([tokens(1 + n * prompts + i)], params)
            runs.append(prompt / (time.perf_counter() - started))
        stop.set()
        decode.join()
        speeds.append(statistics.median(runs))
    if placement == "borrowed":
        cores.close()
    return speeds


def markdown(table: dict[str, list[float]], args: argparse.Namespace) -> str:
    lines = ["## A prefill worker borrowing the decode core (bench/borrowed_cores.py)", "",
             f"`python -m bench.borrowed_cores --prompt {args.prompt} --prompts {args.prompts}`: median prompt tok/s of "
             f"{args.prompt}-token prompts (chunks of 256) beside an emulated decode worker on the second core; the "
             f"ratio is to `own core` under the same load.", "",
             "| decode load (busy / idle s) | " + " | ".join(PLACEMENTS) + " |",
             "|---|" + "---:|" * len(PLACEMENTS)]
    for i, (busy, idle) in enumerate(LOADS):
        name = "always idle" if not busy else "always busy" if not idle else f"{busy:g} / {idle:g}"
        base = table["own core"][i]
        cells = [f"{table[p][i]:.0f}" + ("" if p == "own core" else f" ({table[p][i] / base:.2f}x)")
                 for p in PLACEMENTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.borrowed_cores", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--prompts", type=int, default=5, help="prompts per placement and load (default 5)")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    p.add_argument("--placement", default=None, help=argparse.SUPPRESS)  # a child: measure one and print json
    args = p.parse_args(argv)
    if args.placement:
        print(json.dumps(measure(args.placement, args.prompt, args.prompts, LOADS)))
        return 0
    if len(available_cpus()) < 2:
        print("bench.borrowed_cores needs two cores", file=sys.stderr)
        return 2
    table = {}
    for placement in PLACEMENTS:
        out = subprocess.run([sys.executable, "-m", "bench.borrowed_cores", "--placement", placement,
                              "--prompt", str(args.prompt), "--prompts", str(args.prompts)],
                             check=True, capture_output=True, text=True).stdout
        table[placement] = json.loads(out.strip().splitlines()[-1])
        print(f"{placement}: " + ", ".join(f"{v:.0f}" for v in table[placement]), flush=True)
    text = markdown(table, args)
    print(text)
    if args.write:
        from bench.report import write_section

        write_section("borrowed-cores", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
