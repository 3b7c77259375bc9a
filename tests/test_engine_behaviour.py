"""Engine behaviour on a tiny random Llama: sampling options, stops, aborts, async bookkeeping, errors."""

from __future__ import annotations

import threading

import pytest

from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.engine.llm_engine import LLMEngine
from forerun.request import EngineCoreRequest

PROMPTS = ["The quick brown fox", "In 1492, Columbus", "def fibonacci(n):", "Hello"]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), async_scheduling=request.param, show_progress=False, trace=True) as llm:
        yield llm


def gen(llm, prompts, **kw):
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_max_tokens_exact_and_no_extra_scheduled_tokens(llm):
    sched = llm.engine.core.scheduler
    before = sched.total_scheduled_tokens
    lens = [3, 17, 1, 9]
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lens],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == lens
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    prompt_lens = [len(o.prompt_token_ids) for o in outs]
    # Prefix-cache hits from earlier tests skip prompt tokens, so count with the cache's help subtracted.
    cached = sum(o.num_cached_tokens for o in outs)
    assert sched.total_scheduled_tokens - before == sum(p + m - 1 for p, m in zip(prompt_lens, lens)) - cached
    assert llm.engine.core.scheduler.kv.num_free_blocks == llm.engine.core.num_blocks


def test_final_only_outputs_match_streamed_ones_and_keep_first_token_time(llm):
    """LLM.generate's requests are final-only: the core sends each once, when it ends. Tokens, text and
    finish reasons equal those of the same requests streamed a step at a time, and the time to first
    token is when the first token came, not when the request ended."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = llm.engine
    sent = []
    run_step = engine.core.run_step

    def recording_step():
        out = run_step()
        sent.extend(out)
        return out

    engine.core.run_step = recording_step
    try:
        final = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        del engine.core.run_step  # the class's method again
    assert len(sent) == len(PROMPTS) and all(o.finished and len(o.new_token_ids) == 12 for o in sent)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    streamed, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            streamed[out.request_id] = out
    assert steps >= 12 and all(streamed[i].finished for i in ids)
    assert [(c.token_ids, c.text, c.finish_reason) for o in final for c in o.outputs] == \
        [(c.token_ids, c.text, c.finish_reason) for i in ids for c in streamed[i].outputs]
    assert all(0 < o.metrics["ttft"] < o.metrics["e2e"] for o in final)


def test_seeded_sampling_reproducible_and_option_changes(llm):
    base = dict(max_tokens=12, ignore_eos=True)
    greedy = tokens(gen(llm, PROMPTS, temperature=0, **base))
    seeded = dict(temperature=1.0, seed=7, **base)
    a, b = tokens(gen(llm, PROMPTS, **seeded)), tokens(gen(llm, PROMPTS, **seeded))
    assert a == b, "same seed, same tokens"
    assert a != tokens(gen(llm, PROMPTS, temperature=1.0, seed=8, **base))
    assert a != greedy
    for option in (dict(top_k=5), dict(top_p=0.5), dict(min_p=0.3), dict(temperature=0.5)):
        assert tokens(gen(llm, PROMPTS, **{**seeded, **option})) != a, option
    for option in (dict(repetition_penalty=1.8), dict(presence_penalty=1.5), dict(frequency_penalty=1.5)):
        assert tokens(gen(llm, PROMPTS, temperature=0, **option, **base)) != greedy, option


def test_seeded_sync_and_async_agree(tiny_llama_dir):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
    got = []
    for mode in (False, True):
        with LLM(model=str(tiny_llama_dir), async_scheduling=mode, show_progress=False,
                 max_num_batched_tokens=8) as llm:  # chunked prefill: partial rows must not draw
            got.append(tokens(llm.generate(PROMPTS, params, use_tqdm=False)))
    assert got[0] == got[1]


@pytest.mark.parametrize("budget", [8, 4096], ids=["chunked", "whole"])
def test_penalties_sync_and_async_agree_in_a_mixed_batch(tiny_llama_dir, budget):
    base = dict(max_tokens=40, ignore_eos=True)
    # Prompts whose plain continuation repeats tokens take the penalties, so the penalties bite.
    batch = [("def fibonacci(n):", SamplingParams(temperature=0, repetition_penalty=1.8, **base)),
             ("The quick brown fox", SamplingParams(temperature=0, **base)),
             ("Hello", SamplingParams(temperature=0, presence_penalty=1.5, **base)),
             ("Hello Hello Hello", SamplingParams(temperature=0.8, seed=5, frequency_penalty=1.5, **base)),
             ("Hello", SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                                      frequency_penalty=1.2, **base)),
             ("In 1492, Columbus", SamplingParams(temperature=0.8, seed=6, **base))]
    prompts = [p for p, _ in batch]
    params = [sp for _, sp in batch]
    plain = [SamplingParams(temperature=sp.temperature, seed=sp.seed, **base) for sp in params]
    got, unpenalised = [], []
    for mode in (False, True):
        with LLM(model=str(tiny_llama_dir), async_scheduling=mode, show_progress=False,
                 max_num_batched_tokens=budget) as llm:
            got.append(tokens(llm.generate(prompts, params, use_tqdm=False)))
            unpenalised.append(tokens(llm.generate(prompts, plain, use_tqdm=False)))
    assert got[0] == got[1], "penalised and plain rows alike: async gives sync's tokens"
    assert unpenalised[0] == unpenalised[1]
    for i, sp in enumerate(params):
        if sp.uses_penalties:
            assert got[0][i] != unpenalised[0][i], f"row {i}: the penalty must change the output"
        else:
            assert got[0][i] == unpenalised[0][i], f"row {i}: a neighbour's penalty leaked into it"


def test_logprobs_sync_and_async_agree(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    got = []
    for mode in (False, True):
        with LLM(model=str(tiny_llama_dir), async_scheduling=mode, show_progress=False) as llm:
            got.append(llm.generate(PROMPTS, params, use_tqdm=False))
    for a, b in zip(got[0], got[1]):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert len(ca.logprobs) == 8
        for step_a, step_b, tok in zip(ca.logprobs, cb.logprobs, ca.token_ids):
            assert tok in step_a and len(step_a) >= 3
            assert step_a.keys() == step_b.keys()
            for k in step_a:
                assert step_a[k] == pytest.approx(step_b[k], rel=1e-3)


def test_stop_strings_and_stop_token_ids(llm):
    ref = gen(llm, ["The quick brown fox"], temperature=0, max_tokens=24, ignore_eos=True)[0].outputs[0]
    text = ref.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    out = gen(llm, ["The quick brown fox"], temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    inc = gen(llm, ["The quick brown fox"], temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
              include_stop_str_in_output=True)[0].outputs[0]
    assert inc.text == text[:text.index(stop) + len(stop)]
    stop_id = ref.token_ids[5]
    first = ref.token_ids.index(stop_id)
    out = gen(llm, ["The quick brown fox"], temperature=0, max_tokens=24, ignore_eos=True,
              stop_token_ids=[stop_id])[0].outputs[0]
    assert out.token_ids == ref.token_ids[:first + 1] and out.stop_reason == stop_id


def test_min_tokens_holds_stop_ids_back_exactly_that_long(llm):
    prompt = ["In 1492, Columbus"]
    ref = gen(llm, prompt, temperature=0, max_tokens=24, ignore_eos=True)[0].outputs[0].token_ids
    k = next(i for i in range(3, len(ref)) if ref.index(ref[i]) == i)  # a first occurrence, not too early
    stop = dict(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ref[k]])
    out = gen(llm, prompt, **stop)[0].outputs[0]
    assert out.token_ids == ref[:k + 1] and out.finish_reason == "stop" and out.stop_reason == ref[k]
    # min_tokens=k: k tokens come first, so the stop id may be token k + 1, exactly where it comes.
    assert gen(llm, prompt, min_tokens=k, **stop)[0].outputs[0].token_ids == ref[:k + 1]
    # min_tokens=k+1: held back at position k, so the output goes past it.
    out = gen(llm, prompt, min_tokens=k + 1, **stop)[0].outputs[0]
    assert out.token_ids[:k] == ref[:k] and ref[k] not in out.token_ids[:k + 1]
    assert len(out.token_ids) >= k + 2
    assert (out.finish_reason, out.token_ids[-1]) == ("stop", ref[k]) or \
        (out.finish_reason == "length" and ref[k] not in out.token_ids)


def test_n_completions_with_seed(llm):
    out = gen(llm, ["Hello"], n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


@pytest.mark.parametrize("stop", [None, ["e"]], ids=["decoded-at-the-end", "stop-string"])
def test_final_only_is_one_output_with_the_cumulative_text(llm, stop):
    """A final-only request is returned once, finished, with the same tokens and text as the same
    request streamed step by step (without stop strings its text is decoded only at the end)."""
    engine = llm.engine
    kinds = {}
    for kind in ("cumulative", "final_only"):
        params = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=14, stop=stop, output_kind=kind)
        rid = engine.add_request("The quick brown fox", params)
        seen, deltas = [], ["", ""]  # the output object is updated in place: read deltas as they come
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    seen.append(out)
                    deltas = [d + c.delta_text for d, c in zip(deltas, out.outputs)]
        kinds[kind] = seen, deltas
    (streamed, streamed_deltas), (final, _) = kinds["cumulative"], kinds["final_only"]
    assert len(streamed) >= 2 and len(final) == 1 and final[0].finished and streamed[-1].finished
    for s_out, f_out in zip(streamed[-1].outputs, final[0].outputs):
        assert f_out.token_ids == s_out.token_ids and f_out.text == s_out.text
        assert (f_out.finish_reason, f_out.stop_reason) == (s_out.finish_reason, s_out.stop_reason)
        assert f_out.delta_text == f_out.text and f_out.delta_token_ids == f_out.token_ids
        assert streamed_deltas[s_out.index] == s_out.text
    if stop:
        assert any(c.finish_reason == "stop" and c.stop_reason == "e" for c in final[0].outputs)


def test_prefix_cache_reuse_and_second_chat_turn(llm):
    blocks = llm.engine.core.config.block_size
    long_prompt = "word " * 70
    first = gen(llm, [long_prompt], temperature=0, max_tokens=4)[0]
    again = gen(llm, [long_prompt], temperature=0, max_tokens=4)[0]
    full = (len(first.prompt_token_ids) - 1) // blocks * blocks
    assert again.num_cached_tokens == full > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    turn1 = [{"role": "user", "content": "Tell me about the sea. " * 8}]
    r1 = llm.chat(turn1, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    turn2 = turn1 + [{"role": "assistant", "content": r1.outputs[0].text}, {"role": "user", "content": "More."}]
    r2 = llm.chat(turn2, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert r2.num_cached_tokens >= len(r1.prompt_token_ids) // blocks * blocks
    assert llm.engine.core.scheduler.kv.num_free_blocks == llm.engine.core.num_blocks


@pytest.mark.parametrize("async_mode", [False, True])
def test_eos_stop_dead_token(tiny_llama_dir, async_mode):
    cfg = EngineConfig(model=str(tiny_llama_dir), async_scheduling=async_mode, trace=True)
    engine = LLMEngine(cfg, show_progress=False)
    try:
        prompt = engine.tokenizer.encode("The quick brown fox")
        ref = _drain_core(engine, [EngineCoreRequest("ref", prompt, SamplingParams(temperature=0, max_tokens=10))])
        eos = ref["ref"][3]
        k = ref["ref"].index(eos)
        engine.core.trace.events.clear()
        got = _drain_core(engine, [EngineCoreRequest("e", prompt, SamplingParams(temperature=0, max_tokens=10),
                                                     frozenset({eos}))])
        assert got["e"] == ref["ref"][:k + 1], "the dead token never reaches the output"
        dead = [rid for e in engine.core.trace.events if e.name == "update" for rid in e.args["dead_tokens"]]
        assert dead == (["e"] if async_mode else [])
        assert engine.core.scheduler.kv.num_free_blocks == engine.core.num_blocks
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_mode", [False, True])
def test_stop_string_costs_one_dead_token_in_async_mode(tiny_llama_dir, async_mode):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), async_scheduling=async_mode, trace=True),
                       show_progress=False)
    try:
        params = dict(temperature=0, max_tokens=24, ignore_eos=True)
        text = _run_engine(engine, "The quick brown fox", SamplingParams(**params))["r"].outputs[0].text
        stop = text[len(text) // 2: len(text) // 2 + 3]
        assert stop.strip(), "need a visible stop string"
        engine.core.trace.events.clear()
        out = _run_engine(engine, "The quick brown fox", SamplingParams(stop=[stop], **params))["r"].outputs[0]
        assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]
        dead = [rid for e in engine.core.trace.events if e.name == "update" for rid in e.args["dead_tokens"]]
        assert dead == (["r"] if async_mode else []), "the abort must land before the next step is scheduled"
        assert engine.core.scheduler.kv.num_free_blocks == engine.core.num_blocks
    finally:
        engine.shutdown()


def test_waiting_request_aborted_while_a_step_is_in_flight_is_never_prefilled(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), async_scheduling=True), show_progress=False)
    scheduled: list[str] = []
    real = engine.core.executor.execute_model

    def record(sched, non_block=False):
        scheduled.extend(sched.num_scheduled_tokens)
        return real(sched, non_block)

    engine.core.executor.execute_model = record
    try:
        engine.add_request("The quick brown fox", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "a")
        engine.step()
        engine.step()
        assert engine.core.batch_queue, "a step is in flight"
        engine.add_request("Hello there", SamplingParams(temperature=0, max_tokens=8), "w")
        engine.abort_request("w")  # the client left before the request was admitted
        while engine.has_unfinished_requests():
            engine.step()
        assert "a" in scheduled and "w" not in scheduled
        assert engine.core.scheduler.kv.num_free_blocks == engine.core.num_blocks
    finally:
        engine.shutdown()


def test_request_id_is_free_again_only_when_nothing_of_it_is_in_flight(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), async_scheduling=True), show_progress=False)
    core = engine.core
    try:
        prompt = engine.tokenizer.encode("The quick brown fox")
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        want = _drain_core(engine, [EngineCoreRequest("ref", prompt, params)])["ref"]
        eos = want[3]
        core.add_request(EngineCoreRequest("x", prompt, SamplingParams(temperature=0, max_tokens=10),
                                           frozenset({eos})))
        while not any(o.finished for o in core.run_step() or ()):
            pass  # the EOS is seen one step late: x's dead token is still in flight
        assert any("x" in step.sched.num_scheduled_tokens for step in core.batch_queue)
        with pytest.raises(ValueError, match="request_id"):
            core.add_request(EngineCoreRequest("x", prompt, params))
        core.add_request(EngineCoreRequest("y", prompt, params))
        core.run_step()
        core.abort_requests(["y"])  # gone from the scheduler at once, but a step for it is in flight
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request(prompt, params, request_id="y")  # the front end asks the core too
        while core.has_unfinished_requests():
            core.run_step()
        again = _drain_core(engine, [EngineCoreRequest("x", prompt, params), EngineCoreRequest("y", prompt, params)])
        assert again == {"x": want, "y": want}, "a reused id gets only its own tokens"
        assert core.scheduler.kv.num_free_blocks == core.num_blocks
    finally:
        engine.shutdown()


def _run_engine(engine, prompt, params):
    """Run one request through LLMEngine (detokenizer and stop strings included), and the step after it."""
    engine.add_request(prompt, params, "r")
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return final


def _drain_core(engine, reqs):
    for r in reqs:
        engine.core.add_request(r)
    got = {r.request_id: [] for r in reqs}
    while engine.core.has_unfinished_requests():
        for o in engine.core.run_step():
            got[o.request_id].extend(o.new_token_ids)
    return got


def test_first_async_step_returns_nothing(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), async_scheduling=True), show_progress=False)
    try:
        engine.core.add_request(EngineCoreRequest("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3)))
        assert engine.core.step_with_batch_queue() is None
        assert len(engine.core.batch_queue) == 1
        out = engine.core.step_with_batch_queue()
        assert [o.request_id for o in out] == ["a"] and len(out[0].new_token_ids) == 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_mode", [False, True])
def test_abort_mid_flight_frees_blocks(tiny_llama_dir, async_mode):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), async_scheduling=async_mode), show_progress=False)
    try:
        a = engine.add_request("The quick brown fox", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        b = engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        seen = {a: 0, b: 0}
        for _ in range(4):
            for o in engine.step():
                seen[o.request_id] = len(o.outputs[0].token_ids)
        engine.abort_request(a)
        final = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                final[o.request_id] = o
        assert a not in final, "no output after the abort"
        assert 0 < seen[a] < 50
        assert len(final[b].outputs[0].token_ids) == 6
        assert engine.core.scheduler.kv.num_free_blocks == engine.core.num_blocks
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_mode", [False, True])
def test_forward_error_reaches_caller_and_shutdown_is_clean(tiny_llama_dir, async_mode):
    before = set(threading.enumerate())
    llm = LLM(model=str(tiny_llama_dir), async_scheduling=async_mode, show_progress=False)
    model = llm.engine.core.executor.worker.model
    calls = {"n": 0}
    real = model.forward

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in forward")
        return real(*a, **kw)

    model.forward = flaky
    with pytest.raises(RuntimeError, match="boom in forward"):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert not llm.engine.core.scheduler.has_unfinished_requests()
    model.forward = real
    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3, "the engine keeps serving after an error"
    llm.shutdown()
    leftover = [t for t in threading.enumerate() if t not in before and t.name.startswith("forerun")]
    assert leftover == []


@pytest.mark.parametrize("async_mode", [False, True])
def test_after_a_failed_prefill_a_long_prompt_matches_a_fresh_engine(tiny_llama_dir, async_mode):
    prompt = "One two three four five six seven eight nine ten eleven twelve. " * 5  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(tiny_llama_dir), async_scheduling=async_mode, show_progress=False) as fresh:
        want = fresh.generate([prompt], params, use_tqdm=False)[0]
    assert len(want.prompt_token_ids) >= 3 * fresh.engine.core.config.block_size
    with LLM(model=str(tiny_llama_dir), async_scheduling=async_mode, show_progress=False) as llm:
        model = llm.engine.core.executor.worker.model
        real = model.forward

        def fail_once(*a, **kw):
            model.forward = real
            raise RuntimeError("boom in the prefill")

        model.forward = fail_once  # blocks are hashed when scheduled; this forward never writes them
        with pytest.raises(RuntimeError, match="boom in the prefill"):
            llm.generate([prompt], params, use_tqdm=False)
        got = llm.generate([prompt], params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens == 0


def test_token_ids_outside_the_vocabulary_are_refused_at_submission(llm):
    vocab = llm.engine.core.vocab_size
    for prompt, params, field in [
            (["Hello"], SamplingParams(min_tokens=1, stop_token_ids=[vocab]), "stop_token_ids"),
            (["Hello"], SamplingParams(stop_token_ids=[2, 10**6]), "stop_token_ids"),
            ([[5, 6, vocab]], SamplingParams(), "prompt")]:
        with pytest.raises(ValueError, match=field):
            llm.generate(prompt, params, use_tqdm=False)
    # The core checks too (the server's engine process trusts no one): a bad request is refused alone,
    # and the request already running finishes unharmed.
    core = llm.engine.core
    core.add_request(EngineCoreRequest("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4,
                                                                       ignore_eos=True)))
    got = core.run_step()
    with pytest.raises(ValueError, match="stop_token_ids"):
        core.add_request(EngineCoreRequest("bad-stop", [5, 6], SamplingParams(min_tokens=1, stop_token_ids=[vocab])))
    with pytest.raises(ValueError, match="prompt"):
        core.add_request(EngineCoreRequest("bad-prompt", [5, vocab], SamplingParams()))
    while core.has_unfinished_requests():
        got += core.run_step()
    assert {o.request_id for o in got} == {"ok"}
    assert sum(len(o.new_token_ids) for o in got) == 4 and got[-1].finish_reason == "length"


def test_bad_input_names_the_field(tiny_llama_dir, llm):
    cases = [
        (lambda: llm.generate([""], SamplingParams(), use_tqdm=False), "prompt"),
        (lambda: llm.generate([[1] * 5000], SamplingParams(), use_tqdm=False), "prompt"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(seed=2**64), "seed"),  # would fail the worker's generator, and the step
        (lambda: SamplingParams(n=2, seed=2**64 - 1), "seed"),
        (lambda: SamplingParams(output_kind="delta"), "output_kind"),
        (lambda: LLM(model="/no/such/model", show_progress=False), "model"),
        (lambda: LLM(model=str(tiny_llama_dir), block_size=0, show_progress=False), "block_size"),
    ]
    for fn, field in cases:
        with pytest.raises(ValueError, match=field):
            fn()
    # The engine still serves after rejected input.
    assert len(gen(llm, ["Hello"], temperature=0, max_tokens=2)[0].outputs[0].token_ids) == 2
