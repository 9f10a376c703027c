"""``tandem up``: a whole local cluster in one command, supervised.

It starts the embedded ``nats-server -js`` (unless ``--nats-url`` names one), creates the
work-queue streams, starts the workers (by default one ``prefill_only`` and one
``decode_only``; ``--aggregated`` runs ``prefill_and_decode`` workers instead) and the
gateway, each a ``tandem`` child process with its own metrics port, waits until the
gateway's ``/ready`` lists every worker (with a deadline), prints the URL and a curl line,
and then supervises: a child that dies (a worker, the gateway, the embedded NATS) is named in
one line and started again after a backoff (``--restart on-failure``, the default; 1 s, doubling,
at most ``--restart-max-delay``), while the rest keep serving. It stops everything only on
Ctrl-C / SIGTERM, when a child keeps dying at start-up (three times in a row, or once refusing
its configuration), or with ``--restart never`` when any child dies.

Stopping goes in order: gateway (it drains: ``--drain-timeout``), decode workers, prefill workers,
NATS; each child gets its drain time plus ``--stop-timeout`` after SIGTERM before SIGKILL.
Children run through :mod:`runtime.processes` (own session, parent-death signal), so killing
``tandem up`` itself leaves no orphans.

The modules, in the order a run uses them: ``flags`` (the command line), ``ports``, ``plan`` (what to
start: pure, no processes), ``cluster`` (the children and their supervision), ``autoscale`` (the demand
and KEDA's rule) and ``scaler`` (acting on it), ``announce`` (the ready table and file), ``run`` (the
orchestration).
"""


class UpError(RuntimeError):
    """The cluster could not be started (the message says which part and why)."""
