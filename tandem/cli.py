"""The `tandem` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from engine.model_files import DEFAULT_MODEL, QUANTIZATIONS, ModelLoadError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias, .gguf file or Hugging Face directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="activations and KV cache (default float32)")
    p.add_argument("--quantization", default=os.environ.get("TANDEM_QUANTIZATION", "auto"),
                   choices=QUANTIZATIONS, help="how the weights are held (TANDEM_QUANTIZATION; default auto)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
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
        loaded = load_model(args.model, args.dtype, args.quantization)
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e.args[0] if isinstance(e, ValueError) else e}", file=sys.stderr)
        return 2
    tok = loaded.tokenizer
    if args.raw:
        prompt_ids = tok.encode(args.message)
    else:
        text = loaded.chat_template.render([{"role": "user", "content": args.message}])
        prompt_ids = tok.encode(text)
    engine = LLMEngine(loaded, EngineConfig(dtype=args.dtype, device=args.device, num_blocks=args.num_blocks))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("TANDEM_LOG_LEVEL", "WARNING"),
                        help="DEBUG, INFO, WARNING or ERROR (TANDEM_LOG_LEVEL)")
    parser.add_argument("--log-format", default=os.environ.get("TANDEM_LOG_FORMAT", "text"), choices=["text", "json"])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion locally (no server)")
    g.add_argument("message")
    _add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-blocks", type=int, default=512)
    g.add_argument("--raw", action="store_true", help="send MESSAGE as-is, without the chat template")
    g.add_argument("--json", action="store_true", help="print prompt/output ids, text and finish reason as JSON")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="run one worker (a pipeline role) on the bus")
    sv.add_argument("--pipeline-role", dest="role", default=None,
                    choices=["prefill_and_decode", "prefill_only", "decode_only"])
    sv.add_argument("--model", default=None)
    sv.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="activations and KV cache (TANDEM_DTYPE; default float32)")
    sv.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="how the weights are held (TANDEM_QUANTIZATION; default auto: a GGUF's own Q4_0/Q4_1 "
                         "as int4, its other quantized types as int8, float weights dense)")
    sv.add_argument("--device", default=None, help="cpu, cuda or cuda:N (TANDEM_DEVICE)")
    sv.add_argument("--cpus", default=None,
                    help="pin this worker to these cores, e.g. 0 or 2-3 (TANDEM_CPUS); its torch threads "
                         "default to their count")
    sv.add_argument("--threads", type=int, default=None,
                    help="torch threads (TANDEM_THREADS; default: one per --cpus core, else torch's default)")
    sv.add_argument("--nats-url", default=None)
    sv.add_argument("--namespace", default=None)
    sv.add_argument("--worker-id", default=None)
    sv.add_argument("--metrics-port", type=int, default=None)
    sv.add_argument("--advertise-host", default=None, help="this worker's address as peers see it")
    sv.add_argument("--kv-tcp-host", default=None, help="TCP KV engine listen address (default 127.0.0.1)")
    sv.add_argument("--max-batch", type=int, default=None)
    sv.add_argument("--num-blocks", type=int, default=None)
    sv.add_argument("--block-size", type=int, default=None)
    sv.add_argument("--max-step-tokens", type=int, default=None)
    sv.add_argument("--kv-transfer", default=None, choices=["auto", "nixl", "shm", "tcp", "cuda_ipc"])
    sv.add_argument("--nixl-backend", default=None, choices=["ucx", "libfabric", "uccl"])
    sv.add_argument("--local-prefill-max-tokens", type=int, default=None)
    sv.add_argument("--remote-prefill-fallback", default=None, choices=["local", "error"])
    sv.add_argument("--prefill-timeout", type=float, default=None)
    sv.add_argument("--drain-timeout", type=float, default=None,
                    help="SIGTERM: seconds to finish in-flight requests before leaving (default 30)")
    sv.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_false", default=None)
    sv.add_argument("--layerwise-transfer", default=None, choices=["auto", "on", "off"],
                    help="prefill: send each layer's KV while the next computes (auto: unless the peer is "
                         "reached through same-host shared memory)")
    sv.set_defaults(func=cmd_serve)

    from bus.server import build_parser as nats_parser

    n = nats_parser(sub.add_parser("nats", help="run the embedded nats-server (JetStream) alone"))
    n.set_defaults(func=cmd_nats)

    from gateway.server import configure_parser as gateway_parser

    gateway_parser(sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway"))

    from tandem.up import configure_parser as up_parser

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


_SERVE_FIELDS = ("role", "model", "dtype", "quantization", "device", "cpus", "threads", "nats_url", "namespace", "worker_id",
                 "metrics_port", "advertise_host", "kv_tcp_host",
                 "max_batch", "num_blocks", "block_size", "max_step_tokens", "kv_transfer", "nixl_backend",
                 "local_prefill_max_tokens", "remote_prefill_fallback", "prefill_timeout", "enable_prefix_cache",
                 "layerwise_transfer", "drain_timeout")


def cmd_serve(args: argparse.Namespace) -> int:
    from actors.serve import serve
    from runtime.settings import Settings

    try:
        settings = Settings.from_env(**{f: getattr(args, f) for f in _SERVE_FIELDS})
        return serve(settings)
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_nats(args: argparse.Namespace) -> int:
    from bus.server import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
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
