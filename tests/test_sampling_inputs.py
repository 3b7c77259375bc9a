"""The worker's grammar-mask unpacker, the one production uses, against a bit-by-bit reference."""

from __future__ import annotations

import torch

from forerun.core.scheduler_output import GrammarOutput
from forerun.worker.sampling_inputs import grammar_bad_token_mask

CPU = torch.device("cpu")


def reference_bad(words: list[int], vocab: int) -> list[bool]:
    """Bit j of int32 word i (two's complement) allows token 32 * i + j; tokens past the words never."""
    allowed = [t < 32 * len(words) and bool((words[t // 32] & 0xFFFFFFFF) >> (t % 32) & 1) for t in range(vocab)]
    return [not a for a in allowed]


def test_unpacks_each_structured_row_into_its_batch_row():
    vocab = 100  # not a multiple of 32: the last word is partly padding
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31, (3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -2**31  # only the sign bit: token 31 alone in the first word
    bitmask[1] = -1  # every token allowed
    bitmask[2, 1] = 1  # only token 32 in the second word
    grammar = GrammarOutput(["s0", "s1", "s2"], bitmask)
    req_ids = ["free", "s2", "s0", "other", "s1"]  # the batch's order, with unconstrained rows between
    mask = grammar_bad_token_mask(grammar, req_ids, vocab, CPU)
    assert mask.shape == (5, vocab) and mask.dtype == torch.bool
    assert not mask[0].any() and not mask[3].any()
    for row, src in ((1, 2), (2, 0), (4, 1)):
        assert mask[row].tolist() == reference_bad(bitmask[src].tolist(), vocab), row
    assert not mask[2, 31] and mask[2, :31].all()
    assert not mask[1, 32] and mask[1, 33:64].all()
    assert not mask[4].any()


def test_ids_past_the_grammars_words_are_never_allowed():
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # a 64-token grammar vocabulary, all allowed
    mask = grammar_bad_token_mask(GrammarOutput(["s"], bitmask), ["s"], 80, CPU)  # padded model vocab
    assert not mask[0, :64].any() and mask[0, 64:].all()


def test_no_structured_row_in_the_batch_gives_no_mask():
    bitmask = torch.zeros((1, 4), dtype=torch.int32)
    assert grammar_bad_token_mask(GrammarOutput(["s"], bitmask), ["a", "b"], 100, CPU) is None
