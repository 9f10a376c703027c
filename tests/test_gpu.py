"""The engine's correctness tests on CUDA (skipped where there is no GPU)."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from tests.conftest import chat_ids

pytestmark = pytest.mark.gpu

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?"]


@pytest.fixture(scope="module")
def cuda_engine_factory(smollm):
    def make(**kw) -> LLMEngine:
        kw.setdefault("num_blocks", 128)
        return LLMEngine(smollm, EngineConfig(device="cuda", **kw))

    return make


def test_cuda_capital_of_france(smollm, cuda_engine_factory):
    [seq] = cuda_engine_factory().generate([chat_ids(smollm, QUESTIONS[0])], SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in seq.text


def test_cuda_logits_match_cpu(smollm, cuda_engine_factory):
    from tests.test_model_reference import engine_logits

    ids = chat_ids(smollm, QUESTIONS[1])
    cpu = engine_logits(LLMEngine(smollm, EngineConfig(num_blocks=16)), ids)
    gpu = engine_logits(cuda_engine_factory(num_blocks=16), ids).cpu()
    assert (gpu - cpu).abs().max().item() < 1e-2
    assert torch.equal(gpu.argmax(-1), cpu.argmax(-1))


def test_cuda_batched_chunked_prefix_preempt_equal_reference(smollm, cuda_engine_factory):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [chat_ids(smollm, q) for q in QUESTIONS]
    ref = [cuda_engine_factory(enable_prefix_cache=False).generate([p], params)[0].output_ids for p in prompts]
    variants = [
        cuda_engine_factory(),  # batched, prefix cache on
        cuda_engine_factory(max_step_tokens=7),  # chunked prefill
        cuda_engine_factory(num_blocks=7, enable_prefix_cache=False),  # preemption
    ]
    for engine in variants:
        assert [s.output_ids for s in engine.generate(prompts, params)] == ref
        engine.blocks.check_idle()
    assert variants[2].scheduler.preemptions > 0


def test_cuda_seeded_sampling_reproducible(smollm, cuda_engine_factory):
    engine = cuda_engine_factory()
    ids = chat_ids(smollm, "Tell me a story.")
    a, b = engine.generate([ids, ids], [SamplingParams(max_tokens=12, temperature=1.0, seed=5)] * 2)
    assert a.output_ids == b.output_ids
