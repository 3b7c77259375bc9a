"""Plain greedy rows skip the sampler's per-row inputs (ModelRunner._sample_step): the same tokens as
the full sampler, and every option that changes a greedy row's token (or draws from its generator)
still goes through the sampler."""

from __future__ import annotations

import pytest

import forerun.worker.model_runner as model_runner
from forerun import LLM, SamplingParams

PROMPTS = ["The capital of France is", "One, two, three,", "def fib(n):"]
GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), dtype="float32", show_progress=False) as llm:
        yield llm


@pytest.fixture
def metadata_builds(monkeypatch) -> list[int]:
    """How many rows went through build_sampling_metadata, one entry per call."""
    calls: list[int] = []
    build = model_runner.build_sampling_metadata

    def counting(batch, states, *args, **kwargs):
        calls.append(len(states))
        return build(batch, states, *args, **kwargs)

    monkeypatch.setattr(model_runner, "build_sampling_metadata", counting)
    return calls


def _tokens(llm, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_plain_greedy_rows_take_the_fast_path_with_the_samplers_tokens(llm, metadata_builds):
    fast = _tokens(llm, [SamplingParams(**GREEDY)] * len(PROMPTS))
    assert metadata_builds == [], "plain greedy rows built the sampler's inputs"
    # logprobs send the same rows through the sampler, whose greedy token is the argmax of the same logits
    full = _tokens(llm, [SamplingParams(**GREEDY, logprobs=1)] * len(PROMPTS))
    assert metadata_builds, "rows asking for logprobs skipped the sampler"
    assert fast == full


@pytest.mark.parametrize("option", [dict(logprobs=0), dict(min_tokens=3), dict(repetition_penalty=1.3),
                                    dict(presence_penalty=0.5), dict(frequency_penalty=0.5), dict(seed=7),
                                    dict(logit_bias={5: 2.0}), dict(allowed_token_ids=list(range(50))),
                                    dict(temperature=0.8)])
def test_one_row_with_an_option_sends_the_batch_through_the_sampler(llm, metadata_builds, option):
    params = [SamplingParams(**GREEDY)] * (len(PROMPTS) - 1) + [SamplingParams(**{**GREEDY, **option})]
    _tokens(llm, params)
    assert metadata_builds and max(metadata_builds) == len(PROMPTS), metadata_builds

