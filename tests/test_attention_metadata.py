"""AttentionMetadata.for_decode, the decode steps' builder from host arrays, against the general `build`."""

import numpy as np
import pytest
import torch

from forerun.model.attention import AttentionMetadata


def _decode_batch(seq_lens: list[int], block_size: int, seed: int):
    """Block tables padded with -1 past each row's blocks, as the worker's are, and each row's new slot."""
    rng = np.random.default_rng(seed)
    per_row = -(-max(seq_lens) // block_size)
    ids = rng.permutation(64)[:per_row * len(seq_lens)].reshape(len(seq_lens), per_row).astype(np.int32)
    for i, s in enumerate(seq_lens):
        ids[i, -(-s // block_size):] = -1
    last = np.array(seq_lens, np.int64) - 1
    slots = ids[np.arange(len(seq_lens)), last // block_size].astype(np.int64) * block_size + last % block_size
    return np.array(seq_lens, np.int64), ids, slots


@pytest.mark.parametrize("seq_lens", [[1], [37], [16, 16], [5, 40, 17, 1]])
def test_for_decode_gives_what_build_gives(seq_lens):
    block_size = 16
    lens, tables, slots = _decode_batch(seq_lens, block_size, seed=len(seq_lens))
    got = AttentionMetadata.for_decode(lens, tables, slots, block_size, torch.device("cpu"))
    want = AttentionMetadata.build([1] * len(seq_lens), seq_lens, torch.from_numpy(tables), torch.from_numpy(slots),
                                   block_size)
    for name in ("query_lens", "seq_lens", "block_size", "num_tokens", "all_decode", "decode_len", "prefills",
                 "decode_token_idx"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("block_tables", "slot_mapping", "decode_blocks", "decode_seq_lens"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous(), name
        assert torch.equal(g, w), name
    assert int(got.decode_blocks.min()) >= 0, "padding is never a block id the kernels would read"
