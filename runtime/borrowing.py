"""Cores a decode worker lends a prefill worker: the prefill worker computes on them only while decode lends them.

Why: in a split on few cores the decode worker's core idles between its steps while the prefill worker has a
long prompt on one core (docs/benchmarks.md, experiment 1). The prefill worker runs at idle priority
(``SCHED_IDLE``), so decode gets a core back at once, but the kernels split each operation between their
threads, so a prefill thread that decode pushes off its core holds up the whole operation for the whole decode
step. Guessing from the outside (run-queue delays, ``/proc/stat`` idle ticks) borrowed about half the layers
decode left room for and still caught decode steps mid-layer.

So the two workers say it to each other, a file per core in ``/dev/shm`` (``CoreLease``): the decode worker
marks the core lent while it waits for work or for its next paced step, and holds the file's ``flock`` (shared,
so decode workers on one core never wait for each other) through each step; the prefill worker runs a layer on
the core too only when it is lent and it holds the same lock exclusively, and lets go before the next layer once
the core is no longer lent. A decode step waits for at most the borrowed layer in flight (up to a deadline, past
which it runs anyway), and no borrowed layer is caught halfway. The locks die with their process, so a crashed worker holds nothing.

A busy decode worker steps back to back and lends nothing; ``--lend-step-ms`` paces its steps while a long
prompt is prefilled elsewhere for it (actors/runner.py), which is what gives the borrower whole layers.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time

from runtime.logs import Throttled
from runtime.metrics import (
    DECODE_LATE_STEPS,
    DECODE_LENT_SECONDS,
    DECODE_TAKE_WAIT,
    WORKER_LAYER_SECONDS,
    WORKER_LAYERS,
)
from runtime.placement import parse_cpus

log = logging.getLogger(__name__)
late_warnings = Throttled(log)

LENT, KEPT = b"\x01", b"\x00"


class CoreLease:
    """One core's file ``/dev/shm/tandem-<namespace>-core<N>``: byte 0 says whether its decode worker lends it
    (lent until a decode worker says otherwise); its ``flock`` is held by whoever computes on it: shared by the
    decode workers pinned there (two on one core never wait for each other), exclusive by a borrower."""

    def __init__(self, namespace: str, core: int) -> None:
        self.path = f"/dev/shm/tandem-{namespace}-core{core}"
        self.held = False
        self.fd = self._open()

    def _open(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size < 1:
            os.pwrite(fd, LENT, 0)
        return fd

    def _ours(self) -> bool:
        """Whether the path still names the file this lease has open."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def refresh(self) -> None:
        """Open the path afresh if its decode worker left and took the file with it (not while held)."""
        if not self.held and not self._ours():
            os.close(self.fd)
            self.fd = self._open()

    def lent(self) -> bool:
        return os.pread(self.fd, 1, 0) != KEPT

    def mark(self, lent: bool) -> None:
        os.pwrite(self.fd, LENT if lent else KEPT, 0)

    def try_hold(self, shared: bool = False) -> bool:
        """Hold the lock unless another process holds it in a way that excludes this one (never blocks):
        ``shared`` for a decode worker (several may share a core), exclusive for a borrower."""
        if not self.held:
            try:
                fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.held = True
        return True

    def let_go(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.held = False

    def close(self, remove: bool = False) -> None:
        """Let go; with ``remove``, mark the core lent and take the file away (a decode worker leaving)."""
        self.let_go()
        if remove:
            self.mark(True)
            if self._ours():
                os.unlink(self.path)
        os.close(self.fd)


class LentCores:
    """The decode worker's side: ``lend`` before it waits, ``take`` before each step."""

    def __init__(self, namespace: str, cores: list[int], deadline_s: float = 0.05) -> None:
        self.leases = [CoreLease(namespace, c) for c in sorted(cores)]
        self.deadline_s = deadline_s
        self.lending: bool | None = None  # None: not said yet
        self.late = 0  # steps that ran while a borrowed layer still held a core (past the deadline)
        self.lent_at = 0.0  # monotonic: when it last lent them

    def lend(self) -> None:
        if self.lending is not True:
            for lease in self.leases:
                lease.mark(True)
                lease.let_go()
            self.lending = True
            self.lent_at = time.monotonic()

    def take(self) -> None:
        """Stop lending, and wait for a borrowed layer in flight to end (``deadline_s`` at most)."""
        if self.lending is False:
            return
        for lease in self.leases:
            lease.mark(False)
        asked = time.monotonic()
        if self.lending:
            DECODE_LENT_SECONDS.inc(asked - self.lent_at)
        deadline = asked + self.deadline_s
        for lease in self.leases:
            while not lease.try_hold(shared=True):
                if time.monotonic() > deadline:
                    self.late += 1
                    DECODE_LATE_STEPS.inc()
                    late_warnings.warning("late", "a step started while a borrower still computed on core lease "
                                          "%s after %.0f ms (%d such steps)", lease.path, 1000 * self.deadline_s,
                                          self.late)
                    break
                time.sleep(0.0002)
        DECODE_TAKE_WAIT.observe(time.monotonic() - asked)
        self.lending = False

    def close(self) -> None:
        """Leave: the cores lent for good, the files gone."""
        for lease in self.leases:
            lease.close(remove=True)


class BorrowedCores:
    """The prefill worker's side: own cores always; before each layer the borrowed ones too when their decode
    worker lends them all and it holds their locks; after the layers, back to its own."""

    def __init__(self, namespace: str, own: list[int], borrowed: list[int]) -> None:
        import torch

        self._torch = torch
        self.own, self.borrowed = sorted(own), sorted(borrowed)
        self.leases = [CoreLease(namespace, c) for c in self.borrowed]
        self.borrowing = True
        self._use(False)
        self._counted = {True: WORKER_LAYERS.labels(cores="borrowed"), False: WORKER_LAYERS.labels(cores="own")}
        self._timed = {True: WORKER_LAYER_SECONDS.labels(cores="borrowed"),
                       False: WORKER_LAYER_SECONDS.labels(cores="own")}
        self._layer_at = 0.0  # monotonic: when the layer in flight began (0: none)

    def _use(self, borrowing: bool) -> None:
        # threads only: the process keeps every core in its mask, so the kernel can move a thread that decode
        # pushed aside to an idle core
        if borrowing != self.borrowing:
            self._torch.set_num_threads(len(self.own) + (len(self.borrowed) if borrowing else 0))
            self.borrowing = borrowing

    def before_layer(self) -> None:
        """Borrow the cores for the layer about to run if they are lent, else give them back."""
        self._layer_ended()
        if all(lease.lent() for lease in self.leases) and all(lease.try_hold() for lease in self.leases):
            self._use(True)
        else:
            self._give_back()
        self._counted[self.borrowing].inc()
        self._layer_at = time.monotonic()

    def _layer_ended(self) -> None:
        if self._layer_at:
            self._timed[self.borrowing].inc(time.monotonic() - self._layer_at)
            self._layer_at = 0.0

    def close(self) -> None:
        for lease in self.leases:
            lease.close()

    def _give_back(self) -> None:
        self._use(False)
        for lease in self.leases:
            lease.let_go()

    def after_layers(self) -> None:
        """Back to the own cores, letting go of the borrowed ones' locks; a lease file its decode worker took away
        is opened afresh here, once a forward pass."""
        self._layer_ended()
        self._give_back()
        for lease in self.leases:
            lease.refresh()


def lent_cores(role: str, namespace: str, cpus: str) -> LentCores | None:
    """The cores a worker lends, or None: only a decode worker pinned to cores (``--cpus``) lends them, to a
    prefill worker that borrows them."""
    return LentCores(namespace, parse_cpus(cpus)) if role == "decode_only" and cpus else None
