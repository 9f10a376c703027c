"""Rotary position embeddings (RoPE): each frequency of a config, with its scaling, and their rotation of q and k."""

from __future__ import annotations

import math

import torch

from engine.config import ROPE_SCALING_KEYS, ModelConfig, rope_scaling_type


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with llama3-style scaling when the config asks for it."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    sc = cfg.rope_scaling or {}
    kind = rope_scaling_type(sc)
    if kind == "llama3":
        factor = sc["factor"]
        low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        orig = sc["original_max_position_embeddings"]
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "factors":  # GGUF's rope_freqs tensor: per-frequency divisors
        inv = inv / torch.tensor(sc["factors"], dtype=torch.float64)
    elif kind != "default":  # the loader refuses these first; guard for configs built by hand
        supported = ", ".join(ROPE_SCALING_KEYS)
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {supported})")
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (rotate_half) RoPE on [N, heads, head_dim]; cos [N, 1, head_dim], sin with the sign of
    rotate_half folded in ([-sin, sin]), so it is x * cos + swap_halves(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)
