"""A scripted stand-in for the model runner, for scheduler tests that need no model."""

from __future__ import annotations

from forerun.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class ScriptedRunner:
    """Tracks each request's known length like the real worker and 'samples' token = f(request, position).

    `eos_at` maps request id -> output index at which the EOS token (id 2) is produced.
    """

    def __init__(self, eos_at: dict[str, int] | None = None) -> None:
        self.known: dict[str, int] = {}  # tokens the worker knows: prompt + its own samples
        self.prompt: dict[str, int] = {}
        self.eos_at = eos_at or {}
        self.batches: list[dict[str, int]] = []

    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.known.pop(rid, None)
        for new in so.new_reqs:
            self.known[new.request_id] = len(new.token_ids)
            self.prompt[new.request_id] = new.num_prompt_tokens
        before = {c.request_id: c.num_computed_tokens for c in so.cached_reqs}
        before.update({n.request_id: n.num_computed_tokens for n in so.new_reqs})
        computed = {rid: before[rid] + so.num_scheduled_tokens[rid] for rid in before}
        self.batches.append(dict(so.num_scheduled_tokens))
        ids, toks = [], []
        for rid, n in so.num_scheduled_tokens.items():
            ids.append(rid)
            if computed[rid] >= self.known[rid]:
                out_index = self.known[rid] - self.prompt[rid]
                tok = 2 if self.eos_at.get(rid) == out_index else 100 + out_index
                self.known[rid] += 1
                toks.append([tok])
            else:
                toks.append([])
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks)
