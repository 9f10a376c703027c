"""KV layout and its fingerprint: two workers exchange KV blocks only if their layouts match."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Dimension order of one pool tensor; part of the fingerprint so a layout change is never silent.
BLOCK_MAJOR = "block,layer,kv,slot,head,dim"


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

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        elements = 1
        for d in self.block_shape:
            elements *= d
        return elements * self.torch_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def fingerprint(self) -> str:
        text = "|".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (
            f"{self.model} {self.dtype} block_size={self.block_size} layers={self.num_layers} "
            f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} order={self.order} "
            f"weights={self.weights} [{self.fingerprint()}]"
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        return cls(**d)


class LayoutMismatch(ValueError):
    def __init__(self, ours: KVLayout, theirs: KVLayout):
        super().__init__(f"KV layout mismatch: ours is {ours.describe()}, peer's is {theirs.describe()}")
        self.ours = ours
        self.theirs = theirs
