"""OpenAI request and response bodies (the subset forerun serves), plus vLLM's extra sampling fields."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from forerun.entrypoints.openai.protocol_base import OpenAIModel, RequestModel
from forerun.entrypoints.openai.protocol_tools import (ChatTool, DeltaToolCall, NamedToolChoice, ToolCall, ToolCallIn,
                                                       call_dict)
from forerun.sampling_params import SamplingParams


MAX_N = 128  # OpenAI's limit on completions per prompt; an unbounded n lets one request fill the server


MESSAGE_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_PROMPTS = 2048  # prompts in one completions request, as for embeddings' inputs


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    """`name` and `description` only label the schema; the output is always held to it (`strict` or not)."""

    name: str = "schema"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` field: exactly one of these (vLLM's other options, such as
    whitespace_pattern or structural_tag, are refused as unknown fields)."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat. Invariant: `sampling_params` raises ValueError naming the field."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's extension: json, regex, choice, grammar
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's extension
    bad_words: list[str] | None = None  # vLLM's extension
    priority: int = 0  # vLLM's extension: lower runs first, when served with --scheduling-policy priority
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprobs name tokens `token_id:N`
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's logprobs, plus the top k per position
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be an integer in [1, {MAX_N}], got {self.n}")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they come with the whole response
            raise ValueError("prompt_logprobs: not available when stream is true")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop or None,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self._structured_outputs(),
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            # A response sent in one piece needs only the final output: no per-step text or copies.
            output_kind="cumulative" if self.stream else "final_only",
        )

    def _structured_outputs(self) -> Any:
        fmt = self.response_format
        wants_format = fmt is not None and fmt.type != "text"
        if self.structured_outputs is not None:
            if wants_format:
                raise ValueError("structured_outputs: give either structured_outputs or a response_format "
                                 "of json_object / json_schema, not both")
            return self._vllm_structured_outputs(self.structured_outputs)
        if fmt is None or not wants_format:
            return None
        try:
            from forerun.structured.spec import StructuredOutputsParams
        except ImportError as exc:
            raise ValueError(f"response_format: structured outputs are not available ({exc})") from None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ValueError("response_format.json_schema.schema: required when type is json_schema")
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)

    @staticmethod
    def _vllm_structured_outputs(spec: StructuredOutputsRequest) -> Any:
        from forerun.structured.spec import StructuredOutputsParams
        params = StructuredOutputsParams(json=spec.json_schema, json_object=bool(spec.json_object), regex=spec.regex,
                                         choice=spec.choice, grammar=spec.grammar)
        params.validate()  # here, so its error names the request's field before any tokenizing
        return params

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys as token ids; ranges and the vocabulary are checked by SamplingParams and
        the engine, each with an error naming logit_bias."""
        if self.logit_bias is None:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias: keys must be token ids written as decimal integers, got {key!r}")
            bias[int(key)] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: with logprobs is not supported; send echo without logprobs (prompt_logprobs "
                             "gives the prompt's logprobs)")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt: must not be empty")
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        if len(p) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(p)}")
        return list(p)  # type: ignore[arg-type]


class ChatMessage(RequestModel):
    """One message; `tool_call_id` (a tool message's answer to a call) reaches the template as given."""

    role: Literal[MESSAGE_ROLES]  # type: ignore[valid-type]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | NamedToolChoice, read by `parsed_tool_choice`
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated function calling: only "none" is accepted (`functions` is an unknown field).
    function_call: Any = None

    def parsed_tool_choice(self) -> str | NamedToolChoice | None:
        """`tool_choice` checked: ValueError naming it for anything but OpenAI's forms."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict):
            try:
                return NamedToolChoice.model_validate(choice)
            except ValueError:
                pass
        raise ValueError("tool_choice: must be \"none\", \"auto\", \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")

    def check_function_call(self) -> None:
        if self.function_call is not None and self.function_call != "none":
            raise ValueError("function_call: the deprecated function calling is not supported; "
                             "use tools and tool_choice")

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs: requires logprobs to be true")
            return None
        return self.top_logprobs or 0

    def message_dicts(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise ValueError("messages: must not be empty")
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if content is None:
                content = ""
            elif isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported")
                    parts.append(part["text"])
                content = "".join(parts)
            msg: dict[str, Any] = {"role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                if m.role != "assistant":
                    raise ValueError(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
                msg["tool_calls"] = [call_dict(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
            out.append(msg)
        return out


# ---- responses ----------------------------------------------------------------------------------

class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(OpenAIModel):
    """vLLM's Logprob, as `prompt_logprobs` carries it: one token at one prompt position."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# vLLM's shape: None for the first prompt token, then token id (as a string) -> its logprob, per position.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "forerun"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
