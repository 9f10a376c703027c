"""Byte ranges of a block-to-block copy: which bytes of one pool go where in another, and strided groups of them.

Byte ranges follow the block-major pool: a block's bytes are contiguous, and inside a block each layer's K and V are
contiguous, so a run of adjacent blocks is one range and a layer range of one block is one range.
"""

from __future__ import annotations

from kv.layout import KVLayout
from kv.pool import paired_runs


def byte_ranges(
    layout: KVLayout,
    local_blocks: list[int],
    remote_blocks: list[int],
    layers: tuple[int, int] | None = None,
) -> list[tuple[int, int, int]]:
    """(local_offset, remote_offset, nbytes) ranges for a block-to-block copy.

    Adjacent blocks on both sides are coalesced into one range; with a layer range
    ``[first, last)`` (indices inside a block: its group's layers) that is not every layer, each
    block contributes one range (the layer slices of one block are contiguous, those of two blocks are not).
    """
    block, size = layout.block_bytes, layout.group_size
    runs = paired_runs(list(local_blocks), list(remote_blocks))
    if layers is None or (layers[0] == 0 and layers[1] == size):
        return [(s * block, d * block, n * block) for s, d, n in runs]
    first, last = layers
    if not 0 <= first < last <= size:
        raise ValueError(f"layer range {layers} outside [0, {size})")
    per_layer = block // size
    head, length = first * per_layer, (last - first) * per_layer
    ranges: list[tuple[int, int, int]] = []
    for s, d, n in runs:
        for i in range(n):
            ranges.append(((s + i) * block + head, (d + i) * block + head, length))
    return ranges


def strided_groups(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int, int, int]]:
    """Fold equal-length ranges at constant strides: (src, dst, nbytes, count, src_stride, dst_stride).

    A layer-range write of n blocks is n ranges one block apart; as one strided group it is one
    copy call instead of n (per-call overhead dominates small ranges).
    """
    groups: list[list[int]] = []
    for s, d, n in ranges:
        if groups:
            g = groups[-1]
            if g[2] == n:
                if g[3] == 1 and s - g[0] >= n and d - g[1] >= n:
                    g[3], g[4], g[5] = 2, s - g[0], d - g[1]
                    continue
                if g[3] > 1 and s == g[0] + g[3] * g[4] and d == g[1] + g[3] * g[5]:
                    g[3] += 1
                    continue
        groups.append([s, d, n, 1, n, n])
    return [(g[0], g[1], g[2], g[3], g[4], g[5]) for g in groups]
