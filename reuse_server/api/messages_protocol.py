"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the request as its documentation
and the `anthropic` SDK define it, and the response shapes. `cache_control` (on blocks, tools and at the top)
sets prompt-cache breakpoints (api/cache_breakpoints.py; README, "Anthropic Messages")."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from reuse_server.api.protocol import FUNCTION_NAME, CacheControl, KVBlendOptions, _check_unicode


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # citations

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(BaseModel):
    """A reasoning block another model wrote; sent back by clients, dropped here (README)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["thinking", "redacted_thinking"]


BLOCK_TYPES = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
               "thinking": ThinkingBlock, "redacted_thinking": ThinkingBlock}
Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


def _blocks(value: Any) -> Any:
    """One clear message for a block type we do not take (images, documents, server tool results)."""
    if isinstance(value, list):
        for i, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise ValueError(f"block {i}: blocks of type {kind!r} are not supported here "
                                 f"(only {', '.join(sorted(BLOCK_TYPES))})")
    return value


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[Block]

    _known_blocks = field_validator("content", mode="before")(_blocks)

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> "AnthropicMessage":
        if isinstance(self.content, list):
            wrong = "tool_use" if self.role == "user" else "tool_result"
            if any(b.type == wrong for b in self.content):
                raise ValueError(f"a {self.role} message cannot hold {wrong} blocks")
        return self


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["custom"] | None = None  # server tools (bash, web search, ...) are not ours to run
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _a_named_tool(self) -> "AnthropicToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        return self


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # service_tier, anything else harmless

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    cache_control: CacheControl | None = None  # automatic: a breakpoint on the last cacheable block
    thinking: dict[str, Any] | None = None  # accepted: the served model does not reason in blocks
    service_tier: str | None = None
    # Refused: they would change the answer and this server cannot honour them.
    mcp_servers: list[Any] | None = None
    container: Any = None
    # Extensions, as on the OpenAI routes.
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    prefix_cache: bool | None = True
    cache_salt: str | None = None
    kv_blend: KVBlendOptions | None = None

    _valid_unicode = model_validator(mode="before")(_check_unicode)


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = None  # count_tokens takes no max_tokens


# ---------------------------------------------------------------- responses (declared for /openapi.json)


class AnthropicUsage(BaseModel):
    model_config = ConfigDict(extra="allow")  # blended_tokens, recomputed_tokens, tier_tokens

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    cache_creation: dict[str, int] | None = None  # ephemeral_5m_input_tokens, ephemeral_1h_input_tokens


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail
