"""``tandem tail``: follow everything on ``tandem.>`` and print one line per message.

Why: the bus is the system's nervous system; watching it answers "where is my request"
faster than any log. Each line shows the time, the subject, the message kind, the request
id and a summary, with token ids decoded to text by the model's tokenizer (no weights). ``--request ID`` keeps one request's messages (by the
``Tandem-Request-Id`` header or the body's ``request_id``).

    tandem tail                              # until Ctrl-C
    tandem tail --request 3f2a... --until-done
    tandem tail --count 20 --timeout 10      # stop after 20 lines or 10 s (scripts, tests)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

log = logging.getLogger("tandem.tail")

#: Kinds that end a request's stream (``--until-done``).
TERMINAL_KINDS = frozenset({"stream_finish", "stream_error"})


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer alone (no weights; cached metadata after the first load)."""
    from engine.model_files import load_text

    return load_text(model).tokenizer


class Printer:
    """Turns bus messages into one-line summaries (``decode`` maps token ids to text)."""

    def __init__(self, decode: Callable[[list[int]], str] | None = None, width: int = 80) -> None:
        self.decode = decode
        self.width = width

    def text(self, ids: list[int] | None, fallback: str = "") -> str:
        """Quoted, escaped, shortened text of ``ids`` (or ``fallback`` without a tokenizer)."""
        if ids and self.decode is not None:
            try:
                s = self.decode(list(ids))
            except (ValueError, TypeError, OverflowError) as e:  # an id outside the vocabulary
                s = f"<undecodable: {e}>"
        else:
            s = fallback
        s = json.dumps(s, ensure_ascii=False)[1:-1]
        if self.width and len(s) > self.width:
            keep = self.width // 2 - 2
            s = f"{s[:keep]} … {s[-keep:]}"
        return f'"{s}"'

    def summary(self, msg: Any) -> str:
        """What one decoded tandem message says, in a few words."""
        from bus.wire import kind_of

        k = kind_of(type(msg))
        if k == "generate_request":
            sp = msg.sampling
            target = f" target {msg.target_endpoint}" if msg.target_endpoint else ""
            prompt = self.text(msg.prompt_ids, msg.prompt or "")
            n = len(msg.prompt_ids) if msg.prompt_ids else 0
            return (f"{n} prompt tokens {prompt} max_tokens={sp.max_tokens} temperature={sp.temperature:g}"
                    f"{target} -> {msg.stream_subject}")
        if k == "prefill_job":
            d = msg.dst
            return (f"{len(msg.prompt_ids)} prompt tokens {self.text(msg.prompt_ids)} from token "
                    f"{d.first_token_index}, into {len(d.block_ids)} blocks of {d.worker_id} via {d.engine}, "
                    f"attempt {msg.attempt} -> {msg.reply_subject}")
        if k == "prefill_accepted":
            return f"taken by {msg.prefill_worker_id}, attempt {msg.attempt}"
        if k == "prefill_done":
            t = " ".join(f"{name}={sec * 1000:.1f}ms" for name, sec in msg.timings.items())
            if msg.ok:
                first = f"{msg.first_token} {self.text([msg.first_token])}" if msg.first_token is not None else "-"
                return (f"ok by {msg.prefill_worker_id or '?'}: first token {first}, "
                        f"{msg.cached_tokens} cached, {t}").rstrip(", ")
            return f"FAILED by {msg.prefill_worker_id or '?'} ({msg.error_code}): {msg.error} {t}".rstrip()
        if k == "stream_tokens":
            return f"seq {msg.seq} {list(msg.token_ids)} {self.text(msg.token_ids, msg.text)}"
        if k == "stream_finish":
            u, tm = msg.usage, msg.timings
            where = f" prefill {msg.prefill_mode}" if msg.prefill_mode else ""
            if msg.prefill_worker_id:
                where += f" by {msg.prefill_worker_id}"
            return (f"seq {msg.seq} {msg.finish_reason}: {u.prompt_tokens} prompt ({u.cached_tokens} cached), "
                    f"{u.completion_tokens} completion tokens;{where} decode by {msg.worker_id or '?'}; "
                    f"queue={tm.queue * 1000:.1f}ms prefill={tm.prefill * 1000:.1f}ms "
                    f"transfer={tm.transfer * 1000:.1f}ms decode={tm.decode * 1000:.1f}ms")
        if k == "stream_error":
            return f"seq {msg.seq} {msg.status} {msg.code}: {msg.message}"
        if k == "cancel":
            return f"cancel ({msg.reason or 'no reason'})"
        if k == "claim":
            return f"{msg.key} claimed by {msg.worker_id or '?'}"
        if k == "kv_meta_request":
            return f"from {msg.worker_id or '?'}"
        if k == "kv_meta_reply":
            return f"{msg.worker_id} engine {msg.engine or '?'} incarnation {msg.incarnation}"
        if k == "worker_stats":
            hit = f"{100.0 * msg.prefix_hit_rate:.0f}%"
            sees = f" sees {msg.prefill_workers} prefill" if msg.role == "decode_only" else ""
            return (f"{msg.worker_id} ({msg.role}) running {msg.running}/{msg.max_batch} queued {msg.queued} "
                    f"blocks free {msg.free_blocks}/{msg.total_blocks} hit {hit} up {msg.uptime:.0f}s{sees}")
        return repr(msg)


def describe(subject: str, data: bytes, headers: dict[str, str] | None,
             printer: Printer) -> tuple[str, str, str | None]:
    """(kind, summary, request id) of one raw NATS message; undecodable ones are shown raw."""
    from bus.messages import decode_any
    from bus.wire import REQUEST_ID_HEADER, MessageError, kind_of

    rid = (headers or {}).get(REQUEST_ID_HEADER)
    if not data:
        return "-", "(empty body: a request to an endpoint)" if ".svc." in subject else "(empty)", rid
    try:
        msg = decode_any(data)
    except MessageError:
        preview = data[:120].decode("utf-8", "replace")
        return "?", f"(not a tandem message) {preview!r}", rid
    rid = rid or getattr(msg, "request_id", None)
    return kind_of(type(msg)), printer.summary(msg), rid


def format_line(subject: str, kind: str, rid: str | None, summary: str, when: float | None = None) -> str:
    """``HH:MM:SS.mmm subject kind rid=... summary``."""
    ts = dt.datetime.fromtimestamp(when if when is not None else time.time()).strftime("%H:%M:%S.%f")[:-3]
    return f"{ts} {subject} {kind}{f' rid={rid}' if rid else ''} {summary}"


def _is_request(rid: str | None, wanted: str) -> bool:
    """``wanted`` itself, or one of its jobs: the gateway names them ``<client id>-<choice>[-r1]``."""
    return rid is not None and (rid == wanted or rid.startswith(wanted + "-"))


async def tail(nc: Any, subject: str, printer: Printer, out: TextIO, *, request_id: str | None = None,
               count: int | None = None, timeout: float | None = None, until_done: bool = False,
               skip_kinds: frozenset[str] = frozenset(), ready: Callable[[], None] | None = None) -> int:
    """Print messages on ``subject`` until ``count`` lines, ``timeout`` s, or the request's end.

    Returns the number of lines printed.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        queue.put_nowait((time.time(), msg))

    sub = await nc.subscribe(subject, cb=on_msg)
    await nc.flush(timeout=5)
    if ready is not None:
        ready()
    printed = 0
    deadline = time.monotonic() + timeout if timeout else None
    try:
        while count is None or printed < count:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                break
            try:
                when, msg = await asyncio.wait_for(queue.get(), timeout=wait)
            except asyncio.TimeoutError:
                break
            kind, summary, rid = describe(msg.subject, msg.data, msg.headers, printer)
            if request_id is not None and not _is_request(rid, request_id):
                continue
            if kind in skip_kinds:
                continue
            print(format_line(msg.subject, kind, rid, summary, when), file=out, flush=True)
            printed += 1
            if until_done and kind in TERMINAL_KINDS:
                break
    finally:
        await sub.unsubscribe()
    return printed


# ---------------------------------------------------------------------------------------- CLI


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tandem tail`` flags to ``p``."""
    p.add_argument("--nats-url", default=None, help="NATS URL(s), comma-separated (default TANDEM_NATS_URL)")
    p.add_argument("--namespace", default=None, help="subject namespace (default TANDEM_NAMESPACE or tandem)")
    p.add_argument("--subject", default=None, help="what to follow (default <namespace>.>)")
    p.add_argument("--request", default=None, metavar="ID",
                   help="only this request's messages (a client's X-Request-Id covers all its choices)")
    p.add_argument("--model", default=None,
                   help="model whose tokenizer decodes token ids (default TANDEM_MODEL or the built-in model)")
    p.add_argument("--no-decode", dest="decode", action="store_false", help="print token ids without text")
    p.add_argument("--no-stats", action="store_true", help="hide the workers' 1 Hz load reports")
    p.add_argument("--width", type=int, default=80, help="longest quoted text per line (0 = no limit)")
    p.add_argument("--count", type=int, default=None, help="stop after N lines")
    p.add_argument("--timeout", type=float, default=None, help="stop after S seconds")
    p.add_argument("--until-done", action="store_true",
                   help="with --request: stop after the request's finish or error message")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to reach NATS (default 5)")
    p.set_defaults(func=main)
    return p


async def _run(args: argparse.Namespace) -> int:
    from tandem.local_run import CliConnectError, connect_for_cli

    namespace = args.namespace or os.environ.get("TANDEM_NAMESPACE") or "tandem"
    subject = args.subject or f"{namespace}.>"
    decode = None
    if args.decode:
        from engine.model_files import DEFAULT_MODEL
        from engine.model_text import ModelLoadError

        model = args.model or os.environ.get("TANDEM_MODEL") or DEFAULT_MODEL
        try:
            tok = load_tokenizer(model)
            decode = lambda ids: tok.decode(ids, skip_special=False)  # noqa: E731
        except (ModelLoadError, ValueError, KeyError, OSError) as e:
            print(f"warning: no tokenizer for {model!r} ({e}); token ids are shown without text", file=sys.stderr)
    try:
        nc, opts = await connect_for_cli(args.nats_url, args.connect_timeout, "tandem-tail")
    except CliConnectError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code

    def ready() -> None:
        what = f" for request {args.request}" if args.request else ""
        print(f"tandem tail: following {subject}{what} on {opts.display_servers} (Ctrl-C to stop)",
              file=sys.stderr, flush=True)

    try:
        await tail(nc, subject, Printer(decode, args.width), sys.stdout, request_id=args.request,
                   count=args.count, timeout=args.timeout, until_done=args.until_done and bool(args.request),
                   skip_kinds=frozenset({"worker_stats"}) if args.no_stats else frozenset(), ready=ready)
    finally:
        await nc.close()
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``tandem tail`` with parsed flags; Ctrl-C ends it quietly."""
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0
