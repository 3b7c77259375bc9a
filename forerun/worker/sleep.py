"""Sleep mode (vLLM's meaning): give the KV cache's memory, and at level 2 the weights', back to the OS
between rollouts, so a trainer sharing the machine can use it; `wake_up` makes it usable again.

On CPU the pages are returned with madvise(MADV_DONTNEED): resident memory drops at once, while the
tensors keep their addresses, so nothing that holds a pointer into them (the C kernels' structures)
goes stale. Anonymous pages then read as zeros when touched again (a fresh KV cache is zeros too); a
memory-mapped file's pages are read back from the file. This is what vLLM's CUDA allocator does with
physical memory under fixed virtual addresses. On CUDA a storage is freed (resized to 0) and allocated
again on wake-up; level 1 first copies the weights to the CPU and back.

Level 1 frees the KV cache (its contents are lost: the engine resets the prefix cache). Level 2 also
frees the weights; they come back with `load_weights` after `wake_up`. The kernels' copies of the
weights (packed, compact, the one-call step) are dropped at level 2 and rebuilt by `load_weights`.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
from typing import Iterable

import torch
from torch import Tensor, nn

from forerun.heap import libc, return_free_heap
from forerun.model.layers import PackableLinear
from forerun.worker.zero_pages import zeros_tensor

MADV_DONTNEED = 4
TAGS = ("weights", "kv_cache")


class SleepState:
    """Which memory of one rank sleeps. Invariant: a tag is in `asleep` from `sleep` until `wake_up`
    names it; while "weights" sleeps no weight is written, while either sleeps no step runs."""

    def __init__(self) -> None:
        self.asleep: set[str] = set()
        self.level = 0
        # CUDA: per tag, each freed tensor with its byte size and its CPU copy (None: contents dropped).
        self._offloaded: dict[str, list[tuple[Tensor, int, Tensor | None]]] = {tag: [] for tag in TAGS}

    def check_awake(self, what: str, tag: str) -> None:
        if tag in self.asleep:
            raise ValueError(f"{what}: the engine's {tag} are asleep (sleep(level={self.level})); call "
                             f"wake_up(tags=['{tag}']) first")

    def sleep(self, level: int, model: nn.Module, kv_caches: list[Tensor], holds_blocks: bool) -> int:
        """Free the KV cache, and the weights at level 2; returns the bytes given back."""
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise ValueError(f"sleep: already asleep (level {self.level}); call wake_up() first")
        if level == 2 and holds_blocks:
            raise ValueError("sleep: level 2 discards the weights and load_weights cannot restore a GGUF file's "
                             "quantized blocks; use level=1 for this model")
        freed = sum(self._release(t, "kv_cache", keep=False) for t in _unique(kv_caches))
        if level == 2:
            drop_kernel_copies(model)
        on_cuda = any(p.is_cuda for p in model.parameters())
        if level == 2 or on_cuda:  # level 1 on CUDA moves the weights to the CPU (vLLM's offload)
            freed += sum(self._release(p.detach(), "weights", keep=level == 1) for p in _unique(model.parameters()))
        return_free_heap()
        self.asleep, self.level = set(TAGS), level
        return freed

    def wake_up(self, tags: list[str] | None, model: nn.Module, kv_caches: list[Tensor]) -> None:
        wanted = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in wanted if t not in TAGS]
        if unknown:
            raise ValueError(f"wake_up: unknown tag {unknown[0]!r}; expected some of {list(TAGS)}")
        if not self.asleep:
            raise ValueError("wake_up: the engine is not asleep (call sleep() first)")
        for tag in wanted:
            if tag not in self.asleep:
                continue
            for t, nbytes, saved in self._offloaded[tag]:  # CPU pages come back by themselves when touched
                t.untyped_storage().resize_(nbytes)
                t.copy_(saved) if saved is not None else t.zero_()
            self._offloaded[tag] = []
            self.asleep.discard(tag)
        if not self.asleep:
            self.level = 0

    def _release(self, t: Tensor, tag: str, keep: bool) -> int:
        storage = t.untyped_storage()
        if t.device.type == "cpu":
            return release_pages(storage)
        nbytes = storage.nbytes()
        self._offloaded[tag].append((t, nbytes, t.to("cpu") if keep else None))
        storage.resize_(0)
        torch.cuda.empty_cache()  # the caching allocator would keep the freed blocks otherwise
        return nbytes


def release_pages(storage: torch.UntypedStorage) -> int:
    """Give the whole pages inside `storage` back to the OS (madvise DONTNEED); returns their bytes.
    The partial pages at either end may hold other allocations' bytes and are left as they are."""
    page = mmap.PAGESIZE
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    start, end = -(-ptr // page) * page, (ptr + nbytes) // page * page
    if end <= start:
        return 0
    if libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
    return end - start


def drop_kernel_copies(model: nn.Module) -> None:
    """Forget what the kernels built from the weights (packed GEMM panels, compact copies, the one-call
    step), so their memory is freed; a layer whose only copy was the packed one gets a dense weight of
    untouched zero pages (no resident memory) for `load_weights` to fill. Each layer then runs plain
    `F.linear` until `load_weights` rebuilds its kernels."""
    if hasattr(model, "decode_layers"):
        model.decode_layers = None
    for module in model.modules():
        if not isinstance(module, PackableLinear) or module.blocks is not None:
            continue
        module._matmul, module.small, module.small_rows = None, None, 0
        if not module.weight.numel() and module.dense_shape is not None:
            # Untouched zero pages: nothing resident until load_weights writes them.
            module.weight = nn.Parameter(zeros_tensor(module.dense_shape, module.weight.dtype), requires_grad=False)
    gc.collect()


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    """One tensor per storage (a tied LM head shares the embedding's)."""
    seen: dict[int, Tensor] = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage().data_ptr(), t)
    return [t for t in seen.values() if t.numel()]
