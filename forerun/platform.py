"""The one switch for device-specific choices (CPU here, CUDA where a user has one)."""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def cpu_signature() -> str:
    """CPU model name plus a hash of its feature flags: two 'AMD EPYC' machines may differ in AVX-512."""
    name, flags = "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    return f"{name}/{hashlib.sha1(flags.encode()).hexdigest()[:10]}"
