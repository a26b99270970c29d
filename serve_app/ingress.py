"""The ingress deployment: OpenAI-compatible HTTP API (FastAPI through `serve.ingress`), admission, streaming.

Per request: validate (pydantic), tokenize and check the context length (worker thread), predict its bytes, admit
it onto a replica with room (or refuse at once), stream the engine replica's events back as SSE or one body.
"""

import asyncio
import importlib.metadata
import logging
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle

from serve_app.admission import AdmissionGate, Footprint, board_for
from serve_app.edge import CapacityAdvert, CapacitySource
from serve_app.errors import OpenAIError, error_event, install_error_handlers, not_ready
from serve_app.limits import RequestLimits, timed_out, until_deadline
from serve_app.logprobs import LogprobFormatter
from serve_app.metrics import ErrorCounter, ServiceMetrics
from serve_app.prepare import prepare
from serve_app.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList,
                                new_request_id)
from serve_app.security import METRICS_PATH, OPEN_PATHS, GuardSettings, RequestGuard, load_api_keys
from serve_app.streaming import ChunkFormatter, collect, merge, per_prompt, raise_if_error, sse_stream
from serve_app.tokens import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, detokenize,
                              tokenize)

logger = logging.getLogger("ray.serve")
MODEL_INFO_TIMEOUT_S = 2.0

api = FastAPI(title="ShadowKV Serve", description="OpenAI-compatible long-context LLM serving")
install_error_handlers(api)
GUARD = GuardSettings()  # API keys and body size limit: the Ingress sets them when it starts
api.add_middleware(RequestGuard, settings=GUARD)
CAPACITY = CapacitySource()  # the Ingress sets it when it starts
api.add_middleware(CapacityAdvert, source=CAPACITY)
METRICS = ServiceMetrics()  # one ingress a process: the error-counting middleware and the routes share it
api.add_middleware(ErrorCounter, metrics=METRICS)


@serve.deployment(max_ongoing_requests=1024, max_queued_requests=512, ray_actor_options={"num_cpus": 0},
                  backpressure_config={"status_code": 429, "retry_after_s": 1})
@serve.ingress(api)
class Ingress:
    def __init__(self, engine: DeploymentHandle, weights: dict, max_waiting: int = 64, max_wait_s: float = 300.0,
                 default_max_tokens: int = 256, limits: RequestLimits = RequestLimits(),
                 max_body_bytes: int = 8 << 20, metrics_need_api_key: bool = False):
        GUARD.api_keys, GUARD.max_body_bytes = load_api_keys(), max_body_bytes
        GUARD.open_paths = OPEN_PATHS if metrics_need_api_key else OPEN_PATHS | {METRICS_PATH}
        self.limits = limits
        self.weights = weights
        self.engine = engine
        self.stream_engine = engine.options(stream=True)
        self.board = board_for(serve.get_replica_context().app_name, engine.deployment_name)
        self.gate = AdmissionGate(self.board, max_waiting=max_waiting, max_wait_s=max_wait_s)
        CAPACITY.read = self.gate.capacity
        self.default_max_tokens = default_max_tokens
        self.metrics = METRICS
        self.info: dict | None = None
        self.served_since: int | None = None
        self.footprint: Footprint | None = None
        self._info_task: asyncio.Task | None = None

    # ---- routes ----------------------------------------------------------------------------------------------
    @api.api_route("/health", methods=["GET", "HEAD"])
    async def health(self) -> JSONResponse:
        await self._require_ready()
        return JSONResponse({"status": "ok", "replicas": self.board.num_replicas()})

    @api.get("/v1/models", response_model=ModelList)
    async def models(self) -> ModelList:
        await self._require_ready()
        return ModelList(data=[self._model_card()])

    @api.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(self, model_id: str) -> ModelCard:
        await self._require_ready()
        self._check_model(model_id)
        return self._model_card()

    @api.get("/version")
    async def version(self) -> dict:
        return {"version": importlib.metadata.version("shadowkv-serve")}

    @api.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_prompt(self, request: TokenizeRequest) -> TokenizeResponse:
        await self._require_ready()
        self._check_model(request.model)
        tokens = await asyncio.to_thread(tokenize, self.info["tokenizer"], request, self.info["model"])
        return TokenizeResponse(count=len(tokens), max_model_len=self.info["max_model_len"], tokens=tokens)

    @api.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_tokens(self, request: DetokenizeRequest) -> DetokenizeResponse:
        await self._require_ready()
        self._check_model(request.model)
        return DetokenizeResponse(prompt=await asyncio.to_thread(detokenize, self.info["tokenizer"], request.tokens))

    @api.get(METRICS_PATH)
    async def metrics_text(self) -> Response:
        body = self.metrics.render(self.board.reports(), self.gate.num_waiting, self.board.num_reserved())
        return Response(body, media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions")
    async def completions(self, request: CompletionRequest):
        return await self._serve(request, "completion", new_request_id("cmpl"))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: ChatCompletionRequest):
        return await self._serve(request, "chat", new_request_id("chatcmpl"))

    # ---- one request -----------------------------------------------------------------------------------------
    async def _serve(self, request, kind: str, request_id: str):
        arrived = time.monotonic()
        await self._require_ready()
        self._check_model(request.model)
        self.limits.check_request(request)
        self._refuse_early()
        choices = await asyncio.to_thread(prepare, self.info["tokenizer"], request, self.info["max_model_len"],
                                          self.default_max_tokens, self.footprint.block_size)
        for prepared in choices:
            self.limits.check_prompt(len(prepared.prompt_token_ids))
        events = await self._start_choices(request_id, choices, arrived)
        model, count, tools = self.info["model"], len(choices), choices[0].tool_family
        logprobs = LogprobFormatter(self.info["tokenizer"], request)
        if request.stream:
            prompt_tokens = per_prompt((len(p.prompt_token_ids) for p in choices), request.n)
            fmt = ChunkFormatter(kind, request_id, model, prompt_tokens if request.continuous_usage else None,
                                 logprobs, tools)
            return StreamingResponse(sse_stream(events, fmt, request.include_usage, count, request.n),
                                     media_type="text/event-stream")
        return await collect(events, kind, request_id, model, count, request.n, request.candidates, logprobs, tools)

    async def _start_choices(self, request_id: str, choices: list, arrived: float) -> AsyncIterator[dict]:
        """Admit every choice at once, each as an engine request of its own, and wait for their first events; a
        refusal of any one ends the others, started or still waiting. -> their events merged, tagged with each
        choice's index."""
        engine_ids = [request_id] if len(choices) == 1 else [f"{request_id}-{i}" for i in range(len(choices))]
        tasks = [asyncio.ensure_future(self._start(engine_id, prepared, arrived))
                 for engine_id, prepared in zip(engine_ids, choices)]
        try:
            started = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(outcome, tuple):
                    await outcome[1].aclose()
            raise
        return merge([first for first, _ in started], [events for _, events in started])

    async def _start(self, engine_id: str, prepared, arrived: float) -> tuple[dict, AsyncIterator[dict]]:
        """One choice admitted and started: (its first event, echo included; its events). Runs in a task of its own,
        under a Serve request id of its own: Serve's router tracks a call by its parent request's internal id, so
        calls of one request in flight at once would collide there (one of them never sent)."""
        context = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(replace(context, _internal_request_id=uuid.uuid4().hex))
        gpu, host = self.footprint.predict(len(prepared.prompt_token_ids), prepared.params.max_tokens)
        await self._admit(engine_id, gpu, host, prepared.affinity)
        events = self._events(engine_id, prepared, gpu, host, arrived)
        return prepared.echoed(await self._first_event(events)), events  # on failure it closes `events` itself

    def _refuse_early(self) -> None:
        try:
            self.gate.refuse_early()
        except OpenAIError as exc:
            self.metrics.rejected.labels(reason=exc.code).inc()
            raise

    async def _admit(self, request_id: str, gpu: int, host: int, keys: tuple[bytes, ...]) -> None:
        try:
            await self.gate.admit(request_id, gpu, host, keys)
        except OpenAIError as exc:
            self.metrics.rejected.labels(reason=exc.code or str(exc.status)).inc()
            raise
        self.metrics.admitted.inc()

    async def _events(self, request_id: str, prepared, gpu: int, host: int, arrived: float) -> AsyncIterator[dict]:
        """The replica's events for one request; records TTFT and inter-token latency, and on any exit (done,
        error, client gone, deadline) cancels the replica-side generator and drops the reservation."""
        payload = {"request_id": request_id, "prompt_token_ids": prepared.prompt_token_ids,
                   "params": prepared.params, "gpu_bytes": gpu, "host_bytes": host, "affinity": prepared.affinity}
        stream = self.stream_engine.generate.remote(payload)
        last, finished = None, False
        try:
            async for event in until_deadline(stream, arrived + self.limits.request_timeout_s):
                now, count = time.monotonic(), event.get("num_new_tokens", 0)
                if count:
                    self.metrics.record_tokens(count, now - (last or arrived), first=last is None)
                    last = now
                finished = "error" in event or event["finished"]
                if "error" not in event and event["finished"]:
                    self.metrics.record_end(event["finish_reason"], event["prompt_tokens"], now - arrived)
                yield event
        except TimeoutError:
            yield timed_out(self.limits.request_timeout_s)
        except BackPressureError:
            finished = True
            yield error_event(429, "the engine replicas' queues are full; retry later", type="rate_limit_error",
                              code="rate_limit_exceeded")
        except (RayServeException, RayActorError) as exc:  # the replica died or became unreachable mid-request
            logger.warning("request %s failed in the engine replica: %r", request_id, exc)
            finished = True
            yield error_event(503, "the engine replica serving this request failed; retry", type="server_error",
                              code="replica_failed")
        finally:
            if not finished:
                stream.cancel()
                self.metrics.record_end("abort", len(prepared.prompt_token_ids), time.monotonic() - arrived)
            self.gate.release(request_id)

    async def _first_event(self, events: AsyncIterator[dict]) -> dict:
        """Wait for the first event so that a refusal by the replica gets its own HTTP status, even when streaming."""
        try:
            first = await anext(events)
            raise_if_error(first)
            return first
        except BaseException:
            await events.aclose()
            raise

    # ---- readiness -------------------------------------------------------------------------------------------
    async def _require_ready(self) -> None:
        if self.info is None:
            if self._info_task is None or self._info_task.done():
                self._info_task = asyncio.get_running_loop().create_task(self._load_info())
            await asyncio.wait([self._info_task], timeout=MODEL_INFO_TIMEOUT_S)
        if self.info is None:
            raise not_ready("no engine replica has answered yet")
        if self.board.num_replicas() == 0:
            raise not_ready("no engine replica has reported its capacity yet")

    async def _load_info(self) -> None:
        try:
            info = await self.engine.model_info.remote()
        except Exception:
            logger.exception("could not get the model's info from an engine replica")
            return
        self.footprint = info["footprint"]
        self.metrics.model_name = info["model"]
        self.served_since = int(time.time())  # the model card's `created`: one time for every listing of it
        self.info = info

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.info["model"], created=self.served_since, max_model_len=self.info["max_model_len"],
                         **self.weights)

    def _check_model(self, model: str | None) -> None:
        """The served model, or none named (only /tokenize and /detokenize may leave it out)."""
        if model is not None and model != self.info["model"]:
            raise OpenAIError(404, f"The model {model!r} does not exist; this service serves "
                                   f"{self.info['model']!r}.", param="model", code="model_not_found")
