"""bus: NATS for tandem — embedded server, connection + auth, subjects, message schemas, JetStream.

Modules: ``server`` (EmbeddedNats), ``nats_command`` (``tandem nats``), ``options`` (BusOptions),
``connection`` (connect), ``subjects`` (every subject/stream/consumer name), ``wire`` (the message format),
``*_messages`` (the message schemas, by who exchanges them; ``messages`` unites them), ``publish``
(size-checked send helpers), ``streams`` (work-queue streams and pull consumers).
This package never imports ``actors``, ``gateway``, ``bench`` or ``tandem``; of ``engine``, only
``params`` (and ``model_files`` for ``tandem nats --cluster``); tests/test_layers.py checks the layers.
"""
