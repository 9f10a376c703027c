"""engine.native.huge_pages: the packed weights a decode step streams, in 2 MiB pages."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine import native
from engine.native import huge_pages
from engine.native.huge_pages import HUGE_PAGE, HugePageArena
from tests.harness.chat import chat_ids

MiB = 1 << 20


def test_the_arena_carves_aligned_tensors_that_do_not_overlap_from_2mib_aligned_mappings():
    arena = HugePageArena(chunk=8 * MiB)
    small, mid, same, fresh = arena.empty(1000), arena.empty(3 * MiB), arena.empty(3 * MiB), arena.empty(3 * MiB)
    alone = arena.empty(5 * MiB)  # over half a chunk: a mapping of its own
    parts = [small, mid, same, fresh, alone]
    assert [t.numel() for t in parts] == [1000, 3 * MiB, 3 * MiB, 3 * MiB, 5 * MiB]
    assert all(t.dtype == torch.uint8 and t.data_ptr() % 64 == 0 for t in parts)
    assert small.data_ptr() % HUGE_PAGE == 0 and mid.data_ptr() == small.data_ptr() + 1024
    assert same.data_ptr() == mid.data_ptr() + 3 * MiB
    assert fresh.data_ptr() % HUGE_PAGE == 0 and alone.data_ptr() % HUGE_PAGE == 0  # the first chunk was full
    for i, t in enumerate(parts):
        t.fill_(i + 1)
    assert [int(t.sum()) for t in parts] == [(i + 1) * t.numel() for i, t in enumerate(parts)]


@pytest.mark.skipif(huge_pages.transparent_huge_pages() == "never", reason="this kernel gives no transparent huge pages")
def test_touched_arena_memory_is_in_huge_pages_and_plain_memory_is_not():
    t = HugePageArena().empty(4 * MiB)
    t.fill_(1)
    assert huge_pages.huge_page_bytes([t]) >= 4 * MiB
    plain = HugePageArena(huge=False).empty(4 * MiB)  # a mapping of its own, asked never to be in huge pages
    plain.fill_(1)
    assert plain.data_ptr() % HUGE_PAGE == 0 and huge_pages.huge_page_bytes([plain]) == 0


def test_plain_pages_packs_on_ordinary_memory_and_restores_the_arena():
    arena = huge_pages.WEIGHTS
    with huge_pages.plain_pages():
        assert huge_pages.WEIGHTS is not arena and not huge_pages.WEIGHTS.huge
    assert huge_pages.WEIGHTS is arena and arena.huge


@pytest.mark.skipif(not (native.available() and native.packs_i8()), reason="this kernel path packs no int8 panels")
def test_a_model_packs_every_panel_at_load_and_computes_the_same_on_either_pages(smollm, monkeypatch):
    """The layers' and the LM head's panels are packed when the model loads (not by the first request), into the
    arena; greedy tokens and logprobs are the same whichever pages the panels sit on."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.params import SamplingParams

    packed = []
    real = native.i8_pack
    monkeypatch.setattr(native, "i8_pack", lambda *a: packed.append(real(*a)) or packed[-1])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    prompt = [chat_ids(smollm, "Name three rivers.")]
    outputs = []
    for plain in (False, True):
        packed.clear()
        with huge_pages.plain_pages() if plain else contextlib.nullcontext():
            engine = LLMEngine(smollm, EngineConfig(num_blocks=32, enable_prefix_cache=False))
        layers = len(engine.model.layers)
        assert len(packed) == 4 * layers + 1  # every linear layer, then the LM head
        assert engine.model.lm_head.i8_panels() is packed[-1]
        in_huge, total = huge_pages.huge_page_bytes(p.data for p in packed), sum(p.data.numel() for p in packed)
        if plain:
            assert in_huge == 0
        elif huge_pages.transparent_huge_pages() != "never":
            assert in_huge > 0.9 * total
        [seq] = engine.generate(prompt, params)
        outputs.append((seq.output_ids, [lp.logprob for lp in seq.logprobs]))
        assert len(packed) == 4 * layers + 1  # nothing packed by the request
    assert outputs[0] == outputs[1]
