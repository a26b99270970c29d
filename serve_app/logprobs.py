"""The engine's token logprobs (`TokenLogprob`) in OpenAI's response shapes: completions' legacy `logprobs` (tokens,
token_logprobs, top_logprobs, text_offset), chat's `logprobs.content`, and vLLM's `prompt_logprobs`."""
from __future__ import annotations

from serve_app.protocol import (ChatCompletionRequest, ChatLogprobs, ChatTokenLogprob, CompletionLogprobs,
                                PromptLogprob, PromptLogprobs, TopLogprob)
from shadowkv_core.engine.sequence import TokenLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf: what vLLM sends for it


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class LogprobFormatter:
    """One request's logprobs, formatted as its endpoint returns them. `top`: how many top ids a token shows (None:
    the request asks for no logprobs); `prompt_top`: the same for prompt_logprobs. A completion's text_offset counts
    on from each choice's tokens so far, so that a stream's chunks continue one another."""

    def __init__(self, tokenizer, request):
        self.tokenizer = tokenizer
        self.chat = isinstance(request, ChatCompletionRequest)
        if self.chat:
            self.top = (request.top_logprobs or 0) if request.logprobs else None
        else:
            self.top = request.logprobs
        self.prompt_top = request.prompt_logprobs
        self._offsets: dict[int, int] = {}
        self._texts: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """A token's own text (vLLM's "token_id:N" for a model without a tokenizer)."""
        text = self._texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text

    def of_event(self, event: dict) -> CompletionLogprobs | ChatLogprobs | None:
        """The logprobs of an event's new tokens (None when the request asks for none)."""
        if self.top is None or "logprobs" not in event:
            return None
        if self.chat:
            return self.chat_logprobs(event["token_ids"], event["logprobs"])
        return self.completion_logprobs(event["token_ids"], event["logprobs"], event.get("index", 0))

    def completion_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob | None],
                            index: int = 0) -> CompletionLogprobs:
        """Each token's text, offset, logprob and {text: logprob} of its top ids and itself; a token without logprobs
        (an echoed prompt's first) has null ones."""
        out, offset = CompletionLogprobs(), self._offsets.get(index, 0)
        for token_id, lp in zip(token_ids, logprobs):
            text = self.token(token_id)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(lp.logprob))
            top = {}
            for t, v in (*lp.top[:self.top], (token_id, lp.logprob)):  # ids of one text: the most likely's logprob
                top.setdefault(self.token(t), _finite(v))
            out.top_logprobs.append(top)
        self._offsets[index] = offset
        return out

    def chat_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            ChatTokenLogprob(**self._top_logprob(token_id, lp.logprob).model_dump(),
                             top_logprobs=[self._top_logprob(t, v) for t, v in lp.top[:self.top]])
            for token_id, lp in zip(token_ids, logprobs)])

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token(token_id)
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode("utf-8")))

    def prompt_logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob | None] | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {id: Logprob} of the token and its top ids."""
        if self.prompt_top is None or logprobs is None:
            return None
        out: PromptLogprobs = []
        for token_id, lp in zip(token_ids, logprobs):
            if lp is None:
                out.append(None)
                continue
            entries = {t: PromptLogprob(logprob=_finite(v), rank=rank, decoded_token=self.token(t))
                       for rank, (t, v) in enumerate(lp.top[:self.prompt_top], start=1)}
            entries.setdefault(token_id, PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank,
                                                       decoded_token=self.token(token_id)))
            out.append(entries)
        return out
