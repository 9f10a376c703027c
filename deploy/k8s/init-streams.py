"""Create tandem's JetStream work queues with N replicas (the Kubernetes Job tandem-streams).

Why a separate step: every tandem process ensures the streams at start, but a replicated
stream (3 copies on a 3-node cluster, so a NATS node may fail without losing queued work)
is a cluster decision made once, by a user allowed to make it. Settings come from the
environment, as for every tandem process: TANDEM_MODEL, TANDEM_NAMESPACE, TANDEM_NATS_URL,
TANDEM_NATS_USER / TANDEM_NATS_PASSWORD (or the other TANDEM_NATS_* credentials),
TANDEM_STREAM_REPLICAS (default 3) and TANDEM_STREAMS_TIMEOUT (seconds of retrying, default 300).

    python deploy/k8s/init-streams.py        # exit 0 once both streams and consumers exist
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import replace

import nats.errors

from bus.connection import connect
from bus.options import BusConnectError, BusOptions
from bus.streams import DEFAULT_GENERATE, DEFAULT_PREFILL, StreamConfigError, ensure_streams
from bus.subjects import Subjects
from engine.model_files import DEFAULT_MODEL, model_name


async def init_streams() -> int:
    """Ensure both pools with the configured replicas, retrying until the deadline."""
    replicas = int(os.environ.get("TANDEM_STREAM_REPLICAS", "3"))
    timeout = float(os.environ.get("TANDEM_STREAMS_TIMEOUT", "300"))
    subjects = Subjects(model_name(os.environ.get("TANDEM_MODEL") or DEFAULT_MODEL),
                        os.environ.get("TANDEM_NAMESPACE") or "tandem")
    generate = replace(DEFAULT_GENERATE, replicas=replicas)
    prefill = replace(DEFAULT_PREFILL, replicas=replicas)
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        left = max(1.0, deadline - time.monotonic())
        try:
            nc = await connect(BusOptions.from_env(connect_timeout=min(30.0, left)), name="tandem-streams")
            try:
                done = await ensure_streams(nc, subjects, generate, prefill, timeout=10.0)
            finally:
                await nc.close()
        except (BusConnectError, StreamConfigError, nats.errors.Error, asyncio.TimeoutError, OSError) as e:
            if time.monotonic() >= deadline:
                print(f"error: streams not ready after {timeout:.0f}s ({attempt} attempts): {e}", file=sys.stderr)
                return 1
            print(f"attempt {attempt}: {e}; retrying in 3s", file=sys.stderr, flush=True)
            await asyncio.sleep(3.0)
            continue
        print(f"stream {subjects.generate_stream} {done.generate_stream}, consumer {subjects.generate_consumer} "
              f"{done.generate_consumer}; stream {subjects.prefill_stream} {done.prefill_stream}, consumer "
              f"{subjects.prefill_consumer} {done.prefill_consumer} ({replicas} replicas)", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(init_streams()))
