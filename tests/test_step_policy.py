"""Prefill/decode policies (mixed, split, prefill-first) at scheduler level, against a scripted runner."""

from __future__ import annotations

import pytest

from forerun.core.async_scheduler import AsyncScheduler
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.scheduler import Scheduler, SchedulerConfig
from forerun.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from forerun.core.step_policy import StepPolicy
from forerun.request import EngineCoreRequest, Request
from forerun.sampling_params import SamplingParams
from tests.fake_runner import ScriptedRunner
from tests.test_scheduler import drive, tokens_by_request


class PhaseRunner(ScriptedRunner):
    """Also labels each step from the worker's side: P (only prefill work), D (only decodes: each row
    computes exactly the newest token of a request that has sampled before) or M (both)."""

    def __init__(self, eos_at: dict[str, int] | None = None) -> None:
        super().__init__(eos_at)
        self.kinds: list[str] = []

    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        kinds = {"P" for _ in so.new_reqs}
        for c in so.cached_reqs:
            known = self.known[c.request_id]  # before this step: prompt plus the worker's own samples
            decode = (so.num_scheduled_tokens[c.request_id] == 1 and c.num_computed_tokens == known - 1
                      and known > self.prompt[c.request_id])
            kinds.add("D" if decode else "P")
        self.kinds.append(kinds.pop() if len(kinds) == 1 else "M")
        return super().run(so)


def make(async_mode: bool, policy: str = "mixed", interleave: int = 1, budget: int = 8, blocks: int = 64,
         block_size: int = 4, seqs: int = 16) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=256,
                          prefill_decode_policy=policy, split_interleave_steps=interleave)
    kv = KVCacheManager(blocks, block_size, enable_caching=True)
    return (AsyncScheduler if async_mode else Scheduler)(cfg, kv)


def req(rid: str, n: int, max_tokens: int, base: int = 10) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(EngineCoreRequest(rid, [base + i for i in range(n)], sp, frozenset({2})), 256)


# A: 6-token prompt, 4 outputs; B: 10 tokens (longer than the budget of 8), 3 outputs; C: 3 tokens, 2 outputs.
WORKLOAD = (("A", 6, 4, 10), ("B", 10, 3, 50), ("C", 3, 2, 90))

EXPECTED = {
    # Phase-free: A's first decode shares a step with B's second chunk, and C's prompt with two decodes.
    ("mixed", 1): ([{"A": 6, "B": 2}, {"A": 1, "B": 7}, {"A": 1, "B": 1, "C": 3}, {"A": 1, "B": 1, "C": 1},
                    {"B": 1}], "PMMDD"),
    # One request's prefill per step, then a decode of everything decoding: B's two chunks are split by a
    # decode of A, and C (which arrived with the rest) waits until B is done.
    ("split", 1): ([{"A": 6}, {"A": 1}, {"B": 8}, {"A": 1}, {"B": 2}, {"A": 1, "B": 1}, {"C": 3},
                    {"B": 1, "C": 1}], "PDPDPDPD"),
    # Interleave 2: two prefill steps may run in a row while A waits to decode (A's, then B's first chunk;
    # later B's last chunk, then C's prompt).
    ("split", 2): ([{"A": 6}, {"B": 8}, {"A": 1}, {"B": 2}, {"C": 3}, {"A": 1, "B": 1, "C": 1},
                    {"A": 1, "B": 1}], "PPDPPDD"),
    # Prefill batches (several prompts under one budget) until no prefill is left, then decodes only.
    ("prefill-first", 1): ([{"A": 6, "B": 2}, {"B": 8}, {"C": 3}, {"A": 1, "B": 1, "C": 1}, {"A": 1, "B": 1},
                            {"A": 1}], "PPPDDD"),
}


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("policy,interleave", list(EXPECTED))
def test_step_sequence(policy, interleave, async_mode):
    sched = make(async_mode, policy, interleave)
    for rid, n, m, base in WORKLOAD:
        sched.add_request(req(rid, n, m, base))
    runner = PhaseRunner()
    outputs, _ = drive(sched, runner, async_mode)
    batches, kinds = EXPECTED[(policy, interleave)]
    assert runner.batches == batches
    assert "".join(runner.kinds) == kinds
    got, reasons = tokens_by_request(outputs)
    assert got == {rid: [100 + i for i in range(m)] for rid, _, m, _ in WORKLOAD}
    assert set(reasons.values()) == {"length"}
    assert sched.kv.num_free_blocks == 64


def test_split_holds_one_prefill_and_bounded_decode_stall():
    """Requests arriving while others decode: a prefill step never holds two requests, no step mixes, and
    with interleave 1 no two prefill steps run back to back while a request waits to decode."""
    sched = make(False, "split", 1, budget=5)
    runner = PhaseRunner()
    arrivals = {0: [("a", 7, 6)], 2: [("b", 12, 4), ("c", 3, 5)], 5: [("d", 9, 3), ("e", 4, 2)]}
    step, outputs = 0, []
    while step < 200 and (sched.has_unfinished_requests() or arrivals):
        for rid, n, m in arrivals.pop(step, []):
            sched.add_request(req(rid, n, m, base=20 * (ord(rid) - 96)))
        decoding_before = {r.request_id for r in sched.running if r.output_token_ids}
        so = sched.schedule()
        step += 1
        if so.is_empty:
            continue
        outputs.extend(sched.update_from_output(so, runner.run(so)))
        if runner.kinds[-1] == "P":
            assert len(so.num_scheduled_tokens) == 1
            if decoding_before and len(runner.kinds) > 1:
                assert runner.kinds[-2] == "D", f"two prefill steps in a row at step {step}: {runner.batches}"
    assert "M" not in runner.kinds and "D" in runner.kinds
    got, reasons = tokens_by_request(outputs)
    assert {k: len(v) for k, v in got.items()} == {"a": 6, "b": 4, "c": 5, "d": 3, "e": 2}
    assert set(reasons.values()) == {"length"}


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("policy", ["mixed", "split", "prefill-first"])
def test_chunking_prefix_cache_and_preemption(policy, async_mode):
    """A budget of 6 chunks every prompt, two prompts share 8 tokens (two blocks), and 9 blocks of 4 slots
    cannot hold all four requests: outputs match a roomy mixed run, with hits and preemptions counted."""
    def load(s: Scheduler) -> None:
        s.add_request(req("p", 10, 8, base=10))
        s.add_request(req("q", 11, 8, base=10))  # shares p's first 8 tokens
        s.add_request(req("r", 7, 8, base=60))
        s.add_request(req("s", 9, 6, base=90))

    ref = make(async_mode, "mixed", budget=6, blocks=64)
    load(ref)
    want, _ = tokens_by_request(drive(ref, ScriptedRunner(), async_mode)[0])
    small = make(async_mode, policy, budget=6, blocks=9)
    load(small)
    runner = PhaseRunner()
    got, reasons = tokens_by_request(drive(small, runner, async_mode)[0])
    assert got == want and set(reasons.values()) == {"length"}
    assert small.num_preemptions > 0
    assert small.kv.stats.hit_tokens >= 8
    assert small.kv.num_free_blocks == 9
    if policy != "mixed":
        assert "M" not in runner.kinds
    if policy == "split":
        prefill_steps = [b for b, k in zip(runner.batches, runner.kinds) if k == "P"]
        assert all(len(b) == 1 for b in prefill_steps)


def test_policy_validation():
    with pytest.raises(ValueError, match="prefill_decode_policy"):
        StepPolicy("decode-first")
    with pytest.raises(ValueError, match="split_interleave_steps"):
        StepPolicy("split", 0)
    with pytest.raises(ValueError, match="prefill_decode_policy"):
        make(False, "Split")


@pytest.mark.parametrize("policy", ["split", "prefill-first"])
def test_eos_costs_one_dead_token_in_async_under_every_policy(policy):
    for async_mode, dead in ((False, 0), (True, 1)):
        sched = make(async_mode, policy)
        sched.add_request(req("e", 4, max_tokens=10))
        sched.add_request(req("f", 12, max_tokens=3, base=40))  # a chunked prefill around e's decodes
        outputs, _ = drive(sched, PhaseRunner(eos_at={"e": 3}), async_mode)
        got, reasons = tokens_by_request(outputs)
        assert got == {"e": [100, 101, 102, 2], "f": [100, 101, 102]}
        assert reasons == {"e": "stop", "f": "length"}
        assert sched.num_dead_tokens == dead
        assert sched.kv.num_free_blocks == 64
