"""Sampling parameters and the batched sampler: penalties, temperature, top-k/top-p, seeds, logprobs.

The sampler works on the whole batch with tensor ops. Each sampled row draws one uniform number
(from its own generator when the request has a seed) and picks its token by inverting the CDF of
its distribution — over the vocabulary in id order, or, when top-k or top-p cut it, over the kept
tokens from the most likely down — so a row's draw never depends on its batch neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the bad field, so the API can answer 400 with `param`."""
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be 0 (off) or positive"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20, "must be between 0 and 20"),
            ("stop", len(self.stop) <= 16 and all(self.stop), "at most 16 non-empty strings"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must fit in a signed 64-bit integer"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


NUCLEUS_CANDIDATES = 1024  # top-p first looks for its nucleus among this many most likely tokens


class Sampler:
    """Samples one token per row. Each row has its own params, output history and generator."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        outputs: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits.float().cpu()  # per-request generators live on the CPU
        rows = logits.shape[0]
        penalised = [i for i, p in enumerate(params) if (p.frequency_penalty or p.presence_penalty) and outputs[i]]
        if penalised:
            logits = _apply_penalties(logits, penalised, params, outputs)
        tokens = logits.argmax(dim=-1)
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


def _apply_penalties(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     outputs: list[list[int]]) -> torch.Tensor:
    """OpenAI's frequency (per occurrence) and presence (once) penalties, for all `rows` at once."""
    row_ids = torch.tensor([i for i in rows for _ in outputs[i]])
    token_ids = torch.tensor([t for i in rows for t in outputs[i]])
    counts = torch.zeros_like(logits).index_put_((row_ids, token_ids), torch.ones(len(token_ids)), accumulate=True)
    freq = torch.tensor([params[i].frequency_penalty if i in rows else 0.0 for i in range(len(params))])
    pres = torch.tensor([params[i].presence_penalty if i in rows else 0.0 for i in range(len(params))])
    return logits - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0)


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One U[0, 1) per row: from the row's generator when it has one, else one batched global draw."""
    u = torch.rand(len(generators))
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g)[0]
    return u


def _draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
          ) -> torch.Tensor:
    """Sampled token ids of non-greedy rows: temperature, then top-k, then top-p over what remains."""
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    vocab = probs.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    u = _uniforms(generators)
    if bool((top_k == vocab).all() and (top_p >= 1.0).all()):  # plain temperature: the whole distribution
        return _invert_cdf(probs, u)
    k = int(top_k.max())
    if k == vocab and bool((top_p < 1.0).any()):
        k = min(vocab, NUCLEUS_CANDIDATES)
    for width in (k, vocab):  # the candidates usually hold the nucleus; if not, sort everything
        vals, idx = probs.topk(width) if width < vocab else probs.sort(dim=-1, descending=True)
        rank = torch.arange(width).unsqueeze(0)
        vals = vals.masked_fill(rank >= top_k.unsqueeze(1), 0.0)
        mass = vals.sum(-1, keepdim=True)  # of what top-k keeps (the whole distribution without top-k)
        total = torch.where(top_k.unsqueeze(1) < vocab, mass, torch.ones_like(mass))
        cum = vals.cumsum(-1) / total
        # keep the smallest set whose mass reaches top_p; a row that needs more than `width` tokens retries
        keep = (cum - vals / total) < top_p.unsqueeze(1)
        untruncated = (top_k == vocab) & (top_p >= 1.0)
        complete = (cum[:, -1] >= top_p) | (top_k < vocab) | untruncated
        if width == vocab or bool(complete.all()):
            break
    vals = vals * keep
    picked = _invert_cdf(vals, u)
    out = idx.gather(1, picked.unsqueeze(1)).squeeze(1)
    if bool(untruncated.any()):  # plain-temperature rows of a mixed batch draw from the whole distribution
        out[untruncated] = _invert_cdf(probs[untruncated], u[untruncated])
    return out


def _invert_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds u * total (zero weights are never picked)."""
    cum = weights.cumsum(-1)
    target = (u * cum[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cum, target, right=True).squeeze(1)
    return picked.clamp_max(weights.shape[1] - 1)
