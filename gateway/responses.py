"""OpenAI responses: the JSON bodies, the server-sent-event chunks and the one SSE serializer.

Why one module: a chat completion, a text completion, their chunks, logprobs in both shapes, tool calls
(parsed from the text, or streamed as ``tool_calls`` deltas) and the usage object are what a client's
parser reads; they must agree with each other and with OpenAI's, so they are written in one place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from gateway.jobs import Event, Job, Prepared
from gateway.run import Run
from gateway.textmodel import TokenBytes
from gateway.tools import CallStream, parse_calls

DONE = "data: [DONE]\n\n"
_json = msgspec.json.Encoder().encode


def sse(obj: Any) -> str:
    """One server-sent event holding ``obj`` as JSON (compact, UTF-8: what ``json.dumps`` wrote, ~5x faster)."""
    return f"data: {_json(obj).decode()}\n\n"


# ---- logprobs ---------------------------------------------------------------------------


def chat_logprobs(token_bytes: TokenBytes, ids: Sequence[int], lps: Sequence[float],
                  tops: Sequence[Sequence[tuple[int, float]]]) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for k, (tid, lp) in enumerate(zip(ids, lps)):
        text, raw = token_bytes(tid)
        top = []
        for t, tl in (tops[k] if k < len(tops) else []):
            ttext, traw = token_bytes(t)
            top.append({"token": ttext, "logprob": tl, "bytes": traw})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(token_bytes: TokenBytes, ids: Sequence[int], lps: Sequence[float],
                        tops: Sequence[Sequence[tuple[int, float]]], offset: int, with_top: bool) -> dict[str, Any]:
    """Legacy ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets, top_out = [], [], []
    pos = offset
    for k, tid in enumerate(ids):
        text, _ = token_bytes(tid)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if with_top:
            top_out.append({token_bytes(t)[0]: tl for t, tl in (tops[k] if k < len(tops) else [])})
    return {
        "tokens": tokens,
        "token_logprobs": list(lps[: len(ids)]),
        "top_logprobs": top_out if with_top else None,
        "text_offset": offsets,
    }


def finish_reason(job: Job, calls: int) -> str | None:
    """``tool_calls`` when the answer ended in calls, else the worker's reason."""
    return "tool_calls" if calls and job.finish_reason == "stop" else job.finish_reason


# ---- whole bodies -----------------------------------------------------------------------


def usage(prep: Prepared, jobs: Sequence[Job]) -> dict[str, Any]:
    """OpenAI ``usage``: prompts counted once each, completions summed over choices."""
    prompt = sum(len(p) for p in prep.prompts)
    completion = 0
    cached: dict[int, int] = {}
    for j in jobs:
        completion += j.usage.completion_tokens if j.usage and j.usage.completion_tokens else len(j.token_ids)
        if j.usage:
            cached[j.prompt_index] = max(cached.get(j.prompt_index, 0), j.usage.cached_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        # tandem's extension: where each choice ran (the page shows it under each answer)
        "tandem": {"choices": [_where(j) for j in jobs]},
    }


def _where(job: Job) -> dict[str, Any]:
    mode, _, worker = job.prefill.partition(":")
    return {"index": job.index, "decode_worker": job.decode_worker or job.worker_id, "prefill": mode or None,
            "prefill_worker": worker or None, "prefill_reason": job.prefill_reason or None,
            "kv_bytes": job.kv_bytes, "kv_transfer": job.kv_transfer or None,
            "ttft_s": None if job.first_token_s is None else round(job.first_token_s, 4)}


def chat_body(token_bytes: TokenBytes, run: Run, rid: str) -> dict[str, Any]:
    """``chat.completion``: one message per choice, tool calls parsed out of its text."""
    prep = run.prep
    choices = []
    for j in run.jobs:
        lp = None
        if prep.logprobs:
            lp = chat_logprobs(token_bytes, j.token_ids[: len(j.logprobs)], j.logprobs, j.top_logprobs)
        message: dict[str, Any] = {"role": "assistant", "content": j.text, "refusal": None}
        calls: list[dict[str, Any]] = []
        if prep.parses_tool_calls:
            message["content"], calls = parse_calls(j.text)
            if calls:
                message["tool_calls"] = calls
        choices.append({"index": j.index, "message": message, "logprobs": lp, "finish_reason": finish_reason(j, len(calls))})
    return _body(run, rid, "chat.completion", choices)


def completion_body(token_bytes: TokenBytes, run: Run, rid: str) -> dict[str, Any]:
    """``text_completion``: one text per choice (after the prompt with ``echo``)."""
    prep = run.prep
    choices = []
    for j in run.jobs:
        prefix = prep.prompt_texts[j.prompt_index] if prep.echo else ""
        lp = None
        if prep.logprobs:
            lp = completion_logprobs(token_bytes, j.token_ids[: len(j.logprobs)], j.logprobs, j.top_logprobs,
                                     len(prefix), prep.top_logprobs > 0)
        choices.append({"index": j.index, "text": prefix + j.text, "logprobs": lp, "finish_reason": j.finish_reason})
    return _body(run, rid, "text_completion", choices)


def _body(run: Run, rid: str, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": run.prep.model, "choices": choices,
            "usage": usage(run.prep, run.jobs), "system_fingerprint": None}


# ---- streaming --------------------------------------------------------------------------


class StreamFormatter:
    """The SSE chunks of one streamed run: opening chunks, one or more per event, the usage chunk."""

    def __init__(self, token_bytes: TokenBytes, run: Run, rid: str) -> None:
        self.token_bytes = token_bytes
        self.run = run
        self.prep: Prepared = run.prep
        self.rid = rid
        self.created = int(time.time())
        self.chat = self.prep.kind == "chat"
        self.calls = {j.index: CallStream() for j in run.jobs} if self.prep.parses_tool_calls else {}

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        obj: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.prep.model,
            "choices": choices,
        }
        if self.prep.continuous_usage:
            obj["usage"] = usage(self.run.prep, self.run.jobs)
        elif self.prep.include_usage:
            obj["usage"] = None
        return sse(obj)

    def opening(self) -> list[str]:
        """The assistant role (chat) or the echoed prompt (completions) of every choice."""
        out = []
        for j in self.run.jobs:
            if self.chat:
                out.append(self._chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]))
            elif self.prep.echo:
                out.append(self._chunk([{"index": j.index, "text": self.prep.prompt_texts[j.prompt_index],
                                         "logprobs": None, "finish_reason": None}]))
        return out

    def render(self, ev: Event) -> list[str]:
        """The chunks of one event (none for an event with nothing to show)."""
        j = ev.job
        lp = self._logprobs(ev) if ev.kind == "tokens" else None
        if not self.chat:
            if ev.kind == "tokens" and not ev.text and lp is None:
                return []
            reason = j.finish_reason if ev.kind == "finish" else None
            return [self._chunk([{"index": j.index, "text": ev.text, "logprobs": lp, "finish_reason": reason}])]
        text, calls = ev.text, []
        stream = self.calls.get(j.index)
        if stream is not None:
            text, calls = stream.feed(ev.text)
            if ev.kind == "finish":
                text += stream.finish()
        out = []
        if text or lp is not None:
            out.append(self._chunk([{"index": j.index, "delta": {"content": text}, "logprobs": lp,
                                     "finish_reason": None}]))
        first = stream.calls - len(calls) if stream is not None else 0  # the index of this event's first call
        for n, call in enumerate(calls):
            out.append(self._chunk([{"index": j.index, "delta": {"tool_calls": [{"index": first + n, **call}]},
                                     "logprobs": None, "finish_reason": None}]))
        if ev.kind == "finish":
            reason = finish_reason(j, stream.calls if stream is not None else 0)
            out.append(self._chunk([{"index": j.index, "delta": {}, "logprobs": None, "finish_reason": reason}]))
        return out

    def _logprobs(self, ev: Event) -> dict[str, Any] | None:
        if not (self.prep.logprobs and ev.logprobs is not None):
            return None
        if self.chat:
            return chat_logprobs(self.token_bytes, ev.token_ids, ev.logprobs, ev.top_logprobs or [])
        offset = len(self.prep.prompt_texts[ev.job.prompt_index]) if self.prep.echo else 0
        return completion_logprobs(self.token_bytes, ev.token_ids, ev.logprobs, ev.top_logprobs or [],
                                   offset + len(ev.job.text) - len(ev.text), self.prep.top_logprobs > 0)

    def closing(self) -> list[str]:
        """The usage chunk (with ``stream_options.include_usage``), then ``[DONE]``."""
        out = []
        if self.prep.include_usage:
            obj = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.prep.model, "choices": [],
                   "usage": usage(self.run.prep, self.run.jobs)}
            out.append(sse(obj))
        out.append(DONE)
        return out
