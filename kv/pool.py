"""The paged KV pool: one tensor, block-major, allocated and pre-faulted once.

Block b holds K and V of one layer group (`KVLayout.groups`; every layer for a model without
sliding-window layers) for `block_size` token slots, contiguous in memory, so a run of adjacent
blocks is one contiguous byte range — transfer engines send it as one descriptor.
"""

from __future__ import annotations

import torch

from kv.layout import KVLayout


class KVPool:
    """Storage for `num_blocks` KV blocks of `layout`, on CPU, CUDA or a caller-given buffer (shm).

    Every group's blocks come from the same pool: a sequence of a model with G groups holds G blocks per
    `block_size` tokens (fewer for the windowed groups, which let go of the blocks that left their window).
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: str | torch.device = "cpu",
        buffer: memoryview | bytearray | None = None,
    ):
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, *layout.block_shape)
        if buffer is not None:
            flat = torch.frombuffer(buffer, dtype=layout.torch_dtype, count=num_blocks * layout.block_bytes // layout.torch_dtype.itemsize)
            self.tensor = flat.view(shape)
        else:
            self.tensor = torch.empty(shape, dtype=layout.torch_dtype, device=device)
        # Pre-fault: the first touch of fresh pages is 20-40x slower than a warm copy (DESIGN §5).
        self.tensor.zero_()
        # per-layer views, made once: a forward pass asks for each twice per layer (a view costs ~10 µs)
        self._keys = [self.tensor[:, j, 0] for _, j in layout.group_of]
        self._values = [self.tensor[:, j, 1] for _, j in layout.group_of]

    @staticmethod
    def bytes_needed(layout: KVLayout, num_blocks: int) -> int:
        return layout.block_bytes * num_blocks

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def as_bytes(self) -> torch.Tensor:
        """The whole pool as a flat uint8 tensor (a view, no copy)."""
        return self.tensor.view(-1).view(torch.uint8)

    def keys(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, kv_heads, head_dim] strided view of layer's K (indexed by its group's table)."""
        return self._keys[layer]

    def values(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    def layer_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's K and V views, as `keys` and `values` give them (the same two lists each call)."""
        return self._keys, self._values


def coalesce(blocks: list[int]) -> list[tuple[int, int]]:
    """Adjacent block ids as (first, count) runs: [3,4,5,9] -> [(3,3),(9,1)]."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_first, dst_first, count) runs where both sides are adjacent, for block-to-block copies."""
    if len(src) != len(dst):
        raise ValueError(f"block lists differ in length: {len(src)} source, {len(dst)} destination")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
