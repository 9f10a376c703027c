"""Request bodies of the OpenAI API the gateway accepts, as pydantic models.

Why pydantic: FastAPI validates bodies with it and publishes the schema at
``/openapi.json``. Fields follow OpenAI's; unknown fields are ignored (as vLLM does) so
newer clients keep working. Types are strict (``"n": "2"`` or ``"max_tokens": true`` is a
400, not a guess); an integer is accepted where a number is expected. Extensions: ``target_endpoint``
(DESIGN §7), ``top_k``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, and
``stream_options.continuous_usage_stats`` (vLLM's).
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


class FunctionCall(_Body):
    """The function a tool call calls; ``arguments`` is JSON text."""

    name: str
    arguments: str = "{}"


class ToolCall(_Body):
    """A call an assistant message made earlier."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One chat message; ``content`` is a string or a list of text parts. An assistant message may
    carry ``tool_calls``; a ``tool`` message answers the call named by ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    """A function the model may call; ``parameters`` is a JSON Schema of its arguments."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    """``tools[i]``: only functions."""

    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: the schema the answer must match."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage; with
    ``continuous_usage_stats`` every chunk carries the usage so far (vLLM's extension)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


StopField = Annotated[str | list[str] | None, Field(default=None, description="up to 16 stop strings")]


class _Common(_Body):
    """Fields shared by chat and text completions.

    Sampling fields carry types only: their ranges are checked once, by ``engine.params.SamplingParams``
    (the same check the engine makes), and a bad one is a 400 naming the field.
    """

    model: str
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: StopField = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # extensions
    target_endpoint: str | None = Field(
        default=None, description="a prefill worker to use (id or subject); also the X-Target-Endpoint header"
    )
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # OpenAI fields this server does not implement: named, so a request using them gets a 400
    # instead of an answer that silently ignores them.
    logit_bias: dict[str, float] | None = None
    functions: list[Any] | None = None
    function_call: Any = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: true: tool_choice required may answer with several calls; otherwise one
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``; ``prompt`` is text, texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    tools: list[Tool] | None = None


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


def as_stop_list(stop: str | list[str] | None) -> list[str]:
    """``stop`` as a list (a string is one stop string)."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def dump(model: BaseModel) -> dict[str, Any]:
    """A request as a plain dict (for logs)."""
    return model.model_dump(exclude_none=True)
