"""Request preparation: an OpenAI body in, its prompts' token ids and one job per choice out.

Validation happens here, once, at the edge: the body's types (pydantic, ``gateway.protocol``), then
the model name, the features this server lacks, the messages, the context length, the grammar
(``response_format``, forced tool calls) and the sampling parameters, which are built as the one
request schema (``engine.params.SamplingParams``) and checked by its own ``validate``. A field the
request leaves out takes the model's default (its ``generation_config.json``, or what its card
recommends for a built-in alias), overridden by the gateway's ``--default-*`` flags; a request without
``max_tokens`` (or ``max_completion_tokens``) gets ``--default-max-tokens``, at most what the context leaves.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec

from engine.chat_template import ChatTemplateError
from engine.grammar import GrammarError, check_grammar
from engine.params import Grammar, SamplingParams
from gateway.errors import OpenAIError
from gateway.jobs import Job, Kind, Prepared
from gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseFormat,
    as_stop_list,
)
from gateway.service import Gateway
from gateway.tools import ToolSet, render_generic
from kv.blocks import prefix_hashes


def _unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """400 for an OpenAI feature this server does not implement, rather than silently ignoring it."""
    checks = (
        ("functions", bool(body.functions), "functions (the deprecated form of tools) are"),
        ("function_call", body.function_call not in (None, "none", "auto"),
         "function_call other than 'none' or 'auto' is (use tools and tool_choice)"),
        ("logit_bias", bool(body.logit_bias), "logit_bias is"),
    )
    for param, used, what in checks:
        if used:
            raise OpenAIError(400, f"{what} not supported by this server", param=param, code="unsupported_parameter")


def response_grammar(fmt: ResponseFormat | None) -> Grammar | None:
    """``response_format`` as a grammar (None for text); 400 for a schema that cannot compile."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar(kind="json_object")
    if fmt.json_schema is None:
        raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema",
                          param="response_format.json_schema", code="invalid_value")
    grammar = Grammar(kind="json_schema", value=json.dumps(fmt.json_schema.json_schema))
    _check(grammar, "response_format.json_schema.schema")
    return grammar


def _check(grammar: Grammar, param: str) -> None:
    try:
        check_grammar(grammar)
    except GrammarError as e:
        raise OpenAIError(400, str(e.args[0]), param=param, code="invalid_value") from e


def tool_set(body: ChatCompletionRequest) -> ToolSet | None:
    """The request's tools and choice, checked (a named function must be one of the tools)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise OpenAIError(400, "two tools have the same name", param="tools", code="invalid_value")
    name = choice if isinstance(choice, str) else choice.function.name if choice is not None else "auto"
    if not isinstance(choice, str) and choice is not None and name not in names:
        raise OpenAIError(400, f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                          param="tool_choice", code="invalid_value")
    tools = ToolSet(functions, name, body.parallel_tool_calls is True)
    grammar = tools.grammar()
    if grammar is not None:
        _check(grammar, "tools")
    return tools


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as plain dicts (text parts joined), with their tool calls and tool results."""
    out = []
    for i, m in enumerate(body.messages):
        out.append({"role": "system" if m.role == "developer" else m.role, "content": _content(i, m)})
        if m.name is not None:
            out[-1]["name"] = m.name
        if m.tool_calls:
            out[-1]["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.role == "tool":
            out[-1]["tool_call_id"] = m.tool_call_id or ""
    return out


def _content(i: int, m: ChatMessage) -> str:
    if m.content is None:
        if m.role != "assistant":
            raise OpenAIError(400, f"messages[{i}].content is required", param=f"messages[{i}].content")
        return ""
    if isinstance(m.content, str):
        return m.content
    if not m.content:
        raise OpenAIError(400, f"messages[{i}].content is an empty list", param=f"messages[{i}].content")
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise OpenAIError(400, f"messages[{i}].content[{j}]: only text parts are supported (got {part.type!r})",
                              param=f"messages[{i}].content[{j}].type", code="unsupported_content")
        parts.append(part.text)
    return "\n".join(parts)


def _native(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools itself: call arguments as objects, as HF templates expect."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def render_chat(gw: Gateway, messages: list[dict[str, Any]], tools: ToolSet | None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text: through the template's own ``tools`` support when it has it, else the generic format."""
    try:
        if gw.native_tools:
            extra = {"tools": [{"type": "function", "function": f} for f in tools.functions]} \
                if tools is not None and tools.active else {}
            return gw.text.chat_template.render(_native(messages), add_generation_prompt, **extra)
        return gw.text.chat_template.render(render_generic(messages, tools), add_generation_prompt)
    except ChatTemplateError as e:
        raise OpenAIError(400, str(e), param="messages", code="invalid_messages") from e


async def _in_thread_if_long(gw: Gateway, size: int, fn: Any, *args: Any) -> Any:
    if size > gw.config.tokenize_in_thread_chars:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def prepare_chat(gw: Gateway, body: ChatCompletionRequest, target: str | None, timeout: float) -> Prepared:
    """Validate a chat request, render the template, tokenize, build its jobs."""
    gw.check_model(body.model)
    _unsupported(body)
    tools = tool_set(body)
    grammar = tools.grammar() if tools is not None else None
    if grammar is not None and body.response_format is not None and body.response_format.type != "text":
        raise OpenAIError(400, "response_format cannot be combined with a forced tool_choice", param="response_format",
                          code="invalid_value")
    grammar = grammar or response_grammar(body.response_format)
    messages = chat_messages(body)
    size = sum(len(m["content"]) for m in messages)

    def encode() -> tuple[list[int], str]:
        text = render_chat(gw, messages, tools)
        return gw.text.tokenizer.encode_prompt(text), text

    ids, text = await _in_thread_if_long(gw, size, encode)
    max_tokens = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    return _prepare(gw, "chat", body, [ids], [text], max_tokens, param, "messages", bool(body.logprobs),
                    body.top_logprobs or 0, grammar, echo=False, target=target, timeout=timeout, tools=tools)


async def prepare_completion(gw: Gateway, body: CompletionRequest, target: str | None, timeout: float) -> Prepared:
    """Validate a text completion request, tokenize its prompt(s), build its jobs."""
    gw.check_model(body.model)
    _unsupported(body)
    if body.suffix:
        raise OpenAIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise OpenAIError(400, "best_of other than n is not supported", param="best_of", code="unsupported_parameter")
    grammar = response_grammar(body.response_format)
    raw = body.prompt
    tok = gw.text.tokenizer
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise OpenAIError(400, "prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in raw):
        raw = [raw]  # type: ignore[list-item]
    gw.check_job_count(len(raw), body.n)  # before tokenizing what would be refused anyway
    texts_in = [p for p in raw if isinstance(p, str)]
    encoded = iter(await _in_thread_if_long(gw, sum(map(len, texts_in)), lambda: [tok.encode_prompt(p) for p in texts_in]))
    prompts: list[list[int]] = []
    texts: list[str] = []
    for p in raw:
        if isinstance(p, str):
            prompts.append(next(encoded))
            texts.append(p)
        else:
            ids = list(p)  # type: ignore[arg-type]
            bad = [t for t in ids if not 0 <= t < gw.text.vocab_size]
            if bad:
                raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
            prompts.append(ids)
            texts.append(tok.decode(ids, skip_special=False) if body.echo else "")
    lp = body.logprobs
    return _prepare(gw, "completion", body, prompts, texts, body.max_tokens, "max_tokens", "prompt", lp is not None,
                    lp or 0, grammar, echo=body.echo, target=target, timeout=timeout)


def sampling_params(gw: Gateway, body: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                    logprobs: bool, top_logprobs: int, grammar: Grammar | None) -> SamplingParams:
    """The one request schema from the body: a field left out takes the model's (or the flags') default."""
    given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty",
                                           "frequency_penalty", "presence_penalty")}
    chosen = {k: v if v is not None else gw.sampling_defaults.get(k) for k, v in given.items()}
    return SamplingParams(
        max_tokens=max_tokens, seed=body.seed, stop=as_stop_list(body.stop),
        stop_token_ids=list(body.stop_token_ids or []), logprobs=logprobs, top_logprobs=top_logprobs,
        ignore_eos=body.ignore_eos, grammar=grammar, **{k: v for k, v in chosen.items() if v is not None},
    )


def _prepare(
    gw: Gateway,
    kind: Kind,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    texts: list[str],
    max_tokens: int | None,
    max_tokens_param: str,
    prompt_param: str,
    logprobs: bool,
    top_logprobs: int,
    grammar: Grammar | None,
    *,
    echo: bool,
    target: str | None,
    timeout: float,
    tools: ToolSet | None = None,
) -> Prepared:
    n = body.n
    gw.check_job_count(len(prompts), n)
    if body.seed is not None and not -(2**63) <= body.seed <= 2**63 - n:
        raise OpenAIError(400, f"seed must fit in a signed 64-bit integer (choice i uses seed + i, n={n})",
                          param="seed", code="invalid_value")
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(400, f"{max_tokens_param} must be at least 1", param=max_tokens_param, code="invalid_value")
    limit = gw.text.max_position
    jobs: list[Job] = []
    for pi, ids in enumerate(prompts):
        if not ids:
            raise OpenAIError(400, "prompt is empty", param=prompt_param)
        # no max_tokens: the gateway's --default-max-tokens, cut to what the context leaves (0: all of it)
        room = limit - len(ids)
        cap = gw.config.default_max_tokens
        want = max_tokens if max_tokens is not None else min(room, cap) if cap else room
        if len(ids) >= limit or want < 1 or len(ids) + want > limit:
            what = f" + {max_tokens_param} ({want})" if max_tokens is not None else ""
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max(want, 0)} tokens: prompt ({len(ids)} tokens){what}.",
                param=max_tokens_param if max_tokens is not None and len(ids) < limit else prompt_param,
                code="context_length_exceeded",
            )
        params = sampling_params(gw, body, want, logprobs, top_logprobs, grammar)
        try:
            params.validate()
        except ValueError as e:
            message, field = (e.args + (None,))[:2]
            param = "logprobs" if kind == "completion" and field == "top_logprobs" else field
            raise OpenAIError(400, str(message).replace(str(field), str(param), 1), param=param,
                              code="invalid_value") from e
        hashes = prefix_hashes(ids, gw.config.block_size)
        for i in range(n):
            sampling = params if body.seed is None else _with_seed(params, body.seed + i)
            jobs.append(Job(len(jobs), pi, ids, hashes, sampling))
    opts = body.stream_options
    if opts is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    include_usage = bool(opts and opts.include_usage)
    return Prepared(kind, body.model, prompts, texts, jobs, body.stream, include_usage,
                    include_usage and bool(opts and opts.continuous_usage_stats), logprobs, top_logprobs, echo,
                    target, timeout, tools)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return msgspec.structs.replace(params, seed=seed)
