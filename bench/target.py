"""The server ``tandem bench`` measures: its base URL, its model, and what it says it is.

Why ask: a result is only comparable when it names what was measured — tandem, llama.cpp's
``llama-server`` or vLLM, which model, how many slots. ``/v1/models`` is common to all of
them; ``llama-server`` also answers ``/props`` (slots, context, build) and vLLM ``/version``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


class TargetError(RuntimeError):
    """The server cannot be reached or does not speak the OpenAI API (the message says which)."""


def normalize_base_url(url: str) -> str:
    """``http://h:8000``, ``http://h:8000/`` or ``http://h:8000/v1`` → ``http://h:8000/v1``."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {url!r}: expected http://host:port[/v1]")
    return url if url.endswith("/v1") else f"{url}/v1"


@dataclass(frozen=True)
class Target:
    """Where requests go, and the headers they carry."""

    base_url: str  # ends with /v1
    model: str
    api_key: str = ""

    @property
    def root(self) -> str:
        """The server root (``/props``, ``/version`` live there)."""
        return self.base_url[: -len("/v1")]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


_PROPS_KEYS = ("total_slots", "n_ctx", "model_path", "build_info", "chat_template_caps")


async def identify(client: httpx.AsyncClient, base_url: str, api_key: str = "") -> dict[str, Any]:
    """``{"base_url", "kind", "models", "owned_by", "props", "version", "server_header"}``.

    ``kind`` is ``tandem``, ``llama.cpp``, ``vllm`` or ``unknown``. Raises TargetError when
    ``/v1/models`` does not answer with a model list.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = await client.get(f"{base_url}/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as e:
        raise TargetError(f"cannot reach {base_url}/models: {type(e).__name__}: {e}".rstrip(": ")) from None
    if r.status_code != 200:
        raise TargetError(f"{base_url}/models answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        data = r.json()["data"]
        models = [str(m["id"]) for m in data]
        owned_by = sorted({str(m.get("owned_by", "")) for m in data} - {""})
    except (ValueError, KeyError, TypeError):
        raise TargetError(f"{base_url}/models is not an OpenAI model list: {r.text[:200]}") from None
    root = base_url[: -len("/v1")]
    props = await _optional_json(client, f"{root}/props", headers)
    version = await _optional_json(client, f"{root}/version", headers)
    if "tandem" in owned_by:
        kind = "tandem"
    elif props and ("total_slots" in props or "default_generation_settings" in props):
        kind = "llama.cpp"
    elif "vllm" in owned_by or (version and "version" in version and not props):
        kind = "vllm"
    else:
        kind = "unknown"
    return {
        "base_url": base_url,
        "kind": kind,
        "models": models,
        "owned_by": owned_by,
        "props": {k: props[k] for k in _PROPS_KEYS if k in props} if props else None,
        "version": version.get("version") if version else None,
        "server_header": r.headers.get("server", ""),
    }


async def _optional_json(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    """The JSON object at ``url``, or None when the server has no such endpoint."""
    try:
        r = await client.get(url, headers=headers, timeout=5.0)
        body = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None
