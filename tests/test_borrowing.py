"""runtime/borrowing.py: a worker's steps spread over borrowed cores while their owner idles, and keep off
them while it computes. Checked on real processes: a busy loop pinned to the borrowed core is the owner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from runtime.borrowing import ThreadWaits, cpu_idle_ticks
from runtime.placement import available_cpus
from tests.harness.wait import wait_until


def test_idle_ticks_of_the_named_cores(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 100 5 0 0 0 0 0\n"
                    "cpu0 1 2 3 40 1 0 1 0 0 0\n"
                    "cpu1 5 0 5 60 4 1 0 0 0 0\n"
                    "cpu10 100 0 0 1 0 0 0 0 0 0\n"
                    "intr 12345\n")
    assert cpu_idle_ticks([1], str(stat)) == (64, 75)  # idle + iowait, and every state
    assert cpu_idle_ticks([0, 1], str(stat)) == (64 + 41, 75 + 48)


def test_thread_waits_read_every_thread_and_let_go_of_ended_ones() -> None:
    def direct() -> int:
        return sum(int(Path(f"/proc/self/task/{t}/schedstat").read_text().split()[1]) for t in os.listdir("/proc/self/task"))

    waits = ThreadWaits()
    before = direct()
    assert before <= waits.ns() <= direct()  # the same counters, which only grow
    done = threading.Event()
    extra = threading.Thread(target=done.wait)
    extra.start()
    waits.ns()
    assert set(waits._fds) == set(os.listdir("/proc/self/task"))  # the new thread's file too
    done.set()
    extra.join()  # the thread may outlive join() by a moment
    wait_until(lambda: waits.ns() >= 0 and str(extra.native_id) not in waits._fds, 10, "its file closed")


LAYERS = """
import json, os, subprocess, sys, time
import torch
from runtime.borrowing import BorrowedCores
from runtime.placement import pin_process, run_at_idle_priority

own, lent = OWN, LENT
pin_process([own, lent]); run_at_idle_priority(); torch.set_num_threads(2)
cores = BorrowedCores([own], [lent])
a = torch.randn(384, 384)


def layer():
    cores.before_layer()
    where = [int(cores.borrowing), torch.get_num_threads(), sorted(os.sched_getaffinity(0))]
    t = time.perf_counter()
    while time.perf_counter() - t < 0.1:
        a @ a
    return where


runs = {"idle": [layer() for _ in range(3)]}
owner = subprocess.Popen([sys.executable, "-c", "import os\\nos.sched_setaffinity(0, [LENT])\\nwhile True: pass"])
time.sleep(0.3)
runs["owner busy"] = [layer() for _ in range(12)]
owner.kill(); owner.wait()
runs["owner gone"] = [layer() for _ in range(12)]
print(json.dumps(runs))
"""


def test_layers_borrow_a_core_only_while_its_owner_idles() -> None:
    cpus = available_cpus()
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    own, lent = cpus[:2]
    code = LAYERS.replace("OWN", str(own)).replace("LENT", str(lent))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    runs = json.loads(res.stdout)
    # the mask keeps both cores throughout: only the thread count moves
    both, alone = [1, 2, [own, lent]], [0, 1, [own, lent]]
    assert runs["idle"] == [both] * 3
    # with the owner busy: off its core after the first layer that waited for it, then only a try now and
    # then, each after a longer backoff (1, 2, 4 layers...), never two layers running
    busy = runs["owner busy"]
    assert all(w in (both, alone) for w in busy)
    tries = [i for i, w in enumerate(busy) if w == both]
    assert busy[-1] == alone and len(tries) <= 4 and all(b - a > 1 for a, b in zip(tries, tries[1:])), busy
    # the owner gone: its core idle for a couple of clock ticks (or the backoff over), then borrowed for good
    gone = runs["owner gone"]
    assert gone[-3:] == [both] * 3, gone


def test_bench_table_gives_each_placement_against_its_own_core() -> None:
    import argparse

    from bench import borrowed_cores as bench

    table = {"own core": [500.0, 490.0, 480.0, 470.0], "idle priority": [1000.0, 600.0, 470.0, 380.0],
             "borrowed": [950.0, 640.0, 520.0, 465.0]}
    text = bench.markdown(table, argparse.Namespace(prompt=1024, prompts=5))
    assert "| always idle | 500 | 1000 (2.00x) | 950 (1.90x) |" in text
    assert "| 0.7 / 0.5 | 490 | 600 (1.22x) | 640 (1.31x) |" in text
    assert "| always busy | 470 | 380 (0.81x) | 465 (0.99x) |" in text
