"""The ShadowKV cache (with its dense side for short sequences, as an engine holds it), driven through `attend` on
random q/k/v: at full budget and full rank it equals dense exact attention over the whole cache, for ragged batches,
through prefill and decode steps that fold the window; at a small budget it attends exactly to the chunks it
selected."""
import pytest
import torch

from shadowkv_core import memory_model as mm
from shadowkv_core.attention import attention_ref, prefill_attention_ref
from shadowkv_core.cache.base import AttentionMetadata, CacheSpec
from shadowkv_core.cache.dense import DenseKVCache
from shadowkv_core.shadowkv.hybrid import HybridCache
from shadowkv_core.config import ShadowKVConfig
from shadowkv_core.models.rotary import RotaryEmbedding
from shadowkv_core.models.spec import ModelSpec
from shadowkv_core.shadowkv.cache import ShadowKVCache
from shadowkv_core.shadowkv.pages import GpuPages
from shadowkv_core.shadowkv.plan import PageTables
from test_shadowkv_reference import RopeForTests

L, HQ, HKV, D = 2, 4, 2, 8
SCALE = D ** -0.5


def make_cache(config: ShadowKVConfig, max_num_seqs=4, gpu_pages=64, host_pages=64, dense_blocks=64, rope=None,
               device="cpu") -> HybridCache:
    spec = CacheSpec(L, HQ, HKV, D, SCALE, torch.float32, device)
    pools = mm.Pools(max_num_seqs, dense_blocks, gpu_pages, host_pages)
    shadow = ShadowKVCache(spec, config, pools, rope or RopeForTests(D))
    return HybridCache(config, DenseKVCache(spec, dense_blocks, block_size=4), shadow)


def full_config(**overrides):
    """Budget covering every chunk, full rank: ShadowKV must equal dense attention."""
    fields = dict(rank=HKV * D, chunk_size=4, sparse_budget=128, outlier_chunks=2, local_chunks=2, min_context=0,
                  decode_window=8, page_chunks=4, device_value_share=0.0)
    return ShadowKVConfig(**{**fields, **overrides})


def states(cache: HybridCache):
    return cache.shadow.manager.seqs


class DenseOracle:
    """Every token's post-RoPE key and value per sequence and layer, attended exactly."""

    def __init__(self):
        self.k, self.v = {}, {}

    def prefill(self, layer, seq_id, q, k, v):
        self.k[layer, seq_id], self.v[layer, seq_id] = k, v
        return prefill_attention_ref(q, k, v, SCALE, chunk_tokens=16)

    def decode(self, layer, seq_id, q, k, v):
        self.k[layer, seq_id] = torch.cat([self.k[layer, seq_id], k])
        self.v[layer, seq_id] = torch.cat([self.v[layer, seq_id], v])
        return attention_ref(q, self.k[layer, seq_id], self.v[layer, seq_id], SCALE, causal=True)


def run_forward(cache, oracle, rope, seq_ids, lens, ctx, is_prefill):
    """One forward of random tokens through every layer; returns the largest |ShadowKV - dense| seen."""
    device = cache.shadow.device
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, lens)]).to(device)
    seq_lens = torch.tensor([c + n for c, n in zip(ctx, lens)]).repeat_interleave(torch.tensor(lens)).to(device)
    meta = AttentionMetadata(is_prefill, seq_ids, lens, ctx, positions)
    T = positions.shape[0]
    worst = 0.0
    for layer in range(L):
        q, k_pre, v = (torch.randn(T, h, D, device=device) for h in (HQ, HKV, HKV))
        q, k_rot = rope.apply(q, positions, seq_lens), rope.apply(k_pre, positions, seq_lens)  # as the decoder does
        out = cache.attend(layer, q, k_pre, k_rot, v, meta)
        for seq_id, start, n in zip(seq_ids, meta.query_starts, lens):
            i = slice(start, start + n)
            step = oracle.prefill if is_prefill else oracle.decode
            expect = step(layer, seq_id, q[i], k_rot[i], v[i])
            worst = max(worst, (out[i] - expect).abs().max().item())
    cache.finish_forward(meta)
    return worst


def generate(cache, prompt_lens, steps, seed=0):
    torch.manual_seed(seed)
    rope, oracle = cache.shadow.rotary, DenseOracle()
    seq_ids = list(range(len(prompt_lens)))
    for seq_id, n in zip(seq_ids, prompt_lens):
        cache.manager.allocate(seq_id, n, steps + 1)
    worst = run_forward(cache, oracle, rope, seq_ids, list(prompt_lens), [0] * len(seq_ids), True)
    for t in range(steps):
        ctx = [n + t for n in prompt_lens]
        worst = max(worst, run_forward(cache, oracle, rope, seq_ids, [1] * len(seq_ids), ctx, False))
    return worst


def test_full_budget_full_rank_equals_dense_ragged_with_folding():
    cache = make_cache(full_config())
    worst = generate(cache, prompt_lens=[37, 50, 23], steps=40)
    assert worst < 1e-5
    st = states(cache)[1]
    assert st.seq_len == 90 and st.num_shadow * 4 + st.window_len == 90
    assert st.num_shadow > 50 // 4 - 2 + 4  # folded several times (window of 8: every 4 steps)
    stats = cache.stats()
    assert stats["num_seqs"] == 3 and stats["hit_rate"] > 0.8 and stats["gpu_bytes_in_use"] > 0


def test_fp8_values_full_budget_stay_within_e4m3_precision_of_dense():
    """Full budget and rank: the only difference from dense attention is the values' fp8 rounding (folded chunks
    too), at most 2^-4 of a chunk's largest value per element; the attention output is a convex mix of them."""
    cache = make_cache(full_config(value_format="fp8"))
    worst = generate(cache, prompt_lens=[37, 50, 23], steps=24)
    assert 1e-4 < worst < 0.1  # values ~N(0, 1): the largest in a chunk ~2-3, rounding <= 2^-4 of it
    assert states(cache)[1].num_shadow > 50 // 4 - 2  # folded windows are quantised too
    assert cache.shadow.host.values.dtype == torch.float8_e4m3fn


def layer_outputs(cache, prompt_lens, steps, seed=0):
    """Every layer's attention output at every forward of generate's random tokens: {layer: [tensors]}."""
    outputs = {layer: [] for layer in range(L)}
    attend = cache.attend

    def recording(layer, *args):
        out = attend(layer, *args)
        outputs[layer].append(out)
        return out

    cache.attend = recording
    generate(cache, prompt_lens, steps, seed)
    return outputs


def test_each_layer_keeps_its_own_rank():
    """layer_ranks (16, 8), mean 12: layer 0 is served as a cache of rank 16 serves it, layer 1 as one of rank 8
    (a budget that selects, so the rank shows in the rebuilt keys and the choice), and each layer's U rows and
    bases are its rank wide."""
    sparse = dict(sparse_budget=8, outlier_chunks=1)
    mixed = make_cache(full_config(rank=12, layer_ranks=(16, 8), **sparse))
    assert [u.shape[-1] for u in mixed.shadow.gpu.u] == [16, 8]
    assert [sv.shape[2] for sv in mixed.shadow.slots.sv] == [16, 8]
    got = layer_outputs(mixed, [37, 50, 23], steps=12)
    for layer, rank in ((0, 16), (1, 8)):
        expect = layer_outputs(make_cache(full_config(rank=rank, **sparse)), [37, 50, 23], steps=12)
        assert len(got[layer]) == len(expect[layer]) == 13
        for a, b in zip(got[layer], expect[layer]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    other = layer_outputs(make_cache(full_config(rank=8, **sparse)), [37, 50, 23], steps=12)
    assert max((a - b).abs().max().item() for a, b in zip(got[0], other[0])) > 1e-3  # rank 8 differs on layer 0


def test_layer_ranks_must_fit_the_model_and_average_to_rank():
    with pytest.raises(ValueError, match="average to rank"):
        full_config(rank=12, layer_ranks=(16, 10))
    with pytest.raises(ValueError, match="ranks >= 1"):
        full_config(rank=12, layer_ranks=(24, 0))
    with pytest.raises(ValueError, match="3 ranks; this model has 2 layers"):
        make_cache(full_config(rank=12, layer_ranks=(12, 12, 12)))
    with pytest.raises(ValueError, match=r"rank \(20\) is larger than kv_heads\*head_dim"):
        make_cache(full_config(rank=12, layer_ranks=(20, 4)))


@pytest.mark.parametrize("rope_scaling,partial", [({"rope_type": "dynamic", "factor": 2.0}, 1.0), (None, 0.5)])
def test_model_rotary_including_length_dependent_rope(rope_scaling, partial):
    """The model's RotaryEmbedding: dynamic NTK (frequencies depend on the sequence length, which passes 32 mid-run)
    and GLM's partial interleaved rotary."""
    config = {"architectures": ["GlmForCausalLM" if rope_scaling is None else "LlamaForCausalLM"],
              "vocab_size": 16, "hidden_size": HQ * D, "num_hidden_layers": L, "num_attention_heads": HQ,
              "num_key_value_heads": HKV, "intermediate_size": 16, "max_position_embeddings": 32,
              "rope_scaling": rope_scaling, "partial_rotary_factor": partial}
    rope = RotaryEmbedding(ModelSpec.from_hf_config(config))
    cache = make_cache(full_config(), rope=rope)
    assert generate(cache, prompt_lens=[37, 50, 23], steps=16) < 1e-5


@pytest.mark.gpu
def test_full_budget_full_rank_equals_dense_on_cuda():
    cache = make_cache(full_config(min_context=30), device="cuda")
    assert cache.shadow.host.pinned
    assert generate(cache, prompt_lens=[37, 50, 23, 12], steps=24) < 1e-5
    cache.close()


def test_ragged_batch_mixing_dense_and_shadow_sequences():
    cache = make_cache(full_config(min_context=30))
    worst = generate(cache, prompt_lens=[37, 12, 50, 29], steps=12)
    assert worst < 1e-5
    # Only the 12-token prompt fits in min_context with its generation: 29 + 12 steps does not, so it is in shadows.
    assert set(states(cache)) == {0, 2, 3} and cache.stats()["num_seqs"] == 4


def test_no_outliers_and_prompt_shorter_than_local_chunks():
    cache = make_cache(full_config(outlier_chunks=0))
    assert generate(cache, prompt_lens=[5, 41], steps=20) < 1e-5


def attention_over(q, keys, values, heads_keys):
    """Exact GQA attention of one query q (Hq, d) where KV head h sees only the token rows heads_keys[h]."""
    G = HQ // HKV
    out = torch.empty_like(q)
    for h, rows in enumerate(heads_keys):
        logits = q[h * G:(h + 1) * G] @ keys[rows, h].T * SCALE  # (G, n)
        out[h * G:(h + 1) * G] = logits.softmax(-1) @ values[rows, h]
    return out


def test_small_budget_attends_exactly_to_the_chunks_it_selected_and_counts_fetches():
    """Full rank, 3 of the shadow's chunks per KV head, no outliers: each decode output is exact attention over the
    tokens of the chunks resident in the slot after the step, and the window (prompt's local chunks and generated
    tokens); the step's counters add up."""
    torch.manual_seed(4)
    C = 4
    cache = make_cache(full_config(sparse_budget=3 * C, outlier_chunks=0))
    rope, prompt_lens, steps = cache.shadow.rotary, [64, 45], 10
    keys = {(layer, s): [] for layer in range(L) for s in range(2)}  # every token's exact post-RoPE k and v
    vals = {(layer, s): [] for layer in range(L) for s in range(2)}
    for s, n in enumerate(prompt_lens):
        cache.manager.allocate(s, n, steps + 1)
    for step in range(steps + 1):
        prefill = step == 0
        lens = prompt_lens if prefill else [1, 1]
        ctx = [0, 0] if prefill else [n + step - 1 for n in prompt_lens]
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, lens)])
        meta = AttentionMetadata(prefill, [0, 1], lens, ctx, positions)
        shadow_tokens = [states(cache)[s].num_shadow * C for s in range(2)]
        for layer in range(L):
            q, k_pre, v = (torch.randn(len(positions), h, D) for h in (HQ, HKV, HKV))
            q, k_rot = rope.apply(q, positions), rope.apply(k_pre, positions)
            out = cache.attend(layer, q, k_pre, k_rot, v, meta)
            for s, start in enumerate(meta.query_starts):
                keys[layer, s].append(k_rot[start:start + lens[s]])
                vals[layer, s].append(v[start:start + lens[s]])
                if prefill:
                    continue
                k_all, v_all = torch.cat(keys[layer, s]), torch.cat(vals[layer, s])
                resident = cache.shadow.slots.resident[states(cache)[s].slot, layer]  # (Hkv, K) chunk ids
                window = torch.arange(shadow_tokens[s], len(k_all))
                rows = [torch.cat([(resident[h, :, None] * C + torch.arange(C)).flatten(), window])
                        for h in range(HKV)]
                assert all(resident[h].ge(0).sum() == 3 for h in range(HKV))
                want = attention_over(q[start], k_all, v_all, rows)
                torch.testing.assert_close(out[start], want, rtol=1e-5, atol=1e-5)
        cache.finish_forward(meta)
    stats = cache.stats()
    assert 0.0 <= stats["hit_rate"] < 1.0 and stats["chunks_fetched"] > 0
    assert stats["bytes_fetched"] == stats["chunks_fetched"] * C * D * 4


def test_free_returns_every_page_and_slot():
    cache = make_cache(full_config(min_context=30))
    generate(cache, prompt_lens=[37, 12, 50], steps=5)
    host_in_use = cache.stats()["host_bytes_in_use"]
    assert host_in_use > 0
    for seq_id in range(3):
        cache.manager.free(seq_id)
    stats = cache.stats()
    assert stats["num_seqs"] == 0 and stats["gpu_bytes_in_use"] == 0 and stats["host_bytes_in_use"] == 0
    shadow = cache.shadow.manager
    assert shadow.gpu_pages.num_free == 64 and shadow.host_pages.num_free == 64 and shadow.slots.num_free == 4
    assert cache.dense.manager.blocks.num_free == 64


def test_allocate_refuses_cleanly_when_pages_run_out():
    manager = make_cache(full_config(), gpu_pages=8, host_pages=6).shadow.manager  # page: 4 chunks of 4 tokens
    assert manager.can_allocate(80, 16)  # 6 pages
    manager.allocate(0, 80, 16)
    assert not manager.can_allocate(10, 10)
    with pytest.raises(MemoryError, match="short of host value pages"):
        manager.allocate(1, 10, 10)
    assert manager.gpu_pages.num_free == 2 and manager.host_pages.num_free == 0 and manager.slots.num_free == 3
    manager.free(0)
    manager.allocate(1, 10, 10)


def test_allocate_refuses_when_slots_run_out():
    manager = make_cache(full_config(), max_num_seqs=1).shadow.manager
    manager.allocate(0, 40, 8)
    with pytest.raises(MemoryError, match="slot"):
        manager.allocate(1, 40, 8)
    assert manager.gpu_pages.num_free == 64 - 3


def test_footprint_is_what_the_buffers_take():
    config = full_config(outlier_chunks=3)
    cache = make_cache(config, max_num_seqs=2, gpu_pages=5, host_pages=7)
    g = mm.Geometry(L, HQ, HKV, D, hidden_size=0, intermediate_size=0, vocab_size=0, dtype_bytes=4)
    gpu_page, host_page, slot = mm.gpu_page_bytes(g, config), mm.host_page_bytes(g, config), mm.slot_bytes(g, config)
    shadow = cache.shadow
    tensors = [*shadow.gpu.buffers, *shadow.slots.buffers]
    assert sum(t.numel() * t.element_size() for t in tensors) == 5 * gpu_page + 2 * slot
    assert shadow.host.values.numel() * 4 == 7 * host_page
    assert cache.manager.footprint(40, 8) == (3 * gpu_page + slot, 3 * host_page)
    cache.manager.allocate(0, 40, 8)
    stats = cache.stats()
    assert (stats["gpu_bytes_in_use"], stats["host_bytes_in_use"]) == cache.manager.footprint(40, 8)
    dense_bytes = cache.dense.k.numel() * 4 + cache.dense.v.numel() * 4
    assert stats["gpu_bytes_total"] == 5 * gpu_page + 2 * slot + dense_bytes


def test_config_checked_against_the_model():
    with pytest.raises(ValueError, match="rank"):
        make_cache(full_config(rank=HKV * D + 1))
    with pytest.raises(ValueError, match="landmark_kind must be one of"):
        full_config(landmark_kind="max")


def test_outlier_flags_follow_the_landmarks_through_page_reuse():
    """mark_outliers flags exactly the given chunks of each KV head; writing landmarks over a reused page clears its
    flags, so a later sequence on that page inherits no outliers."""
    pages = GpuPages(CacheSpec(L, HQ, HKV, D, SCALE), full_config(rank=3, chunk_size=2, sparse_budget=8), num_pages=6)
    width = pages.landmarks.shape[-1]  # D, or 2D for bounds landmarks
    table = torch.tensor([4, 0, 2])
    pages.write_landmarks(1, table, 0, torch.randn(10, HKV, width))
    ids = torch.tensor([[0, 5, 9], [2, 5, 7]])  # (Hkv, O)
    pages.mark_outliers(1, table, ids)
    expected = torch.zeros(HKV, 10, dtype=torch.bool)
    expected.scatter_(1, ids, True)
    assert torch.equal(pages.read_outliers(1, table, 10), expected)
    assert not pages.read_outliers(0, table, 10).any()  # another layer
    reused = torch.tensor([5, 2, 3, 0, 1, 4])  # every page, the three flagged ones among them
    pages.write_landmarks(slice(None), reused, 0, torch.randn(L, 24, HKV, width))
    assert not pages.read_outliers(1, reused, 24).any()


def test_page_tables_are_built_once_per_batch_and_stay_right_when_batches_change():
    """The decode plan's page tables: each sequence's page lists zero-padded to a power of two; reused while the
    same sequences decode together, rebuilt for a new batch (a freed sequence's pages given to a new one included),
    and handed out as copies, so a caller writing into them (a captured graph's inputs) cannot corrupt a later plan."""
    manager = make_cache(full_config(), gpu_pages=64, host_pages=64).shadow.manager
    tables = PageTables(torch.device("cpu"), held=8)
    for seq_id, prompt in enumerate([40, 90, 20]):
        manager.allocate(seq_id, prompt, 8)

    def expected(states):
        width = max(1 << (len(st.gpu_pages) - 1).bit_length() for st in states)
        return [torch.tensor([st.gpu_pages + [0] * (width - len(st.gpu_pages)) for st in states], dtype=torch.int32),
                torch.tensor([st.value_pages + [0] * (width - len(st.value_pages)) for st in states],
                             dtype=torch.int32)]

    def check(seq_ids):
        states = [manager.seqs[i] for i in seq_ids]
        got = tables.of(states)
        for table, want in zip(got, expected(states)):
            assert torch.equal(table, want)
        return got

    first = check([0, 1])
    assert first.shape == (2, 2, 8) and len(tables._tables) == 1
    first.fill_(-1)  # what a graph replay does to its inputs
    check([0, 1])
    assert len(tables._tables) == 1  # reused, not rebuilt
    check([1, 2])
    manager.free(1)
    manager.allocate(3, 60, 8)  # the freed pages, under a new state
    check([0, 3])
    assert len(tables._tables) == 3
    batches = [[0], [2], [3], [0, 2], [2, 0], [0, 3], [3, 0], [2, 3], [3, 2], [0, 2, 3]]
    assert len(batches) > tables.held
    for batch in batches:
        check(batch)
    assert len(tables._tables) == tables.held  # the least recently used dropped
