"""gateway/tools.py: the generic tool format, the forced-call grammar and the call parser (unit tests, the
grammars against the real tokenizer; the real model's calls are tested in tests/test_api_cluster.py)."""

from __future__ import annotations

import json

import pytest

from engine.chat_template import CHATML, ChatTemplate
from engine.grammar import GrammarCompiler, check_grammar
from gateway.tools import (
    CallStream,
    ToolSet,
    closed_schema,
    parse_calls,
    render_generic,
    template_takes_tools,
)

WEATHER = {"name": "get_weather", "description": "weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_parse_calls_takes_blocks_out_of_the_text() -> None:
    content, calls = parse_calls(f"Let me look.\n{CALL}\n")
    assert content == "Let me look."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")
    assert parse_calls("no calls here") == ("no calls here", [])
    assert parse_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_calls(f"{CALL}\n{CALL}")[0] is None and len(parse_calls(f"{CALL}\n{CALL}")[1]) == 2


@pytest.mark.parametrize("cut", [1, 3, 7, 11, 20])
def test_call_stream_holds_back_what_may_be_a_call(cut: int) -> None:
    text = f"Sure. {CALL}\n{CALL}"
    stream = CallStream()
    shown, calls = "", []
    for i in range(0, len(text), cut):
        part, got = stream.feed(text[i:i + cut])
        assert "<" not in part or not part.rstrip().endswith("<")  # no half-marker leaks
        shown += part
        calls += got
    shown += stream.finish()
    assert shown.strip() == "Sure." and [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    plain = CallStream()
    assert plain.feed("a <b> c <tool") == ("a <b> c ", []) and plain.finish() == "<tool"


def test_forced_grammars_compile_and_accept_only_calls(smollm) -> None:
    tok = smollm.tokenizer
    compiler = GrammarCompiler(tok.tok.to_str(), smollm.config.vocab_size, sorted(tok.eog_ids))
    good = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    for choice, text, ok in (("required", good, True), ("get_time", good, False), ("get_weather", good, True),
                             ("required", "Hello", False)):
        grammar = ToolSet([WEATHER, TIME], choice).grammar()
        check_grammar(grammar)
        state = compiler.compile(grammar)
        assert state.accept_all(tok.encode(text)) is ok, (choice, text)
    assert ToolSet([WEATHER], "auto").grammar() is None and ToolSet([WEATHER], "none").grammar() is None


def test_forced_calls_are_one_call_with_only_the_declared_arguments(smollm) -> None:
    """The README's weather tool under tool_choice required once gave four identical calls whose arguments held
    the schema's own keys ({"city": "Paris", "type": "string", "required": "city"}): a forced answer is one call
    (several only with parallel_tool_calls true), and its arguments have the declared properties only, the
    required ones present."""
    tok = smollm.tokenizer
    compiler = GrammarCompiler(tok.tok.to_str(), smollm.config.vocab_size, sorted(tok.eog_ids))

    def block(args: str) -> str:
        return f'<tool_call>\n{{"name":"get_weather","arguments":{args}}}\n</tool_call>'

    def accepts(tools: ToolSet, text: str) -> tuple[bool, bool]:
        """(the grammar accepts ``text``, and nothing but the end may follow it)."""
        state = compiler.compile(tools.grammar())
        ok = state.accept_all(tok.encode(text))
        return ok, ok and state.finished

    one = block('{"city":"Paris"}')
    for choice in ("required", "get_weather"):
        for parallel in (False, True):
            tools = ToolSet([WEATHER, TIME], choice, parallel)
            assert accepts(tools, block('{"city":"Paris","type":"string"}'))[0] is False  # an invented key
            assert accepts(tools, block('{"city":"Paris","required":"city"}'))[0] is False
            assert accepts(tools, block("{}"))[0] is False  # the required city is missing
        assert accepts(ToolSet([WEATHER], choice), one) == (True, True)  # one call, and that is the end
        assert accepts(ToolSet([WEATHER], choice), f"{one}\n{one}")[0] is False
    assert accepts(ToolSet([WEATHER], "required", parallel=True), f"{one}\n{one}")[0] is True
    assert accepts(ToolSet([WEATHER], "get_weather", parallel=True), f"{one}\n{one}")[0] is False  # named: one
    # a schema that allows more keeps allowing them
    open_weather = {**WEATHER, "parameters": {**WEATHER["parameters"], "additionalProperties": True}}
    assert accepts(ToolSet([open_weather], "required"), block('{"city":"Paris","unit":"C"}'))[0] is True


def test_closed_schema_closes_declared_objects_only() -> None:
    schema = {"type": "object", "properties": {
        "where": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object"},
        "loose": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        "either": {"anyOf": [{"type": "object", "properties": {"x": {"type": "number"}}}, {"type": "string"}]}},
        "required": ["where"]}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False and closed["required"] == ["where"]
    props = closed["properties"]
    assert props["where"]["additionalProperties"] is False and props["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["extra"]  # a free-form object stays free
    assert props["loose"]["additionalProperties"] is True
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and props["either"]["anyOf"][1] == {
        "type": "string"}
    assert "additionalProperties" not in schema  # the request's own schema is left as it was


def test_closed_schema_leaves_composed_objects_open() -> None:
    """Where allOf, alternatives or if/not beside `properties` describe the same object, closing it would forbid
    what they add: such a schema keeps every object an instance could satisfy before."""
    import jsonschema

    mixed = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}},
             "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                       {"properties": {"y": {"type": "string"}}, "required": ["y"]}]}
    parts = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                       {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    for schema, instance in ((mixed, {"kind": "a", "x": 1}), (parts, {"a": 1, "b": 2})):
        jsonschema.validate(instance, closed_schema(schema))
    assert closed_schema(mixed) == mixed and closed_schema(parts) == parts


def test_generic_rendering_of_tools_calls_and_results() -> None:
    tools = ToolSet([WEATHER], "auto")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C, sunny"}]
    out = render_generic(messages, tools)
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": CALL.replace('"city": "Paris"', '"city": "Paris"')}
    assert out[3]["role"] == "user" and json.loads(out[3]["content"].split("\n")[1]) == {
        "name": "get_weather", "content": "21 C, sunny"}
    assert render_generic(messages[:1], ToolSet([WEATHER], "none")) == messages[:1]  # none: no tools shown
    with_system = render_generic([{"role": "system", "content": "Be brief."}, messages[0]], tools)
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 2
    prompt = ChatTemplate(CHATML).render(out)
    assert "<|im_start|>user\n<tool_response>" in prompt


def test_which_templates_take_tools() -> None:
    assert not template_takes_tools(ChatTemplate(CHATML))
    native = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert template_takes_tools(ChatTemplate(native))
