"""A tensor-parallel replica's engine: rank 0 (this process) and N-1 worker processes, each running an LLMEngine on
its shard (parallel.py). Rank 0 alone takes requests; before each step it broadcasts the calls that changed the
engine's state since the last one, and every rank applies them and steps. Scheduling and sampling are deterministic
(the same calls, the same seeds, the same all-reduced logits on every rank), so the ranks run the same steps with
no per-step metadata beyond those calls.

A rank that fails (an error in a step, a lost process, a collective past its timeout) breaks the replica: rank 0
fails every request it holds with the error, ends the workers, and refuses new requests."""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

import torch
import torch.multiprocessing as mp

from ..config import EngineConfig, choose
from ..parallel import COLLECTIVE_TIMEOUT_S, init_tensor_parallel, leave_tensor_parallel
from .llm_engine import LLMEngine
from .sequence import RequestOutput
from .warm_up import warm_up

logger = logging.getLogger(__name__)

_STOP = "stop"
_PACE = "pace"  # rank 0's SlicePacer scale: every rank's next step slices its prefill alike
WORKER_JOIN_S = 10.0  # how long close() waits for a worker to leave before ending it


def new_engine(config: EngineConfig, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> LLMEngine | TensorParallelEngine:
    """The engine of one replica, not warmed up: an LLMEngine, or with tensor_parallel_size > 1 a
    TensorParallelEngine."""
    return LLMEngine(config) if config.tensor_parallel_size == 1 else TensorParallelEngine(config, timeout_s)


def start_engine(config: EngineConfig, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> LLMEngine | TensorParallelEngine:
    """new_engine's engine, warmed up (config.warm_up) before it is returned."""
    engine = new_engine(config, timeout_s)
    if choose(config.warm_up, torch.device(config.device).type == "cuda"):
        try:
            done = warm_up(engine)
        except BaseException:
            engine.close()
            raise
        logger.info("warm-up: %.1f s, %d context buckets, %d steps", done.seconds, done.buckets, done.steps)
    return engine


class TensorParallelEngine:
    """Rank 0 of a tensor-parallel replica, with LLMEngine's API: the state-changing calls are applied here and
    replayed on the workers before the next step; everything else reads rank 0's engine."""

    def __init__(self, config: EngineConfig, timeout_s: float = COLLECTIVE_TIMEOUT_S):
        size = config.tensor_parallel_size
        fd, rendezvous = tempfile.mkstemp(prefix="shadowkv-tp-")
        os.close(fd)
        os.unlink(rendezvous)  # the file store creates it; a stale one would hold another group's keys
        ctx = mp.get_context("spawn")
        self.workers = [ctx.Process(target=_worker_main, args=(config, rank, size, rendezvous, timeout_s),
                                    name=f"shadowkv-tp-rank{rank}", daemon=True) for rank in range(1, size)]
        for worker in self.workers:
            worker.start()
        self.error: str | None = None
        self.pending: list[tuple[str, tuple]] = []
        try:
            self.tp = init_tensor_parallel(0, size, rendezvous, config.device, timeout_s,
                                           peers_alive=lambda: all(w.is_alive() for w in self.workers))
            self.engine = LLMEngine(config, self.tp)
        except Exception:
            self._end_workers()
            leave_tensor_parallel(clean=False)
            raise

    def __getattr__(self, name: str):
        return getattr(self.__dict__["engine"], name)  # reads (stats, footprint, requests, spec, ...) from rank 0

    def _replayed(self, name: str, *args):
        if self.error is not None:
            raise RuntimeError(f"tensor-parallel replica failed: {self.error}")
        result = getattr(self.engine, name)(*args)
        self.pending.append((name, args))  # only calls that succeeded here: every rank succeeds the same way
        return result

    def add_request(self, *args) -> None:
        self._replayed("add_request", *args)

    def abort(self, request_id: str) -> None:
        if self.error is None:
            self._replayed("abort", request_id)

    def fork(self, request_id: str, new_request_id: str) -> list[RequestOutput]:
        return self._replayed("fork", request_id, new_request_id)

    def drain_in_flight(self) -> list[RequestOutput]:
        return [] if self.error is not None else self._replayed("drain_in_flight")

    def clear_prefix_cache(self) -> int:
        return self._replayed("clear_prefix_cache")

    def compile_buckets(self) -> int:
        return self._replayed("compile_buckets")

    def step(self) -> list[RequestOutput]:
        if self.error is not None:
            return []
        calls, self.pending = self.pending, []
        if self.engine.config.prefill_step_ms is not None:  # the ranks time their steps apart: rank 0's scale holds
            calls.append((_PACE, (self.engine.pacer.scale,)))
        try:
            self.tp.broadcast(calls)
        except Exception as exc:  # a lost worker: its peer's broadcast fails
            return self._break(f"{type(exc).__name__}: {exc}")
        outputs = self.engine.step()
        failed = next((out.error for out in outputs if out.finish_reason == "error"), None)
        dead = [w.name for w in self.workers if not w.is_alive()]
        if failed is None and not dead:
            return outputs
        return [out for out in outputs if out.finished] + self._break(failed or f"{', '.join(dead)} exited")

    def _break(self, reason: str) -> list[RequestOutput]:
        """A rank failed: fail every request still held (their last outputs), end the workers."""
        logger.error("tensor-parallel replica failed: %s", reason)
        self.error = reason
        outputs = self.engine.fail_all(f"tensor-parallel replica failed: {reason}")
        self._end_workers()
        return outputs

    def check_health(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a tensor-parallel rank failed: {self.error}")

    def close(self) -> None:
        clean = self.error is None
        if clean:
            for request_id in list(self.engine.requests):
                self.abort(request_id)
            try:
                self.tp.broadcast(self.pending + [(_STOP, ())])
            except Exception as exc:
                logger.warning("tensor-parallel workers did not take the stop: %s", exc)
                clean = False
        self.engine.close()
        leave_tensor_parallel(clean)  # while the workers leave too, before waiting for them to exit
        self._end_workers()

    def _end_workers(self) -> None:
        for worker in self.workers:
            worker.join(WORKER_JOIN_S if self.error is None else 0)
            if worker.is_alive():
                worker.terminate()
                worker.join()


def _worker_main(config: EngineConfig, rank: int, size: int, rendezvous: str, timeout_s: float) -> None:
    """Rank `rank`'s process: the same engine on its shard, replaying rank 0's calls and stepping with it. Any error
    ends the process (rank 0 then fails the replica's requests)."""
    tp = init_tensor_parallel(rank, size, rendezvous, config.device, timeout_s)
    engine = LLMEngine(config, tp)
    while True:
        calls = tp.broadcast(None)
        for name, args in calls:
            if name == _STOP:
                engine.close()
                leave_tensor_parallel(clean=True)
                return
            if name == _PACE:
                engine.pacer.scale = args[0]
                continue
            getattr(engine, name)(*args)
        failed = next((out for out in engine.step() if out.finish_reason == "error"), None)
        if failed is not None:
            raise RuntimeError(f"rank {rank}: request {failed.request_id} failed: {failed.error}")

