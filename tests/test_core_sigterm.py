"""Stopping an engine core in the middle of a long prefill: every in-flight request ends with an error and
the process exits within seconds, whether the core gets SIGTERM itself, its parent shuts it down, or the
server it serves is sent SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from forerun.config import EngineConfig
from forerun.engine.async_llm import AsyncLLM
from forerun.engine.core_proc import EngineCoreProcess, EngineDeadError
from forerun.request import EngineCoreRequest
from forerun.sampling_params import SamplingParams
from tests.conftest import save_tiny_model
from tests.serve_helpers import alive, descendants, start_server, stop_server

EXIT_WITHIN_S = 5.0
PROMPT = [100 + (i * 37) % 40000 for i in range(4000)]  # one prefill step of 4000 tokens


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Narrow but with a wide MLP: a 4000-token prefill is one step of several seconds (over ten on two
    busy cores), long enough that only an interrupted step ends in time."""
    return save_tiny_model(tmp_path_factory.mktemp("slow-llama"), smollm2_dir, hidden_size=128,
                           intermediate_size=16384, num_hidden_layers=6, max_position_embeddings=4096)


def config(folder: Path, **kw) -> EngineConfig:
    return EngineConfig(model=str(folder), num_kv_blocks=300, max_num_seqs=2, dtype="float32", **kw)


def test_sigterm_mid_prefill_errors_the_request_and_exits_fast(slow_dir):
    core = EngineCoreProcess(config(slow_dir), slow_dir)
    try:
        core.add_requests([EngineCoreRequest("long", PROMPT, SamplingParams(max_tokens=4))])
        time.sleep(1.5)  # the prefill step is under way
        assert core.is_alive()
        t0 = time.monotonic()
        os.kill(core.proc.pid, signal.SIGTERM)
        core.proc.join(EXIT_WITHIN_S)
        took = time.monotonic() - t0
        assert not core.is_alive(), f"core still running {took:.1f} s after SIGTERM"
        msgs = []
        while core.output.poll(500):
            msgs.append(core.decode(core.output.recv()))
        errors = [o for m in msgs for o in m.outputs if o.request_id == "long"]
        assert [(o.finish_reason, o.error) for o in errors] == [("error", "engine core was terminated (SIGTERM)")]
        assert any(m.fatal for m in msgs)
    finally:
        core.shutdown()


def test_shutdown_mid_prefill_is_quick_and_ends_the_request(slow_dir):
    async def scenario() -> tuple[float, BaseException | None]:
        engine = AsyncLLM(config(slow_dir))
        engine.start()
        got: list[BaseException] = []

        async def consume() -> None:
            try:
                async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=4), "long"):
                    pass
            except BaseException as exc:
                got.append(exc)

        task = asyncio.create_task(consume())
        await asyncio.sleep(1.5)
        t0 = time.monotonic()
        try:
            engine.shutdown()
            took = time.monotonic() - t0
        finally:
            if engine.core.is_alive():
                engine.core.proc.kill()
        await asyncio.wait_for(task, 5)
        assert not engine.core.is_alive()
        return took, got[0] if got else None

    took, err = asyncio.run(scenario())
    assert took < EXIT_WITHIN_S, f"shutdown took {took:.1f} s"
    assert isinstance(err, EngineDeadError), err


def test_server_sigterm_mid_prefill_answers_with_an_error_and_exits_fast(slow_dir):
    srv = start_server(slow_dir, "--num-kv-blocks", "300", "--max-num-seqs", "2", "--dtype", "float32",
                       "--distributed-executor-backend", "mp")
    kids = descendants(srv.proc.pid)
    reply: dict[str, object] = {}

    def request() -> None:
        try:
            r = httpx.post(f"{srv.base_url}/v1/completions", timeout=60,
                           json={"model": str(slow_dir), "prompt": PROMPT, "max_tokens": 4})
            reply["status"], reply["body"] = r.status_code, r.text
        except httpx.HTTPError as exc:
            reply["error"] = exc

    try:
        client = threading.Thread(target=request, daemon=True)
        client.start()
        time.sleep(2.5)  # the request reached the core and its prefill step runs
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        try:
            code = srv.proc.wait(EXIT_WITHIN_S)
        except Exception:
            code = None
        took = time.monotonic() - t0
        client.join(10)
        time.sleep(0.5)  # the resource tracker reports leaks as it exits, just after the server
        log = srv.log()
        assert code is not None, f"server still running {took:.1f} s after SIGTERM:\n{log}"
        assert not client.is_alive(), "the in-flight request hung"
        assert "error" in reply or (reply["status"] != 200 and "error" in str(reply["body"])), reply
        assert "leaked shared_memory" not in log, log
        assert not any(alive(k) for k in kids), log
    finally:
        stop_server(srv)
