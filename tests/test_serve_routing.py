"""Two engine replicas on a real local Ray Serve instance: admission places each request on a replica with a free
slot and the memory-aware router sends it there, so both replicas fill before anything is refused."""
import asyncio

import httpx
import pytest

from serve_app.local import local_service
from shadowkv_core.tiny_model import build_tiny_model

SLOTS_PER_REPLICA = 2
REPLICAS = 2


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))
    args = {"model": model, "served_model_name": "tiny", "max_num_seqs": SLOTS_PER_REPLICA, "max_model_len": 1024,
            "num_cpus": 0, "min_replicas": REPLICAS, "max_replicas": REPLICAS, "max_waiting": 0,
            "engine": {"gpu_cache_gib": 0.02}}
    with local_service(args, "routing", replicas=REPLICAS) as base:  # both replicas have reported
        yield base


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_requests_fill_every_replica_before_any_is_refused(url):
    # as long as the model length allows, and the overflow sent as soon as every slot is seen taken: on a fast
    # machine 400 tokens and a fixed 1 s wait let the first requests finish before the overflow arrived
    body = {"model": "tiny", "prompt": "route me", "max_tokens": 960, "ignore_eos": True}
    capacity = SLOTS_PER_REPLICA * REPLICAS

    async def fill_then_overflow():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            running = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(capacity)]
            for _ in range(200):  # at most about 10 s
                await asyncio.sleep(0.05)
                metrics = (await http.get("/metrics")).text
                if _metric(metrics, "shadowkv_num_running") == capacity:
                    break
            overflow = await http.post("/v1/completions", json=body)
            return await asyncio.gather(*running), metrics, overflow

    done, metrics, overflow = asyncio.run(fill_then_overflow())
    assert [r.status_code for r in done] == [200] * capacity, [r.text for r in done if r.status_code != 200]
    assert _metric(metrics, "shadowkv_num_running") == capacity  # each replica holds its own two
    assert overflow.status_code == 429 and overflow.headers["Retry-After"]
