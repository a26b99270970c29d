"""The accuracy harness's two multi-step tasks (benchmarks/accuracy_runs.py): tokens fed through decode steps are the
tokens the model sees, the long-generation prompt is the needle's prompt less its question, and each turn of a
conversation re-sends the one before it with its answer; a conversation on one engine (the cached methods) answers
as re-prefilling each turn cold does, from its prefix cache, and the command line runs the cached methods on
niah_multiturn alone."""
import gc
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

import benchmarks.accuracy_runs as runs
from benchmarks.accuracy import rank_share_of, score_rows
from benchmarks.accuracy_runs import MAX_TOKENS, build, conversation_len, generate, longgen_parts
from shadowkv_core.tiny_model import build_tiny_model
from training.data import make_sample
from training.templates import MULTITURN, RULER, VARIED

MODEL = str(Path(__file__).resolve().parents[1] / "models" / "shadowkv-small")


@pytest.mark.parametrize("method", ["dense", "shadowkv"])
def test_fed_tokens_are_decoded_as_if_they_were_the_prompt(tmp_path, method):
    """Feeding F after prompt P, one decode step at a time, answers as prefilling P + F does: for dense attention,
    and for ShadowKV at a budget that takes every chunk (its window folds twice on the way)."""
    model = str(build_tiny_model(tmp_path / "tiny"))
    prompt, fed = list(range(40, 240)), list(range(60, 220))
    budget = 2.0  # of the prompt: more chunks than the shadow will hold, folded ones included
    fed_llm = build(model, method, len(prompt), budget, "cpu", 1.0, 600, forced=True)
    whole_llm = build(model, method, len(prompt) + len(fed), budget, "cpu", 1.0, 600)
    answer_fed, _ = generate(fed_llm, [prompt], [fed])
    answer_whole, _ = generate(whole_llm, [prompt + fed])
    assert answer_fed == answer_whole and len(answer_fed[0]) > 0


def test_calibrated_ranks_follow_the_models_keys_and_keep_the_methods_mean(tmp_path):
    """--calibrate-ranks: ShadowKV's engine keeps each layer at the rank shadowkv.ranks gives for the text's keys,
    their mean the method's rank; dense is unchanged."""
    from shadowkv_core.shadowkv.ranks import allocate_ranks
    text = tmp_path / "calibration.txt"
    text.write_bytes(b"The quick brown fox jumps over the lazy dog while the cat sleeps. " * 40)
    llm = build(MODEL, "shadowkv", 512, 0.1, "cpu", 12 / 128, 600, calibration_file=str(text))  # mean rank 12
    config = llm.engine.cache.shadow.config
    spectra = list(runs.calibration_spectra(MODEL, str(text), "cpu"))
    assert config.rank == 12 and config.layer_ranks == allocate_ranks(spectra, 12)
    assert len(set(config.layer_ranks)) > 2  # the shipped model's layers differ below its rank-20 keys
    assert [u.shape[-1] for u in llm.engine.cache.shadow.gpu.u] == list(config.layer_ranks)
    assert build(MODEL, "dense", 512, 1.0, "cpu", 0.5, 600, calibration_file=str(text)).engine.config.shadowkv is None


def test_the_baselines_read_exact_keys_and_shadowkv_its_own_rank():
    """Quest, StreamingLLM and SnapKV keep the tokens they keep exactly, so their chunks are rebuilt at
    --baseline-rank-share (full by default); ShadowKV and the chunk oracle at ShadowKV's rank."""
    args = Namespace(rank_share=20 / 128, baseline_rank_share=1.0)
    assert [rank_share_of(args, m) for m in ("quest", "streamingllm", "snapkv")] == [1.0] * 3
    assert [rank_share_of(args, m) for m in ("shadowkv", "shadowkv_timed", "chunk_oracle")] == [20 / 128] * 3
    assert build(MODEL, "snapkv", 512, 0.1, "cpu", rank_share_of(args, "snapkv"), 600).engine.cache.shadow \
        .config.rank == 128


def test_landmark_rebuild_reaches_shadowkvs_engines_when_asked_and_never_the_baselines_or_dense():
    def rebuilds(method: str, **flag) -> bool:
        engine = build(MODEL, method, 512, 0.1, "cpu", 20 / 128, 600, **flag).engine
        engine.close()
        return engine.cache.shadow.config.landmark_rebuild
    for method in ("shadowkv", "shadowkv_timed", "chunk_oracle"):
        assert rebuilds(method, landmark_rebuild=True) and not rebuilds(method), method
    for method in ("quest", "streamingllm", "snapkv"):
        assert not rebuilds(method) and not rebuilds(method, landmark_rebuild=True), method
    assert build(MODEL, "dense", 512, 1.0, "cpu", 0.5, 600, landmark_rebuild=True).engine.config.shadowkv is None


def test_timed_methods_and_baselines_run_the_engines_default_decode_path_and_the_rest_the_reference():
    for method, kernels in (("dense", False), ("dense_timed", "auto"), ("shadowkv", False), ("shadowkv_timed", "auto"),
                            ("quest", "auto"), ("snapkv", "auto"), ("streamingllm", "auto"), ("chunk_oracle", False)):
        llm = build(MODEL, method, 512, 0.1, "cpu", 20 / 128, 600)
        assert llm.engine.config.use_kernels == kernels, method
        assert (llm.engine.config.shadowkv is None) == method.startswith("dense"), method
        llm.engine.close()
        del llm
        gc.collect()  # its pools: eight engines' would not fit a CI machine


def test_longgen_asks_the_needle_after_the_fed_text():
    sample = make_sample("niah_multikey", 2048, seed=3, templates=VARIED)
    text = "lorem ipsum dolor sit amet " * 200
    prompt, fed = longgen_parts(sample, text, tokens=300)
    question = list(sample.question.encode("ascii"))
    assert prompt + question == sample.prompt_ids
    assert len(fed) == 300 + len(question) and fed[300:] == question
    assert bytes(fed[:300]).decode("ascii") in text
    assert longgen_parts(sample, text, tokens=300) == (prompt, fed)  # seeded


def test_each_turn_resends_the_conversation_with_the_methods_own_answers(monkeypatch):
    samples = [make_sample(MULTITURN, 2048, seed, turn=0, templates=VARIED) for seed in range(2)]
    seen = []

    def answers(llm, prompts, tag, close):  # the model: right on sample 0, wrong on sample 1
        seen.append([list(p) for p in prompts])
        turn = len(seen) - 1
        right = samples[0].answer if turn == 0 else samples[0].turns[turn - 1].answer
        return [right, "0000000"], []

    stats = dict.fromkeys(runs.PREFIX_STATS.values(), 0)
    engine = SimpleNamespace(cache=SimpleNamespace(stats=lambda: stats), close=lambda: None)
    monkeypatch.setattr(runs, "generate", answers)
    scores, _, _ = runs.conversation(lambda longest: SimpleNamespace(engine=engine), samples)
    assert len(seen) == 5 and scores == [[100.0] * 5, [0.0] * 5]
    assert seen[0] == [s.prompt_ids for s in samples]
    for turn in range(1, 5):
        for i, sample in enumerate(samples):
            said = (samples[0].answer if turn == 1 else samples[0].turns[turn - 2].answer) if i == 0 else "0000000"
            assert seen[turn][i] == seen[turn - 1][i] + list(said.encode()) + \
                list(sample.turns[turn - 1].question.encode())


@pytest.mark.parametrize("method", ["dense", "shadowkv"])
def test_a_conversation_on_one_engine_answers_as_cold_turns_do_from_the_prefix_cache(monkeypatch, method):
    """The shipped model, dense and ShadowKV at full rank and a budget of every chunk: each turn's answers on one
    engine, from its prefix cache, equal those of a new engine per turn; a cold turn hits nothing, the cached
    engine's first turn nothing and every later turn its cache (dense: every full block of the turn before, prompt
    and answer)."""
    samples = [make_sample(MULTITURN, 1024, seed, turn=0, templates=RULER) for seed in range(2)]
    whole = conversation_len(samples) + MAX_TOKENS
    calls = []

    def recorded(llm, prompts, **kwargs):
        calls.append(([list(p) for p in prompts], generate(llm, prompts, **kwargs)[0]))
        return calls[-1][1], []

    monkeypatch.setattr(runs, "generate", recorded)
    done = {}
    for cached in (False, True):
        done[cached] = runs.conversation(
            lambda longest: build(MODEL, method, whole, 1.0, "cpu", 1.0, longest + MAX_TOKENS,
                                  conversations=len(samples) if cached else 0), samples, cached)
    cold, warm = calls[:5], calls[5:]
    assert [texts for _, texts in warm] == [texts for _, texts in cold] and done[True][0] == done[False][0]
    assert all(text for _, texts in cold for text in texts) and sum(map(sum, done[True][0])) > 0
    cold_prefix, warm_prefix = done[False][2], done[True][2]
    assert cold_prefix["hit_tokens"] == [0] * 5 and warm_prefix["hit_tokens"][0] == 0
    assert all(hits > 0 for hits in warm_prefix["hit_tokens"][1:])
    assert warm_prefix["query_tokens"] == cold_prefix["query_tokens"] == [sum(map(len, p)) for p, _ in cold]
    assert warm_prefix["evictions"] == [0] * 5
    if method == "dense":  # blocks of 16 tokens: the turn before's prompt and answer, less a partial block
        before = [sum((len(p) + len(t)) // 16 * 16 for p, t in zip(prompts, texts)) for prompts, texts in warm[:-1]]
        assert warm_prefix["hit_tokens"][1:] == before


def test_rows_name_calibrated_ranks_only_where_the_keys_are_low_rank_and_name_landmark_rebuild(monkeypatch):
    import benchmarks.accuracy as accuracy
    monkeypatch.setattr(accuracy, "run_group", lambda *a: ([100.0], [], {}))
    args = Namespace(budgets=[0.0156], methods=["dense", "shadowkv", "quest", "snapkv"], max_minutes=1,
                     calibrate_ranks="text.txt", landmark_rebuild=True, rescore=4, rank_share=20 / 128,
                     baseline_rank_share=1.0, templates="heldout", niah_depths=[], shard=None)
    rows = score_rows(args, {("niah_single", 1024): [None]}, lambda rows: None, lambda msg: None)
    labels = {r["method"]: (r.get("layer_ranks"), r.get("landmark_rebuild"), r.get("rescore")) for r in rows}
    assert labels == {"dense": (None, None, None), "shadowkv": ("calibrated", True, 4), "quest": (None, None, None),
                      "snapkv": (None, None, None)}
    assert not any("shard" in r for r in rows)
    args.baseline_rank_share = 20 / 128  # the baselines on ShadowKV's low-rank keys: calibrated as well
    args.shard = (1, 3)
    rows = score_rows(args, {("niah_single", 1024): [None]}, lambda rows: None, lambda msg: None)
    assert {r["method"]: r.get("layer_ranks") for r in rows}["quest"] == "calibrated"
    assert all(r["shard"] == [1, 3] for r in rows)


def test_cached_methods_run_the_multiturn_task_alone(capsys):
    args = Namespace(budgets=[0.0156], methods=["dense_prefix", "shadowkv_prefix"], max_minutes=1)
    groups = {("niah_single", 1024): [make_sample("niah_single", 1024, 0, templates=RULER)]}
    assert score_rows(args, groups, lambda rows: None, print) == []
    assert capsys.readouterr().out.splitlines() == [
        f"dense_prefix 1.0: runs {MULTITURN} only, skips 1 other cells",
        f"shadowkv_prefix 0.0156: runs {MULTITURN} only, skips 1 other cells"]


def test_the_timed_method_is_the_throughput_headlines_configuration():
    """fp8 values and landmarks and the device tier, as benchmarks/throughput.py's shadowkv_fp8lm_tiered_pipelined."""
    from benchmarks.accuracy_runs import TIMED_DEVICE_VALUE_SHARE, method_config
    timed = method_config(MODEL, "shadowkv_timed", 4096, 0.0156, 20 / 128)
    assert (timed.value_format, timed.landmark_format) == ("fp8", "fp8")
    assert timed.device_value_share == TIMED_DEVICE_VALUE_SHARE
    plain = method_config(MODEL, "shadowkv", 4096, 0.0156, 20 / 128)
    assert (plain.value_format, plain.landmark_format) == ("model", "model")
