"""KV layout and its fingerprint: two workers exchange KV blocks only if their layouts match."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from functools import cached_property

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Dimension order of one pool tensor; part of the fingerprint so a layout change is never silent.
BLOCK_MAJOR = "block,layer,kv,slot,head,dim"
MAX_GROUPS = 8  # more block tables than this per sequence cost more per step than the memory they save


def plan_groups(windows: list[int], max_groups: int = MAX_GROUPS) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Layers split into equal-sized groups of one window each: (groups, their windows), or ((), ()) for one
    group of every layer.

    Why: a sliding-window layer needs only its last `window` tokens, so its blocks can go once they leave the
    window, while a global layer keeps every block. Blocks of one size (a group's layers) serve every group
    from one pool (vLLM's hybrid allocator does the same), so nothing has to guess how to split the memory.
    """
    by_window: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        by_window.setdefault(w, []).append(layer)
    if set(by_window) == {0}:
        return (), ()
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    if len(windows) // size > max_groups:
        return (), ()
    groups: list[tuple[int, ...]] = []
    group_windows: list[int] = []
    for w in sorted(by_window):  # the global layers (window 0) first
        layers = by_window[w]
        for i in range(0, len(layers), size):
            groups.append(tuple(layers[i:i + size]))
            group_windows.append(w)
    return tuple(groups), tuple(group_windows)


@dataclass(frozen=True)
class KVLayout:
    """Everything a peer must agree on to read or write our KV blocks byte for byte."""

    model: str  # model identity: name and weights digest
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    order: str = BLOCK_MAJOR
    weights: str = "none"  # how the model's weights are stored (quantization): other weights give other KV
    # Layers that share a block table, each group with its window (`plan_groups`); (): one group of every layer.
    # A block holds one group's layers, so a sequence has a block table per group.
    groups: tuple[tuple[int, ...], ...] = ()
    windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.groups:
            layers = sorted(li for g in self.groups for li in g)
            if layers != list(range(self.num_layers)) or len({len(g) for g in self.groups}) != 1:
                raise ValueError(f"KV groups {self.groups} must split layers 0..{self.num_layers - 1} evenly")
            if len(self.windows) != len(self.groups):
                raise ValueError(f"KV groups {self.groups} need one window each, got {self.windows}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @cached_property
    def layer_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups or (tuple(range(self.num_layers)),)

    @property
    def num_groups(self) -> int:
        return len(self.layer_groups)

    @property
    def group_size(self) -> int:
        return len(self.layer_groups[0])

    @cached_property
    def group_of(self) -> tuple[tuple[int, int], ...]:
        """Per layer: (its group, its index inside that group's blocks)."""
        where = {li: (g, j) for g, layers in enumerate(self.layer_groups) for j, li in enumerate(layers)}
        return tuple(where[li] for li in range(self.num_layers))

    def window(self, group: int) -> int:
        return self.windows[group] if self.windows else 0

    def first_needed(self, group: int, num_tokens: int) -> int:
        """The first block of `group` that the token after `num_tokens` computed ones attends to (earlier ones can go)."""
        w = self.window(group)
        return max(0, num_tokens + 1 - w) // self.block_size if w else 0

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.group_size, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        elements = 1
        for d in self.block_shape:
            elements *= d
        return elements * self.torch_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K/V in every layer (one block of each group)."""
        return self.block_bytes * self.num_groups // self.block_size

    def fingerprint(self) -> str:
        text = "|".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        groups = f" groups={len(self.groups)}x{self.group_size} windows={sorted(set(self.windows))}" if self.groups else ""
        return (
            f"{self.model} {self.dtype} block_size={self.block_size} layers={self.num_layers} "
            f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} order={self.order} "
            f"weights={self.weights}{groups} [{self.fingerprint()}]"
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        d = dict(d)  # JSON gives lists: the fields are tuples (equality, hashing, the fingerprint's text)
        d["groups"] = tuple(tuple(g) for g in d.get("groups", ()))
        d["windows"] = tuple(d.get("windows", ()))
        return cls(**d)


class LayoutMismatch(ValueError):
    def __init__(self, ours: KVLayout, theirs: KVLayout):
        super().__init__(f"KV layout mismatch: ours is {ours.describe()}, peer's is {theirs.describe()}")
        self.ours = ours
        self.theirs = theirs
