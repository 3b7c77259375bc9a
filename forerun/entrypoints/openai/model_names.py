"""The names clients may use for the served model, and the short id /v1/models shows.

Without --served-model-name the id is a short name made from the model's file or folder: the cache
folder `SmolLM2-135M-Instruct.Q4_1-645408bf4862` is served as `SmolLM2-135M-Instruct`, and a model in
`.../all_minilm/model` as `all_minilm`. The longer spellings (the folder's name, its path, what was
passed to --model) stay accepted, so a client that copied any of them still works.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path

from forerun.entrypoints.openai.errors import APIError

# forerun's cache folder of a converted GGUF ends with `-` and 12 hex digits of its cache key.
_CACHE_HASH = re.compile(r"-[0-9a-f]{12}$")
# A GGUF's quantization tag at the end of its stem: .Q4_1, -Q4_K_M, .IQ3_XS, .f16, .BF16 ...
_QUANT_TAG = re.compile(r"[.-](?:i?q\d[a-z0-9_]*|f16|f32|bf16|fp16|fp32)$", re.IGNORECASE)
# Folder names that say nothing about the model: the name is taken from the folder above.
_GENERIC_FOLDERS = frozenset({"model", "models", "weights", "checkpoint", "checkpoints", "hf", "snapshot"})
_HF_SNAPSHOT = re.compile(r"^[0-9a-f]{40}$")
_MAX_LISTED = 8  # names a 404 message lists; paths make the rest long and they add nothing


def short_model_id(folder: Path) -> str:
    """The model's short name from its folder (see the module docstring)."""
    folder = Path(folder)
    name = folder.name
    # A Hugging Face hub cache: models--org--name/snapshots/<40 hex digits>.
    if _HF_SNAPSHOT.match(name) and folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name[len("models--"):].replace("--", "/")
    if name.lower() in _GENERIC_FOLDERS and folder.parent.name:
        name = folder.parent.name
    stem = _CACHE_HASH.sub("", name)
    if stem.lower().endswith(".gguf"):
        stem = stem[:-len(".gguf")]
    return _QUANT_TAG.sub("", stem) or name


class ServedModelNames:
    """Which `model` values a request may carry.

    Invariant: `primary` is in `listed`, and `listed` is within `accepted`. Responses and metrics name
    `primary`; /v1/models lists `listed`; a request naming anything outside `accepted` gets a 404 that
    lists the accepted names.
    """

    def __init__(self, listed: list[str], aliases: Sequence[str] = ()) -> None:
        if not listed:
            raise ValueError("served_model_name: at least one name is needed")
        for name in listed:
            if not name or not name.strip():
                raise ValueError(f"served_model_name: names must not be empty, got {name!r}")
        self.listed = list(dict.fromkeys(listed))
        self.primary = self.listed[0]
        self.accepted = list(dict.fromkeys([*self.listed, *(a for a in aliases if a)]))
        self._accepted = frozenset(self.accepted)

    @classmethod
    def for_model(cls, served: list[str] | None, model_arg: str | None, folder: Path,
                  default_names: frozenset[str] = frozenset()) -> "ServedModelNames":
        """The names given with --served-model-name (only those, as the operator chose them), else the
        short id plus every other spelling of the same model (`default_names`: those of the default
        model, when --model named it or was not given)."""
        if served:
            return cls(list(served))
        aliases = [folder.name]
        if model_arg is None or model_arg in default_names:
            aliases.extend(sorted(default_names))
        if model_arg:
            aliases.append(model_arg)
        aliases.append(str(folder))  # last: a path is the longest and least likely spelling
        return cls([short_model_id(folder)], aliases)

    def check(self, name: str | None) -> None:
        """A 404 naming the accepted names when `name` is not one of them (no name means the primary)."""
        if name is None or name in self._accepted:
            return
        shown = ", ".join(f"`{n}`" for n in self.accepted[:_MAX_LISTED])
        raise APIError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist. This server serves: {shown}.",
                       "invalid_request_error", param="model", code="model_not_found")
