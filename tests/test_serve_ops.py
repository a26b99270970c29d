"""The operator's side of the service on a real local Ray Serve instance (CPU, loopback, a tiny random model): a
burst beyond the slots queues and is served, only what is beyond the queue gets 429; /metrics counts known requests
under vLLM's names and ours; /tokenize, /detokenize, /version, /v1/models/{id}, HEAD /health."""
import asyncio
import importlib.metadata
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from serve_app.local import local_service, send_at_once
from shadowkv_core.tiny_model import build_tiny_model
from support.serve import assert_engine_drains

APP = "shadowkv"
MODEL = "tiny"
SLOTS = 2
QUEUE = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, model path): one replica of 2 slots and a line of 4 that may wait minutes."""
    model = str(build_tiny_model(tmp_path_factory.mktemp("models") / MODEL))
    args = {"model": model, "served_model_name": MODEL, "max_num_seqs": SLOTS, "max_model_len": 2048,
            "max_waiting": QUEUE, "max_wait_s": 300, "engine": {"gpu_cache_gib": 0.05, "host_cache_gib": 0.05}}
    with local_service(args, APP) as base:
        yield base, model


@pytest.fixture(scope="module")
def url(served):
    return served[0]


def _burst(url: str, n: int, max_tokens: int = 64) -> list[dict]:
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": max_tokens, "ignore_eos": True}
    return asyncio.run(send_at_once(url, json.dumps(body).encode(), n, timeout_s=300))


def test_a_burst_within_the_queue_waits_and_is_served_in_full(url):
    replies = _burst(url, SLOTS + QUEUE)
    assert [r["status"] for r in replies] == [200] * (SLOTS + QUEUE)
    assert all(r["completion_tokens"] == 64 for r in replies)
    assert_engine_drains(APP, within_s=5.0)


def test_a_burst_beyond_the_queue_refuses_only_the_excess_with_retry_after(url):
    replies = _burst(url, SLOTS + QUEUE + 3, max_tokens=256)
    ok = [r for r in replies if r["status"] == 200]
    refused = [r for r in replies if r["status"] == 429]
    assert len(ok) == SLOTS + QUEUE and len(refused) == 3, [r["status"] for r in replies]
    assert all(r["completion_tokens"] == 256 for r in ok)
    assert all(int(r["retry_after"]) >= 1 for r in refused)
    assert_engine_drains(APP, within_s=5.0)


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, read without an API key: {(name, sorted labels): value}."""
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_known_requests_under_vllm_names_and_ours(url):
    assert_engine_drains(APP, within_s=5.0)
    before = _scrape(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    replies = [client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5,
                                         extra_body={"ignore_eos": True}) for _ in range(3)]
    for body in ({"model": MODEL, "prompt": "x", "temperature": "hot"}, {"model": MODEL}):
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
    assert_engine_drains(APP, within_s=5.0)
    after = _scrape(url)
    model = (("model_name", MODEL),)

    def grew(name: str, labels: tuple = model) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert grew("vllm:request_success_total", (("finished_reason", "length"), *model)) == 3
    assert grew("vllm:generation_tokens_total") == 15 == grew("shadowkv_generated_tokens_total", ())
    assert grew("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    for histogram in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"):
        assert grew(f"{histogram}_count") == 3
    assert grew("vllm:inter_token_latency_seconds_count") == grew("shadowkv_inter_token_latency_seconds_count", ())
    assert grew("shadowkv_request_errors_total", (("status", "400"),)) == 2
    assert ("vllm:num_requests_running", model) in after and ("vllm:num_requests_waiting", model) in after


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(served):
    url, model_path = served
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "The quick brown fox"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer("The quick brown fox")["input_ids"]
    assert set(body) == {"count", "max_model_len", "tokens"}  # vLLM's token_strs only with return_token_strs
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    chat = [{"role": "user", "content": "The quick brown fox"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": chat})  # the chat template's rendering, as chat sends it
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    plain = httpx.post(f"{url}/tokenize", json={"prompt": "The quick brown fox", "add_special_tokens": False})
    assert plain.json()["tokens"] == tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    r = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": plain.json()["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "The quick brown fox"}
    for path, body, param in (("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
                              ("/tokenize", {"messages": []}, "messages"),
                              ("/tokenize", {"model": "gpt-9", "prompt": "x"}, "model")):
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code in (400, 404) and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert param is None or r.json()["error"]["param"] == param


def test_version_model_card_and_head_health(served):
    url, model_path = served
    assert httpx.get(f"{url}/version").json() == {"version": importlib.metadata.version("shadowkv-serve")}
    card = httpx.get(f"{url}/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["root"] == model_path and card["random_weights"] is False
    assert httpx.get(f"{url}/v1/models").json()["data"] == [card]
    missing = httpx.get(f"{url}/v1/models/gpt-9")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found" and missing.json()["error"]["param"] == "model"
    head = httpx.head(f"{url}/health")
    assert head.status_code == 200 and head.content == b""
