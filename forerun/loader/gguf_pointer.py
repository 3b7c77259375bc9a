"""The file that makes a cache folder a GGUF model's description: it names the GGUF whose tensors are the
folder's weights. Kept free of heavy imports: the front end resolves models without torch or gguf."""

from __future__ import annotations

import json
from pathlib import Path

GGUF_POINTER = "gguf.json"


def write_pointer(folder: Path, gguf_path: Path) -> None:
    """Record in `folder` that its weights are `gguf_path`'s tensors."""
    (folder / GGUF_POINTER).write_text(json.dumps({"file": str(gguf_path.resolve())}) + "\n", encoding="utf-8")


def pointed_gguf(folder: Path) -> Path | None:
    """The GGUF file whose tensors are `folder`'s weights, or None for a safetensors folder."""
    pointer = Path(folder) / GGUF_POINTER
    if not pointer.is_file():
        return None
    path = Path(json.loads(pointer.read_text(encoding="utf-8"))["file"])
    if not path.is_file():
        raise ValueError(f"model: the GGUF file {path} that {folder} was made from is gone; remove that folder")
    return path
