"""What a user asks structured output to enforce: one JSON schema, regex, choice or grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The kinds a GrammarKey can name; backends dispatch on these strings.
KIND_JSON = "json"
KIND_JSON_OBJECT = "json_object"
KIND_REGEX = "regex"
KIND_CHOICE = "choice"
KIND_GRAMMAR = "grammar"

GrammarKey = tuple[str, str]
"""(kind, canonical spec text): equal keys compile to the same grammar."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constraints for one request, given as `SamplingParams(structured_outputs=...)`.

    Invariant (after `validate()`): exactly one of the fields is set. `json` is a JSON schema
    (a dict, or its JSON text); `json_object` asks for any JSON object; `regex` is a regular
    expression the whole output must match; `choice` is a list of non-empty strings the output
    must equal one of; `grammar` is an EBNF grammar (xgrammar's dialect, root rule `root`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def validate(self) -> None:
        """Check the shape of the spec (not whether the schema/regex/grammar compiles)."""
        set_fields = [
            name
            for name, is_set in (
                ("json", self.json is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("grammar", self.grammar is not None),
            )
            if is_set
        ]
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                f"must be set, got {set_fields or 'none'}"
            )
        if self.json is not None:
            self._json_schema()  # raises on bad JSON text or a non-object schema
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex: must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar: must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
            for i, option in enumerate(self.choice):
                # An empty option would let the grammar end before any token, which backends
                # reject in EBNF and which no user means.
                if not isinstance(option, str) or not option:
                    raise ValueError(
                        f"structured_outputs.choice[{i}]: must be a non-empty string, got {option!r}"
                    )

    def key(self) -> GrammarKey:
        """The compile-cache key; validates first, so a key always names a well-formed spec."""
        self.validate()
        if self.json is not None:
            # Canonical text: spacing must not defeat the cache. Key order is kept, not sorted:
            # properties are generated in schema order, so it changes the grammar.
            return KIND_JSON, json.dumps(self._json_schema(), separators=(",", ":"))
        if self.json_object:
            return KIND_JSON_OBJECT, ""
        if self.regex is not None:
            return KIND_REGEX, self.regex
        if self.choice is not None:
            return KIND_CHOICE, json.dumps(list(self.choice), ensure_ascii=False)
        assert self.grammar is not None
        return KIND_GRAMMAR, self.grammar

    def _json_schema(self) -> dict[str, Any] | bool:
        schema: Any = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON text: {exc}") from None
        # JSON Schema allows `true`/`false` as whole schemas; anything else must be an object.
        if not isinstance(schema, (dict, bool)):
            raise ValueError(
                f"structured_outputs.json: a schema must be an object, got {type(schema).__name__}"
            )
        return schema


def choice_to_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`.

    JSON string escaping is also valid EBNF literal escaping (\\", \\\\, \\n, \\uXXXX), so each
    option becomes one quoted alternative of the root rule.
    """
    return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in choices)
