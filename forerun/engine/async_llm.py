"""The asyncio front end used by the server: tokenize here, step in the core process, detokenize here."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from forerun.config import EngineConfig
from forerun.engine.core_proc import CoreMessage, EngineCoreProcess, EngineDeadError, EngineStats
from forerun.engine.engine_core import read_model_config
from forerun.engine.input_processor import InputProcessor, Prompt
from forerun.engine.output_processor import OutputProcessor
from forerun.engine.tokenizer import Tokenizer
from forerun.heap import return_free_heap
from forerun.loader.model_source import resolve_model
from forerun.outputs import EmbeddingOutput, RequestOutput
from forerun.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_LIVENESS_POLL_MS = 500  # how often a quiet reader checks that the core process still runs


class _Aborted:
    """Queued by `abort`: the stream ends quietly."""


_Item = RequestOutput | EmbeddingOutput | BaseException | _Aborted


class AsyncLLM:
    """One engine core process shared by many concurrent `generate` (or, for pooling, `embed`) calls.

    Invariants: every `generate` call ends, with its finished output, an exception, or by the caller
    leaving (which aborts the request in the core); a request id is in use by at most one call at a
    time; once the core is dead every pending call ends with `EngineDeadError` and new calls raise it.
    All state is touched only from the event loop thread that called `start()`.
    """

    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        config.validate()
        self.config = config
        self.runner = config.runner
        self.model_folder: Path = resolve_model(config.model, show_progress=show_progress)
        # Refused here, in one line, before the core process and its workers start (the core checks again).
        config.check_model(read_model_config(self.model_folder))
        self.tokenizer = Tokenizer.from_folder(self.model_folder)
        return_free_heap()  # what parsing tokenizer.json left behind
        self.core = EngineCoreProcess(config, self.model_folder)
        self.max_model_len = self.core.info.max_model_len
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, self.core.info.vocab_size,
                                     config.scheduling_policy, refuse_overlong_max_tokens=True)
        self.outputs = OutputProcessor(self.tokenizer)
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._children: dict[str, list[str]] = {}
        self._core_to_req: dict[str, str] = {}
        self._sent: dict[str, list[tuple[int, int]]] = {}  # per completion: (text chars, tokens) handed out
        self._stats = EngineStats(kv_blocks_free=self.core.info.num_blocks, kv_blocks_total=self.core.info.num_blocks)
        self._stats_waiters: list[asyncio.Future[EngineStats]] = []
        self._reader: asyncio.Task[None] | None = None
        self._dead: str | None = None

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start routing core outputs; call from the event loop that will run `generate`."""
        if self._reader is None:
            sock = zmq.asyncio.Socket.from_socket(self.core.output)
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(sock), name="forerun-reader")

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def abort_all(self, reason: str) -> None:
        """Refuse new requests and end every pending one with `EngineDeadError(reason)`."""
        self._fail_all(reason, abort_in_core=True)

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "engine is shut down"
            self._fail_all(self._dead, abort_in_core=False)
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        self.core.shutdown()

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per step that touched the request (with deltas) until it finishes.

        Raises ValueError for bad input (also when the core refuses the request) and EngineDeadError.
        """
        self._check_can_add(request_id, "generate")
        text, ids, core_reqs = self.inputs.process(request_id, prompt, params, priority)
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        child_ids = [r.request_id for r in core_reqs]
        self._queues[request_id] = queue
        self._children[request_id] = child_ids
        self._core_to_req.update((cid, request_id) for cid in child_ids)
        self._sent[request_id] = [(0, 0)] * len(child_ids)
        self.outputs.add(request_id, text, ids, params, child_ids)
        finished = False
        try:
            try:
                self.core.add_requests(core_reqs)
            except EngineDeadError as exc:
                self._fail_all(f"engine is down: {exc}", abort_in_core=False)
                raise EngineDeadError(self._dead or str(exc)) from None
            while True:
                item = await queue.get()
                if isinstance(item, _Aborted):
                    finished = True  # already aborted in the core
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort(request_id)  # the caller left (disconnect, cancel) before the end
            self._forget(request_id)

    async def embed(self, prompt: Prompt, request_id: str) -> EmbeddingOutput:
        """The pooled vector of one input (needs runner "pooling").

        Raises ValueError for bad input (also when the core refuses it), EngineDeadError, and
        RuntimeError when the engine ended the request with an error.
        """
        self._check_can_add(request_id, "pooling")
        _, ids, core_req = self.inputs.process_pooling(request_id, prompt)
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._queues[request_id] = queue
        self._children[request_id] = [request_id]
        self._core_to_req[request_id] = request_id
        self.outputs.add_pooling(request_id, ids)
        finished = False
        try:
            try:
                self.core.add_requests([core_req])
            except EngineDeadError as exc:
                self._fail_all(f"engine is down: {exc}", abort_in_core=False)
                raise EngineDeadError(self._dead or str(exc)) from None
            item = await queue.get()
            finished = True
            if isinstance(item, _Aborted):
                raise RuntimeError(f"request {request_id!r} was aborted")
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, EmbeddingOutput)
            if item.error:
                raise RuntimeError(f"embedding failed: {item.error}")
            return item
        finally:
            if not finished:
                self._abort(request_id)  # the caller left (disconnect, cancel) before the vector came
            self._forget(request_id)

    def _check_can_add(self, request_id: str, runner: str) -> None:
        self.start()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.runner != runner:
            what = "embeddings need" if runner == "pooling" else "text generation needs"
            raise ValueError(f"runner: {what} a model served with --runner {runner}; this engine runs "
                             f"--runner {self.runner}")
        if request_id in self._queues or self.outputs.has(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")

    async def abort(self, request_id: str) -> None:
        """Stop a request: the core frees its blocks and its `generate` stream ends without more outputs."""
        self._abort(request_id)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(_Aborted())

    def get_stats(self) -> EngineStats:
        """The latest stats the core reported (at most ~100 ms old while busy)."""
        return self._stats

    async def fetch_stats(self, timeout_s: float = 2.0) -> EngineStats:
        """Ask the core for fresh stats; falls back to the latest ones on timeout."""
        self.start()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        fut: asyncio.Future[EngineStats] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        try:
            self.core.request_stats()
        except EngineDeadError as exc:
            self._fail_all(f"engine is down: {exc}", abort_in_core=False)
            raise EngineDeadError(self._dead or str(exc)) from None
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            return self._stats

    # ---- internals -----------------------------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        self._abort_in_core(self.outputs.abort(request_id))

    def _abort_in_core(self, core_ids: list[str]) -> None:
        if not core_ids or not self.core.is_alive():
            return
        try:
            self.core.abort_requests(core_ids)
        except EngineDeadError:
            pass  # nothing left to abort; the reader reports the death to every waiting caller

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._sent.pop(request_id, None)
        for cid in self._children.pop(request_id, []):
            self._core_to_req.pop(cid, None)
        self.outputs.abort(request_id)

    async def _read_loop(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                if not await sock.poll(_LIVENESS_POLL_MS):
                    if not self.core.is_alive():
                        self._fail_all(f"engine is down: the core process exited (code {self.core.proc.exitcode})",
                                       abort_in_core=False)
                        return
                    continue
                msg = self.core.decode(await sock.recv())
                if msg.fatal:
                    self._fail_all(f"engine is down: {msg.fatal}", abort_in_core=False)
                    return
                self._route(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("output reader failed")
            self._fail_all(f"engine is down: output reader failed: {exc!r}", abort_in_core=False)

    def _route(self, msg: CoreMessage) -> None:
        for core_id, why in msg.rejected:
            rid = self._core_to_req.get(core_id)
            if rid is not None and rid in self._queues:
                self._abort(rid)  # drop its siblings the core did accept
                self._queues[rid].put_nowait(ValueError(why))
        if msg.outputs:
            request_outputs, to_abort = self.outputs.process(msg.outputs)
            self._abort_in_core(to_abort)  # completions stopped by a stop string
            for out in request_outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None and isinstance(out, EmbeddingOutput):
                    queue.put_nowait(out)  # final and never mutated again: no copy needed
                elif queue is not None:
                    # The processor mutates its outputs in place: hand the caller a frozen copy, so a
                    # reader that falls behind still sees every delta.
                    queue.put_nowait(self._snapshot(out))
        if msg.stats is not None:
            self._stats = msg.stats
            waiters, self._stats_waiters = self._stats_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(msg.stats)

    def _snapshot(self, out: RequestOutput) -> RequestOutput:
        """A copy whose deltas are exactly what this caller has not seen yet.

        The processor leaves a completion's last delta in place on steps that did not touch it (a
        finished sibling, a child still waiting), so deltas are recomputed from the cumulative text and
        tokens, which only grow.
        """
        sent = self._sent[out.request_id]
        comps = []
        for i, c in enumerate(out.outputs):
            chars, toks = sent[i]
            comps.append(dataclasses.replace(
                c, token_ids=list(c.token_ids), delta_text=c.text[chars:], delta_token_ids=c.token_ids[toks:],
                logprobs=None if c.logprobs is None else list(c.logprobs)))
            sent[i] = (len(c.text), len(c.token_ids))
        return dataclasses.replace(out, outputs=comps, metrics=dict(out.metrics))

    def _fail_all(self, reason: str, abort_in_core: bool) -> None:
        if self._dead is None:
            self._dead = reason
            # abort_in_core: an orderly stop (shutdown signal); otherwise the core died under us.
            logger.log(logging.INFO if abort_in_core else logging.ERROR, "%s", reason)
        for rid, queue in list(self._queues.items()):
            if abort_in_core:
                self._abort(rid)
            queue.put_nowait(EngineDeadError(reason))
        waiters, self._stats_waiters = self._stats_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))




__all__ = ["AsyncLLM", "EngineDeadError", "EngineStats"]
