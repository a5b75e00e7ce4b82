"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as a translation into the chat
path (api/chat.py). `system` becomes the first system message and a `system` message inside `messages` a
system message at its place; `tool_use` blocks the assistant's tool calls (their input written back as JSON),
`tool_result` blocks tool messages; tools and tool_choice map one to one (`any` is "required", `tool` a named
function, `disable_parallel_tool_use` parallel_tool_calls false), `output_config.format` is response_format.
What Anthropic runs itself (server tools, context edits) and an earlier answer's thinking or server tool
blocks are left out of the prompt, not refused (docs/usage.md, "Coding agents")."""
from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from reuse_server.api.app_state import app_state
from reuse_server.api.chat import PreparedChat, answer_steps, prepare_chat, whole_answers
from reuse_server.api.chat_template import render_chat_prompt
from reuse_server.api.errors import anthropic_error_body, describe_validation_error
from reuse_server.api.generation import ChoiceOutputs, SSEResponse, admitted_first, check_model, named_sse_events
from reuse_server.api.keepalive import AnthropicPing, keepalive_for, kept_alive
from reuse_server.api.messages_cache import cache_usage, marked, tool_result_content, with_automatic_breakpoint
from reuse_server.api.messages_protocol import (AnthropicMessage, CountTokensRequest, CustomTool, HistoryOnlyBlock,
                                                MessagesRequest, ServerTool, TextBlock)
from reuse_server.api.protocol import ChatCompletionRequest
from reuse_server.api.tools import tool_settings
from reuse_server.engine.client import EngineClient
from reuse_server.engine.outputs import Admission, RequestOutput
from reuse_server.engine.sampling_params import InvalidRequest

logger = logging.getLogger("reuse_server.api")

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}

# Claude Code's first system block: `x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=...;`.
BILLING_HEADER = re.compile(r"x-anthropic-billing-header:[^\n]*")

# Context edits whose effect this server has anyway: thinking blocks are never rendered (HistoryOnlyBlock).
APPLIED_EDITS = ("clear_thinking_",)


def is_billing_header(block: TextBlock) -> bool:
    """A system block that is only Claude Code's billing header. It is metadata for Anthropic's billing, not
    an instruction, and its suffix changes between sessions: rendered first, it would make every new session
    recompute the instructions and tools behind it, so it is left out of the prompt."""
    return BILLING_HEADER.fullmatch(block.text.strip()) is not None


def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def _parts(blocks: list) -> list[dict]:
    return [marked({"type": "text", "text": b.text}, b) for b in blocks if b.type == "text" and b.text]


def _system_parts(content: str | list[TextBlock]) -> list[dict]:
    blocks = [TextBlock(type="text", text=content)] if isinstance(content, str) else content
    kept = [b for b in blocks if not is_billing_header(b)]
    if len(kept) < len(blocks):
        logger.debug("left Claude Code's billing header out of the system prompt (it changes every session)")
    return _parts(kept)


def _shown(messages: list[AnthropicMessage], at: int) -> bool:
    """Whether a message is in front of the model: a system message with clear_at "next_user_message" is
    only until a later user message exists."""
    message = messages[at]
    return message.clear_at != "next_user_message" or not any(m.role == "user" for m in messages[at + 1:])


def chat_messages(body: MessagesRequest) -> list[dict]:
    """The conversation as chat messages (OpenAI's dicts)."""
    out: list[dict] = []
    if body.system:
        system = _system_parts(body.system)
        if system:
            out.append({"role": "system", "content": system})
    for at, message in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        if message.role == "system":
            system = _system_parts(blocks)
            if system and _shown(body.messages, at):
                out.append({"role": "system", "content": system})
            continue
        if message.role == "assistant":
            dropped = [b.type for b in blocks if isinstance(b, HistoryOnlyBlock)]
            if dropped:
                logger.debug("left %s block(s) of an earlier answer out of the prompt", ", ".join(dropped))
            calls = [{"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}} for b in blocks
                if b.type == "tool_use"]
            out.append({"role": "assistant", "content": _parts(blocks) or None, "tool_calls": calls or None})
            continue
        text: list[dict] = []  # a user message's text, after the tool results it carries
        for block in blocks:
            if block.type == "tool_result":
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": tool_result_content(block, _text(block.content))})
            elif block.type == "text" and block.text:
                text.append(marked({"type": "text", "text": block.text}, block))
        if text or not any(b.type == "tool_result" for b in blocks):
            out.append({"role": "user", "content": text or ""})
    return out


def _functions(body: MessagesRequest) -> list[dict] | None:
    """The client's tools as functions; Anthropic's server tools are left out (no schema to show a model, and
    nothing here runs them), with a warning so an operator sees what the client expected."""
    server = [t for t in body.tools or [] if isinstance(t, ServerTool)]
    if server:
        logger.warning("left server tool(s) %s out of the prompt: this server does not run them",
                       ", ".join(t.name or t.type for t in server))
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema},
             "cache_control": t.cache_control and t.cache_control.model_dump()}
            for t in body.tools or [] if isinstance(t, CustomTool)] or None


def _tool_choice(body: MessagesRequest) -> tuple[Any, bool]:
    if body.tool_choice is None:
        return None, True
    choice = body.tool_choice
    if choice.type == "tool" and any(isinstance(t, ServerTool) and choice.name in (t.name, t.type)
                                     for t in body.tools or []):
        raise InvalidRequest(f"tool_choice names {choice.name!r}, a server tool this server does not run.",
                             "tool_choice")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
        "type": "function", "function": {"name": choice.name}}
    return mapped, not choice.disable_parallel_tool_use


def _response_format(body: MessagesRequest) -> dict | None:
    """output_config.format (or the structured-outputs beta's output_format) as response_format json_schema."""
    fmt = (body.output_config.format if body.output_config else None) or body.output_format
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}


def _log_unapplied_edits(body: MessagesRequest) -> None:
    edits = body.context_management.edits if body.context_management else []
    skipped = [str(e.get("type")) for e in edits if not str(e.get("type")).startswith(APPLIED_EDITS)]
    if skipped:
        logger.warning("context_management edit(s) %s not applied: a prompt longer than the context is refused "
                       "(prompt is too long) for the client to compact", ", ".join(skipped))


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The request as the chat path takes it; InvalidRequest (a 400) for what it cannot honour."""
    if body.mcp_servers:
        raise InvalidRequest("mcp_servers are not supported: this server runs no MCP connector.", "mcp_servers")
    if body.container is not None:
        raise InvalidRequest("container is not supported: this server runs no code execution tool.", "container")
    if body.messages[-1].role == "assistant":
        raise InvalidRequest("A last assistant message (a prefill to continue) is not supported.", "messages")
    _log_unapplied_edits(body)
    choice, parallel = _tool_choice(body)
    chat = {
        "model": body.model, "messages": chat_messages(with_automatic_breakpoint(body)), "max_tokens": body.max_tokens,
        "stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "seed": body.seed, "stream": bool(body.stream), "tool_choice": choice, "parallel_tool_calls": parallel,
        "tools": _functions(body), "response_format": _response_format(body),
        "prefix_cache": body.prefix_cache, "cache_salt": body.cache_salt,
        "kv_blend": body.kv_blend.model_dump() if body.kv_blend else None,
    }
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        message, param = describe_validation_error(list(exc.errors()))
        raise InvalidRequest(message, param) from None


def usage(last: RequestOutput, output_tokens: int | None = None) -> dict:
    """Anthropic's usage: cache_read_input_tokens are the prompt tokens reused, cache_creation_input_tokens
    those computed up to the last cache_control breakpoint (api/messages_cache.py), input_tokens the rest.
    blended/recomputed/tier tokens are this server's extensions."""
    return {**cache_usage(last),
            "output_tokens": last.num_output_tokens if output_tokens is None else output_tokens,
            "blended_tokens": last.blended_tokens, "recomputed_tokens": last.recomputed_tokens,
            "tier_tokens": {"host": 0, "disk": 0, "redis": 0, **last.tier_tokens}}


def admission_usage(admission: Admission) -> dict:
    """message_start's usage when it goes out at admission, before the prompt is computed: the prefix match
    is known, blended chunks not yet (message_delta's usage, the final one, counts them)."""
    return {**cache_usage(admission), "output_tokens": 0, "blended_tokens": 0, "recomputed_tokens": 0,
            "tier_tokens": {"host": 0, "disk": 0, "redis": 0, **admission.tier_tokens}}


def stop_sequence(engine: EngineClient, chat: PreparedChat, token_ids: list[int], text: str,
                  reason: str | None) -> str | None:
    """The stop sequence that ended the answer, if one did (the engine cuts it from the text it returns)."""
    stops = chat.params.stop
    if reason != "stop" or not stops or not token_ids or token_ids[-1] in engine.eos_token_ids:
        return None
    full = engine.tokenizer.decode(token_ids, skip_special_tokens=False)
    return next((s for s in stops if full.startswith(s, len(text))), stops[0] if len(stops) == 1 else None)


def stop_fields(engine: EngineClient, chat: PreparedChat, token_ids: list[int], text: str, reason: str | None) -> dict:
    matched = stop_sequence(engine, chat, token_ids, text, reason)
    return {"stop_reason": "stop_sequence" if matched else STOP_REASONS.get(reason, "end_turn"),
            "stop_sequence": matched}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def message_shell(message_id: str, model: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None}


async def create_message(engine: EngineClient, body: MessagesRequest, request: Request) -> Response:
    chat = await prepare_chat(engine, chat_request(body), request, f"msg_{uuid.uuid4().hex}")
    outputs = chat.start(engine, request)
    if body.stream:
        events = message_events(engine, chat, outputs)
        frames = named_sse_events(events, outputs, _error_event)
        return SSEResponse(kept_alive(frames, keepalive_for(AnthropicPing, request)))
    (answer,) = await whole_answers(chat, outputs, request)
    content: list[dict[str, Any]] = []
    if answer.parsed.content:
        content.append({"type": "text", "text": answer.parsed.content})
    content += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": json.loads(c.arguments)}
                for c in answer.parsed.calls]
    raw_text = "".join(out.new_text for out in answer.outputs)
    message = {**message_shell(chat.request_id, engine.model_id), "content": content,
               **stop_fields(engine, chat, answer.token_ids, raw_text, answer.finish_reason),
               "usage": usage(answer.last)}
    return JSONResponse(message)


def _error_event(status: int, message: str, _: str) -> tuple[str, dict]:
    return "error", anthropic_error_body(status, message)


def message_start(engine: EngineClient, chat: PreparedChat, usage: dict) -> list[tuple[str, dict]]:
    return [("message_start", {"type": "message_start", "message": {
        **message_shell(chat.request_id, engine.model_id), "usage": usage}}), ("ping", {"type": "ping"})]


async def message_events(engine: EngineClient, chat: PreparedChat,
                         outputs: ChoiceOutputs) -> AsyncIterator[tuple[str, dict]]:
    """Anthropic's stream: message_start (as soon as the engine admits the request, so its prefix match is
    known, and a long prompt's stream starts a whole prefill before its first token: Claude Code's idle timer
    restarts on it), ping, a content_block_start / _delta / _stop run per text or tool_use block,
    message_delta, message_stop. Pings also fill the silences (api/keepalive.py)."""
    block, open_block = -1, None
    token_ids: list[int] = []
    raw_text = ""

    def close():
        nonlocal open_block
        if open_block is not None:
            open_block = None
            return [("content_block_stop", {"type": "content_block_stop", "index": block})]
        return []

    started = False
    async for step in admitted_first(outputs.admitted(), answer_steps(chat, outputs)):
        if isinstance(step, Admission):
            started = True
            for item in message_start(engine, chat, admission_usage(step)):
                yield item
            continue
        out = step.out
        token_ids += out.new_token_ids
        raw_text += out.new_text
        if not started:  # an output with no admission before it: the stream still opens with message_start
            started = True
            for item in message_start(engine, chat, usage(out, output_tokens=0)):
                yield item
        for event in step.events:
            if event.kind == "content":
                if open_block != "text":
                    for item in close():
                        yield item
                    block, open_block = block + 1, "text"
                    yield "content_block_start", {"type": "content_block_start", "index": block,
                                                  "content_block": {"type": "text", "text": ""}}
                yield "content_block_delta", {"type": "content_block_delta", "index": block,
                                              "delta": {"type": "text_delta", "text": event.text}}
            elif event.kind == "call":
                for item in close():
                    yield item
                block, open_block = block + 1, "tool_use"
                yield "content_block_start", {"type": "content_block_start", "index": block, "content_block": {
                    "type": "tool_use", "id": tool_use_id(event.id), "name": event.name, "input": {}}}
            else:  # a call's arguments, whole (api/tools.ToolCallStream): its block ends with them
                yield "content_block_delta", {"type": "content_block_delta", "index": block,
                                              "delta": {"type": "input_json_delta", "partial_json": event.text}}
                for item in close():
                    yield item
        if step.finish_reason is not None:
            for item in close():
                yield item
            yield "message_delta", {"type": "message_delta",
                                    "delta": stop_fields(engine, chat, token_ids, raw_text, step.finish_reason),
                                    "usage": usage(out)}
            yield "message_stop", {"type": "message_stop"}


async def count_tokens(engine: EngineClient, body: CountTokensRequest, request: Request) -> Response:
    """The prompt's length as /v1/messages would render it (tools included)."""
    check_model(body, engine.model_names)
    chat = chat_request(body.model_copy(update={"max_tokens": 1, "stream": False}))
    tokenizing = app_state(request).tokenizing
    prompt = await tokenizing.run(render_chat_prompt, tokenizing.tokenizer_for(request.state.tenant),
                                  chat.messages, tool_settings(chat))
    return JSONResponse({"input_tokens": len(prompt.token_ids)})
