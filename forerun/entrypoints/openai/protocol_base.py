"""The two kinds of body model every OpenAI route uses: what a client sends, and what it gets back."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    """A response body (or part of one)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, protected_namespaces=())


class RequestModel(OpenAIModel):
    """A request body (or part of one). Unknown fields are refused (400 naming the field), never
    dropped: a field a client sends is one it expects to act, and forerun cannot honour one it does
    not know."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())
