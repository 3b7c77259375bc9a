"""Read the tensors of a model folder: its safetensors, or the GGUF file it describes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from safetensors import safe_open
from torch import Tensor

from forerun.kernels.compact_weights import CompactWeight
from forerun.loader.gguf_pointer import pointed_gguf
from forerun.loader.gguf_weights import iter_gguf_weights, main_quant_format


def iter_safetensors(folder: Path) -> Iterator[tuple[str, Tensor]]:
    """Yield (name, tensor) for every tensor of every `*.safetensors` file in `folder`, files in name order.

    Tensors are read one at a time, so peak memory stays near one tensor above the model itself.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"folder: no *.safetensors files in {folder}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_model_weights(folder: Path) -> Iterator[tuple[str, Tensor | CompactWeight]]:
    """The folder's weights by Hugging Face name: a GGUF-described folder's quantized matrices as their
    blocks (forerun.loader.gguf_weights), everything else as tensors."""
    gguf = pointed_gguf(folder)
    if gguf is None:
        return iter_safetensors(folder)
    return iter_gguf_weights(gguf, json.loads((Path(folder) / "config.json").read_text()))


def is_gguf_folder(folder: Path) -> bool:
    """Whether the folder's weights come from a GGUF file (quantized matrices stay in their blocks)."""
    return pointed_gguf(folder) is not None


def gguf_quant_format(folder: Path) -> str | None:
    """The main quantized format of the folder's GGUF file (gguf_weights.main_quant_format), or None for
    a folder of other weights or a GGUF file of float matrices only."""
    path = pointed_gguf(folder)
    return None if path is None else main_quant_format(path)
