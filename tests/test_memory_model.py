import dataclasses
import math

import pytest
import torch

from support.model_factory import FAMILIES, build_tiny_hf_model
from shadowkv_core import LLMEngine, EngineConfig, ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.models import load_model
from shadowkv_core.tiny_model import build_tiny_model

G8B = mm.PRESETS["llama-3.1-8b"]
GPU, HOST = 80 * mm.GIB, 512 * mm.GIB
PAPER = ShadowKVConfig(device_value_share=0.0, landmark_kind="mean")  # the paper: mean landmarks, values on the host


def cap(cfg, context=122880, g=G8B):
    return mm.capacity(g, cfg, GPU, HOST, [context], 128)


def test_capacity_falls_with_rank_context_and_outliers_and_rises_with_chunk_size():
    ranks = [cap(dataclasses.replace(PAPER, rank=r)) for r in (64, 160, 512, 1024)]
    contexts = [cap(PAPER, c) for c in (32768, 61440, 122880, 245760)]
    outliers = [cap(dataclasses.replace(PAPER, outlier_chunks=o), 245760) for o in (0, 256, 2048, 8192)]
    chunks = [cap(dataclasses.replace(PAPER, chunk_size=c)) for c in (4, 8, 16, 32)]
    assert ranks == sorted(ranks, reverse=True) and ranks[0] > ranks[-1]
    assert contexts == sorted(contexts, reverse=True) and contexts[0] > contexts[-1]
    assert outliers == sorted(outliers, reverse=True) and outliers[0] > outliers[-1]
    assert chunks == sorted(chunks) and chunks[0] < chunks[-1]


def test_paper_headline_shadowkv_holds_about_six_times_the_dense_batch_at_122k():
    dense, shadow = cap(None), cap(PAPER)
    assert dense >= 1 and 5 <= shadow / dense <= 10, (dense, shadow)


def test_host_memory_caps_the_batch():
    # by hand: a sequence's values, every layer in bf16, in whole pages of page_chunks chunks
    page = PAPER.page_chunks * PAPER.chunk_size
    per_seq = math.ceil((122880 + 128) / page) * page * 32 * 8 * 128 * 2  # layers, KV heads, head_dim, bytes
    held = [mm.capacity(G8B, PAPER, GPU, host, [122880], 128) for host in (4 * per_seq, 4 * per_seq - 1)]
    assert held == [4, 3]  # the GPU would hold more


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_weight_bytes_equal_the_loaded_parameters(family, tmp_path):
    build_tiny_hf_model(family, tmp_path)
    model, spec = load_model(str(tmp_path), torch.float32, "cpu")
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert mm.Geometry.from_spec(spec, torch.float32).weight_bytes == sum(params.values())


@pytest.mark.parametrize("value_format,share,landmarks,kind", [
    ("model", 0.0, "model", "mean"), ("fp8", 0.0, "model", "mean"), ("model", 0.4, "fp8", "mean"),
    ("fp8", 0.55, "fp8", "mean"), ("model", 0.0, "model", "bounds"), ("fp8", 0.4, "fp8", "bounds")])
@pytest.mark.parametrize("layer_ranks", [None, "uneven"])
def test_predicted_bytes_equal_the_engines_allocations_exactly(tmp_path, value_format, share, landmarks, kind,
                                                               layer_ranks):
    """layer_ranks "uneven": each layer at its own rank, their mean the config's rank: the same bytes."""
    path = build_tiny_model(tmp_path)  # 2 layers, keys 32 wide
    cfg = ShadowKVConfig(rank=24, chunk_size=4, sparse_budget=64, outlier_chunks=3, local_chunks=2,
                         min_context=32, decode_window=16, page_chunks=4, value_format=value_format,
                         device_value_share=share, landmark_format=landmarks, landmark_kind=kind,
                         layer_ranks=(17, 31) if layer_ranks else None)
    engine = LLMEngine(EngineConfig(model=str(path), max_num_seqs=3, shadowkv=cfg, gpu_cache_gib=0.005,
                                    host_cache_gib=0.002, max_model_len=1024))
    cache, shadow = engine.cache, engine.cache.shadow
    g = mm.Geometry.from_spec(engine.spec, torch.float32)
    device_values = [t for t in (shadow.host.device_values, shadow.host.device_scales) if t is not None]
    allocated_gpu = sum(t.numel() * t.element_size() for t in
                        (*shadow.gpu.buffers, cache.dense.k, cache.dense.v, *shadow.slots.buffers, *device_values))
    pools = mm.plan_pools(g, cfg, int(0.005 * mm.GIB), int(0.002 * mm.GIB), 3)
    held = (shadow.slots.num_slots, cache.dense.manager.blocks.num_blocks, shadow.gpu.num_pages, shadow.host.num_pages,
            shadow.host.num_device_pages)
    assert held == (pools.num_slots, pools.num_dense_blocks, pools.num_gpu_pages, pools.num_host_pages,
                    pools.num_device_value_pages)
    assert (pools.num_device_value_pages > 0) == (share > 0)
    assert allocated_gpu == pools.gpu_bytes(g, cfg, 16) <= 0.005 * mm.GIB
    host_tensors = (shadow.host.values,) if shadow.host.scales is None else (shadow.host.values, shadow.host.scales)
    assert sum(t.numel() * t.element_size() for t in host_tensors) == pools.host_bytes(g, cfg)
    for prompt_len, max_new in ((300, 40), (20, 10)):  # a shadow sequence, then a dense one
        before = cache.stats()
        assert engine.footprint(prompt_len, max_new) == dataclasses.astuple(mm.seq_bytes(g, cfg, prompt_len, max_new))
        cache.manager.allocate(prompt_len, prompt_len, max_new)
        after = cache.stats()
        used = (after["gpu_bytes_in_use"] - before["gpu_bytes_in_use"],
                after["host_bytes_in_use"] - before["host_bytes_in_use"])
        assert used == dataclasses.astuple(mm.seq_bytes(g, cfg, prompt_len, max_new))
        cache.manager.free(prompt_len)
    assert cache.stats()["gpu_bytes_in_use"] == 0


def test_fp8_values_halve_the_host_bytes_and_double_a_host_bound_batch():
    g = mm.PRESETS["llama-3.1-8b"]
    model, fp8 = PAPER, dataclasses.replace(PAPER, value_format="fp8")
    host_model, host_fp8 = mm.seq_bytes(g, model, 122880, 128).host, mm.seq_bytes(g, fp8, 122880, 128).host
    assert host_fp8 / host_model == pytest.approx(0.5, abs=0.01)  # e4m3 + one fp32 scale per 8 tokens of a head
    gpu, host = 139 * mm.GIB, 100 * mm.GIB
    assert mm.capacity(g, fp8, gpu, host, [122880], 128) == 2 * mm.capacity(g, model, gpu, host, [122880], 128)


def test_predicted_bytes_equal_a_dense_fp8_engines_allocations_exactly(tmp_path):
    path = build_tiny_model(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(path), max_num_seqs=3, gpu_cache_gib=0.005, max_model_len=1024,
                                    kv_cache_dtype="fp8"))
    cache = engine.cache
    g = mm.Geometry.from_spec(engine.spec, torch.float32, "fp8")
    pools = mm.plan_pools(g, None, int(0.005 * mm.GIB), 0, 3)
    assert cache.manager.blocks.num_blocks == pools.num_dense_blocks
    allocated = sum(t.numel() * t.element_size() for t in (cache.k, cache.v, cache.k_scales, cache.v_scales))
    assert engine.config.block_size == cache.manager.block_size == 64  # an fp8 cache's default
    assert allocated == pools.gpu_bytes(g, None) <= 0.005 * mm.GIB
    assert engine.footprint(300, 40) == dataclasses.astuple(mm.seq_bytes(g, None, 300, 40))
    cache.manager.allocate(0, 300, 40)
    assert cache.stats()["gpu_bytes_in_use"] == mm.seq_bytes(g, None, 300, 40).gpu


def test_fp8_dense_kv_about_doubles_the_dense_batch_at_122k():
    fp8 = dataclasses.replace(G8B, kv_cache_dtype="fp8")
    # one byte per element and an fp32 scale per token and KV head (head_dim 128), against two bytes per element
    assert mm.dense_block_bytes(fp8, 16) * 2 * 128 == mm.dense_block_bytes(G8B, 16) * (128 + 4)
    for gpu in (80 * mm.GIB, 139 * mm.GIB):  # an H100's and an H200's memory
        bf16, f8 = (mm.capacity(g, None, gpu, 0, [122880], 128) for g in (G8B, fp8))
        assert f8 in (2 * bf16, 2 * bf16 + 1), (gpu, bf16, f8)  # the same free bytes, 1.94x the sequences


def test_fp8_landmarks_halve_the_landmark_bytes():
    g = mm.PRESETS["llama-3.1-8b"]
    model, fp8 = PAPER, dataclasses.replace(PAPER, landmark_format="fp8")
    u = g.num_layers * mm.page_tokens(model) * model.rank * g.dtype_bytes
    flags = g.num_layers * model.page_chunks * g.num_kv_heads  # one byte per chunk and KV head
    landmarks = mm.gpu_page_bytes(g, model) - u - flags
    assert landmarks == g.num_layers * model.page_chunks * g.kv_width * 2
    scales = g.num_layers * model.page_chunks * g.num_kv_heads * 4
    assert mm.gpu_page_bytes(g, fp8) - u - flags == landmarks // 2 + scales


def test_cli_prints_dense_and_shadowkv_capacity(capsys):
    mm.main(["--model", "llama-3.1-8b", "--context", "122880", "--gpu-gib", "80", "--host-gib", "512"])
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.strip().startswith("122880")][0].split()
    # By hand, Llama-3.1-8B in bf16, sequences of 122880 + 128 tokens: the GPU less the weights, the prefill's
    # workspace and the CUDA context, over what each sequence adds (its cache and its decode logits).
    tokens, layers, kv_width, bf16, pages = 122880 + 128, 32, 8 * 128, 2, math.ceil((122880 + 128) / 128)
    free = GPU - 8_030_261_248 * bf16 - mm.CONTEXT_BYTES  # Llama-3.1-8B's parameters
    # the prefill's peak at this length is in attention (its MLP: 4 hidden vectors and one chunk's intermediates)
    attention = 122880 * mm.ATTENTION_HIDDEN_VECTORS * 4096 * bf16
    assert attention > 122880 * mm.MLP_HIDDEN_VECTORS * 4096 * bf16 + 8192 * mm.MLP_CHUNK_VECTORS * 14336 * bf16
    dense_free = free - int(mm.WORKSPACE_MARGIN * attention)
    logits = 2 * 128256 * (bf16 + 4)
    dense = dense_free // (tokens * 2 * layers * kv_width * bf16 + logits)
    exact = 256 * 8 + 48 * 8 + 4 * 8 + 512  # selected, outlier and local chunks of 8 tokens; the decode window
    slot = layers * ((160 * kv_width + 2 * exact * kv_width) * bf16 + 256 * 8 * 8)  # rank 160 basis; chunk ids
    page_gpu = layers * (128 * 160 * bf16 + 16 * 8 + 16 * 2 * kv_width * bf16)  # U rows, outlier flags, bounds
    shadow_gpu = slot + 4096 * 2 * layers * kv_width * bf16 + pages * page_gpu + logits  # + a dense reservation
    shadow_free = free - int(mm.WORKSPACE_MARGIN * (attention + 2 * 122880 * kv_width * (2 * 4 + bf16)))  # their keys
    shadow_host = pages * 128 * layers * kv_width * bf16
    shadow = min(shadow_free // shadow_gpu, HOST // shadow_host)
    assert (int(row[1]), int(row[2])) == (dense, shadow)
    assert row[4:7] == ["0.000", f"{(slot + pages * page_gpu) / mm.GIB:.2f}", f"{shadow_host / mm.GIB:.2f}"]


@pytest.mark.parametrize("cfg", [None, PAPER], ids=["dense", "shadowkv"])
@pytest.mark.parametrize("max_prefill, max_len", [(32768, 131072), (16384, 4096), (8192, 8192)])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_reserved_prefill_workspace_covers_every_prefill_an_engine_admits(cfg, max_prefill, max_len,
                                                                                prefix_caching):
    reserved = mm.largest_prefill_workspace_bytes(G8B, cfg, max_prefill, max_len, 8192, prefix_caching)
    # a job of up to max_prefill tokens, or one longer prompt alone; after a cached prefix, a job whose sequences each
    # stay within max_len
    cold = [(n, 0) for n in range(1, max(max_prefill, max_len) + 1, 997)] + [(max(max_prefill, max_len), 0)]
    cached = [(n, p) for n in range(1, max_prefill + 1, 991) for p in range(1, max_len, 1009)]
    cached.append((max_prefill, max_len - 1))
    needed = [mm.prefill_workspace_bytes(G8B, cfg, n, 8192, p) for n, p in cold + (cached if prefix_caching else [])]
    assert reserved == max(needed)
    if max_prefill < max_len:  # a prompt longer than a job runs alone: its workspace is the largest
        assert reserved == mm.prefill_workspace_bytes(G8B, cfg, max_len, 8192)
        assert reserved > mm.prefill_workspace_bytes(G8B, cfg, max_prefill, 8192, max_len - 1)


def test_the_prefill_workspace_peaks_in_attention_for_long_prompts_and_in_the_mlp_for_short_ones():
    def parts(n: int) -> tuple[float, float]:
        attention = n * mm.ATTENTION_HIDDEN_VECTORS * 4096 * 2
        mlp = n * mm.MLP_HIDDEN_VECTORS * 4096 * 2 + min(n, 8192) * mm.MLP_CHUNK_VECTORS * 14336 * 2
        return attention, mlp

    for n in (100, 8192, 32768, 262144):
        assert mm.prefill_workspace_bytes(G8B, None, n, 8192) == int(mm.WORKSPACE_MARGIN * max(parts(n)))
    assert parts(8192)[1] > parts(8192)[0] and parts(262144)[0] > parts(262144)[1]
    # beside either phase: ShadowKV's keys being factorised (twice: the build stream's pool), an fp8 pool's fp32 rows
    fp8 = dataclasses.replace(G8B, kv_cache_dtype="fp8")
    for n in (8192, 262144):
        keys = 2 * n * G8B.kv_width * (2 * 4 + 2)
        assert mm.prefill_workspace_bytes(G8B, PAPER, n, 8192) == int(mm.WORKSPACE_MARGIN * (max(parts(n)) + keys))
        rows = n * mm.FP8_WRITE_ROWS * G8B.kv_width * 4
        assert mm.prefill_workspace_bytes(fp8, None, n, 8192) == int(mm.WORKSPACE_MARGIN * (max(parts(n)) + rows))


def test_cli_rejects_an_unknown_model():
    with pytest.raises(ValueError, match="--model"):
        mm.main(["--model", "no-such-model"])


def test_pool_budget_for_a_batch_holds_exactly_that_batch():
    cfg = dataclasses.replace(PAPER, min_context=4096)
    gpu, host = mm.pool_budget_for(G8B, cfg, 7, 122880, 64)
    pools = mm.plan_pools(G8B, cfg, gpu, host, 7)
    pages = mm.shadow_pages(cfg, 122880 + 64)
    assert pools.num_gpu_pages == pools.num_host_pages == 7 * pages
    assert pools.gpu_bytes(G8B, cfg, 16) == gpu and pools.host_bytes(G8B, cfg) == host


@pytest.mark.parametrize("share", [0.37, 0.5, 1.0])
def test_pool_budget_and_capacity_with_a_device_value_share(share):
    """A share of each sequence's values on the device: the budget for a batch holds exactly that batch, and
    capacity() admits that batch in that budget and no more."""
    cfg = dataclasses.replace(PAPER, min_context=4096, value_format="fp8", device_value_share=share)
    batch, context = 7, 122880
    gpu, host = mm.pool_budget_for(G8B, cfg, batch, context, 64)
    pools = mm.plan_pools(G8B, cfg, gpu, host, batch)
    pages = mm.shadow_pages(cfg, context + 64)
    on_device = mm.device_value_pages(cfg, pages)
    assert on_device == int(share * pages) and pools.num_gpu_pages == batch * pages
    assert pools.num_host_pages == batch * (pages - on_device) and pools.num_device_value_pages >= batch * on_device
    assert pools.gpu_bytes(G8B, cfg, 16) == gpu and pools.host_bytes(G8B, cfg) == host
    fixed = mm.fixed_gpu_bytes(G8B, cfg, context, 8192, max_num_seqs=batch)
    assert mm.capacity(G8B, cfg, gpu + fixed, host, [context], 64) == batch
    assert mm.seq_bytes(G8B, cfg, context, 64).host == (pages - on_device) * mm.host_page_bytes(G8B, cfg)


def test_best_device_value_share_fills_device_memory_a_host_bound_batch_leaves():
    g, cfg = mm.PRESETS["llama-3.1-8b"], dataclasses.replace(PAPER, value_format="fp8")
    gpu, host = 125 * mm.GIB, 100 * mm.GIB

    def held_at(host_bytes):
        return lambda c: mm.capacity(g, c, gpu, host_bytes, [122880], 128)

    host_bound = held_at(host)(cfg)
    share = mm.best_device_value_share(cfg, held_at(host))
    best = held_at(host)(dataclasses.replace(cfg, device_value_share=share))
    assert 0 < share < 1 and best > host_bound  # values moved to the device make room on the host
    more = dataclasses.replace(cfg, device_value_share=share + 1 / 64)
    assert held_at(host)(more) < best  # the largest share that keeps that batch
    gpu_bound = held_at(10_000 * mm.GIB)  # values on the device only in what the largest batch leaves of it
    share = mm.best_device_value_share(cfg, gpu_bound)
    assert gpu_bound(dataclasses.replace(cfg, device_value_share=share)) == gpu_bound(cfg)
    assert gpu_bound(dataclasses.replace(cfg, device_value_share=share + 1 / 64)) < gpu_bound(cfg)


def test_host_memory_available_respects_the_container_limit(tmp_path):
    proc = tmp_path / "meminfo"
    proc.write_text("MemTotal:       263000000 kB\nMemAvailable:   200000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert mm.mem_available_bytes(proc, cgroup) == 200000000 * 1024  # no cgroup files: the node's figure
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert mm.mem_available_bytes(proc, cgroup) == 200000000 * 1024  # unlimited
    (cgroup / "memory.max").write_text(f"{160 * mm.GIB}\n")
    (cgroup / "memory.current").write_text(f"{10 * mm.GIB}\n")
    assert mm.mem_available_bytes(proc, cgroup) == 150 * mm.GIB
    assert 0 < mm.mem_available_bytes()  # this machine


def test_an_engine_keeps_room_for_a_prompt_longer_than_its_prefill_jobs(monkeypatch):
    from shadowkv_core.engine.cache_factory import gpu_cache_bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GPU - 20 * mm.GIB, GPU))
    cuda = torch.device("cuda")

    def budget(max_prefill_tokens: int, max_model_len: int) -> int:
        config = EngineConfig(model="unused", max_prefill_tokens=max_prefill_tokens, shadowkv=PAPER)
        return gpu_cache_bytes(config, G8B, cuda, max_model_len)

    # one prompt of up to max_model_len runs alone whatever max_prefill_tokens is: the same room is kept
    assert budget(8192, 131072) == budget(32768, 131072) < budget(32768, 65536)
    longest = mm.prefill_workspace_bytes(G8B, PAPER, 131072, 8192)
    assert budget(32768, 131072) == int(0.9 * GPU) - 20 * mm.GIB - longest - mm.decode_workspace_bytes(G8B, 8)
