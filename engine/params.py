"""The one request schema: sampling parameters of one sequence, and the grammar its output follows.

Why here: the gateway builds it, the bus carries it (``bus.generate_messages`` and ``bus.prefill_messages``
embed it in GenerateRequest and PrefillJob) and the engine samples with it, so it lives in the lowest layer
that all three import, without torch (the gateway never imports torch). It is validated twice: at the edge
(the gateway, or a worker decoding a hand-written bus message) and where the engine accepts it;
:meth:`SamplingParams.validate` is that one check, and its error names the field for an HTTP 400.
"""

from __future__ import annotations

from typing import Literal

import msgspec

#: what a grammar's ``value`` holds, per kind
GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]


class Grammar(msgspec.Struct, kw_only=True):
    """A constraint on the whole output, enforced while sampling (``engine.grammar``).

    ``json_schema``: ``value`` is a JSON Schema as JSON text; ``json_object``: any JSON object
    (``value`` unused); ``regex``: a regular expression; ``lark``: a Lark grammar in llguidance's
    dialect (``%json{...}`` embeds a schema; the tool-call grammars are written this way).
    """

    kind: GrammarKind
    value: str = ""


class SamplingParams(msgspec.Struct, kw_only=True):
    """How one sequence is sampled (``n`` > 1 is fanned out by the gateway).

    ``top_k`` 0 disables top-k; ``seed`` None means unseeded; ``stop`` strings are matched on
    detokenized text, ``stop_token_ids`` on ids. ``repetition_penalty`` divides (or, for negative
    logits, multiplies) the logits of tokens already in the output; 1 is off.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    grammar: Grammar | None = None

    def validate(self) -> None:
        """Raise ValueError(message, field) naming the first bad field (the API answers 400 with ``param``)."""
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be 0 (off) or positive"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20, "must be between 0 and 20"),
            ("top_logprobs", self.logprobs or not self.top_logprobs, "requires logprobs"),
            ("stop", len(self.stop) <= 16 and all(self.stop), "at most 16 non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be token ids (0 or more)"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must fit in a signed 64-bit integer"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}", name)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0 or top-k 1."""
        return self.temperature == 0.0 or self.top_k == 1
