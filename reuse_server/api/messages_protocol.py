"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the request as its documentation
and the `anthropic` SDK define it (Claude Code's fields included: system messages inside `messages`,
`thinking`, `output_config`, `context_management`), and the response shapes. `cache_control` (on blocks,
system blocks, tools and at the top) sets prompt-cache breakpoints (api/cache_breakpoints.py; docs/usage.md,
"Anthropic Messages")."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from reuse_server.api.protocol import FUNCTION_NAME, CacheControl, KVBlendOptions, _check_unicode


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # where an earlier answer's text came from; not rendered


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class HistoryOnlyBlock(BaseModel):
    """A block of an earlier answer that this server neither writes nor renders: another model's thinking
    (`thinking`, `redacted_thinking`), a server tool's call and result (`server_tool_use`,
    `web_search_tool_result`, ...) or a type newer than this server. Taken only in assistant messages, where
    leaving it out of the prompt keeps what the conversation says (its text and tool calls stay)."""

    model_config = ConfigDict(extra="allow")

    type: str


def _block_kind(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return kind if kind in ("text", "tool_use", "tool_result") else "history_only"


Block = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
                  | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[HistoryOnlyBlock, Tag("history_only")],
                  Discriminator(_block_kind)]

# The block types each role may hold; an assistant message's other blocks are HistoryOnlyBlocks, dropped.
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use"), "system": ("text",)}


class SystemMessageOutputConfig(BaseModel):
    """A system message's per-turn output settings (the mid-conversation-system beta): only `effort`, a hint
    for a reasoning model, without effect here."""

    model_config = ConfigDict(extra="ignore")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class AnthropicMessage(BaseModel):
    """A user or assistant turn, or a system message anywhere in the conversation (Claude Code sends them
    with the `mid-conversation-system-2026-04-07` beta): it becomes a system message at that place."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    # Only on system messages: "next_user_message" shows the message only until a later user turn exists.
    clear_at: Literal["next_user_message", "never"] | None = None
    output_config: SystemMessageOutputConfig | None = None

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> "AnthropicMessage":
        if self.role != "system" and (self.clear_at is not None or self.output_config is not None):
            raise ValueError("clear_at and output_config are only taken on system messages")
        if isinstance(self.content, str):
            return self
        allowed = ROLE_BLOCKS[self.role]
        for i, block in enumerate(self.content):
            if block.type in allowed or (self.role == "assistant" and isinstance(block, HistoryOnlyBlock)):
                continue
            if isinstance(block, HistoryOnlyBlock):
                raise ValueError(f"block {i}: blocks of type {block.type!r} are not supported in a {self.role} "
                                 f"message here (only {', '.join(allowed)})")
            raise ValueError(f"a {self.role} message cannot hold {block.type} blocks")
        return self


class CustomTool(BaseModel):
    """A tool the client runs, described by its input schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    # Accepted without effect: decoding is constrained to the schema whether or not `strict` is asked;
    # every tool is in the prompt (no tool search to defer loading to); examples and input streaming
    # options do not change what the model is shown here.
    strict: bool | None = None
    defer_loading: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    eager_input_streaming: bool | None = None
    allowed_callers: list[str] | None = None


class ServerTool(BaseModel):
    """A tool Anthropic defines and runs or trains its models on (`web_search_20250305`, `web_fetch_...`,
    `bash_...`, `text_editor_...`, `code_execution_...`): it has no input schema this server could show a
    model, so it is left out of the prompt (and logged), not refused."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    cache_control: CacheControl | None = None


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "custom" if kind in (None, "custom") else "server"


AnthropicTool = Annotated[Annotated[CustomTool, Tag("custom")] | Annotated[ServerTool, Tag("server")],
                          Discriminator(_tool_kind)]


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


class ThinkingEnabled(BaseModel):
    model_config = ConfigDict(extra="ignore")  # display

    type: Literal["enabled"]
    budget_tokens: int


class ThinkingOther(BaseModel):
    model_config = ConfigDict(extra="ignore")  # display

    type: Literal["disabled", "adaptive", "between_tools"]


# Accepted, without effect: the served models write no thinking blocks (usage counts none).
Thinking = Annotated[ThinkingEnabled | ThinkingOther, Field(discriminator="type")]


class JSONOutputFormat(BaseModel):
    """Structured output: the answer's text is JSON matching `schema` (our response_format json_schema)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # task_budget: advisory, without effect

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a hint for reasoning models
    format: JSONOutputFormat | None = None


class ContextManagement(BaseModel):
    """Server-side edits of the prompt (`clear_thinking_...`, `clear_tool_uses_...`, `compact_...`). Thinking
    blocks are never rendered here, so clearing them is what already happens; the other edits are not
    applied (logged): a prompt that outgrows the context is refused in the shape Claude Code compacts on."""

    model_config = ConfigDict(extra="ignore")

    edits: list[dict[str, Any]] = Field(default_factory=list)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: str | None = None  # Claude Code: JSON with its device and session ids; not used for anything


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # service_tier, speed, inference_geo, anything else harmless

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    stream: bool | None = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    cache_control: CacheControl | None = None  # automatic: a breakpoint on the last cacheable block
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = None  # the structured-outputs beta's name for output_config.format
    context_management: ContextManagement | None = None
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
