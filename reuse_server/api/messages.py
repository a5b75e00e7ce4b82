"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as a translation into the chat
path (api/chat.py). `system` becomes the system message; `tool_use` blocks the assistant's tool calls (their
input written back as JSON), `tool_result` blocks tool messages; tools and tool_choice map one to one
(`any` is "required", `tool` a named function, `disable_parallel_tool_use` parallel_tool_calls false)."""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from reuse_server.api.chat import AnswerStep, PreparedChat, answer_steps, prepare_chat, whole_answers
from reuse_server.api.chat_template import render_chat_prompt
from reuse_server.api.errors import anthropic_error_body, describe_validation_error
from reuse_server.api.generation import SSEResponse, check_model, named_sse_events
from reuse_server.api.messages_protocol import CountTokensRequest, MessagesRequest, TextBlock
from reuse_server.api.protocol import ChatCompletionRequest
from reuse_server.api.tools import tool_settings
from reuse_server.engine.outputs import RequestOutput
from reuse_server.engine.sampling_params import InvalidRequest

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def _parts(blocks: list) -> list[dict]:
    return [{"type": "text", "text": b.text} for b in blocks if b.type == "text" and b.text]


def chat_messages(body: MessagesRequest) -> list[dict]:
    """The conversation as chat messages (OpenAI's dicts)."""
    out: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _parts(body.system)
        if system:
            out.append({"role": "system", "content": system})
    for message in body.messages:
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}} for b in blocks
                if b.type == "tool_use"]
            out.append({"role": "assistant", "content": _parts(blocks) or None, "tool_calls": calls or None})
            continue
        text: list[dict] = []  # a user message's text, after the tool results it carries
        for block in blocks:
            if block.type == "tool_result":
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
            elif block.type == "text" and block.text:
                text.append({"type": "text", "text": block.text})
        if text or not any(b.type == "tool_result" for b in blocks):
            out.append({"role": "user", "content": text or ""})
    return out


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The request as the chat path takes it; InvalidRequest (a 400) for what it cannot honour."""
    if body.mcp_servers:
        raise InvalidRequest("mcp_servers are not supported: this server runs no MCP connector.", "mcp_servers")
    if body.container is not None:
        raise InvalidRequest("container is not supported: this server runs no code execution tool.", "container")
    if body.messages[-1].role == "assistant":
        raise InvalidRequest("A last assistant message (a prefill to continue) is not supported.", "messages")
    choice, parallel = None, True
    if body.tool_choice is not None:
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(body.tool_choice.type) or {
            "type": "function", "function": {"name": body.tool_choice.name}}
        parallel = not body.tool_choice.disable_parallel_tool_use
    chat = {
        "model": body.model, "messages": chat_messages(body), "max_tokens": body.max_tokens,
        "stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "seed": body.seed, "stream": bool(body.stream), "tool_choice": choice, "parallel_tool_calls": parallel,
        "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                    "parameters": t.input_schema}} for t in body.tools or []] or None,
        "prefix_cache": body.prefix_cache, "cache_salt": body.cache_salt,
        "kv_blend": body.kv_blend.model_dump() if body.kv_blend else None,
    }
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        message, param = describe_validation_error(list(exc.errors()))
        raise InvalidRequest(message, param) from None


def usage(last: RequestOutput, output_tokens: int | None = None) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens computed, cache_read_input_tokens those reused.
    Nothing is written to the cache at a price here (every computed block is kept automatically), so
    cache_creation_input_tokens is 0. blended/recomputed/tier tokens are this server's extensions."""
    return {"input_tokens": last.num_prompt_tokens - last.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": last.cached_tokens,
            "output_tokens": last.num_output_tokens if output_tokens is None else output_tokens,
            "blended_tokens": last.blended_tokens, "recomputed_tokens": last.recomputed_tokens,
            "tier_tokens": {"host": 0, "disk": 0, "redis": 0, **last.tier_tokens}}


def stop_sequence(engine, chat: PreparedChat, token_ids: list[int], text: str, reason: str | None) -> str | None:
    """The stop sequence that ended the answer, if one did (the engine cuts it from the text it returns)."""
    stops = chat.params.stop
    if reason != "stop" or not stops or not token_ids or token_ids[-1] in engine.eos_token_ids:
        return None
    full = engine.tokenizer.decode(token_ids, skip_special_tokens=False)
    return next((s for s in stops if full.startswith(s, len(text))), stops[0] if len(stops) == 1 else None)


def stop_fields(engine, chat: PreparedChat, token_ids: list[int], text: str, reason: str | None) -> dict:
    matched = stop_sequence(engine, chat, token_ids, text, reason)
    return {"stop_reason": "stop_sequence" if matched else STOP_REASONS.get(reason, "end_turn"),
            "stop_sequence": matched}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def message_shell(message_id: str, model: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None}


async def create_message(engine, body: MessagesRequest, request: Request) -> Response:
    chat = await prepare_chat(engine, chat_request(body), request, f"msg_{uuid.uuid4().hex}")
    outputs = chat.start(engine, request)
    if body.stream:
        events = message_events(engine, chat, answer_steps(chat, outputs))
        return SSEResponse(named_sse_events(events, outputs, _error_event))
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


async def message_events(engine, chat: PreparedChat,
                         steps: AsyncIterator[AnswerStep]) -> AsyncIterator[tuple[str, dict]]:
    """Anthropic's stream: message_start (once the prompt is in, so its usage is known), ping, a
    content_block_start / _delta / _stop run per text or tool_use block, message_delta, message_stop."""
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
    async for step in steps:
        out = step.out
        token_ids += out.new_token_ids
        raw_text += out.new_text
        if not started:
            started = True
            yield "message_start", {"type": "message_start", "message": {
                **message_shell(chat.request_id, engine.model_id), "usage": usage(out, output_tokens=0)}}
            yield "ping", {"type": "ping"}
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


async def count_tokens(engine, body: CountTokensRequest, request: Request) -> Response:
    """The prompt's length as /v1/messages would render it (tools included)."""
    check_model(body, engine.model_names)
    chat = chat_request(body.model_copy(update={"max_tokens": 1, "stream": False}))
    tokenizing = request.app.state.tokenizing
    prompt = await tokenizing.run(render_chat_prompt, tokenizing.tokenizer_for(request.state.tenant),
                                  chat.messages, tool_settings(chat))
    return JSONResponse({"input_tokens": len(prompt.token_ids)})
