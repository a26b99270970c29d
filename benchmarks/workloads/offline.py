"""The offline driver: a workload run straight through `LLMEngine`, every conversation's first turn submitted at t=0
(as vLLM's offline throughput benchmark does) and each later turn as soon as the answer before it is complete.

Times are taken when `step()` returns the tokens, which is when a server would stream them. A run given a time limit
stops stepping once past it; the requests still open then are recorded as errors ("unfinished"), so a run cut short
reports only what it completed. Beside the requests' own timings it keeps what the engine did: each step's duration
and what it held (StepRecord), the peak bytes held and the ShadowKV selection counters over the run.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from benchmarks.memory_model import non_torch_gpu_bytes
from shadowkv_core import LLMEngine, SamplingParams

from .metrics import RequestRecord, percentile
from .scenarios import Conversation


@dataclass
class StepRecord:
    seconds: float
    prefilled: bool  # it ran layers of a prefill
    tokens: int  # requests that got a token from it
    first_tokens: int  # of those, requests whose first token it was (their prefill ended)
    express: bool  # a short prefill beside the one under way (LLMEngine.express_job) before or after it
    captures: int  # decode CUDA graphs it captured (a batch shape not seen before runs eager, then is captured)

    def cause(self) -> str:
        """What a slow step held, the first that applies: a graph capture, a prefill that ended, an express
        prefill, other prefill slices, or nothing but the decode."""
        if self.captures:
            return "graph_capture"
        if self.first_tokens:
            return "first_token"
        if self.express:
            return "express"
        return "prefill" if self.prefilled else "decode_only"


@dataclass
class EngineTrace:
    steps: list[StepRecord] = field(default_factory=list)
    peak_host_bytes: int = 0
    selected: int = 0  # ShadowKV chunk selections over the run, and how many were already resident
    hits: int = 0

    def summary(self, wall: float, slow_ms: float) -> dict:
        """outside_steps_s: the run's time between the engine's steps (the driver's bookkeeping, the engine's
        statistics), which a server pays between steps too. Steps that gave a running request its next token (an
        inter-token gap): their duration's p50 and p99, and those over slow_ms counted by what they held."""
        total = sum(step.seconds for step in self.steps)
        with_prefill = sum(step.seconds for step in self.steps if step.prefilled)
        gaps = [step for step in self.steps if step.tokens > step.first_tokens]
        gaps_ms = [step.seconds * 1e3 for step in gaps]
        slow = Counter(step.cause() for step, ms in zip(gaps, gaps_ms) if ms > slow_ms)
        return {"steps": len(self.steps), "prefill_step_share": with_prefill / total if total else 0.0,
                "prefill_step_s": with_prefill, "decode_only_step_s": total - with_prefill,
                "outside_steps_s": wall - total,
                "decode_step_p50_ms": percentile(gaps_ms, 50), "decode_step_p99_ms": percentile(gaps_ms, 99),
                "slow_steps": dict(slow),
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
            express, captures = self.engine.express_job is not None, self._captures()
            began = time.perf_counter()
            outputs = self.engine.step()
            now = time.perf_counter()
            tokens = [out for out in outputs if out.new_token_ids]
            first = sum(not self.records[out.request_id].events for out in tokens)
            self.trace.steps.append(StepRecord(now - began, self.engine.last_step_prefilled, len(tokens), first,
                                               express or self.engine.express_job is not None,
                                               self._captures() - captures))
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

    def _captures(self) -> int:
        graphs = self.engine.runner.graphs
        return 0 if graphs is None else graphs.captures

    def _selection_counters(self) -> tuple[int, int]:
        stats = self.engine.stats()
        return stats.get("chunks_selected_total", 0), stats.get("chunk_hits_total", 0)


def peak_gpu_bytes() -> int:
    """The allocator's peak since its last reset, plus what the process holds outside it (CUDA context, cuBLAS)."""
    return torch.cuda.max_memory_allocated() + non_torch_gpu_bytes() if torch.cuda.is_available() else 0
