"""Tiny random models written by tests (as Hugging Face directories and as GGUF), and the engine's logits of
a prompt computed the ways the tests compare with a reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from engine.engine import LLMEngine
from engine.gguf_file import gguf_fields, open_gguf


def finish_gguf(w) -> None:
    """Write a `gguf.GGUFWriter`'s header, metadata and tensors to its file, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


#: the BPE vocabulary alone, without the source model's special ids and chat template
BPE_VOCABULARY = ("tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def tokenizer_fields(gguf_path: Path, keys: tuple[str, ...] | None = None) -> dict:
    """A GGUF's tokenizer.ggml.* metadata, or only `keys` of it (what `write_gguf_from_hf` copies into a tiny
    model's file)."""
    return {k: v for k, v in gguf_fields(open_gguf(gguf_path)).items()
            if (k in keys if keys is not None else k.startswith("tokenizer.ggml."))}


def write_hf_llama(dst: Path, tokenizer_json: str, *, rope_scaling: dict | None = None, tie: bool = True,
                   seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, rope_scaling=rope_scaling, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # random init is tiny; scale up so logits differ visibly between tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(dst, safe_serialization=True)
    (dst / "tokenizer.json").write_text(tokenizer_json)
    (dst / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": None}))
    return dst


def _gguf_writer(dst: Path, arch: str, cfg: dict):
    """A GGUFWriter with the hyper-parameters every architecture writes the same way."""
    import gguf

    w = gguf.GGUFWriter(str(dst), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    return w


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion: half-split RoPE rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_from_hf(hf_dir: Path, dst: Path, fields_from: dict, qtype: str = "F32", *,
                       tokenizer_model: str = "gpt2", rope_scaling_type: str | None = None) -> Path:
    """Convert the tiny HF model to GGUF the way llama.cpp does (permuted Q/K), optionally quantized.

    `tokenizer_model` and `rope_scaling_type` let tests write GGUFs the loader must refuse.
    """
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    w = _gguf_writer(dst, "llama", cfg)
    w.add_rope_freq_base((cfg.get("rope_parameters") or cfg)["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    if rope_scaling_type is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling_type))
        w.add_rope_scaling_factor(4.0)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(fields_from["tokenizer.ggml.pre"])
    w.add_token_list(fields_from["tokenizer.ggml.tokens"])
    w.add_token_types(fields_from["tokenizer.ggml.token_type"])
    w.add_token_merges(fields_from["tokenizer.ggml.merges"])
    w.add_eos_token_id(2)
    qt = gguf.GGMLQuantizationType[qtype]

    def add(name: str, t: torch.Tensor, permute_heads: int = 0) -> None:
        arr = t.float().numpy()
        if permute_heads:
            arr = _permute(arr, permute_heads)
        if arr.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        add("output.weight", sd["lm_head.weight"])
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        add(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add(b + "attn_q.weight", sd[p + "self_attn.q_proj.weight"], nh)
        add(b + "attn_k.weight", sd[p + "self_attn.k_proj.weight"], nkv)
        add(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        add(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    finish_gguf(w)
    return dst


def write_hf_family(family: str, dst: Path, tokenizer_json: str, seed: int = 0, query_pre_attn_scalar: int = 24) -> Path:
    """A tiny random Qwen2, Qwen3 or Gemma 3 model as a Hugging Face directory: every graph feature on
    (Q/K/V biases, q/k norms, sandwich norms, sliding-window layers whose window the tests' prompts pass).
    llama.cpp scales Gemma 3's attention by head_dim (16 here) whatever query_pre_attn_scalar says."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if family == "gemma3":
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=16,
                                            query_pre_attn_scalar=query_pre_attn_scalar,
                                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                            tie_word_embeddings=True)
        cfg.architectures = ["Gemma3ForCausalLM"]
        model = transformers.Gemma3ForCausalLM(cfg)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        cfg.architectures = ["Qwen2ForCausalLM"]
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, tie_word_embeddings=True)
        cfg.architectures = ["Qwen3ForCausalLM"]
        model = transformers.Qwen3ForCausalLM(cfg)
    model = model.float()
    with torch.no_grad():  # random init is tiny (norms and biases start at 0 or 1): make every tensor count
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(dst, safe_serialization=True)
    (dst / "tokenizer.json").write_text(tokenizer_json)
    (dst / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": None}))
    return dst


def write_gguf_gemma3_from_hf(hf_dir: Path, dst: Path, fields_from: dict, qtypes: dict[str, str] | None = None) -> Path:
    """The tiny Gemma 3 as llama.cpp's converter writes it: norms stored as 1 + w, Q/K not permuted (NEOX RoPE),
    the sliding window and its pattern in the metadata. `qtypes`: GGUF tensor name suffix -> quant type
    (e.g. {"attn_q.weight": "Q5_0"}); the rest F32."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    w = _gguf_writer(dst, "gemma3", cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields_from["tokenizer.ggml.pre"])
    w.add_token_list(fields_from["tokenizer.ggml.tokens"])
    w.add_token_types(fields_from["tokenizer.ggml.token_type"])
    w.add_token_merges(fields_from["tokenizer.ggml.merges"])
    w.add_eos_token_id(2)
    qtypes = qtypes or {}

    def add(name: str, t: torch.Tensor, norm: bool = False) -> None:
        arr = t.float().numpy() + (1.0 if norm else 0.0)
        qt = gguf.GGMLQuantizationType[next((q for suffix, q in qtypes.items() if name.endswith(suffix)), "F32")]
        if arr.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"], norm=True)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        for theirs, ours in names.items():
            add(f"blk.{i}.{ours}.weight", sd[f"model.layers.{i}.{theirs}.weight"], norm=ours.endswith("norm"))
    finish_gguf(w)
    return dst


def engine_logits(engine: LLMEngine, ids: list[int], split: int | None = None) -> torch.Tensor:
    """Logits at every position: whole prefill, or prefill[:split] then the rest attending via the pool."""
    return engine.prompt_logits(ids, [split] if split else [])


def decode_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits of the last token computed through the batched decode path."""
    return engine.prompt_logits(ids, [len(ids) - 1])[-1]
