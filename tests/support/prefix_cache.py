"""What both prefix caches' tests share (dense blocks, ShadowKV pages)."""
import pytest

from shadowkv_core import SamplingParams


def assert_bad_input_changes_nothing(engine, doc: list[int], too_long: list[int]) -> None:
    """Requests over a cached document that are refused (a token outside the vocabulary, a prompt past
    max_model_len, max_tokens past it) raise naming their field and leave the engine's stats, the cache's among them,
    as they were."""
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    before = engine.stats()
    for prompt, params, field in ((doc + [10_000], greedy, "prompt"), (too_long, greedy, "prompt"),
                                  (doc, SamplingParams(max_tokens=480), "max_tokens")):
        with pytest.raises(ValueError, match=field):
            engine.add_request("bad", prompt, params)
    assert engine.stats() == before and "bad" not in engine.requests


def record_prefills(engine, monkeypatch):
    """(context_lens, query_lens) of every prefill job the engine starts."""
    seen = []
    start = engine.runner.start_prefill

    def spy(seqs):
        job = start(seqs)
        seen.append((list(job.meta.context_lens), list(job.meta.query_lens)))
        return job

    monkeypatch.setattr(engine.runner, "start_prefill", spy)
    return seen
