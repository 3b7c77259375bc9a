"""POST /v1/embeddings: one pooled vector per input, as floats or base64 float32, in OpenAI's format."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import (StrictInt, StrictStr, ValidationError, ValidatorFunctionWrapHandler,
                      field_validator)
from pydantic_core import PydanticCustomError

from forerun.engine.input_processor import Prompt
from forerun.entrypoints.openai.errors import APIError
from forerun.entrypoints.openai.protocol_base import OpenAIModel, RequestModel, random_id
from forerun.entrypoints.openai.serving_base import ClientDisconnected, ServingBase, run_until_disconnect
from forerun.outputs import EmbeddingOutput

MAX_INPUTS = 2048  # OpenAI's limit on the number of inputs in one request


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings body. Strict types: `true` is not a token id and `"1"` is not one either.
    Unknown fields (vLLM's truncate_prompt_tokens, normalize, ...) are refused, naming the field."""

    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_clear_type_error(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # Without this a wrong type reports the first union branch it failed ("input.str: ...").
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("input_type", "expected a string, a list of strings, a list of token ids "
                                      "or a list of token-id lists") from None

    def prompts(self) -> list[Prompt]:
        """The inputs as engine prompts; ValueError naming `input` for an empty or oversized list."""
        inp = self.input
        if isinstance(inp, str):
            return [inp]
        if not inp:
            raise ValueError("input: must not be an empty list")
        if all(isinstance(t, int) for t in inp):
            return [list(inp)]  # type: ignore[arg-type]  # one input given as token ids
        if len(inp) > MAX_INPUTS:
            raise ValueError(f"input: at most {MAX_INPUTS} inputs per request, got {len(inp)}")
        return list(inp)  # type: ignore[arg-type]


class EmbeddingData(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_base64(vector: list[float]) -> str:
    """Little-endian float32 bytes, base64-encoded: what OpenAI sends and its client decodes.

    struct rather than numpy: importing numpy would add 15 MB to the front end's resident memory."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embedding_dim(folder: Path) -> int | None:
    """The model's output width (its hidden size), or None when config.json does not say."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dim = cfg.get("hidden_size")
    return dim if isinstance(dim, int) else None


class OpenAIServingEmbedding(ServingBase):
    """Item `i` of `data` is the vector of input `i`.

    Invariant: a request whose inputs are not all embedded (bad input, disconnect, engine error)
    leaves nothing running in the engine: every input still in flight is cancelled, which aborts it.
    """

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.dim = embedding_dim(self.engine.model_folder)

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        self.check_request(req)
        if self.engine.runner != "pooling":
            raise APIError(HTTPStatus.BAD_REQUEST, "runner: this server runs a generation model; embeddings "
                           "need a model served with --runner pooling", param="model", code="model_not_supported")
        self._check_dimensions(req.dimensions, self.dim)
        prompts = await self._tokenize(req.prompts())
        rid = random_id("embd")
        try:
            outs = await run_until_disconnect(raw, self._embed_all(prompts, rid))
        except ClientDisconnected:
            return Response(status_code=499)
        if self.dim is None:
            self._check_dimensions(req.dimensions, len(outs[0].embedding))
        data = [EmbeddingData(index=i, embedding=encode_base64(o.embedding) if req.encoding_format == "base64"
                              else o.embedding) for i, o in enumerate(outs)]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        body = EmbeddingResponse(id=rid, created=int(time.time()), model=self.model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
        return JSONResponse(body.model_dump())

    async def _tokenize(self, prompts: list[Prompt]) -> list[Prompt]:
        """Text inputs as token ids: size-checked, then tokenized in one batch on a worker thread."""
        texts: list[str] = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise ValueError("input: must not be empty")
                self.limit.check("input", len(p))
                texts.append(p)
        encoded = iter(await self.limit.encode(texts) if texts else [])
        return [next(encoded) if isinstance(p, str) else p for p in prompts]

    @staticmethod
    def _check_dimensions(dimensions: int | None, dim: int | None) -> None:
        # The vectors cannot be shortened (no Matryoshka training), so only the full width is honoured.
        if dimensions is not None and dimensions != dim:
            raise APIError(HTTPStatus.BAD_REQUEST, f"dimensions: this model cannot truncate its embeddings; "
                           f"omit `dimensions` or pass {dim}", param="dimensions")

    async def _embed_all(self, prompts: list[Prompt], rid: str) -> list[EmbeddingOutput]:
        tasks = [asyncio.ensure_future(self._embed_one(p, f"{rid}-{i}")) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # after a failure (or cancel), stop the siblings: each aborts its request
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _embed_one(self, prompt: Prompt, request_id: str) -> EmbeddingOutput:
        t0 = time.monotonic()
        try:
            out = await self.engine.embed(prompt, request_id)
        except ValueError as exc:
            # The engine names the field `prompt`; in this API the client's field is `input`.
            msg = str(exc)
            raise ValueError("input:" + msg[len("prompt:"):] if msg.startswith("prompt:") else msg) from None
        self.metrics.observe_request("stop", len(out.prompt_token_ids), 0, None, time.monotonic() - t0)
        return out
