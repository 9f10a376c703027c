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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
