"""The `tandem` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from engine.model_files import DEFAULT_MODEL, KV_DTYPES, QUANTIZATIONS
from engine.model_text import ModelLoadError
from runtime.names import ROLES
from runtime.settings import KERNEL_CHOICES, KERNELS_HELP, SPECULATIVE_MODES, Settings, read_env_file


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"alias, .gguf file or Hugging Face directory (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="activations and KV cache (default float32)")
    p.add_argument("--quantization", default=os.environ.get("TANDEM_QUANTIZATION", "auto"),
                   choices=QUANTIZATIONS, help="how the weights are held (TANDEM_QUANTIZATION; default auto)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--kernels", default=os.environ.get("TANDEM_KERNELS", "auto"), choices=KERNEL_CHOICES,
                   help=f"how int4/Q8_0 weights are multiplied (TANDEM_KERNELS; default auto): {KERNELS_HELP}")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import EngineConfig, LLMEngine
    from engine.loader import load_model
    from engine.params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    try:  # bad flags fail before seconds of loading
        params.validate()
        if args.num_blocks < 1:
            raise ValueError("--num-blocks must be at least 1")
        if args.threads < 0:
            raise ValueError("--threads must be at least 0")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        from engine import native

        native.use_kernel_path(args.kernels)
        loaded = load_model(args.model, args.dtype, args.quantization)
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e.args[0] if isinstance(e, ValueError) else e}", file=sys.stderr)
        return 2
    tok = loaded.tokenizer
    if args.raw:
        prompt_ids = tok.encode_prompt(args.message)
    else:
        text = loaded.chat_template.render([{"role": "user", "content": args.message}])
        prompt_ids = tok.encode_prompt(text)
    engine = LLMEngine(loaded, EngineConfig(dtype=args.dtype, device=args.device, num_blocks=args.num_blocks,
                                            speculative=args.speculative))
    try:
        engine.check_request(prompt_ids, params)
    except ValueError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    seq = engine.add_request("generate", prompt_ids, params)
    while not seq.finished:
        for out in engine.step():
            if not args.json and out.text:
                print(out.text, end="", flush=True)
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "prompt_ids": prompt_ids,
            "output_ids": seq.output_ids,
            "text": seq.text,
            "finish_reason": seq.finish_reason,
        }, ensure_ascii=False))
    else:
        print()
        print(
            f"[{len(seq.output_ids)} tokens in {elapsed:.2f}s, finish={seq.finish_reason}, "
            f"load {loaded.load_seconds:.1f}s{' (cached)' if loaded.from_cache else ''}]",
            file=sys.stderr,
        )
    return 0


def load_env_file(path: str) -> None:
    """An env file's variables into this process's environment; a variable already set keeps its value.
    ValueError names the file and line that is not an assignment."""
    try:
        values = read_env_file(path)
    except ValueError as e:
        raise ValueError(f"--env-file {e}") from None
    for key, value in values.items():
        os.environ.setdefault(key, value)


def _apply_preamble(argv: list[str]) -> None:
    """``--env-file`` and ``--nats-user`` act before anything reads the environment (defaults, settings)."""
    from bus.options import user_login

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env-file", action="append", default=[])
    pre.add_argument("--nats-user", default=None)
    known, _ = pre.parse_known_args(argv)
    for path in known.env_file:
        load_env_file(path)
    if known.nats_user:
        os.environ.update(user_login(known.nats_user, os.environ))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--env-file", action="append", default=[], metavar="FILE",
                        help="read TANDEM_* (and any) variables from FILE, KEY=VALUE lines, before anything else; "
                             "variables already set win (repeatable; default: none)")
    parser.add_argument("--nats-user", default=None, metavar="USER",
                        help="log in to NATS as USER of tandem's configs (prefill, decode, aggregate, gateway, ops): "
                             "TANDEM_NATS_USER, its password from TANDEM_NATS_PASSWORD_<USER>, its inbox "
                             "_INBOX_<USER> (default: TANDEM_NATS_* as set)")
    parser.add_argument("--log-level", default=os.environ.get("TANDEM_LOG_LEVEL", "WARNING"),
                        help="DEBUG, INFO, WARNING or ERROR (TANDEM_LOG_LEVEL; default WARNING)")
    parser.add_argument("--log-format", default=os.environ.get("TANDEM_LOG_FORMAT", "text"), choices=["text", "json"],
                        help="one line per event as text or JSON (TANDEM_LOG_FORMAT; default text)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion locally (no server)")
    g.add_argument("message", help="the user message (or, with --raw, the whole prompt)")
    _add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--seed", type=int, default=None, help="seed of the draws (default: none, unseeded)")
    g.add_argument("--num-blocks", type=int, default=512, help="KV cache blocks of 16 tokens (default 512)")
    g.add_argument("--speculative", default="ngram", choices=list(SPECULATIVE_MODES),
                   help="draft tokens by prompt lookup and verify them in one step (default ngram)")
    g.add_argument("--raw", action="store_true",
                   help="send MESSAGE as-is, without the chat template (default: through the template)")
    g.add_argument("--json", action="store_true",
                   help="print prompt/output ids, text and finish reason as JSON (default: the text as it comes)")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="run one worker (a pipeline role) on the bus")
    d = Settings()

    def opt(flag: str, what: str, **kw: Any) -> None:
        """A serve flag: None means the TANDEM_* variable, else the settings' default (said in its help)."""
        name = kw.pop("dest", flag.lstrip("-").replace("-", "_"))
        default = getattr(d, name)
        shown = kw.pop("shown", None) or (f"{default}" if default not in ("", 0) or isinstance(default, float)
                                           else "none")
        sv.add_argument(flag, dest=name, default=None, help=f"{what} (TANDEM_{name.upper()}; default {shown})", **kw)

    opt("--pipeline-role", "the worker's role", dest="role", choices=list(ROLES))
    opt("--model", "alias, .gguf file or Hugging Face directory")
    opt("--dtype", "activations and KV cache", choices=["float32", "bfloat16", "float16"])
    opt("--kv-dtype", "the KV cache's element type (auto: --dtype's); prefill and decode workers must agree",
        choices=list(KV_DTYPES))
    opt("--quantization", "how the weights are held: auto keeps a GGUF's own Q4_0/Q4_1 as int4, its other "
        "quantized types as int8, float weights dense", choices=QUANTIZATIONS)
    opt("--device", "cpu, cuda or cuda:N")
    opt("--kernels", f"how int4/Q8_0 weights are multiplied: {KERNELS_HELP}", choices=list(KERNEL_CHOICES))
    opt("--cpus", "pin this worker to these cores, e.g. 0 or 2-3; its torch threads default to their count",
        shown="any core")
    opt("--threads", "torch threads", type=int, shown="one per --cpus core, else torch's default")
    opt("--borrow-cpus", "cores of another worker this one also computes on (at idle priority) while that worker "
        "lends them, e.g. a prefill worker borrowing a decode worker's core", shown="none")
    opt("--lend-step-ms", "a decode worker on --cpus that a prefill worker borrows: while a long prompt is "
        "prefilled elsewhere for it, start a step at most this often, lending the cores in between", type=float,
        shown="0: back to back")
    sv.add_argument("--idle-priority", action="store_true", default=None,
                    help="run at SCHED_IDLE: cores this worker shares go to other work first, e.g. a prefill "
                         "worker on a decode worker's cores (TANDEM_IDLE_PRIORITY; default off)")
    opt("--nats-url", "NATS server URL(s), comma-separated")
    opt("--namespace", "subject namespace")
    opt("--worker-id", "this worker's id on the bus", shown="<role>-<random>")
    opt("--metrics-port", "port of /metrics, /health and /ready", type=int, shown="0: none")
    opt("--metrics-host", "address that port listens on (tandem up: the gateway's --host)")
    sv.add_argument("--metrics-port-fallback", action="store_true", default=None,
                    help="when --metrics-port is busy, serve metrics on any free port and print which (what tandem "
                         "up asks of its workers; TANDEM_METRICS_PORT_FALLBACK; default off: a busy port is an error)")
    opt("--advertise-host", "this worker's address as peers see it", shown="the --kv-tcp-host, or the hostname")
    opt("--kv-tcp-host", "TCP KV engine listen address")
    opt("--max-batch", "most sequences decoding at once", type=int)
    opt("--num-blocks", "KV cache blocks", type=int)
    opt("--block-size", "tokens per KV block", type=int)
    opt("--max-step-tokens", "most tokens one engine step computes (prefill chunks; default 512, "
        "256 on a prefill_only worker)", type=int)
    opt("--kv-transfer", "how KV bytes move to a peer", choices=["auto", "nixl", "shm", "tcp", "cuda_ipc"])
    opt("--nixl-backend", "NIXL's transport", choices=["ucx", "libfabric", "uccl"])
    opt("--local-prefill-max-tokens", "decode_only: prefill locally at or below this many uncached tokens", type=int)
    opt("--prefill-stall-budget-ms", "decode_only: above that, prefill remotely when a local prefill would hold "
        "the decode batch longer than this, unless the prefill queue is longer still", type=float)
    opt("--remote-prefill-fallback", "after two failed remote prefills: prefill locally, or fail",
        choices=["local", "error"])
    opt("--prefill-timeout", "seconds a decode worker waits for a remote prefill", type=float)
    opt("--drain-timeout", "SIGTERM: seconds to finish in-flight requests before leaving", type=float)
    opt("--speculative", "decode: draft tokens by prompt lookup (ngram) and verify them in one step",
        choices=list(SPECULATIVE_MODES))
    sv.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_false", default=None,
                    help="turn the prefix cache off (TANDEM_ENABLE_PREFIX_CACHE; default on)")
    opt("--layerwise-transfer", "prefill: send each layer's KV while the next computes (auto: unless the peer is "
        "reached through same-host shared memory)", choices=["auto", "on", "off"])
    sv.set_defaults(func=cmd_serve)

    from bus.nats_command import build_parser as nats_parser

    n = nats_parser(sub.add_parser("nats", help="run the embedded nats-server (JetStream) alone"))
    n.set_defaults(func=cmd_nats)

    from gateway.server import configure_parser as gateway_parser

    gateway_parser(sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway"))

    from tandem.up.flags import configure_parser as up_parser

    up_parser(sub.add_parser("up", help="start NATS, the workers and the gateway on this machine"))

    from tandem.status import configure_parser as status_parser

    status_parser(sub.add_parser("status", help="list every worker on the bus (NATS micro discovery)"))

    from tandem.tail import configure_parser as tail_parser

    tail_parser(sub.add_parser("tail", help="follow the bus (tandem.>) with token ids decoded to text"))

    import bench.command

    bench.command.configure_parser(sub.add_parser(
        "bench", help="load an OpenAI-compatible server: latency, throughput, goodput",
        description=bench.command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


_SERVE_FIELDS = ("role", "model", "dtype", "quantization", "kernels", "device", "cpus", "threads", "borrow_cpus", "lend_step_ms",
                 "idle_priority",
                 "nats_url", "namespace", "worker_id",
                 "metrics_port", "metrics_host", "metrics_port_fallback", "advertise_host", "kv_tcp_host",
                 "max_batch", "num_blocks", "block_size", "max_step_tokens", "kv_transfer", "nixl_backend",
                 "local_prefill_max_tokens", "prefill_stall_budget_ms", "remote_prefill_fallback", "prefill_timeout", "enable_prefix_cache",
                 "speculative", "kv_dtype", "layerwise_transfer", "drain_timeout")


def cmd_serve(args: argparse.Namespace) -> int:
    from actors.serve import serve

    try:
        settings = Settings.from_env(**{f: getattr(args, f) for f in _SERVE_FIELDS})
        return serve(settings)
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_nats(args: argparse.Namespace) -> int:
    from bus.nats_command import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _apply_preamble(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    from runtime.logs import setup_logging

    try:
        setup_logging(args.log_level, args.log_format)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
