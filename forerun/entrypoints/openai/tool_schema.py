"""A light check that a tool's `parameters` is a JSON schema, so a bad one is a 400 naming the tool.

Not a full meta-schema validation: it checks the shape of the keywords structured output reads (types,
properties, items, required, enum, combinators, bounds). What passes here and still fails to compile
in the grammar backend is reported as a 400 naming `tools` as well (see serving_chat).
"""

from __future__ import annotations

from typing import Any

JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "additionalItems", "if", "then",
              "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRINGS = ("pattern", "format", "$ref", "title", "description")


def check_parameters(schema: Any, field: str) -> None:
    """ValueError naming `field` (and the bad keyword) unless `schema` is a JSON schema of an object."""
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: must be a JSON schema object, got {type(schema).__name__}")
    if "type" in schema and schema["type"] != "object":
        raise ValueError(f"{field}.type: the parameters of a function must be an object schema, "
                         f"got {schema['type']!r}")
    check_schema(schema, field)


def check_schema(schema: Any, field: str) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        bad = [k for k in kinds if not (isinstance(k, str) and k in JSON_TYPES)]
        if bad or not kinds:
            raise ValueError(f"{field}.type: {bad or kinds!r} is no JSON schema type (one of {sorted(JSON_TYPES)})")
    for key in _SUBSCHEMA:
        if key in schema:
            check_schema(schema[key], f"{field}.{key}")
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, list) or not value:
                raise ValueError(f"{field}.{key}: must be a non-empty array of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{field}.{key}[{i}]")
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, dict):
                raise ValueError(f"{field}.{key}: must be an object mapping names to schemas")
            for name, sub in value.items():
                check_schema(sub, f"{field}.{key}.{name}")
    if "required" in schema:
        value = schema["required"]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{field}.required: must be an array of property names")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise ValueError(f"{field}.enum: must be a non-empty array")
    for key in _COUNTS:
        value = schema.get(key)
        if key in schema and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{field}.{key}: must be a non-negative integer")
    for key in _NUMBERS:
        value = schema.get(key)
        if key in schema and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ValueError(f"{field}.{key}: must be a number")
    for key in _STRINGS:
        if key in schema and not isinstance(schema[key], str):
            raise ValueError(f"{field}.{key}: must be a string")
