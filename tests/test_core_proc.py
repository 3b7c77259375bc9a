"""The core process's step loop with a scripted core: rejections, step errors, recovery, stats, shutdown."""

from __future__ import annotations

import os
import pickle
import threading
from types import SimpleNamespace

import msgspec
import zmq

from forerun.core.spec_stats import SpecDecodeStats
from forerun.engine.core_proc import CoreMessage, _CoreLoop
from forerun.engine.engine_core import EngineStepError
from forerun.outputs import EngineCoreOutput
from forerun.request import EngineCoreRequest
from forerun.sampling_params import SamplingParams


class ScriptedCore:
    """Fails its first step with EngineStepError; later steps finish every request with one token."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.failed_once = False
        kv = SimpleNamespace(num_free_blocks=10, pool=SimpleNamespace(num_blocks=10), stats=SimpleNamespace(hit_rate=0.5))
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0, num_dead_tokens=0, kv=kv,
                                         spec_stats=SpecDecodeStats(), num_generated_tokens=0)

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.prompt_token_ids == [666]:
            raise ValueError("prompt: rejected by the core")
        self.pending.append(req.request_id)

    def abort_requests(self, ids: list[str]) -> None:
        self.pending = [r for r in self.pending if r not in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def check_health(self) -> None:
        """Its workers are fine: the failed step was the step's own fault, so the loop keeps serving."""

    def run_step(self) -> list[EngineCoreOutput]:
        ids, self.pending = self.pending, []
        if not self.failed_once:
            self.failed_once = True
            raise EngineStepError("boom", [EngineCoreOutput(r, [], finish_reason="error", error="boom") for r in ids])
        self.scheduler.num_generated_tokens += len(ids)  # as the real scheduler counts tokens it commits
        return [EngineCoreOutput(r, [7], finish_reason="length") for r in ids]


def test_core_loop_survives_step_error_and_reports_rejections():
    ctx = zmq.Context()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_core.bind("inproc://in")
    core_in.connect("inproc://in")
    from_core.bind("inproc://out")
    core_out.connect("inproc://out")
    loop = _CoreLoop(ScriptedCore(), core_in, core_out, msgspec.msgpack.Encoder(), os.getppid())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    decoder = msgspec.msgpack.Decoder(CoreMessage)

    def send(kind: str, payload: object = None) -> None:
        to_core.send(pickle.dumps((kind, payload)))

    def recv_until(pred) -> list[CoreMessage]:
        got = []
        while True:
            assert from_core.poll(5000), "core loop sent nothing"
            got.append(decoder.decode(from_core.recv()))
            if pred(got[-1]):
                return got

    def req(rid: str, ids: list[int]) -> EngineCoreRequest:
        return EngineCoreRequest(rid, ids, SamplingParams(max_tokens=1))

    try:
        send("add", [req("a", [1, 2]), req("bad", [666]), req("b", [3])])
        msgs = recv_until(lambda m: any(o.request_id == "b" for o in m.outputs))
        assert [r for m in msgs for r in m.rejected] == [("bad", "prompt: rejected by the core")]
        errors = {o.request_id: o for m in msgs for o in m.outputs}
        assert set(errors) == {"a", "b"} and all(o.finish_reason == "error" and o.error == "boom" for o in errors.values())
        send("add", [req("c", [4])])  # the loop keeps serving after a failed step
        msgs = recv_until(lambda m: any(o.request_id == "c" for o in m.outputs))
        out = [o for m in msgs for o in m.outputs if o.request_id == "c"][0]
        assert out.new_token_ids == [7] and out.finish_reason == "length"
        send("stats")
        stats = recv_until(lambda m: m.stats is not None)[-1].stats
        assert stats.kv_blocks_total == 10 and stats.prefix_cache_hit_rate == 0.5 and stats.num_generated_tokens == 1
        send("shutdown")
        thread.join(5)
        assert not thread.is_alive()
    finally:
        for s in (to_core, core_in, core_out, from_core):
            s.close(linger=0)
        ctx.term()
