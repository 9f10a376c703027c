"""What vLLM and llama.cpp users expect, against a real `tandem up` (embedded NATS, one prefill_only and
one decode_only worker with the real model, the gateway) through the real `openai` client: structured
output that parses against its schema (greedy and sampled; every prompt is prefilled remotely, so the
prefill worker's first token is masked too), tool calls (forced, named, one unless parallel_tool_calls,
arguments closed to the declared properties, streamed, and a round trip with the tool's result), /tokenize and /detokenize, X-Request-Id, continuous usage stats and the model's
sampling defaults.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from bench.cluster import TandemUp
from tests.harness.cluster import tandem_up
from tests.harness.json_schemas import CITY, PERSON

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
# closed and bounded, as PERSON and CITY are: open objects let a sampled answer add properties past max_tokens
RECIPE = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "steps": {"type": "array", "items": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 9}, "text": {"type": "string", "maxLength": 60}},
        "required": ["n", "text"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}},
    "required": ["title", "steps"], "additionalProperties": False}
SCHEMAS = [(PERSON, "Describe a famous scientist as JSON."), (CITY, "Describe Paris as JSON."),
           (RECIPE, "Give me a short recipe for tea as JSON.")]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    with tandem_up(tmp_path_factory.mktemp("up"), "--served-model-name", "my-model", "--worker-args",
                   "--num-blocks 256 --local-prefill-max-tokens 0 --prefill-stall-budget-ms 0", stop_timeout=60) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(up: TandemUp) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.base_url, api_key="none", max_retries=0, timeout=300)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_parses_against_its_schema(client: openai.OpenAI, temperature: float) -> None:
    for i, (schema, question) in enumerate(SCHEMAS):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": question}], temperature=temperature, seed=i,
            max_tokens=400, response_format=schema_format(schema))  # room for every bounded answer
        assert raw.headers["x-tandem-prefill"].startswith("remote:")  # the prefill worker sampled token one
        r = raw.parse()
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_structured_output_streamed_and_on_completions(client: openai.OpenAI) -> None:
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], temperature=0.7, seed=3,
        max_tokens=250, response_format=schema_format(CITY), stream=True) if c.choices]
    jsonschema.validate(json.loads("".join(parts)), CITY)
    r = client.completions.create(model=MODEL, prompt="A famous scientist, as JSON:", max_tokens=200,
                                  temperature=0, extra_body={"response_format": schema_format(PERSON)})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give me some data."}],
                                       max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content


def test_forced_and_named_tool_calls_are_valid_calls(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        for temperature in (0.0, 1.0):
            r = client.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER, TIME],
                                               tool_choice=choice, temperature=temperature, seed=7, max_tokens=200)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c.message
            assert c.message.tool_calls and not c.message.content
            for call in c.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
                spec = WEATHER if call.function.name == "get_weather" else TIME
                jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])


def test_the_readmes_forced_weather_call_is_one_call_with_the_declared_arguments(client: openai.OpenAI) -> None:
    """The README's example (a schema that does not say additionalProperties, no max_tokens) once answered four
    identical calls with {"city": "Paris", "type": "string", "required": "city"}: now exactly one call whose
    arguments are the declared properties, the required ones present; parallel_tool_calls true allows more."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    closed = {**weather["function"]["parameters"], "additionalProperties": False}
    question = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=MODEL, tools=[weather], tool_choice=choice, messages=question)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls or []) == 1, c.message
        call = c.message.tool_calls[0]
        assert call.function.name == "get_weather" and not c.message.content
        jsonschema.validate(json.loads(call.function.arguments), closed)
    r = client.chat.completions.create(model=MODEL, tools=[weather], tool_choice="required", messages=question,
                                       parallel_tool_calls=True, max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and 1 <= len(c.message.tool_calls or []) <= 4, c.message
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), closed)


def test_tool_call_round_trip(up: TandemUp, client: openai.OpenAI) -> None:
    """Call, the tool's result as a ``tool`` message, then the model's answer using it."""
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "name": "get_weather",
                     "content": json.dumps({"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny"})})
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto",
                                            temperature=0, max_tokens=60)
    c = answer.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls") and (c.message.content or c.message.tool_calls)
    # the call and its result reached the prompt (same tools shown, so it grew by at least the result)
    result = httpx.post(f"{up.url}/tokenize", json={"prompt": messages[-1]["content"]}, timeout=30).json()
    assert answer.usage.prompt_tokens - r.usage.prompt_tokens >= result["count"]
    rendered = httpx.post(f"{up.url}/tokenize", json={"messages": messages, "tools": [WEATHER]}, timeout=30).json()
    assert rendered["count"] == answer.usage.prompt_tokens
    text = httpx.post(f"{up.url}/detokenize", json={"tokens": rendered["tokens"]}, timeout=30).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tool_response>" in text and "sunny" in text


def test_tool_calls_stream_as_deltas(client: openai.OpenAI) -> None:
    calls: dict[int, dict] = {}
    reasons, content = [], ""
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather and time in Rome, please."}],
            tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=300, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons == ["tool_calls"] and calls and not content.strip()
    for entry in calls.values():
        spec = WEATHER if entry["name"] == "get_weather" else TIME
        jsonschema.validate(json.loads(entry["arguments"]), spec["function"]["parameters"])


def test_tool_choice_auto_answers_or_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], tools=[WEATHER],
                                       tool_choice="auto", temperature=0, max_tokens=40)
    c = r.choices[0]
    assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
    assert c.message.content or c.message.tool_calls


def test_tokenize_round_trip_and_chat_count(up: TandemUp, client: openai.OpenAI) -> None:
    text = "Grüße, world: 12 + 30 = 42 🙂"
    tok = httpx.post(f"{up.url}/tokenize", json={"model": "my-model", "prompt": text, "return_token_strs": True},
                     timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] > 0
    assert httpx.post(f"{up.url}/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json() == {"prompt": text}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = httpx.post(f"{up.url}/tokenize", json={"messages": messages}, timeout=30).json()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert chat["count"] == r.usage.prompt_tokens
    bad = httpx.post(f"{up.url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_request_id_is_echoed_everywhere(up: TandemUp) -> None:
    for method, path, body in (("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi"}]}), ("POST", "/tokenize", {"prompt": "hi"}), ("GET", "/health", None),
            ("POST", "/v1/chat/completions", {"model": "nope", "messages": []}), ("GET", "/no-such-page", None)):
        r = httpx.request(method, f"{up.url}{path}", json=body, headers={"X-Request-Id": "my-id-42"}, timeout=60)
        assert r.headers["x-request-id"] == "my-id-42", (path, r.status_code)
    r = httpx.get(f"{up.url}/health", timeout=10)
    assert len(r.headers["x-request-id"]) >= 16  # made up when the client sends none


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    seen = []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}):
        assert chunk.usage is not None
        seen.append(chunk.usage.completion_tokens)
    assert seen == sorted(seen) and seen[-1] > seen[0] and seen[-1] <= 12


def test_sampling_defaults_come_from_the_model(up: TandemUp, client: openai.OpenAI) -> None:
    """The default model's card recommends temperature 0.2 and top_p 0.9; a request that sets neither gets
    them, and the README's question gets a sensible answer (not temperature 1's ramble)."""
    card = httpx.get(f"{up.url}/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == "my-model" and card["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}
    r = client.chat.completions.create(model="my-model", messages=[
        {"role": "user", "content": "What is the capital of France?"}], max_tokens=30, seed=1)
    assert "Paris" in r.choices[0].message.content
