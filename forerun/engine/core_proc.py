"""The engine core in its own process: a busy step loop behind two ZMQ sockets.

The API process pushes pickled commands (add, abort, stats, shutdown) to the core and pulls
msgpack-encoded `CoreMessage`s back: the step's `EngineCoreOutput`s, rejections of requests the core
refused, and a small `EngineStats` record. Commands are pickled because `SamplingParams` carries
free-form fields (`extra`, structured-output specs); the hot return path is typed msgpack (msgspec).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import msgspec
import zmq

from forerun.config import EngineConfig
from forerun.executor.spawn import PythonChild
from forerun.heap import settle_start_garbage
from forerun.outputs import EngineCoreOutput
from forerun.request import EngineCoreRequest

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1  # how often a busy core reports its stats
SHUTDOWN_GRACE_S = 1.5  # how long the parent lets the core stop on its own before SIGTERM ends it at once
_IDLE_POLL_MS = 100  # an idle core wakes this often to see whether its parent is still alive
HEALTH_INTERVAL_S = 0.5  # how often the core checks that its workers still run (also right after a failed step)


class EngineDeadError(RuntimeError):
    """The engine core is gone (crashed or shut down); no request can be served."""


class EngineStats(msgspec.Struct):
    """A snapshot of the core's scheduler and KV cache; counters are totals since the core started."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_dead_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_spec_drafts: int = 0  # verification rows that carried drafts
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0


class CoreInfo(msgspec.Struct):
    """What the API process needs to know about the loaded model, sent once when the core is ready."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    async_mode: bool


class CoreMessage(msgspec.Struct):
    """One message from the core. `fatal` means the core is exiting and serves nothing more."""

    outputs: list[EngineCoreOutput] = []
    rejected: list[tuple[str, str]] = []  # (core request id, why) for requests the core refused
    stats: EngineStats | None = None
    ready: CoreInfo | None = None
    fatal: str | None = None


# ---- the child ----------------------------------------------------------------------------------

class _Terminated(BaseException):
    """Raised in the core's main thread by SIGTERM: stop now, even in the middle of a long step.

    A BaseException, so no `except Exception` on the way (a step's error handling) swallows it.
    """


def _raise_terminated(signum: int, frame: Any) -> None:
    # One shot: a second SIGTERM while the core winds down must not interrupt the wind-down itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated()


def run_engine_core(config: EngineConfig, model_folder: Path, in_addr: str, out_addr: str,
                    parent_pid: int) -> None:
    """Process entry point: build the core, report ready (or fatal), then step until told to stop.

    SIGTERM (the parent's shutdown when the core did not stop in time, or a supervisor) ends the core at
    once, also mid-step: every request still pending ends with an error, the workers are killed, and the
    process exits without waiting for the step.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the parent decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_terminated)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    # Unbounded queue: a send never blocks, so a core whose parent died still reaches its parent check.
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(out_addr)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(in_addr)
    encoder = msgspec.msgpack.Encoder()
    core = None
    terminated = False
    try:
        try:
            core = _build_core(config, model_folder)
            out.send(encoder.encode(CoreMessage(ready=CoreInfo(core.max_model_len, core.vocab_size, core.num_blocks,
                                                               core.async_mode))))
            _CoreLoop(core, inp, out, encoder, parent_pid).run()
            _end_pending(core, out, encoder, "engine core is shutting down")
        except _Terminated:
            terminated = True
            logger.warning("SIGTERM: ending every pending request and exiting now")
            _end_pending(core, out, encoder, "engine core was terminated (SIGTERM)")
            out.send(encoder.encode(CoreMessage(fatal="engine core was terminated (SIGTERM)")))
        except Exception as exc:  # anything here leaves the core unusable: say why, then exit
            logger.exception("engine core failed")
            out.send(encoder.encode(CoreMessage(fatal=f"engine core failed: {exc!r}")))
        if core is not None and not terminated:
            try:
                core.shutdown()
            except Exception:
                logger.exception("engine core shutdown failed")
    except _Terminated:  # SIGTERM during the orderly shutdown: finish it the quick way
        terminated = True
    # From here on only quick steps remain; a late SIGTERM must not cut them short (the parent kills
    # a core that takes too long).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if terminated and core is not None:
        core.shutdown(now=True)  # the workers may be mid-step: kill them rather than wait
    inp.close()
    out.close()  # LINGER: the messages above still reach the parent
    ctx.term()
    if terminated:
        # A worker thread may still be inside the step; exiting normally would wait for it to finish.
        logging.shutdown()
        os._exit(128 + signal.SIGTERM)


def _end_pending(core: Any, out: zmq.Socket, encoder: msgspec.msgpack.Encoder, reason: str) -> None:
    """Tell the parent that every request the core still holds ends now, with an error."""
    ids = list(core.scheduler.requests) if core is not None else []
    if ids:
        outs = [EngineCoreOutput(rid, [], finish_reason="error", error=reason) for rid in ids]
        out.send(encoder.encode(CoreMessage(outputs=outs)))


def _build_core(config: EngineConfig, model_folder: Path) -> Any:
    """The engine core of this process, with what its start left frozen (the process is the core's own)."""
    # Imported here so the API process never imports torch through this module.
    from forerun.engine.engine_core import EngineCore
    from forerun.engine.llm_engine import make_structured_manager
    if config.runner != "generate":
        core = EngineCore(config, model_folder, None)
    else:
        built: list[Any] = []
        # A factory, not a manager: EngineCore builds it on the first structured request (importing the
        # grammar library costs about a second), with the vocabulary size the core read from the model.
        built.append(EngineCore(config, model_folder,
                                lambda: make_structured_manager(model_folder, built[0].vocab_size)))
        core = built[0]
    settle_start_garbage(freeze=True)
    return core


class _CoreLoop:
    """Polls commands without blocking while there is work, steps, and reports.

    Invariant: every request the core accepted ends with a finished output (done, aborted or error),
    and every request it refused is reported in `rejected`.
    """

    def __init__(self, core: Any, inp: zmq.Socket, out: zmq.Socket, encoder: msgspec.msgpack.Encoder,
                 parent_pid: int) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.encoder = encoder
        self.parent_pid = parent_pid
        self.stopping = False
        self.stats_wanted = False
        self.rejected: list[tuple[str, str]] = []
        self.steps = 0
        self.last_stats = 0.0
        self.last_health = time.monotonic()

    def run(self) -> None:
        from forerun.engine.engine_core import EngineStepError
        while not self.stopping:
            busy = self.core.has_unfinished_requests()
            self._drain_commands(0 if busy else _IDLE_POLL_MS)
            if os.getppid() != self.parent_pid:
                logger.warning("parent process %d is gone; engine core exits", self.parent_pid)
                return
            if self.stopping:
                return
            outputs: list[EngineCoreOutput] = []
            if self.core.has_unfinished_requests():
                try:
                    outputs = self.core.run_step()
                except EngineStepError as exc:
                    outputs = exc.outputs  # every pending request ends with an error; keep serving
                    self.last_health = 0.0  # unless the step failed because a worker is gone
                self.steps += 1
            self._send(outputs, went_idle=busy and not self.core.has_unfinished_requests())
            self._check_workers()

    def _check_workers(self) -> None:
        """Raise (ending the core with a fatal message) when a worker died.

        A dead worker fails the step in flight, but the core would otherwise look healthy until the
        next request reached the executor: /health must say so at once, so a supervisor restarts us.
        """
        now = time.monotonic()
        if now - self.last_health >= HEALTH_INTERVAL_S:
            self.last_health = now
            self.core.check_health()

    def _drain_commands(self, timeout_ms: int) -> None:
        if not self.inp.poll(timeout_ms):
            return
        while True:
            try:
                raw = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(*pickle.loads(raw))

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            for req in payload:
                try:
                    self.core.add_request(req)
                except Exception as exc:  # a bad request must not take the core down
                    self.rejected.append((req.request_id, str(exc)))
        elif kind == "abort":
            self.core.abort_requests(list(payload))
        elif kind == "stats":
            self.stats_wanted = True
        elif kind == "shutdown":
            self.stopping = True
        else:
            logger.error("unknown command %r", kind)

    def _send(self, outputs: list[EngineCoreOutput], went_idle: bool) -> None:
        now = time.monotonic()
        stats = None
        if self.stats_wanted or went_idle or (outputs and now - self.last_stats >= STATS_INTERVAL_S):
            stats, self.stats_wanted, self.last_stats = self.stats(), False, now
        if outputs or stats is not None or self.rejected:
            self.out.send(self.encoder.encode(CoreMessage(outputs, self.rejected, stats)))
            self.rejected = []

    def stats(self) -> EngineStats:
        sched = self.core.scheduler
        kv = sched.kv
        total = kv.pool.num_blocks
        return EngineStats(sched.num_running, sched.num_waiting, total - kv.num_free_blocks, kv.num_free_blocks,
                           total, kv.stats.hit_rate, sched.num_preemptions, sched.num_dead_tokens,
                           sched.num_generated_tokens, self.steps, sched.spec_stats.num_drafts,
                           sched.spec_stats.num_draft_tokens, sched.spec_stats.num_accepted_tokens)


# ---- the parent's handle ------------------------------------------------------------------------

class EngineCoreProcess:
    """Starts the core process and talks to it.

    Invariants: after construction the core has loaded the model (`info` is set) or construction
    raised; the child never outlives `shutdown()`, this object, or the parent process (it polls its
    parent's pid); the socket files live in a private temporary directory removed on shutdown.
    """

    def __init__(self, config: EngineConfig, model_folder: Path, startup_timeout_s: float = 900.0) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="forerun-ipc-")
        in_addr, out_addr = f"ipc://{self._tmpdir}/in", f"ipc://{self._tmpdir}/out"
        self._ctx = zmq.Context()
        self.input = self._ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.LINGER, 0)
        # Unbounded queue: a non-blocking send then fails (zmq.Again) only when the core is gone.
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.bind(in_addr)
        self.output = self._ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(out_addr)
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        # A fresh interpreter that runs forerun's code only, so a script without a main guard, or on stdin,
        # works too; it may start worker processes of its own (tensor parallel).
        self.proc = PythonChild(run_engine_core, (config, model_folder, in_addr, out_addr, os.getpid()))
        self._finalizer = weakref.finalize(self, _reap, self.proc, self._tmpdir)
        try:
            self.info = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout_s: float) -> CoreInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.output.poll(200):
                msg = self.decode(self.output.recv())
                if msg.fatal:
                    raise RuntimeError(msg.fatal)
                if msg.ready is not None:
                    return msg.ready
            elif not self.proc.is_alive():
                raise RuntimeError(f"engine core process exited during startup (exit code {self.proc.exitcode})")
        raise RuntimeError(f"engine core did not become ready within {timeout_s:.0f} s")

    def decode(self, raw: bytes) -> CoreMessage:
        return self._decoder.decode(raw)

    def _send(self, kind: str, payload: Any = None) -> None:
        """Never blocks; raises EngineDeadError when the core process is not there to receive."""
        if self.input.closed:
            raise EngineDeadError("engine core is shut down")
        try:
            self.input.send(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError(f"engine core is not reachable (exit code {self.proc.exitcode})") from None

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        self._send("add", reqs)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send("abort", list(request_ids))

    def request_stats(self) -> None:
        self._send("stats")

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def shutdown(self, timeout_s: float = SHUTDOWN_GRACE_S) -> None:
        """Ask the core to stop; if it has not exited within `timeout_s` (it reads commands only between
        steps, and a long prefill is one step), SIGTERM ends it at once, and a kill follows if even that
        fails. In-flight requests end with an error either way."""
        if self.proc.is_alive():
            try:
                self._send("shutdown")
            except (EngineDeadError, zmq.ZMQError):
                pass
            self.proc.join(timeout_s)
        self._finalizer()
        if not self.input.closed:
            self.input.close()
            self.output.close()
            self._ctx.term()


def _reap(proc: PythonChild, tmpdir: str) -> None:
    if proc.is_alive():
        proc.terminate()  # the core ends its requests and workers and exits at once (see run_engine_core)
        proc.join(3)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    shutil.rmtree(tmpdir, ignore_errors=True)
