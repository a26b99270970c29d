"""LLM: offline batch generation in the convention users know from vLLM."""
from __future__ import annotations

import itertools

from .config import EngineConfig, ShadowKVConfig
from .engine import RequestOutput, SamplingParams
from .engine.tensor_parallel import start_engine


class LLM:
    """`LLM(model=path, device="cuda", dtype="bfloat16", shadowkv=ShadowKVConfig())`; other EngineConfig fields
    (max_num_seqs, max_model_len, gpu_cache_gib, ...) pass through as keyword arguments."""

    def __init__(self, model: str, device: str = "cpu", dtype: str = "auto",
                 shadowkv: ShadowKVConfig | None = None, **engine_kwargs):
        self.engine = start_engine(EngineConfig(model=model, device=device, dtype=dtype, shadowkv=shadowkv,
                                             **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order. A prompt may be a string or a list of token ids."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        request_ids = [f"generate-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt in zip(request_ids, prompts):
                self.engine.add_request(request_id, prompt, params)
        except Exception:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        self.engine.drain_in_flight()  # a step launched for a request that then stopped: free its cache now
        return [finished[request_id] for request_id in request_ids]
