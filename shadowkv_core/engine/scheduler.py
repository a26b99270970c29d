"""Scheduler: continuous batching over ragged lengths.

Every step, every running sequence decodes one token, and, when no prefill is under way, waiting sequences are
admitted for the next one while the cache can hold them (everything they will ever need is reserved up front, so
admitted work never runs out of memory mid-decode). Prefills are grouped by the tokens they prefill (a prompt less
its cached prefix): the oldest waiting sequence picks the length bucket and only prompts of that bucket join its
prefill batch, up to a budget of prefilled tokens, so long prefills do not ride with short ones and the readers of
one cached document are admitted together. While a prefill is under way, the engine may let short prefills start
beside it (an express batch, chosen the same way among the waiting sequences it calls short): a conversation's next
turn, which prefills only its new tokens after a cached prefix, need not wait behind a cold 100K-token prompt.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..cache.base import CacheManager
from .sequence import Sequence, SequenceStatus


SHORT_PREFILL_TOKENS = 1024  # prefills shorter than this share one bucket: a batch of any mix of them stays short


def length_bucket(num_tokens: int) -> int:
    """Power-of-two bucket of the tokens a prompt prefills (..., 1024-2047, 2048-4095, ...), every prefill shorter
    than SHORT_PREFILL_TOKENS in one: the readers of a cached document, whose questions differ in length, go together."""
    return max(num_tokens, SHORT_PREFILL_TOKENS - 1).bit_length()


@dataclass
class ScheduledStep:
    prefill: list[Sequence]
    decode: list[Sequence]


class Scheduler:
    def __init__(self, manager: CacheManager, max_num_seqs: int, max_prefill_tokens: int, max_waiting: int):
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def can_enqueue(self) -> bool:
        return len(self.waiting) < self.max_waiting

    def add(self, seq: Sequence) -> None:
        if not self.can_enqueue():
            raise RuntimeError(f"the waiting queue is full ({self.max_waiting} requests)")
        self.waiting.append(seq)

    def schedule(self, express: Callable[[int, int], bool] | None = None) -> ScheduledStep:
        """The step's decodes, and the sequences admitted to prefill: when no prefill is under way, or, while one is,
        those `express` calls short (given the tokens it would take from the prefix cache and those it would
        prefill); None: none starts beside the one under way."""
        decode = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING]
        prefilling = len(decode) < len(self.running)
        if not prefilling:
            prefill = self._admit(list(self.waiting))
        elif express is not None:
            prefill = self._admit([seq for seq in self.waiting if express(*self._split(seq))])
        else:
            prefill = []
        self.running.extend(prefill)
        return ScheduledStep(prefill, decode)

    def _admit(self, queue: list[Sequence]) -> list[Sequence]:
        """Admit from `queue` (waiting sequences, oldest first) what joins the first one's prefill batch."""
        admitted: list[Sequence] = []
        if not queue:
            return admitted
        bucket = length_bucket(self._to_prefill(queue[0]))
        tokens = 0
        for seq in queue:
            if len(self.running) + len(admitted) >= self.max_num_seqs:
                break
            prefill = self._to_prefill(seq)
            if length_bucket(prefill) != bucket:
                continue
            if admitted and tokens + prefill > self.max_prefill_tokens:
                break
            lookup = self._lookup(seq)
            if not self.manager.can_allocate(seq.prompt_len, seq.params.max_tokens, lookup):
                break  # the oldest that does not fit waits; nothing younger overtakes it in this bucket
            seq.num_cached_tokens = self.manager.allocate(seq.seq_id, seq.prompt_len, seq.params.max_tokens, lookup)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.PREFILLING
            admitted.append(seq)
            tokens += seq.prompt_len - seq.num_cached_tokens
        return admitted

    @staticmethod
    def _lookup(seq: Sequence) -> list[int] | None:
        """The prompt to look up in the prefix cache: none when it asks prompt logprobs, which need every prompt
        position's hidden state, so that it is prefilled whole."""
        return seq.prompt_token_ids if seq.params.prompt_logprobs is None else None

    def _to_prefill(self, seq: Sequence) -> int:
        """The prompt tokens the sequence would prefill if admitted now."""
        return self._split(seq)[1]

    def _split(self, seq: Sequence) -> tuple[int, int]:
        """(tokens the sequence would take from the prefix cache, tokens it would prefill) if admitted now."""
        cached = self.manager.cached_prefix_len(seq.prompt_len, seq.params.max_tokens, self._lookup(seq))
        return cached, seq.prompt_len - cached

    def start_running(self, seq: Sequence) -> None:
        """A sequence that needs no prefill (a fork: its cache is copied in) joins the running batch at once; a
        RuntimeError when the batch is full, a MemoryError when its cache does not fit."""
        if len(self.running) >= self.max_num_seqs:
            raise RuntimeError(f"the running batch is full ({self.max_num_seqs} sequences)")
        self.manager.allocate(seq.seq_id, seq.prompt_len, seq.params.max_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, free: bool = True) -> None:
        """Drop a finished or aborted sequence, and release its cache at once unless `free` is False (the caller
        frees it later, by release: a step still running on the device uses it)."""
        if seq in self.running:
            self.running.remove(seq)
            if free:
                self.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def release(self, seq: Sequence) -> None:
        """Return a dropped sequence's cache to the manager, which keeps its cached blocks for later prompts unless it
        failed (a failed step may have left them partly written)."""
        self.manager.free(seq.seq_id, None if seq.finish_reason == "error" else seq.token_ids)
