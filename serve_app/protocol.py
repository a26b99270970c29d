"""OpenAI API request and response schemas (pydantic), the subset this service implements.

Fields this service does not implement are refused where ignoring them would change the answer (`n` other than 1,
`logprobs`, `tools`, ...); other unknown fields (`user`, `metadata`, ...) are accepted and ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from shadowkv_core.engine.text import is_unicode_text

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256
# Fields that change the answer, with the values that leave it unchanged (all that is accepted for them).
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "best_of": (None, 1), "suffix": (None, ""),
               "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "response_format": (None,),
               "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0)}


def _unicode_text(text: str) -> str:
    """JSON may escape lone surrogates (\\ud800): such a string has no UTF-8 form, and no tokenizer takes it."""
    if not is_unicode_text(text):
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)")
    return text


Text = Annotated[str, AfterValidator(_unicode_text)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk also carries the usage so far
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields common to both endpoints; the range checks mirror OpenAI's."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = Field(default=None, validate_default=True)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, neutral in UNSUPPORTED.items():
                if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in neutral):
                    raise ValueError(f"{name} is not supported by this service")
        return data

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop strings must be 1 to {MAX_STOP_LENGTH} characters")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (as vLLM: continuous_usage_stats with
        include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: Text | list[int] = Field(min_length=1)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "shadowkv-serve"
    root: str  # where the weights come from: the checkpoint's path or hub id
    random_weights: bool = False  # load_format "dummy": drawn at random, the answers are noise
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
