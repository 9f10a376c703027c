"""gateway: the OpenAI-compatible HTTP edge of tandem (FastAPI + uvicorn).

It validates a request, applies the chat template and tokenizes (it loads the tokenizer and
template only, never weights), picks a decode worker by prefix-cache affinity and load (or
the JetStream pool), publishes ``GenerateRequest`` messages on NATS and streams the
workers' tokens back as OpenAI JSON or server-sent events.

Modules: ``app`` (the FastAPI app and its endpoints), ``service`` (one request's life:
prepare, dispatch, collect, deadlines, worker loss), ``bus_client`` (NATS: publish, the
stream subscription, cancel), ``router`` (worker registry and routing), ``protocol``
(request bodies), ``errors`` (OpenAI error shapes), ``textmodel`` (tokenizer-only model
load), ``server`` (``tandem gateway``); its settings are ``runtime.settings.GatewayConfig``.
"""
