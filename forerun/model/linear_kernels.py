"""Ways to run y = x W^T + b on the CPU, chosen per machine by measurement (see forerun.worker.cpu_probe).

`aten` is plain `F.linear`. `mkldnn` prepacks the weight once into the blocked layout oneDNN's GEMM
wants (what inductor's `freezing` does), which saves the per-call reorder: on some CPUs that is worth
2x on wide matrices such as the LM head, on others nothing. (MKL's packed GEMM is left out: it only
helps at the exact batch size it was packed for.) `available_kernels` says which kernels this torch
build, CPU and dtype can use.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

LinearFn = Callable[[Tensor], Tensor]
KERNELS = ("aten", "mkldnn")


def available_kernels(dtype: torch.dtype, device: torch.device) -> list[str]:
    """Kernels that run on this device and dtype in this torch build (always includes 'aten')."""
    if device.type != "cpu":
        return ["aten"]
    found = ["aten"]
    w = torch.zeros(8, 8, dtype=dtype)
    for name in KERNELS[1:]:
        try:
            make_linear(w, None, name, 4)(torch.zeros(2, 8, dtype=dtype))
            found.append(name)
        except (RuntimeError, AttributeError, NotImplementedError):
            continue  # this build or CPU lacks it (e.g. bf16 oneDNN needs avx512bw or avx_ne_convert)
    return found


def make_linear(weight: Tensor, bias: Tensor | None, kernel: str, batch_hint: int) -> LinearFn:
    """A function x -> x W^T + b using `kernel`; the prepacked weight lives in its closure."""
    if kernel == "aten":
        return lambda x: F.linear(x, weight, bias)
    if kernel == "mkldnn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    raise ValueError(f"linear_kernel: unknown kernel {kernel!r}; expected one of {KERNELS}")


def split_by_rows(small: LinearFn, large: LinearFn, max_rows: int) -> LinearFn:
    """`small` for inputs of at most `max_rows` rows (memory-bound), `large` above (compute-bound)."""
    return lambda x: small(x) if x.shape[0] <= max_rows else large(x)
