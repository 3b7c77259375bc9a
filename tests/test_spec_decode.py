"""N-gram speculative decoding: configuration, drafting, verification, and token-for-token parity with
plain decoding in sync and async modes, with preemption, chunked prefill and tensor parallelism."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import save_tiny_model
from forerun import LLM, SamplingParams
from forerun.config import EngineConfig, SpeculativeConfig
from forerun.core.spec_stats import SpecDecodeStats
from forerun.engine.tokenizer import Tokenizer
from forerun.worker.ngram_proposer import NgramProposer
from forerun.worker.sampler import Sampler, inverse_cdf
from forerun.worker.sampling_metadata import SamplingMetadata
from forerun.worker.spec_sampler import SpecSampler

VOCAB = 64
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def loopy_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama with a 64-token vocabulary: its greedy outputs fall into short loops now and
    then, so n-gram drafts are accepted often and rejected often (both paths run)."""
    return save_tiny_model(tmp_path_factory.mktemp("loopy"), smollm2_dir, vocab_size=VOCAB, initializer_range=0.1)


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(4, 30))).tolist() for _ in range(n)]


def run(folder: Path, ids, params, **kw):
    """Token ids per request, the spec counters, and (preemptions, free blocks, total blocks)."""
    with LLM(model=str(folder), dtype="float32", show_progress=False, **kw) as llm:
        outs = llm.generate(ids, params, use_tqdm=False)
        s = llm.engine.core.scheduler
        info = (s.num_preemptions, s.kv.num_free_blocks, llm.engine.core.num_blocks)
        return [list(o.outputs[0].token_ids) for o in outs], s.spec_stats, info, outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# ---- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("value, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 2}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ("{not json", "speculative_config"),
    (3, "speculative_config"),
])
def test_bad_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=value).validate()


def test_config_from_json_and_cli():
    from forerun.entrypoints.cli import build_parser
    from forerun.entrypoints.engine_args import engine_config_from_args
    args = build_parser().parse_args(["generate", "--speculative-config", json.dumps(SPEC), "hi"])
    spec = engine_config_from_args(args).spec
    assert spec == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    only_max = SpeculativeConfig.from_value({"num_speculative_tokens": 1, "prompt_lookup_max": 1})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (1, 1)


# ---- drafting -----------------------------------------------------------------------------------

def test_proposer_takes_longest_match_and_what_followed():
    p = NgramProposer(2, 4)
    assert p.propose(np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3]), 3).tolist() == [4, 5, 9]
    assert p.propose(np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3]), 1).tolist() == [4]
    # "7 2 3" matches three tokens (at the end: what followed is 8), "2 3" alone also at the start.
    assert p.propose(np.array([2, 3, 5, 7, 2, 3, 8, 0, 7, 2, 3]), 2).tolist() == [8, 0]
    assert p.propose(np.array([1, 2, 3, 7, 8, 3]), 3).tolist() == []  # a 1-gram is below the minimum
    assert NgramProposer(1, 3).propose(np.array([1, 2, 3, 7, 8, 3]), 3).tolist() == [7, 8, 3]
    assert p.propose(np.array([4]), 3).tolist() == []


# ---- verification -------------------------------------------------------------------------------

def test_greedy_verification_accepts_while_argmax_agrees():
    logits = torch.full((5, 8), -5.0)
    for row, tok in enumerate([3, 4, 6, 1, 2]):
        logits[row, tok] = 5.0
    meta = SamplingMetadata(temperature=torch.zeros(5))
    # Request 0: drafts 3, 4, 5 against argmax 3, 4, 6, 1 -> keeps 3, 4 then the target's 6.
    # Request 1: no drafts -> the argmax 2.
    out = SpecSampler(Sampler())(logits, meta, np.array([4, 1]), np.array([3, 4, 5, -1, -1]), {})
    assert out.tokens == [[3, 4, 6], [2]]


def test_rejection_sampling_keeps_the_target_distribution():
    """The first two kept tokens after one-hot drafts follow the target exactly (chi-square bound)."""
    torch.manual_seed(0)
    p0 = torch.tensor([0.5, 0.2, 0.2, 0.1])  # draft 1 at position 0: accepted with probability 0.2
    p1 = torch.tensor([0.1, 0.1, 0.3, 0.5])  # draft 3 at position 1 (after an accepted draft 1)
    p2 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    n = 20000
    logits = torch.stack([p0.log(), p1.log(), p2.log()] * n)
    meta = SamplingMetadata(temperature=torch.ones(3 * n))
    out = SpecSampler(Sampler())(logits, meta, np.full(n, 3), np.tile([1, 3, -1], n), {})
    first = np.bincount([t[0] for t in out.tokens], minlength=4)
    second = np.bincount([t[1] for t in out.tokens if t[0] == 1 and len(t) > 1], minlength=4)

    def chi2(counts: np.ndarray, p: torch.Tensor) -> float:
        expected = counts.sum() * p.numpy()
        return float(((counts - expected) ** 2 / expected).sum())

    # 3 degrees of freedom: P(chi2 > 16.3) = 0.001.
    assert chi2(first, p0) < 16.3, first
    assert chi2(second, p1) < 16.3, second
    assert abs(first[1] / n - 0.2) < 0.02  # the draft itself keeps its own probability


def test_a_seeded_request_draws_one_number_per_kept_token():
    """A seeded segment's kept tokens are the draws `Sampler` makes without drafts, one uniform per kept
    token from the request's generator, and the generator ends where those draws leave it."""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    meta = SamplingMetadata(temperature=torch.full((4,), 0.7))
    reference = torch.Generator().manual_seed(42)
    probs = torch.softmax(logits / 0.7, dim=-1)
    own = [int(inverse_cdf(probs[j:j + 1], torch.rand(1, 1, generator=reference))[0]) for j in range(3)]
    wrong = (own[2] + 1) % 8
    gen = torch.Generator().manual_seed(42)
    out = SpecSampler(Sampler())(logits, meta, np.array([4]), np.array([own[0], own[1], wrong, -1]), {0: gen})
    assert out.tokens == [own]  # two drafts kept, the third rejected: the target's own third draw
    assert torch.equal(gen.get_state(), reference.get_state())


def test_seeded_and_greedy_outputs_match_without_speculation_when_batch_invariant(loopy_dir):
    """With logits that do not depend on the batch, a request's tokens and logprobs are the same with and
    without drafts: the verifier keeps the target's own draws."""
    seed_prompt = prompts(3)[2]
    greedy, _, _, _ = run(loopy_dir, [seed_prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    ids = [seed_prompt + greedy[0]] * 6 + prompts(2, seed=8)
    params = [SamplingParams(temperature=0.5, seed=100 + i, max_tokens=16, ignore_eos=True, logprobs=2)
              for i in range(6)] + [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)] * 2
    plain, _, _, plain_outs = run(loopy_dir, ids, params, batch_invariant=True)
    spec, stats, _, spec_outs = run(loopy_dir, ids, params, batch_invariant=True, speculative_config=SPEC)
    assert spec == plain
    assert len({tuple(t) for t in plain[:6]}) > 1  # the seeds draw different outputs
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for a, b in zip(plain_outs, spec_outs):
        assert a.outputs[0].logprobs and a.outputs[0].logprobs == b.outputs[0].logprobs


def test_seeded_sampling_follows_the_target_on_a_model(loopy_dir):
    """Seeded sampled outputs with drafts have the same distribution as without (two-sample chi-square
    on the token at each position), and each seed reproduces its own output."""
    seed_prompt = prompts(3)[2]
    greedy, _, _, _ = run(loopy_dir, [seed_prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    prompt = seed_prompt + greedy[0]  # the model's own loop: drafts are found, and often accepted
    n = 400

    def sample(spec):
        params = [SamplingParams(temperature=0.5, max_tokens=5, ignore_eos=True, seed=s) for s in range(n)]
        out, stats, _, _ = run(loopy_dir, [prompt] * n, params, speculative_config=spec, max_num_seqs=n)
        return np.array(out), stats

    plain, _ = sample(None)
    spec, stats = sample(SPEC)
    again, _ = sample(SPEC)
    assert (spec == again).all()
    assert stats.num_draft_tokens > 100 and 0.1 < stats.acceptance_rate < 0.9
    for pos in range(1, 5):  # position 0 is never drafted
        a = np.bincount(plain[:, pos], minlength=VOCAB).astype(float)
        b = np.bincount(spec[:, pos], minlength=VOCAB).astype(float)
        big = (a + b) >= 10  # pool rare outcomes into one cell
        a = np.append(a[big], a[~big].sum())
        b = np.append(b[big], b[~big].sum())
        keep = (a + b) > 0
        a, b = a[keep], b[keep]
        expected = (a + b) / 2
        stat = float((((a - expected) ** 2 + (b - expected) ** 2) / expected).sum())
        dof = len(a) - 1
        assert dof >= 1
        assert stat < dof + 5 * np.sqrt(2 * dof), (pos, stat, dof)  # about 5 standard deviations out


# ---- engine parity ------------------------------------------------------------------------------

@pytest.mark.parametrize("async_mode", [False, True])
def test_greedy_outputs_match_without_speculation(loopy_dir, async_mode):
    ids = prompts()
    want, _, _, _ = run(loopy_dir, ids, GREEDY, async_scheduling=async_mode)
    assert len({tuple(t) for t in want}) == len(ids)
    variants = {
        "spec": {},
        "spec+chunked": dict(max_num_batched_tokens=10),  # drafts verified next to prefill chunks
        "spec+preemption": dict(num_kv_blocks=28, block_size=4),
        "spec+block-4": dict(block_size=4),
    }
    for name, kw in variants.items():
        got, stats, (preempted, free, total), _ = run(loopy_dir, ids, GREEDY, async_scheduling=async_mode,
                                                      speculative_config=SPEC, **kw)
        assert got == want, name
        assert free == total, f"{name}: blocks leaked"
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, name
        if name == "spec+preemption":
            assert preempted > 0


def test_acceptance_in_async_within_two_points_of_sync(loopy_dir):
    ids = prompts(8, seed=1)
    rates = {}
    for mode in (False, True):
        _, stats, _, _ = run(loopy_dir, ids, GREEDY, async_scheduling=mode, speculative_config=SPEC)
        assert stats.num_draft_tokens > 50
        rates[mode] = stats.acceptance_rate
    assert abs(rates[True] - rates[False]) <= 0.02, rates


@pytest.mark.parametrize("async_mode", [False, True])
def test_stops_and_lengths_on_random_outputs_are_exact(loopy_dir, async_mode):
    ids = prompts(4, seed=2)
    full, _, _, _ = run(loopy_dir, ids, GREEDY, async_scheduling=async_mode)
    # Stop at a token in the middle of each output; and max_tokens cut at every length up to 9.
    stops = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[t[len(t) // 2]]) for t in full]
    want_stop = [t[:t.index(t[len(t) // 2]) + 1] for t in full]
    got, stats, (_, free, total), outs = run(loopy_dir, ids, stops, async_scheduling=async_mode,
                                             speculative_config=SPEC)
    assert got == want_stop
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert free == total
    for m in range(1, 10):
        params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        got, _, _, outs = run(loopy_dir, ids, params, async_scheduling=async_mode, speculative_config=SPEC)
        assert got == [t[:m] for t in full], m
        assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("output_kind", ["cumulative", "final_only"])
def test_output_processor_cuts_a_run_at_its_stop_string(smollm2_dir, output_kind):
    """A step that brings several ids at once (accepted drafts) and completes a stop string in the middle
    keeps the ids and logprobs up to the one that completed it, exactly as one id per step does."""
    from forerun.engine.output_processor import OutputProcessor
    from forerun.outputs import EngineCoreOutput
    tok = Tokenizer.from_folder(smollm2_dir)
    prompt = tok.encode("a b c", add_special_tokens=False)
    run_ids = tok.encode(" d e f g", add_special_tokens=False)
    assert len(run_ids) == 4
    params = SamplingParams(temperature=0.0, stop=["e f"], logprobs=0, output_kind=output_kind)
    results = {}
    for split in ([run_ids], [[t] for t in run_ids]):  # one step of four ids, then four steps of one
        proc = OutputProcessor(tok)
        proc.add("r", None, prompt, params, ["r"])
        aborted, out = [], None
        for ids in split:
            if out is not None and out.finished:
                break
            lps = [{t: -0.5 - i} for i, t in enumerate(ids)]
            outs, to_abort = proc.process([EngineCoreOutput("r", list(ids), lps)])
            aborted += to_abort
            out = outs[0] if outs else out
        c = out.outputs[0]
        results[len(split)] = (list(c.token_ids), c.text, len(c.logprobs), c.finish_reason, c.stop_reason, aborted)
    assert results[1] == ([*run_ids[:3]], " d ", 3, "stop", "e f", ["r"])
    assert results[4][:5] == results[1][:5]


# A pattern SmolLM2 copies on (" d e f g a b c d e f g ..."), whose n-gram drafts from the prompt are
# accepted three at a time: the output comes in runs [d] [e f g a] [b c d e] ... in both modes.
PATTERN = "a b c d e f g a b c d e f g a b c d e f g a b c"


@pytest.fixture(scope="module")
def pattern_dir(tmp_path_factory, smollm2_dir) -> Path:
    """The bundled SmolLM2 (weights linked, not copied) with " f" as an end-of-sequence token, so that
    EOS, like a stop token id, a stop string and max_tokens, can be placed on a token inside an
    accepted run of PATTERN's continuation."""
    out = tmp_path_factory.mktemp("pattern-eos")
    for item in smollm2_dir.iterdir():
        if item.name not in ("config.json", "generation_config.json"):
            (out / item.name).symlink_to(item)
    f_id = _single_token(Tokenizer.from_folder(smollm2_dir), " f")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((smollm2_dir / name).read_text()) if (smollm2_dir / name).exists() else {}
        config["eos_token_id"] = f_id
        (out / name).write_text(json.dumps(config))
    return out


def _single_token(tokenizer: Tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def _stop_cases(tokenizer: Tokenizer) -> dict[str, SamplingParams]:
    """Each stop lands on an accepted draft with more tokens after it in the same step (max_tokens: on
    the last token of a run with accepted drafts), for n = 1 and 2, streamed and final-only."""
    b_id = _single_token(tokenizer, " b")
    kinds = {
        "eos": dict(),                                         # " f", output token 2, in run [e f g a]
        "stop_token_ids": dict(stop_token_ids=[b_id], ignore_eos=True),  # " b", token 5, in [b c d e]
        "stop": dict(stop=[" c"], ignore_eos=True),            # token 6, in [b c d e]
        "stop-two-tokens": dict(stop=["e f g"], include_stop_str_in_output=True, ignore_eos=True),
        "max_tokens=3": dict(max_tokens=3, ignore_eos=True),   # runs [d] [e f]: the cap leaves one draft
        "max_tokens=7": dict(max_tokens=7, ignore_eos=True),   # runs [d] [e f g a] [b c]
    }
    cases = {}
    for name, kw in kinds.items():
        for n in (1, 2):
            for output_kind in ("cumulative", "final_only"):
                params = dict(temperature=0.0, max_tokens=16, logprobs=1, n=n, output_kind=output_kind)
                params.update(kw)
                cases[f"{name}/n={n}/{output_kind}"] = SamplingParams(**params)
    return cases


def _drive(folder: Path, async_mode: bool, spec: dict | None) -> tuple[dict, dict, SpecDecodeStats]:
    """Runs PATTERN under every stop case in one engine, stepping it by hand so streamed outputs are
    seen. Returns per case its final completions (ids, text, finish and stop reason, logprobs), whether
    every streamed delta added up to them, and per completion the tokens each step sampled for it."""
    cases = _stop_cases(Tokenizer.from_folder(folder))
    with LLM(model=str(folder), dtype="float32", show_progress=False, async_scheduling=async_mode,
             speculative_config=spec) as llm:
        engine, sched = llm.engine, llm.engine.core.scheduler
        sampled: dict[str, list[list[int]]] = {}
        append = sched._append_tokens

        def recording(req, tokens, result, rid):
            sampled.setdefault(rid, []).append(list(tokens))
            return append(req, tokens, result, rid)

        sched._append_tokens = recording
        names, children = {}, {}
        for name, params in cases.items():
            rid = engine.add_request(PATTERN, params)
            names[rid] = name
            children[name] = engine.outputs.child_ids(rid)
        streamed = {name: [([], "") for _ in range(p.n)] for name, p in cases.items()}
        emitted = {name: 0 for name in cases}
        final = {}
        while engine.has_unfinished_requests() or engine.core.batch_queue:
            for out in engine.step():
                name = names[out.request_id]
                emitted[name] += 1
                streamed[name] = [(ids + list(c.delta_token_ids), text + c.delta_text)
                                  for (ids, text), c in zip(streamed[name], out.outputs)]
                if out.finished:
                    final[name] = [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason, list(c.logprobs))
                                   for c in out.outputs]
        free, total = sched.kv.num_free_blocks, engine.core.num_blocks
        stats = sched.spec_stats
    assert free == total, "blocks leaked"
    for name, params in cases.items():
        assert name in final, name
        if params.output_kind == "final_only":
            assert emitted[name] == 1, name  # one output, at the end, its deltas holding everything
        assert streamed[name] == [(ids, text) for ids, text, *_ in final[name]], name
    runs = {name: [sampled[cid] for cid in cids] for name, cids in children.items()}
    return final, runs, stats


@pytest.fixture(scope="module")
def plain_pattern_outputs(pattern_dir):
    final, runs, _ = _drive(pattern_dir, False, None)
    assert all(len(step) == 1 for per_case in runs.values() for steps in per_case for step in steps)
    return final


@pytest.mark.parametrize("async_mode", [False, True])
def test_stops_inside_an_accepted_run_are_exact(pattern_dir, plain_pattern_outputs, async_mode):
    """EOS, a stop token id, stop strings and max_tokens that land inside a run of accepted drafts cut the
    output at exactly the token plain decoding stops at: same ids, logprobs (so usage), text, reasons."""
    final, runs, stats = _drive(pattern_dir, async_mode, SPEC)
    assert stats.num_accepted_tokens > 0
    want = plain_pattern_outputs
    assert want["eos/n=1/cumulative"][0][2:4] == ("stop", None)
    assert want["stop_token_ids/n=1/cumulative"][0][0][-1] == want["stop_token_ids/n=1/cumulative"][0][3]
    assert want["stop/n=1/cumulative"][0][1:4] == (" d e f g a b", "stop", " c")
    assert want["stop-two-tokens/n=1/cumulative"][0][1:4] == (" d e f g", "stop", "e f g")
    assert [len(want[f"max_tokens={m}/n=1/cumulative"][0][0]) for m in (3, 7)] == [3, 7]
    for name, completions in final.items():
        assert len(completions) == len(want[name]), name
        for (ids, text, reason, stop_reason, lps), (w_ids, w_text, w_reason, w_stop, w_lps), steps in zip(
                completions, want[name], runs[name]):
            assert (ids, text, reason, stop_reason) == (w_ids, w_text, w_reason, w_stop), name
            assert len(lps) == len(ids), name
            for got_lp, want_lp in zip(lps, w_lps):
                assert got_lp.keys() == want_lp.keys(), name
                for tok in got_lp:
                    assert abs(_value(got_lp[tok]) - _value(want_lp[tok])) < 1e-3, name
            # By construction, checked: the step that made the last kept token sampled it with others (it
            # accepted drafts), and for a stop also sampled tokens past it that the output dropped.
            ends = np.cumsum([len(s) for s in steps])
            stop_step = int(np.searchsorted(ends, len(ids)))  # the step whose run holds token len(ids) - 1
            assert len(steps[stop_step]) > 1, (name, steps)
            if name.startswith("max_tokens"):
                assert ends[stop_step] == len(ids), (name, steps)
            else:
                assert ends[stop_step] > len(ids), (name, steps)


def test_max_model_len_is_exact(loopy_dir):
    ids = prompts(3, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    want, _, _, _ = run(loopy_dir, ids, params, max_model_len=48)
    got, stats, _, _ = run(loopy_dir, ids, params, max_model_len=48, speculative_config=SPEC)
    assert got == want
    assert [len(t) for t in got] == [48 - len(p) for p in ids]
    assert stats.num_accepted_tokens > 0


def test_penalties_and_logprobs_match_without_speculation(loopy_dir):
    ids = prompts(4, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.2, presence_penalty=0.1, min_tokens=5, logprobs=2)
    want, _, _, want_outs = run(loopy_dir, ids, params)
    got, stats, _, got_outs = run(loopy_dir, ids, params, speculative_config=SPEC)
    assert got == want
    assert stats.num_accepted_tokens > 0
    for a, b in zip(want_outs, got_outs):
        lp_a, lp_b = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(lp_a) == len(lp_b) == len(a.outputs[0].token_ids)
        for x, y in zip(lp_a, lp_b):
            assert x.keys() == y.keys()
            for tok in x:
                assert abs(_value(x[tok]) - _value(y[tok])) < 1e-3


def _value(lp) -> float:
    return float(getattr(lp, "logprob", lp))


def test_disable_by_batch_size_turns_drafting_off(loopy_dir):
    ids = prompts(4, seed=5)
    want, _, _, _ = run(loopy_dir, ids, GREEDY)
    spec = dict(SPEC, disable_by_batch_size=3)
    got, stats, _, _ = run(loopy_dir, ids, GREEDY, speculative_config=spec)
    assert got == want
    assert stats.num_draft_slots == 0  # four requests run together to the same length
    alone, stats1, _, _ = run(loopy_dir, ids[:1], GREEDY, speculative_config=spec)
    assert alone == want[:1] and stats1.num_draft_slots > 0


def test_tensor_parallel_mp_matches(loopy_dir):
    ids = prompts(4, seed=6)
    want, _, _, _ = run(loopy_dir, ids, GREEDY)
    for mode in (False, True):
        got, stats, _, _ = run(loopy_dir, ids, GREEDY, async_scheduling=mode, speculative_config=SPEC,
                               distributed_executor_backend="mp", tensor_parallel_size=2)
        assert got == want, f"async={mode}"
        assert stats.num_accepted_tokens > 0


# ---- metrics and the benchmark ------------------------------------------------------------------

def test_metrics_export_spec_counters_and_rates():
    from forerun.engine.core_proc import EngineStats
    from forerun.entrypoints.openai.metrics import ServerMetrics
    m = ServerMetrics("m")
    m.update_engine(EngineStats(num_steps=10, num_spec_drafts=4, num_spec_draft_tokens=12, num_spec_accepted_tokens=9))
    text = m.render().decode()
    assert 'forerun:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'forerun:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert 'forerun:spec_decode_acceptance_rate{model_name="m"} 0.75' in text
    assert 'forerun:spec_decode_mean_accepted_length{model_name="m"} 3.25' in text
    assert 'forerun:spec_decode_draft_tokens_per_step{model_name="m"} 1.2' in text


def test_bench_throughput_compare_spec_on_the_grounded_workload(tmp_path, smollm2_dir):
    """A tiny model with a narrow init repeats one token: drafts are proposed and mostly accepted (the
    default model copying a passage is measured in the README, too slow for a test)."""
    from test_cli import forerun
    folder = save_tiny_model(tmp_path / "repeat", smollm2_dir, initializer_range=0.02)
    out, trace = tmp_path / "r.json", tmp_path / "t.json"
    res = forerun("bench", "throughput", "--model", str(folder), "--num-prompts", "2", "--output-len", "12",
                  "--workload", "grounded", "--compare-spec", "--speculative-config", json.dumps(SPEC),
                  "--trace", str(trace), "--output-json", str(out))
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert result["workload"] == "grounded" and result["speculative_config"]["num_speculative_tokens"] == 3
    plain, spec = result["async"], result["async_spec"]
    assert "spec_decode" not in plain and plain["output_tokens"] == spec["output_tokens"] == 24
    figures = spec["spec_decode"]
    assert figures["num_draft_tokens"] > 0 and 0 < figures["acceptance_rate"] <= 1
    assert figures["mean_accepted_length"] == round(1 + figures["num_accepted_tokens"] / figures["num_drafts"], 3)
    assert spec["steps"] < plain["steps"]  # accepted drafts save steps
    assert result["speedup_spec_over_no_spec_async"] > 0
    updates = [e for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == "update"]
    assert any(e.get("args", {}).get("drafted", 0) > 0 for e in updates)


def test_structured_requests_decode_without_drafts(tiny_llama_dir, caplog):
    """A structured request in a speculating engine decodes one token a step (one log line says so),
    next to plain requests that get draft slots; every output equals the one without speculation."""
    import logging
    import re

    from forerun.structured.spec import StructuredOutputsParams
    phone = SamplingParams(temperature=0.0, max_tokens=20,
                           structured_outputs=StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"))
    ids = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [13, 14, 13, 14, 13]]
    params = [phone, GREEDY, GREEDY]
    want, _, _, _ = run(tiny_llama_dir, ids, params, async_scheduling=True)
    with caplog.at_level(logging.INFO, logger="forerun.engine.engine_core"):
        got, stats, _, outs = run(tiny_llama_dir, ids, params, async_scheduling=True, speculative_config=SPEC)
    assert got == want
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outs[0].outputs[0].text)
    assert stats.num_draft_slots > 0
    assert sum("speculative decoding off (structured output)" in r.message for r in caplog.records) == 1
