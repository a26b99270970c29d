"""Text in and out of the engine, apart from its core: a prompt to token ids, and a sequence's generated ids to the
text it reports, cut at its stop strings. Streamed text is never taken back: a partial UTF-8 character, or an end that
may begin a stop string, waits for the tokens after it."""
from __future__ import annotations

from .sequence import Sequence


class TextProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: the model ships no tokenizer (token ids in, no text out)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model ships no tokenizer; pass token ids")
            if not prompt.isascii() and not is_unicode_text(prompt):
                raise ValueError("prompt: must be valid Unicode text (it holds a lone surrogate)")
            return self.tokenizer(prompt)["input_ids"]
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt: must be text or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def update(self, seq: Sequence, done: bool) -> bool:
        """Set seq.text from its tokens (all of it once `done`); -> whether a stop string ends it there."""
        text = self._decode(seq.output_token_ids, final=done)
        stopped = False
        for stop in seq.params.stop:
            at = text.find(stop)
            if at >= 0:
                text, stopped = text[:at], True
        seq.text = text if done or stopped else text[:len(text) - stop_prefix_len(text, seq.params.stop)]
        return stopped

    def _decode(self, token_ids: list[int], final: bool) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return text if final else text.rstrip("\ufffd")  # a partial UTF-8 character waits for its next bytes


def is_unicode_text(text: str) -> bool:
    """False for a string holding lone surrogates (no UTF-8 encoding exists; tokenizers refuse it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some stop string (0 if none)."""
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
