"""Request bodies of the OpenAI API the gateway accepts, as pydantic models.

Why pydantic: FastAPI validates bodies with it and publishes the schema at
``/openapi.json``. Fields follow OpenAI's; unknown fields are ignored (as vLLM does) so
newer clients keep working. Types are strict (``"n": "2"`` or ``"max_tokens": true`` is a
400, not a guess); an integer is accepted where a number is expected. Extensions: ``target_endpoint`` (DESIGN §7), ``top_k``,
``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API allows ``null`` for optional fields: it means the default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or (k in fields and fields[k].is_required())}


class TextPart(_Body):
    """One part of a message's content; only ``text`` parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(_Body):
    """One chat message; ``content`` is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


StopField = Annotated[str | list[str] | None, Field(default=None, description="up to 16 stop strings")]


class _Common(_Body):
    """Fields shared by chat and text completions."""

    model: str
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: StopField = None
    seed: int | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    user: str | None = None
    # extensions
    target_endpoint: str | None = Field(
        default=None, description="a prefill worker to use (id or subject); also the X-Target-Endpoint header"
    )
    top_k: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # OpenAI fields this server does not implement: named, so a request using them gets a 400
    # instead of an answer that silently ignores them.
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``; ``prompt`` is text, texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


def as_stop_list(stop: str | list[str] | None) -> list[str]:
    """``stop`` as a list (a string is one stop string)."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def dump(model: BaseModel) -> dict[str, Any]:
    """A request as a plain dict (for logs)."""
    return model.model_dump(exclude_none=True)
