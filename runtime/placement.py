"""Which cores and which device each worker runs on.

Why: the point of disaggregation is that prefill and decode do not fight over the same
hardware (DESIGN §2, Placement). On a GPU host that is one device per role; on a CPU host
it is cores — a prefill worker pinned to some, a decode worker to others, each with as many
torch threads as it has cores, so the threads of all workers add up to at most the host's
cores (oversubscription made a prefill 20× slower here).

This module parses CPU lists (``0``, ``2-3``, ``0,2-3``) and device lists (``cuda:0,cuda:1``),
splits them among a role's workers, chooses the default layout of ``tandem up``, and pins a
process (every one of its threads) to its cores.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
#: a decode worker that lends prefill its cores starts a step at most this often while a long prompt is prefilled
#: for it: its streams' tokens come that far apart then, and the prefill worker gets the cores in between
#: (docs/benchmarks.md, "a split that lends its decode core")
LEND_STEP_MS = 50.0


def available_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    return sorted(os.sched_getaffinity(0))


def format_cpus(cpus: list[int] | tuple[int, ...] | set[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2,5`` (the kernel's own list syntax)."""
    out: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def parse_cpus(text: str, flag: str = "--cpus", allowed: list[int] | None = None) -> list[int]:
    """A CPU list (``0``, ``2-3``, ``0,2-3``) as sorted core numbers; ValueError names ``flag`` and why.

    Every core must be one this process may use (``allowed``, default its affinity mask).
    """
    allowed = available_cpus() if allowed is None else allowed
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"{flag} {text!r}: {part!r} is not a core number or a range like 2-3")
        low, high = int(m.group(1)), int(m.group(2) or m.group(1))
        if high < low:
            raise ValueError(f"{flag} {text!r}: the range {part} goes down; write {high}-{low}")
        cpus.update(range(low, high + 1))
    missing = sorted(cpus - set(allowed))
    if missing:
        raise ValueError(f"{flag} {text!r}: core{'s' if len(missing) > 1 else ''} {format_cpus(missing)} "
                         f"not available here (this process may use cores {format_cpus(allowed)})")
    return sorted(cpus)


def parse_devices(text: str, flag: str) -> list[str]:
    """``cuda:0,cuda:1`` → ``['cuda:0', 'cuda:1']``; ValueError names ``flag`` for anything else."""
    devices = [d.strip() for d in text.split(",")]
    for d in devices:
        check_device(d, flag)
    return devices


def check_device(device: str, flag: str = "--device") -> None:
    """``cpu``, ``cuda`` or ``cuda:N``, else a ValueError naming ``flag``."""
    if not _DEVICE.match(device):
        raise ValueError(f"{flag} {device!r}: expected cpu, cuda or cuda:N")


def split_cpus(cpus: list[int], n: int) -> list[list[int]]:
    """``cpus`` in ``n`` contiguous, nearly equal shares; with fewer cores than workers, they take turns."""
    if len(cpus) < n:
        return [[cpus[i % len(cpus)]] for i in range(n)]
    size, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(cpus[start:end])
        start = end
    return out


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one worker runs: its cores (None: wherever the OS puts it), torch threads, device, the cores it
    borrows from decode workers while those idle (runtime/borrowing.py, layer by layer), and whether it runs at
    idle priority (it does when it borrows or shares cores with decode)."""

    cpus: tuple[int, ...] | None = None
    threads: int | None = None
    device: str | None = None
    idle_priority: bool = False
    borrowed: tuple[int, ...] = ()
    lend_step_ms: float = 0.0  # a decode worker whose cores prefill borrows: its pace during long remote prompts

    def serve_args(self) -> list[str]:
        """The ``tandem serve`` flags that put a worker here."""
        args: list[str] = []
        if self.cpus is not None:
            args += ["--cpus", format_cpus(self.cpus)]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        if self.device is not None:
            args += ["--device", self.device]
        if self.borrowed:
            args += ["--borrow-cpus", format_cpus(self.borrowed)]
        elif self.idle_priority:
            args += ["--idle-priority"]
        if self.lend_step_ms:
            args += ["--lend-step-ms", f"{self.lend_step_ms:g}"]
        return args

    def describe(self) -> str:
        """``cores 0, 1 thread`` / ``cuda:1`` / ``any core``."""
        parts = []
        if self.device is not None and self.device != "cpu":
            parts.append(self.device)
        cores = f"cores {format_cpus(self.cpus)}" if self.cpus is not None else "any core"
        parts.append(cores + (f" + {format_cpus(self.borrowed)} while lent" if self.borrowed else ""))
        if self.threads is not None:
            parts.append(f"{self.threads} thread{'s' if self.threads != 1 else ''}")
        if self.idle_priority:
            parts.append("idle priority")
        if self.lend_step_ms:
            parts.append(f"lends them: a step every {self.lend_step_ms:g} ms during long prompts")
        return ", ".join(parts)


@dataclass(frozen=True)
class Layout:
    """Placements of one ``tandem up``: prefill workers, decode workers, and a line that says why."""

    prefill: list[WorkerPlacement]
    decode: list[WorkerPlacement]
    note: str


def _pinned(shares: list[list[int]], sharing: bool) -> list[WorkerPlacement]:
    # workers that share cores (fewer cores than workers) get one thread each
    return [WorkerPlacement(tuple(s), 1 if sharing else len(s)) for s in shares]


def _borrowing(place: WorkerPlacement, decode_cpus: set[int]) -> WorkerPlacement:
    """A prefill placement whose cores include decode's: it borrows those, at idle priority (all of them: at idle
    priority alone, when it has no core of its own)."""
    own = tuple(c for c in place.cpus or () if c not in decode_cpus)
    if not own:
        return replace(place, idle_priority=True)
    borrowed = tuple(c for c in place.cpus or () if c in decode_cpus)
    return replace(place, cpus=own, borrowed=borrowed, idle_priority=True)


def _lending(decode: list[WorkerPlacement], borrowed: set[int]) -> list[WorkerPlacement]:
    """Decode placements with a pace for their steps while a long prompt is prefilled for them, where prefill
    borrows their cores (actors/runner.py)."""
    return [replace(d, lend_step_ms=LEND_STEP_MS) if set(d.cpus or ()) & borrowed else d for d in decode]


def _lend(prefill: list[WorkerPlacement], decode_cpus: list[int]) -> list[WorkerPlacement]:
    """Lend prefill workers the decode cores: at idle priority, so decode gets a core back at once, and layer by
    layer a prefill worker computes on them too while they idle (runtime/borrowing.py). The decode cores are
    split among the prefill workers, so prefill threads never outnumber the cores."""
    lenders = min(len(prefill), len(decode_cpus))
    out = list(prefill)
    for i, extra in enumerate(split_cpus(decode_cpus, lenders)):
        out[i] = replace(prefill[i], borrowed=tuple(extra), threads=len(prefill[i].cpus or ()) + len(extra),
                         idle_priority=True)
    return out


def plan_layout(prefill: int, decode: int, *, prefill_cpus: str | None = None, decode_cpus: str | None = None,
                prefill_devices: str | None = None, decode_devices: str | None = None,
                gpu: bool = False, pin: bool = True, available: list[int] | None = None) -> Layout:
    """Cores and devices for ``prefill`` prefill workers and ``decode`` decode workers (ValueError on bad lists).

    Given lists are split among their role's workers; a role without a list gets the cores the
    other role left (or, with none left, shares them). With no lists on a CPU host the cores are
    split between the roles in proportion to their workers, each worker on its own cores when
    there are enough (prefill workers then also get the decode cores at idle priority, ``_lend``), else each
    role on its own cores with one thread per worker; on a single core every worker floats with
    ``cores // workers`` threads, so threads never outnumber cores. Lists that give both roles a core make the
    prefill workers yield it (idle priority). ``gpu`` (or device lists) or ``pin=False`` leaves cores alone
    unless lists are given.
    """
    avail = available_cpus() if available is None else available
    p_devs = parse_devices(prefill_devices, "--prefill-devices") if prefill_devices else []
    d_devs = parse_devices(decode_devices, "--decode-devices") if decode_devices else []
    if p_devs and not prefill:
        raise ValueError("--prefill-devices names devices for prefill workers, but there are none")
    if prefill_cpus and not prefill:
        raise ValueError("--prefill-cpus names cores for prefill workers, but there are none")
    p_list = parse_cpus(prefill_cpus, "--prefill-cpus", avail) if prefill_cpus else None
    d_list = parse_cpus(decode_cpus, "--decode-cpus", avail) if decode_cpus else None

    def devices(devs: list[str], n: int) -> list[str | None]:
        return [devs[i % len(devs)] for i in range(n)] if devs else [None] * n

    def with_devices(places: list[WorkerPlacement], devs: list[str]) -> list[WorkerPlacement]:
        return [replace(p, device=d) for p, d in zip(places, devices(devs, len(places)))]

    n = prefill + decode
    if p_list is not None or d_list is not None:
        if p_list is None and prefill:
            p_list = [c for c in avail if c not in set(d_list or [])] or avail
        if d_list is None:
            d_list = [c for c in avail if c not in set(p_list or [])] or avail
        shared = bool(p_list and set(p_list) & set(d_list))
        p_place = _pinned(split_cpus(p_list, prefill), len(p_list) < prefill) if p_list and prefill else []
        d_place = _pinned(split_cpus(d_list, decode), len(d_list) < decode)
        if shared:  # prefill takes the shared cores only while decode lends them
            p_place = [_borrowing(p, set(d_list)) for p in p_place]
            d_place = _lending(d_place, {c for p in p_place for c in p.borrowed})
        note = "cores as asked" + (" (prefill and decode share some: prefill at idle priority)" if shared else "")
    elif gpu or p_devs or d_devs or not pin:
        p_place, d_place = [WorkerPlacement()] * prefill, [WorkerPlacement()] * decode
        note = "cores not pinned" + (" (GPU workers)" if gpu or p_devs or d_devs else " (--no-pin)")
    elif len(avail) >= (1 if prefill else 0) + 1:
        # prefill's share rounds down (decode runs continuously, prefill in bursts), one core per role at least
        p_cores = min(len(avail) - 1, max(1, prefill, len(avail) * prefill // n)) if prefill else 0
        p_place = _pinned(split_cpus(avail[:p_cores], prefill), p_cores < prefill) if prefill else []
        d_place = _pinned(split_cpus(avail[p_cores:], decode), len(avail) - p_cores < decode)
        if len(avail) >= n:
            note = "each worker on its own cores"
            if prefill:
                p_place = _lend(p_place, avail[p_cores:])
                d_place = _lending(d_place, {c for p in p_place for c in p.borrowed})
                note += "; prefill borrows the decode cores while they idle"
        elif prefill:
            note = "prefill and decode on their own cores; workers of one role share them, 1 thread each"
        else:
            note = "more workers than cores: each pinned to one core, shared, 1 thread each"
    else:
        threads = max(1, len(avail) // n)
        p_place, d_place = [WorkerPlacement(None, threads)] * prefill, [WorkerPlacement(None, threads)] * decode
        note = (f"{len(avail)} core{'s' if len(avail) != 1 else ''} for {n} workers: they share "
                f"cores {format_cpus(avail)}, {threads} thread{'s' if threads != 1 else ''} each")
    return Layout(with_devices(p_place, p_devs), with_devices(d_place, d_devs), note)


def _tasks() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]


def run_at_idle_priority() -> None:
    """Put this process — every thread it has, and so every thread it starts later — in ``SCHED_IDLE``: a core
    it shares runs anything else that is ready first, so a decode step never waits behind this process."""
    for tid in _tasks():
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def pin_process(cpus: list[int]) -> None:
    """Pin this process — every thread it already has, and so every thread it starts later — to ``cpus``.

    ``sched_setaffinity(0)`` would set only the calling thread; torch or the bus may have
    started threads by now, so each task of ``/proc/self/task`` is set.
    """
    mask = set(cpus)
    for tid in _tasks():
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
