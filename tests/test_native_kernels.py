"""forerun's C kernels (decode attention, fused norm and activation) against stock PyTorch, and their fallbacks."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from forerun import LLM, SamplingParams
from forerun.model.attention import AttentionMetadata, TorchSDPABackend
from forerun.model.attention import NativeDecodeBackend
from forerun.kernels.build import load_native_library
from forerun.loader.model_source import cache_dir


@pytest.fixture(scope="module")
def native() -> NativeDecodeBackend:
    lib = load_native_library(cache_dir() / "kernels")  # one build, shared with the engine's
    assert lib is not None, "gcc is on every machine of this project: the kernel must build"
    return NativeDecodeBackend(lib)


def _batch(query_lens, seq_lens, heads, kv_heads, dim, dtype, block_size=4, seed=0):
    """A random paged cache with shuffled blocks, one step's q/k/v and its metadata."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = max(-(-s // block_size) for s in seq_lens)
    num_blocks = per_seq * len(seq_lens) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: per_seq * len(seq_lens)].view(len(seq_lens), per_seq)
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size
             for i, (q, s) in enumerate(zip(query_lens, seq_lens)) for p in range(s - q, s)]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables.int(), torch.tensor(slots), block_size)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n, dim, generator=gen).to(dtype) for n in (heads, kv_heads, kv_heads))
    return q, k, v, cache, meta


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 3), (14, 2), (16, 1)])  # groups 1, 4, 3, 7, 16
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_match_stock_attention(native, heads, kv_heads, window, dtype):
    # Mixed step: decode rows of several lengths plus a prefill chunk over a cached prefix.
    query_lens, seq_lens = [1, 1, 6, 1, 1], [1, 9, 11, 17, 4]
    q, k, v, cache, meta = _batch(query_lens, seq_lens, heads, kv_heads, 16, dtype)
    want = TorchSDPABackend().forward(q, k, v, cache.clone(), meta, 0.25, window)
    got = native.forward(q, k, v, cache.clone(), meta, 0.25, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the result's own rounding
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() <= tol


@pytest.mark.parametrize("dim", [24, 64, 96, 128, 160])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (14, 2)])
def test_head_sizes_of_each_value_path_match_stock_attention(native, dim, heads, kv_heads):
    # AVX-512: the values are summed 8 lanes a vector where the head size is not a multiple of 16 (24),
    # else 16, over 64 columns at a time for up to 4 query heads a KV head (9 / 3) and 32 for more
    # (14 / 2). AVX2 (8 lanes): a head of up to 64 in one pass, longer ones 128 columns a pass (160: a
    # pass of 128 and one of 32). Every size takes several vectors a head.
    q, k, v, cache, meta = _batch([1, 1, 3], [7, 40, 21], heads, kv_heads, dim, torch.float32)
    want = TorchSDPABackend().forward(q, k, v, cache.clone(), meta, 0.25, None)
    got = native.forward(q, k, v, cache.clone(), meta, 0.25, None)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rows", [1, 2, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_and_many_decode_rows_match_stock_attention(native, rows, dtype):
    # The kernel splits a few rows by (row, KV head) and many rows by row (all heads at once); at
    # 1 thread and at 4 both splits run.
    seq_lens = [3 + 7 * i for i in range(rows)]
    q, k, v, cache, meta = _batch([1] * rows, seq_lens, 9, 3, 16, dtype)
    want = TorchSDPABackend().forward(q, k, v, cache.clone(), meta, 0.25, None)
    threads = torch.get_num_threads()
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            got = native.forward(q, k, v, cache.clone(), meta, 0.25, None)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert (got.float() - want.float()).abs().max().item() <= tol
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("seq_lens", [[300], [1, 300], [130, 301]])
@pytest.mark.parametrize("window", [None, 100])
def test_long_contexts_of_few_rows_split_into_parts_match_stock_attention(native, seq_lens, window):
    # Fewer (row, KV head) items than two per thread: each context is cut into parts (a 1-token row
    # leaves a part empty) whose partial sums are merged.
    q, k, v, cache, meta = _batch([1] * len(seq_lens), seq_lens, 9, 3, 16, torch.float32, block_size=16)
    want = TorchSDPABackend().forward(q, k, v, cache.clone(), meta, 0.25, window)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            got = native.forward(q, k, v, cache.clone(), meta, 0.25, window)
            assert (got - want).abs().max().item() <= 1e-5
    finally:
        torch.set_num_threads(threads)


def test_decode_rows_of_one_block_next_to_a_longer_row(native):
    # Decode rows needing one block each beside a row needing three: the decode block ids are a
    # one-column slice of the table, which must reach the C kernel as a contiguous buffer.
    query_lens, seq_lens = [3, 1, 1, 1], [11, 2, 3, 4]
    q, k, v, cache, meta = _batch(query_lens, seq_lens, 4, 2, 16, torch.float32)
    want = TorchSDPABackend().forward(q, k, v, cache.clone(), meta, 0.25, None)
    got = native.forward(q, k, v, cache.clone(), meta, 0.25, None)
    assert (got - want).abs().max().item() <= 1e-5


def _reference_decode(q, k, v, cache, meta, scale):
    """Decode-only attention written out per sequence in plain torch (no backend involved)."""
    flat = cache.clone().flatten(1, 2)
    flat[0][meta.slot_mapping] = k
    flat[1][meta.slot_mapping] = v
    group = q.shape[1] // k.shape[1]
    rows = []
    for i, seq_len in enumerate(meta.seq_lens):
        pos = torch.arange(seq_len)
        slots = meta.block_tables[i].long()[pos // meta.block_size] * meta.block_size + pos % meta.block_size
        keys, values = (flat[j][slots].repeat_interleave(group, dim=1) for j in (0, 1))  # [s, heads, dim]
        probs = torch.softmax(torch.einsum("hd,shd->hs", q[i], keys) * scale, dim=-1)
        rows.append(torch.einsum("hs,shd->hd", probs, values).reshape(-1))
    return torch.stack(rows)


def _recording(backend: NativeDecodeBackend) -> list:
    """Wrap the backend's C kernels so each call is recorded (and still runs)."""
    calls: list = []

    def wrap(fn):
        return lambda *args: calls.append(args) or fn(*args)

    backend.attention.kernels = {dtype: wrap(fn) for dtype, fn in backend.attention.kernels.items()}
    return calls


def test_unsupported_shapes_fall_back_to_stock_ops(native):
    backend = NativeDecodeBackend(native.lib)
    calls = _recording(backend)
    # Control: a supported head_dim does reach the C kernel through the recorder.
    q, k, v, cache, meta = _batch([1, 1], [5, 3], 4, 2, 16, torch.float32)
    got = backend.forward(q, k, v, cache.clone(), meta, 0.3, None)
    assert len(calls) == 1, "the recorder must see the C kernel's calls"
    assert (got.reshape(2, -1) - _reference_decode(q, k, v, cache, meta, 0.3)).abs().max().item() <= 1e-5
    calls.clear()
    q, k, v, cache, meta = _batch([1, 1], [5, 3], 4, 2, 12, torch.float32)  # head_dim 12: not a multiple of 8
    got = backend.forward(q, k, v, cache.clone(), meta, 0.3, None)
    assert calls == [], "head_dim 12 must not be handed to the C kernel"
    want = _reference_decode(q, k, v, cache, meta, 0.3)
    assert got.numel() == want.numel()
    assert (got.reshape(want.shape) - want).abs().max().item() <= 1e-5


def test_engine_tokens_match_with_and_without_the_c_kernels(tiny_llama_dir):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[7, 8, 9] * 5, [300, 301], list(range(500, 540))]
    outs = {}
    for native in (False, True):
        with LLM(model=str(tiny_llama_dir), dtype="float32", native_kernels=native, block_size=4,
                 show_progress=False) as llm:
            outs[native] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs[False] == outs[True]
    with pytest.raises(ValueError, match="native_kernels"):
        LLM(model=str(tiny_llama_dir), native_kernels="yes", show_progress=False)


# 5 rows run on one thread, 300 rows on all (forerun.kernels.ops.PARALLEL_MIN_ELEMENTS).
@pytest.mark.parametrize("rows", [5, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_activation_match_torch(native, dtype, rows):
    from forerun.kernels.ops import NativeOps, threads_for
    ops = NativeOps(native.lib)
    gen = torch.Generator().manual_seed(3)
    x, res = (torch.randn(rows, 96, generator=gen).to(dtype) for _ in range(2))
    assert (threads_for(x.numel()) > 1) == (rows == 300 and torch.get_num_threads() > 1)
    weight = torch.rand(96, generator=gen).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    normed, summed = ops.add_rms_norm(x, res, weight, 1e-6)
    want_sum = x + res
    assert torch.equal(summed, want_sum), "the sum is rounded to the dtype as torch rounds it"
    assert (normed.float() - torch.nn.functional.rms_norm(want_sum, (96,), weight, 1e-6).float()).abs().max() <= tol
    alone, same = ops.add_rms_norm(x, None, weight, 1e-6)
    assert same is x and (alone.float() - torch.nn.functional.rms_norm(x, (96,), weight, 1e-6).float()).abs().max() <= tol
    gu = torch.randn(rows, 2 * 40, generator=gen).to(dtype)
    want = torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:]
    # Relative: one bf16 rounding step of a value near 8 is 0.03.
    assert ((ops.silu_mul(gu).float() - want.float()).abs() / want.float().abs().clamp(min=1)).max() <= tol
    assert ops.silu_mul(gu[:, :70]) is None, "a strided view is left to torch"
    assert ops.add_rms_norm(x.t(), None, weight[:5], 1e-6) is None


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("head_dim", [64, 40, 10])  # bf16: 16-lane runs only, runs and a tail, tail only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_the_stock_ops_bit_for_bit(native, tokens, head_dim, dtype):
    from forerun.model.rotary import RotaryEmbedding
    from forerun.kernels.ops import NativeOps
    ops = NativeOps(native.lib)
    rope = RotaryEmbedding(head_dim, 2048, 10000.0).to(dtype)  # a bf16 model's table is bf16
    gen = torch.Generator().manual_seed(tokens)
    heads, kv = 6, 2
    qkv = (torch.randn(tokens, (heads + 2 * kv) * head_dim, generator=gen) * 3).to(dtype)
    cos, sin = rope.cos_sin(torch.randint(0, 2048, (tokens,), generator=gen))
    qk = qkv[:, : (heads + kv) * head_dim]  # strided rows, as inside the packed projection
    want = RotaryEmbedding.apply(qk.reshape(tokens, -1, head_dim), cos, sin)
    got = ops.rotary(qk, cos, sin, head_dim)
    assert got is not None and got.shape == want.shape and got.dtype == dtype and torch.equal(got, want)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert ops.rotary(qk, cos.to(other), sin.to(other), head_dim) is None, "factors of another dtype"
    assert ops.rotary(qk.half(), cos.half(), sin.half(), head_dim) is None, "f16 is left to torch"
    assert ops.rotary(qk[:, 1:], cos, sin, head_dim) is None, "a width that is not whole heads"


@pytest.fixture
def one_small_source(tmp_path, monkeypatch):
    """The build reduced to one small source and header and no kernels to bind, so tests of the build's
    caching and compiler handling take a second instead of compiling every kernel (half a minute)."""
    from forerun.kernels import build as kernel_build
    source, header = tmp_path / "src" / "small.c", tmp_path / "src" / "small.h"
    source.parent.mkdir()
    header.write_text("#define SMALL 1\n")
    source.write_text('#include "small.h"\n'
                      "#ifdef FORERUN_EXPECT_DEFINE\n#ifndef FORERUN_CC_TAKES_ARGUMENTS\n"
                      "#error the flag given in CC did not reach the compiler\n#endif\n#endif\n"
                      "int small(void) { return SMALL; }\n")
    monkeypatch.setattr(kernel_build, "SOURCES", [source])
    monkeypatch.setattr(kernel_build, "HEADERS", [header])
    monkeypatch.setattr(kernel_build, "SIGNATURES", {})
    monkeypatch.setattr(kernel_build, "SIGNATURES_F32", {})
    return kernel_build


def test_a_changed_header_rebuilds_the_library(tmp_path, one_small_source):
    cache = tmp_path / "kernels"
    assert one_small_source.load_native_library(cache) is not None
    first = {p.name for p in cache.glob("*.so")}
    assert one_small_source.load_native_library(cache) is not None
    assert {p.name for p in cache.glob("*.so")} == first, "an unchanged build is reused"
    one_small_source.HEADERS[0].write_text("#define SMALL 2  /* a header the kernels include changed */\n")
    lib = one_small_source.load_native_library(cache)
    assert lib is not None and lib.small() == 2
    assert len({p.name for p in cache.glob("*.so")} - first) == 1, "a stale library must not be reused"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "forerun.kernels.build" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("cc", ["ccache gcc", "/nonexistent/bin/cc", None])
def test_a_missing_compiler_warns_once_and_falls_back(tmp_path, monkeypatch, caplog, cc):
    # An empty PATH: no ccache, cc or gcc to find ("ccache gcc" is a wrapper with an argument).
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    if cc is None:
        monkeypatch.delenv("CC", raising=False)
    else:
        monkeypatch.setenv("CC", cc)
    with caplog.at_level(logging.WARNING):
        assert load_native_library(tmp_path / "kernels") is None
    assert len(_warnings(caplog)) == 1, caplog.text
    assert not list(tmp_path.rglob("*.so")), "nothing was built"


def test_a_cache_folder_that_cannot_be_made_warns_once_and_falls_back(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        assert load_native_library(blocker / "kernels") is None
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(blocker) in warnings[0], caplog.text


def test_cc_with_arguments_is_split_like_a_shell(tmp_path, monkeypatch, caplog, one_small_source):
    gcc = shutil.which("gcc")
    assert gcc is not None, "gcc is on every machine of this project"
    monkeypatch.setattr(one_small_source, "CFLAGS", [*one_small_source.CFLAGS, "-DFORERUN_EXPECT_DEFINE"])
    monkeypatch.setenv("CC", f"{gcc} -DFORERUN_CC_TAKES_ARGUMENTS=1")
    with caplog.at_level(logging.WARNING):
        lib = one_small_source.load_native_library(tmp_path / "kernels")
    assert lib is not None and _warnings(caplog) == []
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1


def test_a_failed_compile_warns_once_and_leaves_nothing(tmp_path, caplog, one_small_source):
    one_small_source.SOURCES[0].write_text("int broken(void) { return }\n")
    with caplog.at_level(logging.WARNING):
        assert one_small_source.load_native_library(tmp_path / "kernels") is None
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "error" in warnings[0], caplog.text
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [], "no library, object or temporary file left"


def test_engine_without_a_usable_compiler_starts_on_stock_ops(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[7, 8, 9] * 5, [300, 301]]
    with LLM(model=str(tiny_llama_dir), dtype="float32", native_kernels=False, show_progress=False) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))  # no library built earlier can be found
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setenv("CC", "ccache gcc")
    with caplog.at_level(logging.WARNING):
        with LLM(model=str(tiny_llama_dir), dtype="float32", show_progress=False) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert len(_warnings(caplog)) == 1, caplog.text



def _copy_row(cache, meta, row, length, into, into_meta) -> None:
    """Row `row`'s first `length` positions of K and V in `cache` into the first row of `into`."""
    pos = torch.arange(length)
    src = meta.block_tables[row].long()[pos // meta.block_size] * meta.block_size + pos % meta.block_size
    size = into_meta.block_size
    dst = into_meta.block_tables[0].long()[pos // size] * size + pos % size
    into.flatten(1, 2)[:, dst] = cache.flatten(1, 2)[:, src]


@pytest.mark.parametrize("window", [None, 200])
def test_batch_invariant_rows_split_by_their_own_length(native, window):
    # Batch-invariant mode cuts a row's context into parts by its length alone (1,000 positions: 8
    # parts; 300: 3), so a row gives the same bits alone, amid other rows and at any thread count, and
    # the merged parts still match stock attention.
    invariant = NativeDecodeBackend(native.lib, batch_invariant=True)
    seq_lens = [1000, 7, 300, 129, 64]
    q, k, v, cache, meta = _batch([1] * len(seq_lens), seq_lens, 9, 3, 16, torch.float32, block_size=16)
    want = TorchSDPABackend().forward(q, k, v, cache.clone(), meta, 0.25, window)
    threads = torch.get_num_threads()
    try:
        together = {}
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            filled = cache.clone()
            together[n] = invariant.forward(q, k, v, filled, meta, 0.25, window)
            assert (together[n] - want).abs().max().item() <= 1e-5
            assert torch.equal(together[n], together[1])
        for i, length in enumerate(seq_lens):
            _, _, _, alone_cache, alone_meta = _batch([1], [length], 9, 3, 16, torch.float32, block_size=16, seed=1)
            _copy_row(filled, meta, i, length, alone_cache, alone_meta)
            alone = invariant.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], alone_cache, alone_meta, 0.25, window)
            assert torch.equal(alone, together[1][i:i + 1])
        # The long row really is cut into parts: the batch-variant kernel, given many rows, sums each
        # context in one part, and the merged parts differ from that in the last bits.
        torch.set_num_threads(1)
        if window is None:
            whole = native.forward(q, k, v, cache.clone(), meta, 0.25, window)
            assert (whole[0] - together[1][0]).abs().max().item() <= 1e-5 and not torch.equal(whole[0], together[1][0])
    finally:
        torch.set_num_threads(threads)
