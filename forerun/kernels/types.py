"""What the kernels are handed and hand back, as plain types: no model class is named here.

`LinearFn` is a matmul bound to its weights. `DecodeBatch` is the part of one step's attention
metadata the C decode kernels read; forerun.model.attention.AttentionMetadata has these fields, so the
model passes its own metadata without the kernels importing the model.
"""

from __future__ import annotations

from typing import Callable, Protocol

from torch import Tensor

LinearFn = Callable[[Tensor], Tensor]


class DecodeBatch(Protocol):
    """One step's decode rows. Invariant (kept by the model's metadata builder): `decode_blocks` holds
    `decode_len // block_size` block ids per decode row, row-major, and `decode_seq_lens` one length
    per decode row; `slot_mapping` has one cache slot per token of the step."""

    all_decode: bool
    slot_mapping: Tensor
    decode_blocks: Tensor | None
    decode_seq_lens: Tensor | None
    decode_len: int
