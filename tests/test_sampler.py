"""Sampler tests on random logits (V = 1000, B = 8) against straightforward per-row references."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from forerun.worker.sampler import Sampler, argmax_rows
from forerun.worker.sampling_metadata import SamplingMetadata

V = 1000
B = 8


def _logits(batch: int = B, scale: float = 1.0, seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, V, generator=gen) * scale


def _meta(batch: int, temperature: float | Tensor = 0.0, **kwargs: object) -> SamplingMetadata:
    temp = temperature if isinstance(temperature, Tensor) else torch.full((batch,), float(temperature))
    return SamplingMetadata(temperature=temp, all_greedy=bool((temp == 0).all()),
                            all_random=bool((temp != 0).all()), **kwargs)  # type: ignore[arg-type]


def _repeat_rows(logits: Tensor, times: int) -> Tensor:
    """Each row `times` times in a row: [B, V] -> [B * times, V]; row r*times+j is a copy of row r."""
    return logits.repeat_interleave(times, dim=0)


def _per_row_support(sampled: Tensor, times: int) -> list[set[int]]:
    return [set(sampled[r * times:(r + 1) * times].tolist()) for r in range(sampled.numel() // times)]


# ---------------------------------------------------------------- greedy and temperature


def test_greedy_equals_argmax_and_ties_go_to_lowest_id() -> None:
    logits = _logits()
    logits[3, 10] = logits[3, 500] = logits[3].max() + 1.0  # an exact tie
    out = Sampler()(logits, _meta(B))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[3].item() == 10
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_cpu_argmax_agrees_with_torch_on_ties_infinities_and_nans() -> None:
    gen = torch.Generator().manual_seed(1)
    for trial in range(50):
        x = torch.randint(-3, 3, (6, 40), generator=gen).float()  # many exact ties
        x[1, 7] = x[1, 20] = float("nan")  # the first NaN wins, as in torch.argmax
        x[2] = float("-inf")
        x[3, 4] = x[3, 9] = float("inf")
        x[4, trial % 40] = float("nan")
        want = x.argmax(dim=-1)
        for got in (argmax_rows(x), argmax_rows(x.t().contiguous().t())):  # contiguous and strided
            assert torch.equal(got, want) and got.dtype == torch.int64
    assert torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().argmax(dim=-1))


def test_temperature_changes_result_and_tiny_temperature_is_greedy() -> None:
    logits = _logits()
    greedy = logits.argmax(dim=-1)
    random = Sampler()(logits, _meta(B, temperature=1.0)).sampled_token_ids
    assert (random != greedy).sum() >= B // 2  # flat logits: the argmax rarely wins
    near_greedy = Sampler()(logits, _meta(B, temperature=1e-4)).sampled_token_ids
    assert torch.equal(near_greedy, greedy)


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    logits = _repeat_rows(_logits(2), 200)  # rows 0..199 copy row 0, rows 200..399 copy row 1
    temp = torch.tensor([0.0] * 200 + [1.0] * 200)
    out = Sampler()(logits, _meta(400, temperature=temp)).sampled_token_ids
    assert (out[:200] == logits[0].argmax()).all()
    assert len(set(out[200:].tolist())) > 50


def test_input_logits_untouched_and_bf16_accepted() -> None:
    logits = _logits()
    before = logits.clone()
    meta = _meta(B, temperature=1.0, top_k=torch.full((B,), 5), top_p=torch.full((B,), 0.5),
                 bad_token_mask=torch.zeros(B, V, dtype=torch.bool), max_num_logprobs=2,
                 min_tokens_block=[(0, [1, 2])])
    Sampler()(logits, meta)
    assert torch.equal(logits, before)
    half = logits.to(torch.bfloat16)
    out = Sampler()(half, _meta(B))
    assert torch.equal(out.sampled_token_ids, half.float().argmax(dim=-1))


# ---------------------------------------------------------------- support restrictions


def test_top_k_samples_exactly_within_top_k() -> None:
    times = 300
    base = _logits()
    logits = _repeat_rows(base, times)
    ks = [5, 5, 1, 3, 5, 0, V, 5]  # 0 and V mean off
    top_k = torch.tensor(ks).repeat_interleave(times)
    out = Sampler()(logits, _meta(B * times, temperature=1.0, top_k=top_k)).sampled_token_ids
    for r, support in enumerate(_per_row_support(out, times)):
        if ks[r] in (0, V):
            assert len(support) > 50, "top_k off must not restrict"
        else:
            # Within the top 5 of unit-variance logits no token has under 5%: all appear in 300 draws.
            assert support == set(base[r].topk(ks[r]).indices.tolist())


def _nucleus(row: Tensor, p: float) -> set[int]:
    probs, ids = torch.softmax(row, dim=-1).sort(descending=True)
    kept, mass = [], 0.0
    for prob, tok in zip(probs.tolist(), ids.tolist()):
        if mass >= p:
            break
        kept.append(tok)
        mass += prob
    return set(kept)


def test_top_p_samples_only_inside_the_nucleus() -> None:
    times = 400
    base = _logits(scale=3.0)
    logits = _repeat_rows(base, times)
    ps = [0.5, 0.9, 0.2, 1.0, 0.5, 0.7, 0.05, 0.95]
    top_p = torch.tensor(ps).repeat_interleave(times)
    out = Sampler()(logits, _meta(B * times, temperature=1.0, top_p=top_p)).sampled_token_ids
    for r, support in enumerate(_per_row_support(out, times)):
        nucleus = _nucleus(base[r], ps[r])
        assert support <= nucleus
        assert base[r].argmax().item() in support
        if ps[r] < 1.0:
            assert len(nucleus) < V // 4


def test_min_p_excludes_tokens_below_min_p_times_pmax() -> None:
    times = 400
    base = _logits(scale=3.0)
    logits = _repeat_rows(base, times)
    mps = [0.1, 0.3, 0.0, 0.05, 0.5, 0.2, 0.01, 0.9]
    min_p = torch.tensor(mps).repeat_interleave(times)
    out = Sampler()(logits, _meta(B * times, temperature=1.0, min_p=min_p)).sampled_token_ids
    for r, support in enumerate(_per_row_support(out, times)):
        probs = torch.softmax(base[r], dim=-1)
        allowed = set(torch.nonzero(probs >= mps[r] * probs.max()).flatten().tolist())
        assert support <= allowed
        if mps[r] == 0.0:
            assert len(support) > len(set(torch.nonzero(probs >= 0.01 * probs.max()).flatten().tolist()))


def test_bad_token_mask_and_min_tokens_block() -> None:
    logits = _logits()
    greedy = logits.argmax(dim=-1)
    mask = torch.zeros(B, V, dtype=torch.bool)
    mask[0, greedy[0]] = True
    block = [(1, [int(greedy[1]), 7]), (2, [])]
    out = Sampler()(logits, _meta(B, bad_token_mask=mask, min_tokens_block=block, max_num_logprobs=1))
    second = logits.topk(2, dim=-1).indices[:, 1]
    assert out.sampled_token_ids[0] == second[0] and out.sampled_token_ids[1] == second[1]
    assert torch.equal(out.sampled_token_ids[2:], greedy[2:])
    # Masks come before logprobs: the masked token is now impossible.
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert torch.equal(out.logprob_token_ids[:2, 1], second[:2])
    # Random rows never draw a masked token.
    times = 500
    big = _repeat_rows(logits[:1] * 0.0, times)  # uniform: each token would be drawn ~0.5 times
    big_mask = torch.zeros(times, V, dtype=torch.bool)
    big_mask[:, :900] = True
    sampled = Sampler()(big, _meta(times, temperature=1.0, bad_token_mask=big_mask,
                                   min_tokens_block=[(i, [950]) for i in range(times)])).sampled_token_ids
    assert sampled.min() >= 900 and not (sampled == 950).any()


# ---------------------------------------------------------------- distributions


def test_temperature_one_matches_softmax_over_20k_draws() -> None:
    torch.manual_seed(1234)
    draws = 20_000
    row = _logits(1, scale=2.0)[0]
    probs = torch.softmax(row, dim=-1)
    sampled = Sampler()(row.expand(draws, V), _meta(draws, temperature=1.0)).sampled_token_ids
    freq = torch.bincount(sampled, minlength=V).float() / draws
    # Standard error of a frequency is at most sqrt(0.25 / 20000) ~ 0.0035.
    assert (freq - probs).abs().max() < 0.015
    # Chi-square over the 20 likeliest tokens plus one bin for the rest (20 degrees of
    # freedom; 52.4 is the 99.99th percentile), so every bin expects well over 5 draws.
    top = probs.topk(20).indices
    expected = torch.cat([probs[top], (1 - probs[top].sum()).unsqueeze(0)]) * draws
    observed = torch.cat([freq[top], (1 - freq[top].sum()).unsqueeze(0)]) * draws
    assert expected.min() > 5
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 52.4


def _reference_distribution(row: Tensor, temperature: float, k: int, p: float, min_p: float) -> Tensor:
    """Per-row reference: temperature, then top-k, top-p (on the top-k renormalised), min-p."""
    probs = torch.softmax(row / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()[:k]
    kept: list[int] = []
    mass, total = 0.0, sum(probs[i].item() for i in order)
    for tok in order:
        if mass >= p:
            break
        kept.append(tok)
        mass += probs[tok].item() / total
    pmax = max(probs[i].item() for i in kept)
    kept = [i for i in kept if probs[i].item() >= min_p * pmax]
    ref = torch.zeros(V)
    ref[kept] = probs[kept]
    return ref / ref.sum()


def test_combined_options_match_reference_distribution() -> None:
    torch.manual_seed(99)
    draws = 20_000
    row = _logits(1, scale=2.0, seed=5)[0]
    temp, k, p, mp = 0.8, 30, 0.8, 0.1
    meta = _meta(draws, temperature=temp, top_k=torch.full((draws,), k),
                 top_p=torch.full((draws,), p), min_p=torch.full((draws,), mp))
    sampled = Sampler()(row.expand(draws, V), meta).sampled_token_ids
    freq = torch.bincount(sampled, minlength=V).float() / draws
    ref = _reference_distribution(row, temp, k, p, mp)
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(ref).flatten().tolist())
    assert 3 < int((ref > 0).sum()) < k  # every option actually cut something
    assert (freq - ref).abs().max() < 0.015


# ---------------------------------------------------------------- seeded generators


def _seeded_run(logits_rows: Tensor, seeded_row: int, seed: int, steps: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(steps):
        n = logits_rows.shape[0]
        meta = _meta(n, temperature=1.0, top_p=torch.full((n,), 0.95), generators={seeded_row: gen})
        tokens.append(int(Sampler()(logits_rows, meta).sampled_token_ids[seeded_row]))
    return tokens


def test_seeded_row_reproducible_across_batch_composition() -> None:
    target = _logits(1, seed=7)[0]
    batch_a = _logits(8, seed=1)
    batch_a[5] = target
    batch_b = _logits(3, seed=2)
    batch_b[0] = target
    torch.manual_seed(11)
    run_a = _seeded_run(batch_a, 5, seed=42, steps=20)
    torch.manual_seed(12)  # the unseeded rows' RNG differs too
    run_b = _seeded_run(batch_b, 0, seed=42, steps=20)
    assert run_a == run_b
    assert len(set(run_a)) > 5, "the seeded row must actually sample"
    assert _seeded_run(batch_b, 0, seed=43, steps=20) != run_a


def test_two_seeded_rows_use_their_own_generators() -> None:
    row = _logits(1, seed=3)
    logits = row.expand(4, V).contiguous()
    gens = {1: torch.Generator().manual_seed(5), 3: torch.Generator().manual_seed(5)}
    for _ in range(10):
        out = Sampler()(logits, _meta(4, temperature=1.0, generators=gens)).sampled_token_ids
        assert out[1] == out[3]


# ---------------------------------------------------------------- logprobs


def test_logprobs_layout_values_and_ranks() -> None:
    logits = _logits(scale=2.0)
    k = 5
    temp = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.0, 0.7, 1.5, 0.3])
    out = Sampler()(logits, _meta(B, temperature=temp, top_k=torch.full((B,), 50), max_num_logprobs=k))
    assert out.logprobs is not None and out.logprob_token_ids is not None and out.sampled_ranks is not None
    assert out.logprobs.shape == (B, k + 1) and out.logprob_token_ids.shape == (B, k + 1)
    # Before temperature: the raw log_softmax, whatever the row's temperature.
    ref = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], ref.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top_vals, top_ids = ref.topk(k, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_vals)
    order = ref.argsort(dim=-1, descending=True)
    for r in range(B):
        rank = order[r].tolist().index(int(sampled[r])) + 1
        assert out.sampled_ranks[r].item() == rank
    assert (out.sampled_ranks[temp == 0] == 1).all()
    assert out.sampled_ranks.max() > 1  # some random row did not pick the argmax


def test_zero_logprobs_returns_only_the_sampled_token() -> None:
    logits = _logits()
    out = Sampler()(logits, _meta(B, max_num_logprobs=0))
    assert out.logprobs is not None and out.logprobs.shape == (B, 1)
    assert out.sampled_ranks is not None and (out.sampled_ranks == 1).all()


# ---------------------------------------------------------------- penalties


def _reference_penalties(logits: Tensor, prompts: list[list[int]], outputs: list[list[int]],
                         rep: list[float], pres: list[float], freq: list[float]) -> Tensor:
    """Row by row, token by token: repetition (prompt or output), then frequency, then presence."""
    result = logits.clone()
    for r in range(logits.shape[0]):
        for tok in set(prompts[r]) | set(outputs[r]):
            value = result[r, tok].item()
            result[r, tok] = value / rep[r] if value > 0 else value * rep[r]
        for tok in set(outputs[r]):
            result[r, tok] -= freq[r] * outputs[r].count(tok) + pres[r]
    return result


def _padded(rows: list[list[int]]) -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [V] * (width - len(r)) for r in rows], dtype=torch.int64)


@pytest.mark.parametrize("which", ["repetition", "presence", "frequency", "all"])
def test_penalties_match_reference(which: str) -> None:
    logits = _logits(scale=2.0, seed=4)
    gen = torch.Generator().manual_seed(8)
    greedy = logits.argmax(dim=-1)
    prompts = [torch.randint(0, V, (int(n),), generator=gen).tolist() for n in torch.randint(1, 30, (B,))]
    # Outputs repeat each row's argmax (so penalties must move the greedy pick) plus random tokens.
    outputs = [[int(greedy[r])] * (r % 3 + 1) + torch.randint(0, V, (r * 3,), generator=gen).tolist()
               for r in range(B)]
    prompts[2] = prompts[2] + [int(logits[2].argmin())]  # a negative logit, seen in the prompt only
    rep = [1.0] * B
    pres = [0.0] * B
    freq = [0.0] * B
    if which in ("repetition", "all"):
        rep = [1.0, 3.0, 1.5, 10.0, 2.0, 0.5, 4.0, 5.0]  # row 0 off, row 5 rewards repeats
    if which in ("presence", "all"):
        pres = [0.0, 5.0, 2.0, 10.0, -1.0, 3.0, 8.0, 6.0]
    if which in ("frequency", "all"):
        freq = [0.0, 2.0, 4.0, 1.0, 3.0, 5.0, 2.5, 6.0]
    meta = _meta(B, prompt_token_ids=_padded(prompts), output_token_ids=_padded(outputs),
                 max_num_logprobs=V - 1,
                 repetition_penalty=torch.tensor(rep) if which in ("repetition", "all") else None,
                 presence_penalty=torch.tensor(pres) if which in ("presence", "all") else None,
                 frequency_penalty=torch.tensor(freq) if which in ("frequency", "all") else None)
    out = Sampler()(logits, meta)
    ref = _reference_penalties(logits, prompts, outputs, rep, pres, freq)
    assert torch.equal(out.sampled_token_ids, ref.argmax(dim=-1))
    changed = out.sampled_token_ids != greedy
    assert changed.sum() >= 4 and not changed[0]  # row 0 has every penalty off
    # The full processed distribution, seen through the logprobs (top V-1 of V tokens).
    assert out.logprobs is not None and out.logprob_token_ids is not None
    ref_vals, ref_ids = torch.log_softmax(ref, dim=-1).topk(V - 1, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], ref_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], ref_vals, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(("field", "kwargs"), [
    ("top_k", {"top_k": torch.ones(3, dtype=torch.int64)}),
    ("output_token_ids", {"presence_penalty": torch.zeros(B)}),
    ("prompt_token_ids", {"repetition_penalty": torch.ones(B), "output_token_ids": torch.zeros(B, 1, dtype=torch.int64)}),
    ("bad_token_mask", {"bad_token_mask": torch.zeros(B, V - 1, dtype=torch.bool)}),
    ("max_num_logprobs", {"max_num_logprobs": V}),
    ("generators", {"generators": {B: torch.Generator()}}),
    ("min_tokens_block", {"min_tokens_block": [(-1, [0])]}),
])
def test_bad_metadata_raises_value_error_naming_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=field):
        Sampler()(_logits(), _meta(B, **kwargs))


def test_bad_logits_shape_raises() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(V), _meta(B))


@pytest.mark.parametrize("peaked", [True, False])
def test_cpu_candidate_window_gives_the_same_tokens_as_a_full_sort(
        monkeypatch: pytest.MonkeyPatch, peaked: bool) -> None:
    """The CPU shortcut (look for the nucleus among the largest logits first) changes nothing."""
    import forerun.worker.sampler as sampler_module

    logits = _logits(scale=6.0 if peaked else 1.0, seed=21)
    top_k = torch.tensor([0, 40, 0, 5, V, 0, 200, 0])
    top_p = torch.tensor([0.9, 0.95, 1.0, 0.5, 0.8, 0.3, 0.99, 0.6])

    def run() -> Tensor:
        gens = {r: torch.Generator().manual_seed(100 + r) for r in range(B)}
        return torch.stack([Sampler()(logits, _meta(B, temperature=1.0, top_k=top_k, top_p=top_p,
                                                     generators=gens)).sampled_token_ids
                            for _ in range(30)])

    full = run()
    monkeypatch.setattr(sampler_module, "_CPU_NUCLEUS_CANDIDATES", 16)
    assert torch.equal(run(), full)
    assert len(set(full[:, 3].tolist())) <= 5  # row 3 has top_k = 5
    assert len(set(full[:, 0].tolist())) > 1  # and the rows really sample
