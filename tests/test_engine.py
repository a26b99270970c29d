import json

import pytest
import torch

from shadowkv_core import LLM, EngineConfig, LLMEngine, SamplingParams, ShadowKVConfig
from shadowkv_core.cache.base import CacheSpec
from shadowkv_core.cache.dense import DenseKVCache
from shadowkv_core.tiny_model import build_tiny_model, tiny_llama_config
from support.model_factory import decode, prefill

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# The tiny model has 2 KV heads of 16 dims: rank 32 is full rank; a 4096-token budget covers every context here,
# so ShadowKV must reproduce the dense path exactly. Prompts under 16 tokens stay dense; the window folds often.
FULL_SHADOW = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=4096, outlier_chunks=2, local_chunks=2,
                             min_context=16, decode_window=16)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1))


@pytest.fixture(scope="module", params=["dense", "shadowkv"])
def llm(request, tiny_path):
    shadowkv = FULL_SHADOW if request.param == "shadowkv" else None
    return LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, shadowkv=shadowkv)


@pytest.fixture(scope="module")
def dense_llm(tiny_path):
    return LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01)


def prompts_of_lengths(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def cache_is_empty(engine):
    stats = engine.stats()
    return (stats["num_running"], stats["num_waiting"], stats["num_seqs"], stats["gpu_bytes_in_use"]) == (0, 0, 0, 0)


@pytest.mark.parametrize("field, kwargs", [
    ("max_tokens", {"max_tokens": 0}), ("temperature", {"temperature": -0.1}), ("top_p", {"top_p": 0}),
    ("top_k", {"top_k": -2}), ("stop", {"stop": [""]}), ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("seed", {"seed": 1.5}), ("temperature", {"temperature": float("nan")}),
])
def test_sampling_params_name_the_bad_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field, prompt, params", [
    ("prompt", [], GREEDY),
    ("prompt", [1, 2, 10_000], GREEDY),
    ("prompt", list(range(200)) * 3, GREEDY),
    ("max_tokens", [1, 2, 3], SamplingParams(max_tokens=510)),
])
def test_bad_requests_are_refused_and_leave_the_engine_untouched(llm, field, prompt, params):
    engine = llm.engine
    before = engine.stats()
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    assert engine.stats() == before and "bad" not in engine.requests


def test_ragged_batch_equals_each_prompt_alone(llm):
    prompts = prompts_of_lengths([3, 17, 40, 9, 64])
    together = llm.generate(prompts, GREEDY)
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in together)
    assert cache_is_empty(llm.engine)


def test_requests_join_mid_decode_and_abort_frees_everything(llm):
    engine = llm.engine
    first, late, doomed = prompts_of_lengths([20, 33, 50], seed=3)
    want_late = llm.generate([late], GREEDY)[0].token_ids
    engine.add_request("first", first, GREEDY)
    engine.add_request("doomed", doomed, SamplingParams(max_tokens=100, temperature=0))
    for _ in range(4):
        engine.step()
    engine.add_request("late", late, GREEDY)
    outs = {}
    engine.step()
    assert engine.stats()["num_running"] == 3  # the late request joined the running decode batch
    engine.abort("doomed")
    assert engine.stats()["num_running"] == 2
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["late"].token_ids == want_late
    assert "doomed" not in outs and cache_is_empty(engine)


def test_stop_strings_stop_tokens_and_seeded_sampling(llm):
    prompt = prompts_of_lengths([10], seed=5)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    third = free.token_ids[2]
    by_token = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[third],
                                                     ignore_eos=True))[0]
    assert by_token.token_ids == free.token_ids[:free.token_ids.index(third) + 1]
    assert by_token.finish_reason == "stop"
    assert len(free.text) > 4, free.text
    stop = free.text[2:4]
    by_text = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert by_text.finish_reason == "stop" and stop not in by_text.text
    assert free.text.startswith(by_text.text)
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = llm.generate([prompt, prompt], sampled)
    assert a.token_ids == b.token_ids and a.token_ids != free.token_ids[:16]


def test_a_failing_step_fails_only_its_requests_and_frees_them(llm, monkeypatch):
    engine = llm.engine
    prompt = prompts_of_lengths([12], seed=9)[0]
    engine.add_request("victim", prompt, GREEDY)

    def broken(job, num_layers):
        raise RuntimeError("injected failure")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "advance_prefill", broken)
        (out,) = engine.step()
    assert out.finished and out.finish_reason == "error" and "injected failure" in out.error
    assert cache_is_empty(engine)
    assert llm.generate([prompt], GREEDY)[0].finish_reason == "length"


def test_engine_config_errors_are_clear(tiny_path):
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model=tiny_path, dtype="float8")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLMEngine(EngineConfig(model=tiny_path, max_num_seqs=0))
    with pytest.raises(ValueError, match="prefill_attention"):
        EngineConfig(model=tiny_path, prefill_attention="flash")
    with pytest.raises(ValueError, match="'cudnn' needs a CUDA device"):
        EngineConfig(model=tiny_path, prefill_attention="cudnn", device="cpu")
    with pytest.raises(ValueError, match="overlap_prefill needs a CUDA device"):
        EngineConfig(model=tiny_path, overlap_prefill=True, device="cpu")
    with pytest.raises(ValueError, match="overlap_prefill"):
        EngineConfig(model=tiny_path, overlap_prefill="yes")
    assert LLMEngine(EngineConfig(model=tiny_path, overlap_prefill=False)).streams is None
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=tiny_path, kv_cache_dtype="int8")
    for bad in (0, -1.0, True, "6", float("nan")):
        with pytest.raises(ValueError, match="prefill_step_tflop"):
            EngineConfig(model=tiny_path, prefill_step_tflop=bad)
    assert EngineConfig(model=tiny_path, prefill_step_tflop=None).prefill_step_tflop is None  # no limit
    for bad in (0, -5.0, True, "40", float("nan")):
        with pytest.raises(ValueError, match="prefill_step_ms must be > 0"):
            EngineConfig(model=tiny_path, prefill_step_ms=bad)
    with pytest.raises(ValueError, match="prefill_step_ms paces .* needs prefill_step_tflop"):
        EngineConfig(model=tiny_path, prefill_step_tflop=None, prefill_step_ms=40.0)
    assert EngineConfig(model=tiny_path, prefill_step_ms=40).prefill_step_ms == 40


def test_split_prefill_attention_gives_the_default_tokens(tiny_path, dense_llm, monkeypatch):
    """prefill_attention reaches the caches (dense and shadow sequences in one batch) and changes no token."""
    import shadowkv_core.attention as attention
    calls = []
    split = attention.prefill_attention_split
    monkeypatch.setattr(attention, "prefill_attention_split", lambda *a: calls.append(1) or split(*a))
    for shadowkv in (None, FULL_SHADOW):
        llm = LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, shadowkv=shadowkv,
                  prefill_attention="sdpa_split", max_prefill_tokens=64, prefill_chunk_tokens=16)
        prompts = prompts_of_lengths([40, 100, 23], seed=5)
        want = dense_llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in want]
    assert calls


def teacher_forced_logits(engine, kv_cache_dtype, prompt, generated):
    """Logits of every decode step of prompt + generated, read through a fresh dense cache of kv_cache_dtype."""
    spec = CacheSpec.of(engine.spec, torch.float32, "cpu", use_kernels=False, kv_cache_dtype=kv_cache_dtype)
    cache = DenseKVCache(spec, num_blocks=64, block_size=16)
    cache.manager.allocate(0, len(prompt), len(generated))
    with torch.no_grad():
        logits = [prefill(engine.model, cache, [torch.tensor(prompt)])[-1:]]
        for i, token in enumerate(generated[:-1]):
            logits.append(decode(engine.model, cache, [token], [len(prompt) + i]))
    return torch.cat(logits)  # (generated, vocab)


def test_fp8_dense_cache_generates_greedily_with_logits_close_to_the_model_dtype_cache(tiny_path):
    fp8 = LLM(model=tiny_path, max_num_seqs=2, max_model_len=512, gpu_cache_gib=0.01, kv_cache_dtype="fp8")
    prompts = prompts_of_lengths([40, 23], seed=19)
    for prompt, out in zip(prompts, fp8.generate(prompts, GREEDY)):
        assert len(out.token_ids) == GREEDY.max_tokens
        got = teacher_forced_logits(fp8.engine, "fp8", prompt, out.token_ids)
        want = teacher_forced_logits(fp8.engine, "auto", prompt, out.token_ids)
        assert got.argmax(-1).tolist() == out.token_ids  # the engine decoded from these fp8 logits
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert err <= 2 ** -4 * scale, f"fp8 KV moved the logits by {err:.3g} of a scale of {scale:.3g}"
    assert cache_is_empty(fp8.engine)


def test_full_budget_full_rank_shadowkv_equals_dense_over_long_generation(tiny_path, dense_llm):
    shadow = LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, shadowkv=FULL_SHADOW)
    prompts = prompts_of_lengths([40, 100, 23], seed=11)
    long = SamplingParams(max_tokens=4 * FULL_SHADOW.decode_window, temperature=0, ignore_eos=True)
    want = dense_llm.generate(prompts, long)
    got = shadow.generate(prompts, long)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(len(o.token_ids) == 64 for o in got)
    assert cache_is_empty(shadow.engine) and shadow.engine.stats()["host_bytes_in_use"] == 0


def test_dummy_weights_serve_a_config_only_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama_config(262)))
    llm = LLM(model=str(tmp_path), load_format="dummy", gpu_cache_gib=0.01, max_model_len=256)
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3, 4]], GREEDY)[0]
    assert len(out.token_ids) == 12 and out.text == ""
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("text needs a tokenizer", GREEDY)


# FLOPs of about 16 rows of the tiny model's q/k/v projection (2 * 64 * 128 per row): a long prompt's prefill beside
# running decodes takes many steps, each layer several
SMALL_STEP_TFLOP = 2.5e-7


@pytest.mark.parametrize("shadowkv", [FULL_SHADOW, None], ids=["shadowkv", "dense"])
def test_an_abort_in_the_middle_of_a_sliced_prefill_frees_it_and_spares_the_rest_of_its_job(tiny_path, shadowkv):
    llm = LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01, max_prefill_tokens=256,
              shadowkv=shadowkv, prefill_step_tflop=SMALL_STEP_TFLOP, enable_prefix_caching=False)  # one job
    engine = llm.engine
    short, long, doomed = prompts_of_lengths([10, 64, 64], seed=13)
    want = [o.token_ids for o in llm.generate([short, long], GREEDY)]
    engine.add_request("short", short, GREEDY)
    engine.step()  # nothing decodes yet: the short prompt's whole prefill runs in this step
    assert engine.prefill_job is None
    engine.add_request("long", long, GREEDY)
    engine.add_request("doomed", doomed, GREEDY)  # one job of 128 tokens, beside the short one's decodes
    for _ in range(3):
        assert "short" in {o.request_id for o in engine.step()}
    job = engine.prefill_job
    assert job.layer is not None and job.next_layer == 0  # in the middle of the first layer
    engine.abort("doomed")
    assert [s.request_id for s in engine.prefill_job.seqs] == ["long"] and engine.prefill_job.layer is None
    assert engine.stats()["num_seqs"] == 2  # the aborted prompt's cache is freed at once
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert [outs["short"].token_ids, outs["long"].token_ids] == want
    assert cache_is_empty(engine)


@pytest.mark.parametrize("shadowkv", [FULL_SHADOW, None], ids=["shadowkv", "dense"])
def test_the_triton_decode_path_generates_what_the_reference_path_does(tiny_path, dense_llm, shadowkv):
    # On CPU the kernels run in Triton's interpreter (tests/conftest.py): slow, so a short run.
    prompts = prompts_of_lengths([70, 33], seed=17)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    fast = LLM(model=tiny_path, max_num_seqs=2, max_model_len=256, gpu_cache_gib=0.01, shadowkv=shadowkv,
               use_kernels=True)
    assert [o.token_ids for o in fast.generate(prompts, params)] == \
        [o.token_ids for o in dense_llm.generate(prompts, params)]
    assert shadowkv is None or fast.engine.stats()["hit_rate"] > 0


def test_streamed_text_never_shows_the_start_of_a_stop_string(llm):
    prompt = prompts_of_lengths([10], seed=5)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].text
    stop = free[3:6]
    engine = llm.engine
    engine.add_request("held", prompt, SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.text for o in engine.step() if o.request_id == "held"]
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), seen  # streamed text only ever grows
    assert seen[-1] == free[:free.index(stop)]


def test_a_short_prompt_with_a_long_generation_is_kept_in_shadows(tiny_path, dense_llm):
    shadow = LLM(model=tiny_path, max_num_seqs=2, max_model_len=512, gpu_cache_gib=0.01, shadowkv=FULL_SHADOW)
    prompt = prompts_of_lengths([6], seed=19)[0]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)  # 46 tokens > min_context (16)
    assert shadow.engine.cache.manager.can_allocate(6, 40)
    assert shadow.generate([prompt], params)[0].token_ids == dense_llm.generate([prompt], params)[0].token_ids


SPARSE = dict(rank=8, chunk_size=4, sparse_budget=8, outlier_chunks=1, local_chunks=2, min_context=16,
              decode_window=8)  # low rank, small budget: misses every step
RAGGED_PROMPTS = prompts_of_lengths([90, 5, 61, 47, 120], seed=23)  # 5 + 10 tokens stay dense


def decode_counting(llm: LLM, prompts, params) -> tuple[dict, list[dict]]:
    """Generate step by step -> the tokens per request and the cache's counters after each step."""
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), p, params)
    tokens, counters = {}, []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens[out.request_id] = out.token_ids
        stats = llm.engine.cache.stats()
        counters.append({k: stats[k] for k in ("chunks_fetched", "chunks_from_device")})
    assert cache_is_empty(llm.engine)
    return tokens, counters


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "triton"])
def test_pipelined_halves_decode_exactly_as_one_batch(tiny_path, use_kernels):
    """pipeline_decode only reorders work (two halves, layer by layer): same tokens, same selections and fetches, on
    a sparse config and a ragged batch mixing dense and shadow sequences."""
    sparse = ShadowKVConfig(**SPARSE)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    runs, halves_calls = [], []
    for pipeline in (False, True):
        llm = LLM(model=tiny_path, max_num_seqs=5, max_model_len=256, gpu_cache_gib=0.01, shadowkv=sparse,
                  use_kernels=use_kernels, pipeline_decode=pipeline, pipeline_min_batch=2)
        model = llm.engine.runner.model
        halves = model.forward_halves
        model.forward_halves = lambda *args: halves_calls.append(pipeline) or halves(*args)
        runs.append(decode_counting(llm, RAGGED_PROMPTS, params))
    assert runs[0] == runs[1]
    assert halves_calls and all(halves_calls)  # the pipelined engine decoded in halves, the other never
    # the sparse config fetched: the halves' counters are summed, not overwritten
    assert sum(c["chunks_fetched"] for c in runs[0][1]) > 0
    # by default only CUDA pipelines (its side streams are what a half's fetch overlaps on)
    default = LLM(model=tiny_path, max_num_seqs=2, max_model_len=256, gpu_cache_gib=0.01, shadowkv=sparse)
    assert default.engine.config.pipeline_decode == "auto" and default.engine.runner.pipeline_min_batch == 0
    # asked for, the smallest pipelined batch defaults to the measured break-even: twice as large with fp8 values
    for value_format, min_batch in (("model", 8), ("fp8", 16)):
        asked = LLM(model=tiny_path, max_num_seqs=2, max_model_len=256, gpu_cache_gib=0.01, pipeline_decode=True,
                    shadowkv=ShadowKVConfig(**SPARSE, value_format=value_format))
        assert asked.engine.runner.pipeline_min_batch == min_batch


def test_a_tensor_parallel_rank_decodes_whole_batches_unless_asked(tiny_path):
    """pipeline_decode auto: on CUDA, one GPU's engine pipelines from the break-even batch, a rank of a group never
    (it reads its weights twice for a fetch of its share of the KV heads); asked for, a rank pipelines too."""
    fp8 = ShadowKVConfig(**SPARSE, value_format="fp8")
    auto = EngineConfig(model=tiny_path, shadowkv=fp8)
    assert LLMEngine.pipeline_min_batch(auto, cuda=True, size=1) == 16
    assert LLMEngine.pipeline_min_batch(auto, cuda=True, size=4) == 0
    asked = EngineConfig(model=tiny_path, shadowkv=fp8, pipeline_decode=True)
    assert LLMEngine.pipeline_min_batch(asked, cuda=True, size=4) == 16
    assert LLMEngine.pipeline_min_batch(EngineConfig(model=tiny_path, shadowkv=None), cuda=True, size=1) == 0


def test_next_finish_bounds_when_a_request_can_end(tiny_path):
    """LLMEngine.next_finish_s: None while idle or before any prefill was timed alone; during a prefill with nothing
    decoding, the time its layers still need at the fastest timed prefill rate; 0 once a request decodes."""
    llm = LLM(model=tiny_path, max_num_seqs=2, max_model_len=512, gpu_cache_gib=0.01,
              prefill_step_tflop=SMALL_STEP_TFLOP)
    engine = llm.engine
    first, second = prompts_of_lengths([200, 200], seed=29)
    assert engine.next_finish_s() is None
    engine.add_request("timed", first, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()  # nothing decodes beside it: its whole prefill runs in this step, timed
    assert not engine.has_unfinished_requests()
    engine.add_request("brief", prompts_of_lengths([5], seed=31)[0], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.add_request("bounded", second, SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.next_finish_s() == 0.0  # "brief" decodes
    engine.step()
    engine.step()  # "brief" ends; the prefill has run a few slices beside its decodes
    assert "brief" not in engine.requests and engine.prefill_job is not None
    half = engine.next_finish_s()
    assert half is not None and half > 0  # its layers are still to run
    engine.step()  # nothing decodes: the rest of the prefill runs whole; the request decodes
    assert engine.next_finish_s() == 0.0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.next_finish_s() is None and cache_is_empty(engine)


def run_to_the_end(engine: LLMEngine, requests: dict, join: dict | None = None, abort_at: dict | None = None) -> dict:
    """Add `requests` (id -> (prompt, params)), step until done; `join`: step -> requests added before it,
    `abort_at`: step -> request aborted before it. -> the last output of every request."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outs, step = {}, 0
    while engine.has_unfinished_requests():
        for request_id, (prompt, params) in (join or {}).get(step, {}).items():
            engine.add_request(request_id, prompt, params)
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
        outs.update({o.request_id: o for o in engine.step()})
        step += 1
    return outs


@pytest.mark.parametrize("shadowkv", [SPARSE, None], ids=["shadowkv", "dense"])
def test_async_decode_gives_the_tokens_text_and_finishes_of_sync_decode(tiny_path, shadowkv):
    """EngineConfig.async_decode launches a step before reading the one before it back: the same tokens, text and
    finish reasons as step-by-step decode, on a ragged batch with stop tokens, stop strings, lengths, a late join,
    an abort and a sampled request (drawn on the device, from its seed and token index); every cache freed at the
    end."""
    prompts = prompts_of_lengths([90, 5, 61, 47, 120, 33], seed=31)
    config = None if shadowkv is None else ShadowKVConfig(**shadowkv)
    free = LLM(model=tiny_path, max_num_seqs=6, max_model_len=256, gpu_cache_gib=0.01, shadowkv=config).generate(
        prompts[:2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    requests = {
        "long": (prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
        "stop_token": (prompts[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[free[1].token_ids[6]])),
        "stop_text": (prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                 stop=[free[0].text[5:7]])),
        "short": (prompts[2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
        "aborted": (prompts[3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
    }
    join = {4: {"late": (prompts[4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))},
            12: {"sampled": (prompts[5], SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, top_k=20, seed=3,
                                                        ignore_eos=True))}}
    runs = []
    for async_decode in (False, True):
        llm = LLM(model=tiny_path, max_num_seqs=6, max_model_len=256, gpu_cache_gib=0.01, async_decode=async_decode,
                  shadowkv=config)
        outs = run_to_the_end(llm.engine, requests, join, abort_at={6: "aborted"})
        assert cache_is_empty(llm.engine) and llm.engine.in_flight is None
        runs.append({k: (o.token_ids, o.text, o.finish_reason) for k, o in outs.items()})
    (sync_aborted, _, _), (async_aborted, _, _) = (run.pop("aborted") for run in runs)
    assert runs[1] == runs[0]
    assert async_aborted == sync_aborted[:-1]  # its last token was still in flight when it was aborted
    assert runs[0]["stop_token"][2] == runs[0]["stop_text"][2] == "stop"
    assert runs[0]["short"][2] == runs[0]["late"][2] == "length"


def test_async_decode_reports_a_token_one_step_late_and_frees_an_abort_after_its_step(tiny_path):
    """The first decode step returns nothing (its token is read back by the next); an abort while a step that holds
    the request is in flight frees its cache only once that step is read back."""
    llm = LLM(model=tiny_path, max_num_seqs=2, max_model_len=256, gpu_cache_gib=0.01, async_decode=True,
              shadowkv=ShadowKVConfig(**SPARSE))
    engine = llm.engine
    engine.add_request("a", prompts_of_lengths([70], seed=37)[0], GREEDY)
    (prefilled,) = engine.step()
    assert prefilled.new_token_ids and engine.in_flight is None
    assert engine.step() == [] and engine.in_flight is not None
    (second,) = engine.step()
    assert len(second.token_ids) == 2
    engine.abort("a")
    assert engine.stats()["num_running"] == 0 and engine.cache.stats()["num_seqs"] == 1  # its step still runs
    assert engine.has_unfinished_requests()
    assert engine.step() == []
    assert cache_is_empty(engine) and not engine.has_unfinished_requests()
    sync = LLM(model=tiny_path, max_num_seqs=2, max_model_len=256, gpu_cache_gib=0.01)
    assert sync.engine.async_decode is False  # by default, CUDA only


@pytest.mark.parametrize("where", ["launch", "read_back"])
def test_async_decode_failure_fails_its_requests_and_frees_them_after_the_step_holding_them(tiny_path, monkeypatch,
                                                                                             where):
    """A decode step that fails to launch, or whose tokens fail to come back, while another step holding the same
    requests is in flight: the requests end with an error at once, and their caches are freed once no step still
    running holds them; the engine then serves a new request."""
    llm = LLM(model=tiny_path, max_num_seqs=2, max_model_len=256, gpu_cache_gib=0.01, async_decode=True,
              shadowkv=ShadowKVConfig(**SPARSE))
    engine = llm.engine
    for request_id, prompt in zip("ab", prompts_of_lengths([70, 9], seed=41)):
        engine.add_request(request_id, prompt, GREEDY)
    while engine.in_flight is None or len(engine.in_flight.seqs) < 2:
        engine.step()

    def broken(*args):
        raise RuntimeError("injected failure")

    with monkeypatch.context() as patch:
        if where == "launch":
            patch.setattr(engine.runner, "decode", broken)
        else:
            patch.setattr(engine.in_flight.readback, "tolist", broken)
        outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert all(o.finished and o.finish_reason == "error" and "injected failure" in o.error for o in outs)
    assert engine.stats()["num_running"] == 0
    # launch: the step holding them was read back in the same call; read_back: the step launched before it holds them
    assert engine.cache.stats()["num_seqs"] == (2 if where == "read_back" else 0)
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert cache_is_empty(engine) and engine.in_flight is None
    assert llm.generate([prompts_of_lengths([30], seed=43)[0]], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("async_decode", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("shadowkv", [None, SPARSE, {**SPARSE, "value_format": "fp8"}],
                         ids=["dense", "shadowkv", "shadowkv_fp8"])
def test_a_forked_request_decodes_what_its_source_does(tiny_path, shadowkv, async_decode, monkeypatch):
    """fork mid-generation copies the source's window, resident chunks, shadow and generated tokens (with async
    decode, once the step in flight is read back): greedy, the fork's tokens are the source's, and both caches are
    freed at the end. A fork the running batch has no room for is refused and takes nothing."""
    llm = LLM(model=tiny_path, max_num_seqs=2, max_model_len=256, gpu_cache_gib=0.01, async_decode=async_decode,
              shadowkv=None if shadowkv is None else ShadowKVConfig(**shadowkv))
    engine, prompt = llm.engine, prompts_of_lengths([90], seed=47)[0]
    want = llm.generate([prompt], GREEDY)[0].token_ids
    engine.add_request("src", prompt, GREEDY)
    while len(engine.requests["src"].output_token_ids) < 3:
        engine.step()
    with pytest.raises(ValueError, match="not decoding"):
        engine.fork("nobody", "x")
    engine.fork("src", "fork")
    assert engine.requests["fork"].output_token_ids == engine.requests["src"].output_token_ids
    held = engine.stats()
    with pytest.raises(RuntimeError, match="running batch is full"):
        engine.fork("src", "third")
    assert engine.stats() == held and "third" not in engine.requests
    engine.abort("fork")
    engine.drain_in_flight()
    with monkeypatch.context() as patch:  # a copy that fails returns the slot and pages it was given
        patch.setattr(engine.cache, "copy_sequence", lambda src, dst: (_ for _ in ()).throw(RuntimeError("copy")))
        with pytest.raises(RuntimeError, match="copy"):
            engine.fork("src", "broken")
    assert engine.stats()["num_seqs"] == 1 and len(engine.scheduler.running) == 1
    engine.fork("src", "fork")
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.token_ids
    assert outs["fork"] == outs["src"] == want and cache_is_empty(engine)


def test_logprobs_and_prompt_logprobs_are_the_log_softmax_of_the_models_own_logits(llm, monkeypatch):
    """Each output token's logprob, rank and top ids are those of log_softmax of the model's logits at its step, before
    the request's adjustments (a logit bias and a penalty here); prompt logprobs those of one full forward over the
    prompt, computed a few rows at a time."""
    monkeypatch.setattr("shadowkv_core.engine.runner.PROMPT_LOGITS_ELEMENTS", 7 * llm.engine.spec.vocab_size)
    prompts = prompts_of_lengths([40, 23], seed=41)
    cases = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=3),
             SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True, logprobs=2, presence_penalty=1.5,
                            logit_bias={7: 3.0})]
    for params in cases:
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            want = torch.log_softmax(teacher_forced_logits(llm.engine, "auto", prompt, out.token_ids).double(), -1)
            assert len(out.logprobs) == len(out.token_ids) == 10
            for row, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
                assert lp.logprob == pytest.approx(float(want[row, token]), abs=1e-4)
                assert lp.rank == int((want[row] > want[row, token] + 1e-6).sum()) + 1
                assert [t for t, _ in lp.top] == want[row].topk(params.logprobs).indices.tolist()
            assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
            if params.prompt_logprobs is None:
                assert out.prompt_logprobs is None
                continue
            cache = DenseKVCache(CacheSpec.of(llm.engine.spec, torch.float32, "cpu", use_kernels=False),
                                 num_blocks=64, block_size=16)
            cache.manager.allocate(0, len(prompt), 1)
            with torch.no_grad():
                full = torch.log_softmax(prefill(llm.engine.model, cache, [torch.tensor(prompt)]).double(), -1)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            for pos, lp in enumerate(out.prompt_logprobs[1:]):
                assert lp.logprob == pytest.approx(float(full[pos, prompt[pos + 1]]), abs=1e-4)
                assert [t for t, _ in lp.top] == full[pos].topk(3).indices.tolist()
    assert cache_is_empty(llm.engine)


def test_async_decode_gives_the_logprobs_and_penalised_tokens_of_sync_decode(tiny_path):
    """Under async decode the penalties count the token still in flight (on the device), and each token's logprobs
    are read back with it."""
    prompts = prompts_of_lengths([30, 12], seed=43)
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2, frequency_penalty=1.0),
              SamplingParams(max_tokens=16, temperature=1.0, seed=9, ignore_eos=True, logprobs=0,
                             repetition_penalty=1.3, presence_penalty=0.5)]
    requests = {f"r{i}": (prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))}
    runs = []
    for async_decode in (False, True):
        llm = LLM(model=tiny_path, max_num_seqs=2, max_model_len=256, gpu_cache_gib=0.01, async_decode=async_decode)
        outs = run_to_the_end(llm.engine, requests)
        assert cache_is_empty(llm.engine) and not llm.engine.counts.rows
        runs.append({k: (o.token_ids, [(lp.logprob, lp.rank, lp.top) for lp in o.logprobs]) for k, o in outs.items()})
    assert runs[1] == runs[0]
