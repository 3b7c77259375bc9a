"""Tokenizer wrapper over a Hugging Face model folder, built on the `tokenizers` library.

Reads `tokenizer.json` for the vocabulary, and `tokenizer_config.json`,
`generation_config.json` and `config.json` (each optional) for the special tokens and the
chat template, so the engine never needs `transformers` at run time.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RustTokenizer

logger = logging.getLogger(__name__)

__all__ = ["Tokenizer"]


def _read_json(path: Path) -> dict[str, Any]:
    """Return the JSON object in `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config is either a string or a serialised AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any, field: str) -> list[int]:
    """`eos_token_id` may be an int, a list of ints or null."""
    if value is None:
        return []
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"{field}: expected an int or a list of ints, got {value!r}")


def _find_chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | list[dict[str, str]] | None:
    """Newer `transformers` saves the template beside the config rather than inside it, and
    that file wins, as it does in `transformers`."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = _read_json(folder / "chat_template.json").get("chat_template")
    if json_file is not None:
        return json_file
    return tokenizer_config.get("chat_template")


def _select_template(raw: str | list[dict[str, str]] | None, has_tools: bool) -> str | None:
    """A template may be a list of named variants; pick `tool_use` when tools are passed."""
    if raw is None or isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise ValueError(f"chat_template: expected a string or a list of named templates, got {type(raw).__name__}")
    named: dict[str, str] = {}
    for entry in raw:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)):
            raise ValueError("chat_template: each named template needs string 'name' and 'template'")
        named[entry["name"]] = entry["template"]
    if has_tools and "tool_use" in named:
        return named["tool_use"]
    return named.get("default")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks in
    some templates; for serving only its body matters, so render the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` name token
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation they cannot render (e.g. roles out of order).
    raise ValueError(f"messages: rejected by chat_template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own `tojson` escapes <, >, & and ' for HTML, which would change prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _raise_if_not_unicode(field: str, text: str) -> None:
    """ValueError naming `field` when `text` holds a lone surrogate (JSON's "\\ud800" decodes to one):
    such a string has no UTF-8 form, and the Rust tokenizer refuses it with a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field}: not valid Unicode: lone surrogate {text[exc.start]!r} at index {exc.start}"
                         ) from None


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"messages: expected a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: expected a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}].role: expected a string, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content: expected a string, got {type(message.get('content')).__name__}")


class Tokenizer:
    """Text <-> token ids for one model folder, plus its chat template.

    Invariants: `vocab_size` counts added tokens too, so every id the model can emit is
    below it; `eos_token_ids` is the union of every end-of-sequence id named by the folder's
    configs; `encode(..., add_special_tokens=True)` starts with `bos_token_id` exactly when
    the tokenizer config asks for it (`add_bos_token`) or the tokenizer's own post-processor
    adds it, never twice.
    """

    def __init__(self, rust_tokenizer: _RustTokenizer, tokenizer_config: dict[str, Any] | None = None,
                 generation_config: dict[str, Any] | None = None, model_config: dict[str, Any] | None = None,
                 chat_template: str | list[dict[str, str]] | None = None) -> None:
        tokenizer_config = tokenizer_config or {}
        generation_config = generation_config or {}
        model_config = model_config or {}
        self._tok = rust_tokenizer
        self.vocab_size: int = rust_tokenizer.get_vocab_size(with_added_tokens=True)

        self.bos_token: str | None = _token_content(tokenizer_config.get("bos_token"))
        self.eos_token: str | None = _token_content(tokenizer_config.get("eos_token"))
        bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token is not None else None
        if bos_id is None and isinstance(model_config.get("bos_token_id"), int):
            bos_id = model_config["bos_token_id"]
        self.bos_token_id: int | None = bos_id

        eos: set[int] = set()
        eos.update(_id_list(model_config.get("eos_token_id"), "config.json eos_token_id"))
        eos.update(_id_list(generation_config.get("eos_token_id"), "generation_config.json eos_token_id"))
        if self.eos_token is not None:
            eos_id = self._tok.token_to_id(self.eos_token)
            if eos_id is None:
                logger.warning("eos_token %r from tokenizer_config.json is not in the vocabulary", self.eos_token)
            else:
                eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

        self._add_bos = bool(tokenizer_config.get("add_bos_token", False))
        # Some tokenizer.json files (Llama 3) already add BOS in their post-processor.
        self._post_processor_adds_bos = (
            self.bos_token_id is not None
            and self.bos_token_id in self._tok.encode("", add_special_tokens=True).ids
        )
        self._chat_template = chat_template
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_folder(cls, folder: Path | str) -> "Tokenizer":
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"tokenizer.json: not found in {folder}")
        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        rust = _RustTokenizer.from_file(str(tokenizer_file))
        # Some tokenizer.json files (sentence-transformers exports) pad and truncate every input to a fixed
        # length; the engine batches by itself and checks lengths against the model's limit instead.
        rust.no_padding()
        rust.no_truncation()
        return cls(
            rust,
            tokenizer_config=tokenizer_config,
            generation_config=_read_json(folder / "generation_config.json"),
            model_config=_read_json(folder / "config.json"),
            chat_template=_find_chat_template(folder, tokenizer_config),
        )

    # -- ids <-> text ----------------------------------------------------------------------

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self._add_bos and not self._post_processor_adds_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Holds the GIL for the whole call; `encode_batch` releases it (use that from a worker thread)."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a string, got {type(text).__name__}")
        try:
            encoding = self._tok.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            _raise_if_not_unicode("text", text)
            raise
        return self._with_bos(encoding.ids, add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError("texts: expected a list of strings")
        try:
            encodings = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        except TypeError:
            for i, t in enumerate(texts):
                _raise_if_not_unicode(f"texts[{i}]", t)
            raise
        return [self._with_bos(e.ids, add_special_tokens) for e in encodings]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (at least 1).

        A vocabulary entry is spelled with at least one character per character it covers: byte-level
        BPE spells each byte with one character (and a character is at least one byte), SentencePiece
        spells a space as one `▁`, WordPiece adds a `##`. So a text of more than
        `max_token_chars * k` characters needs more than k tokens, unless the normalizer drops or merges
        characters (BERT drops whitespace runs, NFC merges combining marks): callers bounding input size
        by this must leave room for that.
        """
        return max(1, max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # The detokenizer calls this twice per token per request: no copy of a list it already made.
        return self._tok.decode(ids if type(ids) is list else list(ids), skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        tokens: list[str] = []
        for i in ids:
            token = self._tok.id_to_token(i) if isinstance(i, int) and i >= 0 else None
            if token is None:
                raise ValueError(f"ids: {i!r} is not a token id of this vocabulary (size {self.vocab_size})")
            tokens.append(token)
        return tokens

    # -- chat template ---------------------------------------------------------------------

    def _template(self, has_tools: bool) -> jinja2.Template:
        source = _select_template(self._chat_template, has_tools)
        if source is None:
            raise ValueError("chat_template: this model folder has no chat template")
        compiled = self._compiled.get(source)
        if compiled is None:
            # Same whitespace handling as transformers, so prompts match it byte for byte.
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True,
                extensions=[_GenerationTag, jinja2.ext.loopcontrols],
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                compiled = env.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat_template: syntax error at line {exc.lineno}: {exc.message}") from exc
            self._compiled[source] = compiled
        return compiled

    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template (its `tool_use` variant when it has one) reads a `tools` variable;
        servers spell tools out in text for one that does not."""
        source = _select_template(self._chat_template, has_tools=True)
        if source is None:
            return False
        try:
            parsed = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols]).parse(source)
        except jinja2.TemplateSyntaxError:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(parsed)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kw: Any) -> str:
        """Render the conversation into the prompt text the model was trained on."""
        _validate_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools: expected a list of dicts (JSON schemas)")
        template = self._template(has_tools=bool(tools))
        variables: dict[str, Any] = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        variables.update(kw)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               tools=tools, **variables)
