"""`tandem serve`: build the actor for a pipeline role and run it until SIGTERM."""

from __future__ import annotations

import logging
import sys

from engine import native
from engine.loader import load_model
from engine.progress import LoadProgress
from runtime.borrowing import BorrowedCores
from runtime.health import WorkerHealth, metrics_at_line, serve_worker_http
from runtime.placement import available_cpus, format_cpus, parse_cpus, pin_process, run_at_idle_priority
from runtime.settings import Settings

log = logging.getLogger(__name__)


def serve(settings: Settings) -> int:
    """Load the model and run the role's actor until SIGTERM; each start-up phase is one line on stderr."""
    from actors.decode import DecodeActor
    from actors.prefill import PrefillActor

    cores = place(settings)
    health = WorkerHealth(settings.role, settings.worker_id)
    try:  # before loading the model: a busy port fails in a moment, not after seconds
        server = serve_worker_http(settings.metrics_port, settings.metrics_host, health,
                                   any_port_if_busy=settings.metrics_port_fallback)
    except OSError as e:
        raise ValueError(f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
                         f"{e.strerror or e}") from e
    if server is not None and settings.metrics_port_fallback:
        # tandem up's pick may have been taken since (another cluster starting): say where the metrics are,
        # and advertise that port
        port = int(server.server_address[1])
        print(metrics_at_line(settings.worker_id, settings.metrics_port, port), file=sys.stderr, flush=True)
        settings.metrics_port = port
    health.phase = "loading model"
    native.use_kernel_path(settings.kernels)  # over TANDEM_KERNELS; a path this CPU lacks: one line naming those it has
    loaded = load_model(settings.model, settings.dtype, settings.quantization, LoadProgress(settings.worker_id))
    health.model_loaded = True
    actor_cls = PrefillActor if settings.role == "prefill_only" else DecodeActor
    actor = actor_cls(settings, loaded, health)
    if cores is not None:
        actor.engine.model.before_layer = cores.before_layer
        actor.engine.model.after_layers = cores.after_layers
    actor.serve_forever()
    return 0 if actor.error is None and actor.runner.failure is None else 1


def place(settings: Settings) -> BorrowedCores | None:
    """Pin this process to ``--cpus`` (and ``--borrow-cpus``) and size torch's thread pool (before any kernel
    runs); with borrowed cores, the ``BorrowedCores`` that moves each layer's threads on and off them.

    ``settings.threads`` is left holding the thread count in effect (advertised to ``tandem status``).
    """
    import torch

    own = parse_cpus(settings.cpus) if settings.cpus else []
    borrowed = parse_cpus(settings.borrow_cpus, "--borrow-cpus") if settings.borrow_cpus else []
    if own:
        pin_process(own + borrowed)
    if settings.idle_priority:
        run_at_idle_priority()
    threads = settings.threads or len(own + borrowed)
    if threads:
        torch.set_num_threads(threads)
    settings.threads = torch.get_num_threads()
    log.info("%s %s on cores %s with %d torch threads%s, device %s", settings.role, settings.worker_id,
             format_cpus(available_cpus()), settings.threads, " at idle priority" if settings.idle_priority else "",
             settings.device)
    return BorrowedCores(settings.namespace, own, borrowed) if borrowed else None
