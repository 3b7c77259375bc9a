"""Shared fixtures: the real default model folder and tiny random models that load in milliseconds."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct as forerun loads it: described once in the session's forerun
    cache (config, tokenizer, a pointer to the GGUF file whose blocks are the weights)."""
    from forerun.loader.model_source import resolve_model
    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory) -> Path:
    """The bundled model exported as a float32 Hugging Face folder (de-quantized as gguf's reference
    does), for transformers as the reference."""
    from forerun.loader.gguf_convert import export_hf_folder
    from forerun.loader.model_source import default_model_gguf
    out = tmp_path_factory.mktemp("smollm2-hf")
    export_hf_folder(default_model_gguf(), out)
    return out


def cache_sharing_kernels(root: Path) -> Path:
    """A new, empty forerun cache folder at `root` (point FORERUN_CACHE at it) whose kernels folder is
    the user's, so a test that needs a cold cache for models or probes does not rebuild the C kernels
    (half a minute on 2 cores)."""
    from forerun.loader.model_source import cache_dir
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True)
    (root / "kernels").symlink_to(kernels, target_is_directory=True)
    return root


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """The session's forerun cache: a new folder whose kernels are the user's (not rebuilt) and whose probe
    results start as the user's (not measured again), unless FORERUN_CACHE names one already.

    Why: tests write GGUF files of their own, and forerun describes each one in its cache (config and
    tokenizer, under a key made from the file's path and time); in the user's cache those folders piled
    up, over 300 of them per run of the suite."""
    if os.environ.get("FORERUN_CACHE"):
        yield
        return
    from forerun.loader.model_source import cache_dir
    probes = cache_dir() / "cpu_probe.json"
    root = cache_sharing_kernels(tmp_path_factory.getbasetemp() / "forerun-cache")
    if probes.is_file():
        shutil.copy(probes, root / probes.name)
    os.environ["FORERUN_CACHE"] = str(root)
    try:
        yield
    finally:
        del os.environ["FORERUN_CACHE"]


def save_tiny_model(out: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0, stored_dtype: str = "float32",
                    **overrides) -> Path:
    """A random model of `arch` with SmolLM2's tokenizer, saved as a Hugging Face folder with its
    weights in `stored_dtype` (real checkpoints are mostly bf16)."""
    import torch
    import transformers as tf

    kwargs = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, torch_dtype="float32",
                  # A wide init makes greedy outputs vary from token to token, so equality tests mean something.
                  initializer_range=0.3)
    kwargs.update(overrides)
    config_cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
                  "mistral": tf.MistralConfig}[arch]
    model_cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
                 "mistral": tf.MistralForCausalLM}[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval().to(getattr(torch, stored_dtype))
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


def _is_ray_process(proc) -> bool:
    """Ray's own daemons and its idle worker pool live for a whole module's `local_ray` fixture."""
    import psutil
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "ray" in cmd and ("raylet" in cmd or "gcs_server" in cmd or "ray::" in cmd
                             or "default_worker" in cmd or "dashboard" in cmd or "ray/_private" in cmd)


def _new_live_children(before: set[int]) -> list:
    import psutil
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.pid in before or c.status() == psutil.STATUS_ZOMBIE:
                continue
            if "resource_tracker" in " ".join(c.cmdline()) or _is_ray_process(c):
                continue
            out.append(c)
        except psutil.Error:
            pass
    return out


@pytest.fixture(autouse=True)
def reap_children():
    """Kill what a test started and left alive, even when the test failed, so that one failure does not
    turn into failed child counts and unplaceable Ray bundles in every later test. A test that must
    prove its own clean shutdown asserts that itself; this only keeps the rest of the run honest."""
    import psutil
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    yield
    left = _new_live_children(before)
    if not left:
        return
    deadline = time.monotonic() + 3  # a shutdown that is still under way gets a moment to finish
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _new_live_children(before)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)


@pytest.fixture
def track_llm():
    """`track_llm(LLM(...))` returns the engine and shuts it down when the test ends, passed or failed."""
    made: list = []

    def track(llm):
        made.append(llm)
        return llm

    try:
        yield track
    finally:
        for llm in made:
            llm.shutdown()


def judge_machine(monkeypatch, busy: bool) -> None:
    """Make the probes judge the machine busy or calm, whatever its real load (forerun.kernels.busy_watch)."""
    from forerun.kernels import busy_watch
    monkeypatch.setattr(busy_watch, "machine_busy", lambda: busy)
    monkeypatch.setattr(busy_watch.BusyWatch, "others_seconds", lambda self: 0.0)
