"""What a model family is, in one place: how its GGUF metadata and Hugging Face config.json become a
`ModelConfig` (whose graph fields say what its layers compute beyond Llama's), what its Hugging Face
tensors are called, and what it needs that its files may not say (a chat template).

The loader, the model, the KV layout and the transfer know no family by name: they read the config.
Adding a family is a file here with a `Family` and a line in `FAMILIES`.
"""

from __future__ import annotations

from engine.families import gemma3, llama, qwen
from engine.families.base import Family, FamilyConfigError

__all__ = ["FAMILIES", "Family", "FamilyConfigError", "by_gguf_arch", "by_name", "by_hf_config", "supported"]

FAMILIES: tuple[Family, ...] = (llama.LLAMA, gemma3.GEMMA3, qwen.QWEN2, qwen.QWEN3)


def by_name(name: str) -> Family:
    """The family a ModelConfig names (its `family` field)."""
    return next(f for f in FAMILIES if f.name == name)


def by_gguf_arch(arch: str | None) -> Family | None:
    return next((f for f in FAMILIES if arch in f.gguf_archs), None)


def by_hf_config(c: dict) -> Family | None:
    archs = c.get("architectures") or []
    return next((f for f in FAMILIES if any(a in f.hf_architectures for a in archs)), None) \
        or next((f for f in FAMILIES if c.get("model_type") in f.hf_model_types), None)


def supported(kind: str) -> str:
    """The GGUF architectures ("gguf") or Hugging Face architectures ("hf") we serve, for error messages."""
    names = [n for f in FAMILIES for n in (f.gguf_archs if kind == "gguf" else f.hf_architectures)]
    return ", ".join(names)
