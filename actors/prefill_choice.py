"""Conditional disaggregation: whether a decode worker prefills a prompt here or on a prefill worker.

The choice weighs the uncached prompt length, the prefill workers' reported queue and the
transfer, as estimated from what this worker has seen (docs/architecture.md, "Where a prompt
is prefilled"):

1. ``uncached <= floor`` (``--local-prefill-max-tokens``): local, ``short_prompt``.
2. The estimated remote TTFT (queue wait + compute + transfer + hand-off) is no more than a
   local prefill's: remote, ``remote_faster``.
3. A local prefill would hold this worker's model thread longer than
   ``--prefill-stall-budget-ms``, stalling each of the ``decoding`` streams by ``local_s`` (at
   least one: what arrives meanwhile waits too); a remote one makes this request wait the
   prefill workers' queue. The smaller delay wins: remote, ``decode_stall``, while
   ``queue_s <= max(1, decoding) * local_s``; else local, ``prefill_backlog``. An empty queue
   always sends the prompt remote.
4. Otherwise local, ``local_faster``.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime import metrics

PRIOR_S_PER_TOKEN = 0.004  # prefill seconds per token before anything was measured (SmolLM2-135M, 1 CPU thread)
PRIOR_HANDOFF_S = 0.010  # remote TTFT beyond queue + compute + transfer before any remote prefill was seen
SMOOTHING = 0.2  # weight of the newest observation in each running estimate


def count_decision(mode: str, reason: str) -> None:
    """Where a prompt is prefilled and why (``tandem_decode_prefill_decisions_total``)."""
    metrics.PREFILL_DECISIONS.labels(mode, reason).inc()


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


@dataclass
class Estimate:
    """Seconds to a first token each way, and the parts of the remote one."""

    local_s: float
    queue_s: float
    compute_s: float
    transfer_s: float
    handoff_s: float

    @property
    def remote_s(self) -> float:
        return self.queue_s + self.compute_s + self.transfer_s + self.handoff_s


class PrefillCosts:
    """Running estimates of prefill costs, from this worker's own local and remote prefills."""

    def __init__(self) -> None:
        self.local_per_token: float | None = None  # local TTFT per uncached token
        self.remote_per_token: float | None = None  # prefill worker compute per token
        self.transfer_per_token: float | None = None
        self.handoff_s: float | None = None  # remote TTFT beyond queue, compute and transfer
        self.job_s: float | None = None  # a remote job's compute, for the queue ahead of a new one

    def saw_local(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self.local_per_token = _blend(self.local_per_token, seconds / tokens)

    def saw_remote(self, tokens: int, timings: dict[str, float], total_s: float) -> None:
        """A remote prefill of ``tokens`` landed ``total_s`` after it started; ``timings`` are its PrefillDone's."""
        if tokens <= 0:
            return
        compute, transfer = timings.get("compute", 0.0), timings.get("transfer", 0.0)
        self.remote_per_token = _blend(self.remote_per_token, compute / tokens)
        self.transfer_per_token = _blend(self.transfer_per_token, transfer / tokens)
        self.job_s = _blend(self.job_s, compute)
        self.handoff_s = _blend(self.handoff_s, max(0.0, total_s - timings.get("queue", 0.0) - compute - transfer))

    def estimate(self, uncached: int, jobs_ahead: int) -> Estimate:
        """Both ways for ``uncached`` tokens with ``jobs_ahead`` jobs queued at the least-loaded prefill worker.

        A side not measured yet borrows the other's per-token cost (same model), else the prior. A
        prefill worker runs the shortest prompts first, so a job ahead delays this one by at most
        this one's own compute.
        """
        local = self.local_per_token or self.remote_per_token or PRIOR_S_PER_TOKEN
        remote = self.remote_per_token or self.local_per_token or PRIOR_S_PER_TOKEN
        compute = uncached * remote
        job = min(self.job_s, compute) if self.job_s is not None else compute
        return Estimate(local_s=uncached * local, queue_s=jobs_ahead * job, compute_s=compute,
                        transfer_s=uncached * (self.transfer_per_token or 0.0),
                        handoff_s=PRIOR_HANDOFF_S if self.handoff_s is None else self.handoff_s)


def choose(uncached: int, floor: int, est: Estimate, stall_budget_s: float, decoding: int = 0) -> tuple[str, str]:
    """(``local`` | ``remote``, reason) by the rules in this module's docstring; ``decoding`` is the
    number of streams this worker is decoding, which a local prefill would stall."""
    if uncached <= floor:
        return "local", "short_prompt"
    if est.remote_s <= est.local_s:
        return "remote", "remote_faster"
    if est.local_s > stall_budget_s:
        if est.queue_s <= max(1, decoding) * est.local_s:
            return "remote", "decode_stall"
        return "local", "prefill_backlog"
    return "local", "local_faster"
