"""The load itself: streaming requests, timed per chunk, sent closed-loop or at a Poisson rate.

Each request streams (``stream_options.include_usage`` and ``ignore_eos``, which tandem,
llama-server and vLLM all accept) and records when every content chunk arrived and how many
tokens it carried: counted with the model's tokenizer where there is one, once the stream has
ended (a chunk of *k* tokens later counts as *k* gaps), else one per chunk. The output token count comes from the
stream's usage when the server sends one, else from the chunks (``usage_source``).

Arrivals follow ``vllm bench serve``: gaps drawn from a gamma distribution with shape
``burstiness`` and mean ``1/rate`` (burstiness 1 is a Poisson process, lower is burstier);
``rate=inf`` sends everything at once. Closed-loop ``concurrency`` keeps that many requests in
flight. Every request has a deadline, so a stuck server ends as ``timeout`` errors, not a hang.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import msgspec

from bench.datasets import Prompt
from bench.target import Target


class Dataset(Protocol):
    def get(self, index: int) -> Prompt: ...


@dataclass
class RequestRecord:
    """What one request did, in seconds (``start`` from the run's start, the rest from its own send)."""

    index: int
    kind: str
    start: float
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_source: str = "counted"  # "server" when the stream carried usage
    ttft: float | None = None
    e2e: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in it)
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def gaps(self) -> list[float]:
        """Inter-token gaps in seconds (see :func:`chunk_gaps`)."""
        return [g for _, g in chunk_gaps(self.chunks)]

    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None with one token or none."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def chunk_gaps(chunks: list[tuple[float, int]] | list[list[float]]) -> list[tuple[float, float]]:
    """(arrival, gap) of each inter-token gap: a chunk of k tokens after a gap g counts as k gaps of g/k.

    The first chunk's extra tokens arrived with the first token and count as no gap.
    """
    out: list[tuple[float, float]] = []
    for (t0, _), (t1, k) in zip(chunks, chunks[1:]):
        k = max(1, int(k))
        out += [(t1, (t1 - t0) / k)] * k
    return out


@dataclass(frozen=True)
class Options:
    """How each request is sent."""

    temperature: float = 0.0
    timeout: float = 600.0  # seconds for the whole request
    count_tokens: Callable[[str], int] | None = None  # tokens in a chunk's text; None: one per chunk


def request_body(target: Target, prompt: Prompt, opts: Options) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streaming request."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": prompt.max_tokens, "temperature": opts.temperature,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if prompt.messages is not None:
        return "/chat/completions", {**body, "messages": prompt.messages}
    return "/completions", {**body, "prompt": prompt.text}


def _error_of(status: int, text: str) -> tuple[str, str]:
    """(kind, message) of an HTTP error answer: ``http_503:worker_lost`` when the OpenAI error has a code."""
    try:
        err = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    code = err.get("code") if isinstance(err, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    return f"http_{status}" + (f":{code}" if code else ""), str(message or text)[:300]


async def send(client: httpx.AsyncClient, target: Target, prompt: Prompt, index: int, run_start: float,
               opts: Options) -> RequestRecord:
    """Send one streaming request and time it; every failure becomes ``error_kind`` (never raised)."""
    rec = RequestRecord(index, prompt.kind, time.perf_counter() - run_start, prompt_tokens=prompt.input_tokens)
    path, body = request_body(target, prompt, opts)
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, target, path, body, t0, rec, opts), opts.timeout)
    except asyncio.TimeoutError:
        rec.error_kind, rec.error = "timeout", f"no complete answer within {opts.timeout:g}s"
    except httpx.TimeoutException as e:
        rec.error_kind, rec.error = "timeout", f"{type(e).__name__}: {e}"
    except httpx.ConnectError as e:
        rec.error_kind, rec.error = "connect", str(e)
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        rec.error_kind, rec.error = "disconnected", f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:
        rec.error_kind, rec.error = "http", f"{type(e).__name__}: {e}"
    rec.e2e = time.perf_counter() - t0
    if rec.ok and not rec.chunks:
        rec.error_kind, rec.error = "empty", "the stream ended without a token"
    return rec


async def _stream(client: httpx.AsyncClient, target: Target, path: str, body: dict[str, Any], t0: float,
                  rec: RequestRecord, opts: Options) -> None:
    """Read the SSE stream, noting when each content chunk arrived; its tokens are counted once it has ended,
    so the tokenizer's CPU is not taken from a server that shares the machine while it streams."""
    arrivals: list[tuple[float, str]] = []
    try:
        done = await _read_events(client, target, path, body, t0, rec, arrivals)
    finally:
        if arrivals:
            rec.ttft = arrivals[0][0]
        count = opts.count_tokens
        rec.chunks = [(at, max(1, count(text)) if count else 1) for at, text in arrivals]
    if rec.ok and not done:
        rec.error_kind, rec.error = "incomplete", "the stream ended without data: [DONE]"
    elif rec.ok and rec.usage_source != "server":
        rec.output_tokens = sum(k for _, k in rec.chunks)


async def _read_events(client: httpx.AsyncClient, target: Target, path: str, body: dict[str, Any], t0: float,
                       rec: RequestRecord, arrivals: list[tuple[float, str]]) -> bool:
    """Each content chunk's arrival and text into `arrivals`, usage and errors into `rec`; True at ``[DONE]``."""
    async with client.stream("POST", target.base_url + path, json=body, headers=target.headers()) as r:
        if r.status_code != 200:
            rec.error_kind, rec.error = _error_of(r.status_code, (await r.aread()).decode("utf-8", "replace"))
            return False
        async with aclosing(_sse_data(r)) as events:
            async for data in events:
                if data == b"[DONE]":
                    return True
                try:
                    event = _decode_event(data)
                except msgspec.DecodeError:
                    rec.error_kind, rec.error = "bad_event", f"not JSON: {data[:200].decode('utf-8', 'replace')}"
                    return False
                if event.get("error"):
                    err = event["error"]
                    code = err.get("code") if isinstance(err, dict) else None
                    rec.error_kind = "stream_error" + (f":{code}" if code else "")
                    rec.error = str(err.get("message") if isinstance(err, dict) else err)[:300]
                    return False
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    rec.output_tokens = int(usage["completion_tokens"])
                    rec.usage_source = "server"
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = int(usage["prompt_tokens"])
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
                    if text:
                        arrivals.append((time.perf_counter() - t0, text))
    return False


_decode_event = msgspec.json.Decoder(dict).decode


async def _sse_data(r: httpx.Response) -> AsyncIterator[bytes]:
    """The payload of each ``data:`` line of a server-sent event stream, as it arrives (comments and blank
    separators skipped)."""
    pending = b""
    async for chunk in r.aiter_bytes():
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


def arrival_gaps(rate: float, burstiness: float, rng: random.Random) -> Callable[[], float]:
    """Seconds until the next arrival: gamma(shape=burstiness, mean=1/rate); 0 for an infinite rate."""
    if math.isinf(rate):
        return lambda: 0.0
    scale = 1.0 / (rate * burstiness)
    return lambda: rng.gammavariate(burstiness, scale)


@dataclass(frozen=True)
class Load:
    """Closed-loop ``concurrency``, or open-loop ``rate`` (requests/s) with ``burstiness``."""

    concurrency: int | None = None
    rate: float | None = None
    burstiness: float = 1.0

    def describe(self) -> dict[str, Any]:
        if self.rate is not None:
            return {"mode": "rate", "rate": None if math.isinf(self.rate) else self.rate,
                    "burstiness": self.burstiness}
        return {"mode": "concurrency", "concurrency": self.concurrency}

    def label(self) -> str:
        if self.rate is not None:
            return f"rate {self.rate:g}/s" + (f", burstiness {self.burstiness:g}" if self.burstiness != 1 else "")
        return f"concurrency {self.concurrency}"


@dataclass(frozen=True)
class Stop:
    """End after ``requests`` requests were sent, or after sending for ``duration`` seconds."""

    requests: int | None = None
    duration: float | None = None

    def more(self, sent: int, elapsed: float) -> bool:
        if self.requests is not None:
            return sent < self.requests
        assert self.duration is not None
        return elapsed < self.duration


class Progress(Protocol):
    def sent(self) -> None: ...

    def finished(self, record: RequestRecord) -> None: ...


@dataclass
class RunOutcome:
    """Every request of one load level, and how long the level took (first send to last answer)."""

    records: list[RequestRecord]
    duration: float


async def run_level(target: Target, dataset: Dataset, load: Load, stop: Stop, opts: Options, progress: Progress,
                    first_index: int = 0, seed: int = 0,
                    transport: httpx.AsyncBaseTransport | None = None) -> RunOutcome:
    """Send the load of one level and wait for every answer (each bounded by ``opts.timeout``)."""
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=load.concurrency, max_keepalive_connections=load.concurrency)
    timeout = httpx.Timeout(opts.timeout, connect=30.0)
    builder = ThreadPoolExecutor(1, thread_name_prefix="prompts")  # tokenizing stays off the event loop
    loop = asyncio.get_running_loop()

    async def prompt(i: int) -> Prompt:
        return await loop.run_in_executor(builder, dataset.get, first_index + i)

    async def one(client: httpx.AsyncClient, i: int, p: Prompt, start: float) -> None:
        progress.sent()
        rec = await send(client, target, p, first_index + i, start, opts)
        records.append(rec)
        progress.finished(rec)

    try:
        async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:
            start = time.perf_counter()
            if load.rate is None:
                counter = iter(range(1 << 62))

                async def slot() -> None:
                    while True:
                        i = next(counter)
                        if not stop.more(i, time.perf_counter() - start):
                            return
                        await one(client, i, await prompt(i), start)

                await asyncio.gather(*(slot() for _ in range(load.concurrency or 1)))
            else:
                gap = arrival_gaps(load.rate, load.burstiness, random.Random(f"{seed}:arrivals:{first_index}"))
                tasks: list[asyncio.Task[None]] = []
                at = 0.0
                i = 0
                while stop.more(i, at):
                    p = await prompt(i)
                    delay = start + at - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(one(client, i, p, start)))
                    i += 1
                    at += gap()
                await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    finally:
        builder.shutdown(wait=False, cancel_futures=True)
    records.sort(key=lambda r: r.index)
    return RunOutcome(records, duration)
