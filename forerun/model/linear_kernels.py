"""Ways to run y = x W^T + b on the CPU, chosen per machine by measurement (see forerun.worker.cpu_probe).

`aten` is plain `F.linear`. `mkldnn` prepacks the weight once into the blocked layout oneDNN's GEMM
wants (what inductor's `freezing` does), which saves the per-call reorder: on some CPUs that is worth
2x on wide matrices such as the LM head, on others nothing. `native` is forerun's own fp32 GEMM over
a packed weight (forerun.model.native_gemm), available when the C kernels built. (MKL's packed GEMM
is left out: it only helps at the exact batch size it was packed for.) `available_kernels` says which
kernels this torch build, CPU and dtype can use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from forerun.model.native_gemm import PackedGemm

LinearFn = Callable[[Tensor], Tensor]
KERNELS = ("aten", "mkldnn", "native")


def available_kernels(dtype: torch.dtype, device: torch.device, gemm: PackedGemm | None = None) -> list[str]:
    """Kernels that run on this device and dtype in this torch build (always includes 'aten');
    'native' needs forerun's built C kernels (`gemm`) and fp32."""
    if device.type != "cpu":
        return ["aten"]
    found = ["aten"]
    w = torch.zeros(8, 8, dtype=dtype)
    for name in KERNELS[1:]:
        if name == "native" and (gemm is None or dtype != torch.float32):
            continue
        try:
            make_linear(w, None, name, 4, gemm)(torch.zeros(2, 8, dtype=dtype))
            found.append(name)
        except (RuntimeError, AttributeError, NotImplementedError):
            continue  # this build or CPU lacks it (e.g. bf16 oneDNN needs avx512bw or avx_ne_convert)
    return found


def make_linear(weight: Tensor, bias: Tensor | None, kernel: str, batch_hint: int,
                gemm: PackedGemm | None = None) -> LinearFn:
    """A function x -> x W^T + b using `kernel`; the prepacked weight lives in its closure."""
    if kernel == "aten":
        return lambda x: F.linear(x, weight, bias)
    if kernel == "mkldnn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if kernel == "native":
        if gemm is None:
            raise ValueError("linear_kernel: 'native' needs forerun's C kernels (native_kernels on, a C compiler)")
        return gemm.linear(weight, bias)
    raise ValueError(f"linear_kernel: unknown kernel {kernel!r}; expected one of {KERNELS}")


def split_by_rows(small: LinearFn, large: LinearFn, max_rows: int) -> LinearFn:
    """`small` for inputs of at most `max_rows` rows (memory-bound), `large` above (compute-bound)."""
    return lambda x: small(x) if x.shape[0] <= max_rows else large(x)
