"""``tandem bench``: load any OpenAI-compatible server and report latency, throughput and goodput.

    tandem bench --base-url http://127.0.0.1:8000 --dataset mixed --rate 0.5,1,2,4 --duration 60 \\
        --goodput ttft:3000 itl:150 --json out.json --plot out.png

One run is one or more load levels (``--concurrency 1,4,16`` or ``--rate 0.5,1,2``), each
with its own prompts (so a level does not hit the previous one's prefix cache), after
``--warmup`` requests. It first asks the server what it is (``/v1/models``, ``/props``). The
result: a summary on stdout, a JSON document (``bench.results.SCHEMA``) with every figure and
every request, and a PNG (``bench.plots``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from bench.datasets import DATASETS, FileDataset, PromptBuilder, SyntheticDataset
from bench.loadgen import Load, Options, RequestRecord, Stop, run_level, send
from bench.results import SCHEMA, error_samples, parse_slo, run_json
from bench.target import Target, TargetError, identify, normalize_base_url

WARMUP_INDEX = 10**9  # warm-up prompts come from their own index range


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tandem bench`` flags to ``p`` and make it run :func:`main`."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or its /v1 (default :8000)")
    p.add_argument("--model", default=None, help="model to request (default: the first /v1/models lists)")
    p.add_argument("--api-key", default=None, help="bearer key (default $OPENAI_API_KEY or $TANDEM_API_KEY)")
    p.add_argument("--tokenizer", default="auto",
                   help="model whose tokenizer sizes the prompts: alias, .gguf or HF dir; 'none' to estimate "
                        "(default: the served model when it names a local one, e.g. a llama-server GGUF path)")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions"],
                   help="chat (/v1/chat/completions, chat template counted) or completions (default chat)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", help=f"{' | '.join(DATASETS)} | FILE.jsonl (default random)")
    d.add_argument("--input-len", "--random-input-len", type=int, default=256,
                   help="prompt tokens of a request (shared-prefix: after the prefix) (default 256)")
    d.add_argument("--output-len", "--random-output-len", type=int, default=64,
                   help="output tokens (max_tokens with ignore_eos) (default 64)")
    d.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default 0)")
    d.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens (default 512)")
    d.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts (default 4)")
    d.add_argument("--long-share", type=float, default=0.1, help="mixed: share of long prompts (default 0.1)")
    d.add_argument("--long-tokens", type=int, default=2000, help="mixed: tokens of a long prompt (default 2000)")
    d.add_argument("--long-output-len", type=int, default=16, help="mixed: output tokens of a long prompt (default 16)")
    g = p.add_argument_group("load")
    how = g.add_mutually_exclusive_group()
    how.add_argument("--concurrency", default=None, help="closed loop: requests in flight, e.g. 1,4,16 (default 1)")
    how.add_argument("--rate", default=None, help="open loop: requests/s (Poisson), e.g. 0.5,1,2,4 or inf (default: closed loop, --concurrency)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier (default 1)")
    much = g.add_mutually_exclusive_group()
    much.add_argument("--requests", type=int, default=None, help="requests per level (default 32)")
    much.add_argument("--duration", type=float, default=None, help="seconds of sending per level (default: --requests decides)")
    g.add_argument("--warmup", type=int, default=1, help="requests sent one by one before measuring (default 1)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    g.add_argument("--temperature", type=float, default=0.0, help="of every request (default 0: greedy)")
    g.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default 0)")
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:3000 itl:150 tpot:100 (milliseconds; default: none, no goodput)")
    o.add_argument("--json", dest="json_path", default=None, help="write the result here (default: only the table on stdout)")
    o.add_argument("--plot", default=None, help="write a PNG here (latency CDFs, ITL over time, goodput vs rate; default: none)")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no live progress bar (default: a bar on a terminal)")
    p.set_defaults(func=main)
    return p


def _levels(args: argparse.Namespace) -> list[Load]:
    """The load levels the flags ask for (ValueError names the flag)."""
    if args.rate is not None:
        if not args.burstiness > 0:
            raise ValueError(f"--burstiness must be positive, got {args.burstiness}")
        rates = []
        for part in args.rate.split(","):
            try:
                r = float(part)
            except ValueError:
                raise ValueError(f"--rate {args.rate!r}: {part!r} is not a number") from None
            if not r > 0:
                raise ValueError(f"--rate {args.rate!r}: rates must be positive")
            rates.append(r)
        if any(math.isinf(r) for r in rates) and args.duration is not None:
            raise ValueError("--rate inf sends everything at once: use --requests, not --duration")
        return [Load(rate=r, burstiness=args.burstiness) for r in rates]
    levels = []
    for part in (args.concurrency or "1").split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise ValueError(f"--concurrency {args.concurrency!r}: {part!r} is not a positive integer")
        levels.append(Load(concurrency=int(part)))
    return levels


def _stop(args: argparse.Namespace) -> Stop:
    if args.duration is not None:
        if not args.duration > 0:
            raise ValueError(f"--duration must be positive, got {args.duration}")
        return Stop(duration=args.duration)
    n = 32 if args.requests is None else args.requests
    if n < 1:
        raise ValueError(f"--requests must be at least 1, got {n}")
    return Stop(requests=n)


def _tokenizer_spec(args: argparse.Namespace, model: str) -> str | None:
    """The model spec whose tokenizer sizes prompts: --tokenizer, else the served model when it is local."""
    from engine.model_files import resolve_model_path
    from engine.model_text import ModelLoadError

    if args.tokenizer != "auto":
        return None if args.tokenizer == "none" else args.tokenizer
    try:
        resolve_model_path(model)
    except (ModelLoadError, OSError):
        return None
    return model


def _dataset(args: argparse.Namespace, builder: PromptBuilder) -> SyntheticDataset | FileDataset:
    if args.dataset in DATASETS:
        return SyntheticDataset(
            args.dataset, builder, endpoint=args.endpoint, input_len=args.input_len, output_len=args.output_len,
            range_ratio=args.range_ratio, prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
            long_share=args.long_share, long_tokens=args.long_tokens, long_output_len=args.long_output_len,
            seed=args.seed)
    return FileDataset.load(Path(args.dataset), builder, args.output_len)


class _RichProgress:
    """A live bar on the terminal: done / total (or elapsed), in flight, errors."""

    def __init__(self, label: str, total: int | None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[note]}")]
        self.bar = Progress(*columns, console=Console(file=sys.stderr), transient=True)
        self.task = self.bar.add_task(label, total=total, note="")
        self.in_flight = self.errors = 0

    def __enter__(self) -> _RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def sent(self) -> None:
        self.in_flight += 1
        self._note()

    def finished(self, record: RequestRecord) -> None:
        self.in_flight -= 1
        self.errors += not record.ok
        self.bar.advance(self.task)
        self._note()

    def _note(self) -> None:
        self.bar.update(self.task, note=f"in flight {self.in_flight}, errors {self.errors}")


class _NoProgress:
    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def sent(self) -> None:
        return None

    def finished(self, record: RequestRecord) -> None:
        return None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def format_run(run: dict[str, Any]) -> str:
    """A level's figures for the terminal."""
    req, thr = run["requests"], run["throughput"]
    lines = [f"{_describe_load(run['load'])}: {req['sent']} requests in {run['duration_s']:.1f} s, "
             f"{req['failed']} failed; {thr['requests_per_s']} req/s, {thr['output_tokens_per_s']} output tok/s"]
    lines.append(f"  {'(ms)':<6}" + "".join(f"{k:>9}" for k in ("mean", "p50", "p90", "p99", "max")))
    for name, st in run["latency_ms"].items():
        lines.append(f"  {name.upper():<6}" + "".join(f"{_fmt(st[k]):>9}" for k in ("mean", "p50", "p90", "p99", "max")))
    if run["goodput"] is not None:
        g = run["goodput"]
        lines.append(f"  goodput {g['requests_per_s']} req/s ({g['met']} of {req['sent']} met the SLOs)")
    for kind, part in run["by_kind"].items():
        lat = part["latency_ms"]
        good = f", goodput {part['goodput']['requests_per_s']} req/s" if part["goodput"] is not None else ""
        lines.append(f"  {kind}: {part['requests']['sent']} requests, TTFT p90 {_fmt(lat['ttft']['p90'])} ms, "
                     f"ITL p99 {_fmt(lat['itl']['p99'])} ms{good}")
    for kind, n in run["errors"].items():
        lines.append(f"  error {kind}: {n}")
    return "\n".join(lines)


def _describe_load(load: dict[str, Any]) -> str:
    if load["mode"] == "rate":
        rate = "inf" if load["rate"] is None else f"{load['rate']:g}/s"
        return f"rate {rate}" + (f" (burstiness {load['burstiness']:g})" if load["burstiness"] != 1 else "")
    return f"concurrency {load['concurrency']}"


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every level; returns the result document (raises ValueError / TargetError)."""
    from engine.model_files import load_text

    base_url = normalize_base_url(args.base_url)
    levels, stop, slo = _levels(args), _stop(args), parse_slo(args.goodput)
    if args.warmup < 0 or not args.timeout > 0:
        raise ValueError("--warmup must be at least 0 and --timeout positive")
    if args.dataset not in DATASETS and not (args.dataset.endswith(".jsonl") and Path(args.dataset).is_file()):
        raise ValueError(f"--dataset {args.dataset!r}: choose {', '.join(DATASETS)} or an existing .jsonl file")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TANDEM_API_KEY") or ""
    async with httpx.AsyncClient() as client:
        server = await identify(client, base_url, api_key)
    model = args.model or (server["models"][0] if server["models"] else None)
    if model is None:
        raise TargetError(f"{base_url}/models lists no model; pass --model")
    spec = _tokenizer_spec(args, model)
    text = load_text(spec) if spec else None
    builder = PromptBuilder(text.tokenizer if text else None, text.chat_template if text else None)
    if not builder.exact:
        print(f"tandem bench: no local tokenizer for {model}; prompt lengths are estimates (pass --tokenizer)",
              file=sys.stderr)
    dataset = _dataset(args, builder)
    target = Target(base_url, model, api_key)
    count = (lambda s: len(text.tokenizer.encode(s))) if text else None
    opts = Options(temperature=args.temperature, timeout=args.timeout, count_tokens=count)
    tty = args.progress and sys.stderr.isatty()
    for i in range(args.warmup):
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0)) as client:
            rec = await send(client, target, dataset.get(WARMUP_INDEX + i), WARMUP_INDEX + i, 0.0, opts)
        if not rec.ok:
            raise TargetError(f"warm-up request failed: {rec.error_kind}: {rec.error}")
    runs = []
    for n, load in enumerate(levels):
        progress = _RichProgress(load.label(), stop.requests) if tty else _NoProgress()
        with progress:
            outcome = await run_level(target, dataset, load, stop, opts, progress, first_index=n * 1_000_000,
                                      seed=args.seed)
        run = run_json(load.describe(), outcome.records, outcome.duration, slo)
        run["error_samples"] = error_samples(outcome.records)
        runs.append(run)
        print(format_run(run), flush=True)
    return {
        "schema": SCHEMA,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["tandem", *sys.argv[1:]],
        "server": server,
        "config": {
            "base_url": base_url, "model": model, "endpoint": args.endpoint, "dataset": dataset.describe(),
            "stop": {"requests": stop.requests, "duration_s": stop.duration}, "warmup": args.warmup,
            "seed": args.seed, "temperature": args.temperature, "timeout_s": args.timeout, "slo_ms": slo,
            "tokenizer": spec,
        },
        "runs": runs,
    }


def main(args: argparse.Namespace) -> int:
    """``tandem bench`` entry point: 0 when it measured, 1 when the server failed us, 2 for bad flags."""
    from bench.plots import write_plot

    try:
        if args.plot:
            import matplotlib  # noqa: F401 - fail before minutes of load, not after
        result = asyncio.run(bench(args))
    except ImportError:
        print("tandem bench: --plot needs matplotlib: pip install 'tandem[bench]'", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"tandem bench: {e}", file=sys.stderr)
        return 2
    except TargetError as e:
        print(f"tandem bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    if args.plot:
        write_plot(result, Path(args.plot))
    return 0
