"""The one interface every executor offers the engine core."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from forerun.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from forerun.worker.extension import RpcError, pickle_callable


class Executor(ABC):
    """Runs worker methods on every rank.

    Invariant: calls are executed by every worker in the order they were made, and with
    `non_block=True` the returned Futures resolve in that same order. A step's output comes from rank
    `output_rank`: 0, or with pipeline stages the last stage's first rank.
    """

    output_rank: int = 0
    # Whether workers live in other processes: a callable sent to them is pickled (cloudpickle) first.
    remote_workers: bool = False

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

    def user_rpc(self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                 timeout: float | None = None) -> list[Any]:
        """A trainer's call (vLLM's `collective_rpc`): `method` names a worker method (its extension's
        too) or is a callable run as `method(worker, *args, **kwargs)`; one result per rank, in rank order.

        The worker catches the call's own exception and returns it (`RpcError`), so a bad call leaves
        the workers usable; it is raised here, a ValueError as a ValueError. TimeoutError after `timeout`
        seconds (the call itself still completes on the workers)."""
        if not isinstance(method, str) and not callable(method):
            raise ValueError(f"collective_rpc: method must be a name or a callable, got {type(method).__name__}")
        target = pickle_callable(method) if callable(method) and self.remote_workers else method
        fut = self.collective_rpc("user_call", (target, tuple(args), dict(kwargs or {})), non_block=True)
        try:
            results = self.every_rank(fut.result(timeout=timeout))
        except FutureTimeout:
            raise TimeoutError(f"collective_rpc: {_name(method)} did not finish within {timeout} s") from None
        for rank, result in enumerate(results):
            if isinstance(result, RpcError):
                raise result.exception(_name(method), rank)
        return results

    def every_rank(self, results: list[Any]) -> list[Any]:
        """Every rank's result of a call from what this process received; one engine drives all ranks
        here, so it received them all."""
        return results

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


def _name(method: str | Callable[..., Any]) -> str:
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
