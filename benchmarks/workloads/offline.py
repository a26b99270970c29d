"""The offline driver: a workload run straight through `LLMEngine`, every conversation's first turn submitted at t=0
(as vLLM's offline throughput benchmark does) and each later turn as soon as the answer before it is complete.

Times are taken when `step()` returns the tokens, which is when a server would stream them. A run given a time limit
stops stepping once past it; the requests still open then are recorded as errors ("unfinished"), so a run cut short
reports only what it completed. Beside the requests' own
timings it keeps what the engine did: each step's duration and whether it ran prefill layers, the peak bytes held and
the ShadowKV selection counters over the run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from benchmarks.memory_model import non_torch_gpu_bytes
from shadowkv_core import LLMEngine, SamplingParams

from .metrics import RequestRecord
from .scenarios import Conversation


@dataclass
class EngineTrace:
    steps: list[tuple[float, bool]] = field(default_factory=list)  # (seconds, ran prefill layers)
    peak_host_bytes: int = 0
    selected: int = 0  # ShadowKV chunk selections over the run, and how many were already resident
    hits: int = 0

    def summary(self, wall: float) -> dict:
        """outside_steps_s: the run's time between the engine's steps (the driver's bookkeeping, the engine's
        statistics), which a server pays between steps too."""
        total = sum(s for s, _ in self.steps)
        with_prefill = sum(s for s, prefilled in self.steps if prefilled)
        return {"steps": len(self.steps), "prefill_step_share": with_prefill / total if total else 0.0,
                "prefill_step_s": with_prefill, "decode_only_step_s": total - with_prefill,
                "outside_steps_s": wall - total,
                "peak_host_gib": self.peak_host_bytes / 2**30,
                "hit_rate": self.hits / self.selected if self.selected else None}


UNFINISHED = "unfinished at the run's time limit"


def request_id(conversation: Conversation, turn: int) -> str:
    return f"c{conversation.id}-t{turn}"


class OfflineRun:
    """One workload through one engine; `run()` -> (request records, engine trace, wall seconds)."""

    def __init__(self, engine: LLMEngine, workload: list[Conversation], progress=None,
                 time_limit_s: float | None = None):
        self.engine, self.workload, self.progress, self.time_limit_s = engine, workload, progress, time_limit_s
        self.records: dict[str, RequestRecord] = {}
        self.answers: dict[int, list[list[int]]] = {c.id: [] for c in workload}
        self.trace = EngineTrace()
        self.start = 0.0

    def run(self) -> tuple[list[RequestRecord], EngineTrace, float]:
        counters = self._selection_counters()
        self.start = time.perf_counter()
        for conversation in self.workload:
            self._submit(conversation, 0)
        while self.engine.has_unfinished_requests() and not self._past_limit():
            began = time.perf_counter()
            outputs = self.engine.step()
            now = time.perf_counter()
            self.trace.steps.append((now - began, self.engine.last_step_prefilled))
            self._observe(outputs, now - self.start)
        wall = time.perf_counter() - self.start
        for record in self.records.values():
            if record.finish_reason is None and record.error is None:
                record.error = UNFINISHED
        selected, hits = (after - before for after, before in zip(self._selection_counters(), counters))
        self.trace.selected, self.trace.hits = selected, hits
        return list(self.records.values()), self.trace, wall

    def _past_limit(self) -> bool:
        return self.time_limit_s is not None and time.perf_counter() - self.start >= self.time_limit_s

    def _submit(self, conversation: Conversation, turn: int) -> None:
        prompt = conversation.prompt(turn, self.answers[conversation.id])
        rid = request_id(conversation, turn)
        params = SamplingParams(max_tokens=conversation.turns[turn].max_tokens, temperature=0, ignore_eos=True)
        self.records[rid] = RequestRecord(rid, conversation.id, turn, time.perf_counter() - self.start, len(prompt))
        self.engine.add_request(rid, prompt, params)

    def _observe(self, outputs, at: float) -> None:
        stats = self.engine.stats()
        self.trace.peak_host_bytes = max(self.trace.peak_host_bytes, stats["host_bytes_in_use"])
        for out in outputs:
            record = self.records[out.request_id]
            if out.new_token_ids:
                record.events.append((at, len(out.new_token_ids)))
            if not out.finished:
                continue
            record.finish_reason, record.error = out.finish_reason, out.error
            if self.progress is not None:
                self.progress.update(1)
            conversation = self.workload[record.conversation]
            self.answers[conversation.id].append(list(out.token_ids))
            if out.error is None and record.turn + 1 < len(conversation.turns):
                self._submit(conversation, record.turn + 1)

    def _selection_counters(self) -> tuple[int, int]:
        stats = self.engine.stats()
        return stats.get("chunks_selected_total", 0), stats.get("chunk_hits_total", 0)


def peak_gpu_bytes() -> int:
    """The allocator's peak since its last reset, plus what the process holds outside it (CUDA context, cuBLAS)."""
    return torch.cuda.max_memory_allocated() + non_torch_gpu_bytes() if torch.cuda.is_available() else 0
