"""Every NATS subject, JetStream stream and consumer name tandem uses (DESIGN §3).

This is the only place that spells a subject. Actors, the gateway, the CLI, the
NATS permission config and the KEDA manifests all derive their names from here, so
a rename is one edit and ``tests/test_bus.py`` checks the shapes.

Subject map (namespace ``tandem``, model token ``<model>``)::

    tandem.<model>.generate                  JetStream work queue (pool), pulled by decode/aggregate
    tandem.<model>.prefill                   JetStream work queue (pool), pulled by prefill workers
    tandem.<model>.generate.<worker>         core request to one decode/aggregate worker
    tandem.<model>.prefill.<worker>          core request to one prefill worker (target_endpoint)
    tandem.stream.<gateway>.<request>        tokens / finish / errors for one request
    tandem.prefill.done.<worker>.<request>   prefill result for the waiting decode worker
    tandem.cancel.<request>                  cancel a request wherever it is held
    tandem.kv.meta.<worker>                  core request: a worker's transfer-engine metadata
    tandem.stats.<role>.<worker>             1 Hz load report
    tandem.autoscale.state                   core request: a local autoscaler's desired/actual workers
    tandem.<model>.claim                     JetStream: a worker claims a request before serving it
    tandem.<model>.replay.stream             ask the decode workers to publish a request's stream messages again
    tandem.<model>.replay.prefill            ask the prefill workers to publish a job's answers again

Stream and durable consumer names (what KEDA's ``nats-jetstream`` trigger names)::

    stream   TANDEM_<MODEL>_GENERATE   subjects [tandem.<model>.generate]   consumer  generate-pool
    stream   TANDEM_<MODEL>_PREFILL    subjects [tandem.<model>.prefill]    consumer  prefill-pool
    stream   TANDEM_<MODEL>_CLAIMS     subjects [tandem.<model>.claim]      (no consumer: its duplicate window is the claim)

``<MODEL>`` is the model token upper-cased with ``-`` turned into ``_``; a namespace
other than ``tandem`` replaces the ``TANDEM`` prefix the same way. Each pool stream
captures exactly its pool subject, never ``<pool>.>``: targeted subjects such as
``tandem.<model>.generate.<worker>`` are plain core request–reply and must not be
swallowed (and acknowledged) by the work queue.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from runtime.names import ROLE_DECODE_ONLY, ROLE_PREFILL_AND_DECODE, ROLE_PREFILL_ONLY, ROLES, check_token

DEFAULT_NAMESPACE = "tandem"

#: Durable pull consumer on the generate stream, shared by all decode / aggregate workers.
GENERATE_CONSUMER = "generate-pool"
#: Durable pull consumer on the prefill stream, shared by all prefill workers.
PREFILL_CONSUMER = "prefill-pool"

#: Role names used for the gateway and for read-only tools in permission helpers (not pipeline roles).
ROLE_GATEWAY = "gateway"
ROLE_OBSERVER = "observer"

#: nats-py's default inbox prefix (replies, pull deliveries); a locked-down server gives each process its own.
DEFAULT_INBOX = "_INBOX"

# First tokens after the namespace that have a fixed meaning; a model token equal to one
# of them would make e.g. ``tandem.stream.generate.x`` ambiguous, so it gets a prefix.
RESERVED_TOKENS = frozenset({"stream", "prefill", "cancel", "kv", "stats", "generate", "autoscale"})

_MAX_TOKEN_LEN = 64
_UNSAFE = re.compile(r"[^a-z0-9_-]+")


def safe_token(name: str) -> str:
    """Turn a free-form name (a model name, a path) into one stable subject token.

    Lower-cases (so ``SmolLM2`` and ``smollm2`` meet on the same subjects), maps every
    run of characters outside ``[a-z0-9_-]`` (``.``, ``*``, ``>``, ``/``, whitespace …)
    to ``-`` and trims ``-`` at the ends. Names longer than 64 characters are cut and
    suffixed with a short hash so two long names stay distinct.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"cannot make a subject token from {name!r}: the name is empty")
    token = _UNSAFE.sub("-", name.strip().lower()).strip("-")
    if not token:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        token = f"x-{digest}"
    if len(token) > _MAX_TOKEN_LEN:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        token = f"{token[: _MAX_TOKEN_LEN - 11].rstrip('-')}-{digest}"
    return token


def model_token(model: str) -> str:
    """The subject token for a model: ``safe_token`` plus a ``m-`` prefix on reserved words."""
    token = safe_token(model)
    if token in RESERVED_TOKENS:
        token = f"m-{token}"
    return token


def stream_name_token(token: str) -> str:
    """Upper-case a subject token for a JetStream stream name (``-`` becomes ``_``)."""
    return token.upper().replace("-", "_")


@dataclass(frozen=True)
class Subjects:
    """All subjects of one namespace and one model.

    ``model`` is the served model's name; it is passed through :func:`model_token`.
    Request-scoped subjects (stream, prefill done, cancel) do not depend on the model.
    """

    model: str
    namespace: str = DEFAULT_NAMESPACE
    generate_consumer: str = GENERATE_CONSUMER
    prefill_consumer: str = PREFILL_CONSUMER

    def __post_init__(self) -> None:
        check_token(self.namespace, "namespace")

    # ---- names ---------------------------------------------------------------------
    @property
    def model_token(self) -> str:
        """The model as it appears in subjects."""
        return model_token(self.model)

    @property
    def generate_stream(self) -> str:
        """JetStream stream holding the generate pool, e.g. ``TANDEM_SMOLLM2_GENERATE``."""
        return f"{stream_name_token(self.namespace)}_{stream_name_token(self.model_token)}_GENERATE"

    @property
    def prefill_stream(self) -> str:
        """JetStream stream holding the prefill pool, e.g. ``TANDEM_SMOLLM2_PREFILL``."""
        return f"{stream_name_token(self.namespace)}_{stream_name_token(self.model_token)}_PREFILL"

    @property
    def claims_stream(self) -> str:
        """JetStream stream whose duplicate window grants each request to one worker, e.g. ``TANDEM_SMOLLM2_CLAIMS``."""
        return f"{stream_name_token(self.namespace)}_{stream_name_token(self.model_token)}_CLAIMS"

    @property
    def claims(self) -> str:
        """``tandem.<model>.claim``: a worker publishes here (``Nats-Msg-Id`` = the work's key) before serving."""
        return f"{self.namespace}.{self.model_token}.claim"

    # ---- pools (JetStream work queues) ---------------------------------------------
    @property
    def generate_pool(self) -> str:
        """``tandem.<model>.generate``: generate requests any decode worker may pull."""
        return f"{self.namespace}.{self.model_token}.generate"

    @property
    def prefill_pool(self) -> str:
        """``tandem.<model>.prefill``: prefill jobs any prefill worker may pull."""
        return f"{self.namespace}.{self.model_token}.prefill"

    # ---- targeted (core request-reply) ---------------------------------------------
    def generate_worker(self, worker_id: str) -> str:
        """``tandem.<model>.generate.<worker>``: a generate request for one decode worker."""
        return f"{self.generate_pool}.{check_token(worker_id, 'worker id')}"

    def prefill_worker(self, worker_id: str) -> str:
        """``tandem.<model>.prefill.<worker>``: a prefill job for one prefill worker."""
        return f"{self.prefill_pool}.{check_token(worker_id, 'worker id')}"

    def replay(self, kind: str) -> str:
        """``tandem.<model>.replay.stream|prefill``: ask the decode workers (what they sent on a request's
        ``stream``) or the prefill workers (their answers to a ``prefill`` job) to publish it again
        (``bus.control_messages.Replay``); every worker of that kind hears it."""
        if kind not in ("stream", "prefill"):
            raise ValueError(f"replay is asked for 'stream' or 'prefill' messages, not {kind!r}")
        return f"{self.namespace}.{self.model_token}.replay.{kind}"

    # ---- per request ---------------------------------------------------------------
    def stream(self, gateway_id: str, request_id: str) -> str:
        """``tandem.stream.<gateway>.<request>``: where the owner gateway hears tokens."""
        return (
            f"{self.namespace}.stream.{check_token(gateway_id, 'gateway id')}."
            f"{check_token(request_id, 'request id')}"
        )

    def prefill_done(self, worker_id: str, request_id: str) -> str:
        """``tandem.prefill.done.<worker>.<request>``: prefill result for a decode worker."""
        return (
            f"{self.namespace}.prefill.done.{check_token(worker_id, 'worker id')}."
            f"{check_token(request_id, 'request id')}"
        )

    def cancel(self, request_id: str) -> str:
        """``tandem.cancel.<request>``: cancel one request on every worker holding it."""
        return f"{self.namespace}.cancel.{check_token(request_id, 'request id')}"

    def kv_meta(self, worker_id: str) -> str:
        """``tandem.kv.meta.<worker>``: ask a worker for its transfer-engine metadata."""
        return f"{self.namespace}.kv.meta.{check_token(worker_id, 'worker id')}"

    def stats(self, role: str, worker_id: str) -> str:
        """``tandem.stats.<role>.<worker>``: a worker's 1 Hz load report."""
        return f"{self.namespace}.stats.{check_token(role, 'role')}.{check_token(worker_id, 'worker id')}"

    def service(self, worker_id: str, endpoint: str) -> str:
        """``tandem.svc.<worker>.<endpoint>``: a worker's NATS micro endpoint (info, stats, recent)."""
        return f"{self.namespace}.svc.{check_token(worker_id, 'worker id')}.{check_token(endpoint, 'endpoint')}"

    # ---- wildcards (subscriptions and permissions) ---------------------------------
    @property
    def all(self) -> str:
        """``tandem.>``: everything in the namespace (``tandem tail``)."""
        return f"{self.namespace}.>"

    def streams_of_gateway(self, gateway_id: str) -> str:
        """``tandem.stream.<gateway>.*``: one subscription for all of a gateway's requests."""
        return f"{self.namespace}.stream.{check_token(gateway_id, 'gateway id')}.*"

    def stats_of_role(self, role: str) -> str:
        """``tandem.stats.<role>.*``: the load reports of every worker of one role."""
        return f"{self.namespace}.stats.{check_token(role, 'role')}.*"

    def prefill_done_of_worker(self, worker_id: str) -> str:
        """``tandem.prefill.done.<worker>.*``: one subscription for a decode worker's prefills."""
        return f"{self.namespace}.prefill.done.{check_token(worker_id, 'worker id')}.*"

    @property
    def cancel_all(self) -> str:
        """``tandem.cancel.*``: every cancel (workers filter by the request ids they hold)."""
        return f"{self.namespace}.cancel.*"

    @property
    def autoscale_state(self) -> str:
        """``tandem.autoscale.state``: core request; a local autoscaler (``tandem up --autoscale``) answers."""
        return f"{self.namespace}.autoscale.state"

    @property
    def stats_all(self) -> str:
        """``tandem.stats.>``: every load report."""
        return f"{self.namespace}.stats.>"

    @property
    def kv_meta_all(self) -> str:
        """``tandem.kv.meta.*``: every worker's metadata endpoint."""
        return f"{self.namespace}.kv.meta.*"

    def jetstream_info_subjects(self) -> list[str]:
        """JetStream API subjects that read the pools' and claims' state (``ensure_streams`` when they exist)."""
        out = ["$JS.API.INFO"]
        for stream, consumer in (
            (self.generate_stream, self.generate_consumer),
            (self.prefill_stream, self.prefill_consumer),
        ):
            out += [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.INFO.{stream}.{consumer}"]
        out.append(f"$JS.API.STREAM.INFO.{self.claims_stream}")
        return out

    def jetstream_setup_subjects(self) -> list[str]:
        """JetStream API subjects :func:`bus.streams.ensure_streams` publishes to when it creates or updates.

        Where the processes create the streams at start (Compose), every role has these; where
        someone else does (``tandem up``, the Kubernetes Job), the roles only read (:meth:`jetstream_info_subjects`).
        """
        out = self.jetstream_info_subjects()
        for stream, consumer in (
            (self.generate_stream, self.generate_consumer),
            (self.prefill_stream, self.prefill_consumer),
        ):
            out += [
                f"$JS.API.STREAM.CREATE.{stream}",
                f"$JS.API.STREAM.UPDATE.{stream}",
                f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}",
                f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}.>",
                f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{consumer}",
            ]
        out += [f"$JS.API.STREAM.{op}.{self.claims_stream}" for op in ("CREATE", "UPDATE")]
        return out

    def _pull_subjects(self, stream: str, consumer: str) -> list[str]:
        """Publish permissions a puller needs: next-message requests and acks."""
        return [
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"$JS.ACK.{stream}.{consumer}.>",
        ]

    def permissions(self, role: str, worker_id: str = "*", *, inbox: str = DEFAULT_INBOX,
                    create_streams: bool = True) -> dict[str, list[str]]:
        """What a role may publish and subscribe to, as NATS permission lists.

        Returns ``{"publish": [...], "subscribe": [...]}`` for a nats-server ``permissions``
        block (:mod:`bus.nats_config` renders every server config from it). ``role`` is a
        pipeline role, ``"gateway"`` or ``"observer"`` (``tandem status``/``tail``, the ``nats`` CLI:
        reads everything, publishes only discovery and stats requests, which change nothing);
        ``worker_id="*"`` gives the rule for any process of the role (one credential per role), a
        concrete id narrows the process's own subjects (for a gateway, the id is the gateway id).
        ``inbox`` is the process's inbox prefix (``TANDEM_NATS_INBOX_PREFIX``): it subscribes to
        replies there only, so nobody else's replies (pulled jobs, transfer metadata) reach it.
        ``create_streams`` lets the role create and update the pool streams (``ensure_streams`` at
        start) rather than only read them. Every role uses ``$SRV.>`` (NATS micro discovery); every
        worker serves its micro endpoints ``tandem.svc.<worker>.info|stats|recent``. The server config
        must also set ``allow_responses`` for the workers and the gateway, so request–reply
        endpoints may answer.
        """
        ns = self.namespace
        me = worker_id if worker_id == "*" else check_token(worker_id, "worker id")
        replies = [f"{check_token(inbox, 'inbox prefix')}.>"]
        setup = self.jetstream_setup_subjects() if create_streams else self.jetstream_info_subjects()
        # NATS micro endpoints of one worker (actors/base.py registers info and stats).
        micro = [f"{ns}.svc.{me}.info", f"{ns}.svc.{me}.stats", f"{ns}.svc.{me}.recent"]
        if role == ROLE_PREFILL_ONLY:
            return {
                "publish": [
                    *setup,
                    *self._pull_subjects(self.prefill_stream, self.prefill_consumer),
                    f"{ns}.prefill.done.*.*",  # the PrefillDone for the decode worker that asked
                    f"{ns}.stats.{role}.{me}",
                    self.claims,  # a job delivered twice is served once
                    self.kv_meta_all,  # asks the decode worker for its transfer metadata
                    "$SRV.>",
                ],
                "subscribe": [
                    f"{self.prefill_pool}.{me}", self.cancel_all, f"{ns}.kv.meta.{me}", self.replay("prefill"),
                    *micro, "$SRV.>", *replies,
                ],
            }
        if role in (ROLE_DECODE_ONLY, ROLE_PREFILL_AND_DECODE):
            pub = [
                *setup,
                *self._pull_subjects(self.generate_stream, self.generate_consumer),
                f"{ns}.stream.*.*",
                f"{ns}.stats.{role}.{me}",
                self.claims,  # a request delivered twice is served once
                "$SRV.>",
            ]
            sub = [f"{self.generate_pool}.{me}", self.cancel_all, f"{ns}.kv.meta.{me}", self.replay("stream"), *micro,
                   "$SRV.>", *replies]
            if role == ROLE_DECODE_ONLY:
                # prefill jobs go to the pool (JetStream) or to one prefill worker (core);
                # a decode worker cancels the prefills it gave up on, hears the prefill
                # workers' load reports and finds them with $SRV.INFO.tandem-prefill-only.
                pub += [self.prefill_pool, f"{self.prefill_pool}.*", self.cancel_all, self.replay("prefill"),
                        f"$JS.API.STREAM.MSG.DELETE.{self.prefill_stream}"]  # withdraws a job nobody took
                sub += [f"{ns}.prefill.done.{me}.*", f"{ns}.stats.{ROLE_PREFILL_ONLY}.*"]
            return {"publish": pub, "subscribe": sub}
        if role == ROLE_GATEWAY:
            return {
                # its workers' micro endpoints: the page's cluster view (gateway/cluster.py)
                "publish": [*setup, self.generate_pool, f"{self.generate_pool}.*", self.cancel_all, "$SRV.>",
                            f"{ns}.svc.*.*", self.replay("stream")],
                "subscribe": [f"{ns}.stream.{me}.*", self.stats_all, "$SRV.>", *replies],
            }
        if role == ROLE_OBSERVER:
            return {
                "publish": ["$SRV.>", f"{ns}.svc.*.*", self.autoscale_state, *self.jetstream_info_subjects()],
                "subscribe": [self.all, *replies],
            }
        raise ValueError(f"unknown role {role!r}; expected one of {(*ROLES, ROLE_GATEWAY, ROLE_OBSERVER)}")
