"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM, run by uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from http import HTTPStatus
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from forerun.engine.async_llm import AsyncLLM, EngineDeadError
from forerun.entrypoints.engine_args import engine_config_from_args
from forerun.entrypoints.openai.errors import APIError, error_response, install_error_handlers
from forerun.entrypoints.openai.metrics import ServerMetrics
from forerun.entrypoints.openai.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from forerun.entrypoints.openai.model_names import ServedModelNames
from forerun.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from forerun.entrypoints.openai.serving_chat import OpenAIServingChat
from forerun.entrypoints.openai.serving_completions import OpenAIServingCompletion
from forerun.entrypoints.openai.serving_embeddings import EmbeddingRequest, OpenAIServingEmbedding
from forerun.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponsesRequest
from forerun.entrypoints.openai.serving_tokenization import (DetokenizeRequest, DetokenizeResponse,
                                                             OpenAIServingTokenization, TokenizeRequest,
                                                             TokenizeResponse)
from forerun.entrypoints.openai.tool_request import ChatParsing
from forerun.heap import return_free_heap
from forerun.loader.model_source import DEFAULT_MODEL_NAMES

logger = logging.getLogger(__name__)


DEFAULT_MAX_BODY_BYTES = 32 * 2**20


def build_app(engine: AsyncLLM, names: ServedModelNames | str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, parsing: ChatParsing | None = None) -> FastAPI:
    """An app serving `engine` under `names` (one name, or a ServedModelNames with its aliases).

    The app owns the engine's life: its startup starts the output reader, its shutdown stops the core
    process. With `api_key`, every route but /health needs `Authorization: Bearer <api_key>` (a liveness
    probe carries no key; /metrics and /docs would tell a stranger what runs here). A body over
    `max_body_bytes` is refused (413) before any route reads it. `parsing` holds the tool-call and
    reasoning parsers chat responses are read with.
    """
    if isinstance(names, str):
        names = ServedModelNames([names])
    metrics = ServerMetrics(names.primary)
    completions = OpenAIServingCompletion(engine, names, metrics)
    chat = OpenAIServingChat(engine, names, metrics, parsing)
    embeddings = OpenAIServingEmbedding(engine, names, metrics)
    tokenization = OpenAIServingTokenization(chat)
    responses = OpenAIServingResponses(chat)

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

    # Added last runs first: the key is checked before a stranger's body is even read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

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
        return ModelList(data=[ModelCard(id=name, root=str(engine.model_folder), max_model_len=engine.max_model_len)
                               for name in names.listed])

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        _require_generation(engine)
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        _require_generation(engine)
        return await chat.create(body, raw)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        _require_generation(engine)
        return await responses.create(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(body)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await embeddings.create(body, raw)

    return app


def _require_generation(engine: AsyncLLM) -> None:
    if engine.runner != "generate":
        raise APIError(HTTPStatus.BAD_REQUEST, f"runner: this server runs a {engine.runner} (embedding) model; "
                       "use /v1/embeddings, or serve a generation model for completions",
                       param="model", code="model_not_supported")


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


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address `host` names, as uvicorn would bind them.

    Done before the model loads, so a busy port or a bad host fails in a second with one line, not
    after a minute of loading. Until uvicorn listens on them, connections are refused.
    """
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SystemExit(f"forerun serve: cannot listen on {where}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, address in dict.fromkeys((i[0], i[1], i[2], i[4]) for i in infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise SystemExit(f"forerun serve: cannot listen on {where}: {exc.strerror or exc}") from None
    return sockets


def run_server(args: argparse.Namespace) -> None:
    """Bind the port, start the engine core, then serve until SIGINT/SIGTERM; the core never outlives
    this call."""
    sockets = bind_sockets(args.host, args.port)
    try:
        config = engine_config_from_args(args)
        engine = AsyncLLM(config, show_progress=True)
        try:
            names = ServedModelNames.for_model(args.served_model_name, config.model, engine.model_folder,
                                               DEFAULT_MODEL_NAMES)
            max_body = int(getattr(args, "max_request_body_mb", DEFAULT_MAX_BODY_BYTES / 2**20) * 2**20)
            parsing = ChatParsing(getattr(args, "tool_call_parser", None),
                                  bool(getattr(args, "enable_auto_tool_choice", False)),
                                  getattr(args, "reasoning_parser", None))
            app = build_app(engine, names, args.api_key, max_body_bytes=max_body, parsing=parsing)
            uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                       timeout_graceful_shutdown=10)
            port = sockets[0].getsockname()[1]
            logger.info("serving %s on http://%s:%d", ", ".join(names.listed), args.host, port)
            server = _Server(uv_config, engine)
            return_free_heap()  # FastAPI's route and schema building leaves about 8 MB free but resident
            server.run(sockets=sockets)
        finally:
            engine.shutdown()
    finally:
        for sock in sockets:
            sock.close()
    if server.engine_failed:
        raise SystemExit(f"forerun serve: {server.engine_failed}; exiting with status 1 so a supervisor restarts it")
