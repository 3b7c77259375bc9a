"""A GGUF file's own quantized blocks, saved beside the converted fp32 model and read back at load.

The blocks are kept as forerun.kernels.compact_weights.CompactWeight rows; the model checks each one
expands exactly to its loaded weight before a kernel reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from forerun.kernels.compact_weights import FORMATS, CompactWeight

BLOCKS_FILE = Path("gguf-blocks") / "blocks.safetensors"


def save_gguf_blocks(out_dir: Path, blocks: dict[str, tuple[str, Tensor, int]]) -> None:
    """Write {hf_name: (format, uint8 rows, k)} beside a converted model."""
    path = out_dir / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {name: json.dumps([fmt, k]) for name, (fmt, _, k) in blocks.items()}
    save_file({name: rows.contiguous() for name, (_, rows, _) in blocks.items()}, str(path), metadata=meta)


def load_gguf_blocks(folder: Path) -> dict[str, CompactWeight]:
    """The blocks saved beside a converted GGUF model ({} for any other folder)."""
    path = Path(folder) / BLOCKS_FILE
    if not path.is_file():
        return {}
    out = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        for name in f.keys():
            fmt, k = json.loads(meta[name])
            if fmt in FORMATS:
                out[name] = CompactWeight(fmt, f.get_tensor(name), int(k))
    return out
