"""Qwen2 (biases on Q/K/V) and Qwen3 (RMSNorm of each query and key head): Llama's graph otherwise."""

from engine.families.base import (
    LLAMA_LAYER_NAMES,
    QK_NORM_NAMES,
    QKV_BIAS_NAMES,
    Family,
    FamilyConfigError,
    local_layers_of,
)


def _windows(c: dict) -> dict:
    """Qwen's sliding window applies only with use_sliding_window (no released model turns it on)."""
    if not c.get("use_sliding_window"):
        return {}
    layers = c["num_hidden_layers"]
    # without layer_types (configs before transformers 5): the layers from max_window_layers on
    local = local_layers_of(c, layers) if c.get("layer_types") \
        else tuple(range(c.get("max_window_layers", layers), layers))
    if local and not c.get("sliding_window"):
        raise FamilyConfigError("use_sliding_window without a sliding_window size")
    return {"sliding_window": int(c["sliding_window"]), "local_layers": local} if local else {}


QWEN2 = Family(
    name="qwen2",
    gguf_archs=("qwen2",),
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    gguf_config=lambda fields, arch: {"qkv_bias": True},
    hf_config=lambda c: {"qkv_bias": True, **_windows(c)},
    hf_layer_names={**LLAMA_LAYER_NAMES, **QKV_BIAS_NAMES},
)

QWEN3 = Family(
    name="qwen3",
    gguf_archs=("qwen3",),
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    gguf_config=lambda fields, arch: {"qk_norm": True},
    hf_config=lambda c: {"qk_norm": True, "qkv_bias": bool(c.get("attention_bias")), **_windows(c)},
    hf_layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES, **QKV_BIAS_NAMES},
)
