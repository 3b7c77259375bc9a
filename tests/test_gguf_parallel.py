"""A K-quant GGUF model served from its blocks: sync equals async, and tensor parallelism (shards on
whole blocks, a shard that would cut a block held dense) and pipeline stages give the one-rank tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_factory import write_mixed_llama_gguf

from forerun import LLM, SamplingParams
from forerun.kernels.compact_weights import CompactWeight
from forerun.model.layers import MergedColumnParallelLinear, RowParallelLinear
from forerun.model.parallel import TPGroup

PROMPTS = [[5, 77, 140, 3, 9, 200, 31], [100, 101, 102, 250], [42], list(range(60, 90))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# q/k/v in three formats (three matmuls joined), o in Q4_K: at TP 2 its 256 input columns split into
# shards of 128, which would cut its 256-weight blocks.
LAYER_TYPES = (Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q4_K, Q.Q5_K, Q.Q4_K, Q.Q6_K)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mixed_llama_gguf(tmp_path_factory.mktemp("kquant-parallel") / "m.gguf", LAYER_TYPES, seed=3)


def _tokens(path: Path, **kw) -> list[list[int]]:
    kw.setdefault("dtype", "float32")  # fp32: TP sums its shards in another order (bf16 would show it)
    with LLM(model=str(path), show_progress=False, **kw) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def one_rank(kquant_gguf: Path) -> list[list[int]]:
    tokens = _tokens(kquant_gguf, async_scheduling=False)
    assert len({t for out in tokens for t in out}) > 3  # the random model says more than one thing
    return tokens


def test_async_equals_sync(kquant_gguf: Path, one_rank: list[list[int]]) -> None:
    assert _tokens(kquant_gguf, async_scheduling=True) == one_rank


def test_tensor_parallel_gives_the_one_rank_tokens(kquant_gguf: Path, one_rank: list[list[int]]) -> None:
    assert _tokens(kquant_gguf, tensor_parallel_size=2, distributed_executor_backend="mp") == one_rank


@pytest.mark.parametrize("fmt, kept", [("Q8_0", True), ("Q4_K", False)])
def test_a_row_shard_keeps_whole_blocks_and_holds_a_cut_one_dense(fmt: str, kept: bool) -> None:
    full = CompactWeight.random(fmt, 64, 256)
    for rank in range(2):
        layer = RowParallelLinear(256, 64, False, TPGroup(rank, 2))
        layer.load_weight("weight", full)
        want = full.expand()[:, rank * 128:(rank + 1) * 128]
        if kept:  # 128 columns are four Q8_0 blocks: this rank's blocks, no dense weight
            assert layer.blocks is not None and layer.weight.numel() == 0
            assert torch.equal(layer.blocks[0].expand(), want)
        else:  # half a Q4_K block each: that shard is expanded, exactly
            assert layer.blocks is None and torch.equal(layer.weight, want)


def test_pipeline_stages(kquant_gguf: Path, one_rank: list[list[int]]) -> None:
    assert _tokens(kquant_gguf, pipeline_parallel_size=2, distributed_executor_backend="mp") == one_rank


def test_the_model_holds_blocks_and_no_dense_weight(kquant_gguf: Path) -> None:
    with LLM(model=str(kquant_gguf), dtype="float32", show_progress=False) as llm:
        model = llm.engine.core.executor.worker.model
        layer = model.model.layers[0]
        assert [b.fmt for b in layer.self_attn.qkv_proj.blocks] == ["Q4_K", "Q8_0", "Q6_K"]
        assert [b.fmt for b in layer.mlp.gate_up_proj.blocks] == ["Q5_K", "Q4_K"]
        assert model.lm_head.blocks[0] is model.model.embed_tokens.table  # tied: one copy of the table
        dense = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight") or "embed" in n)
        assert dense == 0, "a quantized matrix was expanded"


def test_a_packed_layer_with_a_dense_part_expands_its_block_parts() -> None:
    """q/k/v where one part is a float tensor in the file: the layer is dense, with every part's weights."""
    layer = MergedColumnParallelLinear(256, [64, 32, 32], False, TPGroup())
    q, v = CompactWeight.random("Q4_K", 64, 256), CompactWeight.random("Q8_0", 32, 256)
    k = torch.randn(32, 256)
    layer.load_weight("weight", q, 0)
    layer.load_weight("weight", k, 1)
    layer.load_weight("weight", v, 2)
    assert layer.blocks is None
    assert torch.equal(layer.weight, torch.cat([q.expand(), k, v.expand()]))
    blocks_only = MergedColumnParallelLinear(256, [64, 32], False, TPGroup())
    blocks_only.load_weight("weight", q, 0)
    blocks_only.load_weight("weight", v, 1)
    assert [b.fmt for b in blocks_only.blocks] == ["Q4_K", "Q8_0"] and blocks_only.weight.numel() == 0
