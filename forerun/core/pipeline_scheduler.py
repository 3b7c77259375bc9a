"""The scheduler for pipeline stages: several steps in flight, a request in at most one unless its input is known."""

from __future__ import annotations

from typing import Any

from forerun.core.async_scheduler import AsyncScheduler
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.scheduler import SchedulerConfig
from forerun.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from forerun.outputs import EngineCoreOutput
from forerun.request import Request, RequestStatus


class PipelineScheduler(AsyncScheduler):
    """Schedules for `pp_size` stages with `pp_size` (sync) or `pp_size + 1` (async) steps in flight.

    Tokens in flight are counted as in AsyncScheduler, in both modes. Invariants: a request whose next
    input is known (the next chunk of its prompt) may sit in several in-flight steps, whose KV writes
    every stage makes in step order; a request whose next input is a token still being sampled is
    scheduled again only with `run_ahead` (async mode), and only when at least `pp_size - 1` launched
    steps lie between the step that samples that token and the new one: by the time the first stage
    reaches the new step the last stage has sampled the token and handed it to the first stage, so the
    first stage never waits and stage 0 runs step N+1 while stage 1 runs step N. Without `run_ahead` the
    engine applies the token first, as in sync mode.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, structured: Any = None, *,
                 pp_size: int, run_ahead: bool) -> None:
        super().__init__(config, kv, structured)
        self.pp_size = pp_size
        self.run_ahead = run_ahead
        self._in_flight: list[int] = []  # ids of launched steps not yet applied, oldest first
        self._sampled_in: dict[str, int] = {}  # request -> the newest step that samples a token for it

    def _num_new_tokens(self, req: Request) -> int:
        if req.num_output_placeholders and not self._next_input_reachable(req):
            return 0
        return super()._num_new_tokens(req)

    def _next_input_reachable(self, req: Request) -> bool:
        if not self.run_ahead or req.num_output_placeholders > 1:
            return False
        step = self._sampled_in.get(req.request_id)
        if step not in self._in_flight:
            return False
        steps_between = len(self._in_flight) - 1 - self._in_flight.index(step)
        return steps_between >= self.pp_size - 1

    def _on_scheduled(self, req: Request, num_tokens: int) -> None:
        before = req.num_output_placeholders
        super()._on_scheduled(req, num_tokens)
        if req.num_output_placeholders > before:
            # `schedule` numbers the step after its requests are placed: this one becomes step_id + 1.
            self._sampled_in[req.request_id] = self.step_id + 1

    def schedule(self, grammars_ready: set[str] | None = None) -> SchedulerOutput:
        out = super().schedule(grammars_ready)
        if not out.is_empty:  # the engine launches every non-empty step and applies it later
            self._in_flight.append(out.step_id)
        return out

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if sched.step_id in self._in_flight:
            self._in_flight.remove(sched.step_id)
        return super().update_from_output(sched, result)

    def fail_all_requests(self) -> list[str]:
        self._in_flight.clear()  # the engine drops every step in flight with them
        return super().fail_all_requests()

    def _free(self, req: Request, status: RequestStatus) -> None:
        self._sampled_in.pop(req.request_id, None)
        super()._free(req, status)
