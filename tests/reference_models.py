"""Tiny random Llama models written by tests: as a Hugging Face directory and as GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


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
    w = gguf.GGUFWriter(str(dst), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base((cfg.get("rope_parameters") or cfg)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
