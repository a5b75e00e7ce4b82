"""Request and response bodies: OpenAI-shaped for /v1/completions and /v1/chat/completions, our own for
/v1/cache/chunks.

Unknown top-level request fields are ignored (as OpenAI-compatible servers do); unknown fields inside our
own `kv_blend` extension and in our own /v1/cache/chunks body are rejected, since a typo there would
silently change what gets measured.
Value ranges (temperature, top_p, ...) are checked by SamplingParams.validate so every entry point agrees.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def _drop_if_none(value: Any) -> bool:
    return value is None


def _lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Where a string holds a lone UTF-16 surrogate (JSON allows "\\ud800"; UTF-8 cannot encode it), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "request body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate_path(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_path(item, f"{path}[{i}]")
            if found:
                return found
    return None


def _check_unicode(cls, data: Any) -> Any:
    where = _lone_surrogate_path(data)
    if where:
        raise ValueError(f"{where} is not valid Unicode text (it holds a lone surrogate)")
    return data


# ---------------------------------------------------------------- requests

MAX_PRECOMPUTE_CHUNKS = 256


class KVBlendOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0)


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions. `None` means "the default" for every field."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed accepts
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    user: str | None = None
    # Extensions: per-request cache controls.
    prefix_cache: bool | None = True
    cache_salt: str | None = None
    kv_blend: KVBlendOptions | None = None

    _valid_unicode = model_validator(mode="before")(_check_unicode)


def _check_prompt(value: Any) -> Any:
    """One prompt: a string or a list of token ids, optionally wrapped in a one-element list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if value and all(isinstance(v, str) for v in value):
            return value
        if value and all(isinstance(v, list) for v in value):
            if all(isinstance(t, int) and not isinstance(t, bool) for v in value for t in v):
                return value
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
    raise ValueError("prompt must be a string, a list of token ids, or a one-element list of either")


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class CacheControl(BaseModel):
    """Anthropic's prompt-cache breakpoint, also taken on chat content parts and tools (as OpenRouter and
    LiteLLM pass it): the prompt up to the end of the marked block is kept for `ttl` (api/cache_breakpoints.py)."""

    model_config = ConfigDict(extra="ignore")  # a newer field of a real client is no reason for a 400

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class JSONSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field("response", pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON that matches a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with the schema")
        return self


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    response_format: ResponseFormat | None = None  # vLLM's extension: constrained output on completions too
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None  # not supported: rejected when given
    best_of: int | None = None  # only 1

    _prompt_shape = field_validator("prompt", mode="before")(_check_prompt)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError(f"a function's parameters must be a JSON schema of type 'object', got {value.get('type')!r}")
        return value


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition
    cache_control: CacheControl | None = None  # a breakpoint at the end of the tool definitions


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: call exactly this function."""

    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer name for system
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts")
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"part {i}: only parts of type 'text' are supported, got {kind!r}")
            if not isinstance(part.get("text"), str) or part["text"] == "":
                raise ValueError(f"part {i}: a text part needs a non-empty 'text' string")
            if part.get("cache_control") is not None:
                try:
                    CacheControl.model_validate(part["cache_control"])
                except ValueError as exc:
                    raise ValueError(f"part {i}: cache_control must be {{'type': 'ephemeral', 'ttl': '5m' or "
                                     f"'1h'}}: {exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}") from None
        return value


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    response_format: ResponseFormat | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        """One message for any malformed tool_choice (pydantic's would name each member of the union)."""
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
                and isinstance(value["function"].get("name"), str):
            return value
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")


class CacheChunksRequest(BaseModel):
    """POST /v1/cache/chunks: documents to compute and file in the chunk index before any question arrives."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    chunks: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, max_length=MAX_PRECOMPUTE_CHUNKS)
    cache_salt: str | None = None

    _valid_unicode = model_validator(mode="before")(_check_unicode)


class CachePrefetchRequest(BaseModel):
    """POST /v1/cache/prefetch: pull a prompt's cached blocks up to the device pool ahead of the request that
    will use them. Exactly one of `prompt` (as /v1/completions takes it) or `messages` (as chat takes them)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None

    _valid_unicode = model_validator(mode="before")(_check_unicode)

    @model_validator(mode="after")
    def _one_prompt(self) -> "CachePrefetchRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


# ---------------------------------------------------------------- responses


class TierTokens(BaseModel):
    """Of the cached tokens, those loaded from each tier below the device pool (the rest were resident)."""

    host: int = 0
    disk: int = 0
    redis: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # prompt tokens computed into whole blocks the cache keeps (docs/usage.md)
    blended_tokens: int = 0
    recomputed_tokens: int = 0
    tier_tokens: TierTokens = Field(default_factory=TierTokens)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed completion chunk (OpenAI uses object "text_completion" for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_drop_if_none)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_drop_if_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(None, exclude_if=_drop_if_none)
    arguments: str | None = Field(None, exclude_if=_drop_if_none)


class DeltaToolCall(BaseModel):
    """A streamed piece of tool call `index`: the first carries id, type and name (arguments ""), the next ones
    fragments of the arguments."""

    index: int
    id: str | None = Field(None, exclude_if=_drop_if_none)
    type: Literal["function"] | None = Field(None, exclude_if=_drop_if_none)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_drop_if_none)
    content: str | None = Field(None, exclude_if=_drop_if_none)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=_drop_if_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_drop_if_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kv-reuse-server"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class CachedChunk(BaseModel):
    index: int
    tokens: int
    stored_tokens: int  # newly filed in the chunk index by this call
    already_cached: bool
    skipped: str | None = Field(None, exclude_if=_drop_if_none)  # why nothing was stored, if so


class CachePrefetchResponse(BaseModel):
    object: Literal["cache.prefetch"] = "cache.prefetch"
    model: str
    prompt_tokens: int
    resident_tokens: int  # prompt tokens whose KV is now in the device pool
    tier_tokens: TierTokens  # of those, pulled up from each tier by this call


class CacheChunksResponse(BaseModel):
    object: Literal["cache.chunks"] = "cache.chunks"
    model: str
    stored_tokens: int
    chunks: list[CachedChunk]


class HealthStatus(BaseModel):
    status: Literal["ok", "draining", "stalled", "dead"]
    reason: str | None = Field(None, exclude_if=_drop_if_none)  # why the server is not serving
