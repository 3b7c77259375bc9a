"""RL trainers' engine calls: load_weights in place (token for token equal to a fresh engine over the
same weights), collective_rpc by name, callable and extension, load_format="dummy", prompt dicts,
detokenize=False, and the ValueErrors of bad calls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import save_tiny_model
from forerun import LLM, SamplingParams
from rl_helpers import changed, read_weights, write_checkpoint

PROMPTS = [{"prompt_token_ids": [1, 504, 3458, 314, 1345]}, "The capital of France is a city that",
           {"prompt": "One two three four five six"}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, detokenize=False, logprobs=0)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, smollm2_dir) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("policy"), smollm2_dir, initializer_range=0.3)


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory, policy_dir) -> Path:
    """The policy after a "training step": its two changed layers negated, the rest as it was."""
    weights = read_weights(policy_dir)
    return write_checkpoint(policy_dir, tmp_path_factory.mktemp("trained"), {**weights, **changed(weights)})


def engine(model: Path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")  # exact: the CPU's auto choice may be bf16
    return LLM(model=str(model), show_progress=False, **kw)


def tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(policy_dir, trained_dir) -> dict[str, list[list[int]]]:
    """Tokens of fresh engines over each checkpoint."""
    out = {}
    for name, folder in (("policy", policy_dir), ("trained", trained_dir)):
        with engine(folder) as llm:
            out[name] = tokens(llm)
    assert out["policy"] != out["trained"], "the change must change the tokens, or equality means nothing"
    return out


# native: the packed GEMM replaces the dense weights (they come back for the update); aten: F.linear
# reads the dense weights themselves; mp TP 2: each worker process cuts its own shard; PP 2: each
# stage keeps its own layers (and the last stage the tied embedding its LM head reads).
@pytest.mark.parametrize("kw", [dict(linear_kernel="native", async_scheduling=True),
                                dict(linear_kernel="aten", async_scheduling=False),
                                dict(distributed_executor_backend="mp", tensor_parallel_size=2,
                                     async_scheduling=True),
                                dict(distributed_executor_backend="mp", pipeline_parallel_size=2,
                                     async_scheduling=True)],
                         ids=["uni-native-async", "uni-aten-sync", "mp-tp2-async", "mp-pp2-async"])
def test_load_weights_equals_a_fresh_engine(kw, policy_dir, reference, track_llm):
    llm = track_llm(engine(policy_dir, **kw))
    assert tokens(llm) == reference["policy"]
    llm.load_weights(changed(read_weights(policy_dir)).items())
    assert tokens(llm) == reference["trained"]
    llm.load_weights(read_weights(policy_dir).items())  # back: every weight pushed again
    assert tokens(llm) == reference["policy"]


def test_one_tensor_per_call_through_an_extension(policy_dir, reference, track_llm):
    """TRL / OpenRLHF push one parameter per RPC: q, k and v of a packed layer arrive in separate calls."""
    llm = track_llm(engine(policy_dir, linear_kernel="native", worker_extension_cls="rl_helpers.TrainerExtension"))
    tokens(llm)
    for name, tensor in changed(read_weights(policy_dir)).items():
        assert llm.collective_rpc("update_named_param", args=(name, tensor)) == [[name]]
    llm.reset_prefix_cache()
    assert tokens(llm) == reference["trained"]


def test_prefix_cache_is_reset_by_load_weights(policy_dir, trained_dir, track_llm):
    """The same long prompt again after the update: its cached blocks would hold the old weights' keys."""
    prompt = {"prompt_token_ids": list(range(100, 150))}  # three full blocks of 16 to cache
    with engine(trained_dir) as fresh:
        want = fresh.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    llm = track_llm(engine(policy_dir))
    llm.generate(prompt, PARAMS, use_tqdm=False)
    assert llm.engine.core.scheduler.kv.pool._cached, "the prompt's full blocks are cached"
    llm.load_weights(changed(read_weights(policy_dir)).items())
    assert llm.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == want


def test_dummy_load_format_then_push_every_weight(policy_dir, reference, track_llm):
    llm = track_llm(engine(policy_dir, load_format="dummy"))
    assert tokens(llm) != reference["policy"]
    llm.load_weights(read_weights(policy_dir).items())
    assert tokens(llm) == reference["policy"]


@pytest.mark.parametrize("backend,tp", [("uni", 1), ("mp", 2)])
def test_collective_rpc_by_name_callable_and_extension(backend, tp, policy_dir, track_llm):
    llm = track_llm(engine(policy_dir, distributed_executor_backend=backend, tensor_parallel_size=tp,
                           worker_extension_cls="rl_helpers.TrainerExtension"))
    pids = llm.collective_rpc("ping")
    assert len(pids) == tp and len(set(pids)) == tp
    offset = 10  # a closure: shipped by value
    assert llm.collective_rpc(lambda worker, x: worker.rank + x + offset, args=(1,)) == [11 + r for r in range(tp)]
    assert llm.collective_rpc("report_rank", kwargs={"tag": "t"}, timeout=60) == [(r, "t", pids[r]) for r in range(tp)]
    with pytest.raises(ValueError, match="no method 'nope'"):
        llm.collective_rpc("nope")
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        llm.collective_rpc(lambda worker: 1 / 0)
    assert llm.collective_rpc("ping") == pids, "a failed call leaves the workers usable"


def test_bad_calls_name_what_is_wrong(policy_dir, track_llm):
    llm = track_llm(engine(policy_dir))
    before = tokens(llm)
    with pytest.raises(ValueError, match="unknown parameter 'model.layers.0.mlp.nope.weight'"):
        llm.load_weights([("model.layers.0.mlp.nope.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.weight' has shape \(2, 64\), expected"):
        llm.load_weights([("model.layers.1.self_attn.k_proj.weight", torch.zeros(2, 64))])
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        llm.load_weights([("model.norm.weight", [1.0] * 64)])
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep(1)
    with pytest.raises(ValueError, match="not asleep"):
        llm.wake_up()
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [1], "prompt": "x"}, PARAMS)
    with pytest.raises(ValueError, match="worker_extension_cls"):
        engine(policy_dir, worker_extension_cls="rl_helpers.NoSuchClass")
    assert tokens(llm) == before, "refused calls changed nothing"




@pytest.fixture(scope="module")
def bf16_exact_dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """A policy whose fp32 weights bf16 holds exactly (stored as bf16), so small batches read compact bf16
    copies and decode runs the one-call C step; "negated" stays bf16-exact, "scaled" does not."""
    policy = save_tiny_model(tmp_path_factory.mktemp("bf16-policy"), smollm2_dir, stored_dtype="bfloat16")
    weights = {k: v.float() for k, v in read_weights(policy).items()}
    out = {"policy": policy}
    for name, change in (("negated", changed(weights)),
                         ("scaled", {k: v * 1.0001 for k, v in weights.items() if ".layers.1." in k})):
        out[name] = write_checkpoint(policy, tmp_path_factory.mktemp(name), {**weights, **change})
    return out


def test_compact_copies_and_the_one_call_step_are_rebuilt(bf16_exact_dirs, track_llm):
    kw = dict(gemv_max_rows=8, linear_kernel="native")
    refs = {}
    for name in ("negated", "scaled"):
        with engine(bf16_exact_dirs[name], **kw) as fresh:
            refs[name] = tokens(fresh)
    llm = track_llm(engine(bf16_exact_dirs["policy"], **kw))
    fused = llm.collective_rpc(lambda w: w.model.decode_layers)[0]
    assert fused is not None, "decode steps run as one C call over the compact weights"
    for name in ("negated", "scaled"):
        llm.load_weights(read_weights(bf16_exact_dirs[name]).items())
        assert tokens(llm) == refs[name], name
    # Weights bf16 cannot hold leave layer 1 without a compact copy, so no one-call step either.
    assert llm.collective_rpc(lambda w: (w.model.model.layers[1].mlp.down_proj.small, w.model.decode_layers)) == [
        (None, None)]


def test_sampled_logprobs_are_the_untempered_distribution(policy_dir, trained_dir, track_llm):
    """What docs/rl.md promises a trainer: each sampled token's logprob is log_softmax of the fp32 logits
    before temperature, as transformers computes it over the same weights (here after an update)."""
    import transformers as tf
    llm = track_llm(engine(policy_dir))
    llm.load_weights(changed(read_weights(policy_dir)).items())
    prompt = [1, 504, 3458, 314, 1345]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=8, logprobs=0, detokenize=False)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert all(len(lp) == 1 for lp in out.logprobs), "logprobs=0: the sampled token's only"
    got = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
    hf = tf.AutoModelForCausalLM.from_pretrained(trained_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + list(out.token_ids)])).logits[0, len(prompt) - 1:-1]
    ids = torch.tensor(out.token_ids).unsqueeze(1)
    want = torch.log_softmax(logits, -1).gather(1, ids).squeeze(1)
    tempered = torch.log_softmax(logits / 0.7, -1).gather(1, ids).squeeze(1)
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    assert not torch.allclose(got, tempered, atol=1e-2)
