"""Every Prometheus metric tandem exports, in one place (names documented in docs/metrics.md).

Each process serves its own registry on its own port (`--metrics-port` / TANDEM_METRICS_PORT);
a metric that does not apply to a role simply stays at zero there.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

# Milliseconds to minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))

# --- gateway: one set per app (own registry), so tests can run several gateways in one process
class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("tandem_gateway_requests_total", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.stream_errors = Counter("tandem_gateway_stream_errors_total",
                                     "Streams that failed after their 200 was sent, by error code", ["code"],
                                     registry=r)
        self.stream_dropped = Counter(
            "tandem_gateway_stream_messages_dropped_total",
            "Messages on a request's stream subject not shown to the client: not from the worker holding the "
            "request (unsigned, other_worker, other_process), or a sequence number already seen (duplicate)",
            ["reason"], registry=r)
        self.replays = Counter(
            "tandem_gateway_replays_requested_total",
            "Times the gateway asked the decode workers to publish a request's stream messages again: a gap in "
            "the sequence numbers (gap), a stream silent for a while (silence), or after its own NATS reconnect "
            "(reconnect)", ["reason"], registry=r)
        self.in_flight = Gauge("tandem_gateway_requests_in_flight", "Choices being generated", registry=r)
        self.live_workers = Gauge("tandem_gateway_live_workers", "Decode-capable workers heard from recently",
                                  registry=r)
        self.ttft = Histogram("tandem_gateway_time_to_first_token_seconds", "Dispatch to a choice's first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_gateway_inter_token_latency_seconds", "Time between token messages of a choice",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tandem_gateway_time_per_output_token_seconds",
                              "After the first token: decode time per output token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("tandem_gateway_e2e_latency_seconds", "HTTP request arrival to last byte", ["endpoint"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tandem_gateway_prompt_tokens_total", "Prompt tokens received", registry=r)
        self.generated_tokens = Counter("tandem_gateway_generated_tokens_total", "Tokens generated", registry=r)
        self.demand = Gauge("tandem_demand", "Demand per role (bus/demand.py): pool lag + work held by workers, "
                            "what autoscalers size workers on", ["role"], registry=r)
        self.demand_lag = Gauge("tandem_demand_pool_lag", "The pool-lag part of tandem_demand (KEDA's "
                                "nats-jetstream lag)", ["role"], registry=r)


# --- the local autoscaler of `tandem up --autoscale`: own registry, served on its own port
class AutoscaleMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.demand = Gauge("tandem_autoscale_demand", "Demand per role the scaler last read", ["role"], registry=r)
        self.desired = Gauge("tandem_autoscale_desired_workers", "Workers the scaler wants per role", ["role"],
                             registry=r)
        self.workers = Gauge("tandem_autoscale_workers", "Workers running and taking work per role", ["role"],
                             registry=r)
        self.draining = Gauge("tandem_autoscale_draining_workers", "Workers draining after a scale-down", ["role"],
                              registry=r)
        self.decisions = Counter("tandem_autoscale_decisions_total", "Scale-ups and scale-downs per role",
                                 ["role", "action"], registry=r)


# --- workers (decode and aggregate)
RUNNING = Gauge("tandem_worker_running_sequences", "Sequences in the running batch", ["role"], registry=REGISTRY)
WAITING = Gauge("tandem_worker_waiting_sequences", "Sequences waiting for blocks or a batch slot", ["role"],
                registry=REGISTRY)
KV_BLOCKS = Gauge("tandem_kv_blocks", "KV blocks by state (used, free, quarantined), in blocks of every layer (block_size tokens each)", ["role", "state"],
                  registry=REGISTRY)
PREFIX_HIT_RATE = Gauge("tandem_prefix_cache_hit_rate", "Share of looked-up full blocks found in the prefix cache",
                        ["role"], registry=REGISTRY)
PREFILL_DECISIONS = Counter("tandem_decode_prefill_decisions_total", "Where prompts were prefilled, and why",
                            ["mode", "reason"], registry=REGISTRY)
REMOTE_PREFILL_WAIT = Histogram("tandem_decode_remote_prefill_wait_seconds",
                                "From publishing a prefill job to the KV having landed", buckets=LATENCY_BUCKETS,
                                registry=REGISTRY)
WORKER_CANCELLED = Counter("tandem_worker_cancelled_total", "Requests stopped because their client or gateway "
                           "cancelled them", ["role"], registry=REGISTRY)
REPLAYED = Counter("tandem_worker_replayed_messages_total", "Messages published again because a receiver asked "
                   "(bus.control_messages.Replay): stream messages (decode) or prefill answers (prefill)", ["role"],
                   registry=REGISTRY)
SPEC_DRAFT_TOKENS = Counter("tandem_spec_draft_tokens_total", "Draft tokens verified (speculative decoding)",
                            registry=REGISTRY)
SPEC_ACCEPTED_TOKENS = Counter("tandem_spec_accepted_tokens_total", "Draft tokens kept: output that cost no step of "
                               "its own", registry=REGISTRY)
WORKER_LAYERS = Counter("tandem_worker_layers_total", "Layers a worker that borrows cores (--borrow-cpus) computed, "
                        "by where their threads ran: own cores, or own and borrowed (lent by their decode worker)",
                        ["cores"], registry=REGISTRY)
WORKER_LAYER_SECONDS = Counter("tandem_worker_layer_seconds_total", "Seconds of layers a worker that borrows cores "
                               "computed, by where their threads ran (as tandem_worker_layers_total)", ["cores"],
                               registry=REGISTRY)
DECODE_LENT_SECONDS = Counter("tandem_decode_lent_seconds_total", "Seconds a decode worker lent its cores to a "
                              "prefill worker that borrows them (while it waited for work or a paced step)",
                              registry=REGISTRY)
DECODE_TAKE_WAIT = Histogram("tandem_decode_take_wait_seconds", "How long a decode step waited for a borrowed "
                             "layer to end before it had its cores back", registry=REGISTRY,
                             buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))
DECODE_LATE_STEPS = Counter("tandem_decode_late_steps_total", "Decode steps that started while a borrower still "
                            "computed on a lent core (its deadline passed)", registry=REGISTRY)
PREEMPTIONS = Counter("tandem_decode_preemptions_total", "Sequences preempted for recompute", registry=REGISTRY)
WORKER_TTFT = Histogram("tandem_worker_time_to_first_token_seconds", "Accepted to first token, on the worker",
                        buckets=LATENCY_BUCKETS, registry=REGISTRY)
WORKER_GENERATED_TOKENS = Counter("tandem_worker_generated_tokens_total", "Tokens generated", ["role"],
                                  registry=REGISTRY)

# --- prefill
PREFILL_QUEUE_WAIT = Histogram("tandem_prefill_queue_wait_seconds", "From job creation to the start of work",
                               buckets=LATENCY_BUCKETS, registry=REGISTRY)
PREFILL_TOKENS = Counter("tandem_prefill_tokens_total", "Prompt tokens prefilled (computed or cached)",
                         ["kind"], registry=REGISTRY)
PREFILL_COMPUTE = Histogram("tandem_prefill_compute_seconds", "Prefill compute time per job",
                            buckets=LATENCY_BUCKETS, registry=REGISTRY)
PREFILL_JOBS = Counter("tandem_prefill_jobs_total", "Prefill jobs by outcome", ["outcome"], registry=REGISTRY)

# --- KV transfer
TRANSFER_BYTES = Counter("tandem_kv_transfer_bytes_total", "KV bytes written to peers", ["engine"],
                         registry=REGISTRY)
TRANSFER_SECONDS = Histogram("tandem_kv_transfer_duration_seconds", "Duration of one KV write", ["engine"],
                             buckets=LATENCY_BUCKETS, registry=REGISTRY)
TRANSFER_RATE = Gauge("tandem_kv_transfer_last_bytes_per_second", "Throughput of the latest KV write",
                      ["engine"], registry=REGISTRY)
TRANSFER_FAILURES = Counter("tandem_kv_transfer_failures_total", "KV writes that failed", ["engine"],
                            registry=REGISTRY)


def observe_transfer(engine: str, nbytes: int, seconds: float) -> None:
    TRANSFER_BYTES.labels(engine).inc(nbytes)
    TRANSFER_SECONDS.labels(engine).observe(seconds)
    if seconds > 0:
        TRANSFER_RATE.labels(engine).set(nbytes / seconds)
