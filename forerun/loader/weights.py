"""Read the tensors of a Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from safetensors import safe_open
from torch import Tensor


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
