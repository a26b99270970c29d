"""How benchmarks/accuracy.py runs its methods through our engine (`LLM`): one engine per method and batch of
prompts, greedy; and the drivers of its two tasks that go beyond one prompt and one answer.

- niah_longgen: a needle among four (niah_multikey's prompt, its question cut off), then LONGGEN_TOKENS tokens of
  the haystack's text fed through decode steps one at a time, then the question, then the answer, greedy. The fed
  tokens are teacher-forced (each step's sampled token is replaced by the text's next one, as benchmarks/fidelity.py
  feeds text), so every method decodes the same tokens and a wrong guess never compounds; they pass through the
  decode path, so the window folds every decode_window / 2 tokens and the question is asked after every fold.
- niah_multiturn: MULTITURN_TURNS needles, one asked per turn; each turn re-sends the whole conversation (the
  prompt, then each earlier question and the method's own answer) as a new request. A method builds a new engine per
  turn, so every turn is prefilled anew (a cold re-prefill); a cached method (CACHED) builds its uncached method's
  engine once for every turn, so that each turn after the first starts with the turn before it (prompt and answer) in
  the engine's prefix cache and prefills only the rest. Its cache holds every sample's longest conversation twice over
  (live, and cached beside it), so that no turn evicts a prefix another sample is yet to adopt. Each turn's
  prefix-cache hit and query tokens and evictions are recorded (a new engine hits nothing). A single-prompt task would
  run a cached method as its uncached one: it runs niah_multiturn only.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from pathlib import Path

import torch

from shadowkv_core import LLM, SamplingParams, ShadowKVConfig
from shadowkv_core.memory_model import GIB, load_geometry, seq_bytes
from shadowkv_core.models.loader import read_config
from shadowkv_core.shadowkv.baselines import ChunkOracleScorer, SnapKVScorer, StreamingScorer
from shadowkv_core.shadowkv.quest import QuestScorer
from shadowkv_core.shadowkv.ranks import allocate_ranks, checkpoint_key_spectra
from training.data import EOS, Sample, score
from training.objectives import CHUNK, LOCAL_CHUNKS, RANK_SHARE

# The paper keeps 48 outlier chunks at 128K (0.3 %); scaled down to 2K-16K that is 1-6 chunks, too few for the
# attention sinks and the heads whose keys stray from their landmarks (docs/accuracy.md). ShadowKV and Quest keep
# these 8 chunks and the budget counts the rest; the eviction baselines have none and 8 more chunks of budget.
OUTLIER_CHUNKS = 8
MAX_TOKENS = 80  # the longest answer (67 tokens) and its EOS, with room
LONGGEN_TOKENS = 2048
TIMED_DEVICE_VALUE_SHARE = 0.375  # the timed configuration's device tier (docs/benchmarks.md's headline)
CALIBRATION_TOKENS = 8192  # the text's first bytes over which calibrated layer ranks are chosen (shadowkv.ranks)

DENSE = ("dense", "dense_fp8", "dense_prefix", "dense_timed")  # full attention: no budget
SCORERS = {"quest": QuestScorer, "streamingllm": StreamingScorer, "snapkv": SnapKVScorer,
           "chunk_oracle": ChunkOracleScorer}
EVICTION = ("streamingllm", "snapkv")
BASELINES = ("quest", *EVICTION)  # published methods: they read their chunks' keys as they are, never corrected
# a conversation's turns on one engine, served from its prefix cache: the method each runs as
CACHED = {"shadowkv_prefix": "shadowkv", "dense_prefix": "dense"}
# ShadowKV methods with the paper's mean landmarks (ShadowKVConfig.landmark_kind, bounds by default): the method each
# is otherwise
MEAN = {"shadowkv_mean": "shadowkv", "shadowkv_timed_mean": "shadowkv_timed"}
# on the engine's default decode path, not the reference's
TIMED = ("shadowkv_timed", "shadowkv_timed_mean", "dense_timed")
# fp8 values; fp8 landmarks as well; the timed configuration (kernels, CUDA graphs, async and pipelined decode where
# the device has them, fp8 values and landmarks, the device tier: the decode throughput headline's)
METHODS = (*DENSE, "shadowkv", "shadowkv_prefix", "quest", "streamingllm", "snapkv", "shadowkv_fp8", "shadowkv_fp8lm",
           "shadowkv_timed", *MEAN, "chunk_oracle")
DIAGNOSTIC = ("chunk_oracle",)  # run only when named: a ceiling, not a method
# what conversation() records of the engine's prefix cache each turn: its field -> the cache's stat
PREFIX_STATS = {"hit_tokens": "prefix_hit_tokens", "query_tokens": "prefix_query_tokens",
                "evictions": "prefix_evictions"}
CACHE_GIB = 2  # device and host cache of every engine; a cached method's adds room for its conversations


def shadowkv_config(model: str, context: int, budget: float, rank_share: float = RANK_SHARE,
                    value_format: str = "model", landmark_format: str = "model") -> ShadowKVConfig:
    """The method's cache config for one context length; budget is a fraction of the context, rank_share one of
    kv_heads*head_dim."""
    cfg = read_config(Path(model))
    width = cfg["num_key_value_heads"] * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return ShadowKVConfig(rank=max(1, round(rank_share * width)), chunk_size=CHUNK,
                          sparse_budget=max(1, round(budget * context / CHUNK)) * CHUNK,
                          outlier_chunks=OUTLIER_CHUNKS, local_chunks=LOCAL_CHUNKS,
                          min_context=0, decode_window=128, value_format=value_format,
                          landmark_format=landmark_format)


def method_config(model: str, method: str, context: int, budget: float, rank_share: float) -> ShadowKVConfig | None:
    if method in DENSE:
        return None
    if method in MEAN:
        return dataclasses.replace(method_config(model, MEAN[method], context, budget, rank_share),
                                   landmark_kind="mean")
    fp8 = method in ("shadowkv_fp8", "shadowkv_fp8lm", "shadowkv_timed")
    config = shadowkv_config(model, context, budget, rank_share, "fp8" if fp8 else "model",
                             "fp8" if method in ("shadowkv_fp8lm", "shadowkv_timed") else "model")
    if method in EVICTION:
        return dataclasses.replace(config, outlier_chunks=0,
                                   sparse_budget=config.sparse_budget + OUTLIER_CHUNKS * CHUNK)
    if method == "shadowkv_timed":
        return dataclasses.replace(config, device_value_share=TIMED_DEVICE_VALUE_SHARE)
    return config


@functools.lru_cache(maxsize=None)
def calibration_spectra(model: str, calibration_file: str, device: str) -> tuple[torch.Tensor, ...]:
    """The model's per-layer key spectra over the first CALIBRATION_TOKENS bytes of a text (the byte-level models
    this harness runs), once per model."""
    text = Path(calibration_file).read_bytes()[:CALIBRATION_TOKENS]
    return tuple(checkpoint_key_spectra(model, list(text), device))


def build(model: str, method: str, context: int, budget: float, device: str, rank_share: float,
          max_model_len: int, forced: bool = False, conversations: int = 0,
          calibration_file: str | None = None, landmark_rebuild: bool = False, rescore: int = 0) -> LLM:
    """The method's engine (a cached method's: its uncached method's). The TIMED methods run what the engine does by
    default on the device; the BASELINES its kernels where it has them (their policies' scores asked per sequence,
    without CUDA graphs); every other method the PyTorch reference decode path. The kernels equal it by test.
    `forced`: each step read back before the next (teacher forcing rewrites the token a step sampled).
    `conversations`: sequences of max_model_len tokens its cache holds twice over beyond CACHE_GIB (live, and their
    prefixes cached beside them). calibration_file: the keys kept at per-layer ranks calibrated on that text
    (ShadowKVConfig.layer_ranks, their mean the method's rank); None: every layer at the method's rank.
    landmark_rebuild: ShadowKV's rebuilt keys moved onto their landmarks (ShadowKVConfig); the BASELINES' never.
    rescore: ShadowKV's landmarks' rescore·k best chunks rescored by their rebuilt keys (ShadowKVConfig); the
    BASELINES' never (their policies choose)."""
    method = CACHED.get(method, method)
    config = method_config(model, method, context, budget, rank_share)
    if config is not None and calibration_file is not None:
        spectra = calibration_spectra(model, calibration_file, device)
        if config.rank < len(spectra[0]):
            config = dataclasses.replace(config, layer_ranks=allocate_ranks(list(spectra), config.rank))
    if config is not None:
        config = dataclasses.replace(config, landmark_rebuild=landmark_rebuild and method not in BASELINES,
                                     rescore=0 if method in BASELINES else rescore)
    speed = {} if method in (*TIMED, *BASELINES) else {"use_kernels": False}
    if forced:
        speed["async_decode"] = False
    gib = CACHE_GIB + _conversations_gib(model, config, conversations, max_model_len)
    llm = LLM(model=model, device=device, shadowkv=config, max_model_len=max_model_len, max_num_seqs=64,
              gpu_cache_gib=gib, host_cache_gib=gib, kv_cache_dtype="fp8" if method == "dense_fp8" else "auto",
              **speed)
    if method in SCORERS:
        llm.engine.cache.shadow.chunk_scorer = SCORERS[method]()
    return llm


def _conversations_gib(model: str, config: ShadowKVConfig | None, conversations: int, tokens: int) -> float:
    """GiB (device and host alike) holding `conversations` sequences of `tokens` tokens twice over, with every value on
    the host: an "auto" device value share is the one under which the pools hold the most, no fewer than with none."""
    if config is not None:
        config = dataclasses.replace(config, device_value_share=0.0)
    need = seq_bytes(load_geometry(model, dtype_bytes=4), config, tokens, 0)  # fp32: the widest dtype a device runs
    return 2 * conversations * max(need.gpu, need.host) / GIB


def generate(llm: LLM, prompts: list[list[int]], forced: list[list[int]] | None = None, tag: str = "",
             close: bool = True) -> tuple[list[str], list[float]]:
    """Greedy completions of `prompts` (each after its `forced` tokens, fed one decode step at a time), and the
    cache's hit rate at each decode step that selected chunks. Request ids are f"{tag}{i}": an engine kept open
    (`close` False) for later calls takes a new tag for each."""
    engine, forced = llm.engine, forced or [[] for _ in prompts]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0) if not f else
              SamplingParams(max_tokens=len(f) + MAX_TOKENS, temperature=0, ignore_eos=True) for f in forced]
    seqs = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}{i}", prompt, p)
        seqs.append(engine.requests[f"{tag}{i}"])
    shadow = getattr(engine.cache, "shadow", None)
    hit_rates = []
    while engine.has_unfinished_requests():
        engine.step()
        for seq, tokens in zip(seqs, forced):
            if seq.output_token_ids and len(seq.output_token_ids) <= len(tokens):  # still feeding: replace
                seq.output_token_ids[-1] = tokens[len(seq.output_token_ids) - 1]
        if shadow is not None and shadow.counts.last.selected:
            hit_rates.append(engine.cache.stats()["hit_rate"])
    scorer = getattr(shadow, "chunk_scorer", None)
    filled = getattr(scorer, "bounds", getattr(scorer, "votes", None))  # what Quest's or SnapKV's prefill fills
    if filled is not None and not filled:
        raise RuntimeError("the selection policy was never called: this cache path ignores chunk_scorer")
    if close:
        engine.close()
    return [_answer(seq.output_token_ids[len(f):]) for seq, f in zip(seqs, forced)], hit_rates


def _answer(tokens: list[int]) -> str:
    """The completion's text, up to its EOS."""
    end = tokens.index(EOS) if EOS in tokens else len(tokens)
    return bytes(t for t in tokens[:end] if t < 256).decode("ascii", "replace")


def longgen_parts(sample: Sample, text: str, tokens: int = LONGGEN_TOKENS) -> tuple[list[int], list[int]]:
    """(prompt, forced) of niah_longgen from a sample: the prompt without its question; then `tokens` tokens of
    `text` (a seeded slice) and the question, to be fed one decode step at a time."""
    question = list(sample.question.encode("ascii"))
    start = random.Random(f"longgen:{sample.seed}").randrange(len(text) - tokens)
    filler = list(text[start:start + tokens].encode("ascii"))
    return sample.prompt_ids[:-len(question)], filler + question


def conversation(llm_for_turn, samples: list[Sample], cached: bool = False) -> tuple[list[list[float]], list[float],
                                                                                    dict[str, list[int]]]:
    """Each sample's score per turn (0 or 100 per item share), the hit rates and the prefix cache's work per turn
    (hit_tokens, query_tokens, evictions): turn t's prompts are the samples' conversations so far, each earlier answer
    the method's own. llm_for_turn(max_prompt_len) builds an engine: one per turn, or, `cached`, one for every turn,
    for the longest prompt the last turn can have (conversation_len), closed after it."""
    prompts = [list(s.prompt_ids) for s in samples]
    asked = [[(s.items, s.question)] + [(t.items, t.question) for t in s.turns] for s in samples]
    scores, hit_rates, prefix = [[] for _ in samples], [], {key: [] for key in PREFIX_STATS}
    shared = llm_for_turn(conversation_len(samples)) if cached else None
    last = dict.fromkeys(PREFIX_STATS.values(), 0)  # the engine's counts before this turn (a new engine's: none)
    for turn in range(len(asked[0])):
        llm = shared if cached else llm_for_turn(max(map(len, prompts)))
        texts, rates = generate(llm, prompts, tag=f"{turn}.", close=False)
        stats = llm.engine.cache.stats()
        for key, stat in PREFIX_STATS.items():
            prefix[key].append(stats[stat] - last[stat])
        if cached:
            last = stats
        else:
            llm.engine.close()
        hit_rates += rates
        for i, text in enumerate(texts):
            scores[i].append(score(dataclasses.replace(samples[i], items=asked[i][turn][0]), text))
            if turn + 1 < len(asked[i]):
                prompts[i] += list(text.encode("ascii", "replace")) + list(asked[i][turn + 1][1].encode("ascii"))
    if cached:
        shared.engine.close()
    return scores, hit_rates, prefix


def conversation_len(samples: list[Sample]) -> int:
    """The longest prompt a conversation's last turn can have: its first prompt, every later question and an answer
    of up to MAX_TOKENS after each turn before it."""
    return max(len(s.prompt_ids) + sum(len(t.question) + MAX_TOKENS for t in s.turns) for s in samples)
