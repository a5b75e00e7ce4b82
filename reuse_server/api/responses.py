"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API as a translation into the
chat path (api/chat.py). `instructions` become the system message; message items the messages,
`function_call` items the assistant's tool calls (consecutive ones one assistant turn), `function_call_output`
items tool messages; `text.format` the response_format. The answer comes back as output items: a `message`
with `output_text`, then a `function_call` per call.

With `previous_response_id` the stored turn is continued from the exact token ids of its prompt and answer
(api/response_store.py, chat_template.render_continuation) when the new request has the same instructions and
tools; otherwise (the prompt's head changed) the stored conversation is rendered again with the new ones."""
from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from reuse_server.api.app_state import app_state
from reuse_server.api.chat import Answer, AnswerStep, PreparedChat, answer_steps, prepare_chat, whole_answers
from reuse_server.api.chat_template import render_chat_prompt, render_continuation
from reuse_server.api.errors import NotFound, describe_validation_error, error_body
from reuse_server.api.generation import SSEResponse, named_sse_events
from reuse_server.api.keepalive import CommentLine, keepalive_for, kept_alive
from reuse_server.api.prompt_chunks import PromptChunks
from reuse_server.api.protocol import ChatCompletionRequest, ChatMessage
from reuse_server.api.response_store import ResponseStore, StoredResponse
from reuse_server.api.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, MessageItem,
                                                 ResponsesRequest)
from reuse_server.api.responses_tools import ResponsesTools, model_name, responses_tools, warn_skipped
from reuse_server.api.tools import StreamEvent
from reuse_server.engine.client import EngineClient
from reuse_server.engine.outputs import RequestOutput
from reuse_server.engine.sampling_params import InvalidRequest

logger = logging.getLogger("reuse_server.api")

# Given (not null, not false, not 0), each of these would change the answer; this server cannot honour them.
REFUSED = {"background": "background responses", "conversation": "the Conversations API",
           "prompt": "stored prompt templates", "max_tool_calls": "a limit on tool calls",
           "top_logprobs": "logprobs on responses", "context_management": "server-side context compaction"}


def refuse_what_cannot_be_honoured(body: ResponsesRequest) -> None:
    for name, what in REFUSED.items():
        if getattr(body, name):
            raise InvalidRequest(f"{name} is not supported: this server has no {what}.", name)


def _text(content: str | list) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content if part.text]


def item_messages(body: ResponsesRequest) -> list[dict]:
    """The request's input as chat messages (OpenAI's dicts); reasoning and hosted tools' items are left out
    (responses_protocol.DroppedItem), a namespaced call is named as the model wrote it."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": model_name(item.model_dump()), "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":  # the calls of one answer are one assistant turn
                out[-1]["tool_calls"] = (out[-1].get("tool_calls") or []) + [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "\n".join(p.text for p in item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return out


def response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


def chat_request(body: ResponsesRequest, tools: ResponsesTools, messages: list[dict]) -> ChatCompletionRequest:
    chat = {
        "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "stream": bool(body.stream), "tool_choice": tools.chat_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "tools": tools.functions or None,
        "response_format": response_format(body), "user": body.user, "prefix_cache": body.prefix_cache,
        "cache_salt": body.cache_salt, "kv_blend": body.kv_blend.model_dump() if body.kv_blend else None,
    }
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        message, param = describe_validation_error(list(exc.errors()))
        raise InvalidRequest(message, param) from None


def framing_of(body: ResponsesRequest) -> str:
    """What, besides the messages, the prompt's head is rendered from: a continuation keeps the stored
    tokens only while these are the same."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    text = json.dumps({"instructions": body.instructions, "tools": tools}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def continuation(stored: StoredResponse, new: int, eos_token_ids):
    """A PromptRenderer for a turn after `stored`: the stored tokens, then the last `new` messages."""
    prefix = PromptChunks(stored.prompt_ids + stored.answer_ids, list(stored.chunk_spans))

    def render(tokenizer, messages: list[ChatMessage], tools) -> PromptChunks:
        prompt = render_continuation(tokenizer, messages[len(messages) - new:], tools, prefix, eos_token_ids)
        if prompt is None:
            logger.info("the chat template cannot continue response %s from its tokens: its conversation is "
                        "rendered again", stored.id)
            return render_chat_prompt(tokenizer, messages, tools)
        return prompt
    return render


# ---------------------------------------------------------------- the answer as output items


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Builds a response's output items from the answer's content and calls, with the stream events that
    announce them (the whole answer uses the same builder and drops the events)."""

    def __init__(self, tools: ResponsesTools) -> None:
        self.tools = tools
        self.items: list[dict] = []
        self._message: dict | None = None

    def _event(self, kind: str, **fields) -> tuple[str, dict]:
        return kind, {"type": kind, **copy.deepcopy(fields)}

    def feed(self, event: StreamEvent) -> list[tuple[str, dict]]:
        out = []
        index = len(self.items) - 1
        if event.kind == "content":
            if self._message is None:
                self._message = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                                 "content": []}
                self.items.append(self._message)
                index = len(self.items) - 1
                out.append(self._event("response.output_item.added", output_index=index, item=self._message))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self._message["content"].append(part)
                out.append(self._event("response.content_part.added", item_id=self._message["id"],
                                       output_index=index, content_index=0, part=part))
            self._message["content"][0]["text"] += event.text
            out.append(self._event("response.output_text.delta", item_id=self._message["id"], output_index=index,
                                   content_index=0, delta=event.text, logprobs=[]))
        elif event.kind == "call":
            out += self._close_message("completed")
            call = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": event.id,
                    **self.tools.call_fields(event.name), "arguments": ""}
            self.items.append(call)
            out.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=call))
        else:  # a call's arguments come whole (api/tools.ToolCallStream): the call is done with them
            call = self.items[-1]
            call["arguments"] += event.text
            out.append(self._event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                                   delta=event.text))
            out.append(self._event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                                   name=call["name"], arguments=call["arguments"]))
            call["status"] = "completed"
            out.append(self._event("response.output_item.done", output_index=index, item=call))
        return out

    def _close_message(self, status: str) -> list[tuple[str, dict]]:
        message, self._message = self._message, None
        if message is None:
            return []
        index = self.items.index(message)
        part = message["content"][0]
        message["status"] = status
        return [self._event("response.output_text.done", item_id=message["id"], output_index=index,
                            content_index=0, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=message["id"], output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=message)]

    def close(self, status: str) -> list[tuple[str, dict]]:
        return self._close_message(status)


def usage(last: RequestOutput) -> dict:
    return {"input_tokens": last.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": last.cached_tokens, "blended_tokens": last.blended_tokens,
                                     "recomputed_tokens": last.recomputed_tokens,
                                     "cache_write_tokens": last.cache_write_tokens,
                                     "tier_tokens": {"host": 0, "disk": 0, "redis": 0, **last.tier_tokens}},
            "output_tokens": last.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": last.num_prompt_tokens + last.num_output_tokens}


class Turn:
    """One POST /v1/responses: the request, its conversation, and how its response is written and stored."""

    def __init__(self, engine: EngineClient, body: ResponsesRequest, tools: ResponsesTools, request: Request,
                 history: list[dict], new: list[dict]):
        self.engine, self.body, self.tools, self.request = engine, body, tools, request
        self.id = _id("resp")
        self.created = int(time.time())
        self.conversation = history + new  # stored without the instructions: each request brings its own

    def response(self, status: str, output: list[dict], last: RequestOutput | None,
                 reason: str | None = None, error: dict | None = None) -> dict:
        body = self.body
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        tool_choice = body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None \
            else body.tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None, "model": self.engine.model_id, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt, "verbosity": (body.text.verbosity if body.text else None) or "medium"},
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump() for t in body.tools or []], "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled", "usage": usage(last) if last is not None else None,
            "user": body.user, "metadata": body.metadata or {},
            "skipped_tools": self.tools.skipped,  # extension: the tools left out of the prompt (docs/usage.md)
        }

    def status(self, last: RequestOutput, reason: str | None) -> str:
        """"incomplete" for an answer cut short: by max_output_tokens or a full context, or aborted. An answer
        ended by the server's own --max-tokens on a request that set no max_output_tokens is "completed": that
        cap is where this server ends every answer (as llama.cpp's --n-predict), not a limit the client asked
        for, and Codex, which sends none, fails a turn that ends incomplete."""
        if reason == "abort":
            return "incomplete"
        if reason != "length":
            return "completed"
        cap = self.engine.config.max_tokens
        server_cap = self.body.max_output_tokens is None and cap is not None and last.num_output_tokens >= cap
        return "completed" if server_cap else "incomplete"

    def finished(self, output: list[dict], last: RequestOutput, reason: str | None) -> dict:
        status = self.status(last, reason)
        return self.response(status, output, last, reason if status == "incomplete" else None)

    async def store(self, chat: PreparedChat, response: dict, answer_ids: list[int]) -> None:
        if self.body.store is False:
            return
        content = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                          for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": model_name(item), "arguments": item["arguments"]}}
                 for item in response["output"] if item["type"] == "function_call"]
        answer = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
        record = StoredResponse(self.id, self.request.state.tenant, response, chat.prompt_ids, answer_ids,
                                self.conversation + [answer], framing_of(self.body), chat.chunk_spans)
        await asyncio.to_thread(_store(self.request).put, record)


def _store(request: Request) -> ResponseStore:
    return app_state(request).settings.responses


async def create_response(engine: EngineClient, body: ResponsesRequest, request: Request) -> Response:
    refuse_what_cannot_be_honoured(body)
    stored = None
    if body.previous_response_id:
        stored = await asyncio.to_thread(_store(request).get, request.state.tenant, body.previous_response_id)
        if stored is None:
            raise NotFound(f"Previous response with id '{body.previous_response_id}' not found.",
                           "previous_response_id")
    new = item_messages(body)
    tools = responses_tools(body)
    turn = Turn(engine, body, tools, request, stored.messages if stored else [], new)
    warn_skipped(turn.id, tools)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if not system + turn.conversation:
        raise InvalidRequest("input: nothing to answer: it holds no message or function call item (reasoning "
                             "items and hosted tools' calls are left out of the prompt).", "input")
    render = render_chat_prompt
    if stored is not None and stored.framing == framing_of(body):
        render = continuation(stored, len(new), engine.eos_token_ids)
    try:
        chat = await prepare_chat(engine, chat_request(body, tools, system + turn.conversation), request, turn.id,
                                  render=render)
    except InvalidRequest as exc:
        exc.param = RESPONSES_PARAMS.get(exc.param, exc.param)
        if body.stream and exc.code == CONTEXT_OVERFLOW:
            numbered = Numbered()
            return SSEResponse(named_sse_events(numbered.wrap(failed_events(turn, exc)), _nothing(),
                                                numbered.error_event))
        raise
    outputs = chat.start(engine, request)
    if body.stream:
        numbered = Numbered()
        events = numbered.wrap(response_events(turn, chat, answer_steps(chat, outputs)))
        frames = named_sse_events(events, outputs, numbered.error_event)
        return SSEResponse(kept_alive(frames, keepalive_for(CommentLine, request)))
    (answer,) = await whole_answers(chat, outputs, request)
    response = turn.finished(whole_output(tools, answer, turn.status(answer.last, answer.finish_reason)),
                             answer.last, answer.finish_reason)
    await turn.store(chat, response, answer.token_ids)
    return JSONResponse(response)


# The chat path's names of the fields an error points at, as the Responses API calls them.
RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
CONTEXT_OVERFLOW = "context_length_exceeded"


async def failed_events(turn: Turn, exc: InvalidRequest) -> AsyncIterator[tuple[str, dict]]:
    """A prompt longer than the context, streamed as OpenAI streams it: the response is created and fails
    with the error's code. Codex reads `context_length_exceeded` in a response.failed event as a full
    context window (codex-api/src/sse/responses.rs); from a plain 400 it would only report an invalid
    request. Nothing was queued, no KV block was touched."""
    shell = turn.response("in_progress", [], None)
    yield "response.created", {"type": "response.created", "response": shell}
    yield "response.in_progress", {"type": "response.in_progress", "response": shell}
    failed = turn.response("failed", [], None, error={"code": exc.code, "message": exc.message})
    yield "response.failed", {"type": "response.failed", "response": failed}


async def _nothing() -> AsyncIterator:
    """The engine outputs of a request that never started (named_sse_events closes them)."""
    return
    yield


def whole_output(tools: ResponsesTools, answer: Answer, status: str) -> list[dict]:
    items = OutputItems(tools)
    if answer.parsed.content:
        items.feed(StreamEvent("content", answer.parsed.content))
    for call in answer.parsed.calls:
        items.feed(StreamEvent("call", id=call.id, name=call.name))
        items.feed(StreamEvent("arguments", call.arguments))
    items.close(status)
    return items.items


async def response_events(turn: Turn, chat: PreparedChat,
                          steps: AsyncIterator[AnswerStep]) -> AsyncIterator[tuple[str, dict]]:
    """The documented sequence: response.created, response.in_progress, then per output item its added /
    part / delta / done events, and response.completed (or response.incomplete when cut by max tokens)."""
    shell = turn.response("in_progress", [], None)
    yield "response.created", {"type": "response.created", "response": shell}
    yield "response.in_progress", {"type": "response.in_progress", "response": shell}
    items = OutputItems(turn.tools)
    answer_ids: list[int] = []
    async for step in steps:
        answer_ids += step.out.new_token_ids
        for event in step.events:
            for item in items.feed(event):
                yield item
        if step.finish_reason is not None:
            for item in items.close(turn.status(step.out, step.finish_reason)):
                yield item
            response = turn.finished(items.items, step.out, step.finish_reason)
            await turn.store(chat, response, answer_ids)
            kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
            yield kind, {"type": kind, "response": response}


class Numbered:
    """Gives every event of a stream its sequence_number, the in-band error event included."""

    def __init__(self) -> None:
        self.next = 0

    async def wrap(self, events: AsyncIterator[tuple[str, dict]]) -> AsyncIterator[tuple[str, dict]]:
        try:
            async for name, payload in events:
                payload["sequence_number"] = self.next
                self.next += 1
                yield name, payload
        finally:
            await events.aclose()

    def error_event(self, status: int, message: str, type_: str) -> tuple[str, dict]:
        error = error_body(message, type_)["error"]
        return "error", {"type": "error", "code": error["code"] or type_, "message": message, "param": None,
                         "sequence_number": self.next}


async def get_response(request: Request, response_id: str) -> Response:
    stored = await asyncio.to_thread(_store(request).get, request.state.tenant, response_id)
    if stored is None:
        raise NotFound(f"Response with id '{response_id}' not found.", "response_id")
    return JSONResponse(stored.response)


async def delete_response(request: Request, response_id: str) -> Response:
    if not await asyncio.to_thread(_store(request).delete, request.state.tenant, response_id):
        raise NotFound(f"Response with id '{response_id}' not found.", "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
