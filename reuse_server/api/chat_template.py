"""Chat messages -> prompt token ids and reusable chunk spans.

Every message's content is its own chunk, and so is every text part of a list content (a RAG client puts
one passage per part); the template's framing between them (role headers, end-of-turn markers, the
generation prompt) forms small chunks that are always computed. See `blend.chunking.render_chat_chunks`.
"""
from __future__ import annotations

from blend.chunking import PART_SEPARATOR, chat_opening, render_chat_chunks
from jinja2 import TemplateError

from reuse_server.api.prompt_chunks import PromptChunks, from_chunks
from reuse_server.api.protocol import ChatMessage
from reuse_server.api.tools import ToolSettings, for_template
from reuse_server.engine.sampling_params import InvalidRequest

NO_TOOLS = ToolSettings((), "none", True)


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them; list content stays a list of text parts; tool calls and
    tool call ids as OpenAI sends them (api/tools.py fits them to the template)."""
    out = []
    for m in messages:
        # chat templates predate OpenAI's "developer" role; it is the system message under a new name
        role = "system" if m.role == "developer" else m.role
        entry = {"role": role, "content": m.content if m.content is not None else ""}
        if isinstance(m.content, list):
            entry["content"] = [{"type": "text", "text": part["text"]} for part in m.content]
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def render_chat_prompt(tokenizer, messages: list[ChatMessage], tools: ToolSettings = NO_TOOLS) -> PromptChunks:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("The served model has no chat template; use /v1/completions instead.", "messages")
    rendered, template_kwargs = for_template(tokenizer, conversation(messages), tools)
    try:
        chunks = render_chat_chunks(tokenizer, rendered, add_generation_prompt=True,
                                    part_separator=PART_SEPARATOR, **template_kwargs)
    except TemplateError as exc:  # e.g. a template that insists roles alternate
        raise InvalidRequest(f"The model's chat template rejected the messages: {exc}", "messages") from exc
    return from_chunks(chunks)


def user_turn_opening(tokenizer) -> list[int]:
    """The tokens a chat prompt puts before the first user message's content (a default system prompt, the
    user header). Precomputed chunks are computed after them, so that when a chunk is reused its cached KV
    was made with the same attention sink at the start of the context (it raised the needle test's accuracy:
    benchmarks/results/history.md). Empty for a model without a chat template."""
    return chat_opening(tokenizer, PART_SEPARATOR)
