"""Priority scheduling at scheduler level: queue order, preemption victim, and refusal under fcfs."""

from __future__ import annotations

import pytest

from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.request_queue import PriorityQueue, check_priority
from forerun.core.scheduler import Scheduler, SchedulerConfig
from forerun.request import EngineCoreRequest, Request, RequestStatus
from forerun.sampling_params import SamplingParams
from tests.fake_runner import ScriptedRunner
from tests.test_scheduler import drive, tokens_by_request


def make(policy: str, blocks: int = 64, seqs: int = 16, step_policy: str = "mixed") -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=64, max_model_len=256,
                          scheduling_policy=policy, prefill_decode_policy=step_policy)
    return Scheduler(cfg, KVCacheManager(blocks, 4, enable_caching=True))


def req(rid: str, priority: int, n: int = 4, max_tokens: int = 8, base: int = 10, arrival: float = 0.0) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(EngineCoreRequest(rid, [base + i for i in range(n)], sp, frozenset({2}), arrival,
                                     priority=priority), 256)


def test_lower_priority_value_is_admitted_first():
    sched = make("priority", seqs=1)
    for i, (rid, prio) in enumerate((("late-low", 5), ("urgent", -2), ("normal", 0), ("normal2", 0))):
        sched.add_request(req(rid, prio, base=20 * i, arrival=float(i), max_tokens=2))
    runner = ScriptedRunner()
    outputs, _ = drive(sched, runner, False)
    prefills = [rid for b in runner.batches for rid, n in b.items() if n == 4]  # whole 4-token prompts
    assert prefills == ["urgent", "normal", "normal2", "late-low"]
    got, _ = tokens_by_request(outputs)
    assert {k: len(v) for k, v in got.items()} == {"late-low": 2, "urgent": 2, "normal": 2, "normal2": 2}


def test_fcfs_keeps_arrival_order():
    sched = make("fcfs", seqs=1)
    for i, rid in enumerate(("a", "b", "c")):
        sched.add_request(req(rid, 0, base=20 * i, arrival=float(i), max_tokens=2))
    runner = ScriptedRunner()
    drive(sched, runner, False)
    assert [rid for b in runner.batches for rid, n in b.items() if n == 4] == ["a", "b", "c"]


def first_victim(sched: Scheduler) -> str:
    """Run until the first preemption and name the request it took."""
    runner = ScriptedRunner()
    for _ in range(100):
        so = sched.schedule()
        if so.preempted_req_ids:
            assert len(so.preempted_req_ids) == 1
            return next(iter(so.preempted_req_ids))
        sched.update_from_output(so, runner.run(so))
    raise AssertionError("no preemption happened")


# Three 4-token prompts of 8 outputs in 7 blocks of 4 slots: each needs a third block at its 9th token
# and only one is left, so the second request to ask preempts someone.
@pytest.mark.parametrize("step_policy", ["mixed", "split", "prefill-first"])
def test_preemption_takes_the_lowest_priority_request(step_policy):
    sched = make("priority", blocks=7, step_policy=step_policy)
    for i, (rid, prio) in enumerate((("r0", 0), ("r1", 5), ("r2", 1))):
        sched.add_request(req(rid, prio, base=20 * i, arrival=float(i)))
    assert first_victim(sched) == "r1"  # not the latest admitted (r2 under fcfs): the highest value
    assert sched.requests["r1"].status == RequestStatus.PREEMPTED


def test_preemption_ties_take_the_latest_arrival_and_fcfs_the_latest_admitted():
    tie = make("priority", blocks=7)
    for i, (rid, prio) in enumerate((("r0", 3), ("r1", 3), ("r2", 3))):
        tie.add_request(req(rid, prio, base=20 * i, arrival=float(i)))
    assert first_victim(tie) == "r2"
    fcfs = make("fcfs", blocks=7)
    for i, rid in enumerate(("r0", "r1", "r2")):
        fcfs.add_request(req(rid, 0, base=20 * i, arrival=float(i)))
    assert first_victim(fcfs) == "r2"


def test_preempted_request_returns_to_its_priority_place_and_outputs_survive():
    ref = make("priority")
    small = make("priority", blocks=7)
    for s in (ref, small):
        for i, (rid, prio) in enumerate((("r0", 0), ("r1", 5), ("r2", 1), ("w", 2))):
            s.add_request(req(rid, prio, base=20 * i, arrival=float(i)))
    want, _ = tokens_by_request(drive(ref, ScriptedRunner(), False)[0])
    got, reasons = tokens_by_request(drive(small, ScriptedRunner(), False)[0])
    assert small.num_preemptions > 0
    assert got == want and set(reasons.values()) == {"length"}
    assert small.kv.num_free_blocks == 7


def test_priority_queue_order_survives_every_insertion_call():
    q = PriorityQueue()
    a, b, c, d = (req(r, p, arrival=t) for r, p, t in (("a", 1, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", -1, 3.0)))
    q.append(a)
    q.append(c)
    q.appendleft(b)  # a preempted request goes back to its own place, not the front
    q.extendleft([d])
    assert [r.request_id for r in q] == ["d", "b", "a", "c"] and q[0] is d and len(q) == 4
    assert q.popleft() is d
    q.remove(a)
    assert [r.request_id for r in q] == ["b", "c"] and a not in q and c in q


def test_check_priority():
    check_priority(0, "fcfs")
    check_priority(-7, "priority")
    with pytest.raises(ValueError, match="priority: got 3 but priority scheduling is off"):
        check_priority(3, "fcfs")
    for bad in (1.5, True, "1"):
        with pytest.raises(ValueError, match="priority: must be an integer"):
            check_priority(bad, "priority")
