"""Prefix-affinity routing on two engine replicas of a real local Ray Serve instance: a conversation's turns go to
the replica that holds its prefix, which the usage's cached tokens show."""
import asyncio

import httpx
import pytest

from serve_app.local import local_service
from shadowkv_core.tiny_model import build_tiny_model

REPLICAS, SLOTS_PER_REPLICA, BLOCK = 2, 2, 16


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))
    args = {"model": model, "served_model_name": "tiny", "max_num_seqs": SLOTS_PER_REPLICA, "max_model_len": 1024,
            "num_cpus": 0, "min_replicas": REPLICAS, "max_replicas": REPLICAS, "max_waiting": 16,
            "engine": {"gpu_cache_gib": 0.02, "block_size": BLOCK}}
    with local_service(args, "affinity", replicas=REPLICAS) as base:  # both replicas have reported
        yield base


def test_a_conversations_turns_land_on_the_replica_holding_its_prefix(url):
    """Four conversations at once, six turns each, on two replicas of two slots: a turn served where the previous
    one was finds every full block of that turn's prompt in the prefix cache (the byte-level tokenizer keeps a
    prompt's tokens a prefix of the next turn's); anywhere else it finds at most what it left there earlier."""
    conversations, turns = 4, 6

    async def converse(http: httpx.AsyncClient, c: int) -> list[tuple[int, int]]:
        prompt, landed = f"conversation {c}: " + "about the document " * 4, []
        for t in range(turns):
            prompt += f"question {t} of conversation {c}, please answer briefly. "
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            landed.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
        return landed

    async def all_conversations():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*(converse(http, c) for c in range(conversations)))

    later_turns = [(before, cached) for landed in asyncio.run(all_conversations())
                   for (before, _), (_, cached) in zip(landed, landed[1:])]
    on_holder = sum(cached >= before // BLOCK * BLOCK for before, cached in later_turns)
    assert on_holder >= 0.9 * len(later_turns), later_turns
