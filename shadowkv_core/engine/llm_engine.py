"""LLMEngine: requests in, tokens out, one scheduling step at a time (the API the server drives)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache.base import COUNTERS
from ..config import EngineConfig, ShadowKVConfig, choose
from ..models import load_model, load_tokenizer
from ..parallel import TensorParallel, rank_device, rank_shadowkv
from ..shadowkv.hybrid import HybridCache
from ..transfers import Readback
from .cache_factory import build_cache
from .pacing import SlicePacer
from .runner import ModelRunner, PrefillJob
from .sampler import OutputCounts, StepLogprobs, sample, unpack_logprobs
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus, TokenLogprob
from .streams import StepStreams
from .structured import GrammarCompiler
from .text import TextProcessor

logger = logging.getLogger(__name__)

# A waiting prompt whose prefill costs at most this fraction of what the prefill under way has left starts beside it:
# a short prefill is not held up by a long one, and each delays the long one by a small share at most.
EXPRESS_SHARE = 8


def on_main_stream(method):
    """An LLMEngine method whose device work goes to the engine's main stream (StepStreams), where it has one."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with self._main_stream():
            return method(self, *args, **kwargs)
    return wrapped


@dataclass
class InFlightDecode:
    """A decode step launched and not yet read back (EngineConfig.async_decode)."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # (B,) int64 sampled tokens on the device: the next step's inputs
    readback: Readback
    rows: dict[int, int]  # seq_id -> its row
    logprobs: StepLogprobs | None  # those of its tokens, for the requests that ask
    release: list[Sequence] = field(default_factory=list)  # finished while it ran: their caches freed once it has


class LLMEngine:
    """One replica's engine; with tensor_parallel_size > 1, one rank's (tp), driven by engine/tensor_parallel.py."""

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None):
        size = 1 if tp is None else tp.size
        if size != config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}: a replica of several ranks starts "
                             "through engine.tensor_parallel.start_engine, each rank with its TensorParallel")
        self.config = config
        self.device = torch.device(config.device) if tp is None else rank_device(config.device, tp.rank)
        self.model, self.spec = load_model(config.model, config.requested_dtype(), self.device,
                                           config.prefill_chunk_tokens, config.load_format, tp)
        self.tokenizer = load_tokenizer(config.model)
        self.text = TextProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids)
        self.max_model_len = config.max_model_len or self.spec.max_position_embeddings
        self.eos_token_ids = set(self.spec.eos_token_ids)
        self.eos_ids = tuple(sorted(self.eos_token_ids))  # the sampler's mask under min_tokens
        rank_config = dataclasses.replace(config, shadowkv=rank_shadowkv(config.shadowkv, size))
        self.cache = build_cache(rank_config, self.model.rank_spec, next(self.model.parameters()).dtype, self.device,
                                 self.model.rotary, self.max_model_len)
        cuda = self.device.type == "cuda"
        self.runner = ModelRunner(self.model, self.cache, self.device,
                                  pipeline_min_batch=self.pipeline_min_batch(config, cuda, size),
                                  cuda_graphs=choose(config.cuda_graphs, cuda))
        self.streams = StepStreams(self.device) if choose(config.overlap_prefill, cuda and size == 1) else None
        self.scheduler = Scheduler(self.cache.manager, config.max_num_seqs, config.max_prefill_tokens,
                                   config.max_waiting)
        self.async_decode = choose(config.async_decode, cuda)
        self.counts = OutputCounts(self.spec.vocab_size, self.device)  # the penalties' output counts
        self.in_flight: InFlightDecode | None = None
        self.requests: dict[str, Sequence] = {}
        self.prefill_job: PrefillJob | None = None
        self.express_job: PrefillJob | None = None  # a short prefill started beside prefill_job (EXPRESS_SHARE)
        self.last_step_prefilled = False  # whether the last step() ran layers of a prefill
        self.pacer = SlicePacer()  # the prefill FLOPs a step runs beside its decode
        self._slices_queued: torch.cuda.Event | None = None  # after the last step's prefill slices (_queued_mark)
        self._seq_ids = itertools.count()
        self._counted: dict[str, float] = {}  # the counters' values at the last reset_counters
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        # Seconds per prompt token of the fastest recent prefill run with nothing decoding beside it (next_finish_s)
        self._prefill_s_per_token: float | None = None
        self._prefill_clock: tuple[float, bool] | None = None  # the job under way: (start, nothing decoded beside it)

    @staticmethod
    def pipeline_min_batch(config: EngineConfig, cuda: bool, size: int) -> int:
        """The smallest decode batch run in pipelined halves (EngineConfig.pipeline_decode, pipeline_min_batch;
        ShadowKV only); 0: none. With fp8 values a half's fetch is half as long, so it takes a larger batch to hide.
        A rank of `size` > 1 fetches the values of its share of the KV heads and reads its share of the weights twice:
        by default it decodes whole batches."""
        if not choose(config.pipeline_decode, cuda and size == 1) or config.shadowkv is None:
            return 0
        return choose(config.pipeline_min_batch, 16 if config.shadowkv.value_format == "fp8" else 8)

    @property
    def shadowkv(self) -> ShadowKVConfig | None:
        """The ShadowKV config this engine's cache runs (its "auto" fields chosen); None for dense attention."""
        return self.cache.shadow.config if isinstance(self.cache, HybridCache) else None

    # ---- requests in -------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.text.encode(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field when a request can never run on this engine."""
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if not all(isinstance(t, int) and 0 <= t < self.spec.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {self.spec.vocab_size})")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            if any(t >= self.spec.vocab_size for t in ids):
                raise ValueError(f"{name}: token ids must be in [0, {self.spec.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens leave no room under max_model_len "
                             f"({self.max_model_len})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens})"
                             f" exceeds max_model_len ({self.max_model_len})")
        if not self.cache.manager.fits_when_empty(len(prompt_token_ids), params.max_tokens):
            gpu, host = self.footprint(len(prompt_token_ids), params.max_tokens)
            raise ValueError(f"prompt: this request needs {gpu} GPU and {host} host bytes, more than this engine "
                             "holds even when idle")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        if not self.scheduler.can_enqueue():
            raise RuntimeError(f"the engine's waiting queue is full ({self.config.max_waiting} requests)")
        seq = Sequence(next(self._seq_ids), request_id, token_ids, params, self._next_seed(params.seed))
        if params.guided is not None:
            seq.grammar = self.grammars.grammar(params.guided)
        self.scheduler.add(seq)
        self.requests[request_id] = seq

    @on_main_stream
    def fork(self, request_id: str, new_request_id: str) -> list[RequestOutput]:
        """A new request that continues from a copy of a decoding request's state: its prompt, its tokens so far and
        its cache (no prefill); its sampled tokens are drawn from a seed of its own. MemoryError if the cache has no
        room for it, ValueError if the source is not decoding. Returns the outputs of the decode step that was in
        flight (async decode), read back first so that the copy holds every token the source has: deliver them as a
        step()'s. A source that finished in that step is not forked (new_request_id is then not among the requests)."""
        src = self.requests.get(request_id)
        if src is None or src.status is not SequenceStatus.RUNNING:
            raise ValueError(f"request_id: {request_id!r} is not decoding")
        if new_request_id in self.requests:
            raise ValueError(f"request_id: {new_request_id!r} is already in flight")
        outputs = self.drain_in_flight()
        if src.is_finished:
            return outputs
        seq = Sequence(next(self._seq_ids), new_request_id, src.prompt_token_ids, src.params, self._next_seed(None))
        seq.output_token_ids, seq.text = list(src.output_token_ids), src.text
        seq.prompt_logprobs, seq.cumulative_logprob = src.prompt_logprobs, src.cumulative_logprob
        seq.output_logprobs = None if src.output_logprobs is None else list(src.output_logprobs)
        seq.grammar = None if src.grammar is None else src.grammar.copy()
        self.scheduler.start_running(seq)
        try:
            self.counts.copy(src.seq_id, seq)
            self.cache.copy_sequence(src.seq_id, seq.seq_id)
        except Exception:
            self.scheduler.finish(seq)  # a copy that failed leaves nothing held
            raise
        self.requests[new_request_id] = seq
        return outputs

    @on_main_stream
    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            seq.finish("abort")
            self._release(seq)

    def _next_seed(self, seed: int | None) -> int:
        return seed if seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_rng))

    def has_unfinished_requests(self) -> bool:
        """Whether a step() has work: requests queued or running, or a decode step still to read back."""
        return self.scheduler.num_unfinished > 0 or self.in_flight is not None

    # ---- one step ----------------------------------------------------------------------------------------
    @on_main_stream
    def step(self) -> list[RequestOutput]:
        """Decode one token for every running request, and advance the prefill under way by as many of its slices
        as the step's budget buys (a short prompt's whole prefill; a long prompt's over many steps): prefill_step_tflop,
        raised while steps take less than prefill_step_ms (SlicePacer); with nothing decoding, the whole prefill runs
        in this step. A short prefill admitted while a long one is under way (EXPRESS_SHARE) runs first from the
        step's budget, and the long one gets what is left.

        With async_decode a decode step is launched and read back in the next step() call, after that call
        has launched its own: each decoded token is reported one call later, and a request that stops (a stop token
        or string) has decoded one more token by then, which is dropped. A step whose batch holds a request with a
        grammar (structured output) runs without that overlap: its mask needs the token before.

        With StepStreams the step's prefill slices run beside its decode, and the next step waits for both."""
        self.pacer.start_step()
        if self.streams is not None and self._slices_queued is not None:
            self.streams.after_slices(self._slices_queued)
        scheduled = self.scheduler.schedule(self._express())
        outputs, prev = [], self.in_flight
        decode = scheduled.decode
        if prev is not None:  # a request whose last token is in flight has no step left to run
            decode = [seq for seq in decode
                      if len(seq.output_token_ids) + (seq.seq_id in prev.rows) < seq.params.max_tokens]
        if self.streams is not None and (scheduled.prefill or self.prefill_job is not None):
            self.streams.before_decode()
        if scheduled.prefill:
            with self._slice_stream():
                job = self.runner.start_prefill(scheduled.prefill)
            if self.prefill_job is None:
                self.prefill_job, self._prefill_clock = job, (time.monotonic(), True)
            else:
                self.express_job = job
        if decode and self.async_decode and not any(seq.grammar is not None for seq in decode):
            outputs += self._launch(decode, prev)
            outputs += self._read_back(prev)
        else:
            self.in_flight = None
            outputs += self._read_back(prev)
            decode = [seq for seq in decode if not seq.is_finished]
            if decode:
                outputs += self._run(self.runner.decode, decode)
        if (decode or self.express_job is not None) and self._prefill_clock is not None:
            self._prefill_clock = (self._prefill_clock[0], False)
        self.last_step_prefilled = self.prefill_job is not None
        flops = self.pacer.budget(self.config) if decode else None
        jobs = [j for j in (self.express_job, self.prefill_job) if j is not None]  # the short one first
        paced = bool(decode and jobs) and flops is not None
        if jobs and self._slices_queued is not None:
            self._slices_queued.synchronize()
        for job in jobs:
            if flops is not None and flops <= 0:
                break
            outputs += self._run(lambda seqs, job=job: self._advance_prefill(job, flops), job.seqs)
            flops = None if flops is None else job.budget.left
            if job.next_layer == self.runner.num_layers:
                self._prefill_done(job)
        self._slices_queued = self._queued_mark() if jobs else None
        self.pacer.end_step(self.config, paced)
        return outputs

    def _queued_mark(self) -> torch.cuda.Event | None:
        """On CUDA, an event after the work queued so far (with StepStreams, the prefill stream's: the slices). The
        next step waits for it before it queues prefill slices, so the device holds one step's slices at most: the
        step's budget then bounds the decodes' wait, and every step waits for the one before it alone, whatever
        slices it holds (none of them needs to sync)."""
        if self.device.type != "cuda":
            return None
        if self.streams is not None:
            return self.streams.mark()
        event = torch.cuda.Event()
        event.record()
        return event

    def _main_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.streams is None else self.streams.engine()

    def _slice_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.streams is None else self.streams.slices()

    def _express(self) -> Callable[[int, int], bool] | None:
        """While a prefill is under way and no short one beside it: whether a waiting prompt (tokens cached, tokens
        to prefill) may start beside it, its prefill at most 1/EXPRESS_SHARE of what the one under way has left."""
        if self.prefill_job is None or self.express_job is not None:
            return None
        budget, num_layers = self.prefill_job.budget, self.runner.num_layers
        limit = self.prefill_job.flops_left(num_layers) / EXPRESS_SHARE
        return lambda cached, n: budget.prompt(cached, n) * num_layers <= limit

    def _prefill_done(self, job: PrefillJob) -> None:
        """A job ran its last layer: the fastest prefill rate yet if it ran alone (prefill_job); a short one that
        ended after prefill_job becomes the job under way."""
        if job is self.express_job:
            self.express_job = None
        elif job is self.prefill_job:
            if self._prefill_clock is not None:
                self._time_prefill(job.num_tokens)
            self.prefill_job, self.express_job = self.express_job, None

    def _advance_prefill(self, job: PrefillJob, flops: float | None) -> torch.Tensor | None:
        """The runner's advance_prefill; once it has run every layer, the prompt logprobs go to the sequences that
        asked for them."""
        with self._slice_stream():
            logits = self.runner.advance_prefill(job, flops)
            for i, packed in job.prompt_logprobs.items():
                seq = job.seqs[i]
                seq.prompt_logprobs = [None, *unpack_logprobs(packed.tolist(),
                                                              [seq.params.prompt_logprobs] * len(packed))]
        if logits is not None and self.streams is not None:  # sampled on the main stream
            self.streams.after_slices()
            logits.record_stream(self.streams.main)
        return logits

    @on_main_stream
    def drain_in_flight(self) -> list[RequestOutput]:
        """Read back the decode step in flight (async decode), if any: after it every request's tokens are those its
        cache holds, and no decode of this engine runs on the device (prefill slices may)."""
        job, self.in_flight = self.in_flight, None
        return self._read_back(job)

    def _time_prefill(self, num_tokens: int) -> None:
        """A prefill job has run all its layers: if nothing ran beside it, its time per token, when it is the
        fastest yet (a rate later prefills are unlikely to beat: next_finish_s stays a lower bound)."""
        start, alone = self._prefill_clock
        self._prefill_clock = None
        if alone:
            s_per_token = (time.monotonic() - start) / num_tokens
            last = self._prefill_s_per_token
            self._prefill_s_per_token = s_per_token if last is None else min(s_per_token, last)

    def next_finish_s(self) -> float | None:
        """A lower bound on the seconds until one of this engine's requests can finish (and free its slot), or None
        when there is nothing to bound. 0 while any request decodes: its next token may end it. Else the prefill
        under way, whose requests finish first, at best: its layers still to run at the fastest measured prefill
        rate (None before any prefill ran alone). An abort can always free a slot sooner."""
        if any(seq.status is SequenceStatus.RUNNING for seq in self.requests.values()):
            return 0.0
        jobs = [job for job in (self.express_job, self.prefill_job) if job is not None]
        if not jobs or self._prefill_s_per_token is None:
            return None
        left = min(job.num_tokens * (self.runner.num_layers - job.next_layer) for job in jobs) / self.runner.num_layers
        return left * self._prefill_s_per_token

    def _run(self, forward, seqs: list[Sequence]) -> list[RequestOutput]:
        """Run a forward over `seqs` and sample from its logits; a forward that returns None (a prefill with layers
        still to run) produces nothing yet."""
        try:
            logits = forward(seqs)
            if logits is None:
                return []
            drawn = sample(logits, seqs, eos_token_ids=self.eos_ids, counts=self.counts)
            logprobs = StepLogprobs.of(logits, drawn, seqs)
            tokens, by_row = drawn.tolist(), {} if logprobs is None else logprobs.by_row()
        except Exception as exc:
            self._fail(seqs, exc)
            return [seq.output(0) for seq in seqs]
        for row, (seq, token) in enumerate(zip(list(seqs), tokens)):
            if seq.status is SequenceStatus.PREFILLING:
                seq.status = SequenceStatus.RUNNING
            self._append(seq, token, by_row.get(row))
        return [seq.output(1) for seq in seqs]

    def _launch(self, seqs: list[Sequence], prev: InFlightDecode | None) -> list[RequestOutput]:
        """Queue a decode step of `seqs` on the device, sampling included (the step in flight from now on), its inputs
        the tokens of `prev` where it has them. If queueing it raised, its requests fail: their outputs."""
        rows = None if prev is None else [prev.rows.get(seq.seq_id, -1) for seq in seqs]
        index = [len(seq.output_token_ids) + (row >= 0) for seq, row in zip(seqs, rows or [-1] * len(seqs))]
        try:
            logits = self.runner.decode(seqs, None if prev is None else prev.tokens, rows)
            tokens = sample(logits, seqs, index, self.eos_ids, self.counts)
            logprobs = StepLogprobs.of(logits, tokens, seqs)
        except Exception as exc:
            self._fail(seqs, exc)  # while `prev` is in flight: the caches it uses are freed once it is read back
            self.in_flight = None
            return [seq.output(0) for seq in seqs]
        self.in_flight = InFlightDecode(list(seqs), tokens, Readback(tokens),
                                        {seq.seq_id: i for i, seq in enumerate(seqs)}, logprobs)
        return []

    def _read_back(self, job: InFlightDecode | None) -> list[RequestOutput]:
        """Wait for a launched decode step and append its tokens (dropping those of requests that finished while it
        ran); then free the caches of the requests that finished while it ran."""
        if job is None:
            return []
        try:
            tokens = job.readback.tolist()
            by_row = {} if job.logprobs is None else job.logprobs.by_row()
        except Exception as exc:
            failed = [seq for seq in job.seqs if not seq.is_finished]
            self._fail(failed, exc)
            outputs = [seq.output(0) for seq in failed]
        else:
            outputs = []
            for row, (seq, token) in enumerate(zip(job.seqs, tokens)):
                if not seq.is_finished:
                    self._append(seq, token, by_row.get(row))
                    outputs.append(seq.output(1))
        for seq in job.release:
            self.scheduler.release(seq)
        return outputs

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        seq.output_token_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
            seq.cumulative_logprob += logprob.logprob
        params = seq.params
        stopped = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if seq.grammar is not None:
            if not seq.grammar.accept(token):
                self._fail([seq], ValueError(f"token {token} breaks the output's grammar: {seq.grammar.error}"))
                return
            stopped |= seq.grammar.is_done
        length = len(seq.output_token_ids) >= params.max_tokens
        stopped |= self.text.update(seq, done=stopped or length)
        if stopped or length:
            seq.finish("stop" if stopped else "length")
            self._release(seq)

    def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        """One failed forward fails only its own requests, and frees them."""
        logger.error("engine step failed for %d requests", len(seqs), exc_info=exc)
        for seq in list(seqs):
            seq.finish("error", f"{type(exc).__name__}: {exc}")
            self._release(seq)

    @on_main_stream
    def fail_all(self, reason: str) -> list[RequestOutput]:
        """Fail every request held (a replica that can no longer step): their last outputs."""
        seqs = list(self.requests.values())
        self._fail(seqs, RuntimeError(reason))
        return [seq.output(0) for seq in seqs]

    def _release(self, seq: Sequence) -> None:
        """Drop a finished, failed or aborted request from the running batch and the prefill under way, and free its
        cache: at once, or, if a decode step still running on the device holds it, once that step is read back.
        One dropped from a prefill is freed behind the slices queued for it."""
        in_express, in_prefill = (job is not None and seq in job.seqs for job in (self.express_job, self.prefill_job))
        if (in_express or in_prefill) and self.streams is not None:
            self.streams.after_slices()
        with self._slice_stream():
            if in_express:
                self.express_job = self.express_job.without(seq)
            if in_prefill:
                self.prefill_job = self.prefill_job.without(seq)
                if self.prefill_job is None:
                    self.prefill_job, self.express_job, self._prefill_clock = self.express_job, None, None
        held = self.in_flight is not None and seq.seq_id in self.in_flight.rows
        self.scheduler.finish(seq, free=not held)
        self.counts.free(seq.seq_id)
        if held:
            self.in_flight.release.append(seq)
        self.requests.pop(seq.request_id, None)

    # ---- what the server asks ----------------------------------------------------------------------------
    def footprint(self, prompt_len: int, max_tokens: int) -> tuple[int, int]:
        """Predicted (GPU bytes, host bytes) a request of this shape holds while it runs."""
        return self.cache.manager.footprint(prompt_len, max_tokens)

    @on_main_stream
    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix no running request holds (their blocks return to the pools); how many blocks."""
        return self.cache.manager.clear_prefix_cache()

    @on_main_stream
    def compile_buckets(self) -> int:
        """Compile the decode kernels for every context bucket a request can reach (KVCache.compile_buckets)."""
        return self.cache.compile_buckets(self.max_model_len)

    def check_health(self) -> None:
        """Raises when the engine can serve no more (tensor_parallel.py's can break); this one fails a request, never
        itself."""

    @on_main_stream
    def close(self) -> None:
        """Abort everything and release the caches (pinned host memory included) once no queued work reads them."""
        for request_id in list(self.requests):
            self.abort(request_id)
        self.drain_in_flight()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # slices and host-value copies still queued on any stream
        if self.runner.graphs is not None:
            self.runner.graphs.clear()  # before a tensor-parallel rank leaves its group (DecodeGraphs.clear)
        self.cache.close()

    def stats(self) -> dict[str, float]:
        stats = {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                 **self.cache.stats()}
        for key, before in self._counted.items():
            stats[key] -= before
        return stats

    def reset_counters(self) -> None:
        """The counters among stats() (cache.base.COUNTERS) count from zero again: a replica's warm-up leaves none of
        its synthetic requests in what it reports. Waits for the device, whose last decode steps' counts it takes."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats = self.cache.stats()
        self._counted = {key: stats[key] for key in COUNTERS if key in stats}

