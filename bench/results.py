"""From timed requests to the figures ``tandem bench`` reports, in one JSON schema.

Latencies (milliseconds) are summarized as mean, p50, p90, p99 and max (linear interpolation
between order statistics, as numpy's default). Goodput follows DistServe: requests per second
that met *every* SLO given — ``ttft`` (time to first token), ``tpot`` (time per output token
after the first) and ``itl`` (every gap between two tokens of the request; a chunk of k tokens
counts as k gaps). A failed request meets none. Where the dataset labels requests (``mixed``:
``short`` and ``long``) every figure is also given per label.

The schema is ``SCHEMA``; its keys are the contract of ``--json`` (tests pin them).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from bench.loadgen import RequestRecord

SCHEMA = "tandem-bench/1"
LATENCY_STATS = ("mean", "p50", "p90", "p99", "max", "count")
SLO_KEYS = ("ttft", "itl", "tpot")


def parse_slo(items: list[str]) -> dict[str, float]:
    """``["ttft:3000", "itl:150"]`` → ``{"ttft": 3000.0, "itl": 150.0}`` (milliseconds); ValueError otherwise."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput {item!r}: the limit must be a positive number of milliseconds")
        out[key] = ms
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-quantile (0–1) of ascending ``sorted_values``, interpolated linearly."""
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def latency_stats(seconds: list[float]) -> dict[str, float | int | None]:
    """Mean/p50/p90/p99/max in milliseconds and the count; None for each figure when empty."""
    if not seconds:
        return {k: (0 if k == "count" else None) for k in LATENCY_STATS}
    ms = sorted(s * 1000.0 for s in seconds)
    return {"mean": round(sum(ms) / len(ms), 3), "p50": round(percentile(ms, 0.5), 3),
            "p90": round(percentile(ms, 0.9), 3), "p99": round(percentile(ms, 0.99), 3),
            "max": round(ms[-1], 3), "count": len(ms)}


def meets(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether ``rec`` succeeded and met every SLO in ``slo`` (milliseconds)."""
    if not rec.ok or rec.ttft is None:
        return False
    if "ttft" in slo and rec.ttft * 1000.0 > slo["ttft"]:
        return False
    tpot = rec.tpot()
    if "tpot" in slo and tpot is not None and tpot * 1000.0 > slo["tpot"]:
        return False
    gaps = rec.gaps()
    return not ("itl" in slo and gaps and max(gaps) * 1000.0 > slo["itl"])


def summarize(records: list[RequestRecord], duration: float, slo: dict[str, float]) -> dict[str, Any]:
    """The figures of one group of requests that ran within ``duration`` seconds."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_known = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    per_s = (lambda n: round(n / duration, 4)) if duration > 0 else (lambda n: None)
    met = sum(1 for r in records if meets(r, slo)) if slo else None
    return {
        "requests": {"sent": len(records), "completed": len(ok), "failed": len(records) - len(ok)},
        "tokens": {"input": sum(in_known) if in_known else None, "output": out_tokens,
                   "output_usage_source": sorted({r.usage_source for r in ok})},
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(out_tokens),
            "total_tokens_per_s": per_s(out_tokens + sum(in_known)) if in_known else None,
        },
        "latency_ms": {
            "ttft": latency_stats([r.ttft for r in ok if r.ttft is not None]),
            "tpot": latency_stats([t for r in ok if (t := r.tpot()) is not None]),
            "itl": latency_stats([g for r in ok for g in r.gaps()]),
            "e2e": latency_stats([r.e2e for r in ok if r.e2e is not None]),
        },
        "errors": dict(sorted(Counter(r.error_kind for r in records if not r.ok).items())),
        "goodput": None if met is None else {
            "requests_per_s": per_s(met), "met": met,
            "share": round(met / len(records), 4) if records else None,
        },
    }


def record_json(rec: RequestRecord) -> dict[str, Any]:
    """One request in the result (times in seconds)."""
    return {
        "index": rec.index, "kind": rec.kind, "start_s": round(rec.start, 6),
        "ttft_s": None if rec.ttft is None else round(rec.ttft, 6),
        "e2e_s": None if rec.e2e is None else round(rec.e2e, 6),
        "prompt_tokens": rec.prompt_tokens, "output_tokens": rec.output_tokens, "usage_source": rec.usage_source,
        "chunks": [[round(t, 6), k] for t, k in rec.chunks],
        "error_kind": rec.error_kind, "error": rec.error,
    }


def run_json(load: dict[str, Any], records: list[RequestRecord], duration: float,
             slo: dict[str, float]) -> dict[str, Any]:
    """One load level: its load, figures for all requests and per kind, the requests themselves."""
    kinds = sorted({r.kind for r in records if r.kind})
    return {
        "load": load,
        "duration_s": round(duration, 4),
        **summarize(records, duration, slo),
        "by_kind": {k: summarize([r for r in records if r.kind == k], duration, slo) for k in kinds},
        "records": [record_json(r) for r in records],
    }


def error_samples(records: list[RequestRecord], per_kind: int = 1) -> dict[str, list[str]]:
    """A message or two per error kind, for the person reading the summary."""
    out: dict[str, list[str]] = {}
    for r in records:
        if not r.ok and len(out.setdefault(r.error_kind or "?", [])) < per_kind:
            out[r.error_kind or "?"].append(r.error or "")
    return out
