"""The engine's correctness tests on CUDA (skipped where there is no GPU)."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.params import SamplingParams
from tests.harness.chat import chat_ids

pytestmark = pytest.mark.gpu

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?"]
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture
def cuda_engine_factory(make_engine):
    """CUDA engines; conftest's make_engine asserts each ends with no work and all its blocks free."""

    def make(**kw) -> LLMEngine:
        return make_engine(device="cuda", **kw)

    return make


@pytest.fixture(scope="module")
def cuda_reference(smollm):
    """Greedy output of each question run alone on CUDA, no prefix cache."""
    engine = LLMEngine(smollm, EngineConfig(device="cuda", num_blocks=128, enable_prefix_cache=False))
    ref = [engine.generate([chat_ids(smollm, q)], PARAMS)[0].output_ids for q in QUESTIONS]
    assert not engine.has_work()
    engine.blocks.check_idle()
    return ref


def test_cuda_capital_of_france(smollm, cuda_engine_factory):
    [seq] = cuda_engine_factory().generate([chat_ids(smollm, QUESTIONS[0])], SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in seq.text


def test_cuda_logits_match_cpu(smollm):
    """The same float32 weights on both devices (the CPU's int4 kernel rounds activations to int16 per group)."""
    from engine.loader import load_model
    from engine.model_files import DEFAULT_MODEL
    from tests.harness.reference_models import engine_logits

    dense = load_model(DEFAULT_MODEL, "float32", "none")
    ids = chat_ids(dense, QUESTIONS[1])
    cpu = engine_logits(LLMEngine(dense, EngineConfig(num_blocks=16)), ids)
    gpu = engine_logits(LLMEngine(dense, EngineConfig(num_blocks=16, device="cuda")), ids).cpu()
    assert (gpu - cpu).abs().max().item() < 1e-2
    assert torch.equal(gpu.argmax(-1), cpu.argmax(-1))


def test_cuda_quantized_weights_are_dequantized_there(smollm, cuda_engine_factory):
    """int4/int8 kernels are CPU kernels: on CUDA the default model's weights are expanded to the dtype."""
    from engine.quant import DenseWeight

    engine = cuda_engine_factory()
    assert all(isinstance(w, DenseWeight) for w in (engine.model.lm_head, engine.model.layers[0].wqkv))
    assert engine.model.layers[0].wqkv.w.device.type == "cuda"


def test_cuda_batched_chunked_preempt_equal_reference(smollm, cuda_engine_factory, cuda_reference):
    prompts = [chat_ids(smollm, q) for q in QUESTIONS]
    variants = [
        cuda_engine_factory(),  # batched; the prefix cache is on but cold (all admitted in one step)
        cuda_engine_factory(max_step_tokens=7),  # chunked prefill
        cuda_engine_factory(num_blocks=7, enable_prefix_cache=False),  # preemption
    ]
    for engine in variants:
        assert [s.output_ids for s in engine.generate(prompts, PARAMS)] == cuda_reference
        assert not engine.has_work()
        engine.blocks.check_idle()
    assert variants[2].scheduler.preemptions > 0


def test_cuda_prefix_cache_hit_equals_no_cache(smollm, cuda_engine_factory, cuda_reference):
    # One request at a time: a prompt's blocks join the prefix cache only once a step has written them,
    # so prompts admitted together never hit. Every question shares the chat template's system prompt.
    engine = cuda_engine_factory()
    bs = engine.cfg.block_size
    prompts = [chat_ids(smollm, q) for q in QUESTIONS]
    seqs = []
    for p in [*prompts, prompts[0]]:  # the last repeats the first: all of it cached but the last block
        seqs += engine.generate([p], PARAMS)
        assert not engine.has_work()
        engine.blocks.check_idle()
    assert seqs[0].num_cached == 0
    assert all(s.num_cached >= bs for s in seqs[1:3])
    assert seqs[3].num_cached == (len(prompts[0]) - 1) // bs * bs
    assert seqs[3].num_cached > seqs[1].num_cached
    assert engine.blocks.hits > 0 and engine.blocks.hit_rate() > 0
    assert [s.output_ids for s in seqs] == [*cuda_reference, cuda_reference[0]]


def test_cuda_seeded_sampling_reproducible(smollm, cuda_engine_factory):
    engine = cuda_engine_factory()
    ids = chat_ids(smollm, "Tell me a story.")
    a, b = engine.generate([ids, ids], [SamplingParams(max_tokens=12, temperature=1.0, seed=5)] * 2)
    assert a.output_ids == b.output_ids
