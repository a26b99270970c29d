"""Auth, limits, the per-request deadline, one failing engine forward and exhausted host memory, through a real
local Ray Serve instance (one replica, two slots, API keys from the environment and a file, fault hooks on)."""
import asyncio
import json
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from serve_app.engine_replica import engine_footprint
from serve_app.faults import ENV as FAULTS_ENV
from serve_app.local import local_service
from serve_app.security import KEY_FILE_ENV, KEYS_ENV
from shadowkv_core import EngineConfig, LLMEngine, ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.tiny_model import build_tiny_model
from support.serve import assert_engine_drains

APP = "limits"
MODEL = "tiny"
KEY, FILE_KEY = "sk-env-key-7f3a9c", "sk-file-key-52d1e8"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 2.0
SHADOWKV = {"rank": 16, "sparse_budget": 64, "outlier_chunks": 2, "min_context": 256, "decode_window": 64}
LONG_PROMPT = "In the beginning there was a haystack. " * 10  # ~390 tokens: past min_context, so ShadowKV
LONG_MAX_TOKENS = 200


def _host_bytes_for_one_long_request(model: str) -> int:
    engine = LLMEngine(EngineConfig(model=model, shadowkv=ShadowKVConfig(**SHADOWKV), max_model_len=2048,
                                    gpu_cache_gib=0.02, host_cache_gib=0.02))
    prompt_len = len(engine.tokenize(LONG_PROMPT))
    return engine_footprint(engine).predict(prompt_len, LONG_MAX_TOKENS)[1]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    model = str(build_tiny_model(root / MODEL))
    (root / "keys").write_text(f"# one key a line\n{FILE_KEY}\n")
    host_gib = 1.5 * _host_bytes_for_one_long_request(model) / mm.GIB  # room for one long request, not two
    args = {"model": model, "served_model_name": MODEL, "max_num_seqs": 2, "max_model_len": 2048, "max_waiting": 0,
            "shadowkv": SHADOWKV, "engine": {"gpu_cache_gib": 0.05, "host_cache_gib": host_gib},
            "max_prompt_tokens": 1536, "max_tokens_limit": 1024, "request_timeout_s": TIMEOUT_S,
            "max_body_bytes": 64 << 10}
    env = {KEYS_ENV: f" {KEY} ,", KEY_FILE_ENV: str(root / "keys"), FAULTS_ENV: "1"}
    with local_service(args, APP, env) as base:
        yield base


def _post(url: str, body: dict, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=kwargs.pop("headers", AUTH), timeout=60, **kwargs)


def _assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert code is None or error["code"] == code, error
    return error


def _inject(kind: str, value=None) -> None:
    serve.get_deployment_handle("EngineReplica", APP).inject_fault.remote(kind, value).result()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": "Bearer"}])
def test_missing_or_wrong_key_is_a_401_everywhere_but_health_and_metrics(url, headers):
    assert httpx.get(f"{url}/health", headers=headers).status_code == 200
    assert httpx.get(f"{url}/metrics", headers=headers).status_code == 200  # a scraper holds no key
    for path in ("/v1/models", "/openapi.json", "/docs"):
        _assert_openai_error(httpx.get(f"{url}{path}", headers=headers), 401, "invalid_api_key")
    r = _post(url, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=headers)
    assert r.headers["WWW-Authenticate"] == "Bearer"
    _assert_openai_error(r, 401, "invalid_api_key")


def test_keys_from_the_environment_and_the_file_both_work_and_are_never_logged(url):
    for key in (KEY, FILE_KEY):
        r = _post(url, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    for log in (p for p in logs.rglob("*") if p.is_file()):
        text = log.read_bytes()
        assert KEY.encode() not in text and FILE_KEY.encode() not in text, log


LIMITS = [
    ({"prompt": "x" * 1600}, 400, "prompt_too_long"),
    ({"prompt": "x", "max_tokens": 1025}, 400, "invalid_value"),
    ({"prompt": "x", "n": 17}, 400, "invalid_value"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ({"prompt": "x", "stop": "s" * 257}, 400, "invalid_value"),
    ({"prompt": "x" * (65 << 10)}, 413, None),
]


@pytest.mark.parametrize("fields,status,code", LIMITS)
def test_each_limit_is_a_clear_4xx(url, fields, status, code):
    _assert_openai_error(_post(url, {"model": MODEL, **fields}), status, code)


def test_a_chunked_body_over_the_limit_is_a_413(url):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    _assert_openai_error(r, 413)


def _stream_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_deadline_aborts_the_engine_request_and_answers_a_clean_408(url):
    _inject("step_delay", 0.1)  # 10 tokens a second at most: 200 tokens outlast the deadline
    body = {"model": MODEL, "prompt": "slow", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    try:
        _assert_openai_error(_post(url, body), 408, "request_timeout")
        events = _stream_events(url, body)
    finally:
        _inject("step_delay", 0)
    assert events[0]["choices"][0]["finish_reason"] is None
    assert events[-1]["error"]["code"] == "request_timeout"
    assert_engine_drains(APP, within_s=2.0)


def test_a_failing_forward_fails_only_its_own_requests(url):
    """A decodes while B's prefill fails: B gets a clean 500, A completes, and both free everything."""
    body = {"model": MODEL, "prompt": "steady", "max_tokens": 60, "ignore_eos": True, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as http:
            decoding = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            await asyncio.to_thread(_inject, "fail_forward", "advance_prefill")
            failing = await http.post("/v1/completions", json={**body, "prompt": "doomed"})
            return await decoding, failing

    done, failed = asyncio.run(run())
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 60, done.text
    error = _assert_openai_error(failed, 500)
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    assert_engine_drains(APP, within_s=2.0)
    assert _post(url, body).status_code == 200  # the engine serves on


def test_host_memory_exhausted_is_a_clean_refusal(url):
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}

    async def two_at_once():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(2)))

    statuses = sorted(r.status_code for r in asyncio.run(two_at_once()))
    assert statuses == [200, 429], statuses  # two slots free, host values for one
    too_big = {**body, "prompt": LONG_PROMPT * 3, "max_tokens": 2}
    assert "host bytes" in _assert_openai_error(_post(url, too_big), 400)["message"]
    assert_engine_drains(APP, within_s=2.0)


BAD_BODIES = [
    b'{"model": "tiny", "prompt": "\xff\xfe bad utf-8"}',
    b'{"model": "tiny", "prompt": "\\ud800 lone surrogate"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}',
    b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 99999999999999999999999999}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": -1, "top_k": -7, "seed": -1}',
    b'{"model": "tiny", "prompt": [-1, 5]}',
    b'{"model": "tiny", "prompt": {"text": "x"}}',
    b'{"model": "tiny", "prompt": "x", "stream": "sometimes"}',
    b'{"model": "tiny", "messages": "hello"}',
    b'{"model": "tiny", "messages": []}',
    b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}',
    b'{"model": "tiny", "messages": [{"content": "x"}]}',
    b'{"model": "tiny", "prompt": "x", "stop": ' + json.dumps(["s"] * 1000).encode() + b"}",
    b'{"model": "tiny", "prompt": "x", "stop": [""]}',
    b'{"model": "tiny", "prompt": "x", "stop": [1, 2]}',
    b"[1, 2, 3]",
    b"",
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_input_is_a_4xx_in_openai_shape(url, body):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(f"{url}{path}", content=body, headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    _assert_openai_error(r, r.status_code)


def test_engine_state_is_intact_after_bad_input(url):
    assert _post(url, {"model": MODEL, "prompt": "fine", "max_tokens": 4}).status_code == 200
    assert_engine_drains(APP, within_s=2.0)
