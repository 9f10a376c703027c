"""`tandem serve`: build the actor for a pipeline role and run it until SIGTERM."""

from __future__ import annotations

import logging

from engine.loader import load_model
from runtime.settings import Settings

log = logging.getLogger(__name__)


def serve(settings: Settings) -> int:
    from actors.decode import DecodeActor
    from actors.prefill import PrefillActor
    from runtime.metrics import serve_metrics

    try:  # before loading the model: a busy port fails in a moment, not after seconds
        serve_metrics(settings.metrics_port)
    except OSError as e:
        raise ValueError(f"cannot serve metrics on port {settings.metrics_port}: {e.strerror or e}") from e
    loaded = load_model(settings.model, settings.dtype)
    actor_cls = PrefillActor if settings.role == "prefill_only" else DecodeActor
    actor = actor_cls(settings, loaded)
    actor.serve_forever()
    return 0 if actor.error is None and actor.runner.failure is None else 1
