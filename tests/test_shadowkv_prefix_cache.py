"""Prefix caching of sequences kept in shadows: a prompt over cached pages adopts them (GPU U-row/landmark pages and
value pages, shared and reference-counted, with the basis and outliers of the sequence that indexed them) and
prefills only its suffix. At full rank and a budget covering the context ShadowKV is exact, so a request served from
the cache must give the cold request's greedy tokens; tiny model, fp32, CPU."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from shadowkv_core import LLM, SamplingParams, ShadowKVConfig
from shadowkv_core.models.prefill_cost import PrefillBudget
from shadowkv_core.shadowkv.host_store import HostValueStore
from shadowkv_core.shadowkv import prefill
from shadowkv_core.shadowkv.prefill import fetch_prefix_values
from shadowkv_core.tiny_model import build_tiny_model
from support.prefix_cache import assert_bad_input_changes_nothing, record_prefills

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
DECODING = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)  # a request decoding beside a prefill
# full rank (Hkv * head_dim = 2 * 16) and a sparse budget covering every context here; pages of 64 tokens
EXACT = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=4096, outlier_chunks=2, local_chunks=2, min_context=128,
                       decode_window=16)
PAGE = 64


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1))


def engine_llm(tiny_path, shadow=EXACT, **kwargs):
    return LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, shadowkv=shadow, **kwargs)


@pytest.fixture(scope="module")
def cold(tiny_path):
    return engine_llm(tiny_path, enable_prefix_caching=False)


def record_logits(engine, monkeypatch):
    """The last-token logits (B, vocab) of every prefill the engine finishes."""
    seen = []
    advance = engine.runner.advance_prefill

    def spy(job, flops):
        out = advance(job, flops)
        if out is not None:
            seen.append(out.clone())
        return out

    monkeypatch.setattr(engine.runner, "advance_prefill", spy)
    return seen


def served_like_cold(llm, cold_llm, prompt, params, monkeypatch):
    """llm's tokens for the prompt, once checked against cold_llm's, and its prefill's last-token logits too (a tiny
    model's greedy tokens would hide small errors in the keys)."""
    with monkeypatch.context() as m:
        got_logits, want_logits = record_logits(llm.engine, m), record_logits(cold_llm.engine, m)
        got = llm.generate([prompt], params)[0].token_ids
        assert got == cold_llm.generate([prompt], params)[0].token_ids
    torch.testing.assert_close(got_logits[-1], want_logits[-1], rtol=1e-4, atol=1e-4)
    return got


def shadow_of(engine):
    return engine.cache.manager.shadow


def indexes(manager):
    return manager.gpu_index, manager.host_index, manager.device_index


def consistent(manager):
    """Each indexed page's GPU page and value page are indexed together, and named with a record; the cached bytes
    usage() reports (kept as pages come and go) are those of the pages and of their records' distinct tensors now
    (a later turn's record shares the basis it adopted)."""
    gpu, host, device = indexes(manager)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for _, record in manager.cached.values() for t in record.tensors}
    cached_bytes = (gpu.num_cached * manager.gpu_pages.unit_bytes
                    + (host.num_cached + device.num_cached) * manager.host_pages.unit_bytes + sum(storages.values()))
    return (len(manager.cached) == gpu.num_cached == host.num_cached + device.num_cached
            and manager.usage()["prefix_cached_bytes"] == cached_bytes)


def settled(engine):
    """Every pool of both sides back to its baseline once the cache is cleared: nothing held, indexed or recorded."""
    engine.clear_prefix_cache()
    shadow, dense = shadow_of(engine), engine.cache.manager.dense
    pools = (shadow.slots, shadow.gpu_pages, shadow.host_pages, shadow.device_value_pages, dense.blocks)
    stats = engine.stats()
    return (all(p.num_free == p.num_blocks for p in pools)
            and all(i.num_in_use == 0 and i.num_cached == 0 for i in indexes(shadow) + (dense.index,))
            and not shadow.seqs and not shadow.cached
            and (stats["num_running"], stats["num_seqs"], stats["gpu_bytes_in_use"], stats["host_bytes_in_use"],
                 stats["prefix_cached_bytes"]) == (0, 0, 0, 0, 0))


def run_all(engine):
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return outs


def test_prompts_over_a_cached_shadow_prefix_prefill_only_their_suffix_and_give_the_cold_tokens(tiny_path, cold,
                                                                                              monkeypatch):
    llm = engine_llm(tiny_path)
    seen = record_prefills(llm.engine, monkeypatch)
    logits = record_logits(llm.engine, monkeypatch)
    doc = tokens(300, 1)  # its shadow holds four whole pages
    prompts = [doc + tokens(7, 2), doc + tokens(9, 3), doc + tokens(40, 4)]
    with monkeypatch.context() as m:
        cold_logits = record_logits(cold.engine, m)
        want = [cold.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert llm.generate([prompts[0]], GREEDY)[0].token_ids == want[0]
    llm.generate([tokens(200, 35)], GREEDY)  # another sequence's prefill overwrites the slot the document's had
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts[1:]] == want[1:]
    assert seen == [([0], [307]), ([0], [200]), ([256], [53]), ([256], [84])]
    for got, cold_one in zip(logits[2:], cold_logits[1:]):  # the readers' first tokens: the same distribution
        torch.testing.assert_close(got, cold_one, rtol=1e-4, atol=1e-4)
    stats = llm.engine.stats()
    assert stats["prefix_hit_tokens"] == 512 and stats["prefix_query_tokens"] == 307 + 200 + 309 + 340
    assert consistent(shadow_of(llm.engine)) and stats["prefix_cached_bytes"] > 0
    assert settled(llm.engine)


def test_a_conversation_reuses_each_turns_prompt_and_answer(tiny_path, cold, monkeypatch):
    """Three turns, each the last one's prompt and answer and a few new tokens: each turn adopts the pages the last
    one's answer filled too (folded into the shadow as it was generated), and gives the cold tokens."""
    shadow = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=4096, outlier_chunks=2, local_chunks=2,
                            min_context=128, decode_window=16, page_chunks=4)  # pages of 16 tokens
    llm, cold_llm = engine_llm(tiny_path, shadow), engine_llm(tiny_path, shadow, enable_prefix_caching=False)
    seen = record_prefills(llm.engine, monkeypatch)
    answer = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompt = tokens(150, 5)
    for turn in range(3):
        got = served_like_cold(llm, cold_llm, prompt, answer, monkeypatch)
        previous, prompt = prompt, prompt + got + tokens(6, 6 + turn)
    contexts = [c for (c,), _ in seen]
    assert contexts[0] == 0 and contexts[1] > 0 and contexts[2] > contexts[1]
    # more than the pages of the earlier turn's prompt alone: the answer's pages were adopted too
    assert contexts[2] > (len(previous) - len(got) - 6) // 16 * 16
    assert all(c % 16 == 0 for c in contexts)
    # every turn's record holds the first turn's basis (adopted, never copied), counted once in the cached bytes
    manager = shadow_of(llm.engine)
    records = {id(record): record for _, record in manager.cached.values()}
    assert len(records) == 3 and len({record.sv[0].data_ptr() for record in records.values()}) == 1
    assert consistent(manager)
    assert settled(llm.engine)


def test_requests_share_a_running_prefix_then_diverge(tiny_path, cold, monkeypatch):
    """b and c read a's cached prefix, prefilled together: its keys are rebuilt and its values read once a layer for
    both; the pages are shared, counted once, and each gets its cold tokens."""
    llm = engine_llm(tiny_path)
    engine = llm.engine
    doc = tokens(280, 7)
    prompts = {"a": doc + tokens(3, 8), "b": doc + tokens(12, 9), "c": doc + tokens(9, 10)}
    want = dict(zip(prompts, (o.token_ids for o in cold.generate(list(prompts.values()), GREEDY))))
    engine.add_request("a", prompts["a"], GREEDY)
    engine.step()  # a's prefill runs and indexes the whole pages of its shadow; it now decodes
    engine.add_request("b", prompts["b"], GREEDY)
    engine.add_request("c", prompts["c"], GREEDY)
    rebuilt = []
    rebuild = prefill.prefix_keys_values
    monkeypatch.setattr(prefill, "prefix_keys_values", lambda cache, layer, st, *a: rebuilt.append(st.slot) or
                        rebuild(cache, layer, st, *a))
    outs = {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert len(rebuilt) == engine.spec.num_layers and len(set(rebuilt)) == 1
    manager = shadow_of(engine)
    seqs = [manager.seqs[i] for i in range(3)]
    shared = seqs[0].gpu_pages[:4]
    assert [st.cached for st in seqs] == [0, 256, 256]
    assert all(st.gpu_pages[:4] == shared and st.value_pages[:4] == seqs[0].value_pages[:4] for st in seqs)
    assert [manager.gpu_index.refs(p) for p in shared] == [3] * 4
    assert len({p for st in seqs for p in st.gpu_pages[4:]}) == sum(len(st.gpu_pages) - 4 for st in seqs)
    # shared pages count once
    held = len(shared) + sum(len(st.gpu_pages) - 4 for st in seqs)
    stats = engine.stats()
    assert stats["host_bytes_in_use"] == held * manager.host_pages.unit_bytes
    assert stats["gpu_bytes_in_use"] == held * manager.gpu_pages.unit_bytes + 3 * manager.slots.unit_bytes
    outs.update(run_all(engine))
    assert outs == want
    assert settled(engine)


def test_a_prefix_ending_mid_page_reuses_the_whole_pages_before_it(tiny_path, cold, monkeypatch):
    llm = engine_llm(tiny_path)
    seen = record_prefills(llm.engine, monkeypatch)
    doc = tokens(300, 11)
    llm.generate([doc], GREEDY)
    prompt = doc[:150] + tokens(60, 12)  # shares two whole pages and 22 tokens of the third
    served_like_cold(llm, cold, prompt, GREEDY, monkeypatch)
    assert seen[1] == ([128], [82])
    assert settled(llm.engine)


def test_the_page_of_the_prompts_last_token_is_never_adopted(tiny_path, monkeypatch):
    """Without outliers every cached page of a run is adoptable (no KV head has fewer to make up)."""
    shadow = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=4096, outlier_chunks=0, local_chunks=2,
                            min_context=128, decode_window=16)
    llm, cold_llm = engine_llm(tiny_path, shadow), engine_llm(tiny_path, shadow, enable_prefix_caching=False)
    seen = record_prefills(llm.engine, monkeypatch)
    doc = tokens(300, 11)
    llm.generate([doc], GREEDY)
    manager = shadow_of(llm.engine)
    assert manager.cached_prefix_len(4 * PAGE, 10, doc[:4 * PAGE]) == 3 * PAGE  # its last token is in page 4
    exact = doc[:4 * PAGE + 1]  # its last token opens page 5: four pages adopted, one token prefilled
    served_like_cold(llm, cold_llm, exact, GREEDY, monkeypatch)
    assert seen[1] == ([4 * PAGE], [1])
    assert settled(llm.engine)


def test_concurrent_cold_prefills_of_one_document_never_mix_their_bases(tiny_path, cold, monkeypatch):
    """Two prompts over one document prefilled cold together: the first indexes the document's pages, the second's
    stay private (its U rows are on its own basis). A later turn over the second's prompt and answer must not adopt
    the first's pages with the second's basis: it adopts what one record describes, and gives the cold tokens."""
    llm = engine_llm(tiny_path)
    engine = llm.engine
    seen = record_prefills(engine, monkeypatch)
    doc = tokens(260, 13)
    long = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    prompts = {"a": doc + tokens(30, 14), "b": doc + tokens(30, 15)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, long)
    answers = run_all(engine)
    assert seen == [([0, 0], [290, 290])]
    manager = shadow_of(engine)
    lineages = {record.lineage for _, record in manager.cached.values()}
    assert len(lineages) == 2  # b indexed the pages its answer filled, under its own record
    turn = prompts["b"] + answers["b"] + tokens(5, 16)
    served_like_cold(llm, cold, turn, GREEDY, monkeypatch)
    assert 0 < seen[-1][0][0] <= 256  # a's document pages at most: b's answer pages are on another basis
    assert settled(engine)


def test_value_pages_in_the_device_region_are_shared_and_returned_too(tiny_path, monkeypatch):
    shadow = dataclasses.replace(EXACT, device_value_share=0.5)  # each sequence's first pages there
    llm, cold_llm = engine_llm(tiny_path, shadow), engine_llm(tiny_path, shadow, enable_prefix_caching=False)
    manager = shadow_of(llm.engine)
    doc = tokens(300, 36)
    llm.generate([doc + tokens(7, 37)], GREEDY)
    assert manager.device_index.num_cached == 2 and manager.host_index.num_cached == 2 and consistent(manager)
    served_like_cold(llm, cold_llm, doc + tokens(12, 38), GREEDY, monkeypatch)
    assert llm.engine.stats()["prefix_hit_tokens"] == 4 * PAGE
    assert settled(llm.engine)


def test_a_document_read_by_running_sequences_moves_to_the_device_region_as_one_copy(tiny_path):
    """b adopts a's document pages while a runs: the three of them on the host move to free device value pages, a's
    page table and b's name the same device pages, and both give the cold tokens."""
    shadow = dataclasses.replace(EXACT, device_value_share=0.25)  # of 5 pages, the first one on the device
    llm, cold_llm = engine_llm(tiny_path, shadow), engine_llm(tiny_path, shadow, enable_prefix_caching=False)
    engine, manager = llm.engine, shadow_of(llm.engine)
    host = manager.host_pages.num_blocks
    doc = tokens(300, 40)
    prompts = {"a": doc + tokens(7, 41), "b": doc + tokens(12, 42)}
    outs = {}
    engine.add_request("a", prompts["a"], GREEDY)
    engine.step()  # a prefilled: its document's four whole pages indexed, the first on the device
    a = manager.seqs[engine.scheduler.running[0].seq_id]
    assert [p >= host for p in a.value_pages[:4]] == [True, False, False, False]
    host_free = manager.host_pages.num_free
    engine.add_request("b", prompts["b"], GREEDY)
    outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    b = next(st for st in manager.seqs.values() if st is not a)
    assert b.value_pages[:4] == a.value_pages[:4] and all(p >= host for p in a.value_pages[:4])
    assert a.value_table.tolist() == a.value_pages and b.value_table.tolist() == b.value_pages
    assert (manager.device_index.num_cached, manager.host_index.num_cached) == (4, 0) and consistent(manager)
    assert all(manager.device_index.refs(p - host) == 2 for p in a.value_pages[:4])
    assert manager.host_pages.num_free == host_free + 3 - (len(b.value_pages) - 4)  # b's own pages on the host
    outs.update(run_all(engine))
    assert outs == {rid: cold_llm.generate([p], GREEDY)[0].token_ids for rid, p in prompts.items()}
    assert settled(engine)


def host_gib(pages, manager):
    return pages * manager.host_pages.unit_bytes / 2**30


def test_a_prefix_in_use_is_never_evicted_and_a_sharer_still_fits(tiny_path):
    probe = engine_llm(tiny_path)
    llm = engine_llm(tiny_path, host_cache_gib=host_gib(8, shadow_of(probe.engine)))  # 8 host value pages
    engine = llm.engine
    manager = shadow_of(engine)
    assert manager.host_pages.num_blocks == 8
    doc = tokens(300, 17)
    engine.add_request("a", doc + tokens(7, 18), GREEDY)  # five pages; after its prefill, four of them indexed
    engine.step()
    other = tokens(300, 19)
    assert not manager.can_allocate(307, 10, other + tokens(7, 20))
    with pytest.raises(MemoryError, match="host value pages"):
        manager.allocate(99, 307, 10, other + tokens(7, 20))
    assert manager.host_index.evictions == manager.gpu_index.evictions == 0 and manager.gpu_index.num_cached == 4
    sharer = doc + tokens(9, 21)
    assert manager.can_allocate(309, 10, sharer)  # adopting the four, it needs one fresh page of the three free
    engine.add_request("b", sharer, GREEDY)
    engine.step()
    assert manager.seqs[1].cached == 256 and [manager.gpu_index.refs(p) for p in manager.seqs[0].gpu_pages] == \
        [2, 2, 2, 2, 1]
    run_all(engine)
    assert settled(engine)


def test_cached_pages_never_refuse_a_request_and_evict_their_gpu_and_value_pages_together(tiny_path):
    probe = engine_llm(tiny_path)
    llm = engine_llm(tiny_path, host_cache_gib=host_gib(7, shadow_of(probe.engine)))
    engine = llm.engine
    manager = shadow_of(engine)
    doc = tokens(300, 22)
    llm.generate([doc + tokens(7, 23)], GREEDY)
    assert manager.host_index.num_cached == 4 and engine.stats()["host_bytes_in_use"] == 0  # cached: free to take
    other = tokens(300, 24) + tokens(7, 25)  # five host pages of seven: three free, two evicted (the document's tail)
    assert manager.can_allocate(307, 10, other)
    llm.generate([other], GREEDY)
    assert manager.host_index.evictions == 2 and manager.gpu_index.evictions == 0
    assert manager.gpu_index.num_cached == 2 + 4 and consistent(manager)  # the evicted pages' GPU pages went too
    assert manager.cached_prefix_len(307, 10, doc + tokens(7, 23)) == 2 * PAGE  # the head is still cached
    assert settled(engine)


def test_abort_during_a_suffix_prefill_releases_it_and_keeps_the_prefix(tiny_path, cold, monkeypatch):
    # about 16 rows of the tiny model's projection per step: beside a decode, an 84-token suffix takes several steps
    llm = engine_llm(tiny_path, prefill_step_tflop=2.5e-7)
    engine = llm.engine
    seen = record_prefills(engine, monkeypatch)
    doc = tokens(300, 26)
    llm.generate([doc + [1]], GREEDY)
    manager = shadow_of(engine)
    before = (manager.gpu_index.num_cached, manager.host_index.num_cached, len(manager.cached))
    engine.add_request("busy", tokens(5, 39), DECODING)  # kept dense
    engine.step()
    prompt = doc + tokens(40, 27)
    engine.add_request("doomed", prompt, GREEDY)
    engine.step()
    assert engine.prefill_job is not None and [s.request_id for s in engine.prefill_job.seqs] == ["doomed"]
    assert seen[-1] == ([256], [84])
    engine.abort("doomed")
    engine.abort("busy")
    assert engine.prefill_job is None and not manager.seqs
    stats = engine.stats()
    assert (stats["gpu_bytes_in_use"], stats["host_bytes_in_use"]) == (0, 0)
    assert (manager.gpu_index.num_cached, manager.host_index.num_cached, len(manager.cached)) == before
    served_like_cold(llm, cold, prompt, GREEDY, monkeypatch)
    assert settled(engine)


@pytest.mark.gpu
def test_a_suffix_prefill_on_cuda_queues_its_layers_without_a_host_sync(tiny_path, monkeypatch):
    """On CUDA the per-layer work of a suffix prefill never waits for the device (the CPU queues every layer ahead of
    the GPU): the record is pinned, outlier counts come from it, index shapes from the host. A sync there raises
    (torch.cuda.set_sync_debug_mode)."""
    llm = engine_llm(tiny_path, device="cuda", host_cache_gib=0.05)
    cache, checked = llm.engine.cache.shadow, []

    def strict(method):
        def run(layer, q, k_pre, k_rot, v, meta):
            if not any(meta.context_lens):  # a cold prefill at full rank factorises by eigh: it waits for its stream
                return method(layer, q, k_pre, k_rot, v, meta)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return method(layer, q, k_pre, k_rot, v, meta)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                checked.append(method.__name__)
        return run

    for name in ("prefill_begin", "prefill_end"):
        monkeypatch.setattr(cache, name, strict(getattr(cache, name)))
    doc = tokens(300, 10)  # on the CPU, every layer of the second prompt makes up outliers past its four pages
    llm.generate([doc + tokens(7, 2)], GREEDY)
    llm.generate([doc + tokens(40, 4)], GREEDY)
    assert llm.engine.stats()["prefix_hit_tokens"] == 256 and {"prefill_begin", "prefill_end"} <= set(checked)


@pytest.mark.gpu
def test_a_cold_prefill_on_cuda_factorises_keys_without_waiting_for_the_work_queued_before(tiny_path, monkeypatch):
    """A cold prefill's key factorisation runs on the cache's build stream, begun with the layer's attention: at full
    rank it is an eigh, whose status check makes the host wait for that stream alone. Work queued on the current
    stream before a layer's build, here a sleeping kernel, is still running when prefill_end returns, so the
    engine's queued prefill slices and decode keep their lead."""
    llm = engine_llm(tiny_path, device="cuda", host_cache_gib=0.05)
    cache, still_running = llm.engine.cache.shadow, []

    def behind_a_sleep(method):
        def run(layer, q, k_pre, k_rot, v, meta):
            torch.cuda._sleep(2_000_000_000)  # about a second of the current stream
            slept = torch.cuda.Event()
            slept.record()
            method(layer, q, k_pre, k_rot, v, meta)
            still_running.append(not slept.query())
        return run

    monkeypatch.setattr(cache, "prefill_end", behind_a_sleep(cache.prefill_end))
    llm.generate([tokens(300, 10)], GREEDY)
    assert still_running == [True] * llm.engine.model.spec.num_layers


def test_a_suffix_prefill_sliced_over_many_steps_beside_decodes_gives_the_cold_tokens(tiny_path, cold, monkeypatch):
    """The suffix after an adopted prefix prefills by slices of a layer, a few per step, while a dense and a ShadowKV
    request decode: each attention slice sees the rebuilt prefix and the suffix so far, and the layer's end appends
    the suffix to the adopted shadow, so its tokens and last-token logits are the cold ones."""
    llm = engine_llm(tiny_path)
    engine = llm.engine
    seen = record_prefills(engine, monkeypatch)
    logits = record_logits(engine, monkeypatch)
    doc = tokens(300, 40)
    llm.generate([doc + [1]], GREEDY)
    for rid, prompt in (("dense", tokens(12, 41)), ("shadow", tokens(150, 42))):
        engine.add_request(rid, prompt, DECODING)
    while sorted(o.request_id for o in engine.step()) != ["dense", "shadow"]:  # both prefilled whole, decoding
        pass
    rows = PrefillBudget(engine.model.rank_spec).projection_row * 8  # 8 rows' worth of a layer per step
    engine.config = dataclasses.replace(engine.config, prefill_step_tflop=rows / 1e12)
    prompt = doc + tokens(70, 43)
    engine.add_request("suffix", prompt, GREEDY)
    prefilling, outs = 0, {}
    while "suffix" in engine.requests:
        got = engine.step()
        outs.update({o.request_id: o.token_ids for o in got if o.finished})
        if engine.prefill_job is not None:
            prefilling += 1
            assert sorted(o.request_id for o in got) == ["dense", "shadow"]  # each decode's token, every step
    with monkeypatch.context() as m:
        cold_logits = record_logits(cold.engine, m)
        assert outs["suffix"] == cold.generate([prompt], GREEDY)[0].token_ids
    assert seen[-1] == ([256], [114])  # four adopted pages: only the suffix prefills
    assert prefilling > 2 * 2 * 114 // 8  # two layers' projection and MLP rows alone take a step per 8 rows
    torch.testing.assert_close(logits[-1], cold_logits[-1], rtol=1e-4, atol=1e-4)
    engine.abort("dense")
    engine.abort("shadow")
    assert settled(engine)


def test_a_sliced_suffix_prefill_reads_each_layers_prefix_at_the_start_of_a_step(tiny_path, cold, monkeypatch):
    """The read of the cached prefix's values from host memory counts in the step's budget (PrefillBudget.host_read):
    one that does not fit what a step has left waits for the next step and opens it, so no step holds it after other
    slices; the tokens are still the cold ones."""
    llm = engine_llm(tiny_path)
    engine, cache = llm.engine, llm.engine.cache
    doc = tokens(300, 60)
    llm.generate([doc + [1]], GREEDY)
    engine.add_request("decoding", tokens(150, 61), DECODING)
    while not engine.step():
        pass
    rows = PrefillBudget(engine.model.rank_spec).projection_row * 8
    engine.config = dataclasses.replace(engine.config, prefill_step_tflop=rows / 1e12)
    reads, begin = [], cache.prefill_begin

    def opening_a_step(layer, q, k_pre, k_rot, v, meta):
        job = engine.prefill_job
        if meta is job.meta:
            read = cache.prefill_read_bytes(layer, meta)
            reads.append((read, job.budget.left == job.budget.granted))
        return begin(layer, q, k_pre, k_rot, v, meta)

    monkeypatch.setattr(cache, "prefill_begin", opening_a_step)
    prompt = doc + tokens(40, 62)
    engine.add_request("suffix", prompt, GREEDY)
    outs = {}
    while "suffix" in engine.requests:
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert outs["suffix"] == cold.generate([prompt], GREEDY)[0].token_ids
    assert len(reads) == engine.model.spec.num_layers
    assert all(read > 0 and opens for read, opens in reads)
    engine.abort("decoding")
    assert settled(engine)


def test_bad_input_is_refused_as_before_and_changes_nothing_cached(tiny_path):
    llm = engine_llm(tiny_path)
    engine = llm.engine
    doc = tokens(300, 28)
    llm.generate([doc], GREEDY)
    assert_bad_input_changes_nothing(engine, doc, doc * 2)
    assert settled(engine)


def test_a_request_asking_prompt_logprobs_prefills_whole_over_a_cached_shadow_prefix(tiny_path, monkeypatch):
    llm = engine_llm(tiny_path)
    seen = record_prefills(llm.engine, monkeypatch)
    doc = tokens(300, 29)
    llm.generate([doc + [1]], GREEDY)
    llm.generate([doc + [2, 3]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert seen == [([0], [301]), ([0], [302])]
    assert settled(llm.engine)


def test_prefix_caching_off_keeps_no_shadow_page(tiny_path, monkeypatch):
    llm = engine_llm(tiny_path, enable_prefix_caching=False)
    seen = record_prefills(llm.engine, monkeypatch)
    doc = tokens(300, 30)
    llm.generate([doc], GREEDY)
    llm.generate([doc + [3]], GREEDY)
    assert seen == [([0], [300]), ([0], [301])]
    manager = shadow_of(llm.engine)
    assert manager.gpu_index.num_cached == 0 and not manager.cached and manager.gpu_pages.num_free == \
        manager.gpu_pages.num_blocks


def test_at_low_rank_and_budget_adoption_runs_and_its_logits_are_finite(tiny_path, monkeypatch):
    shadow = ShadowKVConfig(rank=4, chunk_size=4, sparse_budget=8, outlier_chunks=2, local_chunks=2,
                            min_context=128, decode_window=16)
    llm = engine_llm(tiny_path, shadow)
    engine = llm.engine
    seen = record_prefills(engine, monkeypatch)
    logits = []
    advance = engine.runner.advance_prefill

    def spy(job, flops):
        out = advance(job, flops)
        if out is not None:
            logits.append(out)
        return out

    monkeypatch.setattr(engine.runner, "advance_prefill", spy)
    doc = tokens(300, 31)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)  # decodes fold the window
    llm.generate([doc + tokens(5, 32)], params)
    outs = llm.generate([doc + tokens(20, 33), doc + tokens(30, 34)], params)
    assert [c for c, _ in seen[1:]] == [[256, 256]]
    assert all(len(o.token_ids) == 30 for o in outs)
    assert logits and all(torch.isfinite(x).all() for x in logits)
    assert math.isclose(engine.stats()["prefix_hit_tokens"], 512)
    assert settled(engine)


@pytest.mark.parametrize("landmark_rebuild", [True, False])
def test_an_adopted_prefix_is_rebuilt_as_decode_rebuilds_a_chunk(tiny_path, monkeypatch, landmark_rebuild):
    """landmark_rebuild: the prefix's rebuilt keys are moved onto their chunks' bounds, as decode moves a missed
    chunk, so every key lies inside its chunk's bounds; without it, keys at rank 4 stray outside them."""
    shadow = ShadowKVConfig(rank=4, chunk_size=4, sparse_budget=8, outlier_chunks=2, local_chunks=2,
                            min_context=128, decode_window=16, landmark_rebuild=landmark_rebuild)
    llm = engine_llm(tiny_path, shadow)
    outside = []
    rebuild = prefill.prefix_keys_values

    def spy(cache, layer, st, keys, values):
        rebuild(cache, layer, st, keys, values)
        n, C = st.cached // 4, 4
        lm = cache.gpu.read_landmarks(layer, st.gpu_table, n).float()  # (n, Hkv, 2d)
        d = keys.shape[-1]
        centre, half = lm[..., :d], lm[..., d:]
        chunked = keys.float().view(n, C, -1, d)
        outside.append(int(((chunked - centre[:, None]).abs() > half[:, None] + 1e-4).sum()))

    monkeypatch.setattr(prefill, "prefix_keys_values", spy)
    doc = tokens(300, 41)
    llm.generate([doc + tokens(5, 42)], GREEDY)
    llm.generate([doc + tokens(9, 43)], GREEDY)
    assert len(outside) == len(llm.engine.model.layers)
    assert (sum(outside) == 0) == landmark_rebuild


def check_prefix_on_kernels(tiny_path, monkeypatch, landmark_rebuild, key_tol, **llm_kwargs):
    """Every layer of an adopted prefix read on the kernels (prefill.prefix_keys_values) against the reference path
    on the same state: keys within key_tol, values exact."""
    shadow = ShadowKVConfig(rank=4, chunk_size=4, sparse_budget=8, outlier_chunks=2, local_chunks=2,
                            min_context=128, decode_window=16, landmark_rebuild=landmark_rebuild)
    llm = engine_llm(tiny_path, shadow, use_kernels=True, **llm_kwargs)
    rebuild, compared = prefill.prefix_keys_values, []

    def both(cache, layer, st, keys, values):
        rebuild(cache, layer, st, keys, values)
        assert cache.spec.kernels
        reference = SimpleNamespace(**{**vars(cache), "spec": dataclasses.replace(cache.spec, use_kernels=False)})
        want_keys, want_values = torch.empty_like(keys), torch.empty_like(values)
        rebuild(reference, layer, st, want_keys, want_values)
        torch.testing.assert_close(keys, want_keys, rtol=key_tol, atol=key_tol)
        torch.testing.assert_close(values, want_values, rtol=0, atol=0)
        compared.append(layer)

    monkeypatch.setattr(prefill, "prefix_keys_values", both)
    doc = tokens(300, 51)
    llm.generate([doc + tokens(5, 52)], GREEDY)
    llm.generate([doc + tokens(9, 53)], GREEDY)
    assert compared == list(range(len(llm.engine.model.layers)))
    return llm


@pytest.mark.parametrize("landmark_rebuild,rope", [(False, None), (True, None),
                                                    (False, {"rope_type": "dynamic", "factor": 2.0})])
def test_an_adopted_prefix_on_the_kernels_equals_the_reference_path(tiny_path, tmp_path, monkeypatch,
                                                                    landmark_rebuild, rope):
    """On the kernels an adopted prefix's keys come from the decode path's fused rebuild (and its values from the
    fetch kernel), every chunk a miss: the reference path's keys and values, at a rank that leaves a real rebuild,
    also for RoPE that follows the sequence's length (past 256 positions here). Triton's interpreter on the CPU,
    fp32."""
    if rope is not None:
        tiny_path = str(build_tiny_model(tmp_path, seed=1, rope_scaling=rope, max_position_embeddings=256))
    llm = check_prefix_on_kernels(tiny_path, monkeypatch, landmark_rebuild, 1e-4)
    assert llm.engine.model.rotary.uses_seq_lens == (rope is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("landmark_rebuild", [False, True])
def test_an_adopted_prefix_on_the_kernels_equals_the_reference_path_bf16(tiny_path, monkeypatch, landmark_rebuild):
    """As above on CUDA in bf16: the fused rebuild's keys within a bf16 rounding of the reference's."""
    check_prefix_on_kernels(tiny_path, monkeypatch, landmark_rebuild, 2e-2, device="cuda", dtype="bfloat16",
                            host_cache_gib=0.05)


@pytest.mark.parametrize("fp8", [False, True])
def test_an_adopted_prefix_read_by_the_fetch_kernel_equals_the_gather(fp8):
    """On the kernels an adopted prefix's values come through the decode path's fetch kernel, every chunk of every
    KV head a miss (prefill.fetch_prefix_values), from host pages and device-region pages: what the host gather
    reads, written in place into the first rows of a prompt's (tokens, Hkv, d) values and nothing past them."""
    torch.manual_seed(5)
    C, page, Hkv, d = 4, 16, 2, 32
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU, in Triton's interpreter
    kw = dict(value_format="fp8", chunk_size=C) if fp8 else dict(chunk_size=C)
    store = HostValueStore(num_layers=2, num_pages=5, page_tokens=page, num_kv_heads=Hkv, head_dim=d,
                           dtype=torch.float16, pin=device == "cuda", num_device_pages=3, device=device, **kw)
    table = torch.tensor([5, 1, 7, 0, 3])  # device pages 0 and 2 among host pages
    store.write(slice(None), table, 0, torch.randn(2, 5 * page, Hkv, d, dtype=torch.float16))
    cache = SimpleNamespace(config=SimpleNamespace(chunk_size=C), host=store)
    st = SimpleNamespace(gpu_table=torch.zeros(1, dtype=torch.int64, device=device), value_table=table)
    n = 4 * page // C  # the first four pages' chunks
    for layer in range(2):
        values = torch.full((n * C + 3, Hkv, d), 7.0, dtype=torch.float16, device=device)  # 3 suffix rows
        fetch_prefix_values(cache, layer, st, Hkv, n, values[:n * C])
        want = store.gather(layer, table, torch.arange(n).repeat(Hkv), torch.arange(Hkv).repeat_interleave(n), C)
        torch.testing.assert_close(values[:n * C].cpu(), want.view(Hkv, n * C, d).transpose(0, 1), rtol=0, atol=0)
        assert (values[n * C:] == 7.0).all()
    store.close()
