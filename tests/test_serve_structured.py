"""Structured output and tool calling through the OpenAI API, on a real local Ray Serve instance (CPU, a tiny random
model whose chat template declares tools in the Hermes format), with the official `openai` SDK and LangChain's
ChatOpenAI; and the tool-call parsers on their own."""
import json
import re

import httpx
import jsonschema
import langchain_openai
import openai
import pydantic
import pytest

from serve_app.local import local_service
from serve_app.tools import HERMES, LLAMA3_JSON, ToolStream, declares_tools, family_of, parse
from shadowkv_core.tiny_model import CHAT_TEMPLATE, build_tiny_model
from support.serve import assert_engine_drains

APP = "structured"
MODEL = "tiny-tools"
HERMES_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>You may call these tools:{% for t in tools %} {{ t | tojson }}{% endfor %}"
    ' as <tool_call>{"name": ..., "arguments": ...}</tool_call><|end|>{% endif %}'
    "{% for m in messages %}{% if m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>{% endfor %}<|end|>'
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "maximum": 14}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("models") / MODEL, seed=3)
    config = json.loads((path / "tokenizer_config.json").read_text())
    if (path / "chat_template.jinja").exists():
        (path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    else:
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    args = {"model": str(path), "served_model_name": MODEL, "max_num_seqs": 4, "max_model_len": 1024,
            "engine": {"gpu_cache_gib": 0.05, "host_cache_gib": 0.05}}
    with local_service(args, APP) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


# ---- structured output ----------------------------------------------------------------------------------------
def test_completion_guided_json_stream_and_not(client):
    kw = dict(model=MODEL, prompt="A trip: ", max_tokens=120, seed=1, extra_body={"guided_json": SCHEMA})
    whole = client.completions.create(**kw)
    jsonschema.validate(json.loads(whole.choices[0].text), SCHEMA)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_chat_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=120, response_format=fmt, seed=2)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=120, response_format=fmt, seed=2,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == out.choices[0].message.content
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":  # any object: a random model may write one past max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.startswith("{")


def test_sdk_parse_with_a_pydantic_model(client):
    class Trip(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)
        days: int = pydantic.Field(le=14)

    out = client.chat.completions.parse(model=MODEL, messages=USER, max_tokens=120, response_format=Trip, seed=4)
    assert isinstance(out.choices[0].message.parsed, Trip)


@pytest.mark.parametrize("body", [{"guided_choice": ["sunny", "rainy", "foggy"]},
                                  {"structured_outputs": {"choice": ["sunny", "rainy", "foggy"]}}])
def test_choice(client, body):
    for seed in range(3):
        out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=10, seed=seed, extra_body=body)
        assert out.choices[0].message.content in ("sunny", "rainy", "foggy")


@pytest.mark.parametrize("body, pattern", [
    ({"guided_regex": r"[A-Z]{2}-[0-9]{3}"}, r"[A-Z]{2}-[0-9]{3}"),
    ({"structured_outputs": {"regex": r"(yes|no), [0-9]+"}}, r"(yes|no), [0-9]+"),
    ({"guided_grammar": 'root ::= "go " [a-c] [a-c]'}, r"go [a-c][a-c]"),
    ({"structured_outputs": {"grammar": 'start: "id=" /[0-9]{4}/'}}, r"id=[0-9]{4}"),
    ({"structured_outputs": {"json": SCHEMA}}, r"\{.*\}")])
def test_regex_and_grammar(client, body, pattern):
    out = client.completions.create(model=MODEL, prompt="code:", max_tokens=60, seed=5, extra_body=body)
    assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "guided_regex": "a("}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/completions", {"prompt": "x", "tools": [WEATHER]}, "tools"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "tool_choice": "required",
                              "guided_regex": "a"}, "guided_regex"),
    ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
])
def test_refusals_name_the_field(url, client, path, body, param):
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and error["message"].startswith(param), error


# ---- tool calling ---------------------------------------------------------------------------------------------
def _check_call(call, tools: dict):
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"])


@pytest.mark.parametrize("choice, names", [("required", {"get_weather", "get_time"}),
                                           ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})])
def test_forced_tool_call(client, choice, names):
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for seed in range(2):
        out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=300, seed=seed,
                                             tools=[WEATHER, TIME], tool_choice=choice)
        choice0 = out.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
        assert [c.function.name in names for c in choice0.message.tool_calls] == [True]
        _check_call(choice0.message.tool_calls[0], tools)


def test_forced_tool_call_streams_as_openai_deltas(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=300, seed=9, tools=[WEATHER], tool_choice="required")
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)


def test_auto_and_a_conversation_with_tool_results(client):
    """tool_choice auto (the default with tools) answers in content or calls; a conversation holding an assistant's
    call and the tool's result is accepted."""
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, tools=[WEATHER], seed=1)
    message = out.choices[0].message
    assert (message.tool_calls is None) == (out.choices[0].finish_reason != "tool_calls")
    assert message.content is not None or message.tool_calls
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, tools=[WEATHER],
                                         tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"
    assert_engine_drains(APP, within_s=5.0)


# ---- LangChain ------------------------------------------------------------------------------------------------
class Trip(pydantic.BaseModel):
    """A trip."""

    city: str = pydantic.Field(max_length=8)
    days: int = pydantic.Field(le=14)


def _chat_openai(url: str, **kw):
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                       max_tokens=300, **kw)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(url, method):
    """ChatOpenAI.with_structured_output: json_schema sends response_format, function_calling a forced tool call."""
    structured = _chat_openai(url, seed=11).with_structured_output(Trip, method=method, strict=True)
    assert isinstance(structured.invoke("Plan a trip"), Trip)
    assert all(isinstance(t, Trip) for t in structured.batch(["Plan a trip", "Another one"]))


def test_langchain_bind_tools_invoke_and_stream(url):
    class get_weather(pydantic.BaseModel):  # noqa: N801 (the tool's name)
        """The weather in a city over some days."""

        city: str = pydantic.Field(max_length=8)
        days: int = pydantic.Field(le=14)

    llm = _chat_openai(url, seed=12).bind_tools([get_weather], tool_choice="get_weather", strict=True)
    call = llm.invoke("Weather in Paris?").tool_calls[0]
    assert call["name"] == "get_weather" and get_weather(**call["args"])
    merged = None
    for chunk in llm.stream("Weather in Paris?"):
        merged = chunk if merged is None else merged + chunk
    streamed = merged.tool_calls[0]
    assert streamed["name"] == "get_weather" and get_weather(**streamed["args"])
    assert merged.response_metadata["finish_reason"] == "tool_calls"


# ---- the parsers ----------------------------------------------------------------------------------------------
HERMES_OUT = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
              '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
LLAMA_OUT = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
             '{"name": "get_time", "parameters": {"zone": "UTC"}}')
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("family, text, content", [(HERMES, HERMES_OUT, "Let me look."), (LLAMA3_JSON, LLAMA_OUT, None)])
def test_parsers_whole_and_streamed_agree(family, text, content):
    got_content, calls = parse(family, text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    for step in (1, 3, 7):  # any split of the text into deltas
        stream = ToolStream(family)
        deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i:i + step])] + stream.finish()
        streamed_content = "".join(d.get("content") or "" for d in deltas)
        assert streamed_content.strip() == (content or "")
        names = [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d and
                 d["tool_calls"][0].get("id")]
        args = {}
        for d in deltas:
            for call in d.get("tool_calls", ()):
                args[call["index"]] = args.get(call["index"], "") + call["function"]["arguments"]
        assert list(zip(names, [json.loads(args[i]) for i in sorted(args)])) == CALLS


@pytest.mark.parametrize("family, text", [(HERMES, "no call here, <tool_ but not one"), (HERMES, "<tool_call>{bad"),
                                          (LLAMA3_JSON, "Plain answer {with braces}"), (LLAMA3_JSON, "{not json")])
def test_text_that_is_not_a_call_stays_content(family, text):
    assert parse(family, text) == (text, [])
    stream = ToolStream(family)
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    assert "".join(d["content"] for d in deltas) == text and all("tool_calls" not in d for d in deltas)


def test_template_families():
    assert not declares_tools(CHAT_TEMPLATE)
    assert declares_tools(HERMES_TEMPLATE) and family_of(HERMES_TEMPLATE) == HERMES
    assert family_of("{% for t in tools %}<|python_tag|>{% endfor %}") == LLAMA3_JSON
