"""A family's description (`Family`) and the config.json readers several families share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

#: a Hugging Face layer tensor (after ``model.layers.N.``) -> the engine's name (see engine.loader.fuse_weights)
LLAMA_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
#: the same for the per-head q/k norms (Qwen3, Gemma 3) and the Q/K/V biases (Qwen2, Qwen3 with attention_bias)
QK_NORM_NAMES = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
QKV_BIAS_NAMES = {"self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv"}


class FamilyConfigError(ValueError):
    """The files ask for something this family's implementation does not compute (the message says what)."""


@dataclass(frozen=True)
class Family:
    name: str
    gguf_archs: tuple[str, ...]  # general.architecture values
    hf_architectures: tuple[str, ...]  # config.json "architectures"
    hf_model_types: tuple[str, ...]  # config.json "model_type"
    #: (GGUF fields, architecture prefix) -> ModelConfig fields beyond the common ones
    gguf_config: Callable[[dict, str], dict] = lambda fields, arch: {}
    #: config.json -> ModelConfig fields beyond the common ones
    hf_config: Callable[[dict], dict] = lambda c: {}
    hf_layer_names: dict[str, str] = field(default_factory=lambda: dict(LLAMA_LAYER_NAMES))
    gguf_permuted_qk: bool = False  # llama.cpp stores Q/K rows permuted for interleaved RoPE (arch "llama" only)
    hf_norm_offset: float = 0.0  # added to every norm weight of a Hugging Face checkpoint (Gemma: 1 + w)
    hf_tied_default: bool = False  # tie_word_embeddings where config.json leaves it out (its config class's default)
    chat_template: str | None = None  # when the files carry none (None: ChatML)


def rope_theta_of(c: dict, kind: str | None = None, default: float = 10000.0) -> float:
    """RoPE base from config.json: transformers >= 5 writes `rope_parameters` (per layer kind for Gemma 3)."""
    rope = c.get("rope_parameters") or {}
    if kind is not None and isinstance(rope.get(kind), dict):
        rope = rope[kind]
    return float(rope.get("rope_theta", c.get("rope_theta", default)))


def local_layers_of(c: dict, layers: int, pattern: int = 0) -> tuple[int, ...]:
    """Layers that attend through the sliding window: config.json's `layer_types`, else every layer but each
    `pattern`-th (Gemma 3's configs before `layer_types`), else none."""
    types = c.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or pattern
    return all_but_every(pattern, layers) if pattern else ()


def all_but_every(pattern: int, layers: int) -> tuple[int, ...]:
    """Every layer but each `pattern`-th: the sliding-window ones of an interleaved model."""
    return tuple(i for i in range(layers) if (i + 1) % pattern)

