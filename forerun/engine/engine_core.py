"""The step loop: schedule, execute, sample, apply. Sync (`step`) or one step ahead (`step_with_batch_queue`)."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from forerun.config import EngineConfig
from forerun.core.async_scheduler import AsyncScheduler
from forerun.core.kv_cache_manager import KVCacheManager, NoKVCache
from forerun.core.pipeline_scheduler import PipelineScheduler
from forerun.core.request_queue import check_priority
from forerun.core.scheduler import Scheduler, SchedulerConfig
from forerun.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from forerun.engine.step_trace import StepTrace
from forerun.engine.trainer_calls import TrainerCalls
from forerun.executor.factory import make_executor
from forerun.outputs import EngineCoreOutput
from forerun.request import EngineCoreRequest, Request, RequestStatus
from forerun.sampling_params import check_token_ids

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A step failed on the worker. `outputs` end every pending request with an error."""

    def __init__(self, message: str, outputs: list[EngineCoreOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


@dataclass
class _InFlight:
    sched: SchedulerOutput
    execute: Future
    sample: Future | None  # None while sampling waits for a structured request's in-flight token


class EngineCore(TrainerCalls):
    """Owns the scheduler and the executor (and takes RL trainers' calls: forerun.engine.trainer_calls).

    Invariants: at most `queue_depth` steps are in flight (1 in sync mode, 2 in async mode; with
    pipeline stages `pipeline_parallel_size`, plus one in async mode) and they are applied in launch order;
    the first call of `step_with_batch_queue` returns None (it fills the queue); an abort takes effect
    at once, so an aborted request is never scheduled again and outputs of steps already in flight
    for it are dropped (dead tokens), never returned.
    """

    def __init__(self, config: EngineConfig, model_folder: Path,
                 structured_factory: Callable[[], Any] | None = None) -> None:
        config.validate()
        self.config = config
        config.check_model(read_model_config(model_folder))  # before any worker starts
        self.executor = make_executor(config, model_folder)
        try:
            info = self._size_kv_cache()
        except BaseException as exc:
            # Workers (processes, shared memory) are already up: a refused start must not leave them
            # behind. An interrupt (a signal) rather than an error means exit now.
            self._stop_executor(now=not isinstance(exc, Exception))
            raise
        self.encoder_only = info.encoder_only
        num_blocks = self.num_blocks
        kv = NoKVCache() if self.encoder_only else KVCacheManager(num_blocks, config.block_size,
                                                                   config.enable_prefix_caching)
        spec = config.spec
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                    config.enable_chunked_prefill, encoder_only=self.encoder_only,
                                    prefill_decode_policy=config.prefill_decode_policy,
                                    split_interleave_steps=config.split_interleave_steps,
                                    scheduling_policy=config.scheduling_policy,
                                    num_spec_tokens=spec.num_speculative_tokens if spec else 0,
                                    spec_disable_batch_size=spec.disable_by_batch_size if spec else None)
        # Built on the first structured request: importing the grammar library costs about a second.
        self._structured_factory = structured_factory
        self.structured: Any = None
        self.async_mode = bool(config.async_scheduling)
        pp = config.pipeline_parallel_size
        self.scheduler: Scheduler
        if pp > 1:
            self.scheduler = PipelineScheduler(sched_cfg, kv, pp_size=pp, run_ahead=self.async_mode)
        else:
            self.scheduler = (AsyncScheduler if self.async_mode else Scheduler)(sched_cfg, kv)
        self.batch_queue: deque[_InFlight] = deque()
        # One step per stage keeps every stage busy; async mode adds the step being scheduled.
        self.queue_depth = pp + (1 if self.async_mode else 0)
        self.trace: StepTrace | None = StepTrace() if config.trace else None
        self._unsent_finished: set[str] = set()
        self._unsent_preempted: set[str] = set()
        self.asleep: set[str] = set()  # sleep mode: which memory sleeps (no request runs meanwhile)

    def _size_kv_cache(self) -> Any:
        """Settle max_model_len and the block count with the workers, then allocate the cache.

        Refuses (ValueError) a max_model_len that one sequence cannot fill in the cache, since such a
        request would never be admitted and would stall the queue; an unset one shrinks to the cache.
        """
        config = self.config
        info = self.executor.collective_rpc("model_info")[0]
        self.vocab_size = info.vocab_size
        wanted = config.check_max_model_len(info.max_model_len)
        num_blocks = min(self.executor.collective_rpc("determine_num_blocks", (wanted,)))
        self.max_model_len = config.fit_max_model_len(wanted, num_blocks)
        self.executor.collective_rpc("init_kv_cache", (num_blocks, self.max_model_len))
        self.num_blocks = num_blocks
        return info

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, core_req: EngineCoreRequest) -> None:
        """Raises ValueError naming the field for a request this core cannot run; nothing else is touched."""
        self.check_awake("generate")
        rid = core_req.request_id
        if rid in self.scheduler.requests or any(rid in s.sched.num_scheduled_tokens for s in self.batch_queue):
            # A step in flight would hand its token for the old request to the new one.
            raise ValueError(f"request_id: {rid!r} is still in use (running, or a step for it is in flight); "
                             "use a new id, or reuse it once its previous request has fully ended")
        # Checked here as well as in the front end: an id outside the vocabulary would fail a whole step.
        check_token_ids("prompt", core_req.prompt_token_ids, self.vocab_size)
        core_req.sampling_params.validate_token_ids(self.vocab_size)
        check_priority(core_req.priority, self.config.scheduling_policy)
        req = Request(core_req, self.max_model_len)
        if core_req.pooling:
            if req.num_prompt_tokens > self.max_model_len:
                raise ValueError(f"input: {req.num_prompt_tokens} tokens exceed the model's limit of "
                                 f"{self.max_model_len}")
        elif req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt: {req.num_prompt_tokens} tokens leave no room for output within "
                             f"max_model_len {self.max_model_len}")
        self.scheduler.check_fits(req)
        sp = core_req.sampling_params
        if sp.prompt_logprobs is not None and (self.config.spec is not None or self.config.pipeline_parallel_size > 1):
            raise ValueError("prompt_logprobs: not supported with speculative decoding or pipeline parallelism")
        if sp.structured_outputs is not None:
            req.grammar_future = self.structured_manager().submit(sp.structured_outputs)
            if self.config.spec is not None:
                # Drafts are not checked against the grammar: such a request decodes one token a step.
                req.use_spec = False
                logger.info("request %s: speculative decoding off (structured output)", rid)
        self.scheduler.add_request(req)

    def structured_manager(self) -> Any:
        if self.structured is None:
            if self._structured_factory is None:
                raise ValueError("structured_outputs: this engine has no structured-output backend")
            self.structured = self._structured_factory()
            self.scheduler.structured = self.structured
        return self.structured

    def abort_requests(self, request_ids: list[str]) -> None:
        """End the requests now, also in async mode with steps in flight.

        Waiting until the in-flight step is applied would schedule the request once more first: a stop
        string would cost two dead tokens instead of one, and a waiting request whose client left
        would still be prefilled. Freeing blocks a step in flight still writes is safe: the worker runs
        steps in order, so a later owner of those blocks writes after it.
        """
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def check_health(self) -> None:
        """Raise when a worker is gone: no later step can succeed."""
        self.executor.check_health()

    def run_step(self) -> list[EngineCoreOutput]:
        out = self.step_with_batch_queue() if self.queue_depth > 1 else self.step()
        return self.scheduler.take_error_outputs() + (out or [])

    # ---- sync ----------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        sched = self._schedule()
        if sched.is_empty:
            self._wait_for_grammars()
            return []
        try:
            self.executor.execute_model(sched)
            result = self.executor.sample_tokens(self._grammar_output(sched))
        except Exception as exc:
            raise self._fail_all(exc) from exc
        return self._update(sched, result)

    # ---- async ---------------------------------------------------------------------------------
    def step_with_batch_queue(self) -> list[EngineCoreOutput] | None:
        launched = False
        # A step whose sampling is deferred must be sampled before another is executed (the worker
        # alternates the two calls); with more than two steps in flight it may not be the oldest.
        deferred = bool(self.batch_queue) and self.batch_queue[-1].sample is None
        if self.scheduler.has_unfinished_requests() and len(self.batch_queue) < self.queue_depth and not deferred:
            sched = self._schedule()
            if not sched.is_empty:
                self.batch_queue.append(self._launch(sched))
                launched = True
        if launched and len(self.batch_queue) < self.queue_depth:
            return None  # fill the queue before collecting
        if not self.batch_queue:
            self._wait_for_grammars()
            return []
        oldest = self.batch_queue.popleft()
        t0 = time.perf_counter()
        try:
            if oldest.sample is None:
                oldest.execute.result()  # a forward that raised reports its own error, not sampling's
                oldest.sample = self.executor.sample_tokens(self._grammar_output(oldest.sched), non_block=True)
            result = self._sampled(oldest)
        except Exception as exc:
            raise self._fail_all(exc) from exc
        if self.trace is not None:
            self.trace.span("wait", oldest.sched.step_id, t0)
        outputs = self._update(oldest.sched, result)
        if self.batch_queue and self.batch_queue[0].sample is None:
            newer = self.batch_queue[0]  # its grammar just advanced: build its bitmask and sample
            newer.sample = self.executor.sample_tokens(self._grammar_output(newer.sched), non_block=True)
        return outputs

    @staticmethod
    def _sampled(step: _InFlight) -> ModelRunnerOutput:
        """The step's sampled tokens. Only the sampling call is waited on: the worker runs it after the
        forward, so one wake-up of this thread a step instead of two, each of which took the GIL just as
        the worker went from the forward to sampling. A forward that raised reports its own error, not
        sampling's."""
        assert step.sample is not None
        try:
            result = step.sample.result()
        except Exception:
            step.execute.result()
            raise
        step.execute.result()
        return result

    def _launch(self, sched: SchedulerOutput) -> _InFlight:
        execute = self.executor.execute_model(sched, non_block=True)
        if sched.pending_structured_output:
            return _InFlight(sched, execute, None)
        sample = self.executor.sample_tokens(self._grammar_output(sched), non_block=True)
        return _InFlight(sched, execute, sample)

    # ---- shared pieces -------------------------------------------------------------------------
    def _wait_for_grammars(self, timeout_s: float = 0.01) -> None:
        """Nothing could run: block briefly on a compiling grammar instead of spinning empty steps
        (which would also take the core the compile thread needs)."""
        pending = [r.grammar_future for r in self.scheduler.waiting
                   if r.grammar_future is not None and not r.grammar_future.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(self._grammars_ready())
        # Rows to drop must reach the worker even when this step is empty and never launched.
        sched.finished_req_ids |= self._unsent_finished
        sched.preempted_req_ids |= self._unsent_preempted
        if sched.is_empty:
            self._unsent_finished, self._unsent_preempted = sched.finished_req_ids, sched.preempted_req_ids
        else:
            self._unsent_finished, self._unsent_preempted = set(), set()
        if self.trace is not None:
            self.trace.span("schedule", sched.step_id, t0, tokens=sched.total_num_scheduled_tokens,
                            reqs=len(sched.num_scheduled_tokens), structured=len(sched.structured_req_ids),
                            deferred_sampling=sched.pending_structured_output)
        return sched

    def _grammars_ready(self) -> set[str]:
        """Waiting requests whose grammar has compiled on every rank.

        With external_launcher each rank runs its own engine and compiles grammars itself; admitting a
        request as soon as this rank's compile is done would give the ranks different batches and
        mismatched collectives, so the executor makes the ranks agree (a no-op for one engine).
        """
        if self.structured is None:  # no structured request yet: skip the scan of the waiting queue
            return set()
        pending = [r for r in self.scheduler.waiting if r.status == RequestStatus.WAITING_FOR_GRAMMAR]
        if not pending:
            return set()
        done = self.executor.all_ranks_true([r.grammar_future.done() for r in pending])
        return {r.request_id for r, ok in zip(pending, done) if ok}

    def _grammar_output(self, sched: SchedulerOutput) -> GrammarOutput | None:
        if not sched.structured_req_ids or self.structured is None:
            return None
        matchers = [self.scheduler.requests[r].grammar if r in self.scheduler.requests else None
                    for r in sched.structured_req_ids]
        bitmask = self.structured.grammar_bitmask(matchers)
        return None if bitmask is None else GrammarOutput(sched.structured_req_ids, bitmask)

    def _update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        outputs = self.scheduler.update_from_output(sched, result)
        if self.trace is not None:
            if result.timing is not None:
                for timing in (*result.timing.stages, result.timing):  # pipeline stages, first to last
                    for name, b, e in timing.spans:
                        self.trace.span(name, sched.step_id, b, e, thread=timing.thread)
            drafted = sum(result.num_drafted.values()) if result.num_drafted else 0
            accepted = sum(len(result.sampled_token_ids[i]) - 1 for i, rid in enumerate(result.req_ids)
                           if result.num_drafted and result.num_drafted.get(rid)) if drafted else 0
            self.trace.span("update", sched.step_id, t0,
                            dead_tokens=list(self.scheduler.last_dead_token_req_ids),
                            finished=[o.request_id for o in outputs if o.finished],
                            draft_slots=sum(sched.num_draft_slots.values()), drafted=drafted, accepted=accepted)
        return outputs

    def _fail_all(self, exc: BaseException) -> EngineStepError:
        """End every request with an error so no caller waits forever."""
        for step in self.batch_queue:  # let the worker settle before anything new is sent
            for fut in (step.execute, step.sample):
                if fut is not None:
                    try:
                        fut.result()
                    except Exception:
                        pass
        self.batch_queue.clear()
        ids = self.scheduler.fail_all_requests()
        outs = [EngineCoreOutput(rid, [], finish_reason="error", error=str(exc)) for rid in ids]
        logger.error("engine step failed: %s", exc)
        return EngineStepError(f"engine step failed: {exc!r}", outs)

    def shutdown(self, now: bool = False) -> None:
        """Stop the workers. `now` (a signal to exit at once): no goodbye call, since a worker may be in
        the middle of a long step; an executor that can end its workers at once (`kill`) does, the rest
        is left to the process's exit."""
        self.batch_queue.clear()
        if now:
            self._stop_executor(now=True)
            return
        try:
            self.executor.collective_rpc("shutdown")
        finally:
            self._stop_executor(now=False)
        if self.structured is not None:
            self.structured.close()

    def _stop_executor(self, now: bool) -> None:
        if not now:
            self.executor.shutdown()
            return
        kill = getattr(self.executor, "kill", None)
        if kill is not None:
            kill()


def read_model_config(model_folder: Path) -> dict[str, Any]:
    """The model's config.json (empty when absent: the loader then reports the missing file)."""
    path = Path(model_folder) / "config.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())
