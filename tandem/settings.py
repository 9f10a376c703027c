"""Every setting in one place: flags override `TANDEM_*` environment variables, which override defaults."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, fields

from engine.loader import DEFAULT_MODEL

ROLES = ("prefill_and_decode", "prefill_only", "decode_only")


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TANDEM_{name.upper()}", default)


@dataclass
class Settings:
    model: str = DEFAULT_MODEL
    role: str = "prefill_and_decode"
    worker_id: str = ""
    namespace: str = "tandem"
    nats_url: str = "nats://127.0.0.1:4222"
    metrics_port: int = 0  # 0: no metrics server
    advertise_host: str = "127.0.0.1"  # this worker's address as peers see it (metrics URL, KV over TCP)
    kv_tcp_host: str = "127.0.0.1"  # where the TCP KV engine listens (0.0.0.0 across hosts/containers)
    kv_transfer: str = "auto"  # auto|nixl|shm|tcp|cuda_ipc
    nixl_backend: str = "ucx"  # ucx|libfabric|uccl
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 1024
    max_batch: int = 32
    max_step_tokens: int = 512
    enable_prefix_cache: bool = True
    # Prefill ships each layer's KV while the next layer computes: "on", "off", or "auto" = on unless the
    # peer is reached through same-host shared memory, where a whole-prompt copy is cheaper (docs/benchmarks.md).
    layerwise_transfer: str = "auto"
    local_prefill_max_tokens: int = 32  # decode_only: prefill locally at or below this many uncached tokens
    remote_prefill_fallback: str = "local"  # local|error
    prefill_timeout: float = 60.0  # seconds a decode worker waits for a remote prefill
    request_timeout: float = 600.0  # default deadline of a request
    stats_interval: float = 1.0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        s = cls()
        for f in fields(cls):
            if f.name == "extra":
                continue
            raw = os.environ.get(f"TANDEM_{f.name.upper()}")
            if raw is not None:
                setattr(s, f.name, _convert(raw, getattr(s, f.name)))
        for k, v in overrides.items():
            if v is not None:
                setattr(s, k, v)
        if not s.worker_id:
            s.worker_id = f"{s.role.split('_')[0]}-{uuid.uuid4().hex[:6]}"
        s.validate()
        return s

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown pipeline role {self.role!r}; choose one of {', '.join(ROLES)}")
        if self.kv_transfer not in ("auto", "nixl", "shm", "tcp", "cuda_ipc"):
            raise ValueError(f"unknown TANDEM_KV_TRANSFER {self.kv_transfer!r}")
        if self.layerwise_transfer not in ("auto", "on", "off"):
            raise ValueError("--layerwise-transfer must be auto, on or off")
        if self.remote_prefill_fallback not in ("local", "error"):
            raise ValueError("--remote-prefill-fallback must be local or error")
        if any(c in self.worker_id for c in ".*> \t"):
            raise ValueError(f"worker id {self.worker_id!r} must not contain '.', '*', '>' or whitespace")


def _convert(raw: str, like):
    if isinstance(like, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(like, int):
        return int(raw)
    if isinstance(like, float):
        return float(raw)
    return raw
