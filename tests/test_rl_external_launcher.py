"""The RL loop under torchrun, TP 2 on external_launcher with async scheduling: each rank's "trainer"
generates, negates two layers, pushes them with load_weights and generates again, which must equal a
fresh engine over a checkpoint with those weights, token for token in fp32; then sleep(2), wake_up()
and pushing every weight gives the same tokens again. collective_rpc returns one value per rank."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from conftest import save_tiny_model
from forerun import LLM, SamplingParams
from rl_helpers import changed, read_weights, write_checkpoint
from test_external_launcher import run_torchrun

PROMPTS = [[1, 504, 3458, 314, 1345], [1, 1462, 6052, 282, 4649, 314], [1, 3264, 827, 1545, 2116]]
TESTS = Path(__file__).resolve().parent

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[3])
    from forerun import LLM, SamplingParams
    from rl_helpers import changed, read_weights
    from pathlib import Path
    model, out_dir, prompts = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[4])
    rank = int(os.environ["RANK"])
    llm = LLM(model=str(model), distributed_executor_backend="external_launcher", tensor_parallel_size=2,
              async_scheduling=True, dtype="float32", enable_sleep_mode=True, show_progress=False,
              worker_extension_cls="rl_helpers.TrainerExtension")
    params = SamplingParams(temperature=0.0, max_tokens=12, detokenize=False, logprobs=0)
    def generate():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    result = {"before": generate()}
    weights = read_weights(model)  # the trainer's full (unsharded) tensors
    trained = changed(weights)
    llm.load_weights(trained.items())
    result["after"] = generate()
    llm.sleep(level=2)
    try:
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    except ValueError as exc:
        result["asleep_error"] = str(exc)
    llm.wake_up(tags=["weights"])
    llm.load_weights({**weights, **trained}.items())
    llm.wake_up(tags=["kv_cache"])
    result["after_sleep"] = generate()
    result["rpc_name"] = llm.collective_rpc("report_rank", args=("x",))
    result["rpc_callable"] = llm.collective_rpc(lambda worker, k: worker.tp.rank * k, args=(3,))
    llm.shutdown()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
""")


def test_torchrun_tp2_rl_loop_matches_a_fresh_engine(tmp_path, smollm2_dir):
    policy = save_tiny_model(tmp_path / "policy", smollm2_dir, initializer_range=0.3)
    weights = read_weights(policy)
    trained = write_checkpoint(policy, tmp_path / "trained", {**weights, **changed(weights)})
    params = SamplingParams(temperature=0.0, max_tokens=12)
    refs = {}
    for name, folder in (("before", policy), ("after", trained)):
        with LLM(model=str(folder), dtype="float32", show_progress=False) as llm:
            refs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert refs["before"] != refs["after"]
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    run_torchrun(script, str(policy), str(tmp_path), str(TESTS), json.dumps(PROMPTS), timeout=240)
    pids = []
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["before"] == refs["before"], f"rank {rank} before"
        assert result["after"] == refs["after"], f"rank {rank} after load_weights"
        assert result["after_sleep"] == refs["after"], f"rank {rank} after sleep(2), wake_up, load_weights"
        assert "asleep" in result["asleep_error"]
        assert [r[:2] for r in result["rpc_name"]] == [[0, "x"], [1, "x"]]
        assert result["rpc_callable"] == [0, 3]
        pids.append([r[2] for r in result["rpc_name"]])
    assert pids[0] == pids[1] and len(set(pids[0])) == 2, "every rank sees every rank's result"
