"""The RL loop with forerun: generate rollouts, update the policy, push the new weights, generate again.

    python docs/rl_example.py                            # one process
    torchrun --nproc-per-node 3 docs/rl_example.py       # three tensor-parallel ranks (9 heads)

The policy is the default model exported as a float32 Hugging Face folder (a GGUF file's quantized
weights cannot be updated in place). The "training step" scales two layers' MLP weights; a real
trainer computes new weights from the rollouts' tokens and logprobs instead.
"""

import os
import tempfile
from pathlib import Path

import torch

from forerun import LLM, SamplingParams
from forerun.loader.gguf_convert import export_hf_folder
from forerun.loader.model_source import default_model_gguf
from forerun.loader.weights import iter_safetensors

world = int(os.environ.get("WORLD_SIZE", "1"))
folder = Path(tempfile.gettempdir()) / f"forerun-rl-policy-{os.environ.get('RANK', '0')}"
if not (folder / "model.safetensors").exists():
    folder.mkdir(parents=True, exist_ok=True)
    export_hf_folder(default_model_gguf(), folder)
policy = dict(iter_safetensors(folder))  # the trainer's own (full, unsharded) copy of the weights

llm = LLM(model=str(folder), dtype="float32", enable_sleep_mode=True, show_progress=False,
          distributed_executor_backend="external_launcher" if world > 1 else "uni", tensor_parallel_size=world)
prompts = [{"prompt_token_ids": llm.tokenizer.encode(text)} for text in ("The capital of France is", "2 + 2 =")]
params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=24, logprobs=0, detokenize=False)

for step in range(3):
    rollouts = llm.generate(prompts, params, use_tqdm=False)
    for out in rollouts:
        for c in out.outputs:  # the sampled tokens and each one's logprob as the sampler computed it
            logprobs = [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]
            if os.environ.get("RANK", "0") == "0":
                print(f"step {step}: {len(c.token_ids)} tokens, mean logprob {sum(logprobs) / len(logprobs):.3f}")
    llm.sleep(level=1)  # the KV cache's memory goes back to the OS while the trainer works
    with torch.no_grad():  # the "training step"
        for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"):
            policy[name] = policy[name] * 0.9
    llm.wake_up(tags=["weights"])
    llm.load_weights((name, policy[name]) for name in ("model.layers.0.mlp.down_proj.weight",
                                                       "model.layers.1.mlp.down_proj.weight"))
    llm.wake_up(tags=["kv_cache"])

print("rank", os.environ.get("RANK", "0"), "ranks' pids:", llm.collective_rpc("ping"))
llm.shutdown()
if world > 1:
    torch.distributed.destroy_process_group()  # the engine leaves the process group to the script
