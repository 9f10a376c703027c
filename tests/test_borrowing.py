"""runtime/borrowing.py: a prefill worker computes on a decode worker's core only while that worker lends it, a
decode step waits for at most the borrowed layer in flight, and a worker that leaves holds nothing. The two sides
are separate processes where it matters (the lock is the kernel's, per open file)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from runtime.borrowing import BorrowedCores, CoreLease, LentCores
from runtime.metrics import (
    DECODE_LATE_STEPS,
    DECODE_LENT_SECONDS,
    DECODE_TAKE_WAIT,
    WORKER_LAYER_SECONDS,
    WORKER_LAYERS,
)


def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def test_layers_borrow_a_lent_core_and_never_a_kept_one() -> None:
    ns, threads = namespace(), torch.get_num_threads()
    lent = LentCores(ns, [7])
    cores = BorrowedCores(ns, [0], [7])
    try:
        borrowed_before = WORKER_LAYERS.labels(cores="borrowed")._value.get()
        cores.before_layer()  # no decode worker has said anything: the core is free
        assert cores.borrowing and torch.get_num_threads() == 2
        lent.take()  # stops lending; the borrower holds the lock, so the step runs at the deadline
        assert lent.late == 1
        cores.before_layer()  # sees the core kept: back to its own before the next layer
        assert not cores.borrowing and torch.get_num_threads() == 1
        assert not cores.leases[0].held
        lent.lend()
        lent.take()  # nobody holds it now: taken at once, not late
        assert lent.late == 1 and lent.leases[0].held
        cores.before_layer()
        assert not cores.borrowing  # kept through the step
        lent.lend()
        cores.before_layer()
        assert cores.borrowing and cores.leases[0].held
        cores.after_layers()  # the forward pass is over: own cores, lock let go
        assert not cores.borrowing and not cores.leases[0].held and torch.get_num_threads() == 1
        assert WORKER_LAYERS.labels(cores="borrowed")._value.get() - borrowed_before == 2
    finally:
        cores.close()
        lent.close()
        torch.set_num_threads(threads)
    assert not Path(lent.leases[0].path).exists()  # the decode worker took its file with it


def test_the_seconds_lent_waited_for_and_borrowed_are_counted() -> None:
    """What an operator divides to see how much of what decode lends prefill uses (docs/metrics.md)."""
    ns, threads = namespace(), torch.get_num_threads()
    lent = LentCores(ns, [7], deadline_s=0.02)
    cores = BorrowedCores(ns, [0], [7])
    seconds = {c: WORKER_LAYER_SECONDS.labels(cores=c) for c in ("own", "borrowed")}
    before = {c: m._value.get() for c, m in seconds.items()}
    lent_before, late_before = DECODE_LENT_SECONDS._value.get(), DECODE_LATE_STEPS._value.get()
    waits_before = sum(b.get() for b in DECODE_TAKE_WAIT._buckets)
    try:
        lent.lend()
        cores.before_layer()
        time.sleep(0.05)  # a borrowed layer
        lent.take()  # it is still in flight: the step waits its deadline, then runs late
        cores.before_layer()
        time.sleep(0.03)  # an own layer
        cores.after_layers()
        lent_s = DECODE_LENT_SECONDS._value.get() - lent_before
        assert 0.05 <= lent_s < 1.0
        assert DECODE_LATE_STEPS._value.get() - late_before == 1
        assert sum(b.get() for b in DECODE_TAKE_WAIT._buckets) - waits_before == 1
        borrowed_s = seconds["borrowed"]._value.get() - before["borrowed"]
        own_s = seconds["own"]._value.get() - before["own"]
        assert 0.05 <= borrowed_s < 1.0 and 0.03 <= own_s < 1.0
    finally:
        cores.close()
        lent.close()
        torch.set_num_threads(threads)


BORROWER = """
import sys, time
from runtime.borrowing import BorrowedCores
cores = BorrowedCores(sys.argv[1], [0], [7])
for line in sys.stdin:
    if line.startswith("layer"):
        cores.before_layer()
        print("borrowing" if cores.borrowing else "own", flush=True)
    elif line.startswith("hold"):  # a layer that takes this long, then the layers' end
        cores.before_layer()
        print("borrowing" if cores.borrowing else "own", flush=True)
        time.sleep(float(line.split()[1]))
        released = time.monotonic()
        cores.after_layers()
        print(released, flush=True)
"""


def borrower(ns: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BORROWER, ns], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])


def ask(proc: subprocess.Popen, line: str) -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def lent_and_held(ns: str, deadline_s: float, seconds: float) -> tuple[LentCores, subprocess.Popen]:
    """A decode side that lends core 7, and a borrower process that runs a layer there for ``seconds``."""
    lent = LentCores(ns, [7], deadline_s=deadline_s)
    lent.lend()
    proc = borrower(ns)
    assert ask(proc, f"hold {seconds}") == "borrowing"
    return lent, proc


def test_a_step_waits_for_the_borrowed_layer_in_flight_then_keeps_the_core() -> None:
    lent, proc = lent_and_held(namespace(), 30.0, 0.4)
    try:
        lent.take()
        taken = time.monotonic()
        released = float(proc.stdout.readline())
        assert taken >= released and lent.late == 0  # it waited for the layer, not past it
        assert ask(proc, "layer") == "own"  # the core is kept while the step runs
        lent.lend()
        assert ask(proc, "layer") == "borrowing"
    finally:
        proc.kill()
        proc.wait()
        lent.close()


def test_a_borrower_that_never_lets_go_costs_a_step_the_deadline_and_dies_holding_nothing() -> None:
    lent, proc = lent_and_held(namespace(), 0.3, 3600)
    try:
        started = time.monotonic()
        lent.take()
        assert time.monotonic() - started >= 0.3 and lent.late == 1  # the step ran anyway
        proc.kill()
        proc.wait()
        lent.lend()
        lent.take()  # the kernel dropped the dead borrower's lock
        assert lent.late == 1 and lent.leases[0].held
    finally:
        proc.kill()
        proc.wait()
        lent.close()


def test_a_borrower_follows_a_decode_worker_that_restarted() -> None:
    ns = namespace()
    cores = BorrowedCores(ns, [0], [7])
    first = LentCores(ns, [7])
    first.take()
    cores.before_layer()
    assert not cores.borrowing
    first.close()  # leaves: the file goes, and with it the mark
    cores.after_layers()  # the borrower opens the path afresh
    second = LentCores(ns, [7])
    try:
        second.take()
        cores.before_layer()
        assert not cores.borrowing  # it reads the new worker's mark, not the old file's
        second.lend()
        cores.before_layer()
        assert cores.borrowing
    finally:
        cores.close()
        second.close()


def test_a_new_lease_file_says_lent_and_a_second_opener_reads_the_mark() -> None:
    ns = namespace()
    lease = CoreLease(ns, 7)
    try:
        assert lease.lent() and os.path.getsize(lease.path) == 1
        lease.mark(False)
        other = CoreLease(ns, 7)
        assert not other.lent()  # the file exists: its mark is kept, not reset
        other.close()
    finally:
        lease.close(remove=True)
    assert not Path(lease.path).exists()


def test_bench_table_gives_each_placement_against_its_own_core() -> None:
    import argparse

    from bench import borrowed_cores as bench

    table = {"own core": [500.0, 490.0, 480.0, 470.0], "idle priority": [1000.0, 600.0, 470.0, 380.0],
             "borrowed": [950.0, 640.0, 520.0, 465.0]}
    text = bench.markdown(table, argparse.Namespace(prompt=1024, prompts=5))
    assert "| always idle | 500 | 1000 (2.00x) | 950 (1.90x) |" in text
    assert "| 0.7 / 0.5 | 490 | 600 (1.22x) | 640 (1.31x) |" in text
    assert "| always busy | 470 | 380 (0.81x) | 465 (0.99x) |" in text


def test_decode_workers_sharing_a_core_never_wait_for_each_other_and_both_keep_it_from_a_borrower() -> None:
    ns = namespace()
    first, second = LentCores(ns, [7], deadline_s=5.0), LentCores(ns, [7], deadline_s=5.0)
    proc = borrower(ns)
    try:
        first.take()
        started = time.monotonic()
        second.take()
        assert time.monotonic() - started < 2.0 and first.late == second.late == 0
        second.lend()  # one of them idles: the mark says lent, but the other still computes there
        assert ask(proc, "layer") == "own"
        first.lend()
        assert ask(proc, "layer") == "borrowing"
    finally:
        proc.kill()
        proc.wait()
        first.close()
        second.close()
