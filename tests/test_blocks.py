"""BlockPool: reference counts, prefix cache, LRU eviction, quarantine."""

from __future__ import annotations

import pytest

from kv.blocks import BlockPool, OutOfBlocks, prefix_hashes
from kv.layout import KVLayout, LayoutMismatch, plan_groups
from kv.pool import KVPool, coalesce, paired_runs


def test_allocate_release_and_leak_check():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert pool.num_free == 1
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_idle()
    pool.release(a)
    pool.check_idle()
    with pytest.raises(RuntimeError):
        pool.release([a[0]])


def test_prefix_match_and_lru_eviction():
    pool = BlockPool(4, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = prefix_hashes(tokens, 2)
    assert len(hashes) == 3
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    pool.release(blocks)
    assert pool.num_free == 4  # cached but unreferenced blocks count as free
    assert pool.match_prefix(prefix_hashes([1, 2, 3, 4, 9, 9], 2)) == blocks[:2]
    pool.release(blocks[:2])
    # Fresh allocations use never-cached blocks first, then evict the least recently used.
    fresh = pool.allocate(2)
    assert blocks[2] in fresh  # tail of the prefix went back to the LRU first
    assert pool.peek_prefix(hashes) == 2
    pool.release(fresh)
    pool.check_idle()


def test_hash_chain_depends_on_prefix():
    assert prefix_hashes([1, 2, 3, 4], 2)[1] != prefix_hashes([9, 9, 3, 4], 2)[1]
    assert prefix_hashes([1, 2, 3], 2) == prefix_hashes([1, 2, 7], 2)


def test_quarantine_blocks_reuse():
    pool = BlockPool(2, 2)
    blocks = pool.allocate(2)
    pool.quarantine(blocks)
    assert pool.num_free == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.release_quarantine(blocks)
    assert pool.num_free == 2
    pool.check_idle()


def test_pool_is_block_major_and_coalesces():
    layout = KVLayout("m", "float32", 4, 3, 2, 8)
    pool = KVPool(layout, 5)
    assert pool.tensor.shape == (5, 3, 2, 4, 2, 8)
    assert pool.nbytes == 5 * layout.block_bytes
    pool.tensor[2].fill_(1.0)
    flat = pool.as_bytes().view(-1, layout.block_bytes)
    assert flat[2].any() and not flat[1].any() and not flat[3].any()  # a block is one contiguous range
    assert coalesce([1, 2, 3, 7, 8]) == [(1, 3), (7, 2)]
    assert paired_runs([1, 2, 5], [7, 8, 9]) == [(1, 7, 2), (5, 9, 1)]


def test_layout_fingerprint_and_mismatch():
    a = KVLayout("m", "float32", 16, 30, 3, 64)
    b = KVLayout("m", "float32", 32, 30, 3, 64)
    assert a.fingerprint() == KVLayout.from_dict(a.to_dict()).fingerprint()
    assert a.fingerprint() != b.fingerprint()
    err = str(LayoutMismatch(a, b))
    assert "block_size=16" in err and "block_size=32" in err


def test_layers_grouped_by_window():
    """Gemma 3 270M: 15 local layers (window 512) and 3 global ones make 6 groups of 3, the global one first."""
    windows = [0 if i % 6 == 5 else 512 for i in range(18)]
    groups, group_windows = plan_groups(windows)
    assert groups[0] == (5, 11, 17) and groups[1] == (0, 1, 2) and groups[5] == (14, 15, 16)
    assert group_windows == (0, 512, 512, 512, 512, 512)
    assert sorted(li for g in groups for li in g) == list(range(18))
    assert plan_groups([0] * 30) == ((), ())  # no windows: one group of every layer, as before groups existed
    assert plan_groups([0] + [16] * 19) == ((), ())  # 20 groups of one layer would cost more than they save
    layout = KVLayout("g", "float32", 16, 18, 1, 64, groups=groups, windows=group_windows)
    flat = KVLayout("g", "float32", 16, 18, 1, 64)
    assert layout.block_shape == (3, 2, 16, 1, 64) and layout.bytes_per_token == flat.bytes_per_token
    assert layout.group_of[5] == (0, 0) and layout.group_of[4] == (2, 1)
    assert KVLayout.from_dict(layout.to_dict()) == layout and layout.fingerprint() != flat.fingerprint()
    # the token after 600 computed ones attends to positions 89..600: blocks from 5 on, in a local group only
    assert [layout.first_needed(g, 600) for g in (0, 1)] == [0, 5]
    assert layout.first_needed(1, 511) == 0 and layout.first_needed(1, 527) == 1
    with pytest.raises(ValueError, match="evenly"):
        KVLayout("g", "float32", 16, 3, 1, 64, groups=((0, 1), (2,)), windows=(0, 16))
