"""Turns engine-core token outputs into user-facing RequestOutputs: text, stop strings, n > 1."""

from __future__ import annotations

import time
from dataclasses import dataclass

from forerun.engine.detokenizer import IncrementalDetokenizer
from forerun.engine.input_processor import child_id
from forerun.engine.tokenizer import Tokenizer
from forerun.outputs import CompletionOutput, EmbeddingOutput, EngineCoreOutput, RequestOutput
from forerun.sampling_params import SamplingParams


@dataclass
class _Completion:
    out: CompletionOutput
    detok: IncrementalDetokenizer
    deferred: bool = False  # final-only without stop strings: the text is decoded once, at the end
    detokenize: bool = True  # False (SamplingParams.detokenize): token ids only, the text stays ""


@dataclass
class _RequestState:
    output: RequestOutput
    children: dict[str, _Completion]
    arrival: float
    first_token_time: float | None = None
    num_unfinished: int = 0  # completions still running: the request is finished at 0
    final_only: bool = False  # returned once, when finished


class OutputProcessor:
    """Holds per-request text state.

    Invariant: a RequestOutput is `finished` exactly when all its completions are; a completion stopped by a
    stop string is reported as finished at once and its core request is returned for abort; a final-only
    request is returned once, finished, with its deltas holding everything.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        self._pooling: dict[str, list[int]] = {}  # pooling request -> prompt ids

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
            child_ids: list[str]) -> None:
        children = {}
        final_only = params.output_kind == "final_only"
        for i, cid in enumerate(child_ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                           params.stop or (), params.include_stop_str_in_output)
            lp = [] if params.logprobs is not None else None
            children[cid] = _Completion(CompletionOutput(i, "", [], lp), detok,
                                        (final_only and not params.stop) or not params.detokenize, params.detokenize)
            self._child_to_parent[cid] = request_id
        out = RequestOutput(request_id, prompt, prompt_ids, [c.out for c in children.values()])
        self._states[request_id] = _RequestState(out, children, time.monotonic(),
                                                 num_unfinished=len(children), final_only=final_only)

    def add_pooling(self, request_id: str, prompt_ids: list[int]) -> None:
        self._pooling[request_id] = prompt_ids

    def has(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._pooling

    def child_ids(self, request_id: str) -> list[str]:
        state = self._states.get(request_id)
        return list(state.children) if state else []

    def __len__(self) -> int:
        return len(self._states) + len(self._pooling)

    def process(self, core_outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput | EmbeddingOutput], list[str]]:
        """Returns the updated outputs (one per touched request) and core ids to abort.

        Runs on the engine thread for every request in every step, so it is kept lean: each call of a
        helper here costs about a microsecond, times the batch, on the cores the model runs on.
        """
        touched: dict[str, _RequestState] = {}
        embeddings: list[EmbeddingOutput] = []
        to_abort: list[str] = []
        finished: list[str] = []
        now = time.monotonic()
        for co in core_outputs:
            rid = co.request_id
            parent = self._child_to_parent.get(rid)
            if parent is None:
                prompt_ids = self._pooling.pop(rid, None)
                if prompt_ids is not None:
                    embeddings.append(EmbeddingOutput(rid, prompt_ids, co.pooled or [], co.error))
                continue
            state = self._states[parent]
            output = state.output
            if parent not in touched:
                touched[parent] = state
                if not state.final_only:  # deltas describe this call only, for every sibling
                    for sibling in output.outputs:
                        sibling.delta_text, sibling.delta_token_ids = "", []
            comp = state.children[rid]
            if co.prompt_logprobs is not None and output.prompt_logprobs is None:  # n > 1: every child has them
                output.prompt_logprobs, output.prompt_ranks = co.prompt_logprobs, co.prompt_ranks
            if comp.out.finish_reason is not None:
                continue
            self._apply(comp, co, to_abort)
            if comp.out.finish_reason is not None:
                state.num_unfinished -= 1
                if state.num_unfinished == 0:
                    finished.append(parent)
            if state.first_token_time is None and co.new_token_ids:
                state.first_token_time = now if co.first_token_time is None else co.first_token_time
            if co.num_cached_tokens > output.num_cached_tokens:
                output.num_cached_tokens = co.num_cached_tokens
        for rid in finished:
            state = touched[rid]
            state.output.finished = True
            if state.final_only:  # its one output: the deltas since the last one are everything
                for c in state.output.outputs:
                    c.delta_text, c.delta_token_ids = c.text, list(c.token_ids)
            self._finish(rid, now)
        outputs = [st.output for st in touched.values() if st.output.finished or not st.final_only]
        return [*outputs, *embeddings], to_abort

    def _apply(self, comp: _Completion, co: EngineCoreOutput, to_abort: list[str]) -> None:
        out = comp.out
        new_ids = co.new_token_ids
        detok = comp.detok
        if comp.deferred:  # nobody reads the text before the end; without stop strings the core cut the ids
            out.token_ids.extend(new_ids)
            out.delta_token_ids = list(new_ids)
            if out.logprobs is not None and co.new_logprobs:
                out.logprobs.extend(co.new_logprobs)
            if co.finish_reason is not None:
                if out.token_ids and comp.detokenize:
                    detok.update(out.token_ids)
                    detok.flush()
                    out.text = detok.text
                out.finish_reason, out.stop_reason, out.error = co.finish_reason, co.stop_reason, co.error
            return
        # Several ids arrive at once when drafts were accepted: a stop string completed by one of them ends
        # the output there, so the ids (and logprobs, and so the usage count) after it are dropped, as
        # one-token steps would never have produced them.
        delta, kept = detok.update_until_stop(new_ids) if new_ids else ("", 0)
        if kept < len(new_ids):
            new_ids = new_ids[:kept]
        out.token_ids.extend(new_ids)
        if out.logprobs is not None and co.new_logprobs:
            out.logprobs.extend(co.new_logprobs[:kept])
        out.delta_token_ids = list(new_ids)
        if detok.stop_reason is not None:
            out.finish_reason, out.stop_reason = "stop", detok.stop_reason
            if co.finish_reason is None:
                to_abort.append(co.request_id)
        elif co.finish_reason is not None:
            delta += detok.flush()
            out.finish_reason, out.stop_reason = co.finish_reason, co.stop_reason
            out.error = co.error
        out.delta_text = delta
        if delta:
            out.text = detok.text

    def _finish(self, request_id: str, now: float) -> None:
        state = self._states.pop(request_id)
        for cid in state.children:
            self._child_to_parent.pop(cid, None)
        m = state.output.metrics
        m["arrival_time"] = state.arrival
        m["e2e"] = now - state.arrival
        if state.first_token_time is not None:
            m["ttft"] = state.first_token_time - state.arrival

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its core ids for the engine to abort."""
        if self._pooling.pop(request_id, None) is not None:
            return [request_id]
        state = self._states.pop(request_id, None)
        if state is None:
            return []
        for cid in state.children:
            self._child_to_parent.pop(cid, None)
        return list(state.children)


__all__ = ["OutputProcessor", "child_id"]
