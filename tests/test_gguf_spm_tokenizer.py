"""GGUF files with a SentencePiece vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Mistral, TinyLlama).

The reference is a real SentencePiece BPE model, trained here in-process with Llama 2's settings
(byte fallback, split digits, whitespace-only pieces, identity normalization, dummy prefix), written
into a GGUF the way llama.cpp writes one; forerun's tokenizer built from that GGUF must give the same
ids and decode back to the text, and the whole file must generate in `forerun.LLM` exactly like
transformers' own GGUF loader.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from gguf_factory import SpmVocab, write_model_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from forerun import LLM, SamplingParams
from forerun.engine.tokenizer import Tokenizer
from forerun.loader.gguf_convert import describe_gguf
from forerun.loader.gguf_tokenizer import build_tokenizer, tokenizer_config
from forerun.loader.gguf_vocab import vocab_from_metadata
from tests.conftest import cache_sharing_kernels

_CORPUS = """The quick brown fox jumps over the lazy dog. A quick brown dog jumps over the lazy fox.
Hello world! Hello there, general Kenobi. It's 2024 and numbers like 12345 and 3.14159 appear.
def f(x):
    return x**2  # square
Café naïve résumé — the end.   Multiple   spaces   here.
[INST] What is the capital of France? [/INST] The capital of France is Paris.
"""
LLAMA2_TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "  leading spaces,   inner  runs, trailing   ",
    " ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "\n",
    "héllo 🙂 naïve café — 日本語",  # 🙂 and 日本語 are not pieces: byte fallback
    "🦙🦙",
    "12345 and 3.14159 or 1,000,000",
    "def f(x):\n    return x**2  # square\n",
    "[INST] What is the capital of France? [/INST]",
    "It's we'll they're I'M",
]

# llama.cpp token types, for the hand-made vocabularies below.
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


def _token_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    # The mapping llama.cpp's converter applies to a SentencePiece model's piece types.
    if sp.is_unknown(i):
        return _UNKNOWN
    if sp.is_control(i):
        return _CONTROL
    if sp.is_byte(i):
        return _BYTE
    if sp.is_unused(i):
        return 5
    return _NORMAL


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    """A small real SentencePiece BPE model with Llama 2's tokenizer settings."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in _CORPUS.split("\n") if line] * 3), model_writer=model,
        model_type="bpe", vocab_size=448, byte_fallback=True, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        add_dummy_prefix=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _spm_vocab(sp: spm.SentencePieceProcessor) -> SpmVocab:
    n = sp.get_piece_size()
    return SpmVocab(tokens=[sp.id_to_piece(i) for i in range(n)], scores=[sp.get_score(i) for i in range(n)],
                    types=[_token_type(sp, i) for i in range(n)], chat_template=LLAMA2_TEMPLATE)


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory: pytest.TempPathFactory, sp: spm.SentencePieceProcessor) -> tuple[Path, Path]:
    """(the GGUF file of a tiny random Llama with that vocabulary, the folder forerun converts it into)."""
    root = tmp_path_factory.mktemp("spm_gguf")
    config = LlamaConfig(vocab_size=sp.get_piece_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         rope_theta=10000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = root / "tiny-spm.gguf"
    write_model_gguf(path, model, "llama", spm=_spm_vocab(sp))
    describe_gguf(path, root / "hf")
    return path, root / "hf"


@pytest.fixture(scope="module")
def tokenizer(spm_files: tuple[Path, Path]) -> Tokenizer:
    return Tokenizer.from_folder(spm_files[1])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_sentencepiece(tokenizer: Tokenizer, sp: spm.SentencePieceProcessor, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == [1, *sp.encode(text)]  # the GGUF says add_bos_token, bos id 1
    assert tokenizer.encode(text, add_special_tokens=False) == sp.encode(text)
    assert tokenizer.decode(ids) == text == sp.decode(ids)


def test_random_strings_match_sentencepiece(tokenizer: Tokenizer, sp: spm.SentencePieceProcessor) -> None:
    rng = random.Random(7)
    alphabet = [*"the quick brown fox HELLO 0123456789.,!?'*#()[]\n\t     ", "é", "ï", "—", "🙂", "日", "\u00a0"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 48)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), repr(text)
        assert tokenizer.decode(ids) == text, repr(text)


def test_transformers_gguf_tokenizer_agrees(spm_files: tuple[Path, Path], tokenizer: Tokenizer) -> None:
    path = spm_files[0]
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers' Metaspace adds no prefix to text that already starts with a space (" hi" gives
    # ▁hi, where SentencePiece and llama.cpp give ▁▁hi), so those texts are left to the test above.
    plain = [text for text in TEXTS if not text[0].isspace()]
    assert len(plain) >= 8
    for text in plain:
        assert tokenizer.encode(text) == reference(text)["input_ids"], repr(text)


def test_converted_folder_files(spm_files: tuple[Path, Path], tokenizer: Tokenizer) -> None:
    cfg = json.loads((spm_files[1] / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert (cfg["add_bos_token"], cfg["add_eos_token"], cfg["chat_template"]) == (True, False, LLAMA2_TEMPLATE)
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.encode("") == [1]  # BOS exactly once, from the post-processor


def test_special_tokens_are_atomic_and_text_after_them_gets_the_space(
        tokenizer: Tokenizer, sp: spm.SentencePieceProcessor) -> None:
    # llama.cpp prefixes a space to every stretch of text that follows a special token.
    ids = tokenizer.encode("<s>[INST] hi [/INST]</s>ok", add_special_tokens=False)
    assert ids == [1, *sp.encode("[INST] hi [/INST]"), 2, *sp.encode("ok")]
    assert tokenizer.decode(ids) == "[INST] hi [/INST] ok"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s> [INST] hi [/INST]</s> ok"


def _meta(tokens: list[str], scores: list[float], types: list[int], **extra: object) -> dict[str, object]:
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, **extra}


_BYTES = [f"<0x{b:02X}>" for b in range(256)]
_SMALL = ["<unk>", "<s>", "</s>", *_BYTES, "\u2581", "a", "b", "ab", "\u2581a"]
_SMALL_TYPES = [_UNKNOWN, _CONTROL, _CONTROL, *[_BYTE] * 256, *[_NORMAL] * 5]


@pytest.mark.parametrize(("ab_score", "expected"), [(-1.0, ["\u2581", "ab"]), (-3.0, ["\u2581a", "b"])])
def test_merges_follow_scores_not_vocabulary_order(ab_score: float, expected: list[str]) -> None:
    # "▁ab": the pairs (a, b) and (▁, a) compete; the higher-scored piece wins, wherever it is listed.
    scores = [0.0] * 259 + [-5.0, -6.0, -7.0, ab_score, -2.0]
    tok = build_tokenizer(vocab_from_metadata(_meta(_SMALL, scores, _SMALL_TYPES)))
    assert tok.encode("ab", add_special_tokens=False).tokens == expected


def test_no_space_prefix_no_bos_and_eos_appended() -> None:
    meta = _meta(_SMALL, [0.0] * 259 + [-5.0, -6.0, -7.0, -1.0, -2.0], _SMALL_TYPES,
                 **{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False,
                    "tokenizer.ggml.add_eos_token": True})
    vocab = vocab_from_metadata(meta)
    tok = build_tokenizer(vocab)
    enc = tok.encode("ab a")
    assert enc.tokens == ["ab", "\u2581a", "</s>"]
    assert tok.decode(enc.ids) == "ab a"
    # No prefix to strip: a leading space survives the round trip as one space.
    assert tok.decode(tok.encode(" a", add_special_tokens=False).ids) == " a"
    # A character outside the vocabulary falls back to its UTF-8 bytes.
    assert tok.encode("é", add_special_tokens=False).tokens == ["<0xC3>", "<0xA9>"]
    cfg = tokenizer_config(vocab, None, 128)
    assert (cfg["add_bos_token"], cfg["add_eos_token"]) == (False, True)


def test_missing_keys_take_llama_cpp_defaults() -> None:
    vocab = vocab_from_metadata(_meta(_SMALL, [0.0] * len(_SMALL), _SMALL_TYPES))
    assert (vocab.unk_id, vocab.bos_id, vocab.eos_id, vocab.add_bos, vocab.add_space_prefix) == (0, 1, 2, True, True)
    assert build_tokenizer(vocab).encode("a").tokens == ["<s>", "\u2581a"]


@pytest.mark.parametrize(("change", "field"), [
    ({"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores"),
    ({"tokenizer.ggml.scores": [0.0, 1.0]}, "tokenizer.ggml.scores"),
    ({"tokenizer.ggml.token_type": [1]}, "tokenizer.ggml.token_type"),
    ({"tokenizer.ggml.bos_token_id": 9999}, "tokenizer.ggml.bos_token_id"),
    ({"tokenizer.ggml.model": "rwkv"}, "tokenizer.ggml.model"),
])
def test_bad_metadata_names_the_field(change: dict[str, object], field: str) -> None:
    meta = {**_meta(_SMALL, [0.0] * len(_SMALL), _SMALL_TYPES), **change}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        vocab_from_metadata({k: v for k, v in meta.items() if v is not None})


@pytest.fixture(scope="module")
def llm(spm_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as patch:  # the conversion's cache only, not the later tests'
        patch.setenv("FORERUN_CACHE", str(cache_sharing_kernels(tmp_path_factory.mktemp("spm") / "forerun_cache")))
        engine = LLM(model=str(spm_files[0]), dtype="float32", show_progress=False)
    with engine:
        yield engine


def test_llm_greedy_matches_transformers_on_the_gguf(llm: LLM, spm_files: tuple[Path, Path],
                                                     sp: spm.SentencePieceProcessor) -> None:
    path = spm_files[0]
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt in ["The capital of France is", "  Hello 🙂 world\n"]:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == [1, *sp.encode(prompt)]
        with torch.no_grad():
            expected = reference.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=12, min_new_tokens=12,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        ids = out.outputs[0].token_ids
        assert ids == expected[0, len(out.prompt_token_ids):].tolist()
        # The output reads as a continuation of the prompt: its first "▁" is a space, not a prefix to drop.
        decode = llm.tokenizer.decode
        prompt_text = decode(out.prompt_token_ids)
        assert out.outputs[0].text == decode(out.prompt_token_ids + ids)[len(prompt_text):]


def test_llm_chat_uses_the_template_and_spm_ids(llm: LLM, sp: spm.SentencePieceProcessor) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == "<s>[INST] What is the capital of France? [/INST]"
    assert out.prompt_token_ids == [1, *sp.encode("[INST] What is the capital of France? [/INST]")]
    assert len(out.outputs[0].token_ids) == 4
