"""The one interface every executor offers the engine core."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from forerun.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Runs worker methods on every rank.

    Invariant: calls are executed by every worker in the order they were made, and with
    `non_block=True` the returned Futures resolve in that same order. A step's output comes from rank
    `output_rank`: 0, or with pipeline stages the last stage's first rank.
    """

    output_rank: int = 0

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False) -> list[Any] | Future:
        """Call `method` on every rank's worker; return every rank's result (rank order)."""

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Future | None:
        out = self.collective_rpc("execute_model", (scheduler_output,), non_block=non_block)
        return out if non_block else None

    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: bool = False) -> ModelRunnerOutput | Future:
        out = self.collective_rpc("sample_tokens", (grammar_output,), non_block=non_block)
        if non_block:
            return _pick(out, self.output_rank)
        return out[self.output_rank]

    def all_ranks_true(self, flags: list[bool]) -> list[bool]:
        """Each flag ANDed over every rank's engine, for decisions an engine makes from its own process
        state (has this grammar compiled?). One engine drives every rank here, so its flags stand."""
        return flags

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None: ...


def _pick(fut: Future, rank: int) -> Future:
    """A Future of `rank`'s result out of a Future of every rank's results."""
    out: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(f.result()[rank])

    fut.add_done_callback(done)
    return out
