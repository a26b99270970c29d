"""A replica's warm-up: before it takes traffic, the engine runs once through the paths its first requests would
otherwise pay for when they arrive (Triton compiles, cuDNN plans, CUDA graph captures), on synthetic tokens:

1. a prompt prefilled whole on the idle engine, then decoded;
2. a second prompt, prefilled in slices beside that decode (sliced attention, the step budget's pacing);
3. the first prompt again with more tokens after it: with prefix caching on it adopts the first one's cached prefix
   and prefills only the rest, beside the other two (suffix prefill, the prefix's keys rebuilt, values fetched).

Before them, the decode kernels whose compiled variant depends on a bucket of the context are launched once per bucket
up to max_model_len (LLMEngine.compile_buckets): a batch that a longer sequence joins later does not stall on a
compile. The prefix cache is cleared after and the engine's counters reset, so the replica starts with every pool as a
fresh one has it and reports none of these requests. It works through the engine's API alone, so a tensor-parallel
engine replays it on every rank."""
from __future__ import annotations

import time
from dataclasses import dataclass

from .sampling import SamplingParams
from .sequence import RequestOutput

DECODE_TOKENS = 32  # tokens the first prompt decodes: the steps the second prompt's slices run beside
SUFFIX_TOKENS = 64  # what the third prompt adds after the first


@dataclass
class WarmUp:
    seconds: float
    buckets: int  # context buckets the decode kernels were compiled for
    steps: int
    second_prompt_steps: int  # from the second prompt's arrival to its first token: more than one when sliced
    cached_tokens: int  # the third prompt's tokens read from the first's cached prefix


def warm_up_prompt(max_model_len: int, vocab_size: int, first: int = 0) -> list[int]:
    """A quarter of the context (at most 8K tokens), long enough to be kept in shadows; `first` picks another
    sequence of tokens (no block shared with the others)."""
    return [(first + i) % vocab_size for i in range(min(max_model_len // 4, 8192))]


def warm_up(engine) -> WarmUp:
    """Run the three requests above to their end on `engine` (an LLMEngine or a TensorParallelEngine with nothing
    running), then clear its prefix cache and reset its counters. Raises if one of them fails: a replica that cannot
    serve them should not take traffic."""
    start, steps = time.perf_counter(), 0
    buckets = engine.compile_buckets()
    vocab = engine.spec.vocab_size
    first = warm_up_prompt(engine.max_model_len, vocab)
    prompts = {"warm-up-1": warm_up_prompt(engine.max_model_len, vocab, first=1),
               "warm-up-2": first + [i % vocab for i in range(SUFFIX_TOKENS)]}
    first_token: dict[str, int] = {}  # the step that reported a request's first token
    last: dict[str, RequestOutput] = {}

    def step() -> None:
        nonlocal steps
        steps += 1
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"warm-up request {out.request_id} failed: {out.error}")
            first_token.setdefault(out.request_id, steps)
            last[out.request_id] = out

    engine.add_request("warm-up-0", first, SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True))
    while "warm-up-0" not in first_token:
        step()
    arrived = steps
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        step()
    engine.clear_prefix_cache()
    engine.reset_counters()
    return WarmUp(time.perf_counter() - start, buckets, steps, first_token["warm-up-1"] - arrived,
                  last["warm-up-2"].num_cached_tokens)
