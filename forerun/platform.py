"""The one switch for device-specific choices (CPU here, CUDA where a user has one)."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path

import torch


def default_device() -> torch.device:
    """CUDA when available, else CPU. Every device-specific decision reads this."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# How much lower the model's threads run than the engine thread on a CPU (a nice increment).
MODEL_THREAD_NICE = 5


def lower_model_thread_priority() -> None:
    """Called first thing on the in-process worker thread; the OpenMP threads it starts later inherit it.

    On a CPU the model's threads and the engine thread share the cores. At equal priority the OS may
    preempt the engine thread for a spinning OpenMP thread while the engine holds the GIL, and the
    worker, waiting for that GIL, stalls the whole model: about one 55 M run in four was 10-25% slow.
    With the model's threads a step lower the engine thread runs as soon as it wakes, and its short
    bursts end. Measured (55 M, 64 x 128/128, engine run over its forward-only replay, 6 pairs each,
    interleaved): median 0.960 -> 1.007, lowest 0.898 -> 0.957. Linux only (elsewhere a thread id is
    not a valid target); on CUDA the GPU does the work and nothing changes.
    """
    if default_device().type != "cpu" or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:  # relative to the engine thread's value, which the new thread started with
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + MODEL_THREAD_NICE))
    except OSError:
        pass  # not permitted in this sandbox or container: run at the same priority as before


def distributed_backend(device: torch.device) -> str:
    """torch.distributed backend for tensor parallelism on this device."""
    return "nccl" if device.type == "cuda" else "gloo"


def parse_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """Map a `--dtype` value to a torch dtype. `auto` is bf16 on CUDA and None on CPU, where the
    faster of fp32 and bf16 differs between machines and is measured (forerun.kernels.probe)."""
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
