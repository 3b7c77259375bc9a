"""`forerun bench invariance`: does a request's output depend on what runs beside it?

A few target prompts run alone, then amid random requests of varied lengths and sampling settings, in
several engines: the default batching, chunked prefill with a small token budget, after prefix-cache
hits, and with async scheduling off. For greedy and seeded sampling it counts the targets whose
tokens and logprobs equal, bit for bit, those of the prompt run alone (and, apart, those whose tokens
alone do), and prints the counts as JSON.
With `--batch-invariant` every count should be whole; without it, on most CPUs, it is not.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from typing import Any, Sequence

from forerun.engine.llm import LLM
from forerun.outputs import RequestOutput
from forerun.sampling_params import SamplingParams

Prompt = str | list[int]
# Long enough (40-60 tokens) to fill whole 16-token cache blocks, so prefix-cache hits and chunks cut them.
TARGETS = [
    "The history of the city begins with a small fishing village on the river. Over the centuries it grew "
    "into a market town, then a port, and finally the capital of the region. Today the city is known for",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that large n "
    "do not overflow the stack.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker and "
    "his granddaughter. Every morning the girl would climb the hill behind the house and",
    "Here is a list of three prime numbers, each followed by a short explanation of why it is prime and "
    "how one can check it by trial division with every number up to its square root:",
    "The best way to learn a new language as an adult is a question that researchers have studied for "
    "decades. Most of them agree on a few simple principles, the first of which is",
]
# The engines the targets run amid others in: their changes to the engine options, and whether the
# prefix cache is filled with the targets first.
RUNS: dict[str, tuple[dict[str, Any], bool]] = {
    "amid_others": ({}, False),
    "chunked_prefill": ({"max_num_batched_tokens": 32, "max_num_seqs": 16}, False),
    "prefix_cache_hit": ({"enable_prefix_caching": True}, True),
    "sync_scheduling": ({"async_scheduling": False}, False),
}


def sampling(kind: str, max_tokens: int) -> SamplingParams:
    """The targets' sampling: greedy, or seeded random sampling (temperature 0.9, top-p 0.95)."""
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=4)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=max_tokens, ignore_eos=True, logprobs=4)


def others(n: int, vocab: int, seed: int) -> tuple[list[Prompt], list[SamplingParams]]:
    """n requests of random token ids (1-70 of them) and varied sampling: greedy, random, seeded, top-k,
    a presence penalty; 1-40 new tokens each."""
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    params = []
    for i in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(1, 70))])
        kind = i % 4
        params.append(SamplingParams(
            temperature=0.0 if kind == 0 else rng.uniform(0.5, 1.3), top_k=50 if kind == 2 else 0,
            seed=rng.randrange(1 << 30) if kind == 3 else None, presence_penalty=0.5 if kind == 1 else 0.0,
            max_tokens=rng.randint(1, 40), ignore_eos=True, logprobs=2 if kind == 0 else None))
    return prompts, params


def result(out: RequestOutput) -> tuple[list[int], list[dict]]:
    """A request's token ids and logprobs, as compared."""
    c = out.outputs[0]
    return list(c.token_ids), [dict(lp) for lp in (c.logprobs or [])]


def alone(llm: LLM, targets: Sequence[Prompt], params: SamplingParams) -> list:
    """Each target run by itself."""
    return [result(llm.generate([p], params, use_tqdm=False)[0]) for p in targets]


def amid(llm: LLM, targets: Sequence[Prompt], params: SamplingParams, vocab: int, num_others: int, seed: int,
         cached: list[int] | None = None) -> list:
    """The targets spread among `num_others` others, all sent at once (`cached` gets each target's
    prefix-cache hit, in tokens)."""
    prompts, all_params = others(num_others, vocab, seed)
    at = [round((i + 0.5) * (num_others + len(targets)) / len(targets)) for i in range(len(targets))]
    for i, target in zip(at, targets):
        prompts.insert(i, target)
        all_params.insert(i, params)
    outs = llm.generate(prompts, all_params, use_tqdm=False)
    if cached is not None:
        cached.extend(outs[i].num_cached_tokens for i in at)
    return [result(outs[i]) for i in at]


def compare(model: str | None, engine: dict[str, Any], targets: Sequence[Prompt], num_others: int = 63,
            max_tokens: int = 24, seed: int = 7, runs: dict[str, tuple[dict[str, Any], bool]] = RUNS) -> dict[str, Any]:
    """Counts of targets equal to their run alone, per run and sampling kind; `engine` holds the engine
    options every run shares (the prefix cache off unless a run turns it on)."""
    base = {"enable_prefix_caching": False, **engine, "show_progress": False}
    counts: dict[str, dict[str, int]] = {name: {} for name in runs}
    same_tokens = 0  # targets whose token ids alone equal (their logprobs may differ in the last bits)
    hits: list[int] = []
    distinct: set[int] = set()
    kinds = {kind: sampling(kind, max_tokens) for kind in ("greedy", "seeded")}
    with LLM(model=model, **base) as llm:  # one engine a run, each running both kinds
        reference = {kind: alone(llm, targets, params) for kind, params in kinds.items()}
        vocab = llm.tokenizer.vocab_size
    distinct.update(t for outs in reference.values() for tokens, _ in outs for t in tokens)
    for name, (changes, warm) in runs.items():
        with LLM(model=model, **{**base, **changes}) as llm:
            for kind, params in kinds.items():
                if warm:
                    alone(llm, targets, params)  # fills the prefix cache with every target's whole blocks
                got = amid(llm, targets, params, vocab, num_others, seed, hits if warm else None)
                counts[name][kind] = sum(a == b for a, b in zip(got, reference[kind]))
                same_tokens += sum(a[0] == b[0] for a, b in zip(got, reference[kind]))
    compared = len(targets) * len(kinds) * len(runs)
    return {"targets": len(targets), "num_others": num_others, "max_tokens": max_tokens, "runs": counts,
            "identical": sum(n for per_run in counts.values() for n in per_run.values()), "compared": compared,
            "identical_tokens": same_tokens,
            "prefix_cache_hit_tokens": hits, "distinct_tokens_alone": len(distinct)}


def add_args(parser: argparse.ArgumentParser) -> None:
    from forerun.entrypoints.engine_args import add_engine_args
    add_engine_args(parser)
    parser.add_argument("--num-others", type=int, default=63,
                        help="random requests each target runs amid (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="new tokens of each target (default: %(default)s)")
    parser.add_argument("--workload-seed", type=int, default=7,
                        help="seed of the random requests (default: %(default)s)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from forerun.entrypoints.engine_args import engine_config_from_args
    config = engine_config_from_args(args)
    engine = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("model", "enable_prefix_caching", "extra")}
    if args.num_others < 0 or args.max_tokens < 1:
        raise ValueError("num_others / max_tokens: need num_others >= 0 and max_tokens >= 1")
    return compare(config.model, engine, TARGETS, args.num_others, args.max_tokens, args.workload_seed)
