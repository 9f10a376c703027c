"""Tool calling: tool definitions into the prompt, the grammar of a forced call, calls out of the text.

One format on the way out, whatever the template: the model writes each call as a block

    <tool_call>
    {"name": "<function>", "arguments": {...}}
    </tool_call>

(the Hermes format, which Qwen's and other templates with tool support teach their models). A template
that takes a ``tools`` variable renders the definitions, the assistant's earlier ``tool_calls`` and the
``tool`` results itself. For a template without tool support (the default model's), this module renders
them in a generic format, as llama.cpp's server does for such templates: the definitions and the
instructions above go into the system message, earlier calls become the blocks above in the assistant's
text, and each tool result becomes a user message holding ``<tool_response>{"name", "content"}</tool_response>``.

``tool_choice``: ``none`` leaves the tools out of the prompt (no call can come); ``auto`` lets the model
choose, and blocks in its answer become ``tool_calls``; ``required`` and a named function constrain the
answer with a grammar (``engine.grammar``) to exactly one block (``required`` with ``parallel_tool_calls:
true``: up to :data:`MAX_PARALLEL_CALLS`) whose arguments match the function's parameters schema, closed
(:func:`closed_schema`: only the declared properties, unless the schema itself allows more), so even a small
model's call is well-formed and carries no invented keys.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from engine.chat_template import ChatTemplate
from engine.params import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 4
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
#: JSON inside the forced blocks is compact, as json.dumps(separators=(",", ":")) writes it
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def template_takes_tools(template: ChatTemplate) -> bool:
    """Whether the template renders a ``tools`` variable itself."""
    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template.source))
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in names


#: keywords whose subschemas describe other values than the object itself (items, property values, definitions)
_ONE = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames", "unevaluatedItems")
_LIST = ("prefixItems",)
_MAP = ("properties", "patternProperties", "$defs", "definitions")
#: keywords that test the same object with other subschemas: beside them an object's own properties are not
#: all it may have (allOf's parts add properties; if/then/else, not, $ref test them)
_SAME_OBJECT = ("allOf", "not", "if", "then", "else", "$ref", "dependentSchemas")
_EITHER = ("anyOf", "oneOf")  # alternatives: each a whole schema of the object, unless properties sit beside them


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object that declares ``properties`` closed to others (``additionalProperties:
    false``), where those properties are all the object may have: not where it says itself what else it allows,
    nor where allOf, if/then/else, not, $ref or alternatives beside its properties describe the same object (that
    would forbid what they add). Without it a grammar lets a call carry keys the function does not take (a small
    model copies the schema's own ``type`` and ``required`` into its arguments)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed_schema(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in out[key].items()}
    own = isinstance(out.get("properties"), dict)
    for key in _EITHER:
        if isinstance(out.get(key), list) and not own:
            out[key] = [closed_schema(s) for s in out[key]]
    composed = any(k in out for k in (*_SAME_OBJECT, *_EITHER))
    if own and not composed and not any(
            k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


@dataclass
class ToolSet:
    """The request's tools and choice, as the prompt, the grammar and the parser need them."""

    functions: list[dict[str, Any]]  # {"name", "description", "parameters"}
    choice: str  # none | auto | required | the name of the one function to call
    parallel: bool = False  # required: up to MAX_PARALLEL_CALLS calls (the request's parallel_tool_calls: true)

    @property
    def active(self) -> bool:
        """Whether the answer may hold calls (and is parsed for them)."""
        return bool(self.functions) and self.choice != "none"

    def grammar(self) -> Grammar | None:
        """The grammar of a forced answer (``required`` or a named function); None for auto/none."""
        if self.choice in ("none", "auto"):
            return None
        chosen = [f for f in self.functions if self.choice in ("required", f["name"])]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": closed_schema(f.get("parameters") or {"type": "object"})},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
        schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
        schema = {**schema, "x-guidance": _COMPACT}
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if self.parallel and self.choice == "required" else ""
        lark = (f"start: call{more}\n"
                f'call: "{OPEN}\\n" %json{json.dumps(schema)} "\\n{CLOSE}"\n')
        return Grammar(kind="lark", value=lark)

    def system_text(self) -> str:
        """The generic format's instructions (for templates without tool support)."""
        defs = json.dumps([{k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None}
                           for f in self.functions], ensure_ascii=False)
        must = {"auto": "Call a function only when it helps to answer.",
                "required": "You must call at least one function." if self.parallel else
                "You must call one function."}.get(self.choice, f"Call the function {self.choice}.")
        return (f"You can call functions. Their definitions, as JSON:\n{defs}\n"
                f"To call a function, answer with one block per call and nothing else:\n"
                f'{OPEN}\n{{"name": "<function name>", "arguments": {{<the arguments as JSON>}}}}\n{CLOSE}\n'
                f"A function's result comes back to you in a <tool_response> block. {must}")


def render_generic(messages: list[dict[str, Any]], tools: ToolSet | None) -> list[dict[str, Any]]:
    """OpenAI messages (with ``tool_calls`` and ``tool`` results) as plain-text messages for a template
    without tool support; the tool definitions join the system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [f"{OPEN}\n{json.dumps(call_body(c), ensure_ascii=False)}\n{CLOSE}" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            result = {"name": m.get("name") or "", "content": content}
            out.append({"role": "user",
                        "content": f"<tool_response>\n{json.dumps(result, ensure_ascii=False)}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools is not None and tools.active:
        text = tools.system_text()
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def call_body(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (``function.arguments`` a JSON string) as the block's ``{"name", "arguments"}``."""
    fn = call.get("function") or {}
    args = fn.get("arguments") or "{}"
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        parsed = args
    return {"name": fn.get("name", ""), "arguments": parsed}


def _as_call(block: str) -> dict[str, Any] | None:
    """One block's JSON as an OpenAI tool call, or None when it is not a call."""
    try:
        body = json.loads(block)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = body.get("arguments", body.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": body["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def parse_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the call blocks, or None when nothing is left; the calls)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        call = _as_call(match.group(1))
        if call is None:
            continue  # not a call: it stays text
        kept.append(text[pos:match.start()])
        calls.append(call)
        pos = match.end()
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class CallStream:
    """Streaming: text in, (text safe to show, calls completed) out.

    Text that may be the start of a ``<tool_call>`` is held back until it is not; a block is held
    until it closes and then comes out as one call (name and whole arguments in one delta)."""

    def __init__(self) -> None:
        self.pending = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.pending += text
        shown: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.pending, OPEN)
                shown.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            end = self.pending.find(CLOSE, start)
            if end < 0:
                shown.append(self.pending[:start])
                self.pending = self.pending[start:]
                break
            call = _as_call(self.pending[start + len(OPEN):end].strip())
            block_end = end + len(CLOSE)
            if call is None:
                shown.append(self.pending[:block_end])
            else:
                shown.append(self.pending[:start])
                calls.append(call)
            self.pending = self.pending[block_end:]
        self.calls += len(calls)
        text_out = "".join(shown)
        if self.calls and not text_out.strip():
            text_out = ""  # the newlines between calls are not content
        return text_out, calls

    def finish(self) -> str:
        """What is left at the end (an unclosed block is text)."""
        rest, self.pending = self.pending, ""
        return "" if self.calls and not rest.strip() else rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
