"""The calls RL trainers make between rollouts (vLLM's names and meanings), as a part of `EngineCore`:
trainer RPCs, in-place weight updates, prefix-cache reset, sleep and wake-up.

Invariant: none of these runs while a step is in flight. Each first drains the batch queue (waits for
every launched step and applies it, launching nothing new); since the engine loop and these calls run
on one thread, a request added meanwhile waits until the call returns.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from forerun.outputs import EngineCoreOutput

if TYPE_CHECKING:
    # Only for annotations: the server's front end imports the engine, and must not pay torch's
    # import (about 120 MB and a second) for calls only trainers make.
    from torch import Tensor

    from forerun.config import EngineConfig
    from forerun.core.scheduler import Scheduler
    from forerun.executor.base import Executor

# Weights sent to worker processes travel in batches of about this many bytes (each one pickled whole).
LOAD_BATCH_BYTES = 256 << 20
SLEEP_TAGS = ("weights", "kv_cache")


class TrainerCalls:
    """Mixed into EngineCore, whose executor, scheduler and batch queue it uses."""

    config: "EngineConfig"
    executor: "Executor"
    scheduler: "Scheduler"
    batch_queue: deque
    asleep: set[str]

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Run `method` (a worker method's name, or a callable taking the worker first) on every rank."""
        self.drain()
        return self.executor.user_rpc(method, args, kwargs, timeout)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Update every rank's weights in place from (Hugging Face name, full tensor) pairs, then reset
        the prefix cache (its blocks hold keys and values of the old weights)."""
        if "weights" in self.asleep:
            raise ValueError("load_weights: the weights are asleep; call wake_up(tags=['weights']) first")
        self.drain()
        batches = _batches(weights, LOAD_BATCH_BYTES) if self.executor.remote_workers else [weights]
        try:
            for batch in batches:
                self.executor.user_rpc("load_weights", (batch,))
        finally:  # a partial update changed weights too
            self.reset_prefix_cache()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (blocks in use stay with their requests)."""
        self.scheduler.kv.reset_prefix_cache()
        return True

    def sleep(self, level: int = 1) -> None:
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep: needs an engine started with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise ValueError("sleep: the engine is already asleep; call wake_up() first")
        if self.scheduler.has_unfinished_requests():
            raise ValueError(f"sleep: {len(self.scheduler.requests)} requests are still running; let them finish "
                             "or abort them first")
        self.drain()
        self.executor.user_rpc("sleep", (level,))
        self.reset_prefix_cache()  # the KV cache's contents are gone
        self.asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Make the memory named by `tags` ("weights", "kv_cache"; None: both) usable again."""
        if isinstance(tags, str):
            raise ValueError(f"wake_up: tags must be a list of tags, got the string {tags!r}")
        unknown = [t for t in tags or () if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up: unknown tag {unknown[0]!r}; expected some of {list(SLEEP_TAGS)}")
        if not self.asleep:
            raise ValueError("wake_up: the engine is not asleep (call sleep() first)")
        self.executor.user_rpc("wake_up", (None if tags is None else list(tags),))
        self.asleep -= set(SLEEP_TAGS if tags is None else tags)

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def check_awake(self, what: str) -> None:
        if self.asleep:
            raise ValueError(f"{what}: the engine is asleep ({', '.join(sorted(self.asleep))}); call wake_up() "
                             "first")

    def drain(self) -> list[EngineCoreOutput]:
        """Wait for every step in flight and apply it, in launch order, launching nothing new."""
        outputs: list[EngineCoreOutput] = []
        while self.batch_queue:
            step = self.batch_queue.popleft()
            try:
                step.execute.result()
                if step.sample is None:
                    step.sample = self.executor.sample_tokens(self._grammar_output(step.sched), non_block=True)
                result = step.sample.result()
            except Exception as exc:
                raise self._fail_all(exc) from exc
            outputs += self._update(step.sched, result)
        return outputs

    # Provided by EngineCore.
    _grammar_output: Callable[..., Any]
    _update: Callable[..., list[EngineCoreOutput]]
    _fail_all: Callable[[BaseException], Exception]


def _batches(weights: Iterable[tuple[str, Tensor]], max_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Lists of pairs of about `max_bytes` each. A view is copied out first: pickling a tensor sends its
    whole storage, which for a slice of a large flat buffer is far more than the slice."""
    import torch  # here, not at the top: see the TYPE_CHECKING import

    batch: list[tuple[str, Tensor]] = []
    size = 0
    for item in weights:
        if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[1], torch.Tensor):
            raise ValueError("load_weights: expected an iterable of (name, torch.Tensor) pairs")
        name, tensor = item
        tensor = tensor.detach().cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.untyped_storage().nbytes() != nbytes:
            tensor = tensor.clone()
        batch.append((name, tensor))
        size += nbytes
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
