"""Point-to-point messages between pipeline stages: activations forward, sampled token ids back to the first."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Sends kept in flight before the oldest is waited for. gloo's Work.is_completed() stays False until
# wait() is called, so completion cannot be polled. The engine keeps at most pp_size + 1 steps in flight,
# so a send this many messages old has normally been received; if not, waiting only holds this rank back
# until its peer catches up (the peer needs nothing more from this rank to receive it), never deadlocks.
MAX_SENDS_IN_FLIGHT = 16
# One tag per kind of message, so a stream of one kind never matches a receive posted for another.
_TAG_ACTIVATIONS, _TAG_TIMING, _TAG_TOKENS = 1, 2, 3


class StageLink:
    """This rank's neighbours in the pipeline and the messages it exchanges with them.

    Invariants: rank = stage * tp_size + tp_rank; a rank talks only to ranks of the same tp_rank (its
    tensor-parallel peers hold the same activations), so every stream has one sender and one receiver and
    arrives in send order; sends never block the caller (a sent tensor is kept alive until delivered),
    because the receiver may still be busy with an earlier step.
    """

    def __init__(self, stage: int, num_stages: int, tp_rank: int, tp_size: int, device: torch.device) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.device = device
        self.prev = (stage - 1) * tp_size + tp_rank
        self.next = (stage + 1) * tp_size + tp_rank
        self.first = tp_rank
        self.last = (num_stages - 1) * tp_size + tp_rank
        self._sends: deque[tuple[Any, Tensor]] = deque()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # ---- activations: stage s -> s + 1 ---------------------------------------------------------
    def send_activations(self, hidden: Tensor, residual: Tensor) -> None:
        # As raw bytes: one message for both tensors, whatever the dtype (gloo lacks some float types).
        self._isend(torch.stack((hidden, residual)).view(torch.uint8), self.next, _TAG_ACTIVATIONS)

    def recv_activations(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        buf = torch.empty((2, num_tokens, hidden_size * dtype.itemsize), dtype=torch.uint8, device=self.device)
        dist.recv(buf, self.prev, tag=_TAG_ACTIVATIONS)
        both = buf.view(dtype)
        return both[0], both[1]

    # ---- worker timing (only with the step trace on): stage s -> s + 1 --------------------------
    def send_timing(self, rows: Tensor) -> None:
        self._isend(rows, self.next, _TAG_TIMING)

    def recv_timing(self, num_rows: int, width: int) -> Tensor:
        buf = torch.empty((num_rows, width), dtype=torch.float64, device=self.device)
        dist.recv(buf, self.prev, tag=_TAG_TIMING)
        return buf

    # ---- sampled token ids: last stage -> first stage ------------------------------------------
    def send_tokens(self, ids: Tensor) -> None:
        self._isend(ids.to(torch.int64).contiguous(), self.first, _TAG_TOKENS)

    def irecv_tokens(self, n: int) -> tuple[Tensor, Any]:
        """A buffer of `n` ids and the pending receive that fills it (wait on it before reading)."""
        buf = torch.empty(n, dtype=torch.int64, device=self.device)
        return buf, dist.irecv(buf, self.last, tag=_TAG_TOKENS)

    # ---- sends in flight -----------------------------------------------------------------------
    def _isend(self, tensor: Tensor, dst: int, tag: int) -> None:
        self._sends.append((dist.isend(tensor, dst, tag=tag), tensor))
        while len(self._sends) > MAX_SENDS_IN_FLIGHT:
            self._sends.popleft()[0].wait()

    def close(self) -> None:
        """Drop the sends still in flight (at shutdown, or after a peer died)."""
        self._sends.clear()
