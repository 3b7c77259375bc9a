"""The KV cache is allocated as untouched zero pages in every CPU dtype: a large cache costs no resident
memory until its blocks are used."""

from __future__ import annotations

import pytest
import torch

from forerun.worker.worker import _zeros


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_kv_cache_takes_no_memory_until_used(dtype: torch.dtype) -> None:
    before = _resident_mb()
    cache = _zeros((2, 4096, 16, 8, 256), dtype, torch.device("cpu"))  # 512 MiB in fp32, 256 in 16-bit types
    grown = _resident_mb() - before
    assert cache.dtype == dtype and cache.shape == (2, 4096, 16, 8, 256)
    assert grown < 16, f"allocating the cache made {grown:.0f} MiB resident"
    assert cache[1, 4095].abs().sum().item() == 0 and cache[0, 0, 0, 0, 0].item() == 0.0
    cache[0, :64].fill_(1.0)  # using blocks makes exactly those pages resident
    assert _resident_mb() - before >= cache[0, :64].numel() * cache.element_size() / 2**20 * 0.9


def test_a_used_block_makes_only_its_own_pages_resident() -> None:
    """A request's first tokens touch one block of K and one of V a layer. With huge pages (numpy asks for
    them on large arrays) each touch made 2 MiB resident, 30 layers of SmolLM2 ~135 MB for a few tokens."""
    cache = _zeros((2, 4096, 16, 4, 64), torch.float32, torch.device("cpu"))  # 128 MiB; a block is 16 KiB
    before = _resident_mb()
    for block in (0, 1000, 2000, 3000):
        cache[0, block].fill_(1.0)
        cache[1, block].fill_(1.0)
    grown = _resident_mb() - before
    assert cache[0, 1000].sum().item() == 16 * 4 * 64
    assert grown < 1.0, f"8 blocks of 16 KiB made {grown:.1f} MiB resident"


def test_an_empty_cache_is_allowed() -> None:
    """A cache of no blocks is an empty tensor, not an error."""
    cache = _zeros((2, 0, 16, 4, 64), torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (2, 0, 16, 4, 64) and cache.dtype == torch.bfloat16
