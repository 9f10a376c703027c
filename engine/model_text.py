"""What reading a model's files yields without its weights (`ModelText`), and the error when they cannot be used."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.chat_template import ChatTemplate
from engine.config import ModelConfig
from engine.tokenizer import TextTokenizer


class ModelLoadError(ValueError):
    """The model cannot be used; the message names the file (or alias) and what is wrong."""


@dataclass
class ModelText:
    """A model without its weights: what a gateway needs to tokenize, template and check lengths."""

    config: ModelConfig
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    identity: str  # name + weights digest, part of the KV layout fingerprint
    path: Path
    from_cache: bool
    #: sampling the model's files recommend (SamplingParams field -> value), for requests that leave them out
    sampling_defaults: dict[str, float] = field(default_factory=dict)


def declared_sampling(values: dict, keys: dict[str, str]) -> dict[str, float]:
    """The sampling defaults among ``values`` (a generation config or GGUF fields), by SamplingParams field."""
    out: dict[str, float] = {}
    for key, name in keys.items():
        v = values.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = int(v) if name == "top_k" else float(v)
    return out
