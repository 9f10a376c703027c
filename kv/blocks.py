"""Block accounting: reference counts, free list and a prefix cache over full blocks.

A full block is named by a chained hash of its tokens and its predecessor's hash, so two
prompts that share a prefix share the blocks of that prefix. Cached blocks nobody references
stay resident and are evicted least-recently-used when fresh blocks run out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Deterministic across processes, so a gateway can compute the same names for routing."""
    h = hashlib.blake2b(digest_size=16)
    if parent:
        h.update(parent)
    h.update(array("i", tokens).tobytes())
    return h.digest()


def prefix_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of `tokens`."""
    out: list[bytes] = []
    parent = None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[i : i + block_size])
        out.append(parent)
    return out


def group_key(h: bytes, group: int) -> bytes:
    """The prefix-cache name of a block of KV group `group` holding the tokens hashed to `h` (group 0's is `h`)."""
    return h if group == 0 else h + bytes([group])


NULL_BLOCK = 0  # what a block table holds where its block left the window: any valid id, never read


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # never-cached or invalidated blocks
        self.cached: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref == 0, oldest first
        self.quarantined: set[int] = set()
        self.hits = 0
        self.queries = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - len(self.quarantined)

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def match_prefix(self, hashes: list[bytes], count: bool = True) -> list[int]:
        """Blocks already holding the longest cached prefix; each is referenced for the caller (`count`: in the
        hit rate)."""
        blocks: list[int] = []
        if self.enable_prefix_cache:
            for h in hashes:
                b = self.cached.get(h)
                if b is None:
                    break
                blocks.append(b)
        if count:
            self.queries += len(hashes)
            self.hits += len(blocks)
        for b in blocks:
            self._take(b)
        return blocks

    def peek_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks are cached, without referencing them."""
        n = 0
        if self.enable_prefix_cache:
            for h in hashes:
                if h not in self.cached:
                    break
                n += 1
        return n

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.lru.popitem(last=False)
                del self.cached[self.hash_of[b]]
                self.hash_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def _take(self, b: int) -> None:
        if self.ref[b] == 0:
            self.lru.pop(b, None)
        self.ref[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """Name a block that just became full; the first block with a given name wins."""
        if not self.enable_prefix_cache or self.hash_of[block] is not None:
            return
        if h not in self.cached:
            self.cached[h] = block
            self.hash_of[block] = h

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # tail blocks first so a prefix's head stays cached longest
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} released more times than taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is not None:
                    self.lru[b] = None
                else:
                    self.free.append(b)

    def quarantine(self, blocks: list[int]) -> None:
        """Hold blocks a remote writer may still touch: never reused until `release_quarantine`."""
        for b in blocks:
            if self.ref[b] != 1:
                raise RuntimeError(f"quarantined block {b} must have exactly one owner, has {self.ref[b]}")
            if self.hash_of[b] is not None:
                del self.cached[self.hash_of[b]]
                self.hash_of[b] = None
            self.quarantined.add(b)

    def release_quarantine(self, blocks: list[int]) -> None:
        for b in blocks:
            self.quarantined.discard(b)
        self.release(blocks)

    def check_idle(self) -> None:
        """Raise if any block is still referenced (a leak) — used by tests and at drain."""
        held = [b for b, r in enumerate(self.ref) if r]
        if held:
            raise AssertionError(f"{len(held)} KV blocks still referenced: {held[:16]}")
