"""Sequence: one request's CPU-side state through the engine, and the RequestOutput the engine reports."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .sampling import SamplingParams
from .structured import Grammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted, cache reserved, its prefill job under way
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob under the model's distribution, its rank in it (1: the most likely id), and the `top`
    most likely ids with their logprobs, most likely first (as many as the request asked for)."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every token generated so far
    new_token_ids: list[int]  # generated in this step
    text: str  # generated text so far, cut at a stop string; holds back a trailing partial UTF-8 character
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asks for logprobs
    cumulative_logprob: float | None = None  # the sum of those logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None), when asked
    num_cached_tokens: int = 0  # prompt tokens read from a cached prefix, not prefilled


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int):
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed  # what its sampled tokens are drawn from (sampler.py), with their index in its output
        self.status = SequenceStatus.WAITING
        self.num_cached_tokens = 0  # prompt tokens its cache held from a cached prefix at admission: not prefilled
        self.finish_reason: str | None = None
        self.text = ""
        self.error: str | None = None
        self.output_logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.grammar: Grammar | None = None  # structured output: the ids its next token may be

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def output(self, num_new: int) -> RequestOutput:
        new = self.output_token_ids[len(self.output_token_ids) - num_new:] if num_new else []
        logprobs = None if self.output_logprobs is None else list(self.output_logprobs)
        return RequestOutput(self.request_id, self.prompt_token_ids, list(self.output_token_ids), new, self.text,
                             self.is_finished, self.finish_reason, self.error, logprobs,
                             None if logprobs is None else self.cumulative_logprob, self.prompt_logprobs,
                             self.num_cached_tokens)
