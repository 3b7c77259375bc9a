"""Greedy sampling's C argmax (csrc/argmax.c) against torch.argmax, and the engine reading bf16 logits with it."""

from __future__ import annotations

import pytest
import torch

from forerun import LLM, SamplingParams
from forerun.kernels.build import load_native_library
from forerun.kernels.ops import NativeOps
from forerun.loader.model_source import cache_dir

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    lib = load_native_library(cache_dir() / "kernels")  # one build, shared with the engine's
    assert lib is not None, "gcc is on every machine of this project: the kernel must build"
    return NativeOps(lib)


def _want(x: torch.Tensor) -> torch.Tensor:
    return x.float().argmax(dim=-1)


# Widths below one vector, between the vector loop's steps and with a scalar tail; 64 x 32000 runs
# on all threads.
@pytest.mark.parametrize("rows,width", [(1, 1), (3, 7), (2, 31), (5, 32), (4, 33), (3, 100), (64, 32000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_rows_match_torch(ops, dtype, rows, width):
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    assert torch.equal(ops.argmax_rows(x), _want(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_lowest_index(ops, dtype):
    # Four values only: every row's maximum repeats in many lanes, chains and the tail.
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, (50, 203), generator=gen).to(dtype)
    assert torch.equal(ops.argmax_rows(x), _want(x))
    y = torch.full((3, 70), -5.0, dtype=dtype)
    y[0, [69, 40, 17]] = 2.0  # the last lane of the tail, a later chain, an earlier lane
    y[1, [64, 65, 33]] = 2.0
    y[2, [1, 0]] = 2.0
    assert ops.argmax_rows(y).tolist() == [17, 33, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zeros_are_equal_and_infinities_order(ops, dtype):
    x = torch.zeros(3, 50, dtype=dtype)
    x[0, :] = -0.0
    x[0, 20] = 0.0  # +0 == -0: index 0 stays first
    x[1, :] = float("-inf")
    x[1, 45] = -1e30
    x[2, :] = float("-inf")  # all -inf: the first
    x[2, 10] = float("inf")
    x[2, 40] = float("inf")
    assert ops.argmax_rows(x).tolist() == [0, 45, 10] == _want(x).tolist()


@pytest.mark.parametrize("width", [5, 64, 77])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_first_nan_counts_as_the_largest(ops, dtype, width):
    x = torch.randn(width, width, generator=torch.Generator().manual_seed(2)).to(dtype)
    for r in range(width):
        if r % 3:
            x[r, r] = float("nan")
            x[r, (r * 7) % width] = float("nan")
    x[0, width - 1] = 1e30  # no NaN in row 0
    got = ops.argmax_rows(x)
    assert torch.equal(got, _want(x))
    assert got[1].item() == 1 and got[0].item() == width - 1


def test_inputs_it_does_not_take_give_none(ops):
    x = torch.randn(4, 40)
    assert ops.argmax_rows(x.half()) is None
    assert ops.argmax_rows(x.t()) is None  # not contiguous
    assert ops.argmax_rows(x[0]) is None  # one dimension
    assert ops.argmax_rows(torch.empty(0, 40)).shape == (0,)


def test_a_bf16_engine_takes_greedy_tokens_from_bf16_logits(tiny_llama_dir, monkeypatch):
    """The runner hands greedy rows the LM head's bf16 logits (no float32 copy); the tokens are those of
    the float32 copy's argmax."""
    seen: list[torch.dtype] = []
    native_argmax = NativeOps.argmax_rows

    def spy(self, logits):
        seen.append(logits.dtype)
        return native_argmax(self, logits)

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[7, 8, 9] * 5, [300, 301], list(range(500, 540))]
    outs = []
    for argmax in (spy, lambda self, logits: None):  # None: the runner's float32 copy and NumPy
        monkeypatch.setattr(NativeOps, "argmax_rows", argmax)
        # gemv_max_rows=0: where the probe sends small steps to the compact GEMV (AVX2-only CPUs), its
        # LM head gives fp32 logits, and no step would hand the argmax bf16 ones.
        with LLM(model=str(tiny_llama_dir), dtype="bfloat16", block_size=4, gemv_max_rows=0,
                 show_progress=False) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert torch.bfloat16 in seen
    assert outs[0] == outs[1]
