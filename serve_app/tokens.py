"""/tokenize and /detokenize, in vLLM's shapes: a prompt (or chat messages, rendered as a chat completion would be)
to the token ids the engine would see, and token ids back to text."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.errors import invalid_field
from serve_app.prepare import prompt_token_ids
from serve_app.protocol import ChatCompletionRequest, ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # as a chat completion takes them
    add_special_tokens: bool = True  # prompts only: chat templates place their own

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(tokenizer, request: TokenizeRequest, model: str) -> list[int]:
    """Blocking (a long prompt): the ingress runs it in a worker thread."""
    if request.messages is not None:
        (ids,) = prompt_token_ids(tokenizer, ChatCompletionRequest(model=model, messages=request.messages))
        return ids
    if tokenizer is None:
        raise invalid_field("prompt", "this model ships no tokenizer")
    return tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)["input_ids"]


def detokenize(tokenizer, tokens: list[int]) -> str:
    if tokenizer is None:
        raise invalid_field("tokens", "this model ships no tokenizer")
    unknown = [t for t in tokens if not 0 <= t < len(tokenizer)]
    if unknown:
        raise invalid_field("tokens", f"token ids outside the vocabulary (0..{len(tokenizer) - 1}): {unknown[:8]}")
    return tokenizer.decode(tokens)
