"""The conversation as the chat template gets it when tools are involved.

A template that reads `tools` gets them, and past calls as `message["tool_calls"]` with arguments as a
dict (Hugging Face's convention). A template without tool support (the default SmolLM2 model's, for
one) gets the hermes format spelled out in text instead:

- a system message listing the tools (`DEFAULT_TOOL_PROMPT`, appended to the conversation's own system
  message, or put first when there is none);
- each past call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in its assistant message;
- each tool result as a user message `<tool_response>...</tool_response>`.

The calls the model then writes are read by `--tool-call-parser hermes`.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_TOOL_PROMPT = """You can call functions to help answer. Each function is described by one JSON object per line between <tools> and </tools>:
<tools>
{tools}
</tools>
To call a function, write a JSON object with its "name" and its "arguments" (an object) between <tool_call> and </tool_call>, like this:
<tool_call>
{{"name": "function_name", "arguments": {{"argument_name": "value"}}}}
</tool_call>
Write one such block per call. The result of each call comes back between <tool_response> and </tool_response>."""


def template_inputs(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_takes_tools: bool
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render; `tools` is None when the prompt shows no tools."""
    if template_takes_tools:
        return messages, tools
    out = [_as_text(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = DEFAULT_TOOL_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
              for c in calls]
    text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
    content = f"{message['content']}\n{text}" if message["content"] else text
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
