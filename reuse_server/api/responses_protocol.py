"""OpenAI's Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}): the request as OpenAI documents
it and its SDKs send it. Fields that would change the answer and that this server cannot honour are refused
(400); options real clients send that have no use here are accepted (README, "Responses API")."""
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
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
              "function_call_output": FunctionCallOutputItem}
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
        if kind not in ITEM_TYPES:
            raise ValueError(f"item {i}: items of type {kind!r} are not supported here "
                             f"(only {', '.join(ITEM_TYPES)})")
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


def _tools(value: Any) -> Any:
    for i, tool in enumerate(value if isinstance(value, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"tool {i}: tools of type {kind!r} are not supported here (only 'function': "
                             "this server runs no hosted tool)")
    return value


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


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
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
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
    # Accepted, no effect here (README): options with no use on this server.
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
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
        if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
            return value
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...} "
                         "(hosted tools and allowed_tools are not supported here)")


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
