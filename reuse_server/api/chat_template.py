"""Chat messages -> prompt token ids and reusable chunk spans.

Every message's content is its own chunk, and so is every text part of a list content (a RAG client puts
one passage per part); the template's framing between them (role headers, end-of-turn markers, the
generation prompt) forms small chunks that are always computed. See `blend.chunking.render_chat_chunks`.
"""
from __future__ import annotations

from blend.chunking import PART_SEPARATOR, Chunk, chat_opening, encode, render_chat_chunks
from jinja2 import TemplateError

from reuse_server.api.cache_breakpoints import breakpoints
from reuse_server.api.prompt_chunks import PromptChunks, from_chunks
from reuse_server.api.protocol import ChatMessage
from reuse_server.api.tools import ToolSettings, for_template
from reuse_server.engine.sampling_params import InvalidRequest
from reuse_server.kv.pins import CacheBreakpoint

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
            entry["content"] = [_text_part(part) for part in m.content]
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def _text_part(part: dict) -> dict:
    """A text part as the template takes it; a cache_control mark rides along to place the breakpoint."""
    out = {"type": "text", "text": part["text"]}
    if part.get("cache_control") is not None:
        out["cache_control"] = part["cache_control"]
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


def render_marked_chat_prompt(render, tokenizer, messages: list[ChatMessage], tools: ToolSettings
                              ) -> tuple[PromptChunks, tuple[CacheBreakpoint, ...]]:
    """`render`'s prompt (render_chat_prompt or a continuation) and the cache breakpoints the messages' and
    tools' cache_control marks set in it (api/cache_breakpoints.py). A continuation's spans start with the
    stored turn's, which hold no marks: its breakpoints are the new messages' only when the spans line up."""
    prompt = render(tokenizer, messages, tools)
    marked = conversation(messages)
    if not tools.cache_control and not any(isinstance(m["content"], list) and any("cache_control" in p for p in m["content"])
                                           for m in marked):
        return prompt, ()
    rendered, _ = for_template(tokenizer, marked, tools)
    return prompt, breakpoints(rendered, prompt.chunk_spans)


# Stand-ins for a stored turn in a probe rendering (private-use characters no client text holds).
_EARLIER_TURN = "\ue000earlier turn\ue001"
_EARLIER_ANSWER = "\ue000earlier answer\ue001"


def render_continuation(tokenizer, messages: list[ChatMessage], tools: ToolSettings, prefix: PromptChunks,
                        eos_token_ids) -> PromptChunks | None:
    """The prompt of a turn that continues a stored one: `prefix` (the stored prompt's and answer's exact
    token ids) followed by the tokens the template puts after an assistant answer for `messages` (the new
    ones only): the end of the answer's turn, each new message, the generation prompt. Found by rendering
    the new messages after a stand-in turn and taking what follows the stand-in answer. When the stored
    answer ended with the end-of-turn token itself (EOS), the template's copy of it is left out. None when
    the template does not render content verbatim or rejects the stand-in turn (then the caller renders the
    whole conversation)."""
    probe = [ChatMessage(role="user", content=_EARLIER_TURN), ChatMessage(role="assistant", content=_EARLIER_ANSWER),
             *messages]
    rendered, template_kwargs = for_template(tokenizer, conversation(probe), tools)
    try:
        chunks = render_chat_chunks(tokenizer, rendered, add_generation_prompt=True,
                                    part_separator=PART_SEPARATOR, **template_kwargs)
    except TemplateError:  # e.g. a template that wants the stand-in answer to hold the calls answered
        return None
    at = next((k for k, c in enumerate(chunks) if c.reusable and c.text == _EARLIER_ANSWER), None)
    if at is None:
        return None
    suffix = list(chunks[at + 1:])
    if suffix and not suffix[0].reusable and prefix.token_ids and prefix.token_ids[-1] in eos_token_ids:
        end = tokenizer.decode([prefix.token_ids[-1]])
        if end and suffix[0].text.startswith(end):
            rest = suffix[0].text[len(end):]
            suffix[0] = Chunk(rest, encode(tokenizer, rest), False)
    ids, spans = from_chunks(suffix, prefix=prefix.token_ids)
    return PromptChunks(ids, list(prefix.chunk_spans) + spans)


def user_turn_opening(tokenizer) -> list[int]:
    """The tokens a chat prompt puts before the first user message's content (a default system prompt, the
    user header). Precomputed chunks are computed after them, so that when a chunk is reused its cached KV
    was made with the same attention sink at the start of the context (it raised the needle test's accuracy:
    benchmarks/results/history.md). Empty for a model without a chat template."""
    return chat_opening(tokenizer, PART_SEPARATOR)
