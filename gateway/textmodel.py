"""The text side of a model — tokenizer, chat template, context length — without its weights.

Why: the gateway tokenizes and applies the chat template itself (so it can route by prefix
and refuse over-long prompts before any worker is bothered), but it must never load or
dequantize weights. `engine.model_files.load_text` reads the same metadata the workers use, cached
as JSON after the first parse.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.chat_template import ChatTemplate
from engine.model_files import load_text, model_name
from engine.tokenizer import TextTokenizer

log = logging.getLogger("tandem.gateway.textmodel")


@dataclass
class TextModel:
    """What the gateway knows about the served model: name, tokenizer, template, limits."""

    name: str
    spec: str
    path: Path
    tokenizer: TextTokenizer
    chat_template: ChatTemplate
    max_position: int
    vocab_size: int
    load_seconds: float = 0.0
    from_cache: bool = False
    #: sampling the model recommends (SamplingParams field -> value) for requests that leave a field out
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def load_text_model(spec: str) -> TextModel:
    """Tokenizer, chat template and context length of ``spec`` (alias, .gguf or HF dir); no weights."""
    t0 = time.perf_counter()
    text = load_text(spec)
    tm = TextModel(model_name(spec), spec, text.path, text.tokenizer, text.chat_template,
                   text.config.max_position, text.config.vocab_size, time.perf_counter() - t0, text.from_cache,
                   dict(text.sampling_defaults))
    log.info(
        "text model %s: vocab %d, context %d, loaded in %.2fs%s",
        tm.name, tm.vocab_size, tm.max_position, tm.load_seconds, " (cached)" if tm.from_cache else "",
    )
    return tm


# ---- token bytes for logprobs ---------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character → byte map (inverse of ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()
_SPM_BYTE = re.compile(r"<0x[0-9A-F]{2}>")


class TokenBytes:
    """Text and raw bytes of single tokens, as OpenAI's logprobs show them (memoized)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        """(display text, utf-8 bytes) of one token; a byte-level piece, or a <0xXX> byte-fallback token, maps to
        its exact bytes."""
        hit = self._memo.get(tid)
        if hit is not None:
            return hit
        piece = self.tokenizer.id_to_token(tid) or ""
        raw = None
        if not self.tokenizer.byte_level:
            if _SPM_BYTE.fullmatch(piece):  # a byte-fallback token
                raw = bytes([int(piece[3:5], 16)])
        elif piece and all(ch in _BYTE_DECODER for ch in piece):
            raw = bytes(_BYTE_DECODER[ch] for ch in piece)
        if raw is not None:
            text = raw.decode("utf-8", errors="replace")
            out = (text if "\ufffd" not in text else self.tokenizer.token_text(tid), list(raw))
        elif not self.tokenizer.byte_level:  # SentencePiece-style: the piece is its text, U+2581 a space
            text = piece.replace("\u2581", " ")
            out = (text, list(text.encode("utf-8")))
        else:
            text = self.tokenizer.token_text(tid)
            out = (text, list(text.encode("utf-8")))
        if len(self._memo) < 200_000:
            self._memo[tid] = out
        return out
