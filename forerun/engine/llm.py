"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

from tqdm import tqdm

from forerun.config import EngineConfig
from forerun.engine.input_processor import Prompt
from forerun.engine.llm_engine import LLMEngine
from forerun.outputs import EmbeddingOutput, RequestOutput
from forerun.sampling_params import SamplingParams, final_only


class LLM:
    """Runs a batch of prompts to completion in this process.

    Keyword arguments are `EngineConfig` fields (`max_model_len`, `async_scheduling`, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        show_progress = kwargs.pop("show_progress", True)
        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown engine option")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), show_progress=show_progress)
        self.tokenizer = self.engine.tokenizer
        self._shut_down = False

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[
            SamplingParams] | None = None, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """`priority`: one value per prompt (lower runs first), for an engine with scheduling_policy='priority'."""
        items = _as_prompt_list(prompts)
        params = final_only(_as_params_list(sampling_params, len(items)))  # generate returns only those
        if priority is not None and (isinstance(priority, (int, str)) or len(priority) != len(items)):
            raise ValueError(f"priority: expected a list of {len(items)} integers, one per prompt")
        priorities = list(priority) if priority is not None else [0] * len(items)
        ids = []
        try:
            for prompt, sp, prio in zip(items, params, priorities):
                ids.append(self.engine.add_request(prompt, sp, priority=prio))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            self._drain()
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        # The template already holds any BOS token: encode without adding special tokens again.
        token_prompts: list[Prompt] = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(token_prompts, sampling_params, use_tqdm)
        for out, text in zip(outs, prompts):
            out.prompt = text
        return outs

    def embed(self, inputs: Prompt | Sequence[Prompt], use_tqdm: bool = True) -> list[EmbeddingOutput]:
        """One vector per input (needs `runner="pooling"`); inputs are strings or token-id lists."""
        items = _as_prompt_list(inputs)
        ids = []
        try:
            for item in items:
                ids.append(self.engine.add_pooling_request(item))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            self._drain()
            raise
        outs = self._run(ids, use_tqdm)
        for out in outs:
            if out.error:
                raise RuntimeError(f"embedding failed: {out.error}")
        return outs

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in getattr(out, "outputs", ()))
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s")
            while self.engine.core.batch_queue:  # async: collect the step still in flight (its dead tokens)
                self.engine.step()
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    # ---- RL trainers' calls (vLLM's names and meanings; forerun.engine.trainer_calls) ------------------
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Run `method` on every rank's worker and return one result per rank, in rank order: a worker
        method's name (one of `worker_extension_cls`'s too), or a callable run as
        `method(worker, *args, **kwargs)` (pickled with cloudpickle for worker processes). With
        external_launcher every rank must make the call (each gets every rank's result)."""
        return self.engine.core.collective_rpc(method, args, kwargs, timeout)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Update the weights in place from (Hugging Face parameter name, full tensor) pairs: each rank
        takes its own tensor-parallel shard and pipeline stage, packed q/k/v and gate/up and the kernels'
        weight copies are rebuilt, and the prefix cache is reset. A subset of the weights may be given.
        ValueError for an unknown name or a wrong shape, and for a GGUF-quantized model."""
        self.engine.core.load_weights(weights)

    def reset_prefix_cache(self) -> bool:
        return self.engine.core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Needs enable_sleep_mode=True. Level 1 gives the KV cache's memory back to the OS (on CUDA the
        weights move to the CPU); level 2 also drops the weights: load them again after wake_up."""
        self.engine.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake "weights", "kv_cache" or (None) both; generation needs both awake."""
        self.engine.core.wake_up(tags)

    def shutdown(self) -> None:
        """Stop the engine's workers; a second call does nothing (a `with` block after an explicit call)."""
        if not self._shut_down:
            self._shut_down = True
            self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: expected a prompt or a non-empty list of prompts")
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return list(params)
