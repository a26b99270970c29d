"""Tensor parallelism inside a replica, on the CPU over gloo: 2 ranks give 1 rank's logits and greedy tokens (dense
and ShadowKV at full rank and budget), the weights load sharded, and a rank that dies fails its requests cleanly."""
import dataclasses
import io
import os
import signal
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

from serve_app.engine_replica import engine_footprint
from shadowkv_core import LLM, EngineConfig, LLMEngine, SamplingParams, ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.engine import tensor_parallel
from shadowkv_core.engine.cache_factory import HOST_HEADROOM, build_cache, host_cache_bytes
from shadowkv_core.engine.tensor_parallel import TensorParallelEngine, start_engine
from shadowkv_core.models import load_model
from shadowkv_core.models.prefill_cost import PrefillBudget
from shadowkv_core.parallel import TensorParallel, init_tensor_parallel, rank_shadowkv, rank_spec
from support.model_factory import assert_close_to, build_tiny_hf_model, decode, prefill

# The tiny model has 2 KV heads of 16 dims: rank 32 is full rank (16 per rank of 2), and the budget covers every
# context here, so each rank's shadow of its one KV head is exact.
FULL_SHADOW = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=4096, outlier_chunks=2, local_chunks=2,
                             min_context=0, decode_window=16, device_value_share=0.0)
PROMPT_LENS = (37, 20)
VOCAB = 128
CHUNK_TOKENS = 16  # the prefill's token chunks: a row-parallel projection all-reduces each chunk
DECODE_STEPS = 20  # past decode_window: the window folds into each rank's shadow


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # 4 heads, 2 KV heads, random norms and biases: the row-parallel biases must be added once
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_hf_model("llama", path, seed=3, attention_bias=True, mlp_bias=True)
    return str(path)


def _prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in PROMPT_LENS]


def _logits(path: str, shadowkv: ShadowKVConfig | None, tp=None) -> torch.Tensor:
    """Prefill the prompts, then greedy-decode DECODE_STEPS tokens; every step's logits, stacked (steps, B, vocab)."""
    size = 1 if tp is None else tp.size
    decoder, spec = load_model(path, torch.float32, "cpu", CHUNK_TOKENS, tp=tp)
    config = EngineConfig(model=path, max_num_seqs=2, gpu_cache_gib=0.01, host_cache_gib=0.01,
                          prefill_chunk_tokens=CHUNK_TOKENS, shadowkv=rank_shadowkv(shadowkv, size))
    cache = build_cache(config, decoder.rank_spec, torch.float32, torch.device("cpu"), decoder.rotary, 512)
    prompts = _prompts()
    for i, p in enumerate(prompts):
        cache.manager.allocate(i, len(p), DECODE_STEPS)
    last = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    steps = [prefill(decoder, cache, prompts)[last]]
    lens = list(PROMPT_LENS)
    for _ in range(DECODE_STEPS - 1):
        steps.append(decode(decoder, cache, steps[-1].argmax(-1).tolist(), lens))
        lens = [n + 1 for n in lens]
    return torch.stack(steps)


def _rank_main(rank, size, rendezvous, fn, args, results):
    tp = init_tensor_parallel(rank, size, rendezvous, "cpu", timeout_s=60)
    try:
        buffer = io.BytesIO()
        torch.save(fn(*args, tp=tp), buffer)  # bytes, not shared memory: this process ends before they are read
        results.put((rank, buffer.getvalue()))
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(fn, size, *args):
    """fn(*args, tp=...) on `size` gloo ranks, each a process; {rank: result}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(r, size, rendezvous, fn, args, results)) for r in range(size)]
        for p in procs:
            p.start()
        out = {rank: torch.load(io.BytesIO(data)) for rank, data in (results.get(timeout=120) for _ in procs)}
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    return out


@pytest.fixture(scope="module")
def phi3_path(tmp_path_factory):
    # a checkpoint that fuses qkv_proj and gate_up_proj: each rank reads its rows of every section
    path = tmp_path_factory.mktemp("phi3")
    build_tiny_hf_model("phi3", path, seed=4)
    return str(path)


@pytest.mark.parametrize("kind", ["dense", "shadowkv", "phi3-dense"])
def test_two_ranks_give_one_ranks_logits(request, kind):
    path = request.getfixturevalue("phi3_path" if kind.startswith("phi3") else "tiny_path")
    shadowkv = FULL_SHADOW if kind == "shadowkv" else None
    ref = _logits(path, shadowkv)
    ranks = run_ranks(_logits, 2, path, shadowkv)
    for rank, logits in ranks.items():
        assert_close_to(logits, ref, f"{kind} rank {rank}")  # fp32: only the all-reduce's summation order differs
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    assert torch.equal(ranks[0], ranks[1])  # replicated lm_head over all-reduced states: the ranks sample alike


def _shard(path, tp):
    decoder, _ = load_model(path, torch.float32, "cpu", tp=tp)
    return {name: p.clone() for name, p in decoder.named_parameters()}


def test_each_rank_loads_its_slices(tiny_path):
    full, spec = load_model(tiny_path, torch.float32, "cpu")
    params = dict(full.named_parameters())
    ranks = run_ranks(_shard, 2, tiny_path)
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    for r, shard in ranks.items():
        qkv = params["layers.1.self_attn.qkv_proj.weight"]
        rows = [qkv[r * q // 2:(r + 1) * q // 2], qkv[q + r * kv // 2:q + (r + 1) * kv // 2],
                qkv[q + kv + r * kv // 2:q + kv + (r + 1) * kv // 2]]
        assert torch.equal(shard["layers.1.self_attn.qkv_proj.weight"], torch.cat(rows))
        gate_up = params["layers.0.mlp.gate_up_proj.weight"]
        assert torch.equal(shard["layers.0.mlp.gate_up_proj.weight"],
                           torch.cat([gate_up[r * inter // 2:(r + 1) * inter // 2],
                                      gate_up[inter + r * inter // 2:inter + (r + 1) * inter // 2]]))
        assert torch.equal(shard["layers.0.self_attn.o_proj.weight"],
                           params["layers.0.self_attn.o_proj.weight"][:, r * q // 2:(r + 1) * q // 2])
        assert torch.equal(shard["layers.1.mlp.down_proj.weight"],
                           params["layers.1.mlp.down_proj.weight"][:, r * inter // 2:(r + 1) * inter // 2])
        assert torch.equal(shard["lm_head.weight"], params["lm_head.weight"])


def test_bad_splits_are_refused(tiny_path):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(model=tiny_path, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="start_engine"):  # several ranks need their group
        LLMEngine(EngineConfig(model=tiny_path, tensor_parallel_size=2))
    _, spec = load_model(tiny_path, torch.float32, "cpu")
    assert rank_spec(spec, 2).num_kv_heads == 1
    with pytest.raises(ValueError, match="num_key_value_heads"):
        rank_spec(spec, 4)
    with pytest.raises(ValueError, match="multiple of tensor_parallel_size"):
        rank_shadowkv(dataclasses.replace(FULL_SHADOW, rank=33), 2)
    with pytest.raises(ValueError, match="shadowkv rank 27 must be a multiple of tensor_parallel_size"):
        rank_shadowkv(dataclasses.replace(FULL_SHADOW, rank=24, layer_ranks=(27, 21)), 2)


def test_each_rank_keeps_its_share_of_every_layers_rank():
    per_rank = rank_shadowkv(dataclasses.replace(FULL_SHADOW, rank=24, layer_ranks=(32, 16)), 2)
    assert (per_rank.rank, per_rank.layer_ranks) == (12, (16, 8))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_ranks_share_the_hosts_memory_for_their_values(monkeypatch, size):
    """Every rank of a GPU replica sizes its pinned values from MemAvailable at once, before any of them pins: each
    takes its share of the headroom, not the whole of it. A configured host_cache_gib is each rank's as given."""
    monkeypatch.setattr(mm, "mem_available_bytes", lambda: 100 * mm.GIB)
    config = EngineConfig(model="unused", device="cuda", tensor_parallel_size=size)
    assert host_cache_bytes(config, wanted=10**15) == int(100 * mm.GIB * HOST_HEADROOM) // size
    assert host_cache_bytes(config, wanted=mm.GIB) == mm.GIB  # what the GPU pages can use, when that is less
    given = dataclasses.replace(config, host_cache_gib=3.0)
    assert host_cache_bytes(given, wanted=10**15) == 3 * mm.GIB


def test_memory_model_counts_one_ranks_weights_and_cache(tiny_path):
    _, spec = load_model(tiny_path, torch.float32, "cpu")
    whole = mm.Geometry.from_spec(spec, torch.float32)
    rank = whole.rank_share(2)
    assert rank == mm.Geometry.from_spec(rank_spec(spec, 2), torch.float32)
    # loading runs no collective
    shard_params = sum(p.numel() for p in _shard(tiny_path, TensorParallel(0, 2)).values())
    assert rank.weight_bytes == 4 * shard_params  # fp32: replicated embeddings, norms and row-parallel biases once
    assert 2 * mm.dense_block_bytes(rank, 16) == mm.dense_block_bytes(whole, 16)


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_model_len=128, gpu_cache_gib=0.01, host_cache_gib=0.01)


@pytest.mark.parametrize("shadowkv", [None, FULL_SHADOW], ids=["dense", "shadowkv"])
def test_engine_of_two_ranks_gives_the_same_greedy_tokens(tiny_path, shadowkv):
    prompts = [p.tolist() for p in _prompts()]
    one = LLM(model=tiny_path, shadowkv=shadowkv, **ENGINE)
    ref = one.generate(prompts, GREEDY)
    llm = LLM(model=tiny_path, shadowkv=shadowkv, tensor_parallel_size=2, **ENGINE)
    try:
        assert isinstance(llm.engine, TensorParallelEngine)
        outs = llm.generate(prompts, GREEDY)
        # admission counts one rank's bytes, as its cache reserves them: about half of one rank holding every head
        rank_bytes = llm.engine.footprint(64, 16)
        assert engine_footprint(llm.engine).predict(64, 16) == rank_bytes
        assert 0 < rank_bytes[0] < one.engine.footprint(64, 16)[0]
    finally:
        llm.engine.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(o.finish_reason == "length" for o in outs)


def test_ranks_of_a_paced_engine_slice_alike_and_give_one_ranks_tokens(tiny_path):
    """prefill_step_ms: rank 0's pacer scale reaches every rank before each step. Here rank 0 times its steps as far
    under the target (its budget grows every step) while the worker's own steps are far over it (its budget would
    stay put): ranks that sliced a prefill apart would run different collectives."""
    decoding, prompt = [1 + t % (VOCAB - 1) for t in range(9)], torch.randint(VOCAB, (100,)).tolist()
    params = dataclasses.replace(GREEDY, max_tokens=20)
    one = LLM(model=tiny_path, **ENGINE)
    want = [o.token_ids for o in one.generate([decoding, prompt], params)]
    rows = 4 * PrefillBudget(rank_spec(one.engine.model.spec, 2)).projection_row
    engine = TensorParallelEngine(EngineConfig(model=tiny_path, tensor_parallel_size=2, prefill_step_tflop=rows / 1e12,
                                               prefill_step_ms=1e-3, **ENGINE), timeout_s=20)
    ticks = iter(range(10**9))
    engine.engine.pacer.clock = lambda: next(ticks) * 1e-9  # a step of 1 ns: 1,000x under the target
    try:
        engine.add_request("d", decoding, params)
        outs = engine.step() + engine.step()
        engine.add_request("p", prompt, params)
        scales = []
        while engine.requests:
            outs += engine.step()
            scales.append(engine.engine.pacer.scale)
    finally:
        engine.close()
    assert engine.error is None and max(scales) > 10  # rank 0's budget grew: the worker took it
    got = {o.request_id: o.token_ids for o in outs if o.finished}
    assert [got["d"], got["p"]] == want


def test_two_ranks_warm_up_alike_and_then_give_one_ranks_tokens(tiny_path, caplog):
    """start_engine's warm-up goes through the request API (and the bucket compile through a replayed call): every
    rank runs it, their collectives stay in step, and what the replica serves after it is TP=1's."""
    prompts = [p.tolist() for p in _prompts()]
    want = [o.token_ids for o in LLM(model=tiny_path, shadowkv=FULL_SHADOW, **ENGINE).generate(prompts, GREEDY)]
    with caplog.at_level("INFO", logger="shadowkv_core.engine.tensor_parallel"):
        engine = start_engine(EngineConfig(model=tiny_path, shadowkv=FULL_SHADOW, tensor_parallel_size=2,
                                           warm_up=True, **ENGINE), timeout_s=20)
    try:
        assert any(r.getMessage().startswith("warm-up:") for r in caplog.records)  # it ran
        assert engine.stats()["prefix_query_tokens"] == 0  # and its requests are not counted
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, GREEDY)
        outs = []
        while engine.requests:
            outs += engine.step()
    finally:
        engine.close()
    assert engine.error is None
    got = {o.request_id: o.token_ids for o in outs if o.finished}
    assert [got[str(i)] for i in range(len(prompts))] == want


def _record_leaving(monkeypatch, engine) -> list:
    """The order in which rank 0 leaves the group (with its `clean` flag) and waits for its workers to exit."""
    seen = []
    leave, end = tensor_parallel.leave_tensor_parallel, engine._end_workers
    monkeypatch.setattr(tensor_parallel, "leave_tensor_parallel", lambda clean: (seen.append(("leave", clean)),
                                                                                   leave(clean)))
    monkeypatch.setattr(engine, "_end_workers", lambda: (seen.append(("end_workers",)), end()))
    return seen


def test_rank_zero_leaves_the_group_beside_its_workers(tiny_path, monkeypatch):
    """NCCL's shutdown of a group waits for every rank: rank 0 leaves while its workers leave theirs, then waits for
    them to exit. Leaving after that wait (the worker is ended by then) never returned on GPUs."""
    engine = TensorParallelEngine(EngineConfig(model=tiny_path, tensor_parallel_size=2, **ENGINE), timeout_s=20)
    engine.add_request("a", _prompts()[0].tolist(), GREEDY)
    engine.step()
    seen = _record_leaving(monkeypatch, engine)
    engine.close()
    assert seen == [("leave", True), ("end_workers",)]
    assert [w.exitcode for w in engine.workers] == [0]  # the worker left through its own stop, not terminated


def test_a_rank_that_dies_fails_its_requests(tiny_path, monkeypatch):
    engine = TensorParallelEngine(EngineConfig(model=tiny_path, tensor_parallel_size=2, **ENGINE), timeout_s=20)
    seen = _record_leaving(monkeypatch, engine)
    try:
        engine.add_request("a", _prompts()[0].tolist(), dataclasses.replace(GREEDY, max_tokens=80))
        for _ in range(3):
            assert not any(o.finished for o in engine.step())
        os.kill(engine.workers[0].pid, signal.SIGKILL)
        outs = []
        while engine.requests:
            outs += engine.step()
        failed = [o for o in outs if o.request_id == "a" and o.finished]
        assert len(failed) == 1 and failed[0].finish_reason == "error"
        assert "tensor-parallel replica failed" in failed[0].error
        with pytest.raises(RuntimeError, match="tensor-parallel replica failed"):
            engine.add_request("b", [1, 2, 3], GREEDY)
    finally:
        engine.close()
    assert ("leave", False) in seen  # a lost peer: its communicators aborted, nobody waited for


def _threads(tp) -> tuple[int, int]:
    return torch.get_num_threads(), len(os.sched_getaffinity(0))


def test_ranks_split_the_hosts_cpus_between_their_thread_pools(monkeypatch):
    """Each rank defaulted to a thread per CPU, so N ranks ran N times the host's CPUs; a host op large enough to go
    parallel then waited on threads its peers held."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # an explicit setting is the user's and is kept
    for threads, cpus in run_ranks(_threads, 2).values():
        assert 1 <= threads and (threads * 2 <= cpus or threads == 1)


def test_rank_zero_gives_its_process_back_its_threads(tiny_path, monkeypatch):
    """Rank 0 runs in its caller's process (a test run, a benchmark), which keeps running after the replica closes."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)  # a count no rank's share equals
    try:
        engine = TensorParallelEngine(EngineConfig(model=tiny_path, tensor_parallel_size=2, **ENGINE), timeout_s=20)
        assert torch.get_num_threads() <= max(1, len(os.sched_getaffinity(0)) // 2)
        engine.close()
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


def test_workers_wait_out_an_idle_replica(tiny_path):
    """Between requests a worker waits for rank 0's next step, longer than any collective may take: that wait must
    not time out (it did, through the group's collective timeout, and the replica's next request failed)."""
    prompt = _prompts()[0].tolist()
    want = LLM(model=tiny_path, **ENGINE).generate([prompt], GREEDY)[0].token_ids
    engine = TensorParallelEngine(EngineConfig(model=tiny_path, tensor_parallel_size=2, **ENGINE), timeout_s=2)
    try:
        engine.add_request("a", prompt, GREEDY)
        outs = engine.step()
        time.sleep(5)  # idle past the timeout, a step in flight
        while engine.requests:
            outs += engine.step()
    finally:
        engine.close()
    assert engine.error is None
    assert [o.token_ids for o in outs if o.finished] == [want]


def _late_rank_main(rank, rendezvous, delay_s, results):
    time.sleep(delay_s)
    tp = init_tensor_parallel(rank, 2, rendezvous, "cpu", timeout_s=1)
    try:
        results.put((rank, tp.all_reduce(torch.full((2,), float(rank + 1))).tolist()))
    finally:
        torch.distributed.destroy_process_group()


def test_a_rank_slow_to_start_still_joins():
    """The group's connection gives up after the collective timeout: a rank that starts later than that (a loaded
    host, a slow import) failed the replica before it ran a step."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_late_rank_main, args=(r, rendezvous, 3.0 * r, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    assert got == {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_a_rank_lost_before_joining_fails_the_join(tmp_path):
    with pytest.raises(RuntimeError, match="exited before joining"):
        init_tensor_parallel(0, 2, str(tmp_path / "lost"), "cpu", peers_alive=lambda: False)
    with pytest.raises(TimeoutError, match="1 of 2"):
        init_tensor_parallel(0, 2, str(tmp_path / "late"), "cpu", join_timeout_s=0.2)
    assert not torch.distributed.is_initialized()
