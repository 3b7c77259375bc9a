"""A synchronous engine front end: text in, RequestOutputs out, one step per call."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from forerun.config import EngineConfig
from forerun.engine.engine_core import EngineCore, EngineStepError
from forerun.engine.input_processor import InputProcessor, Prompt
from forerun.engine.output_processor import OutputProcessor
from forerun.engine.tokenizer import Tokenizer
from forerun.loader.model_source import resolve_model
from forerun.outputs import EmbeddingOutput, RequestOutput
from forerun.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def make_structured_manager(folder: Path, vocab_size: int):
    """The xgrammar-backed manager; a clear error when xgrammar is not installed."""
    try:
        from forerun.structured.manager import StructuredOutputManager
        return StructuredOutputManager(folder, vocab_size)
    except ImportError as exc:
        raise ValueError(f"structured_outputs: needs xgrammar ({exc}); run scripts/setup.sh") from exc


class LLMEngine:
    """Tokenizes, runs the engine core in this thread, detokenizes.

    Invariant: every request added is eventually returned finished, by completion, abort or error.
    """

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        config.validate()
        self.config = config
        self.model_folder = resolve_model(config.model, show_progress=show_progress)
        self.tokenizer = Tokenizer.from_folder(self.model_folder)
        # The factory runs on the first structured request, when the core knows the model's vocabulary.
        self.core = EngineCore(config, self.model_folder,
                               lambda: make_structured_manager(self.model_folder, self.core.vocab_size))
        self.inputs = InputProcessor(self.tokenizer, self.core.max_model_len, self.core.vocab_size,
                                     config.scheduling_policy)
        self.outputs = OutputProcessor(self.tokenizer)

    @property
    def trace(self):
        return self.core.trace

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Queue one prompt; `priority` (lower runs first) needs scheduling_policy='priority' unless 0."""
        request_id = request_id or self.inputs.next_request_id()
        if self.outputs.has(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text, ids, core_reqs = self.inputs.process(request_id, prompt, params, priority)
        if params.structured_outputs is not None:
            self.core.structured_manager().validate_sync(params.structured_outputs)
        added = []
        try:
            for core_req in core_reqs:
                self.core.add_request(core_req)
                added.append(core_req.request_id)
        except Exception:
            self.core.abort_requests(added)
            raise
        self.outputs.add(request_id, text, ids, params, [r.request_id for r in core_reqs])
        return request_id

    def add_pooling_request(self, prompt: Prompt, request_id: str | None = None) -> str:
        if self.config.runner != "pooling":
            raise ValueError("runner: embeddings need an engine started with runner='pooling'")
        request_id = request_id or self.inputs.next_request_id()
        if self.outputs.has(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        _, ids, core_req = self.inputs.process_pooling(request_id, prompt)
        self.core.add_request(core_req)
        self.outputs.add_pooling(request_id, ids)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.outputs.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return len(self.outputs) > 0 or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput | EmbeddingOutput]:
        try:
            core_outputs = self.core.run_step()
        except EngineStepError as exc:
            self.outputs.process(exc.outputs)
            raise
        t0 = time.perf_counter()
        request_outputs, to_abort = self.outputs.process(core_outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        if self.core.trace is not None and core_outputs:
            self.core.trace.span("output", self.core.scheduler.step_id, t0, requests=len(core_outputs))
        return request_outputs

    def shutdown(self) -> None:
        self.core.shutdown()
