import pytest
import torch

from shadowkv_core import LLM, EngineConfig, SamplingParams, ShadowKVConfig
from shadowkv_core.cache.allocator import BlockAllocator
from shadowkv_core.cache.base import AttentionMetadata, CacheSpec
from shadowkv_core.cache.dense import DenseKVCache
from shadowkv_core.cache.prefix import PrefixIndex, block_hashes
from shadowkv_core.tiny_model import build_tiny_model
from support.prefix_cache import assert_bad_input_changes_nothing, record_prefills

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_cache(num_blocks=8, block_size=4):
    spec = CacheSpec(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8, scale=8 ** -0.5)
    return DenseKVCache(spec, num_blocks=num_blocks, block_size=block_size, prefix_caching=True)


def prefilled(cache, seq_id, prompt, max_new=0):
    """Allocate a sequence for `prompt` and run its (suffix) prefill through one layer; returns its cached tokens."""
    cached = cache.manager.allocate(seq_id, len(prompt), max_new, prompt)
    n = len(prompt) - cached
    meta = AttentionMetadata(True, [seq_id], [n], [cached], torch.arange(cached, len(prompt)))
    x = torch.randn(n, 2, 8)
    cache.attend(0, x, x[:, :1], x[:, :1], x[:, :1], meta)
    cache.finish_forward(meta)
    return cached


# ---- block hashes and the index ------------------------------------------------------------------------------------
def test_block_hashes_chain_whole_blocks_only():
    a = list(block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4))
    assert len(a) == 2  # the ninth token fills no block
    assert list(block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)) == a
    b = list(block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4))
    assert b[0] != a[0] and b[1] != a[1]  # same second block, other prefix: another name
    assert list(block_hashes([5, 6, 7, 8], 4))[0] != a[1]


def test_index_refcounts_evicts_unreferenced_tail_first_and_never_a_held_unit():
    index = PrefixIndex(BlockAllocator(4, what="units"), enabled=True)
    hashes = list(block_hashes(list(range(12)), 4))
    units = index.alloc(3)
    for h, u in zip(hashes, units):
        index.insert(h, u)
    assert index.lookup(iter(hashes), 3) == units and index.lookup(iter(hashes), 2) == units[:2]
    index.acquire(units[:2])  # a second holder of the first two blocks
    index.release(units)
    assert [index.refs(u) for u in units] == [1, 1, 0] and index.num_available == 2
    with pytest.raises(MemoryError):
        index.alloc(3)
    assert index.lookup(iter(hashes), 3) == units and index.evictions == 0  # the refusal evicted nothing
    got = index.alloc(2)  # the free unit, and the only unreferenced cached one
    assert units[2] in got and index.evictions == 1 and index.lookup(iter(hashes), 3) == units[:2]
    index.release(units[:2])
    index.release(got)
    assert sorted(index.alloc(2)) == sorted(got) and index.evictions == 1  # free units go before cached ones
    index.release(got)
    assert index.clear() == 2 and index.allocator.num_free == 4 and index.num_cached == 0


def test_index_refuses_to_index_a_unit_no_one_holds_and_disabled_indexes_nothing():
    index = PrefixIndex(BlockAllocator(2), enabled=True)
    h = next(block_hashes([1, 2], 2))
    with pytest.raises(ValueError, match="not held"):
        index.insert(h, 0)
    with pytest.raises(ValueError, match="not in the prefix index"):
        index.acquire([0])
    off = PrefixIndex(BlockAllocator(2), enabled=False)
    (u,) = off.alloc(1)
    off.insert(h, u)
    off.release([u])
    assert off.lookup(iter([h]), 1) == [] and off.allocator.num_free == 2


# ---- the dense manager ---------------------------------------------------------------------------------------------
def test_a_prefix_ending_mid_block_reuses_the_whole_blocks_before_it():
    cache = make_cache()
    doc = tokens(10, 0)  # two full blocks of 4 and two tokens
    assert prefilled(cache, 0, doc) == 0
    assert prefilled(cache, 1, doc + [7, 7, 7]) == 8
    manager = cache.manager
    assert manager.block_tables[1][:2] == manager.block_tables[0][:2]
    assert manager.block_tables[1][2] != manager.block_tables[0][2]  # the part-filled block is never shared
    assert cache.stats()["prefix_hit_tokens"] == 8 and cache.stats()["prefix_query_tokens"] == 23


def test_a_whole_cached_prompt_still_prefills_its_last_block():
    cache = make_cache()
    doc = tokens(8, 1)
    prefilled(cache, 0, doc)
    assert prefilled(cache, 1, doc) == 4  # the last token's logits need a forward: its block is recomputed
    assert prefilled(cache, 2, doc[:7]) == 4


def test_shared_blocks_are_never_written():
    cache = make_cache()
    doc = tokens(8, 2)
    prefilled(cache, 0, doc, max_new=4)
    cache.manager.allocate(1, 9, 0, doc + [3])
    meta = AttentionMetadata(True, [1], [2], [7], torch.arange(7, 9))  # a forward that would rewrite token 7
    x = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="cached prefix"):
        cache.attend(0, x, x[:, :1], x[:, :1], x[:, :1], meta)
    meta = AttentionMetadata(False, [0], [1], [3], torch.tensor([3]))  # sequence 0's own prompt is shared now too
    with pytest.raises(RuntimeError, match="cached prefix"):
        cache.attend(0, x[:1], x[:1, :1], x[:1, :1], x[:1, :1], meta)


def test_cached_blocks_never_refuse_a_request_that_fits_without_them():
    cache = make_cache(num_blocks=4)
    manager = cache.manager
    prefilled(cache, 0, tokens(16, 3))
    manager.free(0, tokens(16, 3))
    assert cache.stats()["prefix_cached_bytes"] == 4 * manager.blocks.unit_bytes
    assert cache.stats()["gpu_bytes_in_use"] == 0  # cached, held by no one: free to take
    other = tokens(13, 4)
    assert manager.can_allocate(13, 3, other)
    prefilled(cache, 1, other, max_new=3)
    assert manager.index.evictions == 4 and cache.stats()["prefix_cached_bytes"] == 3 * manager.blocks.unit_bytes


def test_a_prefix_in_use_is_never_evicted():
    cache = make_cache(num_blocks=4)
    manager = cache.manager
    doc = tokens(9, 5)
    prefilled(cache, 0, doc, max_new=3)  # 3 blocks; its first two are indexed and held
    assert not manager.can_allocate(8, 0, tokens(8, 6))
    with pytest.raises(MemoryError):
        manager.allocate(1, 8, 0, tokens(8, 6))
    assert manager.index.evictions == 0
    assert prefilled(cache, 2, doc[:8] + [1], max_new=3) == 8  # sharing it, the same request fits: one new block
    assert [manager.index.refs(u) for u in manager.block_tables[0]] == [2, 2, 1]


def test_freed_sequences_leave_their_generated_blocks_and_pools_come_back_whole():
    cache = make_cache()
    manager = cache.manager
    prompt, generated = tokens(6, 7), tokens(4, 8)
    prefilled(cache, 0, prompt, max_new=4)
    for i, t in enumerate(generated[:3]):  # decode: the cache then holds prompt + the first three generated tokens
        meta = AttentionMetadata(False, [0], [1], [6 + i], torch.tensor([6 + i]))
        x = torch.randn(1, 2, 8)
        cache.attend(0, x, x[:, :1], x[:, :1], x[:, :1], meta)
        cache.finish_forward(meta)
    manager.free(0, prompt + generated)
    assert manager.index.num_cached == 2  # tokens 0-7: the prompt's block and the one the decode filled
    assert manager.can_allocate(10, 0, prompt + generated) and prefilled(cache, 1, prompt + generated) == 8
    manager.free(1, None)  # a failed sequence keeps nothing new
    assert manager.index.num_cached == 2 and manager.clear_prefix_cache() == 2
    assert manager.blocks.num_free == manager.blocks.num_blocks and cache.stats()["gpu_bytes_in_use"] == 0


# ---- the engine ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1))


@pytest.fixture(scope="module")
def cold(tiny_path):
    return LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, enable_prefix_caching=False)


def engine_llm(tiny_path, **kwargs):
    return LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, **kwargs)


def settled(engine):
    """Every pool back to its baseline once the cache is cleared: no sequence, no block held or indexed."""
    engine.clear_prefix_cache()
    manager = getattr(engine.cache.manager, "dense", engine.cache.manager)  # a ShadowKV engine's dense side
    stats = engine.stats()
    return (stats["num_running"], stats["num_seqs"], stats["gpu_bytes_in_use"], stats["prefix_cached_bytes"],
            manager.blocks.num_free, manager.index.num_in_use) == (0, 0, 0, 0, manager.blocks.num_blocks, 0)


def test_prompts_over_a_cached_prefix_prefill_only_their_suffix_and_give_the_cold_tokens(tiny_path, cold, monkeypatch):
    llm = engine_llm(tiny_path)
    seen = record_prefills(llm.engine, monkeypatch)
    doc = tokens(70, 10)  # four full blocks and six tokens
    prompts = [doc + tokens(5, 11), doc + tokens(1, 12), doc]  # the last two prefill 7 and 6 tokens: one bucket
    want = [o.token_ids for o in cold.generate(prompts, GREEDY)]
    assert llm.generate([prompts[0]], GREEDY)[0].token_ids == want[0]
    assert [o.token_ids for o in llm.generate(prompts[1:], GREEDY)] == want[1:]
    assert seen == [([0], [75]), ([64, 64], [7, 6])]
    stats = llm.engine.stats()
    assert stats["prefix_hit_tokens"] == 128 and stats["prefix_query_tokens"] == 75 + 71 + 70
    assert settled(llm.engine)


def test_requests_share_a_running_prefix_then_diverge(tiny_path, cold, monkeypatch):
    llm = engine_llm(tiny_path)
    engine = llm.engine
    seen = record_prefills(engine, monkeypatch)
    doc = tokens(48, 13)
    prompts = {"a": doc + tokens(3, 14), "b": doc + tokens(12, 15), "c": doc + tokens(9, 16)}  # b, c: one bucket
    want = dict(zip(prompts, (o.token_ids for o in cold.generate(list(prompts.values()), GREEDY))))
    engine.add_request("a", prompts["a"], GREEDY)
    engine.step()  # a's prefill runs and indexes its full blocks; it now decodes
    engine.add_request("b", prompts["b"], GREEDY)
    engine.add_request("c", prompts["c"], GREEDY)
    outs = {}
    outs.update({o.request_id: o for o in engine.step() if o.finished})
    table = engine.cache.manager.block_tables
    shared = table[0][:3]
    assert table[1][:3] == shared and table[2][:3] == shared
    assert [engine.cache.manager.index.refs(u) for u in shared] == [3, 3, 3]
    assert len({tuple(t[3:]) for t in table.values()}) == 3  # after the prefix each writes blocks of its own
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert {k: o.token_ids for k, o in outs.items()} == want
    assert seen == [([0], [51]), ([48, 48], [12, 9])]
    assert settled(engine)


def test_readers_of_a_cached_document_are_admitted_together_by_the_tokens_they_prefill(tiny_path, cold, monkeypatch):
    """The prefill budget and the length buckets count prefilled tokens, not whole prompts: three prompts over a
    cached 64-token document and a short cold one, 18 tokens to prefill in all, share one prefill under a budget
    smaller than the two document prompts whole."""
    llm = LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, max_prefill_tokens=100)
    engine = llm.engine
    seen = record_prefills(engine, monkeypatch)
    doc = tokens(64, 20)
    prompts = [doc + tokens(5, 21), tokens(6, 22), doc + tokens(7, 23)]
    want = [o.token_ids for o in cold.generate(prompts, GREEDY)]
    llm.generate([doc + tokens(3, 24)], GREEDY)  # the document is cached from here on
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert seen[1:] == [([64, 0, 64], [5, 6, 7])]
    assert settled(engine)


def test_readers_with_questions_of_any_short_length_share_one_prefill_and_a_long_prompt_waits(tiny_path, cold,
                                                                                               monkeypatch):
    """Suffixes of 5, 40 and 300 tokens after a cached document (three power-of-two buckets apart) prefill in one
    batch, in arrival order; a cold prompt of 1,100 tokens, past SHORT_PREFILL_TOKENS, does not ride with them."""
    llm = LLM(model=tiny_path, max_num_seqs=8, max_model_len=2048, gpu_cache_gib=0.05)
    engine = llm.engine
    seen = record_prefills(engine, monkeypatch)
    doc = tokens(64, 30)
    prompts = [doc + tokens(5, 31), doc + tokens(40, 32), tokens(1100, 33), doc + tokens(300, 34)]
    llm.generate([doc + tokens(3, 35)], GREEDY)  # the document is cached from here on
    outs = llm.generate(prompts, GREEDY)
    assert seen[1:] == [([64, 64, 64], [5, 40, 300]), ([0], [1100])]
    wide = LLM(model=tiny_path, max_num_seqs=4, max_model_len=2048, gpu_cache_gib=0.05, enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in wide.generate(prompts, GREEDY)]
    assert settled(engine)


def test_the_prefill_budget_still_counts_whole_prompts_without_a_cached_prefix(tiny_path, monkeypatch):
    llm = LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, max_prefill_tokens=100)
    seen = record_prefills(llm.engine, monkeypatch)
    llm.generate([tokens(69, 25), tokens(70, 26), tokens(71, 27)], GREEDY)
    assert seen == [([0], [69]), ([0], [70]), ([0], [71])]


def test_a_later_turn_reuses_the_earlier_turns_generated_tokens(tiny_path, cold):
    llm = engine_llm(tiny_path)
    turn1 = tokens(40, 17)
    answer = llm.generate([turn1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
    turn2 = turn1 + answer + tokens(6, 18)
    assert llm.generate([turn2], GREEDY)[0].token_ids == cold.generate([turn2], GREEDY)[0].token_ids
    # the cache held turn 1's 40 prompt tokens and 29 of its answer: four full blocks
    assert llm.engine.stats()["prefix_hit_tokens"] == 64
    assert settled(llm.engine)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_async_decode_leaves_blocks_whose_tokens_are_those_it_cached(tiny_path, device):
    """Under async decode a request ends with a step still in flight: the blocks it leaves must hold exactly the
    tokens it reports. The next turn, over them, gives the cold tokens (on CUDA: the kernels, graphs and all)."""
    llms = {on: LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, device=device,
                    async_decode=True, enable_prefix_caching=on) for on in (True, False)}
    turn1 = tokens(37, 24)
    stop = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    answer = llms[True].generate([turn1], stop)[0].token_ids
    assert answer == llms[False].generate([turn1], stop)[0].token_ids
    turn2 = turn1 + answer + tokens(5, 25)
    assert llms[True].generate([turn2], GREEDY)[0].token_ids == llms[False].generate([turn2], GREEDY)[0].token_ids
    assert llms[True].engine.stats()["prefix_hit_tokens"] == 64  # 37 + 39 cached tokens: four full blocks
    assert settled(llms[True].engine)


def test_abort_during_a_suffix_prefill_frees_it_and_keeps_the_prefix(tiny_path, cold, monkeypatch):
    # about 16 rows of the tiny model's projection per step: beside a decode, a 40-token suffix takes several steps
    llm = engine_llm(tiny_path, prefill_step_tflop=2.5e-7)
    engine = llm.engine
    seen = record_prefills(engine, monkeypatch)
    doc = tokens(32, 19)
    llm.generate([doc + [1]], GREEDY)
    engine.add_request("busy", tokens(5, 21), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    engine.step()
    prompt = doc + tokens(40, 20)
    engine.add_request("doomed", prompt, GREEDY)
    engine.step()
    assert engine.prefill_job is not None and [s.request_id for s in engine.prefill_job.seqs] == ["doomed"]
    engine.abort("doomed")
    engine.abort("busy")
    assert engine.prefill_job is None and engine.stats()["gpu_bytes_in_use"] == 0
    manager = engine.cache.manager
    assert manager.index.num_cached == 2  # the doc's two blocks, not the aborted suffix's half-written ones
    assert llm.generate([prompt], GREEDY)[0].token_ids == cold.generate([prompt], GREEDY)[0].token_ids
    assert seen[2:] == [([32], [40]), ([32], [40])]
    assert settled(engine)


def test_bad_input_is_refused_as_before_and_changes_nothing_cached(tiny_path):
    llm = engine_llm(tiny_path)
    engine = llm.engine
    doc = tokens(40, 21)
    llm.generate([doc], GREEDY)
    assert_bad_input_changes_nothing(engine, doc, doc * 13)


def test_prefix_caching_off_prefills_every_prompt_whole(tiny_path, monkeypatch):
    llm = engine_llm(tiny_path, enable_prefix_caching=False)
    seen = record_prefills(llm.engine, monkeypatch)
    doc = tokens(40, 22)
    llm.generate([doc], GREEDY)
    llm.generate([doc + [3]], GREEDY)
    assert seen == [([0], [40]), ([0], [41])]
    stats = llm.engine.stats()
    assert (stats["prefix_hit_tokens"], stats["prefix_cached_bytes"]) == (0, 0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(model=tiny_path, enable_prefix_caching="yes")


def test_the_replicas_prefix_stats_reach_prometheus(tiny_path):
    from serve_app.metrics import ServiceMetrics
    llm = engine_llm(tiny_path)
    doc = tokens(40, 23)
    llm.generate([doc], GREEDY)
    llm.generate([doc + [5]], GREEDY)
    reports = [llm.engine.stats(), {"prefix_hit_tokens": 16, "prefix_evictions": 2}]
    text = ServiceMetrics().render(reports, 0, 0).decode()
    cached = llm.engine.stats()["prefix_cached_bytes"]
    for line in ("shadowkv_prefix_hit_tokens 48.0", "shadowkv_prefix_query_tokens 81.0",
                 f"shadowkv_prefix_cached_bytes {float(cached)}", "shadowkv_prefix_evictions 2.0"):
        assert line in text, line
    assert cached > 0


def test_the_memory_model_counts_what_a_prefill_after_a_cached_prefix_reads(tiny_path, monkeypatch):
    from shadowkv_core import memory_model as mm
    llm = engine_llm(tiny_path)
    engine = llm.engine
    doc = tokens(64, 26)
    llm.generate([doc + [1]], GREEDY)
    read = []
    load = engine.cache._load

    def spy(layer, rows):
        keys, values = load(layer, rows)
        read.append(keys.nbytes + values.nbytes)
        return keys, values

    monkeypatch.setattr(engine.cache, "_load", spy)
    llm.generate([doc + tokens(7, 27)], GREEDY)
    g = mm.Geometry.from_spec(engine.spec, torch.float32, "auto")
    extra = mm.prefill_workspace_bytes(g, None, 7, 8192, 64) - mm.prefill_workspace_bytes(g, None, 7, 8192)
    assert read and max(read[:engine.runner.num_layers]) == extra  # the prefill's layers read first


def test_a_shadowkv_engine_caches_the_prefixes_of_its_dense_and_its_shadow_sequences(tiny_path, monkeypatch):
    shadow = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=4096, outlier_chunks=2, local_chunks=2,
                            min_context=128, decode_window=16)  # full rank and budget: the dense tokens exactly
    llm = engine_llm(tiny_path, shadowkv=shadow)
    cold_llm = engine_llm(tiny_path, shadowkv=shadow, enable_prefix_caching=False)
    seen = record_prefills(llm.engine, monkeypatch)
    short, long = tokens(48, 28), tokens(150, 29)
    prompts = [short, short + [4, 5], long, long + [6]]
    want = [o.token_ids for o in cold_llm.generate(prompts, GREEDY)]
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == want
    # the long prompt's shadow held two whole pages of 64 tokens (tests/test_shadowkv_prefix_cache.py: the shadow side)
    assert [s for s, _ in seen] == [[0], [48], [0], [128]]
    assert llm.engine.clear_prefix_cache() > 0 and settled(llm.engine)
    assert llm.engine.stats()["host_bytes_in_use"] == 0


def test_a_request_asking_prompt_logprobs_prefills_whole_over_a_cached_prefix(tiny_path, cold, monkeypatch):
    """Prompt logprobs need every prompt position's hidden state: such a request skips the cached prefix."""
    llm = engine_llm(tiny_path)
    seen = record_prefills(llm.engine, monkeypatch)
    doc = tokens(70, 13)
    llm.generate([doc + tokens(3, 14)], GREEDY)
    asking = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    prompt = doc + tokens(6, 15)
    got, want = llm.generate([prompt], asking)[0], cold.generate([prompt], asking)[0]
    assert seen == [([0], [73]), ([0], [76])]
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
    assert [p.logprob for p in got.prompt_logprobs[1:]] == \
        pytest.approx([p.logprob for p in want.prompt_logprobs[1:]], abs=1e-5)
    assert [p.rank for p in got.prompt_logprobs[1:]] == [p.rank for p in want.prompt_logprobs[1:]]
    assert got.token_ids == want.token_ids
    assert settled(llm.engine)


def test_a_waiting_prompt_is_hashed_once_however_often_it_is_looked_up(tiny_path, monkeypatch):
    """Admission looks a waiting prompt up at every pass and again to allocate it: its block hashes are computed once."""
    import shadowkv_core.cache.prefix as prefix

    hashed = []

    def counting(token_ids, block_size, parent=b""):
        hashed.append(len(token_ids))
        return block_hashes(token_ids, block_size, parent)

    monkeypatch.setattr(prefix, "block_hashes", counting)
    llm = engine_llm(tiny_path)
    doc = tokens(70, 16)
    llm.generate([doc + tokens(4, 17)], GREEDY)
    prompts = [doc + tokens(6, 18), doc + tokens(8, 19)]
    before = len(hashed)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{i}", prompt, GREEDY)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert hashed[before:].count(76) == 1 and hashed[before:].count(78) == 1  # each prompt's whole list, once
    assert llm.engine.stats()["prefix_hit_tokens"] == 2 * 64
    assert settled(llm.engine)
