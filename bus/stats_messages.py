"""Load and scale reports: a worker's stats (routing, discovery, autoscaling), an autoscaler's state."""

from __future__ import annotations

import time

import msgspec

from bus.wire import Msg, NonNegInt, Part


class WorkerStats(Msg, tag="worker_stats", kw_only=True):
    """A worker's 1 Hz load report on ``tandem.stats.<role>.<worker>``."""

    role: str
    worker_id: str
    model: str = ""
    running: NonNegInt = 0
    queued: NonNegInt = 0
    free_blocks: NonNegInt = 0
    total_blocks: NonNegInt = 0
    prefix_hit_rate: float = 0.0
    uptime: float = 0.0
    incarnation: str = ""
    max_batch: NonNegInt = 0
    draining: bool = False  # stopping: route nothing new here
    #: decode_only: prompts it prefills locally only for want of a free prefill worker (bus/demand.py)
    deferred_prefills: NonNegInt = 0
    #: decode_only: the prefill workers it counts alive to send prompts to (their reports reached it)
    prefill_workers: NonNegInt = 0
    #: it keeps served prompts' blocks for later requests: only then does a router send it the same prefix again
    prefix_cache: bool = True
    #: the path that multiplies many rows of its weights (engine.native.kernel_path: avx512_bf16, avx2, ...)
    kernels: str = ""
    ts: float = msgspec.field(default_factory=time.time)


class RoleScale(Part, kw_only=True):
    """One role in an :class:`AutoscaleState`."""

    role: str
    demand: NonNegInt = 0
    lag: NonNegInt = 0
    desired: NonNegInt = 0
    actual: NonNegInt = 0  # workers running and taking work
    draining: NonNegInt = 0
    min: NonNegInt = 0
    max: NonNegInt = 0
    last_action: str = ""


class AutoscaleState(Msg, tag="autoscale_state", kw_only=True):
    """A local autoscaler's answer on ``tandem.autoscale.state`` (``tandem status`` shows it)."""

    scaler: str
    model: str = ""
    roles: list[RoleScale] = []
    ts: float = msgspec.field(default_factory=time.time)
