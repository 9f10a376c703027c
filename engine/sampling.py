"""Sampling parameters and the sampler: penalties, temperature, top-k/top-p, seeds, logprobs."""

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


class Sampler:
    """Samples one token per row. Each row has its own params, output history and generator."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        outputs: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits.float().cpu()  # per-request generators live on the CPU; rows are small
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            logits = logits.clone()
            for i, (p, out) in enumerate(zip(params, outputs)):
                if out and (p.frequency_penalty or p.presence_penalty):
                    ids, counts = torch.tensor(out).unique(return_counts=True)
                    logits[i, ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
        logprobs_needed = any(p.logprobs for p in params)
        logp = torch.log_softmax(logits, dim=-1) if logprobs_needed else None
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = [self._sample_row(logits[i], p, g) for i, (p, g) in enumerate(zip(params, generators))]
        infos: list[TokenLogprob | None] = []
        for i, (p, t) in enumerate(zip(params, tokens)):
            if not p.logprobs:
                infos.append(None)
                continue
            top: list[tuple[int, float]] = []
            if p.top_logprobs:
                vals, idx = logp[i].topk(p.top_logprobs)
                top = list(zip(idx.tolist(), vals.tolist()))
            infos.append(TokenLogprob(t, float(logp[i, t]), top))
        return tokens, infos

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        if p.greedy:
            return int(row.argmax())
        row = row / p.temperature
        if p.top_k and p.top_k < row.numel():
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            drop = cum - sorted_p > p.top_p  # keep the smallest set whose mass reaches top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=gen))
