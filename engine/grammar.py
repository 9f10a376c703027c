"""Structured output: a request's :class:`~engine.params.Grammar` as a token mask, with llguidance.

Why llguidance (not xgrammar): both run on CPU; here xgrammar's masks were faster per token
(3–6 µs against 17–63 µs, ``bench/grammar.py``, docs/benchmarks.md) but it compiled a schema
6–10× slower and imports transformers (and declares triton and torch as dependencies), while
llguidance has no dependencies at all; tens of microseconds per token are well under 1% of a decode
step here. Both the gateway (to refuse a bad grammar with a 400 before it is sent) and the engine
(to mask) use this module; it does not import torch.

One :class:`GrammarState` per sequence: :meth:`GrammarState.fill_mask` writes the allowed-token
bitmask for the next token (one bit per token id, 32 per int32), :meth:`GrammarState.accept`
advances it by each accepted token. Resumed tokens (a migrated stream) are replayed through
:meth:`GrammarState.accept` too.
"""

from __future__ import annotations

import json

import llguidance

from engine.params import Grammar

#: JSON as compact as json.dumps(separators=(",", ":")): no whitespace a small model could loop on
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """A grammar that does not compile (ValueError(message, "response_format") for the API)."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message, param)


def llguidance_grammar(g: Grammar) -> str:
    """The grammar in llguidance's own form (a JSON string)."""
    if g.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if g.kind == "json_schema":
        try:
            schema = json.loads(g.value)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if g.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(g.value)
    if g.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(g.value)
    raise GrammarError(f"unknown grammar kind {g.kind!r}")


def check_grammar(g: Grammar) -> None:
    """Raise :class:`GrammarError` for a grammar that cannot compile (no tokenizer needed)."""
    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance_grammar(g))
    except ValueError as e:  # grammar_from_json_schema refuses a non-object
        raise GrammarError(f"invalid {g.kind.replace('_', ' ')}: {e}") from e
    if error:
        raise GrammarError(f"invalid {g.kind.replace('_', ' ')}: {error}")


class GrammarCompiler:
    """Compiles grammars against one tokenizer (built once per engine: it indexes the vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids)

    def compile(self, g: Grammar) -> GrammarState:
        """A fresh matcher for ``g`` (raises :class:`GrammarError`)."""
        try:
            source = llguidance_grammar(g)
        except ValueError as e:
            raise GrammarError(f"invalid {g.kind.replace('_', ' ')}: {e}") from e
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {g.kind.replace('_', ' ')}: {matcher.get_error()}")
        return GrammarState(matcher, self.vocab_size)


class GrammarState:
    """Where one sequence's output stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32  # int32 words of one mask row

    def fill_mask(self, address: int) -> None:
        """Write the next token's allowed-token bitmask (``words`` int32) at ``address``."""
        self.matcher.unsafe_compute_mask_ptr(address, self.words * 4)

    def forced(self) -> list[int]:
        """The tokens the grammar allows next and nothing else (a JSON key, a closing brace): a draft that is
        all but certain to be kept (grammar fast-forward, engine/speculation.py)."""
        return self.matcher.compute_ff_tokens()

    def after(self, tokens: list[int]) -> GrammarAfter:
        """This state as it would stand after ``tokens``, for the mask of a draft's row."""
        return GrammarAfter(self, tokens)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it (the matcher is then in error)."""
        return self.matcher.consume_token(token)

    def accept_all(self, tokens: list[int]) -> bool:
        """Replay ``tokens`` (a resumed output); False at the first one the grammar refuses."""
        return self.matcher.consume_tokens(tokens) if tokens else True

    @property
    def finished(self) -> bool:
        """Nothing but an end-of-sequence token can follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher stopped accepting, or ''."""
        return self.matcher.get_error() if self.matcher.is_error() else ""


class GrammarAfter:
    """A :class:`GrammarState` advanced by a draft's tokens, only for its mask: the state is advanced, the mask
    written, and the state rolled back. Past a draft token the grammar refuses, the mask is that of the tokens
    before it: that row is never kept (its row before drew something else)."""

    def __init__(self, state: GrammarState, tokens: list[int]) -> None:
        self.state = state
        self.tokens = tokens
        self.words = state.words

    def fill_mask(self, address: int) -> None:
        matcher = self.state.matcher
        n = matcher.try_consume_tokens(self.tokens)
        try:
            self.state.fill_mask(address)
        finally:
            matcher.rollback(n)
