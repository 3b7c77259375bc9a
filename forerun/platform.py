"""The one switch for device-specific choices (CPU here, CUDA where a user has one)."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """CUDA when available, else CPU. Every device-specific decision reads this."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def distributed_backend(device: torch.device) -> str:
    """torch.distributed backend for tensor parallelism on this device."""
    return "nccl" if device.type == "cuda" else "gloo"


def parse_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """Map a `--dtype` value to a torch dtype. `auto` is bf16 on CUDA and None on CPU, where the
    faster of fp32 and bf16 differs between machines and is measured (forerun.worker.cpu_probe)."""
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if name not in table:
        raise ValueError(f"dtype: unknown value {name!r}; expected auto or one of {sorted(table)}")
    return table[name]
