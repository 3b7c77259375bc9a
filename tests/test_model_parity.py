"""Parity of forerun's paged Llama-family models with Hugging Face transformers (tiny random models)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from forerun.model.attention import AttentionMetadata
from forerun.model.registry import load_model

VOCAB = 512
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, head_dim=16)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_theta=10000.0),
    "smollm2-tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True, rope_theta=100000.0),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "mistral-window5": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON),
}
ARCH = {"llama": transformers.LlamaForCausalLM, "smollm2-tied": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM, "mistral-window5": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_pair(request, tmp_path_factory) -> tuple:
    """(HF reference model, forerun model) sharing random weights saved to a temporary folder."""
    torch.manual_seed(0)
    hf = ARCH[request.param](CONFIGS[request.param]())
    with torch.no_grad():  # non-trivial values everywhere: HF inits biases to 0 and norms to 1
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    hf.eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours = load_model(folder, torch.float32, torch.device("cpu"))
    return hf, ours


class PagedKV:
    """Test-only block allocator: grows each sequence's block list and maps new tokens to slots."""

    def __init__(self, model, num_blocks: int, block_size: int, shuffle: bool) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        if shuffle:
            random.Random(1).shuffle(self.free)
        # Poison the cache (finite: masked slots are multiplied by 0) so reading an unwritten slot shows.
        self.caches = [torch.full(model.kv_cache_shape(num_blocks, block_size), 1e3)
                       for _ in range(model.num_layers)]
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, rows: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """rows = (sequence id, its new tokens); returns input_ids, positions, metadata."""
        ids, pos, slots, qlens, slens = [], [], [], [], []
        for seq, tokens in rows:
            start = self.lens.get(seq, 0)
            blocks = self.blocks.setdefault(seq, [])
            for p in range(start, start + len(tokens)):
                if p // self.block_size >= len(blocks):
                    blocks.append(self.free.pop())
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
                pos.append(p)
            ids += tokens
            self.lens[seq] = start + len(tokens)
            qlens.append(len(tokens))
            slens.append(self.lens[seq])
        width = max(len(self.blocks[s]) for s, _ in rows) + 1  # one column of padding
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for r, (seq, _) in enumerate(rows):
            table[r, : len(self.blocks[seq])] = torch.tensor(self.blocks[seq], dtype=torch.int32)
        meta = AttentionMetadata.build(qlens, slens, table, torch.tensor(slots, dtype=torch.int64), self.block_size)
        return torch.tensor(ids), torch.tensor(pos), meta


def run_steps(model, kv: PagedKV, steps: list[list[tuple[int, list[int]]]]) -> dict[int, dict[int, torch.Tensor]]:
    """Run each step through the model; return logits by sequence and position."""
    got: dict[int, dict[int, torch.Tensor]] = {}
    with torch.inference_mode():
        for rows in steps:
            ids, pos, meta = kv.step(rows)
            logits = model.compute_logits(model(ids, pos, kv.caches, meta))
            assert logits.shape == (len(ids), VOCAB) and logits.dtype == torch.float32
            t = 0
            for seq, tokens in rows:
                for _ in tokens:
                    got.setdefault(seq, {})[int(pos[t])] = logits[t]
                    t += 1
    return got


def check_against_hf(hf, steps, got) -> None:
    full: dict[int, list[int]] = {}
    for rows in steps:
        for seq, tokens in rows:
            full.setdefault(seq, []).extend(tokens)
    with torch.no_grad():
        for seq, tokens in full.items():
            ref = hf(torch.tensor([tokens])).logits[0]
            assert set(got[seq]) == set(range(len(tokens)))
            ours = torch.stack([got[seq][p] for p in range(len(tokens))])
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.mark.parametrize("block_size,shuffle", [(16, False), (4, True)])
def test_batched_prefill_then_batched_decode(model_pair, block_size, shuffle) -> None:
    hf, ours = model_pair
    rng = random.Random(2)
    steps = [[(0, toks(rng, 5)), (1, toks(rng, 11)), (2, toks(rng, 7))]]  # (a) one flattened prefill
    steps += [[(s, toks(rng, 1)) for s in (0, 1, 2)] for _ in range(5)]   # (b) decode rows batched
    kv = PagedKV(ours, 64, block_size, shuffle)
    check_against_hf(hf, steps, run_steps(ours, kv, steps))


@pytest.mark.parametrize("block_size,shuffle", [(16, False), (4, True)])
def test_chunked_prefill_mixed_with_decode(model_pair, block_size, shuffle) -> None:
    hf, ours = model_pair
    rng = random.Random(3)
    steps = [
        [(0, toks(rng, 6)), (1, toks(rng, 9))],                     # seq 0 chunk 1, seq 1 whole prompt
        [(1, toks(rng, 1)), (0, toks(rng, 7)), (2, toks(rng, 4))],  # (c) decode, chunk 2 on cache, fresh
        [(2, toks(rng, 1)), (0, toks(rng, 1)), (1, toks(rng, 1))],  # all decode, rows reordered
        [(0, toks(rng, 3)), (2, toks(rng, 1))],                     # 3-token append on cache + decode
    ]
    kv = PagedKV(ours, 64, block_size, shuffle)
    check_against_hf(hf, steps, run_steps(ours, kv, steps))


def test_model_attributes(model_pair) -> None:
    _, ours = model_pair
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim, ours.vocab_size) == (2, 2, 16, VOCAB)
    assert ours.kv_cache_shape(10, 4) == (2, 10, 4, 2, 16)


def _write_config(folder: Path, **cfg) -> Path:
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_unknown_architecture_raises(tmp_path) -> None:
    _write_config(tmp_path, architectures=["GPT2LMHeadModel"], **COMMON)
    with pytest.raises(ValueError, match="architectures"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_metadata_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="query_lens"):
        AttentionMetadata.build([3], [2], torch.zeros(1, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        AttentionMetadata.build([2], [2], torch.zeros(1, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), 4)


def _tp_worker(rank: int, folder: str, steps: list, expected: dict, rdzv: str) -> None:
    """One tensor-parallel rank: load its shard, run the steps, compare with the HF logits."""
    import torch.distributed as dist

    from forerun.model.parallel import TPGroup

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        model = load_model(Path(folder), torch.float32, torch.device("cpu"), TPGroup(rank, 2))
        assert model.num_kv_heads == 1 and model.kv_cache_shape(8, 4) == (2, 8, 4, 1, 16)
        got = run_steps(model, PagedKV(model, 32, 4, True), steps)
        for seq, ref in expected.items():
            torch.testing.assert_close(torch.stack([got[seq][p] for p in range(len(ref))]), ref,
                                       atol=1e-4, rtol=1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["qwen2", "smollm2-tied"])
def test_tensor_parallel_two_ranks(name, tmp_path) -> None:
    torch.manual_seed(0)
    hf = ARCH[name](CONFIGS[name]())
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.08 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "model")
    rng = random.Random(4)
    steps = [[(0, toks(rng, 6)), (1, toks(rng, 3))], [(0, toks(rng, 1)), (1, toks(rng, 4))]]
    full = {0: steps[0][0][1] + steps[1][0][1], 1: steps[0][1][1] + steps[1][1][1]}
    with torch.no_grad():
        expected = {s: hf(torch.tensor([t])).logits[0] for s, t in full.items()}
    torch.multiprocessing.spawn(_tp_worker, args=(str(tmp_path / "model"), steps, expected,
                                                  str(tmp_path / "rdzv")), nprocs=2, join=True)
