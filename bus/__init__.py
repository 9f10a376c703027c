"""bus: NATS for tandem — embedded server, connection + auth, subjects, message schemas, JetStream.

Modules: ``server`` (EmbeddedNats), ``connection`` (BusOptions, connect), ``subjects``
(every subject/stream/consumer name), ``messages`` (every message schema), ``publish``
(size-checked send helpers), ``streams`` (work-queue streams and pull consumers).
This package never imports ``actors``, ``gateway``, ``bench`` or ``tandem``; of ``engine``, only
``params`` (and ``model_files`` for ``tandem nats --cluster``); tests/test_layers.py checks the layers.
"""
