"""Every family's graph against transformers on tiny random models, and the GGUF side of Gemma 3 (its own
tensor names, 1 + w norms, windowed layers, and the quant types its files hold) against the same weights."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.engine import EngineConfig, LLMEngine
from engine.kv_connector import LANDED, RemoteResult
from engine.loader import _q4_codes, _q8_codes, load_model
from engine.model_files import load_text
from engine.model_text import ModelLoadError
from engine.quant import Int4Weight, Q8Weight
from tests.harness.kv_connector import RecordingConnector
from tests.harness.reference_models import (
    BPE_VOCABULARY,
    decode_logits,
    engine_logits,
    finish_gguf,
    tokenizer_fields,
    write_gguf_gemma3_from_hf,
    write_hf_family,
)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# > 16 tokens: past the tiny Gemma's sliding window (16), so its local layers must drop the oldest tokens
PROMPT = ("The quick brown fox jumps over the lazy dog. 1 2 3 4 5 6 7 8 9 10 and then some more words, enough "
          "to span several KV blocks and the window.")
REFERENCE = {"gemma3": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm):
    root = tmp_path_factory.mktemp("families")
    tok_json = smollm.tokenizer.tok.to_str()
    dirs = {family: write_hf_family(family, root / family, tok_json, seed=i) for i, family in enumerate(REFERENCE)}
    # as llama.cpp computes Gemma 3 (scale by head_dim): the model its GGUF files are compared with
    dirs["gemma3-gguf"] = write_hf_family("gemma3", root / "gemma3-gguf", tok_json, seed=3, query_pre_attn_scalar=16)
    return dirs


@pytest.fixture(scope="module")
def gguf_fields(smollm):
    return tokenizer_fields(smollm.path, BPE_VOCABULARY)


def reference_logits(path, family: str, ids: list[int]) -> torch.Tensor:
    model = getattr(transformers, REFERENCE[family]).from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def check_engine(loaded, expected: torch.Tensor, ids: list[int], atol: float) -> None:
    """Whole prefill, prefill in two chunks (the second reading the first's K/V from the pool) and the decode
    path all give the reference's logits."""
    engine = LLMEngine(loaded, EngineConfig(num_blocks=16))
    got = engine_logits(engine, ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < atol
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95
    for split in (21, 40):  # at 40 the tiny Gemma's local layers skip the first block (window 16)
        torch.testing.assert_close(engine_logits(engine, ids, split=split), got, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(decode_logits(engine, ids), got[-1], atol=1e-3, rtol=1e-3)
    engine.blocks.check_idle()


@pytest.mark.parametrize("family", list(REFERENCE))
def test_tiny_model_logits_match_transformers(tiny, smollm, family):
    loaded = load_model(str(tiny[family]))
    assert loaded.config.family == family
    ids = smollm.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * 16
    check_engine(loaded, reference_logits(tiny[family], family, ids), ids, atol=1e-4)


def test_windowed_kv_moves_between_engines_as_a_remote_prefill_does(tiny, smollm):
    """A prefill engine's blocks, copied into the blocks a decode engine reserved (the local groups' from their
    window on only), decode what one engine generates; the blocks the local groups let go are not sent."""
    from engine.params import SamplingParams

    loaded = load_model(str(tiny["gemma3"]))
    ids = smollm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [whole] = LLMEngine(loaded, EngineConfig(num_blocks=16)).generate([ids], params)

    prefill = LLMEngine(loaded, EngineConfig(num_blocks=16, max_step_tokens=16),  # chunks that pass the window
                        connector=RecordingConnector(keep={"r"}))
    prefill.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0.0))
    first = [t for _ in range(20) if prefill.has_work() for out in prefill.step() for t in out.token_ids]
    decode = LLMEngine(loaded, EngineConfig(num_blocks=16), connector=RecordingConnector())
    seq = decode.add_request("r", ids, params, remote=True)
    decode.step()
    _, dst = decode.connector.placed["r"]
    src, dst_groups = prefill.prompt_blocks("r", 0), decode.prompt_blocks("r", 0)
    n, local = -(-len(ids) // 16), decode.layout.first_needed(1, len(ids))
    assert local > 0  # the prompt passed the window (16): its first blocks are not sent
    assert [len(g) for g in src] == [len(g) for g in dst_groups] == [n, n - local, n - local]
    assert dst == [b for g in dst_groups for b in g]
    for s, d in zip(src, dst_groups):
        decode.pool.tensor[d] = prefill.pool.tensor[s]
    assert prefill.held and prefill.blocks.num_free < prefill.blocks.num_blocks  # kept while it is sent
    prefill.connector.released = ["r"]
    prefill.step()
    prefill.blocks.check_idle()
    decode.connector.results = [RemoteResult("r", LANDED, first[0])]
    while decode.has_work():
        decode.step()
    assert seq.output_ids == whole.output_ids
    decode.blocks.check_idle()


def test_the_torch_operations_compute_what_the_native_ones_do(tiny, smollm, monkeypatch):
    """Without engine.native (no compiler) the window, the q/k norms and the sandwich norms are torch's."""
    from engine import native

    ids = smollm.tokenizer.encode(PROMPT)
    expected = reference_logits(tiny["gemma3"], "gemma3", ids)
    monkeypatch.setenv("TANDEM_NATIVE", "0")
    native.library.cache_clear()
    try:
        check_engine(load_model(str(tiny["gemma3"])), expected, ids, atol=1e-4)
    finally:
        monkeypatch.delenv("TANDEM_NATIVE")
        native.library.cache_clear()


def test_gemma3_config_from_each_file_kind(tiny, gguf_fields, tmp_path):
    hf = load_text(str(tiny["gemma3"])).config
    gg = load_text(str(write_gguf_gemma3_from_hf(tiny["gemma3"], tmp_path / "g.gguf", gguf_fields))).config
    assert hf.local_layers == gg.local_layers == (0, 2)
    assert hf.sliding_window == gg.sliding_window == 16
    assert hf.embed_scale == pytest.approx(8.0) and gg.embed_scale == pytest.approx(8.0)
    assert hf.attn_scale == pytest.approx(24 ** -0.5)  # query_pre_attn_scalar, not head_dim
    assert (hf.rope_theta, hf.rope_local_theta) == (1e6, 1e4)
    assert not hf.plain_llama and ModelConfig("x", 8, 8, 8, 1, 1, 1, 8, 8).plain_llama


def test_gemma3_gguf_matches_its_hf_checkpoint(tiny, smollm, gguf_fields, tmp_path):
    """llama.cpp's naming and +1 norms read back to the same model: the F32 GGUF equals transformers."""
    path = write_gguf_gemma3_from_hf(tiny["gemma3-gguf"], tmp_path / "gemma3-f32.gguf", gguf_fields)
    ids = smollm.tokenizer.encode(PROMPT)
    check_engine(load_model(str(path)), reference_logits(tiny["gemma3-gguf"], "gemma3", ids), ids, atol=1e-4)


def test_gemma3_gguf_quant_types_against_their_dequantized_weights(tiny, smollm, gguf_fields, tmp_path):
    """Q5_0 and Q8_0 (Q8_0 blocks exactly) kept quantized give the logits of the same file dequantized."""
    path = write_gguf_gemma3_from_hf(tiny["gemma3-gguf"], tmp_path / "gemma3-q.gguf", gguf_fields,
                                     {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0",
                                      "ffn_gate.weight": "Q5_0", "ffn_up.weight": "Q5_0", "token_embd.weight": "Q8_0"})
    quantized = load_model(str(path), quantization="auto")
    assert quantized.quantization == "auto:none+q8_0"
    ids = smollm.tokenizer.encode(PROMPT)
    reference = LLMEngine(load_model(str(path), quantization="none"), EngineConfig(num_blocks=16))
    check_engine(quantized, engine_logits(reference, ids), ids, atol=2e-2)


def _tensor(kind: str, n: int, k: int, raw: np.ndarray):
    return types.SimpleNamespace(shape=[k, n], data=raw, tensor_type=gguf.GGMLQuantizationType[kind])


def _random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks: random bytes, with every float16 scale a small finite number."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scales = {"Q4_K": (0, 2), "Q6_K": (size - 2,), "Q5_0": (0,), "Q4_0": (0,), "Q8_0": (0,)}[kind]
    for at in scales:
        raw[..., at:at + 2] = rng.uniform(0.001, 0.05, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0"])
def test_q8_codes_are_the_blocks_exactly(kind):
    rng = np.random.default_rng(0)
    raw = _random_blocks(kind, 64, 256, rng)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(64, 256)
    got = Q8Weight(*_q8_codes(_tensor(kind, 64, 256, raw), 0)).dequantize().numpy()
    np.testing.assert_array_equal(got, expected)


def test_q4_k_codes_keep_the_blocks_but_for_float16_sub_scales():
    rng = np.random.default_rng(1)
    raw = _random_blocks("Q4_K", 64, 512, rng)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(64, 512)
    got = Int4Weight.from_codes(*_q4_codes(_tensor("Q4_K", 64, 512, raw), 0)).dequantize().numpy()
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() < scale * 2 ** -10  # float16 sub-scales: 2^-11 relative, of d and of m


def test_q6_k_requantized_to_q8_0_within_a_quarter_of_its_step():
    rng = np.random.default_rng(2)
    raw = _random_blocks("Q6_K", 32, 256, rng)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(32, 256)
    got = Q8Weight.quantize(torch.from_numpy(w)).dequantize().numpy()
    step = np.abs(w).reshape(32, 8, 32).max(-1) / 127  # Q8_0's step per 32
    err = np.abs(got - w).reshape(32, 8, 32).max(-1)
    assert (err <= step * 0.5 + 1e-6).all()


def test_gemma3_config_json_as_transformers_4_writes_it(tiny, tmp_path):
    """No rope_parameters, no head_dim or tie_word_embeddings (their defaults were left out): the local layers
    still get rope_local_base_freq, the head is tied, head_dim is Gemma 3's 256."""
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(tiny["gemma3"], old)
    cfg = json.loads((old / "config.json").read_text())
    for key in ("rope_parameters", "head_dim", "tie_word_embeddings", "layer_types"):
        cfg.pop(key, None)
    (old / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                                 "sliding_window_pattern": 6, "num_hidden_layers": 8}))
    got = load_text(str(old)).config
    assert (got.rope_theta, got.rope_local_theta, got.head_dim, got.tie_embeddings) == (1e6, 1e4, 256, True)
    assert got.local_layers == (0, 1, 2, 3, 4, 6, 7) and got.attn_scale == pytest.approx(24 ** -0.5)


def test_unsupported_family_and_settings_named(tiny, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny["gemma3"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "final_logit_softcapping": 30.0}))
    with pytest.raises(ModelLoadError, match="final_logit_softcapping"):
        load_text(str(bad))
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["PhiForCausalLM"], "model_type": "phi"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'PhiForCausalLM'.*Gemma3ForCausalLM"):
        load_text(str(bad))


def test_unsupported_gguf_architecture_named_before_any_weight(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    finish_gguf(w)
    with pytest.raises(ModelLoadError, match=r"phi\.gguf: unsupported architecture 'phi2' \(general\.architecture; "
                                             r"supported: llama, gemma3, qwen2, qwen3\)"):
        load_text(str(tmp_path / "phi.gguf"))
