"""The default weights (the GGUF's own Q4_1 as int4) against float32 of the same weights: quality and size."""

from __future__ import annotations

import pytest

from bench.quality import PROMPTS, agreement, score


@pytest.fixture(scope="module")
def float32_model():
    from engine.loader import load_model
    from engine.model_files import DEFAULT_MODEL

    return load_model(DEFAULT_MODEL, "float32", "none")


@pytest.mark.slow
def test_auto_perplexity_within_one_percent_and_greedy_mostly_equal(smollm, float32_model):
    assert smollm.quantization.startswith("auto:") and "int4" in smollm.quantization
    ref, got = score(float32_model), score(smollm)
    assert 20 < ref.perplexity < 100  # the text is ordinary English the model reads well
    # issue 32's bound: x1.003 on every kernel path (measured: x1.0000 with bfloat16 panels, x1.0017 with int8
    # activations; float32 of the dequantized weights elsewhere)
    assert abs(got.perplexity / ref.perplexity - 1) <= 0.003, (got.perplexity, ref.perplexity)
    assert abs(got.kernel_perplexity / ref.kernel_perplexity - 1) <= 0.01, (got.kernel_perplexity, ref.kernel_perplexity)
    assert abs(ref.kernel_perplexity / ref.perplexity - 1) <= 1e-3  # float32: the chunking itself changes nothing
    # measured (bench.quality): 20 of 20 both ways
    assert agreement(got, ref, small=True) > len(PROMPTS) // 2  # int16 activations
    assert agreement(got, ref) > len(PROMPTS) // 2  # int4 layers on float32 panels
    assert len(ref.greedy_long) == 20 and agreement(got, ref, long=True) > 10  # a long chunk


def test_auto_weights_take_at_most_a_third_of_float32(smollm, float32_model):
    from bench.engine import weight_bytes
    from engine.engine import EngineConfig, LLMEngine

    auto = weight_bytes(LLMEngine(smollm, EngineConfig(num_blocks=4)))
    dense = weight_bytes(LLMEngine(float32_model, EngineConfig(num_blocks=4)))
    assert auto <= 0.35 * dense, (auto, dense)
