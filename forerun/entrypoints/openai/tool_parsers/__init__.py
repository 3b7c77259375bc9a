"""Tool-call parsers, chosen with `--tool-call-parser` by vLLM's names."""

from __future__ import annotations

from forerun.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedTools, ToolParser, ToolSpec
from forerun.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from forerun.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from forerun.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from forerun.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from forerun.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
    "qwen3_coder": Qwen3XmlToolParser,  # vLLM's other name for the same format
    "pythonic": PythonicToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedTools", "ToolParser", "ToolSpec"]
