"""OpenAI API request and response schemas (pydantic), the subset this service implements.

Every OpenAI and vLLM request field that would change the answer is either honoured or refused with a 400 naming it
(`UNSUPPORTED`); fields that change nothing (`user`, `metadata`, `store`, ...) are accepted and ignored. docs/api.md
lists them all.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from shadowkv_core.engine.sampling import MAX_LOGPROBS, is_int
from shadowkv_core.engine.text import is_unicode_text

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256
MAX_LOGIT_BIAS = 300  # entries, as OpenAI bounds it
MAX_CHOICES = 16  # prompts of a batch × n: each choice is an engine request of its own
# OpenAI and vLLM fields not implemented yet that change the answer, with the values that leave it unchanged (all
# that is accepted for them); a request schema that defines one of them honours it.
UNSUPPORTED = {
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "top_logprobs": (None, 0), "echo": (None, False),
    "suffix": (None, ""), "guided_decoding_backend": (None, "auto", "guidance"),
    "guided_whitespace_pattern": (None,), "structural_tag": (None,), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"),
    "allowed_token_ids": (None,), "bad_words": (None, []), "logits_processors": (None,), "prediction": (None,),
    "audio": (None,), "modalities": (None, ["text"]), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,), "add_special_tokens": (None,), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "documents": (None,), "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "reasoning_effort": (None,), "web_search_options": (None,), "verbosity": (None,),
    "prompt_embeds": (None,),
}


def _unicode_text(text: str) -> str:
    """JSON may escape lone surrogates (\\ud800): such a string has no UTF-8 form, and no tokenizer takes it."""
    if not is_unicode_text(text):
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)")
    return text


Text = Annotated[str, AfterValidator(_unicode_text)]


def _prompt_list(prompt):
    """A prompt in any of OpenAI's four shapes -> a list of prompts, each text or token ids (a batch: one choice
    each), every one checked here so that a refusal names what is wrong rather than a union member's type."""
    prompts = [prompt] if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)) else prompt
    if not isinstance(prompts, list) or not prompts or not (
            all(isinstance(p, str) for p in prompts) or all(isinstance(p, list) for p in prompts)):
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")
    for p in prompts:
        if not p:
            raise ValueError("a prompt must not be empty")
        if isinstance(p, str):
            _unicode_text(p)
        elif not all(is_int(t) and t >= 0 for t in p):
            raise ValueError("token ids must be integers >= 0")
    return prompts


def _content_text(content):
    """A message's content: a string, or a list of text parts (joined by newlines, as vLLM does)."""
    if not isinstance(content, list):
        return content
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"content part of type {kind!r} is not supported; only text parts "
                             '({"type": "text", "text": ...}) are')
    return "\n".join(part["text"] for part in content)


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of json (a schema), json_object, regex, choice, grammar. Its options that would
    change the answer beyond them (structural_tag, whitespace_pattern) are refused by name."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_fallback: bool = False  # there is no other backend to fall back to
    disable_any_whitespace: bool = False  # JSON comes compact whatever it says
    disable_additional_properties: bool = False
    backend: str | None = None


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
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int = Field(default=0, ge=0)
    stop: Text | list[Text] | None = Field(default=None, validate_default=True)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    # vLLM's extension: each prompt token's logprob and its top ids' (all but the first token)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # structured output (serve_app/structured.py); at most one of them
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's optional fields take null for their default (the SDK sends it for an argument given as None)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, neutral in UNSUPPORTED.items():
                if name in data and name not in cls.model_fields and not any(
                        data[name] == v and type(data[name]) is type(v) for v in neutral):
                    raise ValueError(f"{name}: not supported by this service (yet); leave it out")
        return data

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not available with stream (as vLLM)")
        return self

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


def _no_bool(value):
    """`false` is OpenAI's "no logprobs"; `true` is no count."""
    if value is False:
        return None
    if value is True:
        raise ValueError(f"must be an integer in [0, {MAX_LOGPROBS}]")
    return value


class CompletionRequest(_SamplingFields):
    prompt: list[str | list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # the sampled token's and the top N's
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt):
        return _prompt_list(prompt)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, value):
        return _no_bool(value)

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be at least n ({self.n}), got {self.best_of}")
        if self.stream and self.candidates > self.n:
            raise ValueError("best_of: cannot stream with best_of > n (the best are known only at the end)")
        return self

    @property
    def candidates(self) -> int:
        """Choices generated per prompt: best_of, of which the n with the highest cumulative logprob are returned."""
        return self.best_of or self.n


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A conversation's message. An assistant's may hold tool_calls instead of content; a tool's result names the
    call it answers (tool_call_id)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _joined(cls, content):
        return _content_text(content)

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required, except in an assistant message with tool_calls")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: the calls' arguments as objects (as Hugging Face templates expect)."""
        message = self.model_dump(exclude_none=True)
        for call in message.get("tool_calls", ()):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the text as sent
        return message


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs true")
        return self

    @model_validator(mode="after")
    def _choice_needs_tools(self):
        if isinstance(self.tool_choice, NamedToolChoice) and not self.tool_choice.function.name:
            raise ValueError("tool_choice.function.name: must not be empty")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: names a call but the request has no tools")
        return self

    @property
    def candidates(self) -> int:
        return self.n

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the replica's prefix cache instead of prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # in a request's final usage

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "Usage":
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per token its text, its offset in the choice's text, its logprob and a
    {token: logprob} of the top ones (the sampled token's included)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob, one entry of prompt_logprobs' {token id: ...}."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
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
