"""Phase-free scheduler: every request gets tokens under one budget each step (vLLM V1 style)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.prompt_logprobs import attach_prompt_logprobs, store_prompt_logprobs
from forerun.core.request_queue import add_running, make_waiting_queue
from forerun.core.request_tokens import append_tokens
from forerun.core.scheduler_output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                           SchedulerOutput)
from forerun.core.spec_stats import SpecDecodeStats
from forerun.core.step_policy import Phase, StepPolicy
from forerun.outputs import EngineCoreOutput
from forerun.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    encoder_only: bool = False  # prompts run whole in one step (bidirectional attention cannot be chunked)
    prefill_decode_policy: str = "mixed"  # mixed, split or prefill-first (see forerun/core/step_policy.py)
    split_interleave_steps: int = 1  # split: most prefill steps in a row while a decode waits
    scheduling_policy: str = "fcfs"  # fcfs, or priority: lower `Request.priority` first
    num_spec_tokens: int = 0  # draft slots reserved per decode (n-gram speculation); 0: off
    spec_disable_batch_size: int | None = None  # no drafts in a step whose running batch is larger


class Scheduler:
    """Decides, each step, how many tokens each request computes.

    Invariants: running requests come first, in admission order (FCFS), and preemption takes the most
    recently admitted one; under the priority policy both queues are in (priority, arrival) order instead,
    so preemption takes the lowest-priority request; `num_computed_tokens` advances when a request is
    scheduled (by 1 + k for a decode given k draft slots, rolled back by the slots not accepted when its
    output is applied, so it is an upper bound while a step is in flight); a finished request's blocks are back in the pool before `update_from_output` returns.
    Which requests share a step (prefills, decodes or both) is the `StepPolicy`'s call.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, structured: Any = None) -> None:
        self.config = config
        self.kv = kv
        self.structured = structured  # forerun.structured.manager.StructuredOutputManager or None
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = make_waiting_queue(config.scheduling_policy)  # type: ignore[assignment]
        self.step_policy = StepPolicy(config.prefill_decode_policy, config.split_interleave_steps)
        self.last_step_phase: Phase | None = None  # the pass that made the latest step (None: empty)
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._sent_blocks: dict[str, int] = {}
        self.step_id = 0
        self.num_preemptions = 0
        self.num_dead_tokens = 0
        self.num_generated_tokens = 0  # output tokens committed, counted as they arrive (not as they are sent)
        self.last_dead_token_req_ids: list[str] = []
        self.total_scheduled_tokens = 0
        self.spec_stats = SpecDecodeStats()
        self._error_outputs: list[EngineCoreOutput] = []

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already running")
        self.check_fits(req)
        if req.grammar_future is not None:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def check_fits(self, req: Request) -> None:
        """Raise ValueError for a request the whole KV cache cannot hold at its longest (prompt plus
        max_tokens): it could never be admitted again once preempted, and would block the queue."""
        if self.config.encoder_only:
            return  # no KV cache
        bs, num_blocks = self.kv.block_size, self.kv.pool.num_blocks
        longest = req.num_prompt_tokens + (0 if req.pooling else req.max_tokens)
        if -(-longest // bs) > num_blocks:
            what = "prompt" if req.pooling or req.max_tokens == 0 else "max_tokens"
            raise ValueError(f"{what}: {req.num_prompt_tokens} prompt tokens plus max_tokens {req.max_tokens} need "
                             f"{-(-longest // bs)} KV blocks of {bs}, more than the whole cache ({num_blocks} "
                             "blocks); lower max_tokens or the prompt, or raise kv_cache_memory or num_kv_blocks")

    def finish_requests(self, request_ids: list[str] | set[str], status: RequestStatus) -> list[Request]:
        """Abort (or error) requests now: blocks freed at once, later outputs for them ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, status)
            done.append(req)
        return done

    def fail_all_requests(self) -> list[str]:
        """A step failed on the worker: end every request with an error and empty the prefix cache.

        Blocks are hashed when a step is scheduled, before its forward pass writes them, so after a
        failed step some cached blocks may hold KV that was never written. Telling those apart from
        good ones is not worth it for a rare error: every cached hash goes.
        """
        ids = list(self.requests)
        self.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        self.kv.reset_prefix_cache()
        return ids

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self._sent_blocks.pop(req.request_id, None)
        self._finished_since_last_step.add(req.request_id)
        del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- hooks the async scheduler overrides ---------------------------------------------------
    def _num_new_tokens(self, req: Request) -> int:
        return req.num_tokens - req.num_computed_tokens

    def _on_scheduled(self, req: Request, num_tokens: int) -> None:
        """Called after `num_computed_tokens` advanced for a scheduled request."""

    def _can_admit(self, req: Request) -> bool:
        return True

    def _structured_pending(self, req: Request) -> bool:
        return False

    # ---- schedule ------------------------------------------------------------------------------
    def schedule(self, grammars_ready: set[str] | None = None) -> SchedulerOutput:
        """One step's batch. `grammars_ready` names the waiting requests whose grammar may be used now
        (the engine's word, agreed across ranks where each rank schedules for itself); None: each
        request's own compile decides."""
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        draft_slots: dict[str, int] = {}
        spec_on = self._spec_on()
        self.kv.new_step()

        policy = self.step_policy
        decode_ready = policy.needs_decode_ready and self._decode_ready()
        self.last_step_phase = None
        for phase in policy.phases(decode_ready):
            self._schedule_pass(phase, num_scheduled, new_reqs, preempted, grammars_ready, draft_slots, spec_on)
            if num_scheduled:
                self.last_step_phase = phase
                break
        policy.record(self.last_step_phase)

        new_ids = {r.request_id for r in new_reqs}
        sent_blocks, on_scheduled, block_ids = self._sent_blocks, self._on_scheduled, self.kv.block_ids
        for req in self.running:  # runs per request per step: names bound once above
            rid = req.request_id
            n = num_scheduled.get(rid)
            if n is None:
                continue
            req.num_computed_tokens += n
            on_scheduled(req, n)
            if rid not in new_ids:
                sent = sent_blocks.get(rid, 0)
                fresh = block_ids(rid, sent)
                cached_reqs.append(CachedRequestData(rid, fresh, req.num_computed_tokens - n))
                if fresh:
                    sent_blocks[rid] = sent + len(fresh)

        out = self._make_output(num_scheduled, new_reqs, cached_reqs, preempted)
        out.num_draft_slots = {rid: d for rid, d in draft_slots.items() if rid in out.num_scheduled_tokens}
        self.spec_stats.num_draft_slots += sum(out.num_draft_slots.values())
        return out

    def _is_decode(self, req: Request) -> bool:
        """The request's next step computes only its newest token: a decode. Anything more (a prompt, or
        prompt plus outputs after preemption) is a prefill, even when a chunk boundary or a prefix-cache
        hit leaves one token of it."""
        return req.num_outputs_planned > 0 and self._num_new_tokens(req) <= 1

    def _decode_ready(self) -> bool:
        return any(self._is_decode(r) and self._num_new_tokens(r) > 0 for r in self.running)

    def _schedule_pass(self, phase: Phase, num_scheduled: dict[str, int], new_reqs: list[NewRequestData],
                       preempted: set[str], grammars_ready: set[str] | None, draft_slots: dict[str, int],
                       spec_on: bool) -> None:
        """Give tokens to running requests of `phase`, then (unless something was preempted) admit waiting
        ones, all under one fresh budget: the scheduler only runs a second pass when the first took nothing."""
        budget = self.config.max_num_batched_tokens
        max_prefills = self.step_policy.max_prefill_requests if phase is Phase.PREFILL else None
        num_prefills = 0
        # Runs per request per step: names bound once here.
        running, num_new_tokens, allocate = self.running, self._num_new_tokens, self.kv.allocate_slots
        cache_blocks, any_phase, want_decode = self.kv.cache_blocks, phase is Phase.ANY, phase is Phase.DECODE
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if not any_phase and self._is_decode(req) != want_decode:
                i += 1
                continue
            n = num_new_tokens(req)
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            if max_prefills is not None and num_prefills >= max_prefills:
                break
            drafts = self._num_draft_slots(req, n, budget) if spec_on else 0
            n += drafts
            while not allocate(req, n):
                if drafts:  # drop the drafts before preempting anyone for them
                    n, drafts = n - drafts, 0
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            num_scheduled[req.request_id] = n
            if drafts:
                draft_slots[req.request_id] = drafts
            # Capped at the committed tokens: drafts are never hashed into the prefix cache.
            cache_blocks(req, min(req.num_computed_tokens + n, len(req.all_token_ids)))
            budget -= n
            if max_prefills is not None and not self._is_decode(req):
                num_prefills += 1
            i += 1

        if preempted or phase is Phase.DECODE:
            return
        if max_prefills is not None:
            # Split: a request still mid-prefill (scheduled or not) is the one prefill in flight.
            max_prefills -= sum(1 for r in self.running if not self._is_decode(r) and self._num_new_tokens(r) > 0)
            if max_prefills <= 0:
                return
        self._admit_waiting(budget, num_scheduled, new_reqs, grammars_ready, max_prefills)

    def _spec_on(self) -> bool:
        """Drafts this step at all: speculation configured and the batch not above the cut-off where
        verifying drafts costs more than it saves."""
        cfg = self.config
        if cfg.num_spec_tokens <= 0:
            return False
        return cfg.spec_disable_batch_size is None or len(self.running) <= cfg.spec_disable_batch_size

    def _num_draft_slots(self, req: Request, n: int, budget: int) -> int:
        """Draft slots for a decode: k, capped so that every draft accepted plus the target's own token
        stays within max_tokens (and so max_model_len) counting tokens in flight, and within the budget."""
        if n != 1 or not req.use_spec or req.pooling or req.num_outputs_planned == 0:
            return 0  # not a decode (a prompt's last token samples the first output without drafts)
        room = req.max_tokens - req.num_outputs_planned - 1
        return max(0, min(self.config.num_spec_tokens, room, budget - 1))

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        """Requests that ended outside a step's output (a grammar that failed to compile)."""
        out, self._error_outputs = self._error_outputs, []
        return out

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData],
                       grammars_ready: set[str] | None, max_admits: int | None = None) -> int:
        skipped: list[Request] = []
        admitted = 0
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and (max_admits is None or admitted < max_admits):
            req = self.waiting[0]
            if not self._ready(req, grammars_ready) or not self._can_admit(req):
                popped = self.waiting.popleft()
                if not popped.finished:
                    skipped.append(popped)
                continue
            computed_blocks, num_cached, copy_from = self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_cached
            if n > budget and self.config.encoder_only:
                if num_scheduled:
                    break
                budget = n  # a prompt longer than the budget runs alone in its own step
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n, computed_blocks, num_cached):
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING and req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            add_running(self.running, req, self.config.scheduling_policy)
            admitted += 1
            num_scheduled[req.request_id] = n
            # Index the blocks now, so an identical prompt admitted later in this same step shares them.
            self.kv.cache_blocks(req, min(num_cached + n, req.num_tokens))
            budget -= n
            ids = self.kv.block_ids(req.request_id)
            self._sent_blocks[req.request_id] = len(ids)
            sp = None if req.pooling else req.sampling_params
            new_reqs.append(NewRequestData(req.request_id, list(req.all_token_ids), req.num_prompt_tokens,
                                           sp, ids, num_cached, req.eos_token_ids,
                                           -1 if copy_from is None else copy_from.block_id))
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _ready(self, req: Request, grammars_ready: set[str] | None) -> bool:
        """A request whose grammar is still compiling waits without blocking the queue."""
        if req.status != RequestStatus.WAITING_FOR_GRAMMAR:
            return True
        fut = req.grammar_future
        if not (fut.done() if grammars_ready is None else req.request_id in grammars_ready):
            return False
        try:
            req.grammar = self.structured.new_matcher(fut.result())
        except Exception as exc:  # a spec that failed to compile ends only this request
            logger.warning("request %s: grammar failed to compile: %s", req.request_id, exc)
            self._free(req, RequestStatus.FINISHED_ERROR)
            self._error_outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="error",
                                                        error=f"structured_outputs: {exc}"))
            return False
        req.status = RequestStatus.WAITING
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self._sent_blocks.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _make_output(self, num_scheduled: dict[str, int], new_reqs: list[NewRequestData],
                     cached_reqs: list[CachedRequestData], preempted: set[str]) -> SchedulerOutput:
        self.step_id += 1
        ordered = {r.request_id: num_scheduled[r.request_id] for r in new_reqs}
        ordered.update({c.request_id: num_scheduled[c.request_id] for c in cached_reqs})
        # Only an engine that has seen a structured request has a manager (and so matchers) at all.
        structured = ([] if self.structured is None else
                      [rid for rid in ordered if self._samples_with_grammar(self.requests[rid])])
        total = sum(ordered.values())
        self.total_scheduled_tokens += total
        out = SchedulerOutput(
            step_id=self.step_id, new_reqs=new_reqs, cached_reqs=cached_reqs, num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=total, finished_req_ids=self._finished_since_last_step,
            preempted_req_ids=preempted, structured_req_ids=structured,
            pending_structured_output=any(self._structured_pending(self.requests[r]) for r in structured))
        self._finished_since_last_step = set()
        return out

    def _samples_with_grammar(self, req: Request) -> bool:
        return req.grammar is not None and req.num_computed_tokens >= req.num_tokens

    # ---- apply a step's output -----------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        self.last_dead_token_req_ids = []
        scheduled = list(sched.num_scheduled_tokens)
        sampled = result.sampled_token_ids
        if result.req_ids != scheduled:  # rows in another order, or missing: look each one up
            row = result.index()
            sampled = [sampled[row[rid]] if rid in row else [] for rid in scheduled]
        requests, draft_slots = self.requests, sched.num_draft_slots
        for rid, tokens in zip(scheduled, sampled):
            req = requests.get(rid)
            if req is None:  # finished or aborted while this step was in flight
                if tokens:
                    self.num_dead_tokens += len(tokens)
                    self.last_dead_token_req_ids.append(rid)
                continue
            self._on_output(req, len(tokens), draft_slots.get(rid, 0) if draft_slots else 0)
            if result.prompt_logprobs:
                store_prompt_logprobs(req, result, rid)
            if tokens and result.num_drafted and rid in result.num_drafted:
                self._count_spec(result.num_drafted[rid], len(tokens) - 1)
            if req.pooling:
                if result.pooled and rid in result.pooled:
                    outputs.append(self._finish_pooling(req, result.pooled[rid]))
                continue
            out = self._append_tokens(req, tokens, result, rid)
            if out is not None:
                outputs.append(out)
        return outputs

    def _on_output(self, req: Request, num_tokens: int, draft_slots: int) -> None:
        """Called before a request's sampled tokens are appended: roll back the draft slots whose drafts
        were rejected or never proposed (their KV slots are rewritten by the next step, and their blocks
        stay with the request)."""
        if draft_slots and num_tokens and req.status == RequestStatus.RUNNING:
            req.num_computed_tokens -= draft_slots - (num_tokens - 1)

    def _count_spec(self, drafted: int, accepted: int) -> None:
        if drafted:
            st = self.spec_stats
            st.num_drafts += 1
            st.num_draft_tokens += drafted
            st.num_accepted_tokens += accepted

    def _append_tokens(self, req: Request, tokens: list[int], result: ModelRunnerOutput,
                       rid: str) -> EngineCoreOutput | None:
        if not tokens:
            return None
        new, status = append_tokens(req, tokens, rid)
        self.num_generated_tokens += len(new)
        if req.final_only and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if status is None:
            self.kv.cache_blocks(req, min(req.num_computed_tokens, len(req.all_token_ids)))
            if req.final_only:
                return None  # held back until the request finishes (Request.final_only)
        elif req.final_only:
            new = list(req.output_token_ids)
        logprobs = result.logprobs.get(rid) if result.logprobs else None
        if logprobs is not None:
            logprobs = logprobs[:len(new)]
        out = EngineCoreOutput(rid, new, logprobs, num_cached_tokens=req.num_cached_tokens,
                               first_token_time=req.first_token_time)
        if req.prompt_logprobs is not None:
            attach_prompt_logprobs(req, out)
        if status is not None:
            self._finish(req, status)
            out.finish_reason = status.value
            out.stop_reason = req.stop_reason
            if status == RequestStatus.FINISHED_ERROR:
                out.error = "sampled token rejected by the request's grammar"
        return out

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req, status)

    def _finish_pooling(self, req: Request, pooled: list[float]) -> EngineCoreOutput:
        self._finish(req, RequestStatus.FINISHED_STOPPED)
        return EngineCoreOutput(req.request_id, [], finish_reason="stop", pooled=pooled)
