"""`load_format="dummy"`: random weights of the model's shapes, for a trainer that pushes its own
weights with `load_weights` right after start (no checkpoint is read)."""

from __future__ import annotations

import torch
from torch import nn

DUMMY_RANGE = 1e-3  # as vLLM: uniform in [-1e-3, 1e-3], small enough that no activation overflows


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter (this rank's shards) from a seeded generator, then count the model as loaded,
    so that later `load_weights` calls update it in place."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            values = torch.empty(param.shape, dtype=torch.float32).uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
            param.copy_(values)
    model.weights_loaded = True
