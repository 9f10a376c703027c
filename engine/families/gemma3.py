"""Gemma 3 (text): embeddings scaled by sqrt(hidden); RMSNorm weights of (1 + w); norms before and after
attention and MLP; RMSNorm of each query and key head; a GELU(tanh)-gated MLP; five sliding-window layers
(RoPE base 10k) to each global one (1M); a tied head. Checked against llama.cpp's gemma3 graph and
transformers' modeling_gemma3."""

from engine.families.base import (
    LLAMA_LAYER_NAMES,
    QK_NORM_NAMES,
    Family,
    FamilyConfigError,
    all_but_every,
    local_layers_of,
    rope_theta_of,
)

PATTERN = 6  # every sixth layer is global (llama.cpp's set_swa_pattern(6), transformers' sliding_window_pattern)
LOCAL_ROPE_THETA = 10000.0  # llama.cpp: rope_freq_base_train_swa; transformers: rope_local_base_freq
HEAD_DIM = 256  # Gemma3TextConfig's default, which a config.json written by transformers 4.x leaves out

_GRAPH = {"qk_norm": True, "sandwich_norms": True, "activation": "gelu_tanh"}


def _gguf(fields: dict, arch: str) -> dict:
    for key in (f"{arch}.final_logit_softcapping", f"{arch}.attn_logit_softcapping"):
        if fields.get(key):
            raise FamilyConfigError(f"{key} is set: logit soft-capping (Gemma 2) is not implemented")
    layers, hidden, heads = fields[f"{arch}.block_count"], fields[f"{arch}.embedding_length"], \
        fields[f"{arch}.attention.head_count"]
    head_dim = fields.get(f"{arch}.attention.key_length", hidden // heads)
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern", PATTERN)
    local = tuple(i for i, swa in enumerate(pattern) if swa) if isinstance(pattern, list) \
        else all_but_every(pattern, layers)
    # llama.cpp: the 27B model (62 layers) scales by its query_pre_attn_scalar = hidden / heads, the others by head_dim
    scale = (hidden / heads) ** -0.5 if layers == 62 else head_dim ** -0.5
    return {**_GRAPH, "embed_scale": hidden ** 0.5, "attn_scale": scale,
            "sliding_window": int(fields.get(f"{arch}.attention.sliding_window", 0)),
            "local_layers": local if fields.get(f"{arch}.attention.sliding_window") else (),
            "rope_local_theta": LOCAL_ROPE_THETA}


def _hf(c: dict) -> dict:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key):
            raise FamilyConfigError(f"{key} is {c[key]}: logit soft-capping is not implemented")
    if c.get("use_bidirectional_attention"):
        raise FamilyConfigError("use_bidirectional_attention is set: only causal attention is implemented")
    if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise FamilyConfigError(f"hidden_activation {c['hidden_activation']!r}: only gelu_pytorch_tanh is implemented")
    layers = c["num_hidden_layers"]
    local = local_layers_of(c, layers, PATTERN) if c.get("sliding_window") else ()
    head_dim = c.get("head_dim") or HEAD_DIM
    # transformers 5 writes rope_parameters per layer kind; 4.x configs say rope_theta and rope_local_base_freq
    sliding = (c.get("rope_parameters") or {}).get("sliding_attention") or {}
    out = {**_GRAPH, "embed_scale": c["hidden_size"] ** 0.5, "head_dim": head_dim,
           "attn_scale": float(c.get("query_pre_attn_scalar") or head_dim) ** -0.5,
           "sliding_window": int(c.get("sliding_window") or 0), "local_layers": local,
           "rope_theta": rope_theta_of(c, "full_attention", 1e6),
           "rope_local_theta": float(sliding.get("rope_theta") or c.get("rope_local_base_freq") or LOCAL_ROPE_THETA)}
    full = (c.get("rope_parameters") or {}).get("full_attention")
    if isinstance(full, dict) and full.get("rope_type", "default") != "default":
        out["rope_scaling"] = full
    return out


# Gemma's own format; a system message opens the first user turn (Gemma has no system role).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

GEMMA3 = Family(
    name="gemma3",
    gguf_archs=("gemma3",),
    hf_architectures=("Gemma3ForCausalLM",),
    hf_model_types=("gemma3_text",),
    gguf_config=_gguf,
    hf_config=_hf,
    # Gemma's post_attention_layernorm norms the attention output; its MLP has norms of its own before and after
    hf_layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES, "post_attention_layernorm.weight": "post_attn_norm",
                    "pre_feedforward_layernorm.weight": "ffn_norm", "post_feedforward_layernorm.weight": "post_ffn_norm"},
    hf_norm_offset=1.0,
    hf_tied_default=True,
    chat_template=CHAT_TEMPLATE,
)
