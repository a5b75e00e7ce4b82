"""OpenAI's Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}): the request as OpenAI documents
it and its SDKs send it. Fields that would change the answer and that this server cannot honour are refused
(400); options real clients send that have no use here are accepted (docs/usage.md, "Agent front doors")."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from reuse_server.api.protocol import FUNCTION_NAME, KVBlendOptions, _check_unicode


class TextPart(BaseModel):
    """input_text (what a user sends) or output_text (an earlier answer sent back)."""

    model_config = ConfigDict(extra="ignore")  # annotations, logprobs

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    namespace: str | None = None  # a function of a namespace tool (api/responses_tools.py)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


class DroppedItem(BaseModel):
    """An item sent back that has no place in this model's prompt: reasoning (the model does not reason; an
    encrypted one is another model's), and the calls of hosted or custom tools this server never offers
    (they came from another model, e.g. before a switch of provider). Accepted and left out."""

    model_config = ConfigDict(extra="ignore")

    type: str


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | DroppedItem
ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
              "function_call_output": FunctionCallOutputItem}
# OpenAI's output item types (and their outputs) that the prompt leaves out
DROPPED_ITEM_TYPES = ("reasoning", "web_search_call", "file_search_call", "code_interpreter_call",
                      "image_generation_call", "computer_call", "computer_call_output", "local_shell_call",
                      "local_shell_call_output", "custom_tool_call", "custom_tool_call_output", "tool_search_call",
                      "tool_search_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
                      "mcp_approval_response")
PART_TYPES = ("input_text", "output_text")


def _items(value: Any) -> Any:
    """Each item validated as its own type, with one clear message for a type this server does not take."""
    if not isinstance(value, list):
        return value
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValueError(f"item {i} is not an object")
        kind = item.get("type", "message")
        if kind in DROPPED_ITEM_TYPES:
            out.append(DroppedItem(type=kind))
            continue
        if kind not in ITEM_TYPES:
            raise ValueError(f"item {i}: items of type {kind!r} are not supported here "
                             f"(only {', '.join(ITEM_TYPES)}; left out of the prompt: "
                             f"{', '.join(DROPPED_ITEM_TYPES)})")
        content = item.get("content") if kind == "message" else item.get("output")
        for j, part in enumerate(content if isinstance(content, list) else []):
            part_kind = part.get("type") if isinstance(part, dict) else None
            if part_kind not in PART_TYPES:
                raise ValueError(f"item {i}, part {j}: parts of type {part_kind!r} are not supported here "
                                 f"(only {', '.join(PART_TYPES)})")
        out.append(ITEM_TYPES[kind].model_validate(item))
    return out


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(BaseModel):
    """Functions grouped under one name (Codex's sub-agent tools, each of its MCP servers); the model sees
    them flattened (api/responses_tools.py)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["namespace"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    tools: list[FunctionTool] = Field(min_length=1)


class HostedTool(BaseModel):
    """Any other tool: one OpenAI runs (web_search, file_search, code_interpreter, image_generation, mcp...),
    one the client runs on output this server cannot constrain (custom grammar tools, local_shell,
    tool_search). Left out of the prompt and reported (docs/usage.md, "Coding agents")."""

    model_config = ConfigDict(extra="allow")  # echoed back in the response's tools as sent

    type: str
    name: str | None = None

    def reported(self) -> dict:
        return {"type": self.type, **({"name": self.name} if self.name else {})}


Tool = FunctionTool | NamespaceTool | HostedTool


def _tools(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise ValueError(f"tool {i}: a tool needs its 'type'")
        model = {"function": FunctionTool, "namespace": NamespaceTool}.get(kind, HostedTool)
        if kind == "namespace":
            for j, inner in enumerate(tool.get("tools") or []):
                inner_kind = inner.get("type") if isinstance(inner, dict) else None
                if inner_kind != "function":
                    raise ValueError(f"tool {i}, tool {j}: a namespace holds functions, not {inner_kind!r}")
        out.append(model.model_validate(tool))
    return out


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str
    namespace: str | None = None  # the function `name` of that namespace tool


class HostedChoice(HostedTool):
    """tool_choice of a hosted tool ({"type": "web_search"}, {"type": "custom", "name": ...}): that tool is
    left out, so the choice is taken as "auto" (api/responses_tools.py)."""

    model_config = ConfigDict(extra="ignore")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a format of type 'json_schema' needs its 'schema'")
        return self


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[Item] = Field(min_length=1)
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | HostedChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    # Accepted, no effect here (docs/usage.md): options with no use on this server.
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's session, turn and window ids
    # Refused when given: they would change the answer and this server cannot honour them.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: Any = None
    # Extensions, as on the chat route.
    top_k: int | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    prefix_cache: bool | None = True
    cache_salt: str | None = None
    kv_blend: KVBlendOptions | None = None

    _valid_unicode = model_validator(mode="before")(_check_unicode)
    _known_items = field_validator("input", mode="before")(_items)
    _known_tools = field_validator("tools", mode="before")(_tools)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "function" and isinstance(value.get("name"), str):
            return FunctionChoice.model_validate(value)
        if isinstance(kind, str) and kind not in ("function", "allowed_tools"):
            return HostedChoice.model_validate(value)
        raise ValueError("tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'name': ...} "
                         "or a hosted tool's {'type': ...} (allowed_tools is not supported here)")


# ---------------------------------------------------------------- responses (declared for /openapi.json)


class ResponseObject(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool
