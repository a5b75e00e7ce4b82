"""Chat messages -> prompt token ids. One function, so blending can later replace it with a chunked version."""
from __future__ import annotations

from jinja2 import TemplateError

from reuse_server.api.protocol import ChatMessage
from reuse_server.sampling_params import InvalidRequest


def render_chat_prompt(tokenizer, messages: list[ChatMessage]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("The served model has no chat template; use /v1/completions instead.", "messages")
    conversation = []
    for m in messages:
        entry = {"role": m.role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        conversation.append(entry)
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # e.g. a template that insists roles alternate
        raise InvalidRequest(f"The model's chat template rejected the messages: {exc}", "messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)
