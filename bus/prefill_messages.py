"""What a decode worker and a prefill worker exchange: the prefill job with the KV destination, its
acceptance and result, and the transfer-engine metadata."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from bus.wire import Msg, NonNegInt, Part, TokenId, TopLogprob
from engine.params import SamplingParams


class KVDestination(Part, kw_only=True):
    """Where a prefill worker must write the KV: the decode worker's pre-allocated blocks.

    ``engine`` is the transfer engine (``nixl``, ``shm``, ``tcp``, ``cuda_ipc``, ``auto``);
    ``endpoint`` the subject answering with the pool's transfer metadata (NIXL agent blob,
    shm segment, host:port), fetched once per ``incarnation``, which
    changes when the decode worker restarts, so writes to a dead pool are refused.
    ``first_token_index`` is the first uncached prompt token: blocks cover tokens from
    there on (the prefix before it is already in the decode worker's cache). ``grant`` is the
    token the decode worker's pool made for these blocks and this attempt: an engine that takes
    writes from the network (TCP) refuses one without it (``kv.transfer.grants.WriteGrants``).
    """

    engine: str
    worker_id: str
    incarnation: str
    block_ids: list[NonNegInt]
    first_token_index: NonNegInt = 0
    endpoint: str | None = None
    grant: str = ""


class PrefillJob(Msg, tag="prefill_job", kw_only=True):
    """Decode worker → prefill worker (pool ``tandem.<model>.prefill`` or targeted).

    The prefill worker refuses a ``layout_fingerprint`` different from its own (the
    error names both ``layout`` dicts), computes the prompt, writes the KV for tokens
    ``dst.first_token_index`` onward into ``dst.block_ids`` and answers on
    ``reply_subject`` with a PrefillDone. ``attempt`` counts retries (0 first).
    """

    request_id: str
    prompt_ids: list[TokenId]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    layout_fingerprint: str
    layout: dict[str, Any] = {}
    dst: KVDestination
    reply_subject: str
    deadline: float = 0.0
    decode_worker_id: str = ""
    attempt: NonNegInt = 0
    model: str = ""
    created: float = msgspec.field(default_factory=time.time)


class PrefillAccepted(Msg, tag="prefill_accepted", kw_only=True):
    """Prefill worker → decode worker, on the job's ``reply_subject``: I took this job.

    Why: a job from the pool names no worker; this tells the decode worker whose
    liveness to watch, so a worker that dies mid-job is noticed within seconds, not at
    the job's deadline. ``transfer`` names the mechanism that will carry the KV ("" when
    not known yet): the decode worker polls for landings only through one that needs it.
    """

    request_id: str
    attempt: NonNegInt = 0
    prefill_worker_id: str
    transfer: str = ""


class PrefillDone(Msg, tag="prefill_done", kw_only=True):
    """Prefill worker → decode worker: the KV is written (ok) or why not.

    ``timings`` keys are seconds: ``queue`` (until its first engine step, in this worker's backlog and
    behind shorter prompts), ``compute`` (the engine steps it was in), ``step`` (the last of them),
    ``transfer`` (after the last step, until the KV landed), ``write`` (from the first KV byte sent until
    the last landed: with layer-wise streaming that overlaps the compute). ``transfer`` (the field) names
    the mechanism that carried the KV.
    ``first_top_logprobs`` is a list of ``[token_id, logprob]`` pairs.
    """

    request_id: str
    ok: bool
    first_token: TokenId | None = None
    first_logprob: float | None = None
    first_top_logprobs: list[TopLogprob] | None = None
    error: str | None = None
    error_code: str | None = None
    timings: dict[str, float] = {}
    prefill_worker_id: str = ""
    cached_tokens: NonNegInt = 0
    attempt: NonNegInt = 0
    layout_fingerprint: str | None = None
    # Whether any write into the destination blocks began. A failed job that wrote may still
    # have bytes in flight: the decode worker keeps those blocks quarantined until the deadline.
    wrote: bool = False
    transfer: str = ""


class KVMetaRequest(Msg, tag="kv_meta_request", kw_only=True):
    """Ask a worker (``tandem.kv.meta.<worker>``) for its transfer-engine metadata."""

    worker_id: str = ""
    engine: str | None = None


class KVMetaReply(Msg, tag="kv_meta_reply", kw_only=True):
    """A worker's transfer-engine metadata.

    ``meta`` holds JSON-friendly facts (shm name, host:port, layout); ``blob`` carries an
    opaque binary such as a NIXL agent descriptor (base64 in JSON).
    """

    worker_id: str
    incarnation: str
    engine: str = ""
    meta: dict[str, Any] = {}
    blob: bytes | None = None
