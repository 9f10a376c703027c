"""Chats as tests send them: chat-template prompt ids, long prompts, a streaming chat read the way a user sees it."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from bench.cluster import MODEL

FILLER = "Tandem serves language models with prefill and decode on separate workers over a message bus. "


def chat_ids(loaded: Any, message: str) -> list[int]:
    """``message`` as one user turn through ``loaded``'s chat template, tokenized (what a worker is sent)."""
    return loaded.tokenizer.encode(loaded.chat_template.render([{"role": "user", "content": message}]))


def chat_prompt_ids(question: str) -> list[int]:
    """The default model's chat-template prompt, tokenized (tokenizer and template only)."""
    from engine.model_files import load_text

    return chat_ids(load_text(MODEL), question)


def long_prompt(i: int, repeats: int = 30) -> str:
    """A prompt long enough to be prefilled remotely, numbered so no two share a cached prefix past the filler."""
    return f"Request {i}. " + FILLER * repeats + "Summarize the text above."


async def stream_chat(client: httpx.AsyncClient, url: str, content: str, into: dict[str, Any] | None = None,
                      **body: Any) -> dict[str, Any]:
    """One streaming chat: {'status', 'text', 'finish', 'error', 'done', 'max_gap'} (an OpenAI error body for a
    non-200; ``max_gap``: the longest time, in seconds, between two of its SSE events from the first text on),
    kept up to date in ``into`` as the events arrive, where given (a test waits on the text so far)."""
    out: dict[str, Any] = {} if into is None else into
    out.update({"status": None, "text": "", "finish": None, "error": None, "done": False, "max_gap": 0.0})
    payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True,
               "temperature": 0, **body}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=payload) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            out["retry_after"] = r.headers.get("retry-after")
            return out
        last: float | None = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if last is not None:
                out["max_gap"] = max(out["max_gap"], now - last)
            if last is not None or out["text"]:
                last = now
            if line == "data: [DONE]":
                out["done"] = True
                continue
            d = json.loads(line[6:])
            if "error" in d:
                out["error"] = d["error"]
            elif d["choices"]:
                ch = d["choices"][0]
                out["text"] += ch["delta"].get("content") or ""
                out["finish"] = ch["finish_reason"] or out["finish"]
    return out


def assert_clear(results: list[dict[str, Any]]) -> None:
    """Each result completed, or ended with an OpenAI error (HTTP status, or SSE error event then [DONE])."""
    for r in results:
        if r["status"] == 200:
            assert r["done"], r
            assert r["finish"] in ("stop", "length") or (r["error"] and r["error"]["message"]), r
        else:
            assert r["status"] in (429, 503, 504) and r["error"]["message"], r
