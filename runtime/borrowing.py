"""BorrowedCores: a worker computes on another worker's cores only while that worker leaves them idle.

Why: in a split on few cores the decode worker's core idles between its streams while the prefill worker
has a long prompt on one core (docs/benchmarks.md, experiment 1). Idle priority (``SCHED_IDLE``) gives decode
its core back at once, but torch and the kernels split each operation evenly between their threads, so a
prefill thread that decode pushes off its core holds up the whole operation: beside an emulated decode busy
all the time, prefill on both cores at idle priority ran at 0.78x its speed on its own core alone
(``python -m bench.borrowed_cores``). So before each layer the worker decides how many threads that layer
uses: as many as its own cores once a layer's threads waited for a core (their run-queue delay,
``/proc/self/task/*/schedstat``), own plus borrowed again when the borrowed cores were idle for a few clock
ticks (``/proc/stat``) or, failing that, after a backoff that doubles while they stay busy. The affinity mask
keeps every core throughout (``_use``).
"""

from __future__ import annotations

import os
import time

from runtime.metrics import WORKER_LAYERS

#: give them back when this process's threads waited for a core this share of a layer's wall time (with one
#: borrowed core beside one own, borrowing stops paying at about 0.5: the thread pushed off a core finishes its
#: even share of each operation late)
WAIT_TO_RETURN = 0.3
#: borrow again when the borrowed cores were idle this share of at least MIN_TICKS clock ticks (10 ms each),
#: counted over the last WINDOW_TICKS at most
IDLE_TO_BORROW, MIN_TICKS, WINDOW_TICKS = 0.6, 2, 5
#: the most layers to stay off them before trying again (~2 prefill steps of 256 tokens)
MAX_BACKOFF = 64


def cpu_idle_ticks(cpus: list[int], stat: str = "/proc/stat") -> tuple[int, int]:
    """(idle, total) clock ticks of ``cpus`` since boot (idle counts iowait too)."""
    idle = total = 0
    wanted = {f"cpu{c}" for c in cpus}
    with open(stat) as f:
        for line in f:
            name, *values = line.split()
            if name in wanted:
                ticks = [int(v) for v in values[:8]]
                idle += ticks[3] + ticks[4]
                total += sum(ticks)
    return idle, total


class ThreadWaits:
    """Nanoseconds this process's threads have spent ready to run but waiting for a core, read before every
    layer from files kept open: opening each thread's ``schedstat`` every time cost ~0.3 ms a layer with a
    worker's threads (~9 ms of a 256-token chunk), reading open ones a tenth of that."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def ns(self) -> int:
        tids = os.listdir("/proc/self/task")
        total = 0
        for tid in tids:
            try:
                fd = self._fds.get(tid)
                if fd is None:
                    fd = self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
                total += int(os.pread(fd, 128, 0).split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):  # a thread that ended meanwhile
                if (fd := self._fds.pop(tid, None)) is not None:  # a later thread may get its id: open afresh
                    os.close(fd)
        for gone in self._fds.keys() - set(tids):
            os.close(self._fds.pop(gone))
        return total


class BorrowedCores:
    """Own cores always; borrowed ones layer by layer: off them as soon as a layer's threads waited for a core,
    back on once they were idle for a few clock ticks, or to try again after a backoff that doubles while their
    owner stays busy."""

    def __init__(self, own: list[int], borrowed: list[int]):
        import torch

        self._torch = torch
        self.own, self.borrowed = sorted(own), sorted(borrowed)
        self.borrowing = True  # place() started the process on both
        self._counted = {True: WORKER_LAYERS.labels(cores="borrowed"), False: WORKER_LAYERS.labels(cores="own")}
        self._backoff = 0  # layers left on the own cores before trying the borrowed ones again
        self._penalty = 1  # the next backoff
        self._waits = ThreadWaits()
        self._mark_wait, self._mark_t = self._waits.ns(), time.perf_counter()
        self._mark_idle = (0, 0)  # the borrowed cores' (idle, total) ticks, read when it stops borrowing

    def _use(self, borrowing: bool) -> None:
        # threads only: the process keeps every core in its mask, so the kernel can move a thread that decode
        # pushed aside to an idle core (pinning it back to its own cores would pile every thread onto them, and
        # a core running only idle-priority threads counts as idle to the kernel, so they would stay piled)
        self._torch.set_num_threads(len(self.own) + (len(self.borrowed) if borrowing else 0))
        self.borrowing = borrowing

    def before_layer(self) -> None:
        """Borrow or return the cores for the layer about to run, from how the last one went."""
        if self.borrowing:
            wait, now = self._waits.ns(), time.perf_counter()
            waited = (wait - self._mark_wait) / max(1.0, (now - self._mark_t) * 1e9)
            self._mark_wait, self._mark_t = wait, now
            if waited > WAIT_TO_RETURN:  # their owner is back
                self._use(False)
                self._backoff, self._penalty = self._penalty, min(2 * self._penalty, MAX_BACKOFF)
                self._mark_idle = cpu_idle_ticks(self.borrowed)
            else:
                self._penalty = 1
        else:
            self._backoff -= 1
            idle, total = cpu_idle_ticks(self.borrowed)
            d_idle, d_total = idle - self._mark_idle[0], total - self._mark_idle[1]
            if self._backoff <= 0 or (d_total >= MIN_TICKS and d_idle >= IDLE_TO_BORROW * d_total):
                self._use(True)
                self._mark_wait, self._mark_t = self._waits.ns(), time.perf_counter()
            elif d_total >= WINDOW_TICKS:  # judge by the last few ticks alone
                self._mark_idle = (idle, total)
        self._counted[self.borrowing].inc()
