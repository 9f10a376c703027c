"""What ``tandem bench`` sends: prompts of a given token length, and the datasets made of them.

Why the tokenizer: "a 2,000-token prompt" must be 2,000 tokens as the served model counts
them, chat template included, or a long-prompt experiment measures something else. Prompts
are made of whole-token words (vocabulary entries that are a space and a lowercase word, and
encode back to exactly that one token), so a prompt's length can be set exactly; random words
from a per-request seed make every prompt distinct, sharing at most the chat template's
system prompt (or, for ``shared-prefix``, the system prompt chosen for it). Without a
tokenizer (another model) prompts are built from a built-in word list and their lengths are
estimates, said so in the result.

Datasets, with ``vllm bench serve``'s length conventions (``--random-input-len``,
``--random-output-len``, ``--random-range-ratio``):

- ``random``: prompts of ``input_len`` tokens, ``output_len`` out, lengths drawn uniformly from
  ``[len·(1−r), len·(1+r)]``.
- ``shared-prefix``: ``num_prefixes`` system prompts of ``prefix_len`` tokens, request *i* uses
  prefix *i mod K*, followed by ``input_len`` tokens of its own.
- ``mixed``: short chats as ``random`` (kind ``short``) and, at a fixed share ``long_share``
  evenly spaced, prompts of ``long_tokens`` tokens (kind ``long``) with ``long_output_len`` out.
- a ``.jsonl`` file: one ``{"messages": [...]}`` (chat) or ``{"prompt": "..."}`` (completions)
  per line, with ``max_tokens`` and optionally ``kind``; requests cycle through the lines.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

DATASETS = ("random", "shared-prefix", "mixed")

# Used only without a tokenizer; common English words, most of them one token in any BPE vocabulary.
_FALLBACK_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...


class Template(Protocol):
    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class Prompt:
    """One request's input: chat ``messages`` or a completions ``text``, how many tokens out, its class."""

    messages: list[dict[str, str]] | None
    text: str | None
    max_tokens: int
    input_tokens: int | None  # as the tokenizer counts the whole prompt; None when unknown
    kind: str = ""


class PromptBuilder:
    """Chat messages or completion texts of an exact token length (with a tokenizer), else estimated."""

    def __init__(self, tokenizer: Tokenizer | None = None, template: Template | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.words = self._token_words() if tokenizer is not None else list(_FALLBACK_WORDS)
        self.exact = tokenizer is not None

    def _token_words(self, limit: int = 4000) -> list[str]:
        """Vocabulary entries that are " word" and encode back to themselves alone."""
        tok = self.tokenizer
        assert tok is not None
        words: list[str] = []
        tid = 0
        misses = 0
        while len(words) < limit and misses < 5000:  # past the vocabulary's end ids decode to ""
            text = tok.decode([tid], skip_special=True)
            tid += 1
            body = text[1:]
            if text.startswith(" ") and 3 <= len(body) <= 9 and body.isascii() and body.isalpha() \
                    and body.islower() and tok.encode(text) == [tid - 1]:
                words.append(body)
                misses = 0
            else:
                misses += 1
        if len(words) < 100:
            raise ValueError(f"the tokenizer has too few whole-word tokens ({len(words)}) to build prompts")
        return words

    def count(self, messages: list[dict[str, str]] | None, text: str | None) -> int | None:
        """Tokens of the prompt as the server will see it (chat template applied); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        if messages is not None:
            if self.template is None:
                return None
            text = self.template.render(messages)
        return len(self.tokenizer.encode_prompt(text or ""))

    def filler(self, rng: random.Random, n: int) -> str:
        """``n`` random words, each one token after a space (the text starts with a space)."""
        return "".join(" " + rng.choice(self.words) for _ in range(max(0, n)))

    def chat(self, rng: random.Random, tokens: int, system: str | None = None) -> tuple[list[dict[str, str]], int | None]:
        """Messages whose rendered prompt is ``tokens`` long (the template's own tokens included)."""
        head = [{"role": "system", "content": system}] if system is not None else []
        base = self.count([*head, {"role": "user", "content": ""}], None)
        guess = tokens - base if base is not None else tokens
        words = self.filler(rng, max(1, guess) + 64)
        return self._fit(lambda k: build_words(head, words, k), guess, tokens)

    def completion(self, rng: random.Random, tokens: int) -> tuple[str, int | None]:
        """A completions prompt of ``tokens`` tokens."""
        words = self.filler(rng, tokens + 64)
        return self._fit(lambda k: _first_words(words, k), tokens, tokens)

    def _fit(self, make: Any, guess: int, target: int) -> tuple[Any, int | None]:
        """``make(k)`` for the word count ``k`` whose token count is ``target`` (or the closest above 1 word)."""
        if not self.exact:
            return make(max(1, guess)), None
        k = max(1, guess)
        best = None
        for _ in range(12):
            out = make(k)
            c = self._count_out(out)
            if best is None or abs(c - target) < abs(best[1] - target):
                best = (out, c)
            if c == target:
                return out, c
            step = target - c
            if k + step < 1:
                break
            k += step
        assert best is not None
        return best

    def _count_out(self, out: Any) -> int:
        if isinstance(out, str):
            return self.count(None, out) or 0
        return self.count(out, None) or 0


def _cut(words: str, n: int) -> int:
    """End offset of the first ``n`` words of a space-led word string."""
    pos = 0
    for _ in range(n):
        nxt = words.find(" ", pos + 1)
        if nxt < 0:
            return len(words)
        pos = nxt
    return pos


def _first_words(words: str, n: int) -> str:
    return words[: _cut(words, n)]


def build_words(head: list[dict[str, str]], words: str, n: int) -> list[dict[str, str]]:
    return [*head, {"role": "user", "content": _first_words(words, n).lstrip()}]


def draw_length(rng: random.Random, length: int, ratio: float) -> int:
    """``length`` drawn uniformly from ``[length·(1−ratio), length·(1+ratio)]`` (vLLM's range ratio), at least 1."""
    if ratio <= 0:
        return max(1, length)
    return max(1, rng.randint(math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))))


def is_long(index: int, share: float) -> bool:
    """Whether request ``index`` is one of the evenly spaced ``share`` of long ones."""
    return math.floor((index + 1) * share) > math.floor(index * share)


@dataclass
class SyntheticDataset:
    """``random``, ``shared-prefix`` or ``mixed``: request *i* is a pure function of (seed, i)."""

    name: str
    builder: PromptBuilder
    endpoint: str = "chat"  # chat | completions
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 512
    num_prefixes: int = 4
    long_share: float = 0.1
    long_tokens: int = 2000
    long_output_len: int = 16
    seed: int = 0
    _prefixes: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose {', '.join(DATASETS)} or a .jsonl file")
        for flag, value, least in (("--input-len", self.input_len, 1), ("--output-len", self.output_len, 1),
                                   ("--prefix-len", self.prefix_len, 1), ("--num-prefixes", self.num_prefixes, 1),
                                   ("--long-tokens", self.long_tokens, 1),
                                   ("--long-output-len", self.long_output_len, 1)):
            if value < least:
                raise ValueError(f"{flag} must be at least {least}, got {value}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"--long-share must be between 0 and 1, got {self.long_share}")
        if self.name == "shared-prefix" and self.endpoint != "chat":
            raise ValueError("the shared-prefix dataset shares system prompts: use --endpoint chat")

    def get(self, index: int) -> Prompt:
        """Request ``index``'s prompt (the same every time)."""
        rng = random.Random(f"{self.seed}:{self.name}:{index}")
        if self.name == "mixed" and is_long(index, self.long_share):
            return self._make(rng, self.long_tokens, self.long_output_len, "long")
        tokens = draw_length(rng, self.input_len, self.range_ratio)
        out = draw_length(rng, self.output_len, self.range_ratio)
        if self.name == "shared-prefix":
            system = self._prefix(index % self.num_prefixes)
            base = self.builder.count([{"role": "system", "content": system}], None)
            messages, count = self.builder.chat(rng, (base or self.prefix_len) + tokens, system)
            return Prompt(messages, None, out, count, "")
        return self._make(rng, tokens, out, "short" if self.name == "mixed" else "")

    def _make(self, rng: random.Random, tokens: int, out: int, kind: str) -> Prompt:
        if self.endpoint == "completions":
            text, count = self.builder.completion(rng, tokens)
            return Prompt(None, text, out, count, kind)
        messages, count = self.builder.chat(rng, tokens)
        return Prompt(messages, None, out, count, kind)

    def _prefix(self, k: int) -> str:
        """System prompt ``k`` of ``prefix_len`` words (each one token)."""
        if k not in self._prefixes:
            rng = random.Random(f"{self.seed}:prefix:{k}")
            self._prefixes[k] = f"Context {k}." + self.builder.filler(rng, self.prefix_len - 3)
        return self._prefixes[k]

    def describe(self) -> dict[str, Any]:
        """The dataset's parameters, for the JSON result."""
        out: dict[str, Any] = {"name": self.name, "endpoint": self.endpoint, "input_len": self.input_len,
                               "output_len": self.output_len, "range_ratio": self.range_ratio, "seed": self.seed,
                               "exact_lengths": self.builder.exact}
        if self.name == "shared-prefix":
            out.update(prefix_len=self.prefix_len, num_prefixes=self.num_prefixes)
        if self.name == "mixed":
            out.update(long_share=self.long_share, long_tokens=self.long_tokens, long_output_len=self.long_output_len)
        return out


@dataclass
class FileDataset:
    """Prompts read from a JSON-lines file; requests cycle through them."""

    path: Path
    prompts: list[Prompt]

    name = "file"

    @classmethod
    def load(cls, path: Path, builder: PromptBuilder, default_max_tokens: int) -> FileDataset:
        """Read ``path`` (ValueError naming the line for anything malformed)."""
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read dataset {path}: {e.strerror or e}") from None
        prompts = []
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{no}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            if not isinstance(row, dict) or ("messages" in row) == ("prompt" in row):
                raise ValueError(f'{where}: each line needs exactly one of "messages" or "prompt"')
            max_tokens = row.get("max_tokens", default_max_tokens)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
            kind = row.get("kind", "")
            if not isinstance(kind, str):
                raise ValueError(f"{where}: kind must be a string")
            if "messages" in row:
                msgs = row["messages"]
                if not (isinstance(msgs, list) and msgs and all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in msgs)):
                    raise ValueError(f'{where}: "messages" must be a list of {{"role", "content"}} strings')
                prompts.append(Prompt(msgs, None, max_tokens, builder.count(msgs, None), kind))
            else:
                if not isinstance(row["prompt"], str):
                    raise ValueError(f'{where}: "prompt" must be a string')
                prompts.append(Prompt(None, row["prompt"], max_tokens, builder.count(None, row["prompt"]), kind))
        if not prompts:
            raise ValueError(f"dataset {path} has no prompts")
        return cls(path, prompts)

    def get(self, index: int) -> Prompt:
        return self.prompts[index % len(self.prompts)]

    def describe(self) -> dict[str, Any]:
        return {"name": "file", "path": str(self.path), "prompts": len(self.prompts)}
