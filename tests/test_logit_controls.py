"""logit_bias, allowed_token_ids and bad_words: the sampler's arithmetic, the per-step inputs, the engine
against a transformers reference (fp32) in sync, async and speculative modes and with grammars, the
validation errors, and the OpenAI server on SmolLM2."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from conftest import save_tiny_model
from forerun import LLM, SamplingParams
from forerun.engine.tokenizer import Tokenizer
from forerun.structured.spec import StructuredOutputsParams
from forerun.worker.input_batch import InputBatch
from forerun.worker.sampler import Sampler
from forerun.worker.sampling_inputs import build_sampling_metadata
from forerun.worker.sampling_metadata import SamplingMetadata
from serve_helpers import serving

CPU = torch.device("cpu")
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "In 1492, Columbus"]
N = 12
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ---- the transformers reference -----------------------------------------------------------------

def banned_now(out: list[int], words: list[list[int]]) -> set[int]:
    """vLLM's rule: a word's last token is banned when the output so far ends with its other tokens."""
    return {w[-1] for w in words if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])}


def hf_controlled_greedy(model, prompt: list[int], n: int, bias: dict[int, float] | None = None,
                         allowed: list[int] | None = None, words: list[list[int]] = ()) -> list[int]:
    """Greedy decoding with the controls written out plainly: biases added, everything else set to -inf."""
    out: list[int] = []
    with torch.inference_mode():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            logits = res.logits[0, -1].float().clone()
            for tok, b in (bias or {}).items():
                logits[tok] += b
            if allowed is not None:
                keep = torch.zeros_like(logits, dtype=torch.bool)
                keep[allowed] = True
                logits[~keep] = float("-inf")
            for tok in banned_now(out, list(words)):
                logits[tok] = float("-inf")
            out.append(int(logits.argmax()))
            res = model(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), dtype="float32", async_scheduling=request.param, show_progress=False) as llm:
        yield llm


def generate(llm: LLM, prompts: list, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **kw)


# ---- the sampler and its inputs, on small tensors -----------------------------------------------

def test_sampler_adds_bias_and_bans_but_never_empties_a_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen)
    bias = (torch.tensor([0, 0, 2]), torch.tensor([4, 7, 9]), torch.tensor([1.5, -3.0, 100.0]))
    banned = torch.zeros(3, 50, dtype=torch.bool)
    banned[1, :10] = True
    banned[2] = True  # would leave row 2 with nothing: it keeps its logits unbanned
    grammar = torch.zeros(3, 50, dtype=torch.bool)
    grammar[2, 9] = True  # the grammar forbids 9 in row 2 whatever the bias says
    meta = SamplingMetadata(temperature=torch.zeros(3), all_greedy=True, max_num_logprobs=0,
                            logit_bias=bias, banned_tokens=banned, bad_token_mask=grammar)
    x, _ = Sampler().process(logits, meta)
    want = logits.clone()
    want[0, 4] += 1.5
    want[0, 7] -= 3.0
    want[1, :10] = float("-inf")
    want[2, 9] = float("-inf")
    assert torch.equal(x, want)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == want.argmax(-1).tolist()
    assert torch.isfinite(out.logprobs).all()  # logprobs describe the biased, banned distribution
    with pytest.raises(ValueError, match="banned_tokens"):
        Sampler()(logits, SamplingMetadata(temperature=torch.zeros(3), banned_tokens=banned[:2]))


def test_random_rows_respect_bias_and_bans():
    logits = torch.zeros(2, 30).repeat_interleave(200, dim=0)  # uniform rows: only the controls decide
    rows = torch.arange(200)
    bias = (rows, torch.full((200,), 5), torch.full((200,), 100.0))  # rows 0..199 forced to token 5
    banned = torch.ones(400, 30, dtype=torch.bool)
    banned[200:, 20:] = False  # rows 200..399 may only draw 20..29
    banned[:200] = False
    meta = SamplingMetadata(temperature=torch.ones(400), all_random=True, logit_bias=bias, banned_tokens=banned)
    got = Sampler()(logits, meta).sampled_token_ids
    assert set(got[:200].tolist()) == {5}
    assert set(got[200:].tolist()) <= set(range(20, 30)) and len(set(got[200:].tolist())) > 5


def add_row(batch: InputBatch, rid: str, prompt: list[int], out: list[int], sp: SamplingParams):
    return batch.add(rid, prompt + out, len(prompt), sp, frozenset({0}), [0], len(prompt) + len(out), CPU)


def test_per_step_inputs_ban_a_word_only_after_its_prefix_and_cost_nothing_without_controls():
    batch = InputBatch(4, 32, 2)
    plain = add_row(batch, "plain", [1, 2], [3], SamplingParams(temperature=0))
    meta = build_sampling_metadata(batch, [plain], 20, CPU)
    assert meta.logit_bias is None and meta.banned_tokens is None and not batch.controlled
    words = [[7], [3, 4], [5, 6, 8]]
    sp = SamplingParams(temperature=0, bad_words_token_ids=words, logit_bias={9: -2.0}, allowed_token_ids=None)
    after3 = add_row(batch, "after3", [1, 2], [5, 3], sp)
    prompt5 = add_row(batch, "prompt5", [1, 5], [6], sp)  # 5, 6 ends prompt + output, not the output
    allowed = add_row(batch, "allowed", [1], [2], SamplingParams(temperature=0, allowed_token_ids=[2, 11]))
    states = [plain, after3, prompt5, allowed]
    meta = build_sampling_metadata(batch, states, 20, CPU)
    ban = meta.banned_tokens
    assert ban is not None and ban.shape == (4, 20)
    assert not ban[0].any()
    assert set(ban[1].nonzero().flatten().tolist()) == {7, 4}
    assert set(ban[2].nonzero().flatten().tolist()) == {7}  # only generated tokens count as the prefix
    assert set((~ban[3]).nonzero().flatten().tolist()) == {2, 11}
    rows, ids, vals = meta.logit_bias
    assert sorted(zip(rows.tolist(), ids.tolist(), vals.tolist())) == [(1, 9, -2.0), (2, 9, -2.0)]
    # Drafts before a verified position count as output: after drafts [5, 6] the row must not take 8.
    meta = build_sampling_metadata(batch, [after3, after3], 20, CPU, extra_outputs=[[], [5, 6]])
    assert set(meta.banned_tokens[0].nonzero().flatten().tolist()) == {7, 4}
    assert set(meta.banned_tokens[1].nonzero().flatten().tolist()) == {7, 8}
    batch.remove("after3", finished=True)
    batch.remove("prompt5", finished=False)
    batch.remove("allowed", finished=True)
    assert not batch.controlled


# ---- the engine against transformers -----------------------------------------------------------

def test_minus_100_bias_removes_the_greedy_token_as_masking_it_would(llm, hf_model):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    plain = generate(llm, ids, greedy())
    for prompt, ref in zip(ids, plain):
        assert hf_controlled_greedy(hf_model, prompt, N) == ref
    biased = generate(llm, ids, [greedy(logit_bias={p[0]: -100.0}) for p in plain])
    for prompt, p, got in zip(ids, plain, biased):
        assert p[0] not in got
        assert got == hf_controlled_greedy(hf_model, prompt, N, allowed=None, words=[[p[0]]])
        assert got != p


def test_plus_100_bias_forces_a_token_greedy_and_random(llm):
    target = 1234
    for temperature in (0.0, 1.0):
        sp = SamplingParams(temperature=temperature, max_tokens=N, ignore_eos=True, seed=3,
                            logit_bias={target: 100.0, 99: -5.0})
        assert generate(llm, PROMPTS, sp) == [[target] * N] * len(PROMPTS)


def test_allowed_token_ids_restrict_every_token(llm, hf_model):
    allowed = [262, 314, 1234, 5000, 40000]
    got = generate(llm, PROMPTS, SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True,
                                                allowed_token_ids=allowed, seed=1))
    assert all(set(g) <= set(allowed) for g in got) and len({t for g in got for t in g}) > 1
    ids = llm.tokenizer.encode(PROMPTS[0])
    assert generate(llm, [ids], greedy(allowed_token_ids=allowed))[0] == \
        hf_controlled_greedy(hf_model, ids, N, allowed=allowed)


def contains(seq: list[int], word: list[int]) -> bool:
    return any(seq[i:i + len(word)] == word for i in range(len(seq) - len(word) + 1))


def test_bad_words_never_appear_one_and_several_tokens(llm, hf_model):
    tok = llm.tokenizer
    ids = tok.encode(PROMPTS[0])
    plain = generate(llm, [ids], greedy())[0]
    # A word of two tokens the model does generate (its own spelling after a space), and one of one token.
    pair = next(i for i in range(2, N - 1) if tok.encode(tok.decode(plain[i:i + 2]), add_special_tokens=False)
                == plain[i:i + 2] and tok.decode(plain[i:i + 2]).startswith(" "))
    two = tok.decode(plain[pair:pair + 2]).strip()
    one = tok.decode(plain[:1]).strip()
    words = llm.engine.inputs.bad_words_token_ids(SamplingParams(bad_words=[two, one]))
    assert plain[pair:pair + 2] in words and any(len(w) == 1 and w[0] == plain[0] for w in words)
    got = generate(llm, [ids], greedy(bad_words=[two, one]))[0]
    assert not any(contains(got, w) for w in words)
    assert got == hf_controlled_greedy(hf_model, ids, N, words=words) != plain
    # The multi-token word alone: the output is plain greedy until the word's last token would follow.
    got = generate(llm, [ids], greedy(bad_words=[two]))[0]
    assert got[:pair + 1] == plain[:pair + 1] and got[pair + 1] != plain[pair + 1]
    assert not contains(got, plain[pair:pair + 2])


def test_bad_words_are_tokenized_with_and_without_a_leading_space(llm):
    tok = llm.tokenizer
    words = llm.engine.inputs.bad_words_token_ids(SamplingParams(bad_words=["  Paris"], bad_words_token_ids=[[5]]))
    assert words == [[5], tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)]
    sp = SamplingParams(bad_words=["Paris"], n=2)
    _, _, reqs = llm.engine.inputs.process("probe", "x", sp)
    assert [r.sampling_params.bad_words_token_ids for r in reqs] == [words[1:]] * 2  # each child bans them
    assert sp.bad_words_token_ids is None  # the caller's params are not changed


def test_sync_and_async_agree_on_a_mixed_batch(tiny_llama_dir):
    params = [greedy(), greedy(logit_bias={262: 4.0, 11: -100.0}),
              SamplingParams(temperature=0.9, top_k=50, max_tokens=N, ignore_eos=True, seed=7,
                             allowed_token_ids=list(range(200, 260))),
              SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, seed=8, bad_words=["the", "of the"],
                             logit_bias={13: 3.0}, repetition_penalty=1.3)]
    prompts = PROMPTS + ["Hello"]
    runs = []
    for mode in (False, True):
        with LLM(model=str(tiny_llama_dir), dtype="float32", async_scheduling=mode, show_progress=False) as llm:
            runs.append(generate(llm, prompts, params))
    assert runs[0] == runs[1]
    assert all(200 <= t < 260 for t in runs[0][2])


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 64-token model with its attention outputs zeroed: each token's successor depends on that token
    alone, so greedy output falls into a cycle that the n-gram drafter predicts several tokens ahead."""
    import transformers as tf
    folder = save_tiny_model(tmp_path_factory.mktemp("bigram"), smollm2_dir, vocab_size=64)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_speculative_decoding_applies_the_controls_at_every_draft_position(bigram_dir, async_mode):
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(bigram_dir, torch_dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 64, size=int(rng.integers(6, 20))).tolist() for _ in range(4)]
    n = 40
    base = dict(temperature=0.0, max_tokens=n, ignore_eos=True)
    with LLM(model=str(bigram_dir), dtype="float32", show_progress=False) as llm:
        plain = generate(llm, prompts, SamplingParams(**base))
    # Prompts that already hold the cycle, so the drafter proposes the banned pair inside a run of drafts:
    # the ban must then count the drafts before its position as output.
    prompts = [p + out[:16] for p, out in zip(prompts, plain)]
    words = [plain[0][20:22]]
    bias = {plain[3][1]: -100.0, 7: 2.0}
    refs = [hf_controlled_greedy(model, p, n, bias=bias, words=words) for p in prompts]
    with LLM(model=str(bigram_dir), dtype="float32", show_progress=False, async_scheduling=async_mode,
             speculative_config=SPEC) as llm:
        got = generate(llm, prompts, SamplingParams(**base, bad_words_token_ids=words, logit_bias=bias))
        stats = llm.engine.core.scheduler.spec_stats
    assert got == refs
    assert stats.num_accepted_tokens > n and stats.num_draft_tokens > stats.num_accepted_tokens
    assert not any(contains(g, words[0]) for g in got) and all(contains(p, words[0]) for p in prompts)


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_with_a_grammar_both_masks_hold_and_the_grammar_wins_a_conflict(tiny_llama_dir, async_mode):
    with LLM(model=str(tiny_llama_dir), dtype="float32", async_scheduling=async_mode, show_progress=False) as llm:
        digit = {d: llm.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
        regex = StructuredOutputsParams(regex=r"[0-9]{3}")
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, structured_outputs=regex,
                                 allowed_token_ids=[digit[1], digit[2]]) for s in range(3)]
        params += [SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=regex, logit_bias={digit[7]: 100}),
                   SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=regex, bad_words=["0", "1", "2"]),
                   # Nothing the grammar allows is allowed here: the grammar's mask alone decides.
                   SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=regex,
                                  allowed_token_ids=llm.tokenizer.encode(" hello", add_special_tokens=False))]
        outs = [o.outputs[0] for o in llm.generate(["Some digits:"] * len(params), params, use_tqdm=False)]
    for o in outs[:3]:
        assert re.fullmatch(r"[12]{3}", o.text), o.text
    assert outs[3].text == "777"
    assert re.fullmatch(r"[3-9]{3}", outs[4].text), outs[4].text
    assert re.fullmatch(r"[0-9]{3}", outs[5].text), outs[5].text
    assert all(o.finish_reason == "stop" for o in outs)


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: -101}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": "Paris"}, "bad_words"),
    ({"bad_words_token_ids": [[]]}, "bad_words"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_bias_bounds_are_accepted_and_normalised():
    sp = SamplingParams(logit_bias={3: 100, 4: -100, 5: 0.5})
    assert sp.logit_bias == {3: 100.0, 4: -100.0, 5: 0.5} and all(type(v) is float for v in sp.logit_bias.values())


@pytest.mark.parametrize("kwargs, field", [
    ({"logit_bias": {49152: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [3, 10**6]}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[3, 49152]]}, "bad_words"),
])
def test_ids_outside_the_vocabulary_are_refused_naming_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate(["Hello"], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert len(generate(llm, ["Hello"], greedy())[0]) == N  # the engine carries on


# ---- the server on SmolLM2 ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_server(smollm2_dir):
    yield from serving(smollm2_dir, "--served-model-name", "smol", "--max-model-len", "512",
                       "--num-kv-blocks", "64", "--dtype", "float32")


def test_server_minus_100_on_paris(smol_server, smollm2_dir):
    paris = Tokenizer.from_folder(smollm2_dir).encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    url = f"{smol_server.base_url}/v1/completions"
    body = {"model": "smol", "prompt": "The capital of France is", "temperature": 0, "max_tokens": 4}
    plain = httpx.post(url, json=body, timeout=60)
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"].startswith(" Paris")
    r = httpx.post(url, json={**body, "logit_bias": {str(paris[0]): -100}}, timeout=60)
    assert r.status_code == 200, r.text
    assert " Paris" not in r.json()["choices"][0]["text"]
    yes_no = [Tokenizer.from_folder(smollm2_dir).encode(w, add_special_tokens=False)[0] for w in (" yes", " no")]
    r = httpx.post(url, json={**body, "allowed_token_ids": yes_no, "max_tokens": 6}, timeout=60)
    assert r.status_code == 200 and set(r.json()["choices"][0]["text"].split()) <= {"yes", "no"}


def test_server_chat_bad_words_and_bias(smol_server):
    url = f"{smol_server.base_url}/v1/chat/completions"
    body = {"model": "smol", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 16}
    plain = httpx.post(url, json=body, timeout=60)
    assert plain.status_code == 200 and "Paris" in plain.json()["choices"][0]["message"]["content"]
    r = httpx.post(url, json={**body, "bad_words": ["Paris"]}, timeout=60)
    assert r.status_code == 200, r.text
    assert "Paris" not in r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"99999999": -100}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"allowed_token_ids": [99999999]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
])
def test_server_bad_values_give_400_naming_the_field(smol_server, endpoint, extra, param):
    body = {"model": "smol", "max_tokens": 2, **extra}
    body.update({"prompt": "Hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    for stream in (False, True):
        r = httpx.post(f"{smol_server.base_url}/v1/{endpoint}", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(param), err
