"""Model hyper-parameters, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

# RoPE scaling kinds the engine implements, with the keys each needs. "factors" is internal: a GGUF's
# rope_freqs tensor of per-frequency divisors. Anything else (yarn, dynamic, longrope) would silently
# produce wrong logits, so the loader refuses it up front.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings"),
    "factors": ("factors",),
}


def rope_scaling_type(scaling: dict | None) -> str:
    """The scaling kind of a rope_scaling dict (HF writes `rope_type`, older configs `type`)."""
    sc = scaling or {}
    return sc.get("rope_type") or sc.get("type") or "default"


ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    # The layer graph beyond Llama's, set by the model's family (engine.families); defaults are Llama's.
    family: str = "llama"
    qkv_bias: bool = False  # Q/K/V projections have biases (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # the attention and MLP outputs are normed before they join the residual (Gemma)
    activation: str = "silu"  # of the gated MLP: silu or gelu_tanh
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float = 0.0  # softmax scale of q.k; 0: 1 / sqrt(head_dim)
    sliding_window: int = 0  # tokens a local layer attends to (itself included); 0: none
    local_layers: tuple[int, ...] = ()  # the layers that attend through the window
    rope_local_theta: float = 0.0  # RoPE base of the local layers; 0: rope_theta

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_layers", tuple(self.local_layers))  # a JSON round trip gives a list
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def plain_llama(self) -> bool:
        """The Llama graph exactly: what engine.native's one-call-per-layer path computes."""
        return not (self.qkv_bias or self.qk_norm or self.sandwich_norms or self.local_layers) \
            and self.activation == "silu" and self.embed_scale == 1.0

    def window(self, layer: int) -> int:
        """Tokens layer `layer` attends to (0: all of them)."""
        return self.sliding_window if layer in self.local_layers else 0
