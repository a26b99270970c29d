"""SamplingParams: what the caller asks of one request's generation, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .structured import GuidedDecoding

MAX_LOGPROBS = 20  # top logprobs a token may ask for, as vLLM's default max_logprobs

def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def is_int(value) -> bool:
    """An int, not a bool (JSON's true is no token id, no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: tokens to generate at most. temperature 0 is greedy. top_k 0 (or -1), top_p 1 and min_p 0 disable
    those filters; min_p drops ids less likely than min_p times the most likely one. seed makes a sampled request
    reproducible. stop: strings that end the output (not included in it); stop_token_ids: extra token ids that end it.
    ignore_eos: keep going past the model's end-of-sequence token. min_tokens: the end-of-sequence and stop token ids
    are masked until that many tokens are out. Penalties, as vLLM applies them: presence_penalty and
    frequency_penalty subtract from the logits of ids in the output (once, and per occurrence); repetition_penalty
    divides positive (multiplies negative) logits of ids in the prompt or the output. logit_bias: {token id: bias}
    added to the logits. logprobs: report each output token's logprob and the top `logprobs` ids' (0: the token's
    only; None: nothing), those of the model's raw distribution, before any of the adjustments above; prompt_logprobs:
    the same for each prompt token after the first, computed during the prefill. guided: structured output, a grammar
    the output must match (structured.py)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] | list[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided: GuidedDecoding | None = None

    def __post_init__(self):
        _check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
               and math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(is_int(self.top_k) and self.top_k >= -1, "top_k", f"must be an integer >= -1, got {self.top_k!r}")
        _check(self.seed is None or is_int(self.seed), "seed", f"must be an integer or None, got {self.seed!r}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check(_is_number(getattr(self, name)), name, f"must be a finite number, got {getattr(self, name)!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               f"must be a number > 0, got {self.repetition_penalty!r}")
        _check(all(is_int(t) and t >= 0 and _is_number(b) for t, b in dict(self.logit_bias).items()), "logit_bias",
               "must map token ids (integers >= 0) to finite numbers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                   f"must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        _check(self.guided is None or isinstance(self.guided, GuidedDecoding), "guided",
               f"must be a GuidedDecoding, got {self.guided!r}")
        # a grammar may allow nothing but the end before min_tokens are out, and masking the end would leave no token
        _check(self.guided is None or self.min_tokens == 0, "min_tokens",
               "cannot be combined with structured output: the grammar decides where the output ends")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _check(all(isinstance(s, str) and s for s in stop), "stop", "must be non-empty strings")
        stop_ids = tuple(self.stop_token_ids)
        _check(all(is_int(t) and t >= 0 for t in stop_ids), "stop_token_ids", "must be integers >= 0")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)
