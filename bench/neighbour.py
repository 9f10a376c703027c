"""A neighbour that takes a core in short bursts, as the gateway, nats-server and the client take a worker's cores
for each streamed token: busy ``--busy-ms``, asleep ``--idle-ms``, over and over, on one core.

    python -m bench.neighbour [--cpu N] [--busy-ms 0.3] [--idle-ms 3] [--seconds 300]

Run it beside ``bench.engine`` (or the engine of another commit) to see what such bursts cost a decode step whose
threads fill every core (docs/benchmarks.md, "work a thread may not finish").
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def burst(busy_s: float, idle_s: float, until: float) -> int:
    """Spin ``busy_s``, sleep ``idle_s``, until the monotonic clock reads ``until``; the bursts done."""
    done = 0
    while time.monotonic() < until:
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        time.sleep(idle_s)
        done += 1
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.neighbour", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", type=int, default=None, help="the core (default: the last this process may use)")
    p.add_argument("--busy-ms", type=float, default=0.3)
    p.add_argument("--idle-ms", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=300.0, help="then it exits (default 300)")
    args = p.parse_args(argv)
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    n = burst(args.busy_ms / 1000, args.idle_ms / 1000, time.monotonic() + args.seconds)
    print(f"bench.neighbour: {n} bursts of {args.busy_ms:g} ms on core {cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
