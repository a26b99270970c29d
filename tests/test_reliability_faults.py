"""An engine replica killed mid-stream, on a real local Ray Serve instance with two replicas of one slot each: its
client gets a clean error event and [DONE] (no hang), the other replica's stream runs to its end, Serve starts a new
replica, and new requests succeed on both."""
import asyncio
import json
import time

import httpx
import pytest
import ray
from ray import serve

from serve_app.local import local_service, wait_healthy
from shadowkv_core.tiny_model import build_tiny_model

APP = "faults"
REPLICAS = 2
BODY = {"model": "tiny", "prompt": "keep talking", "max_tokens": 600, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))
    args = {"model": model, "served_model_name": "tiny", "max_num_seqs": 1, "max_model_len": 1024, "num_cpus": 0,
            "min_replicas": REPLICAS, "max_replicas": REPLICAS, "max_waiting": 0, "engine": {"gpu_cache_gib": 0.02}}
    with local_service(args, APP, replicas=REPLICAS) as base:
        yield base


def _engine_replica_actors() -> list:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#EngineReplica#")]
    return [ray.get_actor(name, namespace="serve") for name in names]


async def _stream(http: httpx.AsyncClient, started: asyncio.Event) -> list[dict]:
    """One streaming request's events, up to [DONE]; `started` is set after its third chunk."""
    events = []
    async with http.stream("POST", "/v1/completions", json=BODY) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return events
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    started.set()
    raise AssertionError("the stream ended without [DONE]")


async def _kill_one_replica_mid_stream(url: str) -> list[list[dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        started = [asyncio.Event() for _ in range(REPLICAS)]
        streams = [asyncio.create_task(_stream(http, s)) for s in started]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), timeout=30)
        victims = _engine_replica_actors()
        assert len(victims) == REPLICAS
        ray.kill(victims[0], no_restart=True)
        return await asyncio.wait_for(asyncio.gather(*streams), timeout=60)  # no hang


def _succeeds_within(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    body = {**BODY, "stream": False, "max_tokens": 4}
    while httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "no request succeeded after the replica was killed"
        time.sleep(0.5)


def test_a_replica_killed_mid_stream_fails_only_its_streams_and_is_replaced(url):
    results = asyncio.run(_kill_one_replica_mid_stream(url))
    failed = [events for events in results if "error" in events[-1]]
    finished = [events for events in results if "error" not in events[-1]]
    assert len(failed) == 1 and len(finished) == 1, [events[-1] for events in results]
    assert failed[0][-1]["error"]["type"] == "server_error" and failed[0][-1]["error"]["message"]
    assert finished[0][-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["text"]) for e in finished[0]) > 0

    deadline = time.monotonic() + 90
    while len(_engine_replica_actors()) < REPLICAS or serve.status().applications[APP].status != "RUNNING":
        assert time.monotonic() < deadline, "Serve did not replace the killed replica"
        time.sleep(0.5)
    wait_healthy(url, replicas=REPLICAS)
    _succeeds_within(url, timeout_s=30)

    async def both_slots():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {**BODY, "stream": False, "max_tokens": 50}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(REPLICAS)))

    assert [r.status_code for r in asyncio.run(both_slots())] == [200] * REPLICAS
