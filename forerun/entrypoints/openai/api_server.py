"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM, run by uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
from http import HTTPStatus
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from forerun.engine.async_llm import AsyncLLM, EngineDeadError
from forerun.entrypoints.engine_args import engine_config_from_args
from forerun.entrypoints.openai.errors import APIError, error_body, error_response, install_error_handlers
from forerun.entrypoints.openai.metrics import ServerMetrics
from forerun.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from forerun.entrypoints.openai.serving_chat import OpenAIServingChat
from forerun.entrypoints.openai.serving_completions import OpenAIServingCompletion
from forerun.entrypoints.openai.serving_embeddings import EmbeddingRequest, OpenAIServingEmbedding

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLM, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """An app serving `engine` under `served_model_name`.

    The app owns the engine's life: its startup starts the output reader, its shutdown stops the core
    process. With `api_key`, every route but /health needs `Authorization: Bearer <api_key>` (a liveness
    probe carries no key; /metrics and /docs would tell a stranger what runs here).
    """
    metrics = ServerMetrics(served_model_name)
    completions = OpenAIServingCompletion(engine, served_model_name, metrics)
    chat = OpenAIServingChat(engine, served_model_name, metrics)
    embeddings = OpenAIServingEmbedding(engine, served_model_name, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="forerun", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)

    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return error_response(EngineDeadError(engine.dead_reason or "engine is down"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        if not engine.is_dead:
            metrics.update_engine(await engine.fetch_stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, root=str(engine.model_folder),
                                         max_model_len=engine.max_model_len)])

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        _require_generation(engine)
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        _require_generation(engine)
        return await chat.create(body, raw)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await embeddings.create(body, raw)

    return app


def _require_generation(engine: AsyncLLM) -> None:
    if engine.runner != "generate":
        raise APIError(HTTPStatus.BAD_REQUEST, f"runner: this server runs a {engine.runner} (embedding) model; "
                       "use /v1/embeddings, or serve a generation model for completions",
                       param="model", code="model_not_supported")


_OPEN_PATHS = frozenset({"/health"})  # reachable without the API key


class _ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streaming responses and disconnects pass through untouched.

    Unknown paths are refused too (401, not 404), so a stranger cannot map the routes.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(error_body("Incorrect API key provided.", "invalid_request_error",
                                                   code="invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


ENGINE_DEAD_EXIT_DELAY_S = 3.0  # /health answers 503 this long before the server exits, so probes see why
_WATCH_INTERVAL_S = 0.2


class _Server(uvicorn.Server):
    """On the first SIGINT/SIGTERM, also end every in-flight request so connections drain at once.

    When the engine dies under it (core crash, killed worker) the server cannot recover: after a short
    delay it shuts down and `engine_failed` is set, so `run_server` exits non-zero and a supervisor
    restarts it. Pending requests have already ended with an error by then.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine_failed: str | None = None

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self.loop = asyncio.get_running_loop()
        watchdog = self.loop.create_task(self._watch_engine(), name="forerun-engine-watchdog")
        try:
            await super().serve(sockets)
        finally:
            watchdog.cancel()

    async def _watch_engine(self) -> None:
        while not self.should_exit:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            # A dead engine after a shutdown signal is the plan; before one, it is a failure.
            if self.engine.is_dead and not self.should_exit:
                self.engine_failed = self.engine.dead_reason or "engine is down"
                logger.error("%s; the server exits in %.0f s", self.engine_failed, ENGINE_DEAD_EXIT_DELAY_S)
                await asyncio.sleep(ENGINE_DEAD_EXIT_DELAY_S)
                self.should_exit = True
                return

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.loop is not None:
            self.loop.call_soon_threadsafe(self.engine.abort_all, "server is shutting down")


def run_server(args: argparse.Namespace) -> None:
    """Start the engine core, then serve until SIGINT/SIGTERM; the core never outlives this call."""
    config = engine_config_from_args(args)
    engine = AsyncLLM(config, show_progress=True)
    try:
        name = args.served_model_name or config.model or engine.model_folder.name
        app = build_app(engine, name, args.api_key)
        uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                   timeout_graceful_shutdown=10)
        logger.info("serving %s on http://%s:%d", name, args.host, args.port)
        server = _Server(uv_config, engine)
        server.run()
    finally:
        engine.shutdown()
    if server.engine_failed:
        raise SystemExit(f"forerun serve: {server.engine_failed}; exiting with status 1 so a supervisor restarts it")
