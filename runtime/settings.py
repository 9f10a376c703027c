"""Every setting in one place: flags override `TANDEM_*` environment variables, which override defaults."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine.model_files import DEFAULT_MODEL, KV_DTYPES, QUANTIZATIONS
from engine.speculation import MODES as SPECULATIVE_MODES
from runtime.names import ROLES, check_token
from runtime.placement import check_device, format_cpus, parse_cpus

STEP_TOKENS, PREFILL_STEP_TOKENS = 512, 256  # default --max-step-tokens of decoding and prefill_only workers
#: --kernels: auto and engine.native.KERNEL_PATHS (named here too: this module stays free of torch)
KERNEL_CHOICES = ("auto", "avx512_vnni", "neon_dotprod", "avx512_bf16", "avx2", "portable", "invariant")
#: --kernels, as help text
KERNELS_HELP = ("auto (the fastest this CPU has), avx512_vnni, neon_dotprod, avx512_bf16, avx2, portable, or invariant "
                "(every row on one path: a request's tokens never depend on what else its steps hold; slower prompts and "
                "large batches)")
#: the most tokens a request that gives neither max_tokens nor max_completion_tokens gets (--default-max-tokens)
DEFAULT_MAX_TOKENS = 2048


@dataclass
class Settings:
    model: str = DEFAULT_MODEL
    role: str = "prefill_and_decode"
    worker_id: str = ""
    namespace: str = "tandem"
    nats_url: str = "nats://127.0.0.1:4222"
    metrics_port: int = 0  # 0: no metrics server (/metrics, /health, /ready)
    metrics_host: str = "0.0.0.0"  # where it listens (tandem up: the gateway's host, 127.0.0.1 by default)
    # a busy metrics_port: serve on any free port instead and say which (tandem up's own picks); off: an error
    metrics_port_fallback: bool = False
    # this worker's address as peers see it (metrics URL, KV over TCP); "" = the TCP bind host,
    # or this machine's hostname when that is 0.0.0.0 (containers: the name peers resolve)
    advertise_host: str = ""
    kv_tcp_host: str = "127.0.0.1"  # where the TCP KV engine listens (0.0.0.0 across hosts/containers)
    kv_transfer: str = "auto"  # auto|nixl|shm|tcp|cuda_ipc
    nixl_backend: str = "ucx"  # ucx|libfabric|uccl
    device: str = "cpu"
    cpus: str = ""  # pin the worker to these cores ("0", "2-3"); "" = wherever the OS puts it
    threads: int = 0  # torch threads; 0 = one per core of `cpus`, or torch's default without it
    # run at SCHED_IDLE: cores this worker shares go to other work first (a prefill worker on a decode worker's cores)
    idle_priority: bool = False
    # cores of another worker this one also computes on, at idle priority, layer by layer while that worker lends
    # them (runtime/borrowing.py); `threads` then defaults to those and `cpus` together
    borrow_cpus: str = ""
    # decode_only on --cpus a prefill worker borrows: while a long prompt is prefilled elsewhere for it, start a step
    # at most every this many ms, lending the cores in between (0: back to back; tandem up sets it, actors/runner.py)
    lend_step_ms: float = 0.0
    dtype: str = "float32"
    quantization: str = "auto"  # weights: none|fp16|int8|int4|auto (auto: a GGUF's own Q4 as int4, other quants int8)
    # how int4/Q8_0 weights are multiplied (engine.native.kernel_path): auto = the fastest this CPU has;
    # "invariant": every row on one path, so a request's tokens never depend on its batch (docs/architecture.md)
    kernels: str = "auto"
    block_size: int = 16
    num_blocks: int = 1024
    max_batch: int = 32
    # tokens one engine step computes; 0 = the role's default: 256 on a prefill_only worker (a short prompt
    # waits at most one such chunk of a long one, docs/benchmarks.md), 512 elsewhere
    max_step_tokens: int = 0
    enable_prefix_cache: bool = True
    speculative: str = "ngram"  # decode: draft tokens by prompt lookup and verify them in one step, or "off"
    kv_dtype: str = "auto"  # the KV cache's element type (engine.engine.kv_dtype_for); peers must agree
    # Prefill ships each layer's KV while the next layer computes: "on", "off", or "auto" = on unless the
    # peer is reached through same-host shared memory, where a whole-prompt copy is cheaper (docs/benchmarks.md).
    layerwise_transfer: str = "auto"
    local_prefill_max_tokens: int = 32  # decode_only: prefill locally at or below this many uncached tokens
    # decode_only: above that floor, prefill remotely when a local prefill would hold the decode batch longer than
    # this (or when remote is faster), unless the prefill workers' queue is longer still (actors/prefill_choice.py)
    prefill_stall_budget_ms: float = 50.0
    remote_prefill_fallback: str = "local"  # local|error
    prefill_timeout: float = 60.0  # seconds a decode worker waits for a remote prefill
    request_timeout: float = 600.0  # default deadline of a request
    stats_interval: float = 1.0
    # replicas of the work queues a process creates when they do not exist yet (a NATS cluster: 3); a larger
    # existing one is never shrunk (bus/streams.py)
    stream_replicas: int = 1
    drain_timeout: float = 30.0  # SIGTERM: seconds to finish what this worker holds before it leaves
    restarts: int = 0  # how often a supervisor (tandem up) restarted this worker: TANDEM_RESTARTS

    @classmethod
    def from_env(cls, **overrides) -> Settings:
        s = cls()
        for f in fields(cls):
            name = f"TANDEM_{f.name.upper()}"
            raw = os.environ.get(name)
            if raw is not None:
                setattr(s, f.name, _convert(name, raw, getattr(s, f.name)))
        for k, v in overrides.items():
            if v is not None:
                setattr(s, k, v)
        if not s.worker_id:
            s.worker_id = f"{s.role.split('_')[0]}-{uuid.uuid4().hex[:6]}"
        s.validate()
        return s

    def validate(self) -> None:
        """Refuse bad values, and fill in what derives from other settings (``advertise_host``)."""
        if not self.advertise_host:
            wildcard = self.kv_tcp_host in ("0.0.0.0", "::", "")
            self.advertise_host = socket.gethostname() if wildcard else self.kv_tcp_host
        if self.role not in ROLES:
            raise ValueError(f"unknown pipeline role {self.role!r}; choose one of {', '.join(ROLES)}")
        if self.kv_transfer not in ("auto", "nixl", "shm", "tcp", "cuda_ipc"):
            raise ValueError(f"unknown TANDEM_KV_TRANSFER {self.kv_transfer!r}")
        if self.layerwise_transfer not in ("auto", "on", "off"):
            raise ValueError("--layerwise-transfer must be auto, on or off")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"--kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.remote_prefill_fallback not in ("local", "error"):
            raise ValueError("--remote-prefill-fallback must be local or error")
        check_token(self.worker_id, "worker id")
        check_device(self.device)
        if self.cpus:
            self.cpus = format_cpus(parse_cpus(self.cpus))
        if self.borrow_cpus:
            if not self.cpus:
                raise ValueError("--borrow-cpus needs --cpus: the cores this worker always has")
            borrowed = parse_cpus(self.borrow_cpus, "--borrow-cpus")
            if set(borrowed) & set(parse_cpus(self.cpus)):
                raise ValueError(f"--borrow-cpus {self.borrow_cpus!r} names cores of --cpus {self.cpus!r}: "
                                 f"borrow only another worker's cores")
            self.borrow_cpus, self.idle_priority = format_cpus(borrowed), True
        check_token(self.namespace, "namespace")
        if not self.max_step_tokens:
            self.max_step_tokens = PREFILL_STEP_TOKENS if self.role == "prefill_only" else STEP_TOKENS
        for name, least in (("block_size", 1), ("num_blocks", 1), ("max_batch", 1), ("max_step_tokens", 1),
                            ("stream_replicas", 1),
                            ("local_prefill_max_tokens", 0), ("threads", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(self, name)}")
        for name in ("prefill_timeout", "request_timeout", "stats_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("drain_timeout", "restarts", "prefill_stall_budget_ms", "lend_step_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0 (none) to 65535, got {self.metrics_port}")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``KEY=VALUE`` lines of an env file (``tandem --env-file``, ``tandem nats --make-passwords``, Compose's
    ``--env-file``): ``#`` comments, blank lines and ``export`` allowed, one level of quotes taken off a value.
    ValueError names the file and the line that is not an assignment, or why the file cannot be read."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()  # noqa: SIM115
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    out: dict[str, str] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.removeprefix("export ").partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ValueError(f"{path}, line {n}: not KEY=VALUE: {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


def _convert(name: str, raw: str, like: Any) -> Any:
    """``raw`` read as the type of ``like``; a ValueError names the variable."""
    text = raw.strip()
    if isinstance(like, bool):
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{name} must be true or false (1/0, yes/no, on/off), got {raw!r}")
    try:
        if isinstance(like, int):
            return int(text)
        if isinstance(like, float):
            return float(text)
    except ValueError:
        kind = "an integer" if isinstance(like, int) else "a number"
        raise ValueError(f"{name} must be {kind}, got {raw!r}") from None
    return raw


# ---------------------------------------------------------------- gateway


def _env_value(name: str, default: Any) -> Any:
    """Variable ``name`` read as the type of ``default``; unset or empty: ``default``."""
    raw = os.environ.get(name)
    return _convert(name, raw, default) if raw else default


def default_max_tokens_from_env() -> int:
    """``TANDEM_GATEWAY_DEFAULT_MAX_TOKENS``, or :data:`DEFAULT_MAX_TOKENS` when it is unset."""
    return _env_value("TANDEM_GATEWAY_DEFAULT_MAX_TOKENS", DEFAULT_MAX_TOKENS)


def api_keys_from_env() -> tuple[str, ...]:
    """``TANDEM_API_KEYS``: comma-separated bearer keys; empty means no authentication."""
    raw = os.environ.get("TANDEM_API_KEYS", "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())


@dataclass(frozen=True)
class GatewayConfig:
    """Everything one gateway process needs to know."""

    model: str
    nats_url: str
    namespace: str = "tandem"
    gateway_id: str = field(default_factory=lambda: f"gw-{uuid.uuid4().hex[:8]}")
    #: accepted bearer keys (``TANDEM_API_KEYS``); empty: no authentication
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    #: default deadline of a request (seconds), and the most a client may ask for (X-Request-Timeout)
    request_timeout: float = 600.0
    max_request_timeout: float = 3600.0
    #: after the deadline, how long to wait for the worker's own 504 before answering ours
    deadline_grace: float = 1.0
    #: KV block size the workers use (prefix hashes for routing)
    block_size: int = 16
    #: choices in flight at this gateway before new requests get 429
    max_inflight: int = 512
    #: jobs (prompts × n) one HTTP request may fan out to
    max_jobs_per_request: int = 64
    #: request bodies larger than this get 413 before they are read
    max_body_bytes: int = 16 * 1024 * 1024
    #: publish to the pool even when no worker is alive (scale from zero), instead of 503
    queue_when_no_workers: bool = False
    #: a worker counts as alive this long after its last stats report (/ready, routing)
    alive_after: float = 3.0
    #: routing cost = uncached prompt blocks + this × the KV blocks the worker holds for running requests
    route_load_weight: float = 1.0
    #: a request held by a worker silent this long is re-sent elsewhere (or fails); one the worker never
    #: acknowledged, after ``alive_after``
    worker_lost_after: float = 5.0
    #: SSE comment sent after this many idle seconds (keeps proxies and disconnect detection going)
    sse_keepalive: float = 15.0
    #: prompts longer than this many characters are tokenized in a thread
    tokenize_in_thread_chars: int = 4096
    #: extra names the model answers to (besides its own name and spec)
    served_model_names: tuple[str, ...] = ()
    #: connect to NATS with this deadline (seconds)
    connect_timeout: float = 30.0
    #: create the pool streams at start (off when permissions forbid it), with this many replicas
    ensure_streams: bool = True
    stream_replicas: int = 1
    #: SIGTERM: seconds running requests get to finish before they end with a 503
    drain_timeout: float = 30.0
    #: a request whose expected wait for a worker is longer than this is refused at once (429); 0: never
    max_queue_wait: float = 30.0
    #: times a request may move to another decode worker when its worker dies after tokens were sent
    migration_limit: int = 1
    #: seconds such a request waits, when no other decode worker is alive, for one (or the same, restarted)
    worker_wait: float = 15.0
    #: seconds the gateway may be away from NATS (every member unreachable) before its open requests end with
    #: 503 ``bus_unavailable``; shorter outages lose nothing (the workers publish again what it missed)
    bus_lost_after: float = 20.0
    #: sampling for requests that leave a field out; None: the model's own default (generation_config.json)
    default_temperature: float | None = None
    default_top_p: float | None = None
    default_top_k: int | None = None
    default_repetition_penalty: float | None = None
    #: max_tokens of a request that gives neither max_tokens nor max_completion_tokens (still cut to what the
    #: context leaves); 0: no cap, up to the end of the context
    default_max_tokens: int = DEFAULT_MAX_TOKENS

    def sampling_overrides(self) -> dict[str, float]:
        """The ``--default-*`` flags given, by SamplingParams field."""
        flags = {"temperature": self.default_temperature, "top_p": self.default_top_p,
                 "top_k": self.default_top_k, "repetition_penalty": self.default_repetition_penalty}
        return {k: v for k, v in flags.items() if v is not None}

    def __post_init__(self) -> None:
        check_token(self.gateway_id, "gateway id")
        if self.request_timeout <= 0 or self.max_request_timeout < self.request_timeout:
            raise ValueError("request timeout must be positive and at most max_request_timeout")
        if not 0 <= self.route_load_weight < float("inf"):
            raise ValueError(f"TANDEM_GATEWAY_ROUTE_LOAD_WEIGHT must be a number ≥ 0, got {self.route_load_weight}")
        for name in ("drain_timeout", "max_queue_wait", "migration_limit", "worker_wait", "bus_lost_after",
                     "default_max_tokens"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, **overrides: Any) -> GatewayConfig:
        """Read ``TANDEM_*`` (shared settings plus ``TANDEM_API_KEYS`` and ``TANDEM_GATEWAY_*``)."""
        s = Settings.from_env()
        cfg = cls(
            model=s.model,
            nats_url=s.nats_url,
            namespace=s.namespace,
            api_keys=api_keys_from_env(),
            request_timeout=s.request_timeout,
            max_request_timeout=max(s.request_timeout, _env_value("TANDEM_GATEWAY_MAX_REQUEST_TIMEOUT", 3600.0)),
            block_size=s.block_size,
            stream_replicas=s.stream_replicas,
            max_inflight=_env_value("TANDEM_GATEWAY_MAX_INFLIGHT", 512),
            queue_when_no_workers=_env_value("TANDEM_GATEWAY_QUEUE_WHEN_NO_WORKERS", False),
            route_load_weight=_env_value("TANDEM_GATEWAY_ROUTE_LOAD_WEIGHT", 1.0),
            drain_timeout=_env_value("TANDEM_GATEWAY_DRAIN_TIMEOUT", 30.0),
            max_queue_wait=_env_value("TANDEM_GATEWAY_MAX_QUEUE_WAIT", 30.0),
            migration_limit=_env_value("TANDEM_GATEWAY_MIGRATION_LIMIT", 1),
            worker_wait=_env_value("TANDEM_GATEWAY_WORKER_WAIT", 15.0),
            bus_lost_after=_env_value("TANDEM_GATEWAY_BUS_LOST_AFTER", 20.0),
            default_max_tokens=default_max_tokens_from_env(),
        )
        if os.environ.get("TANDEM_GATEWAY_ID"):
            cfg = replace(cfg, gateway_id=os.environ["TANDEM_GATEWAY_ID"])
        changes = {k: v for k, v in overrides.items() if v is not None}
        return replace(cfg, **changes) if changes else cfg
