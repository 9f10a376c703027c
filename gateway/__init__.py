"""gateway: the OpenAI-compatible HTTP edge of tandem (FastAPI + uvicorn).

It validates a request, applies the chat template and tokenizes (it loads the tokenizer and
template only, never weights), picks a decode worker by prefix-cache affinity and load (or
the JetStream pool), publishes ``GenerateRequest`` messages on NATS and streams the
workers' tokens back as OpenAI JSON or server-sent events.

Modules: ``app`` (the FastAPI app and its endpoints), ``prepare`` (a body validated into
jobs), ``jobs`` (the data: ``Prepared``, ``Job``), ``run`` (one request's jobs on the bus:
dispatch, collect, deadlines, worker loss), ``service`` (the shared state and its checks),
``responses`` (OpenAI bodies and chunks), ``bus_client`` (NATS: publish, the
stream subscription, cancel), ``router`` (worker registry and routing), ``protocol``
(request bodies), ``errors`` (OpenAI error shapes), ``textmodel`` (tokenizer-only model
load), ``server`` (``tandem gateway``); its settings are ``runtime.settings.GatewayConfig``.
"""
