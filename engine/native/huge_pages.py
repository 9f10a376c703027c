"""Memory in 2 MiB pages for the packed weights a decode step streams.

A batch-1 step of the default model reads ~97 MB of packed weights once. On 4 KiB pages that is ~24,000 TLB misses
a step, each a page walk through entries the stream itself has pushed out of the caches, and the hardware
prefetcher stops at every page's end. Transparent huge pages cut the pages to ~50. Where the kernel gives them
only on request (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, the usual default), the request is
madvise(MADV_HUGEPAGE) on an anonymous mapping aligned to 2 MiB; where it gives none, these are plain pages.
Measured (docs/benchmarks.md): batch-1 decode steps ~0.93x the time.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK = 32 << 20  # one mapping per CHUNK of small weights; larger ones get their own
ALIGN = 64


def _mapping(nbytes: int, huge: bool) -> torch.Tensor:
    """`nbytes` (a multiple of HUGE_PAGE) of fresh anonymous memory from a 2 MiB boundary, asked for in huge pages,
    or (`huge` False) asked never to be: a mapping of its own either way, so no other memory's pages are counted
    with it or merged into it (a plain `torch.empty` may land in a mapping another library asked huge pages for)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: shmem, no THP
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds mm open as long as any view of it lives
    start = -whole.data_ptr() % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None and transparent_huge_pages() != "never":
        mm.madvise(advice, start, nbytes)
    return whole[start:start + nbytes]


def transparent_huge_pages() -> str:
    """The kernel's setting: "always", "madvise" or "never" ("never" where it has none)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "never"


def huge_page_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes in 2 MiB pages of the mappings that hold `tensors` (each mapping counted once; Linux's
    /proc/self/smaps, 0 where there is none): whether the kernel gave the weights huge pages."""
    addresses = sorted({t.data_ptr() for t in tensors})
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    total, holds = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            holds = any(lo <= a < hi for a in addresses)
        elif holds and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


class HugePageArena:
    """Hands out byte tensors (64-byte aligned) carved from 2 MiB-aligned mappings. A carved tensor keeps its
    whole mapping alive; weights live as long as their model, so nothing is freed piecemeal. `huge=False`: the
    same mappings on 4 KiB pages (even where the kernel gives every mapping huge pages), for the comparison."""

    def __init__(self, chunk: int = CHUNK, huge: bool = True) -> None:
        self.chunk, self.huge = chunk, huge
        self._mapped = hasattr(mmap, "MAP_PRIVATE")  # POSIX only; elsewhere plain torch tensors
        self._lock = threading.Lock()
        self._free = torch.empty(0, dtype=torch.uint8)

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 tensor of `nbytes`."""
        if not self._mapped:
            return torch.empty(nbytes, dtype=torch.uint8)
        padded = -(-nbytes // ALIGN) * ALIGN
        if padded > self.chunk // 2:
            return _mapping(-(-padded // HUGE_PAGE) * HUGE_PAGE, self.huge)[:nbytes]
        with self._lock:
            if self._free.numel() < padded:
                self._free = _mapping(self.chunk, self.huge)
            out, self._free = self._free[:nbytes], self._free[padded:]
        return out


WEIGHTS = HugePageArena()


@contextlib.contextmanager
def plain_pages() -> Iterator[None]:
    """Weights packed within it are on 4 KiB pages (what `bench.engine --plain-pages` compares against)."""
    global WEIGHTS
    saved, WEIGHTS = WEIGHTS, HugePageArena(huge=False)
    try:
        yield
    finally:
        WEIGHTS = saved
