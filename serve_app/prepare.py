"""From an OpenAI request to what the engine takes: prompt token ids, max_tokens, `SamplingParams`; every check
that can fail here fails as a 400 in OpenAI's shape, before any capacity is reserved."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from serve_app.admission import affinity_keys
from serve_app.errors import context_length_exceeded, invalid_field
from serve_app.protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from serve_app.structured import guided_decoding
from serve_app.tools import declares_tools, family_of, forced_call
from shadowkv_core import SamplingParams
from shadowkv_core.engine.structured import GuidedDecoding

_FIELD_PREFIX = re.compile(r"^(\w+)")


@dataclass(frozen=True)
class Prepared:
    prompt_token_ids: list[int]
    params: SamplingParams
    echo: str = ""  # text sent before the answer: the prompt, for a completion with echo
    echo_logprobs: bool = False  # with echo and logprobs, the prompt's tokens and logprobs come before the answer's
    tool_family: str | None = None  # the output is parsed into tool calls in this format (serve_app/tools.py)
    affinity: tuple[bytes, ...] = ()  # the prompt's prefix-affinity keys (serve_app/admission.py), for placement

    def echoed(self, first: dict) -> dict:
        """The choice's first event with its echo before it: the prompt's text and, with echo_logprobs, its tokens
        and their logprobs (the engine's prompt logprobs, the first token's None)."""
        event = {**first, "text": self.echo + first["text"]}
        if self.echo_logprobs and "logprobs" in first:
            event["token_ids"] = self.prompt_token_ids + first["token_ids"]
            event["logprobs"] = first["prompt_logprobs"] + first["logprobs"]
        return event


def prompt_token_ids(tokenizer, request: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
    """Each prompt's token ids: tokenized the way the engine does (`tokenizer(prompt)`), or the chat template
    rendered first."""
    if isinstance(request, ChatCompletionRequest):
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise invalid_field("messages", "this model ships no chat template; use /v1/completions")
        messages = [m.for_template() for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if uses_tools(tokenizer, request) else None
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return [tokenizer(text, add_special_tokens=False)["input_ids"]]
    if any(isinstance(p, str) for p in request.prompt) and tokenizer is None:
        raise invalid_field("prompt", "this model ships no tokenizer; send the prompt as token ids")
    # token ids: the engine checks them against its vocabulary
    return [list(p) if isinstance(p, list) else tokenizer(p)["input_ids"] for p in request.prompt]


def uses_tools(tokenizer, request) -> bool:
    """Whether a chat request's tools go into its prompt; 400 when it has tools its model's template does not
    declare (a tool_choice of "none" leaves them out instead)."""
    if not isinstance(request, ChatCompletionRequest) or not request.tools:
        return False
    if declares_tools(getattr(tokenizer, "chat_template", None)):
        return True
    if request.tool_choice == "none":
        return False
    raise invalid_field("tools", "tools: this model's chat template does not declare tools")


def tool_family(tokenizer, request) -> str | None:
    """The tool-call format a chat request's output is parsed in; None: not parsed (no tools, tool_choice none)."""
    if not uses_tools(tokenizer, request) or request.tool_choice == "none":
        return None
    family = family_of(tokenizer.chat_template)
    if family is None:
        raise invalid_field("tools", "tools: this model's chat template writes tool calls in a format this service "
                                     "does not parse (it parses Hermes <tool_call> and Llama-3.1 JSON)")
    return family


def constraint(request, family: str | None) -> GuidedDecoding | None:
    """The grammar the output must match: the structured output asked for, or the call tool_choice forces."""
    guided = guided_decoding(request)
    if family is None:
        return guided
    choice = request.tool_choice if isinstance(request.tool_choice, str | None) else request.tool_choice.model_dump()
    forced = forced_call(family, [t.model_dump() for t in request.tools], choice)
    if forced is not None and guided is not None:
        raise invalid_field(guided.source, f"{guided.source}: cannot be combined with a tool_choice that forces "
                                           "a call")
    return forced or guided


def max_tokens_of(request: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int,
                  default_max_tokens: int) -> int:
    """The request's max_tokens (or the default, capped by the room left), checked against the context length."""
    asked = request.requested_max_tokens if isinstance(request, ChatCompletionRequest) else request.max_tokens
    max_tokens = asked if asked is not None else max(1, min(default_max_tokens, max_model_len - prompt_len))
    if prompt_len + max_tokens > max_model_len:
        raise context_length_exceeded(prompt_len, max_tokens, max_model_len)
    return max_tokens


def logprobs_of(request: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, int | None]:
    """The engine's (logprobs, prompt_logprobs): what the response shows, at least the sampled tokens' logprobs for
    best_of to rank its candidates, and the prompt's for echo with logprobs."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None, request.prompt_logprobs
    logprobs = request.logprobs if request.logprobs is not None or request.candidates == request.n else 0
    prompt = request.prompt_logprobs
    if request.echo and request.logprobs is not None:
        prompt = max(prompt or 0, request.logprobs)
    return logprobs, prompt


def sampling_params(request: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    guided: GuidedDecoding | None = None) -> SamplingParams:
    logprobs, prompt_logprobs = logprobs_of(request)
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
                              top_k=request.top_k, min_p=request.min_p, seed=request.seed, stop=list(request.stop),
                              stop_token_ids=list(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
                              min_tokens=request.min_tokens, presence_penalty=request.presence_penalty,
                              frequency_penalty=request.frequency_penalty,
                              repetition_penalty=request.repetition_penalty, logit_bias=dict(request.logit_bias or {}),
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, guided=guided)
    except ValueError as exc:
        named = _FIELD_PREFIX.match(str(exc))
        raise invalid_field(named.group(1) if named else "request", str(exc)) from exc


def prepare(tokenizer, request, max_model_len: int, default_max_tokens: int, block_size: int) -> list[Prepared]:
    """One Prepared per choice, n (best_of: best_of candidates) per prompt in the prompts' order (OpenAI's choice
    indices); a prompt's choices share its affinity keys, on the engine's `block_size`. Blocking (tokenization and
    hashing of a long prompt): the ingress runs it in a worker thread."""
    num_prompts = len(request.prompt) if isinstance(request, CompletionRequest) else 1
    per_prompt, name = request.candidates, "n" if request.candidates == request.n else "best_of"
    if num_prompts * per_prompt > MAX_CHOICES:
        raise invalid_field(name, f"{name}: {num_prompts} prompts × {name}={per_prompt} choices; at most "
                                  f"{MAX_CHOICES} in all")
    echo_logprobs = bool(getattr(request, "echo", False)) and getattr(request, "logprobs", None) is not None
    prepared = []
    family = tool_family(tokenizer, request)
    guided = constraint(request, family)
    for token_ids, echo in zip(prompt_token_ids(tokenizer, request), echo_texts(tokenizer, request)):
        if not token_ids:
            raise invalid_field("prompt", "the prompt must not be empty")
        params = sampling_params(request, max_tokens_of(request, len(token_ids), max_model_len, default_max_tokens),
                                 guided)
        seeds = [None if params.seed is None else params.seed + j for j in range(per_prompt)]  # distinct draws
        keys = affinity_keys(token_ids, block_size)
        prepared += [Prepared(token_ids, replace(params, seed=seed), echo, echo_logprobs, family, keys)
                     for seed in seeds]
    return prepared


def echo_texts(tokenizer, request: CompletionRequest | ChatCompletionRequest) -> list[str]:
    """Each prompt's text to send before its answer: the prompt itself with echo (token ids decoded), else ""."""
    if not getattr(request, "echo", False):
        return [""] * (len(request.prompt) if isinstance(request, CompletionRequest) else 1)
    if tokenizer is None and any(isinstance(p, list) for p in request.prompt):
        raise invalid_field("echo", "echo: this model ships no tokenizer to turn token ids back into text")
    return [p if isinstance(p, str) else tokenizer.decode(p) for p in request.prompt]
