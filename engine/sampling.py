"""The batched sampler: grammar masks, penalties, temperature, top-k/top-p, seeds, logprobs.

The sampler works on the whole batch with tensor ops. Rows whose request has a grammar
(structured output, tool calls) first lose every token the grammar does not allow: each such row's
bitmask is filled by its :class:`~engine.grammar.GrammarState` and applied to all of them at once.
Each sampled row draws one uniform number
(from its own generator when the request has a seed) and picks its token by inverting the CDF of
its distribution — over the vocabulary in id order, or, when top-k or top-p cut it, over the kept
tokens from the most likely down — so a row's draw never depends on its batch neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import native
from engine.grammar import GrammarState
from engine.params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded request's draw for output token `index`: each draw depends on its
    position only, so preemption, migration or speculation draw the same numbers."""
    return (seed * 1_000_003 + index * 7_919) % (1 << 62)


NUCLEUS_CANDIDATES = 1024  # top-p first looks for its nucleus among this many most likely tokens


class Sampler:
    """Samples one token per row. Each row has its own params, output history and generator."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        outputs: list[list[int]],
        generators: list[torch.Generator | None],
        grammars: list[GrammarState | None] | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        if logits.device.type != "cpu" or logits.dtype != torch.float32:  # no-op calls cost ~5-50 µs on a step's cold caches
            logits = logits.float().cpu()  # per-request generators live on the CPU
        rows = logits.shape[0]
        penalised = [i for i, p in enumerate(params) if _penalises(p) and outputs[i]]
        if penalised:
            logits = _apply_penalties(logits, penalised, params, outputs)
        constrained = [i for i, g in enumerate(grammars or ()) if g is not None]
        if constrained:
            logits = _apply_grammars(logits, constrained, grammars)
        tokens = native.argmax(logits) if native.available() else logits.argmax(dim=-1)
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            tokens[drawn] = _draw(logits[drawn], [params[i] for i in drawn], [generators[i] for i in drawn])
        token_list = tokens.tolist()
        infos: list[TokenLogprob | None] = [None] * rows
        wanted = [i for i, p in enumerate(params) if p.logprobs]
        if wanted:
            logp = torch.log_softmax(logits[wanted], dim=-1)
            chosen = logp.gather(1, tokens[wanted].unsqueeze(1)).squeeze(1).tolist()
            k = max(params[i].top_logprobs for i in wanted)
            top_v, top_i = logp.topk(k) if k else (logp[:, :0], logp[:, :0].long())
            for j, i in enumerate(wanted):
                n = params[i].top_logprobs
                top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
                infos[i] = TokenLogprob(token_list[i], chosen[j], top)
        return token_list, infos


def _penalises(p: SamplingParams) -> bool:
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)


def _apply_penalties(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     outputs: list[list[int]]) -> torch.Tensor:
    """OpenAI's frequency (per occurrence) and presence (once) penalties and the repetition penalty
    (a seen token's logit divided by it when positive, multiplied when negative), for all `rows` at once."""
    row_ids = torch.tensor([i for i in rows for _ in outputs[i]])
    token_ids = torch.tensor([t for i in rows for t in outputs[i]])
    counts = torch.zeros_like(logits).index_put_((row_ids, token_ids), torch.ones(len(token_ids)), accumulate=True)
    seen = counts > 0
    freq = torch.tensor([params[i].frequency_penalty if i in rows else 0.0 for i in range(len(params))])
    pres = torch.tensor([params[i].presence_penalty if i in rows else 0.0 for i in range(len(params))])
    rep = torch.tensor([params[i].repetition_penalty if i in rows else 1.0 for i in range(len(params))]).unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * seen


_BIT = torch.arange(32, dtype=torch.int32)


def _apply_grammars(logits: torch.Tensor, rows: list[int], grammars: list[GrammarState | None]) -> torch.Tensor:
    """Every token a row's grammar does not allow next gets -inf, for all constrained `rows` at once."""
    words = grammars[rows[0]].words
    bits = torch.zeros(len(rows), words, dtype=torch.int32)
    for j, i in enumerate(rows):
        grammars[i].fill_mask(bits[j].data_ptr())
    allowed = ((bits.unsqueeze(-1) >> _BIT) & 1).view(len(rows), words * 32)[:, : logits.shape[1]].bool()
    index = torch.tensor(rows)
    return logits.index_put((index,), logits[index].masked_fill(~allowed, float("-inf")))


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One U[0, 1) per row: from the row's generator when it has one, else one batched global draw."""
    u = torch.rand(len(generators))
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g)[0]
    return u


def _draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
          ) -> torch.Tensor:
    """Sampled token ids of non-greedy rows: temperature, then top-k, then top-p over what remains.

    A row's draw never depends on the other rows: each row's candidates are its own choice (the
    `NUCLEUS_CANDIDATES` most likely, its top-k when that is more, every token when its nucleus needs more),
    so a batch only groups rows that would compute the same alone."""
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    vocab = probs.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    u = _uniforms(generators)
    out = torch.empty(len(params), dtype=torch.long)
    plain = (top_k == vocab) & (top_p >= 1.0)  # plain temperature: the whole distribution
    if bool(plain.any()):
        out[plain] = _invert_cdf(probs[plain], u[plain])
    narrow = min(vocab, NUCLEUS_CANDIDATES)
    rows = (~plain & ((top_k <= narrow) | (top_k == vocab))).nonzero().squeeze(1)
    wide = (~plain & (top_k > narrow) & (top_k < vocab)).nonzero().squeeze(1)
    if rows.numel():
        picked, complete = _truncated(probs[rows], top_k[rows], top_p[rows], u[rows], narrow)
        out[rows] = picked
        wide = torch.cat([wide, rows[~complete]])  # a nucleus wider than the candidates: all tokens
    for k in top_k[wide].unique().tolist():  # each row among its own top-k (all tokens: a wide nucleus)
        at = wide[top_k[wide] == k]
        out[at] = _truncated(probs[at], top_k[at], top_p[at], u[at], k)[0]
    return out


def _truncated(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, width: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's draw among its `width` most likely tokens after top-k and top-p, and whether those held
    all the row's nucleus (if not, the row must draw again over a wider set)."""
    vocab = probs.shape[1]
    vals, idx = probs.topk(width) if width < vocab else probs.sort(dim=-1, descending=True)
    rank = torch.arange(width).unsqueeze(0)
    vals = vals.masked_fill(rank >= top_k.unsqueeze(1), 0.0)
    mass = vals.sum(-1, keepdim=True)  # of what top-k keeps (the whole distribution without top-k)
    total = torch.where(top_k.unsqueeze(1) < vocab, mass, torch.ones_like(mass))
    cum = vals.cumsum(-1) / total
    keep = (cum - vals / total) < top_p.unsqueeze(1)  # the smallest set whose mass reaches top_p
    complete = (cum[:, -1] >= top_p) | (top_k < vocab)
    picked = _invert_cdf(vals * keep, u)
    return idx.gather(1, picked.unsqueeze(1)).squeeze(1), complete


def _invert_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds u * total (zero weights are never picked)."""
    cum = weights.cumsum(-1)
    target = (u * cum[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cum, target, right=True).squeeze(1)
    return picked.clamp_max(weights.shape[1] - 1)
