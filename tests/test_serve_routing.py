"""Two engine replicas on a real local Ray Serve instance: admission places each request on a replica with a free
slot and the memory-aware router sends it there, so both replicas fill before anything is refused."""
import asyncio
import socket
import time

import httpx
import pytest
import ray
from ray import serve

from serve_app.app import build_app
from shadowkv_core.tiny_model import build_tiny_model

SLOTS_PER_REPLICA = 2
REPLICAS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": model, "served_model_name": "tiny", "max_num_seqs": SLOTS_PER_REPLICA, "max_model_len": 1024,
            "num_cpus": 0, "min_replicas": REPLICAS, "max_replicas": REPLICAS, "max_waiting": 0,
            "engine": {"gpu_cache_gib": 0.02}}
    serve.run(build_app(args), name="routing", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while httpx.get(f"{base}/health").json().get("replicas") != REPLICAS:  # both replicas have reported
        assert time.monotonic() < deadline, "the replicas never both reported their capacity"
        time.sleep(0.2)
    yield base
    serve.shutdown()
    ray.shutdown()


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_requests_fill_every_replica_before_any_is_refused(url):
    body = {"model": "tiny", "prompt": "route me", "max_tokens": 400, "ignore_eos": True}
    capacity = SLOTS_PER_REPLICA * REPLICAS

    async def fill_then_overflow():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            running = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(capacity)]
            await asyncio.sleep(1.0)
            metrics = (await http.get("/metrics")).text
            overflow = await http.post("/v1/completions", json=body)
            return await asyncio.gather(*running), metrics, overflow

    done, metrics, overflow = asyncio.run(fill_then_overflow())
    assert [r.status_code for r in done] == [200] * capacity, [r.text for r in done if r.status_code != 200]
    assert _metric(metrics, "shadowkv_num_running") == capacity  # each replica holds its own two
    assert overflow.status_code == 429 and overflow.headers["Retry-After"]
