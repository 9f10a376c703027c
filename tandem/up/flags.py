"""The ``tandem up`` command line."""

from __future__ import annotations

import argparse

from engine.model_files import KV_DTYPES
from gateway.server import add_sampling_default_flags
from runtime.settings import KERNEL_CHOICES, KERNELS_HELP, SPECULATIVE_MODES
from tandem.up.ports import DEFAULT_METRICS_BASE, DEFAULT_PORT

DEFAULT_NATS_PORT = 4222


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tandem up`` flags to ``p`` and make it run :func:`tandem.up.run.main`."""
    from tandem.up.run import main

    p.add_argument("--model", default=None, help="alias, .gguf file or HF directory (default: the built-in model)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help=f"gateway HTTP port (default {DEFAULT_PORT}, or any free one when that is busy; 0 = any free)")
    p.add_argument("--prefill", type=int, default=None, help="prefill_only workers (default 1; none with --aggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--aggregated", action="store_true",
                   help="run --decode prefill_and_decode workers and no prefill workers (default off: disaggregated)")
    p.add_argument("--nats-url", default=None, help="join this NATS instead of starting an embedded one (default: an embedded nats-server -js)")
    p.add_argument("--nats-port", type=int, default=DEFAULT_NATS_PORT,
                   help="embedded NATS client port (default 4222; a free one if busy; 0 = any)")
    p.add_argument("--nats-monitor-port", type=int, default=None,
                   help="embedded NATS: serve its monitoring (/varz, /jsz: what KEDA's JetStream scaler reads) "
                        "on this port (default: off)")
    p.add_argument("--namespace", default=None, help="subject namespace (TANDEM_NAMESPACE, default tandem)")
    p.add_argument("--metrics-port-base", type=int, default=None,
                   help=f"workers' metrics ports, one each from here up (default {DEFAULT_METRICS_BASE}, any free "
                        "port in place of a busy one; 0 = any free; a busy port given here is an error)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="activations and KV cache of the workers (TANDEM_DTYPE; default float32)")
    p.add_argument("--quantization", default=None, choices=["none", "fp16", "int8", "int4", "auto"],
                   help="how workers hold the weights (TANDEM_QUANTIZATION; default auto: the GGUF's own)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] for the workers (default cpu)")
    p.add_argument("--kernels", default=None, choices=list(KERNEL_CHOICES), help=f"how workers multiply int4/Q8_0 weights (TANDEM_KERNELS; default auto): {KERNELS_HELP}")
    p.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPES),
                   help="the KV cache's element type (TANDEM_KV_DTYPE; default auto: --dtype's)")
    p.add_argument("--speculative", default=None, choices=list(SPECULATIVE_MODES),
                   help="decode: draft tokens by prompt lookup (ngram) and verify them in one step, or off "
                        "(TANDEM_SPECULATIVE; default ngram)")
    p.add_argument("--prefill-cpus", default=None,
                   help="cores for the prefill workers, e.g. 0 or 0-3, split among them (default: see --no-pin)")
    p.add_argument("--decode-cpus", default=None,
                   help="cores for the decode (or --aggregated) workers, split among them (default: see --no-pin)")
    p.add_argument("--prefill-devices", default=None, help="GPUs for the prefill workers, e.g. cuda:0 (split; default: none, CPU)")
    p.add_argument("--decode-devices", default=None, help="GPUs for the decode workers, e.g. cuda:1 (split; default: none, CPU)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not give workers their own cores (default on a CPU host: prefill and decode "
                        "workers on disjoint cores when there are enough, one torch thread per core)")
    p.add_argument("--worker-args", default="", help="extra flags for every `tandem serve`, e.g. '--max-batch 8' (default: none)")
    p.add_argument("--gateway-args", default="", help="extra flags for `tandem gateway`, e.g. '--max-queue-wait 10' (default: none)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /ready (default 300)")
    p.add_argument("--restart", default="on-failure", choices=["on-failure", "never"],
                   help="restart a child that dies (default on-failure); never: any death stops everything")
    p.add_argument("--restart-delay", type=float, default=1.0,
                   help="seconds before the first restart of a child; doubles with each failure (default 1)")
    p.add_argument("--restart-max-delay", type=float, default=30.0,
                   help="the most seconds between restarts of a child (default 30)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds the gateway and each worker get to finish in-flight requests on Ctrl-C (default 30)")
    p.add_argument("--stop-timeout", type=float, default=10.0,
                   help="seconds a child gets beyond its drain time after SIGTERM before SIGKILL (default 10)")
    p.add_argument("--ready-file", default=None,
                   help="write the cluster's URLs and PIDs here as JSON once ready, again after each restart (default: none)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="a name the model answers to, the first one also in /v1/models (repeatable; default: "
                        "the model's own name)")
    p.add_argument("--autoscale", default=None, metavar="prefill=MIN..MAX,decode=MIN..MAX",
                   help="start and drain workers on this host from each role's demand (bus/demand.py), e.g. "
                        "prefill=0..2,decode=1..2 (replaces --prefill/--decode; default: fixed counts)")
    p.add_argument("--autoscale-target", default="",
                   help="demand one worker should carry, per role, e.g. prefill=2,decode=4 (default: those)")
    p.add_argument("--autoscale-activation", default="",
                   help="a role with MIN 0 starts its first worker once its demand exceeds this, e.g. prefill=1 "
                        "(default prefill=1,decode=0)")
    p.add_argument("--autoscale-cooldown", type=float, default=30.0,
                   help="seconds a role must want fewer workers before one is drained (default 30)")
    p.add_argument("--autoscale-interval", type=float, default=1.0,
                   help="seconds between two readings of the demand (default 1)")
    p.add_argument("--autoscale-metrics-port", type=int, default=None,
                   help="port of the scaler's /metrics (tandem_autoscale_*; default the first free one after the "
                        "workers' metrics ports)")
    add_sampling_default_flags(p)
    p.add_argument("--quiet", action="store_true",
                   help="do not echo the children's output (default: echoed, start-up phases included)")
    p.set_defaults(func=main)
    return p


# ---- ports -------------------------------------------------------------------------------
