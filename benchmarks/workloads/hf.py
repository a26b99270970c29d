"""Hugging Face transformers serving a workload offline: `generate` on every request in the order they arrive (every
first turn sent at t=0, a later turn when the answer before it is complete), one request at a time; a request's time
to first token includes its wait in the queue, as it does in the engines' runs.

One at a time because a padded batch of 32K-122K prompts does not run: transformers materialises the attention mask
of a padded batch, (query x key) per row. Two settings, each a method:

- `hf_static`: the static cache, allocated once and sized for the workload's longest request, decode compiled by
  `generate` itself (its automatic compilation of a static cache's decode step; on CUDA), SDPA attention. A static
  cache is longer than the prompt, so every forward carries a mask and SDPA copies K and V per query head.
- `hf_dynamic`: the default dynamic cache: no mask at batch 1, so SDPA runs its causal kernel with grouped-query
  attention; decode is not compiled (transformers compiles only static caches).

Times are taken when `generate` hands each token to its streamer. A run given a time limit stops generating once past
it; what is open then is recorded as unfinished, as in the engines' offline runs.
"""
from __future__ import annotations

import collections
import time

import torch

from benchmarks import hf_baseline

from .metrics import RequestRecord
from .offline import UNFINISHED, request_id
from .scenarios import Conversation

METHODS = ("hf_static", "hf_dynamic")


class _Clock:
    """A `generate` streamer and stopping criterion: it timestamps every token handed to it (the first call brings
    the prompt) and asks `generate` to stop once the run is past its time limit."""

    def __init__(self, record: RequestRecord, start: float, deadline: float | None):
        self.record, self.start, self.deadline, self.prompt_seen = record, start, deadline, False

    def put(self, tokens: torch.Tensor) -> None:
        if self.prompt_seen:
            self.record.events.append((time.perf_counter() - self.start, tokens.numel()))
        self.prompt_seen = True

    def end(self) -> None:
        pass

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.past_deadline(), dtype=torch.bool, device=input_ids.device)


class HFRun:
    """One workload through one transformers model; `run()` -> (request records, wall seconds)."""

    def __init__(self, model, method: str, workload: list[Conversation], progress=None,
                 time_limit_s: float | None = None):
        if method not in METHODS:
            raise ValueError(f"unknown Hugging Face method {method!r}; one of {METHODS}")
        self.model, self.method, self.workload = model, method, workload
        self.progress, self.time_limit_s = progress, time_limit_s
        self.device = next(model.parameters()).device
        model.generation_config.eos_token_id = None  # every request gets the tokens it asked for
        self.cache = None
        if method == "hf_static":
            from transformers import StaticCache

            self.cache = StaticCache(config=model.config, max_cache_len=longest_request(workload))

    @torch.inference_mode()
    def warm_up(self, prompt: list[int]) -> None:
        """A short request before the run, as the engines get: it compiles the static cache's decode."""
        self._generate(prompt, 4, _Clock(RequestRecord("warm-up", -1, 0, 0.0, len(prompt)), 0.0, None))

    @torch.inference_mode()
    def run(self) -> tuple[list[RequestRecord], float]:
        start = time.perf_counter()
        deadline = None if self.time_limit_s is None else start + self.time_limit_s
        queue = collections.deque((c, 0, 0.0) for c in self.workload)  # (conversation, turn, when it was sent)
        answers: dict[int, list[list[int]]] = {c.id: [] for c in self.workload}
        records: list[RequestRecord] = []
        while queue:
            conversation, turn, sent = queue.popleft()
            prompt = conversation.prompt(turn, answers[conversation.id])
            record = RequestRecord(request_id(conversation, turn), conversation.id, turn, sent, len(prompt))
            records.append(record)
            clock = _Clock(record, start, deadline)
            if clock.past_deadline():
                record.error = UNFINISHED
                continue
            answer = self._generate(prompt, conversation.turns[turn].max_tokens, clock)
            if len(answer) < conversation.turns[turn].max_tokens:
                record.error = UNFINISHED
                continue
            record.finish_reason = "length"
            answers[conversation.id].append(answer)
            if self.progress is not None:
                self.progress.update(1)
            if turn + 1 < len(conversation.turns):
                queue.append((conversation, turn + 1, time.perf_counter() - start))
        return records, time.perf_counter() - start

    def _generate(self, prompt: list[int], max_tokens: int, clock: _Clock) -> list[int]:
        from transformers import StoppingCriteriaList

        ids = torch.tensor([prompt], device=self.device)
        if self.cache is not None:
            self.cache.reset()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  do_sample=False, past_key_values=self.cache, streamer=clock,
                                  stopping_criteria=StoppingCriteriaList([clock]), pad_token_id=0)
        return out[0, len(prompt):].tolist()


def longest_request(workload: list[Conversation]) -> int:
    """The most tokens a request of the workload holds, prompt and answer (every earlier answer at its full length)."""
    longest = 0
    for c in workload:
        history = len(c.document)
        for turn in c.turns:
            history += len(turn.question)
            longest = max(longest, history + turn.max_tokens)
            history += turn.max_tokens
    return longest


def load(model_dir: str, dummy: bool):
    """The model of `model_dir` (random weights when `dummy`) with SDPA attention, on the GPU in bf16 if there is one,
    else on the CPU in fp32."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if dummy:
        return hf_baseline.load(model_dir, dtype, device)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa", device_map=device)
    return model.eval().requires_grad_(False)
