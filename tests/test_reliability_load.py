"""Load and soak through a real local Ray Serve instance (tiny model, one replica), driven by benchmarks/load.py:
nothing lost, latency recorded, every byte returned, RSS flat. Reduced size by default (CI); the long runs recorded in
docs/reliability.md set SHADOWKV_LOAD_S and SHADOWKV_SOAK_REQUESTS."""
import asyncio
import os
from dataclasses import replace

import pytest

from benchmarks.load import LoadConfig, run_load
from serve_fixtures import assert_engine_drains, engine_stats, local_service
from shadowkv_core.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow
APP = "load"
LOAD_S = float(os.environ.get("SHADOWKV_LOAD_S", 15))
SOAK_REQUESTS = int(os.environ.get("SHADOWKV_SOAK_REQUESTS", 150))
RSS_GROWTH_LIMIT = 32 << 20  # what allocator noise may add over a soak; a leak per request grows without bound
# The tiny model's tokenizer is byte-level (~6 tokens a word): prompts of up to ~1,500 tokens, ShadowKV from 256.
MIX = ((0.6, 2, 16), (0.3, 40, 120), (0.1, 150, 250))


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))
    shadowkv = {"rank": 16, "sparse_budget": 64, "outlier_chunks": 2, "min_context": 256, "decode_window": 64}
    args = {"model": model, "served_model_name": "tiny", "max_num_seqs": 4, "max_model_len": 2048,
            "max_waiting": 8, "shadowkv": shadowkv, "engine": {"gpu_cache_gib": 0.1, "host_cache_gib": 0.1}}
    with local_service(args, APP) as base:
        yield base


def _load(url: str, **overrides) -> dict:
    cfg = LoadConfig(url=url, model="tiny", concurrency=6, max_tokens=(4, 48), request_timeout_s=60, mix=MIX)
    return asyncio.run(run_load(replace(cfg, **overrides)))


def test_load_generator_refuses_anything_but_loopback():
    for url in ("http://10.0.0.1:8000", "http://localhost:8000", "https://example.com"):
        with pytest.raises(ValueError, match="127.0.0.1"):
            asyncio.run(run_load(LoadConfig(url=url, model="tiny")))


def test_mixed_load_loses_nothing_and_returns_every_byte(url):
    summary = _load(url, duration_s=LOAD_S, max_requests=10_000)
    assert summary["lost"] == 0 and summary["error"] == 0, summary["failures"]
    assert summary["ok"] >= 10 and summary["wall_s"] < LOAD_S + 60, summary
    assert summary["ttft_ms_p50"] is not None and summary["itl_ms_p99"] is not None, summary
    assert_engine_drains(APP, within_s=5.0)
    print(f"load: {summary}")


def test_soak_shows_no_leak(url):
    _load(url, duration_s=120, max_requests=30)  # warm-up: allocator and caches settle
    before = assert_engine_drains(APP, within_s=5.0)["rss_bytes"]
    summary = _load(url, duration_s=max(600, SOAK_REQUESTS), max_requests=SOAK_REQUESTS, stream_share=0.5)
    assert summary["requests"] == SOAK_REQUESTS and summary["lost"] == 0 and summary["error"] == 0, summary
    after = assert_engine_drains(APP, within_s=5.0)["rss_bytes"]
    print(f"soak: {summary}; engine RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")  # the figures docs record
    assert after - before < RSS_GROWTH_LIMIT, (before, after)
    assert engine_stats(APP)["num_held"] == 0
