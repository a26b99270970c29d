"""Load and soak through a real local Ray Serve instance (tiny model, one replica), driven by benchmarks/load.py:
nothing lost, latency recorded, every byte returned, RSS back to its baseline. Reduced size by default (CI); the long
runs recorded in docs/reliability.md set SHADOWKV_LOAD_S and SHADOWKV_SOAK_REQUESTS."""
import asyncio
import os
from dataclasses import replace

import pytest

from benchmarks.load import LoadConfig, load_in_rounds, run_load, warm_up
from serve_app.local import local_service
from shadowkv_core.tiny_model import build_tiny_model
from support.serve import assert_engine_drains

pytestmark = pytest.mark.slow
APP = "load"
LOAD_S = float(os.environ.get("SHADOWKV_LOAD_S", 15))
SOAK_REQUESTS = int(os.environ.get("SHADOWKV_SOAK_REQUESTS", 150))
SOAK_ROUNDS = 3
# Drained, the replica has handed its free heap back (malloc_trim), so RSS returns to the baseline but for settling:
# +0.8 MiB over 150 requests, +3.2 MiB over the first 334 of 1,000 and flat after. A leak of 55 KiB a request fails
# here; a smaller one shows in the long soak's slope (docs/reliability.md).
RSS_TOLERANCE = 8 << 20
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


def _cfg(url: str, **overrides) -> LoadConfig:
    cfg = LoadConfig(url=url, model="tiny", concurrency=6, max_tokens=(4, 48), request_timeout_s=60, mix=MIX)
    return replace(cfg, **overrides)


def _load(url: str, **overrides) -> dict:
    return asyncio.run(run_load(_cfg(url, **overrides)))


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
    asyncio.run(warm_up(_cfg(url), 30))  # the host store's high-water, then allocator and caches settle
    before = assert_engine_drains(APP, within_s=5.0)["rss_bytes"]
    cfg = _cfg(url, duration_s=max(600, SOAK_REQUESTS), max_requests=SOAK_REQUESTS, stream_share=0.5)
    summary, series = load_in_rounds(cfg, APP, -(-SOAK_REQUESTS // SOAK_ROUNDS))
    assert summary["requests"] == SOAK_REQUESTS and summary["lost"] == 0 and summary["error"] == 0, summary
    assert_engine_drains(APP, within_s=5.0)
    rss = [round(p["rss_bytes"] / 2**20, 1) for p in series]
    print(f"soak: {summary}; engine RSS {before / 2**20:.1f} MiB, drained after each round {rss}")  # docs' figures
    assert all(abs(p["rss_bytes"] - before) < RSS_TOLERANCE for p in series), (before / 2**20, rss)
