"""The engine's sliced prefill (DecoderLayer.prefill_slices, EngineConfig.prefill_step_tflop): a long prompt's prefill
runs a few slices of a layer per step while the running requests keep decoding one token per step, and gives what an
unsliced prefill gives (fp32 on CPU): the same last-token logits, the same greedy tokens, the same prompt logprobs,
for dense and ShadowKV caches, ragged batches and a prompt after a cached prefix."""
import dataclasses

import pytest
import torch

from shadowkv_core import LLM, EngineConfig, SamplingParams, ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.engine.pacing import GROWTH, SHRINK, SlicePacer
from shadowkv_core.engine.sequence import Sequence
from shadowkv_core.models.prefill_cost import PrefillBudget
from shadowkv_core.tiny_model import build_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# full rank and a budget over every context: ShadowKV reproduces dense attention exactly; under 16 tokens stays dense
FULL_SHADOW = ShadowKVConfig(rank=32, chunk_size=4, sparse_budget=4096, outlier_chunks=2, local_chunks=2,
                             min_context=16, decode_window=16)
CACHES = {"dense": None, "shadowkv": FULL_SHADOW}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1))


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_llm(tiny_path, shadowkv=None, **kwargs):
    return LLM(model=tiny_path, max_num_seqs=6, max_model_len=512, gpu_cache_gib=0.03, shadowkv=shadowkv, **kwargs)


def rows_of(engine, n):
    """FLOPs of n rows of a layer's projection: a budget that small slices the prefill finely."""
    return n * PrefillBudget(engine.model.rank_spec).projection_row


def allocated(engine, prompts, first_id=0):
    seqs = []
    for i, prompt in enumerate(prompts, first_id):
        seq = Sequence(i, str(i), prompt, GREEDY, 0)
        seq.num_cached_tokens = engine.cache.manager.allocate(i, len(prompt), GREEDY.max_tokens, prompt)
        seqs.append(seq)
    return seqs


def unsliced_logits(engine, seqs):
    """The last tokens' logits of a whole-layer prefill: the decoder's forward through the caches' attend."""
    job = engine.runner.start_prefill(seqs)
    ids = torch.tensor([t for s in seqs for t in s.prompt_token_ids[s.num_cached_tokens:]])
    with torch.inference_mode():
        h = engine.model(ids, job.meta.positions, engine.cache, job.meta)
    engine.cache.finish_forward(job.meta)
    return engine.model.compute_logits(h[torch.tensor(job.meta.query_lens).cumsum(0) - 1])


def sliced_logits(engine, seqs, flops):
    """(logits, advance_prefill calls) of the runner's sliced prefill at `flops` per call."""
    job, calls = engine.runner.start_prefill(seqs), 1
    while (logits := engine.runner.advance_prefill(job, flops)) is None:
        calls += 1
    return logits, calls


@pytest.mark.parametrize("cache", CACHES)
def test_a_finely_sliced_prefill_of_a_ragged_batch_gives_the_unsliced_logits(tiny_path, cache):
    # 90/61/120 tokens are kept in shadows, 5 and 10 stay dense: with ShadowKV a mixed batch through the hybrid cache
    prompts = [tokens(n, seed) for n, seed in ((90, 1), (5, 2), (61, 3), (10, 4), (120, 5))]
    whole, sliced = make_llm(tiny_path, CACHES[cache]), make_llm(tiny_path, CACHES[cache])
    want = unsliced_logits(whole.engine, allocated(whole.engine, prompts))
    got, calls = sliced_logits(sliced.engine, allocated(sliced.engine, prompts), rows_of(sliced.engine, 7))
    assert calls > 2 * sum(map(len, prompts)) // 7  # projection and MLP rows alone take a call per 7 rows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", CACHES)
def test_attention_slices_say_whether_they_hold_all_of_a_sequences_queries(tiny_path, cache, monkeypatch):
    """A finely sliced prefill hands its caches slices of each sequence's queries marked whole=False (under "auto"
    on CUDA those take the Triton kernel, whose launch serves every slice size, where SDPA's cuDNN kernel would build
    a plan for each); an unsliced one hands each sequence's queries whole."""
    prompts = [tokens(n, seed) for n, seed in ((90, 6), (61, 7))]
    llm = make_llm(tiny_path, CACHES[cache])
    engine, seen = llm.engine, []
    target = type(engine.cache)
    original = target.prefill_attention
    monkeypatch.setattr(target, "prefill_attention",
                        lambda self, q, k, v, whole=True: seen.append((q.shape[0], whole)) or original(self, q, k, v,
                                                                                                       whole))
    sliced_logits(engine, allocated(engine, prompts), rows_of(engine, 7))
    layers = engine.model.spec.num_layers
    assert {n for n, whole in seen if whole} == set() and len(seen) > 2 * layers
    assert sum(n for n, _ in seen) == layers * sum(map(len, prompts))
    seen.clear()
    unsliced = make_llm(tiny_path, CACHES[cache])
    monkeypatch.setattr(type(unsliced.engine.cache), "prefill_attention",
                        lambda self, q, k, v, whole=True: seen.append((q.shape[0], whole)) or original(self, q, k, v,
                                                                                                       whole))
    sliced_logits(unsliced.engine, allocated(unsliced.engine, prompts), float("inf"))
    assert sorted(seen) == sorted([(90, True), (61, True)] * layers)


@pytest.mark.parametrize("budget", [None, 1e-9])
def test_a_suffix_after_a_cached_prefix_prefills_sliced_to_the_cold_logits(tiny_path, budget):
    doc, suffix = tokens(48, 11), tokens(37, 12)
    cold, warm = make_llm(tiny_path, enable_prefix_caching=False), make_llm(tiny_path)
    warm.generate([doc + [7]], GREEDY)  # caches the doc's full blocks
    want = unsliced_logits(cold.engine, allocated(cold.engine, [doc + suffix]))
    seqs = allocated(warm.engine, [doc + suffix], first_id=50)
    assert seqs[0].num_cached_tokens == 48
    flops = None if budget is None else budget * 1e12
    got, calls = sliced_logits(warm.engine, seqs, flops)
    assert (calls == 1) == (budget is None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def run_beside_decodes(llm, prompts, params, decoding=2):
    """Start `decoding` requests, let them decode, then add `prompts`: (the prompts' outputs, per step the requests
    that got a token and whether a prefill job was under way after it)."""
    engine = llm.engine
    for i in range(decoding):
        engine.add_request(f"d{i}", tokens(12, 30 + i), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    outs, steps = {}, []
    while any(f"p{i}" in engine.requests for i in range(len(prompts))):
        got = engine.step()
        steps.append(([o.request_id for o in got], engine.prefill_job is not None))
        outs.update({o.request_id: o for o in got if o.request_id.startswith("p")})
    for i in range(decoding):
        engine.abort(f"d{i}")
    engine.drain_in_flight()  # async decode (CUDA): the aborted requests' caches are freed once it is read back
    stats = engine.stats()
    assert (stats["num_seqs"], stats["num_running"], stats["gpu_bytes_in_use"]) == (0, 0, 0)
    return [outs[f"p{i}"] for i in range(len(prompts))], steps


@pytest.mark.parametrize("cache", CACHES)
def test_a_long_prefill_spans_many_steps_while_each_decode_gets_a_token_every_step(tiny_path, cache):
    llm = make_llm(tiny_path, CACHES[cache])
    engine = llm.engine
    engine.config = dataclasses.replace(engine.config, prefill_step_tflop=rows_of(engine, 16) / 1e12)
    prompt = tokens(200, 21)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    (out,), steps = run_beside_decodes(llm, [prompt], params)
    reference = make_llm(tiny_path, CACHES[cache]).generate([prompt], params)[0]
    assert out.token_ids == reference.token_ids
    prefilling = [got for got, under_way in steps if under_way]
    assert len(prefilling) > 20  # two layers of a 200-token prompt, 16 rows' worth per step
    assert all(sorted(got) == ["d0", "d1"] for got in prefilling)  # every step: one token for each decode
    first = next(i for i, (got, _) in enumerate(steps) if "p0" in got)
    assert first == len(prefilling)  # its first token comes with the step that ends its prefill
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for got, want in zip(out.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert (got.rank, [t for t, _ in got.top]) == (want.rank, [t for t, _ in want.top])
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)


class StepClock:
    """A clock for SlicePacer that moves `step_s` at every read: each step, read at its start and end, lasts that."""

    def __init__(self, step_s):
        self.step_s, self.now = step_s, 0.0

    def __call__(self):
        self.now += self.step_s
        return self.now


def test_the_pacer_raises_the_budget_toward_the_target_and_never_below_prefill_step_tflop(tiny_path):
    config = EngineConfig(model=tiny_path, prefill_step_tflop=2.0, prefill_step_ms=40.0)
    pacer = SlicePacer(StepClock(0.010))
    budgets = []
    for _ in range(8):
        budgets.append(pacer.budget(config))
        pacer.start_step()
        pacer.end_step(config, paced=True)
    assert budgets[0] == 2e12
    assert all(b == pytest.approx(a * GROWTH) for a, b in zip(budgets, budgets[1:]))  # 4x under the target
    pacer.clock.step_s = 0.050  # 1.25x over it: the budget falls by that much
    pacer.start_step()
    pacer.end_step(config, paced=True)
    assert pacer.budget(config) == pytest.approx(budgets[-1] * GROWTH * 0.8)
    pacer.clock.step_s = 1.0  # far over: at most halved a step, down to the floor and no lower
    seen = []
    for _ in range(12):
        pacer.start_step()
        pacer.end_step(config, paced=True)
        seen.append(pacer.budget(config))
    assert seen[0] == pytest.approx(budgets[-1] * GROWTH * 0.8 * SHRINK) and seen[-1] == 2e12 and min(seen) == 2e12
    pacer.clock.step_s = 0.001
    for paced, cfg in ((False, config), (True, dataclasses.replace(config, prefill_step_ms=None))):
        pacer.start_step()
        pacer.end_step(cfg, paced)  # a step without decode and slices, or a fixed budget: no change
        assert pacer.budget(config) == 2e12
    assert pacer.budget(dataclasses.replace(config, prefill_step_tflop=None, prefill_step_ms=None)) is None


def paced_prefill_steps(tiny_path, cache, step_ms, step_s):
    """Prefill steps of a 200-token prompt beside two decodes at 16 rows' worth of prefill_step_tflop, each step
    timed as `step_s` long, and the prompt's output."""
    llm = make_llm(tiny_path, CACHES[cache])
    engine = llm.engine
    engine.config = dataclasses.replace(engine.config, prefill_step_tflop=rows_of(engine, 16) / 1e12,
                                        prefill_step_ms=step_ms)
    engine.pacer.clock = StepClock(step_s)
    (out,), steps = run_beside_decodes(llm, [tokens(200, 21)], GREEDY)
    return sum(under_way for _, under_way in steps), out


@pytest.mark.parametrize("cache", CACHES)
def test_paced_steps_prefill_a_prompt_in_fewer_steps_while_they_are_short_and_change_no_token(tiny_path, cache):
    fixed, want = paced_prefill_steps(tiny_path, cache, None, 0.001)
    short, got = paced_prefill_steps(tiny_path, cache, 40.0, 0.001)
    long, got_long = paced_prefill_steps(tiny_path, cache, 40.0, 0.080)
    assert fixed > 100 and short < fixed / 4  # budgets that grow 1.25x a step: under a quarter of the steps
    assert long == fixed  # steps over the target: prefill_step_tflop, as without a target
    assert got.token_ids == want.token_ids == got_long.token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("cache", CACHES)
def test_on_cuda_a_step_queues_prefill_slices_once_the_last_steps_are_done(tiny_path, cache, monkeypatch):
    """The device holds one step's prefill slices at most: a step queues its slices only after the slices of the step
    before have run, whatever they were (here each step's slices end in a sleeping kernel), so the step budget is
    what a decode waits for, and the tokens are the unsliced ones."""
    llm = make_llm(tiny_path, CACHES[cache], device="cuda", dtype="float32")
    engine = llm.engine
    engine.config = dataclasses.replace(engine.config, prefill_step_tflop=rows_of(engine, 16) / 1e12)
    advance, marks, done_before = engine.runner.advance_prefill, [], []

    def slow_advance(job, flops):
        done_before.append(all(mark.query() for mark in marks))
        logits = advance(job, flops)
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of the device per step
        mark = torch.cuda.Event()
        mark.record()
        marks.append(mark)
        return logits

    monkeypatch.setattr(engine.runner, "advance_prefill", slow_advance)
    for i in range(2):
        engine.add_request(f"d{i}", tokens(12, 30 + i), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    prompt = tokens(120, 22)
    engine.add_request("p", prompt, GREEDY)
    outs = []
    while "p" in engine.requests:
        outs += [o for o in engine.step() if o.request_id == "p"]
    assert len(done_before) > 5 and all(done_before)
    unsliced = make_llm(tiny_path, CACHES[cache], device="cuda", dtype="float32")
    assert outs[-1].token_ids == unsliced.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("cache", CACHES)
def test_on_cuda_a_steps_slices_start_while_its_decode_still_runs(tiny_path, cache, monkeypatch):
    """overlap_prefill: a step's prefill slices go to a low-priority stream of their own and start while the step's
    decode (made to end in a sleeping kernel here) still runs on the high-priority main stream; with one stream they
    start after it."""
    order = {}
    for overlap in (True, False):
        llm = make_llm(tiny_path, CACHES[cache], device="cuda", dtype="float32", overlap_prefill=overlap)
        engine = llm.engine
        assert (engine.streams is not None) == overlap
        if overlap:
            assert engine.streams.main.priority < engine.streams.prefill.priority
        engine.config = dataclasses.replace(engine.config, prefill_step_tflop=rows_of(engine, 16) / 1e12)
        decode, advance, pairs, on = engine.runner.decode, engine.runner.advance_prefill, [], set()

        def slow_decode(*args, **kwargs):
            logits = decode(*args, **kwargs)
            torch.cuda._sleep(50_000_000)
            pairs.append([None, torch.cuda.Event(enable_timing=True)])
            pairs[-1][1].record()
            return logits

        def marked_advance(job, flops):
            on.add(torch.cuda.current_stream() == (engine.streams.prefill if overlap else torch.cuda.default_stream()))
            if pairs and pairs[-1][0] is None:
                pairs[-1][0] = torch.cuda.Event(enable_timing=True)
                pairs[-1][0].record()
            return advance(job, flops)

        monkeypatch.setattr(engine.runner, "decode", slow_decode)
        monkeypatch.setattr(engine.runner, "advance_prefill", marked_advance)
        run_beside_decodes(llm, [tokens(120, 22)], GREEDY)
        torch.cuda.synchronize()
        # elapsed from a step's first slice starting to its decode ending: > 0 when the slice began first
        order[overlap] = [start.elapsed_time(end) for start, end in pairs if start is not None]
        assert on == {True}
    assert len(order[True]) > 5 and all(ms > 0 for ms in order[True])
    assert len(order[False]) > 5 and all(ms < 0 for ms in order[False])


@pytest.mark.gpu
@pytest.mark.parametrize("cache", CACHES)
def test_on_cuda_slices_beside_the_decode_give_the_tokens_of_one_stream(tiny_path, cache):
    """With and without overlap_prefill, the same tokens for every request of a run that holds decodes, a long
    prompt sliced finely, a short one prefilled beside it, and an abort of the long one midway; every pool back to
    empty after (express_run checks)."""
    runs = []
    for overlap in (True, False):
        engine = make_llm(tiny_path, CACHES[cache], device="cuda", dtype="float32", overlap_prefill=overlap).engine
        long_prompt, later = tokens(200, 41), {"short": tokens(9, 42), "other": tokens(150, 43)}
        outs, _, _, _ = express_run(engine, long_prompt, later, GREEDY, abort=("long", 2))
        runs.append({rid: out.token_ids for rid, out in outs.items()})
    assert runs[0] == runs[1] and {"short", "other"} <= set(runs[0])


def held_bytes(job) -> int:
    """Bytes of the distinct tensor storages a prefill job holds between steps: its hidden states and what its layer
    generator (and the generators it delegates to) keep."""
    tensors, gen = [job.hidden], job.layer
    while gen is not None:
        tensors += [v for v in gen.gi_frame.f_locals.values() if isinstance(v, torch.Tensor)]  # closures' too
        gen = gen.gi_yieldfrom
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("cache", CACHES)
def test_what_a_job_holds_between_steps_fits_the_memory_models_prefill_workspace(tiny_path, cache):
    llm = make_llm(tiny_path, CACHES[cache])
    engine = llm.engine
    prompt = tokens(300, 41)
    job = engine.runner.start_prefill(allocated(engine, [prompt]))
    g = mm.Geometry.from_spec(engine.model.rank_spec, torch.float32, "auto")
    workspace = mm.prefill_workspace_bytes(g, CACHES[cache], len(prompt), engine.config.prefill_chunk_tokens)
    peak, rows = 0, rows_of(engine, 40)
    while engine.runner.advance_prefill(job, rows) is None:
        peak = max(peak, held_bytes(job))
    assert 4 * len(prompt) * g.hidden_size * 4 < peak <= workspace  # at least the layer's input, q, k, v, output


def express_run(engine, long_prompt, later, params, after_steps=3, abort=None):
    """Two decodes running, a long prompt sliced finely, and after `after_steps` steps the prompts of `later` added
    (id -> prompt); `abort`: (request id, steps after the later ones are added). -> (outputs by id, per step the ids
    that got a token, the steps an express job was under way); with `abort`, also the ids of the prefill job and the
    express job at the abort, and of the prefill job just after it."""
    engine.config = dataclasses.replace(engine.config, prefill_step_tflop=rows_of(engine, 16) / 1e12)
    for i in range(2):
        engine.add_request(f"d{i}", tokens(12, 30 + i), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request("long", long_prompt, params)
    outs, steps, express, jobs = {}, [], 0, []
    while "long" in engine.requests or any(r in engine.requests for r in later):
        if len(steps) == after_steps:
            for rid, prompt in later.items():
                engine.add_request(rid, prompt, params)
        if abort is not None and len(steps) == after_steps + abort[1]:
            jobs += [job_ids(engine.prefill_job), job_ids(engine.express_job)]
            engine.abort(abort[0])
            jobs.append(job_ids(engine.prefill_job))
        got = engine.step()
        express += engine.express_job is not None
        steps.append([o.request_id for o in got])
        outs.update({o.request_id: o for o in got if not o.request_id.startswith("d")})
    for i in range(2):
        engine.abort(f"d{i}")
    engine.drain_in_flight()
    stats = engine.stats()
    assert (stats["num_seqs"], stats["num_running"], stats["gpu_bytes_in_use"]) == (0, 0, 0)
    return (outs, steps, express, jobs) if abort else (outs, steps, express)


def job_ids(job):
    return None if job is None else [s.request_id for s in job.seqs]


def first_token_step(steps, rid):
    return next(i for i, got in enumerate(steps) if rid in got)


@pytest.mark.parametrize("cache", CACHES)
def test_a_short_prompt_prefills_beside_a_long_one_and_is_answered_first(tiny_path, cache):
    """A short prompt that arrives while a long prompt prefills starts beside it (the express job), gets its first
    token long before the long one does, and both get the tokens they get alone; the decodes keep a token a step."""
    long_prompt, short = tokens(200, 41), tokens(9, 42)
    outs, steps, express = express_run(make_llm(tiny_path, CACHES[cache]).engine, long_prompt, {"short": short},
                                       GREEDY)
    alone = make_llm(tiny_path, CACHES[cache]).generate([long_prompt, short], GREEDY)
    assert [outs["long"].token_ids, outs["short"].token_ids] == [o.token_ids for o in alone]
    assert express > 0 and first_token_step(steps, "short") < first_token_step(steps, "long") - 10
    assert all({"d0", "d1"} <= set(got) for got in steps[:first_token_step(steps, "long")])


def test_a_prompt_that_is_not_short_waits_for_the_long_prefill(tiny_path):
    """A prompt whose prefill costs more than an eighth of what the long prefill has left waits for it to end."""
    long_prompt, middling = tokens(200, 41), tokens(120, 43)
    outs, steps, express = express_run(make_llm(tiny_path).engine, long_prompt, {"middling": middling}, GREEDY)
    assert express == 0 and first_token_step(steps, "middling") > first_token_step(steps, "long")


def test_a_next_turn_after_a_cached_prefix_prefills_beside_a_long_prompt(tiny_path):
    """A conversation's next turn is a long prompt whose first pages are cached: only its new tokens prefill, which
    makes it short; it starts beside a long cold prompt and gets the tokens of the same turn prefilled cold."""
    llm = make_llm(tiny_path, FULL_SHADOW)
    doc = tokens(84, 44)  # one 64-token page of shadow, then the window
    first = llm.generate([doc], GREEDY)[0]
    turn = doc + first.token_ids + tokens(6, 45)
    assert llm.engine.cache.manager.cached_prefix_len(len(turn), GREEDY.max_tokens, turn) == 64
    outs, steps, express = express_run(llm.engine, tokens(400, 41), {"turn": turn}, GREEDY)
    cold = make_llm(tiny_path, FULL_SHADOW, enable_prefix_caching=False).generate([turn], GREEDY)[0]
    assert outs["turn"].token_ids == cold.token_ids
    assert express > 0 and first_token_step(steps, "turn") < first_token_step(steps, "long") - 10


@pytest.mark.parametrize("abort, after", [("long", 1), ("short", 1)])
def test_an_abort_beside_an_express_prefill_leaves_the_other_to_finish(tiny_path, abort, after):
    """Aborting the long prompt while a short one prefills beside it makes the short one the prefill under way;
    aborting the short one leaves the long one's; the other gets its tokens, and every pool returns to empty."""
    long_prompt, short = tokens(200, 41), tokens(9, 42)
    outs, _, _, jobs = express_run(make_llm(tiny_path, FULL_SHADOW).engine, long_prompt, {"short": short}, GREEDY,
                                   abort=(abort, after))
    kept = "short" if abort == "long" else "long"
    assert jobs == [["long"], ["short"], [kept]]
    alone = make_llm(tiny_path, FULL_SHADOW).generate([long_prompt if kept == "long" else short], GREEDY)[0]
    assert outs[kept].token_ids == alone.token_ids and abort not in outs
