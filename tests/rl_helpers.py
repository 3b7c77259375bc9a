"""What the RL tests share: a trainer's worker extension (importable by worker processes and torchrun
ranks), and checkpoints whose weights differ from a tiny model's the way a training step changes them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Two layers' worth of tensors negated: the "trained" policy of the tests.
CHANGED_LAYERS = (".layers.0.", ".layers.1.mlp.")


class TrainerExtension:
    """A trainer's methods mixed into every worker (worker_extension_cls="rl_helpers.TrainerExtension")."""

    def report_rank(self, tag: str) -> tuple[int, str, int]:
        return self.rank, tag, os.getpid()

    def update_named_param(self, name: str, tensor: torch.Tensor) -> list[str]:
        """TRL's shape of call: one named tensor per RPC."""
        return self.load_weights([(name, tensor)])


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def changed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a training step changed: those of CHANGED_LAYERS, negated."""
    return {k: -v for k, v in weights.items() if any(part in k for part in CHANGED_LAYERS)}


def write_checkpoint(src: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """`src`'s folder (config, tokenizer) with `weights` as its safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out
