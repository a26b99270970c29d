"""serve_app's plain-Python parts, without Ray: schemas, errors, SSE, footprint, capacity board, admission gate,
metrics, autoscaling arithmetic."""
import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from serve_app.admission import ENDED_KEPT_S, AdmissionGate, CapacityBoard, affinity_keys
from serve_app.autoscaling import desired_replicas
from serve_app.engine_replica import EngineReplica, engine_footprint
from serve_app.errors import OpenAIError, context_length_exceeded, install_error_handlers, over_capacity
from serve_app.ingress import Ingress
from serve_app.limits import RequestLimits
from serve_app.logprobs import LogprobFormatter
from serve_app.metrics import ServiceMetrics
from serve_app.prepare import logprobs_of, prepare
from serve_app.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from serve_app.router import MemoryAwareRouter
from serve_app.security import OPEN_PATHS, GuardSettings, RequestGuard
from serve_app.streaming import SSE_DONE, ChunkFormatter, collect, merge, sse_stream
from serve_app.tools import HERMES
from shadowkv_core import EngineConfig, LLMEngine, ShadowKVConfig
from shadowkv_core.engine.sequence import TokenLogprob
from shadowkv_core.engine.tensor_parallel import TensorParallelEngine
from shadowkv_core.tiny_model import build_tiny_model

GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


def _report(free_gpu, free_host=0, slots=4, ids=(), total_gpu=4 * GIB, total_host=0):
    return {"free_gpu_bytes": free_gpu, "free_host_bytes": free_host, "free_slots": slots, "request_ids": list(ids),
            "gpu_bytes_total": total_gpu, "host_bytes_total": total_host}


def _count_sleeps(monkeypatch) -> list[float]:
    """Every asyncio.sleep from now on (the gate's only way to wait for room), by its delay."""
    sleeps, real = [], asyncio.sleep

    async def sleep(delay, *args, **kwargs):
        sleeps.append(delay)
        return await real(delay, *args, **kwargs)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    return sleeps


def _events(texts, prompt_tokens=3, cached_tokens=0):
    async def gen():
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            yield {"text": text, "num_new_tokens": 1, "finished": last, "finish_reason": "length" if last else None,
                   "prompt_tokens": prompt_tokens, "completion_tokens": i + 1, "cached_tokens": cached_tokens}
    return gen()


async def _drain(agen):
    return [x async for x in agen]


def test_request_schemas_refuse_what_they_cannot_honour():
    assert CompletionRequest(model="m", prompt="hi").prompt == ["hi"]
    for bad in ({"n": 17}, {"n": 0}, {"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"stop": ["x"] * 5},
                {"stop": [""]}, {"prompt": ""}, {"logprobs": 21}, {"logprobs": True}, {"best_of": 3, "stream": True},
                {"n": 2, "best_of": 1}, {"prompt_logprobs": 1, "stream": True}, {"top_logprobs": 2},
                {"presence_penalty": 2.5}, {"min_p": 2}, {"logit_bias": {"5": 101}}, {"min_tokens": -1},
                {"tools": [{"type": "function"}]}):
        with pytest.raises(ValidationError):
            CompletionRequest(**{"model": "m", "prompt": "hi", **bad})
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[])
    chat = [{"role": "user", "content": "x"}]
    for bad in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": 2}, {"best_of": 2}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            ChatCompletionRequest(model="m", messages=chat, **bad)
    assert CompletionRequest(model="m", prompt="hi", stop="x").stop == ["x"]
    assert CompletionRequest(model="m", prompt="hi", logprobs=None, best_of=1, presence_penalty=0, user="u")


@pytest.fixture(scope="module")
def schema_api():
    """The request schemas behind FastAPI with the service's error handlers, without Ray."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    def completions(request: CompletionRequest):
        return request.model_dump()

    @app.post("/v1/chat/completions")
    def chat(request: ChatCompletionRequest):
        return request.model_dump()

    return TestClient(app)


@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_takes_openais_four_shapes(schema_api, prompt, prompts):
    r = schema_api.post("/v1/completions", json={"model": "m", "prompt": prompt})
    assert r.status_code == 200 and r.json()["prompt"] == prompts


def test_chat_content_takes_text_parts_joined(schema_api):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    r = schema_api.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200 and r.json()["messages"][0]["content"] == "hello\nworld"


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": [[1], "a"]}, "prompt", "list of token-id lists"),
    ("/v1/completions", {"prompt": [[]]}, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": [3, -1]}, "prompt", ">= 0"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop", "valid string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "'image_url'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content", "text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                                           {"role": "user"}]}, "messages.2.content", "required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": ""}}},
     "tool_choice.function.name", "must not be empty"),
])
def test_malformed_shapes_get_a_short_message_naming_the_field(schema_api, path, body, param, words):
    r = schema_api.post(path, json={"model": "m", **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"], error
    assert error["message"].startswith(f"{param}: ") and "function-after" not in error["message"]
    assert "Value error" not in error["message"]


@pytest.mark.parametrize("path, body, name", [
    (path, body, name) for path, body, schema in [
        ("/v1/completions", {"prompt": "x"}, CompletionRequest),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, ChatCompletionRequest)]
    for name in sorted(UNSUPPORTED) if name not in schema.model_fields])
def test_every_field_not_implemented_is_refused_by_name(schema_api, path, body, name):
    r = schema_api.post(path, json={"model": "m", **body, name: {"asked": True}})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == name and error["message"].startswith(f"{name}: "), error
    neutral = schema_api.post(path, json={"model": "m", **body, name: UNSUPPORTED[name][-1]})
    assert neutral.status_code == 200, neutral.text


def test_error_bodies_have_openai_shape():
    err = context_length_exceeded(100, 50, 128)
    assert err.status == 400 and set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert err.body()["error"]["code"] == "context_length_exceeded"
    busy = over_capacity(0.2)
    assert busy.status == 429 and busy.type == "rate_limit_error" and busy.headers["Retry-After"] == "1"


def test_sse_stream_chunks_usage_and_done():
    fmt = ChunkFormatter("chat", "chatcmpl-1", "m")
    lines = asyncio.run(_drain(sse_stream(_events(["a", "b"]), fmt, include_usage=True)))
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    assert lines[-1] == SSE_DONE
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "ab"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_sse_stream_continuous_usage_counts_every_event(kind):
    """With continuous usage every chunk carries the usage so far, and an event of tokens without text (part of a
    UTF-8 character) gets its chunk; without it, only the usage chunk has usage, and that event sends nothing."""
    def chunks(fmt):
        lines = asyncio.run(_drain(sse_stream(_events(["a", "", "b"], cached_tokens=2), fmt, include_usage=True)))
        return [json.loads(line[6:]) for line in lines[:-1]]
    continuous = chunks(ChunkFormatter(kind, "x", "m", usage_prompt_tokens=3))
    opening = [0] if kind == "chat" else []
    assert [c["usage"]["completion_tokens"] for c in continuous] == [*opening, 1, 2, 3, 3]
    assert {c["usage"]["prompt_tokens"] for c in continuous} == {3}
    plain = chunks(ChunkFormatter(kind, "x", "m"))
    assert [c["usage"] for c in plain[:-1]] == [None] * (len(opening) + 2)
    assert plain[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                  "prompt_tokens_details": {"cached_tokens": 2}}


def test_sse_data_lines_survive_line_splitting_on_unicode_breaks():
    """Generated text may hold U+0085, U+2028 or U+2029, which JSON leaves raw and str.splitlines (as httpx's
    aiter_lines) breaks lines at: each event is still one line, and its text comes back whole."""
    text = "a\x85b\u2028c\u2029d\ne\x0b"
    lines = asyncio.run(_drain(sse_stream(_events([text]), ChunkFormatter("completion", "c", "m"), False)))
    data = [line for line in "".join(lines).splitlines() if line]
    assert data[-1] == SSE_DONE.strip() and all(line.startswith("data: ") for line in data)
    assert json.loads(data[0][6:])["choices"][0]["text"] == text


def test_sse_stream_sends_an_error_event_then_done():
    async def failing():
        yield {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}, "status": 500}
    lines = asyncio.run(_drain(sse_stream(failing(), ChunkFormatter("completion", "c", "m"), False)))
    assert json.loads(lines[0][6:])["error"]["message"] == "boom" and lines[-1] == SSE_DONE


def test_an_error_closes_every_merged_choice_at_once():
    """A choice's error ends the response: the other choices' streams (their engine requests) close with it, streamed
    or not, not when the garbage collector gets to them."""
    closed = []

    async def choice(events):
        try:
            for event in events:
                yield event
                await asyncio.sleep(0)
        finally:
            closed.append(True)

    async def merged():
        error = {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}, "status": 500}
        streams = [choice([error]), choice([{"text": "x"}] * 100)]
        return merge([await anext(stream) for stream in streams], streams)

    async def streamed():
        lines = await _drain(sse_stream(await merged(), ChunkFormatter("completion", "c", "m"), False, 2))
        return lines, len(closed)

    lines, closed_then = asyncio.run(streamed())
    assert json.loads(lines[0][6:])["error"]["message"] == "boom" and closed_then == 2

    async def whole():
        with pytest.raises(OpenAIError):
            await collect(await merged(), "completion", "c", "m", 2)
        return len(closed)

    closed.clear()
    assert asyncio.run(whole()) == 2


def test_held_back_tool_text_still_carries_the_usage_so_far():
    """With continuous usage, an event whose text a tool-call stream holds back (it may open a call) still sends a
    chunk: the usage counts its tokens when they come."""
    fmt = ChunkFormatter("chat", "x", "m", usage_prompt_tokens=3, tool_family=HERMES)
    held = json.loads(fmt.delta("<tool", None, 2)[6:])
    assert held["usage"]["completion_tokens"] == 2 and held["choices"][0]["delta"].get("content") is None


def _two_choices(prompt_tokens=(3, 3)):
    """Two choices' events merged, their first events already read (as the ingress does)."""
    streams = [_events(["a", "b", "c"], prompt_tokens[0]), _events(["x"], prompt_tokens[1])]

    async def start():
        return [await anext(stream) for stream in streams]

    return lambda: merge_after(start, streams)


async def merge_after(start, streams):
    async for event in merge(await start(), streams):
        yield event


def test_merge_tags_each_choices_events_and_closes_every_stream_on_exit():
    events = asyncio.run(_drain(_two_choices()()))
    assert sorted((e["index"], e["text"]) for e in events) == [(0, "a"), (0, "b"), (0, "c"), (1, "x")]
    closed = []

    def stream(name):
        async def gen():
            try:
                for _ in range(100):
                    yield {"text": name}
                    await asyncio.sleep(0)
            finally:
                closed.append(name)
        return gen()

    async def first_then_stop():
        streams = [stream("p"), stream("q")]
        merged = merge([await anext(s) for s in streams], streams)
        await anext(merged)
        await merged.aclose()

    asyncio.run(first_then_stop())
    assert sorted(closed) == ["p", "q"]


def test_several_choices_collect_and_stream_with_one_usage():
    body = asyncio.run(collect(_two_choices((4, 6))(), "completion", "c", "m", num_choices=2, n=1))
    assert [(c.index, c.text) for c in body.choices] == [(0, "abc"), (1, "x")]
    assert (body.usage.prompt_tokens, body.usage.completion_tokens) == (10, 4)
    same_prompt = asyncio.run(collect(_two_choices((5, 5))(), "chat", "c", "m", num_choices=2, n=2))
    assert same_prompt.usage.prompt_tokens == 5 and [c.message.content for c in same_prompt.choices] == ["abc", "x"]
    lines = asyncio.run(_drain(sse_stream(_two_choices()(), ChunkFormatter("chat", "c", "m"), True, 2, 2)))
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]  # each choice's role chunk
    assert [c for c in chunks if c["usage"]] == [chunks[-1]] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert lines[-1] == SSE_DONE


LETTERS = SimpleNamespace(decode=lambda ids: "".join(chr(ord("a") + i) for i in ids))  # id i is the i-th letter


def _lp(token, logprob):
    """A token's logprobs with the top 3 ids: 0, 1, 2 at -0.5, -1.5, -2.5."""
    return TokenLogprob(logprob, 1 if token == 0 else 2, ((0, -0.5), (1, -1.5), (2, -2.5)))


def _scored(tokens_per_event, cumulative, prompt=(3, 4)):
    """One choice's events: each brings its token ids with their logprobs; the prompt's logprobs come first."""
    async def gen():
        total = 0
        for i, tokens in enumerate(tokens_per_event):
            last = i == len(tokens_per_event) - 1
            total += len(tokens)
            event = {"text": LETTERS.decode(tokens), "num_new_tokens": len(tokens), "finished": last,
                     "finish_reason": "length" if last else None, "prompt_tokens": len(prompt),
                     "completion_tokens": total, "cached_tokens": 0, "token_ids": tokens,
                     "logprobs": [_lp(t, -1.0) for t in tokens],
                     "cumulative_logprob": cumulative}
            if i == 0:
                event.update(prompt_token_ids=list(prompt), prompt_logprobs=[None, _lp(4, -3.0)])
            yield event
    return gen()


def test_completion_and_chat_logprobs_in_openais_shapes():
    request = CompletionRequest(model="m", prompt="x", logprobs=2, prompt_logprobs=1)
    body = asyncio.run(collect(_scored([[2], [0, 5]], -3.0), "completion", "c", "m",
                               logprobs=LogprobFormatter(LETTERS, request)))
    logprobs = body.choices[0].logprobs
    assert logprobs.tokens == ["c", "a", "f"] and logprobs.text_offset == [0, 1, 2]
    assert logprobs.token_logprobs == [-1.0, -1.0, -1.0]
    # the top 2, and the sampled token beside them when it is not one of them
    assert logprobs.top_logprobs == [{"a": -0.5, "b": -1.5, "c": -1.0}, {"a": -0.5, "b": -1.5},
                                     {"a": -0.5, "b": -1.5, "f": -1.0}]
    assert body.model_dump()["choices"][0]["prompt_logprobs"] == [
        None, {0: {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
               4: {"logprob": -3.0, "rank": 2, "decoded_token": "e"}}]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                 top_logprobs=1)
    body = asyncio.run(collect(_scored([[2]], -1.0), "chat", "c", "m", logprobs=LogprobFormatter(LETTERS, chat)))
    assert body.model_dump()["choices"][0]["logprobs"] == {"content": [
        {"token": "c", "logprob": -1.0, "bytes": [99], "top_logprobs": [{"token": "a", "logprob": -0.5,
                                                                         "bytes": [97]}]}]}
    assert body.prompt_logprobs is None
    plain = asyncio.run(collect(_scored([[2]], -1.0), "chat", "c", "m",
                                logprobs=LogprobFormatter(LETTERS, ChatCompletionRequest(model="m", messages=chat.messages))))
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_each_streamed_chunk_carries_its_tokens_logprobs(kind):
    request = CompletionRequest(model="m", prompt="x", logprobs=1, stream=True) if kind == "completion" else \
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=1,
                              stream=True)
    events = _scored([[2], [0, 5], [1]], -4.0)

    async def with_a_silent_event():
        async for event in events:
            yield {**event, "text": ""} if event["token_ids"] == [0, 5] else event  # text held back: no text yet
    fmt = ChunkFormatter(kind, "c", "m", logprobs=LogprobFormatter(LETTERS, request))
    lines = asyncio.run(_drain(sse_stream(with_a_silent_event(), fmt, include_usage=False)))
    chunks = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
    if kind == "chat":
        tokens = [[t["token"] for t in c["logprobs"]["content"]] for c in chunks[1:]]
        assert tokens == [["c"], ["a", "f"], ["b"]]
        assert chunks[2]["logprobs"]["content"][1]["top_logprobs"] == [{"token": "a", "logprob": -0.5,
                                                                        "bytes": [97]}]
    else:
        assert [c["logprobs"]["tokens"] for c in chunks] == [["c"], ["a", "f"], ["b"]]
        assert [c["logprobs"]["text_offset"] for c in chunks] == [[0], [1, 2], [3]]  # counting on across chunks


def test_best_of_returns_the_n_candidates_of_highest_cumulative_logprob_and_counts_their_usage():
    async def candidates():
        streams = [_scored([[1]], -5.0), _scored([[3]], -2.0), _scored([[2, 2]], -1.0)]
        async for event in merge([await anext(s) for s in streams], streams):
            yield event
    body = asyncio.run(collect(candidates(), "completion", "c", "m", num_choices=3, n=2, candidates=3,
                               logprobs=LogprobFormatter(LETTERS, CompletionRequest(model="m", prompt="x", n=2,
                                                                                   best_of=3))))
    assert [(c.index, c.text) for c in body.choices] == [(0, "cc"), (1, "d")]  # -1 then -2; -5 left out
    assert body.choices[0].logprobs is None  # best_of ranks by logprobs the request did not ask to see
    assert (body.usage.prompt_tokens, body.usage.completion_tokens) == (2, 3)


def test_prepare_hashes_each_prompt_once_for_its_affinity_keys(monkeypatch):
    """Two prompts of two full blocks, n=3: one hashing per prompt, shared by that prompt's three choices."""
    hashed = []

    def counted(token_ids, block_size):
        hashed.append(list(token_ids))
        return affinity_keys(token_ids, block_size)
    monkeypatch.setattr("serve_app.prepare.affinity_keys", counted)
    first, second = list(range(32)), list(range(100, 132))
    choices = prepare(None, CompletionRequest(model="m", prompt=[first, second], max_tokens=2, n=3), 64, 8, 16)
    assert hashed == [first, second]
    assert [c.affinity for c in choices] == [affinity_keys(first, 16)] * 3 + [affinity_keys(second, 16)] * 3
    assert len(choices[0].affinity) == 2 and choices[0].affinity != choices[3].affinity

def test_prepare_asks_the_engine_for_what_logprobs_best_of_and_echo_need():
    tokenizer = None  # prompts of token ids
    ids = [5, 6, 7]
    plain, = prepare(tokenizer, CompletionRequest(model="m", prompt=[ids], max_tokens=2), 64, 8, 16)
    assert (plain.params.logprobs, plain.params.prompt_logprobs) == (None, None)
    best = prepare(tokenizer, CompletionRequest(model="m", prompt=[ids], max_tokens=2, n=2, best_of=3), 64, 8, 16)
    assert len(best) == 3 and {p.params.logprobs for p in best} == {0}
    echo, = prepare(LETTERS, CompletionRequest(model="m", prompt=[ids], max_tokens=2, echo=True, logprobs=3), 64, 8, 16)
    assert (echo.params.logprobs, echo.params.prompt_logprobs) == (3, 3)
    first = {"text": "i", "token_ids": [8], "logprobs": [_lp(8, -1.0)], "prompt_logprobs": [None, _lp(6, -2.0),
                                                                                              _lp(7, -2.0)]}
    echoed = echo.echoed(first)
    assert echoed["text"] == "fghi" and echoed["token_ids"] == ids + [8]
    assert echoed["logprobs"][0] is None and len(echoed["logprobs"]) == 4
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert logprobs_of(chat) == (0, None)
    assert logprobs_of(chat.model_copy(update={"top_logprobs": 4})) == (4, None)


def test_collect_builds_one_body_with_usage():
    body = asyncio.run(collect(_events(["x", "y", "z"]), "completion", "cmpl-1", "m"))
    assert body.choices[0].text == "xyz" and body.usage.completion_tokens == 3 and body.usage.prompt_tokens == 3


@pytest.mark.parametrize("shadowkv", [None, ShadowKVConfig(rank=16, sparse_budget=64, outlier_chunks=2,
                                                           min_context=256, decode_window=64)])
def test_footprint_is_exactly_what_the_engine_reserves(tiny_model, shadowkv):
    engine = LLMEngine(EngineConfig(model=tiny_model, shadowkv=shadowkv, max_model_len=4096, gpu_cache_gib=0.02,
                                    host_cache_gib=0.02))
    footprint = engine_footprint(engine)
    for prompt_len in (1, 15, 16, 17, 255, 256, 1000, 3000):
        for max_tokens in (1, 16, 100):
            assert footprint.predict(prompt_len, max_tokens) == engine.footprint(prompt_len, max_tokens)


def test_replica_health_asks_the_engine_whatever_its_kind(tiny_model):
    """A replica is unhealthy when its engine says so, through the one check every engine has."""
    replica = object.__new__(EngineReplica.func_or_class)
    replica._loop_task = replica._step_started = None
    replica.engine = LLMEngine(EngineConfig(model=tiny_model, gpu_cache_gib=0.02, host_cache_gib=0.02))
    replica.check_health()
    broken = object.__new__(TensorParallelEngine)  # rank 0 of a group whose rank 1 has gone
    broken.error = "shadowkv-tp-rank1 exited"
    replica.engine = broken
    with pytest.raises(RuntimeError, match="a tensor-parallel rank failed: shadowkv-tp-rank1 exited"):
        replica.check_health()

    class LostDevice:  # any other engine
        def check_health(self):
            raise RuntimeError("device lost")
    replica.engine = LostDevice()
    with pytest.raises(RuntimeError, match="device lost"):
        replica.check_health()

def test_board_places_best_fit_and_tracks_reservations_between_reports():
    board = CapacityBoard()
    board.update({"big": _report(4 * GIB), "small": _report(1 * GIB)})
    assert board.place("r1", GIB // 2, 0) == "small"  # least left over
    assert board.place("r2", GIB // 2, 0) == "small"
    assert board.place("r3", GIB // 2, 0) == "big"  # small is full by reservations
    board.update({"big": _report(4 * GIB), "small": _report(0, ids=["r1", "r2"])})  # report now counts r1, r2
    assert board.num_reserved() == 1 and board.placement("r3") == "big"
    board.release("r3")
    assert board.num_reserved() == 0 and board.place("r4", 5 * GIB, 0) is None
    assert not board.fits_when_idle(5 * GIB, 0) and board.fits_when_idle(GIB, 0)


def test_board_credits_a_finished_request_until_the_report_catches_up():
    board = CapacityBoard()
    board.update({"a": _report(GIB, slots=1)})
    assert board.place("r1", GIB, 0) == "a"
    board.update({"a": _report(0, slots=0, ids=["r1"])})
    assert board.place("r2", GIB, 0) is None and board.placement("r1") == "a"
    board.release("r1")  # ended; the replica's report still lists it
    assert board.place("r2", GIB, 0) == "a"
    board.update({"a": _report(0, slots=0, ids=["r2"])})  # r1 gone from the report, r2 now counted
    assert board.place("r3", 1, 0) is None


def test_board_credits_a_request_that_ended_before_any_report_listed_it():
    board = CapacityBoard()
    board.update({"a": _report(GIB, slots=1)})
    assert board.place("r1", GIB, 0) == "a"
    board.release("r1")  # ended within one report period: never counted
    board.update({"a": _report(0, slots=0, ids=["r1"])})  # a report taken while it was held arrives after its end
    assert board.place("r2", GIB, 0) == "a"  # its slot and bytes are free all the same
    board.update({"a": _report(0, slots=0, ids=["r2"])})
    assert board.place("r3", 1, 0) is None


def test_affinity_keys_are_the_chained_hashes_of_the_first_power_of_two_blocks_deepest_first():
    conversation = list(range(100))  # six full blocks of 16
    keys = affinity_keys(conversation, 16)
    assert len(keys) == 3  # 4, 2 and 1 blocks
    assert affinity_keys(conversation[:64], 16) == keys  # its first four blocks: the same prefix
    assert affinity_keys(conversation[:15], 16) == ()  # no full block: no affinity
    other = affinity_keys(list(range(40)) + [7] * 60, 16)  # shares two blocks, differs in the third
    assert other[1:] == keys[1:] and other[0] != keys[0]


def test_board_places_a_prefix_on_its_holder_and_the_least_loaded_replica_otherwise():
    board = CapacityBoard()
    board.update({"a": _report(4 * GIB, slots=2), "b": _report(3 * GIB, slots=3)})
    chat1, chat2 = list(range(200)), list(range(1000, 1200))
    assert board.place("c1-t1", GIB, 0, keys=affinity_keys(chat1, 16)) == "a"  # new prefix: most room
    assert board.place("c2-t1", GIB, 0, keys=affinity_keys(chat2, 16)) == "b"  # as many bytes left, more slots
    turn2 = affinity_keys(chat1 + list(range(300, 340)), 16)
    assert board.place("c1-t2", GIB, 0, keys=turn2) == "a"  # its holder, although b has more slots left
    # a has no slot left: the next turn goes to the least-loaded replica with room, which then holds the prefix
    assert board.place("c1-t3", GIB, 0, keys=turn2) == "b"
    board.release("c1-t1")
    assert board.place("c1-t4", GIB, 0, keys=turn2) == "b"  # its holder now, although a has more room
    board.update({"a": _report(3 * GIB, slots=2)})  # b is gone, and with it what it held
    assert board.place("c2-t2", GIB, 0, keys=affinity_keys(chat2, 16)) == "a"


def test_board_forgets_the_least_recently_placed_prefixes_beyond_its_bound(monkeypatch):
    monkeypatch.setattr("serve_app.admission.AFFINITY_KEYS_KEPT", 2)
    board = CapacityBoard()
    board.update({"a": _report(4 * GIB, slots=8), "b": _report(4 * GIB, slots=8)})
    first, second, third = ([k] * 16 for k in range(3))
    placed = board.place("r1", GIB, 0, keys=affinity_keys(first, 16))
    board.place("r2", GIB, 0, keys=affinity_keys(second, 16))
    board.place("r3", GIB, 0, keys=affinity_keys(third, 16))  # the first prefix is forgotten now
    board.release("r2")
    board.release("r3")
    assert board.place("r4", GIB, 0, keys=affinity_keys(first, 16)) != placed  # most room again, not its holder


def test_board_credits_an_early_ended_request_that_a_late_report_lists_after_one_that_did_not():
    now = [0.0]
    board = CapacityBoard(clock=lambda: now[0])
    board.update({"a": _report(GIB, slots=1)})
    assert board.place("r1", GIB, 0) == "a"
    board.release("r1")  # ended before any report listed it
    board.update({"a": _report(GIB, slots=1)})  # taken before r1 reached the replica
    board.update({"a": _report(0, slots=0, ids=["r1"])})  # taken while the replica still held it
    assert board.place("r2", GIB, 0) == "a"  # its slot and bytes are free all the same
    board.release("r2")
    now[0] = ENDED_KEPT_S
    board.update({"a": _report(GIB, slots=1)})  # past ENDED_KEPT_S unlisted, r2 is forgotten: a later listing counts
    board.update({"a": _report(0, slots=0, ids=["r2"])})
    assert board.place("r3", GIB, 0) is None


def test_board_respects_slots_and_ignores_unreported_replicas():
    board = CapacityBoard()
    board.update({"a": _report(4 * GIB, slots=1), "b": {}})
    assert board.num_replicas() == 1
    assert board.place("r1", 1, 0) == "a" and board.place("r2", 1, 0) is None


def test_gate_refuses_at_once_when_no_room_and_no_waiting_allowed(monkeypatch):
    board = CapacityBoard()
    board.update({"a": _report(GIB, slots=1)})
    gate = AdmissionGate(board, max_waiting=0, max_wait_s=5.0)
    assert asyncio.run(gate.admit("r1", 1, 0)) == "a"
    sleeps = _count_sleeps(monkeypatch)
    with pytest.raises(OpenAIError) as exc:
        asyncio.run(gate.admit("r2", 1, 0))
    assert exc.value.status == 429 and sleeps == []  # refused without waiting for room
    with pytest.raises(OpenAIError) as exc:
        asyncio.run(gate.admit("r3", 5 * GIB, 0))
    assert exc.value.status == 400


def test_gate_refuses_early_behind_a_full_line_even_with_a_free_slot():
    """Two slots, room for one request's bytes: r2 waits for bytes with a slot free. The line (1) is full, so a new
    request is refused before any work, although a slot is free: it could only queue behind r2. With no line
    allowed, a free slot lets a request through to admission, and no free slot refuses it early."""
    board = CapacityBoard()
    board.update({"a": _report(GIB, slots=2)})
    gate = AdmissionGate(board, max_waiting=1, max_wait_s=60.0, poll_s=0.01)

    async def scenario():
        await gate.admit("r1", GIB, 0)
        waiter = asyncio.create_task(gate.admit("r2", GIB, 0))
        while gate.num_waiting == 0:
            await asyncio.sleep(0.01)
        assert board.has_free_slot()
        with pytest.raises(OpenAIError) as exc:
            gate.refuse_early()
        assert exc.value.status == 429 and exc.value.headers["Retry-After"] == "1"
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)

    asyncio.run(scenario())
    no_line = AdmissionGate(board, max_waiting=0, max_wait_s=60.0)
    no_line.refuse_early()  # r1 holds one of the two slots
    board.update({"a": _report(GIB, slots=0, ids=["r1"])})
    with pytest.raises(OpenAIError):
        no_line.refuse_early()

def test_gate_waits_a_bounded_time_for_room():
    board = CapacityBoard()
    board.update({"a": _report(GIB, slots=1)})
    gate = AdmissionGate(board, max_waiting=1, max_wait_s=1.0, poll_s=0.01)

    async def scenario():
        assert await gate.admit("r1", 1, 0) == "a"
        waiter = asyncio.create_task(gate.admit("r2", 1, 0))
        await asyncio.sleep(0.05)
        assert gate.num_waiting == 1
        with pytest.raises(OpenAIError):  # the waiting line (1) is full: refused at once
            await gate.admit("r3", 1, 0)
        board.release("r1")
        return await waiter

    assert asyncio.run(scenario()) == "a"


def test_gate_queues_in_arrival_order_within_the_predicted_wait_and_refuses_beyond_it():
    """One slot; requests held it 100 s each: the first in line is predicted to wait 100 s (within the 150 s bound)
    and queues, the second 200 s and is refused at once with that as Retry-After. Room goes to the line in order."""
    board = CapacityBoard()
    board.update({"a": {**_report(GIB, slots=1), "num_slots": 1}})
    now = [0.0]
    gate = AdmissionGate(board, max_waiting=8, max_wait_s=150.0, poll_s=0.01, clock=lambda: now[0])
    placed = []

    async def admitted(request_id):
        placed.append((request_id, await gate.admit(request_id, 1, 0)))

    async def scenario():
        assert gate.predicted_wait_s(1) is None  # nothing has ended yet: no prediction, so a request may queue
        await admitted("r0")
        now[0] += 100.0
        gate.release("r0")
        assert gate.predicted_wait_s(1) == 100.0 and gate.predicted_wait_s(2) == 200.0
        await admitted("r1")
        queued = asyncio.create_task(admitted("r2"))
        await asyncio.sleep(0.05)
        with pytest.raises(OpenAIError) as exc:
            await gate.admit("r3", 1, 0)
        assert exc.value.status == 429 and exc.value.headers["Retry-After"] == "200"
        assert gate.num_waiting == 1 and placed == [("r0", "a"), ("r1", "a")]
        gate.release("r1")
        await queued

    asyncio.run(scenario())
    assert [request_id for request_id, _ in placed] == ["r0", "r1", "r2"]


def test_gate_places_the_line_first_come_first_placed():
    board = CapacityBoard()
    board.update({"a": _report(GIB, slots=1)})
    gate = AdmissionGate(board, max_waiting=8, max_wait_s=60.0, poll_s=0.01)
    placed = []

    async def admitted(request_id):
        await gate.admit(request_id, 1, 0)
        placed.append(request_id)

    async def scenario():
        await admitted("r0")
        line = []
        for request_id in ("r1", "r2", "r3"):
            line.append(asyncio.create_task(admitted(request_id)))
            await asyncio.sleep(0.02)
        for done in ("r0", "r1", "r2"):
            gate.release(done)
            while placed[-1] == done:
                await asyncio.sleep(0.01)
        await asyncio.gather(*line)

    asyncio.run(scenario())
    assert placed == ["r0", "r1", "r2", "r3"]


def _ingress(board, engine_events):
    """An Ingress without Ray: its gate on `board`, an engine whose request streams `engine_events(payload)`.
    -> (the ingress, the engine request ids in the order they reached the engine, those it was told to cancel)."""
    ingress = object.__new__(Ingress.func_or_class.__mro__[1])  # the class as written, without Serve's ASGI wrapper
    ingress.gate = AdmissionGate(board, max_waiting=8, max_wait_s=60.0, poll_s=0.01)
    ingress.footprint = SimpleNamespace(predict=lambda prompt_len, max_tokens: (1, 0), block_size=16)
    ingress.metrics, ingress.limits = ServiceMetrics(), RequestLimits()
    started, cancelled = [], []

    class Stream:
        def __init__(self, payload):
            self.request_id = payload["request_id"]
            started.append(self.request_id)
            self.events = engine_events(payload)

        def __aiter__(self):
            return self.events

        def cancel(self):
            cancelled.append(self.request_id)

    ingress.stream_engine = SimpleNamespace(generate=SimpleNamespace(remote=Stream))
    return ingress, started, cancelled


def _engine_event(text, prompt_tokens, completion_tokens, finished=False):
    return {"text": text, "num_new_tokens": 1, "finished": finished, "finish_reason": "length" if finished else None,
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "cached_tokens": 0}


def test_ingress_admits_a_requests_choices_together_in_order_and_totals_their_usage():
    """Two prompts (3 and 5 tokens) × n=2: four engine requests, each giving its first event only once all four
    have reached the engine (so admitting them one after another, each after the last one's first event, would
    never end); the last choice finishes first, yet the choices come back in their order, with the usage of each
    prompt counted once."""
    board = CapacityBoard()
    board.update({"a": _report(GIB, slots=4)})
    all_started = asyncio.Event()

    async def engine_events(payload):
        if len(started) == 4:
            all_started.set()
        await all_started.wait()
        index, prompt = int(payload["request_id"].rsplit("-", 1)[1]), len(payload["prompt_token_ids"])
        yield _engine_event(str(index), prompt, 1)
        for _ in range(4 - index):
            await asyncio.sleep(0)
        yield _engine_event("!" * (index + 1), prompt, index + 2, finished=True)

    ingress, started, cancelled = _ingress(board, engine_events)
    request = CompletionRequest(model="m", prompt=[[1, 2, 3], [4, 5, 6, 7, 8]], max_tokens=8, n=2)
    choices = prepare(None, request, 64, 8, 16)

    async def scenario():
        events = await ingress._start_choices("c", choices, time.monotonic())
        return await collect(events, "completion", "c", "m", num_choices=4, n=2)

    body = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert started == ["c-0", "c-1", "c-2", "c-3"] and cancelled == []
    assert [(c.index, c.text) for c in body.choices] == [(0, "0!"), (1, "1!!"), (2, "2!!!"), (3, "3!!!!")]
    assert (body.usage.prompt_tokens, body.usage.completion_tokens) == (3 + 5, 2 + 3 + 4 + 5)
    assert board.num_reserved() == 0 and ingress.gate.num_waiting == 0


def test_ingress_ends_every_choice_when_one_is_refused():
    """Three choices admitted together; the engine refuses the second once all three have reached it: the request
    gets that refusal, and the engine is told to cancel the other two, which no longer hold a reservation."""
    board = CapacityBoard()
    board.update({"a": _report(GIB, slots=4)})
    all_started, never = asyncio.Event(), asyncio.Event()

    async def engine_events(payload):
        if len(started) == 3:
            all_started.set()
        await all_started.wait()
        if payload["request_id"] == "c-1":
            yield {"error": {"message": "no free slot", "type": "rate_limit_error"}, "status": 429}
            return
        yield _engine_event("x", 3, 1)
        await never.wait()

    ingress, started, cancelled = _ingress(board, engine_events)
    choices = prepare(None, CompletionRequest(model="m", prompt=[[1, 2, 3]], max_tokens=8, n=3), 64, 8, 16)
    with pytest.raises(OpenAIError) as exc:
        asyncio.run(asyncio.wait_for(ingress._start_choices("c", choices, time.monotonic()), timeout=30))
    assert exc.value.status == 429 and started == ["c-0", "c-1", "c-2"] and sorted(cancelled) == ["c-0", "c-2"]
    assert board.num_reserved() == 0 and ingress.gate.num_waiting == 0

def test_gate_only_the_head_of_the_line_polls_and_leaving_hands_its_turn_on(monkeypatch):
    """r1, r2, r3 wait for the one slot r0 holds: only r1, at the head, polls for room. r1 gives up (its client
    went away): r2 polls in its stead, r3 still does not, and the slot goes to r2, then r3."""
    board = CapacityBoard()
    board.update({"a": _report(GIB, slots=1)})
    gate = AdmissionGate(board, max_waiting=8, max_wait_s=60.0, poll_s=0.01)
    pollers, real_sleep = [], asyncio.sleep

    async def sleep(delay, *args, **kwargs):
        pollers.append(asyncio.current_task().get_name())
        return await real_sleep(delay, *args, **kwargs)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    placed = []

    async def admitted(request_id):
        await gate.admit(request_id, 1, 0)
        placed.append(request_id)

    async def until(condition):
        while not condition():
            await real_sleep(0.01)

    async def scenario():
        await admitted("r0")
        line = {rid: asyncio.create_task(admitted(rid), name=rid) for rid in ("r1", "r2", "r3")}
        await until(lambda: pollers.count("r1") >= 5)
        assert set(pollers) == {"r1"} and gate.num_waiting == 3
        line["r1"].cancel()
        await until(lambda: pollers.count("r2") >= 5)
        assert set(pollers) == {"r1", "r2"} and gate.num_waiting == 2
        gate.release("r0")
        await line["r2"]
        gate.release("r2")
        await line["r3"]

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert placed == ["r0", "r2", "r3"] and gate.num_waiting == 0

def test_metrics_render_prometheus_text():
    metrics = ServiceMetrics()
    metrics.admitted.inc()
    metrics.rejected.labels(reason="rate_limit_exceeded").inc()
    metrics.model_name = "m"
    metrics.record_tokens(18, 0.2, first=True)
    metrics.record_tokens(2, 0.02, first=False)
    metrics.record_end("length", 7, 0.3)
    reports = [{"gpu_bytes_in_use": 10, "gpu_bytes_peak": 12, "host_bytes_in_use": 3, "hit_rate": 0.5,
                "chunks_selected_total": 8, "chunk_hits_total": 6},
               {"gpu_bytes_in_use": 5, "gpu_bytes_peak": 9, "chunks_selected_total": 4, "chunk_hits_total": 1}]
    text = metrics.render(reports, 2, 1).decode()
    for name in ("shadowkv_admission_queue_depth 2.0", "shadowkv_requests_admitted_total 1.0",
                 'shadowkv_requests_rejected_total{reason="rate_limit_exceeded"} 1.0', "shadowkv_tokens_per_second 2.0",
                 "shadowkv_time_to_first_token_seconds_bucket", "shadowkv_inter_token_latency_seconds_count 1.0",
                 "shadowkv_hit_rate 0.5", "shadowkv_gpu_bytes_in_use 15.0", "shadowkv_host_bytes_in_use 3.0",
                 "shadowkv_gpu_bytes_peak 21.0", "shadowkv_chunks_selected_total 12.0",
                 "shadowkv_chunk_hits_total 7.0", 'vllm:generation_tokens_total{model_name="m"} 20.0',
                 'vllm:prompt_tokens_total{model_name="m"} 7.0', 'vllm:num_requests_waiting{model_name="m"} 2.0',
                 'vllm:request_success_total{finished_reason="length",model_name="m"} 1.0',
                 'vllm:inter_token_latency_seconds_count{model_name="m"} 1.0',
                 'vllm:time_to_first_token_seconds_count{model_name="m"} 1.0',
                 'vllm:e2e_request_latency_seconds_count{model_name="m"} 1.0'):
        assert name in text, name


def test_metrics_are_open_to_scrapers_unless_configured_to_need_the_key():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def status_of(settings: GuardSettings) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b""}

        await RequestGuard(app, settings)({"type": "http", "path": "/metrics", "headers": []}, receive, send)
        return sent[0]["status"]

    assert asyncio.run(status_of(GuardSettings(api_keys=(b"k",)))) == 200
    assert asyncio.run(status_of(GuardSettings(api_keys=(b"k",), open_paths=OPEN_PATHS))) == 401


def test_metrics_count_requests_per_replica_and_forget_replicas_gone():
    metrics = ServiceMetrics()
    reports = [{"replica": "a", "device": "gpu0", "num_requests": 3}, {"replica": "b", "device": "gpu1",
                                                                       "num_requests": 5}]
    text = metrics.render(reports, 0, 0).decode()
    assert 'shadowkv_replica_requests{device="gpu0",replica="a"} 3.0' in text
    assert 'shadowkv_replica_requests{device="gpu1",replica="b"} 5.0' in text
    text = metrics.render(reports[1:], 0, 0).decode()
    assert 'replica="a"' not in text and 'replica="b"' in text


def test_autoscaling_asks_for_replicas_by_memory_demand():
    assert desired_replicas([0.9, 0.9], current=2, lowest=1, highest=8) == 3
    assert desired_replicas([0.1, 0.0], current=2, lowest=1, highest=8) == 1
    assert desired_replicas([1.0] * 8, current=8, lowest=1, highest=8) == 8
    assert desired_replicas([], current=3, lowest=1, highest=8) == 3


class _FakeReplica:
    def __init__(self, unique_id: str):
        self.replica_id = SimpleNamespace(unique_id=unique_id)


def _router_with(board: CapacityBoard) -> MemoryAwareRouter:
    router = MemoryAwareRouter.__new__(MemoryAwareRouter)  # Serve's constructor needs a live deployment
    router._board = board
    return router


def test_router_sends_a_request_where_admission_placed_it_and_replaces_it_if_that_replica_is_gone():
    board = CapacityBoard()
    board.update({"a": _report(GIB), "b": _report(2 * GIB)})
    router = _router_with(board)
    a, b = _FakeReplica("a"), _FakeReplica("b")
    placed = board.place("r1", GIB, 0)
    request = SimpleNamespace(args=[{"request_id": "r1", "gpu_bytes": GIB, "host_bytes": 0, "affinity": ()}])
    assert asyncio.run(router.choose_replicas([a, b], request)) == [[a if placed == "a" else b]]
    assert asyncio.run(router.choose_replicas([b], request)) == [[b]]  # "a" gone: best fit among the live ones
    assert board.placement("r1") == "b"
    assert asyncio.run(router.choose_replicas([a, b], None)) == [[a, b]]  # no placement: any replica


def test_edge_shedder_refuses_beyond_the_advertised_capacity_without_forwarding():
    """The proxy's middleware: forwards everything until a response advertises the capacity, then refuses completion
    requests beyond it at once (429, Retry-After, OpenAI body) without calling the app; other routes always pass."""
    from serve_app.edge import CAPACITY_HEADER, RETRY_HEADER, CapacityAdvert, CapacitySource, EdgeShedder

    release, calls = asyncio.Event(), []

    async def service(scope, receive, send):  # the ingress behind the proxy, advertising capacity 2
        calls.append(scope["path"])
        if scope["method"] == "POST":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    source = CapacitySource()
    edge = EdgeShedder(CapacityAdvert(service, source))

    async def call(method, path):
        sent = []

        async def send(message):
            sent.append(message)
        await edge({"type": "http", "method": method, "path": path, "headers": []}, None, send)
        start = sent[0]
        return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])

    async def scenario():
        assert (await call("GET", "/health"))[0] == 200 and edge.capacity is None  # no replica reported yet
        source.read = lambda: (2, 3.0)
        status, headers, _ = await call("GET", "/health")
        assert status == 200 and headers[CAPACITY_HEADER] == b"2" and headers[RETRY_HEADER] == b"3.0"
        assert edge.capacity == 2
        held = [asyncio.create_task(call("POST", "/v1/completions")) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert edge.in_flight == 2
        forwarded = len(calls)
        status, headers, body = await call("POST", "/v1/chat/completions")
        assert status == 429 and headers[b"retry-after"] == b"3" and len(calls) == forwarded
        assert json.loads(body)["error"]["type"] == "rate_limit_error" and edge.shed == 1
        assert (await call("GET", "/v1/models"))[0] == 200  # other routes pass at capacity
        release.set()
        assert [t[0] for t in await asyncio.gather(*held)] == [200, 200] and edge.in_flight == 0
        assert (await call("POST", "/v1/completions"))[0] == 200  # room again

    asyncio.run(scenario())


def test_gate_refuses_at_once_when_no_request_can_end_within_the_wait(monkeypatch):
    """Replicas bound when their first request can end (LLMEngine.next_finish_s): past the wait, waiting could only
    end in a refusal, so the gate refuses at once, with that time as Retry-After; within it, or unbounded, it waits."""
    board = CapacityBoard()
    gate = AdmissionGate(board, max_waiting=4, max_wait_s=1.0, poll_s=0.01)
    board.update({"a": {**_report(GIB, slots=1), "next_free_at": time.time() + 30}})
    assert asyncio.run(gate.admit("r1", 1, 0)) == "a"
    sleeps = _count_sleeps(monkeypatch)
    with pytest.raises(OpenAIError) as exc:
        asyncio.run(gate.admit("r2", 1, 0))
    assert exc.value.status == 429 and sleeps == []  # refused without waiting for room
    assert 28 <= int(exc.value.headers["Retry-After"]) <= 30
    for bound in (time.time() + 0.5, None):  # a request may end within the wait, or no bound: wait, then refuse
        board.update({"a": {**_report(GIB, slots=0, ids=["r1"]), "next_free_at": bound}})
        start = time.monotonic()
        with pytest.raises(OpenAIError):
            asyncio.run(gate.admit("r3", 1, 0))
        assert time.monotonic() - start >= 1.0 and sleeps  # it polled for room the whole wait
