"""Scheduler and async scheduler against a scripted runner: budgets, chunking, stops, dead tokens."""

from __future__ import annotations

import time
from collections import deque

import pytest

from forerun.core.async_scheduler import AsyncScheduler
from forerun.core.block_pool import KVBlock
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.scheduler import Scheduler, SchedulerConfig
from forerun.core.scheduler_output import CachedRequestData
from forerun.request import EngineCoreRequest, Request, RequestStatus
from forerun.sampling_params import SamplingParams
from forerun.worker.input_batch import RowState
from tests.fake_runner import ScriptedRunner


def make(async_mode: bool, budget: int = 64, blocks: int = 64, block_size: int = 4, seqs: int = 16):
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=256)
    kv = KVCacheManager(blocks, block_size, enable_caching=True)
    return (AsyncScheduler if async_mode else Scheduler)(cfg, kv)


def req(rid: str, n: int, max_tokens: int = 4, base: int = 10, **kw) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return Request(EngineCoreRequest(rid, [base + i for i in range(n)], sp, frozenset({2})), 256)


def drive(sched: Scheduler, runner: ScriptedRunner, async_mode: bool, max_steps: int = 200):
    """The engine loop in miniature: depth-2 queue in async mode, schedule->run->update otherwise."""
    outputs, queue, first_returns = [], deque(), []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not queue:
            break
        if async_mode:
            pushed = False
            if sched.has_unfinished_requests():
                so = sched.schedule()
                if not so.is_empty:
                    queue.append((so, runner.run(so)))
                    pushed = True
            if pushed and len(queue) < 2:  # fill the queue before collecting
                first_returns.append(None)
                continue
            if not queue:
                continue
            so, ro = queue.popleft()
        else:
            so = sched.schedule()
            ro = runner.run(so)
        outputs.extend(sched.update_from_output(so, ro))
    return outputs, first_returns


def tokens_by_request(outputs):
    got: dict[str, list[int]] = {}
    reasons = {}
    for o in outputs:
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finish_reason:
            reasons[o.request_id] = o.finish_reason
    return got, reasons


@pytest.mark.parametrize("async_mode", [False, True])
def test_chunk_budget_sequence(async_mode):
    sched = make(async_mode, budget=10)
    sched.add_request(req("A", 12, max_tokens=3))
    sched.add_request(req("B", 12, max_tokens=3, base=50))
    runner = ScriptedRunner()
    outputs, first = drive(sched, runner, async_mode)
    # Prompt tokens go (10 of A), (2 of A + 8 of B), (4 of B); A's first decode rides along with B's
    # last chunk because the budget has room for it, then one token each per step (A finishes first).
    assert runner.batches == [{"A": 10}, {"A": 2, "B": 8}, {"A": 1, "B": 4}, {"A": 1, "B": 1}, {"B": 1}]
    got, reasons = tokens_by_request(outputs)
    assert got == {"A": [100, 101, 102], "B": [100, 101, 102]}
    assert reasons == {"A": "length", "B": "length"}
    if async_mode:
        assert first[:1] == [None], "the first async step returns nothing"


@pytest.mark.parametrize("async_mode", [False, True])
def test_max_tokens_exact_and_no_extra_steps(async_mode):
    sched = make(async_mode)
    lens = {"a": (5, 7), "b": (9, 1), "c": (3, 4)}
    for k, (rid, (p, m)) in enumerate(lens.items()):
        sched.add_request(req(rid, p, max_tokens=m, base=100 * k))  # no shared prefix
    runner = ScriptedRunner()
    outputs, _ = drive(sched, runner, async_mode)
    got, reasons = tokens_by_request(outputs)
    assert {k: len(v) for k, v in got.items()} == {k: m for k, (p, m) in lens.items()}
    assert set(reasons.values()) == {"length"}
    assert sched.total_scheduled_tokens == sum(p + m - 1 for p, m in lens.values())
    assert sched.num_dead_tokens == 0
    assert sched.kv.num_free_blocks == 64


def test_eos_costs_one_dead_token_in_async_only():
    for async_mode, dead in ((False, 0), (True, 1)):
        sched = make(async_mode)
        sched.add_request(req("e", 4, max_tokens=10))
        outputs, _ = drive(sched, ScriptedRunner(eos_at={"e": 3}), async_mode)
        got, reasons = tokens_by_request(outputs)
        assert got["e"] == [100, 101, 102, 2] and reasons["e"] == "stop"
        assert sched.num_dead_tokens == dead
        assert sched.kv.num_free_blocks == 64


@pytest.mark.parametrize("async_mode", [False, True])
def test_preemption_keeps_outputs(async_mode):
    # 6 blocks of 4 slots: three requests of 8 + 8 tokens cannot all fit.
    ref = make(async_mode, blocks=64)
    small = make(async_mode, blocks=6)
    for s in (ref, small):
        for i in range(3):
            s.add_request(req(f"r{i}", 8, max_tokens=8, base=10 * i))
    want, _ = tokens_by_request(drive(ref, ScriptedRunner(), async_mode)[0])
    got, reasons = tokens_by_request(drive(small, ScriptedRunner(), async_mode)[0])
    assert small.num_preemptions > 0
    assert got == want and set(reasons.values()) == {"length"}
    assert small.kv.num_free_blocks == 6


@pytest.mark.parametrize("async_mode", [False, True])
def test_abort_frees_blocks_and_ignores_late_output(async_mode):
    sched = make(async_mode)
    sched.add_request(req("x", 6, max_tokens=50))
    sched.add_request(req("y", 6, max_tokens=5, base=40))
    runner = ScriptedRunner()
    so = sched.schedule()
    ro = runner.run(so)
    sched.update_from_output(so, ro)
    so2 = sched.schedule()
    ro2 = runner.run(so2)
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(so2, ro2)
    assert all(o.request_id != "x" for o in outs)
    assert "x" in sched.schedule().finished_req_ids
    assert sched.kv.block_ids("x") == []


def test_prefix_cache_shares_identical_prompts_in_one_step():
    sched = make(False, block_size=4)
    sched.add_request(req("p", 13))
    sched.add_request(req("q", 13))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"p": 13, "q": 1}
    pb, qb = sched.kv.block_ids("p"), sched.kv.block_ids("q")
    assert pb[:3] == qb[:3] and pb[3] != qb[3]
    assert sched.requests["q"].num_cached_tokens == 12


@pytest.mark.parametrize("async_mode", [False, True])
def test_prefix_cache_copies_a_cached_last_block_and_computes_only_the_last_token(async_mode):
    sched = make(async_mode, block_size=4)
    sched.add_request(req("p", 12))
    sched.add_request(req("q", 12))
    so = sched.schedule()
    # In p's own step its blocks are not computed yet: q shares them but copies none.
    assert so.num_scheduled_tokens == {"p": 12, "q": 4} and [n.copy_block for n in so.new_reqs] == [-1, -1]
    sched.update_from_output(so, ScriptedRunner().run(so))
    sched.add_request(req("r", 12))
    sched.add_request(req("s", 13))  # its last block is partial: nothing to copy, its 12 cached tokens shared
    so = sched.schedule()
    new = {n.request_id: n for n in so.new_reqs}
    assert so.num_scheduled_tokens["r"] == 1 and new["r"].num_computed_tokens == 11
    pb, rb = sched.kv.block_ids("p"), sched.kv.block_ids("r")
    assert rb[:2] == pb[:2] and new["r"].copy_block == pb[2] and rb[2] not in pb
    assert so.num_scheduled_tokens["s"] == 1 and new["s"].copy_block == -1
    assert sched.kv.block_ids("s")[:3] == pb[:3]
    assert sched.requests["r"].num_cached_tokens == 11 and sched.requests["s"].num_cached_tokens == 12


def test_async_never_schedules_past_max_tokens():
    sched = make(True)
    sched.add_request(req("m", 4, max_tokens=2))
    so1 = sched.schedule()  # prefill: token 1 in flight
    so2 = sched.schedule()  # decode of token 1: token 2 in flight
    assert so1.num_scheduled_tokens == {"m": 4} and so2.num_scheduled_tokens == {"m": 1}
    assert sched.schedule().is_empty  # max_tokens reached counting placeholders
    assert sched.requests["m"].num_output_placeholders == 2


def test_failed_step_leaves_no_unwritten_block_in_the_prefix_cache():
    sched = make(False, block_size=4)
    sched.add_request(req("p", 13))
    assert sched.schedule().num_scheduled_tokens == {"p": 13}  # hashes 3 full blocks before any forward
    assert sched.fail_all_requests() == ["p"]  # the forward failed: those blocks were never written
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 64
    sched.add_request(req("q", 13))
    assert sched.schedule().num_scheduled_tokens == {"q": 13}
    assert sched.requests["q"].num_cached_tokens == 0


@pytest.mark.parametrize("async_mode", [False, True])
def test_final_only_requests_are_sent_once_with_every_token(async_mode):
    """A final-only request with no stop strings and no logprobs is sent once, when it ends, holding all
    its tokens and the time of its first; with stop strings or logprobs it is sent every step, as a
    streamed request is. Tokens and finish reasons are those of the same requests streamed, preempted
    ones included (6 blocks of 4 slots cannot hold four requests of 8 + 8 tokens)."""
    kinds = {"held": dict(output_kind="final_only"), "stops": dict(output_kind="final_only", stop=["x"]),
             "logprobs": dict(output_kind="final_only", logprobs=1), "stream": {}}
    runs = {}
    for held_back in (False, True):
        sched = make(async_mode, blocks=6)
        for k, (rid, kw) in enumerate(kinds.items()):
            sched.add_request(req(rid, 8, max_tokens=8, base=30 * k, **(kw if held_back else {})))
        eos = {"stops": 5}
        before = time.monotonic()
        outputs, _ = drive(sched, ScriptedRunner(eos_at=eos), async_mode)
        runs[held_back] = (outputs, tokens_by_request(outputs))
        assert sched.num_preemptions > 0
        assert sched.num_generated_tokens == sum(len(t) for t in runs[held_back][1][0].values())
    outputs, (got, reasons) = runs[True]
    assert (got, reasons) == runs[False][1]
    assert got["held"] == [100 + i for i in range(8)] and reasons["stops"] == "stop"
    per_request = {rid: [o for o in outputs if o.request_id == rid] for rid in kinds}
    assert len(per_request["held"]) == 1 and per_request["held"][0].finish_reason == "length"
    first = per_request["held"][0].first_token_time
    assert first is not None and before <= first <= time.monotonic()
    for rid in ("stops", "logprobs", "stream"):
        assert [len(o.new_token_ids) for o in per_request[rid]] == [1] * len(got[rid])
        assert all(o.first_token_time is None for o in per_request[rid])


@pytest.mark.parametrize("async_mode", [False, True])
def test_stop_test_reads_eos_stop_ids_and_min_tokens_as_the_request_asked(async_mode):
    """The stop test's fields are copied onto the request when it is made: EOS ends a request unless it asks
    ignore_eos, a stop token id ends it with that token as its stop reason, and neither counts before
    min_tokens outputs."""
    cases = {"eos": ({}, "stop", None, 3), "ignore": (dict(ignore_eos=True), "length", None, 8),
             "stop_id": (dict(stop_token_ids=[102]), "stop", 102, 3),
             "min": (dict(min_tokens=5), "length", None, 8)}
    sched = make(async_mode)
    for rid, (kw, _, _, _) in cases.items():
        sched.add_request(req(rid, 4, max_tokens=8, **kw))
    outputs, _ = drive(sched, ScriptedRunner(eos_at={"eos": 2, "ignore": 2, "min": 2}), async_mode)
    got, reasons = tokens_by_request(outputs)
    stop_reasons = {o.request_id: o.stop_reason for o in outputs if o.finish_reason}
    for rid, (_, reason, stop_reason, count) in cases.items():
        assert (reasons[rid], stop_reasons[rid], len(got[rid])) == (reason, stop_reason, count), rid
    assert got["stop_id"][-1] == 102 and got["eos"][-1] == 2


def test_per_request_state_has_no_instance_dict():
    """The engine reads these per request and step just after the weights have streamed through the
    caches; slots keep each in fewer cache lines (forerun.request.Request)."""
    objs = [req("r", 4), KVBlock(0), CachedRequestData("r", [], 0),
            RowState("r", 0, 4, 4, 0, None, frozenset(), [])]
    assert [type(o).__name__ for o in objs if hasattr(o, "__dict__")] == []
