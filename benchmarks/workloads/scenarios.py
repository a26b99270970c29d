"""What users run, as seeded and exact workloads: the scenarios of the workload benchmark.

A workload is a list of conversations. A conversation has a document (the tokens before its first question; the whole
prompt of a single-turn request) and one or more turns, each a question and the tokens it asks the answer to hold. Turn
k's prompt is the document, every earlier turn's question and answer, then its own question: a client that holds a
conversation sends all of it again each turn. Users of `shared_doc` share one document (the same tokens).

Sizes are for the GPU (Llama-3.1-8B at up to 122K tokens); `scale` multiplies every token count and `count_scale` every
number of conversations, for the CPU and CI. Arrivals: all at t=0 (offline), or the conversations' first turns as a
Poisson process of a given rate (online); a later turn is sent when the answer before it has arrived.
"""
from __future__ import annotations

import random
import zlib
from array import array
from dataclasses import dataclass

K = 1024


@dataclass(frozen=True)
class Scenario:
    """conversations, each of `turns` turns; document tokens drawn from `documents` (ranges, one picked with the
    weights `mix`); question and answer tokens drawn uniformly from their ranges (inclusive). shared: one document
    for every conversation. ttft_bound_s, itl_bound_ms: what a request must meet to count in goodput."""

    conversations: int
    documents: tuple[tuple[int, int], ...]
    answers: tuple[int, int]
    turns: int = 1
    questions: tuple[int, int] = (0, 0)
    mix: tuple[float, ...] = (1.0,)
    shared: bool = False
    ttft_bound_s: float = 30.0
    itl_bound_ms: float = 100.0


SCENARIOS = {
    "doc_qa": Scenario(16, ((32 * K, 120 * K),), (128, 1024)),
    "long_output": Scenario(16, ((32 * K, 120 * K),), (4 * K, 8 * K)),
    "multi_turn": Scenario(8, ((64 * K, 120 * K),), (256, 256), turns=6, questions=(50, 200), ttft_bound_s=10.0),
    "shared_doc": Scenario(32, ((120 * K, 120 * K),), (256, 256), questions=(50, 200), shared=True,
                           ttft_bound_s=10.0),
    "mixed": Scenario(32, ((1 * K, 8 * K), (32 * K, 120 * K)), (128, 1024), mix=(0.7, 0.3), ttft_bound_s=10.0),
}


@dataclass(frozen=True)
class Turn:
    question: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    id: int
    arrival_s: float
    document: tuple[int, ...]
    turns: tuple[Turn, ...]

    def prompt(self, turn: int, answers: list[list[int]]) -> list[int]:
        """Turn `turn`'s prompt, given the answers (token ids) of the turns before it."""
        tokens = list(self.document)
        for t, answer in zip(self.turns[:turn], answers):
            tokens += [*t.question, *answer]
        return tokens + list(self.turns[turn].question)


def _scaled(r: tuple[int, int], scale: float, least: int) -> tuple[int, int]:
    return max(least, round(r[0] * scale)), max(least, round(r[1] * scale))


def make_workload(name: str, seed: int, vocab_size: int, scale: float = 1.0, count_scale: float = 1.0,
                  rate: float | None = None) -> list[Conversation]:
    """The scenario's conversations, the same for the same arguments. rate: first turns per second (a Poisson
    process, drawn apart from the tokens: every rate sends the same conversations), None: every conversation at t=0."""
    spec = SCENARIOS[name]
    rng, arrivals = random.Random(f"{name}:{seed}"), random.Random(f"{name}:{seed}:arrivals")
    count = max(1, round(spec.conversations * count_scale))
    documents = [_scaled(r, scale, 8) for r in spec.documents]
    questions = _scaled(spec.questions, scale, 1) if spec.questions != (0, 0) else (0, 0)
    answers = _scaled(spec.answers, scale, 1)

    def tokens(bounds: tuple[int, int]) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab_size) for _ in range(rng.randint(*bounds)))

    def document() -> tuple[int, ...]:
        return tokens(rng.choices(documents, weights=spec.mix)[0])

    shared = document() if spec.shared else None
    clock, out = 0.0, []
    for i in range(count):
        if rate is not None:
            clock += arrivals.expovariate(rate)
        turns = tuple(Turn(tokens(questions), rng.randint(*answers)) for _ in range(spec.turns))
        out.append(Conversation(i, clock, shared or document(), turns))
    return out


def describe(workload: list[Conversation]) -> list[dict]:
    """What a workload holds, without its tokens: per conversation its arrival, document (length and a fingerprint)
    and turns (question length, max_tokens)."""
    return [{"id": c.id, "arrival_s": c.arrival_s, "document_tokens": len(c.document),
             "document_fingerprint": zlib.crc32(array("q", c.document).tobytes()),
             "turns": [{"question_tokens": len(t.question), "max_tokens": t.max_tokens} for t in c.turns]}
            for c in workload]
