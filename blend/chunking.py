"""Prompts as sequences of separately tokenized chunks.

Every chunk is tokenized ALONE (no special tokens added) and the token lists are
concatenated, on the cached and the uncached paths alike. A passage therefore has the
same tokens wherever it appears, which is what lets its KV (and its key, which hashes only
its own tokens) be reused at any position. The price: the token sequence can differ from
tokenizing the whole prompt string at once at chunk boundaries (BPE merges across a
boundary do not happen); it decodes to the same text, and the model sees the same
sequence whether or not blending is used, because both paths chunk the same way.
Tokenizers that prepend a dummy-prefix space to every encoded string (sentencepiece
"add_dummy_prefix", e.g. Llama-2) would insert that space at every chunk start; the
byte-level BPE tokenizers of Llama-3/SmolLM2 do not.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any, Sequence

from jinja2 import TemplateError

from blend.token_cache import MIN_CACHED_CHARS, cache_for

log = logging.getLogger(__name__)

# Text parts of one message are joined with a newline, as vLLM does for string-content chat templates
# (clients send parts expecting it). The separator is framing: it forms its own small chunk between parts,
# so a passage's tokens stay the same wherever it appears.
PART_SEPARATOR = "\n"


@dataclass(frozen=True)
class Chunk:
    text: str
    tokens: tuple[int, ...]
    reusable: bool

    def __len__(self) -> int:
        return len(self.tokens)


def encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    """Token ids of ``text`` alone, no special tokens added (special-token TEXT in ``text``
    such as "<|im_start|>" is still recognised, as in a full rendering).
    Works with transformers tokenizers and raw ``tokenizers.Tokenizer`` objects.
    Long texts seen before come from the tokenizer's token cache (blend.token_cache)."""
    if len(text) >= MIN_CACHED_CHARS:
        cache = cache_for(tokenizer)
        if cache is not None:
            return cache.get_or_encode(text, lambda t: _encode(tokenizer, t))
    return _encode(tokenizer, text)


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    out = tokenizer.encode(text, add_special_tokens=False)
    ids = out.ids if hasattr(out, "ids") else out
    return tuple(int(t) for t in ids)


def whitespace_tokens(tokenizer: Any) -> dict[int, int]:
    """Each token id that decodes to whitespace alone, and the line breaks in it: what ParagraphCuts
    (blend/content_cuts.py) reads blank lines from. Decodes the whole vocabulary once (under a second
    for Gemma 3's 262,144 tokens)."""
    raw = getattr(tokenizer, "backend_tokenizer", tokenizer)  # the tokenizers.Tokenizer: 5x faster than transformers'
    texts = raw.decode_batch([[i] for i in range(raw.get_vocab_size())], skip_special_tokens=False)
    return {i: t.count("\n") for i, t in enumerate(texts) if t.isspace()}


def tokenize_chunks(tokenizer: Any, texts: Sequence[str], reusable: Sequence[bool] | None = None) -> list[Chunk]:
    """One Chunk per text, each tokenized alone; ``reusable`` defaults to all True."""
    if reusable is None:
        reusable = [True] * len(texts)
    if len(reusable) != len(texts):
        raise ValueError(f"{len(texts)} texts but {len(reusable)} reusable flags")
    return [Chunk(t, encode(tokenizer, t), bool(r)) for t, r in zip(texts, reusable)]


def split_by_separator(text: str, separator: str) -> list[str]:
    """Split a /v1/completions prompt at ``separator`` (``--blend-separator``).

    The separator is a pure boundary marker: it is REMOVED, and empty pieces are dropped.
    The model sees the concatenation of the pieces, each tokenized alone, so the separator
    can neither change a neighbour's tokenization nor be tokenized differently mid-text
    (LMCache issue #1136, where the separator was matched on token ids). Whitespace that
    should separate passages belongs inside the pieces.
    """
    if not separator:
        raise ValueError("separator must be a non-empty string")
    return [piece for piece in text.split(separator) if piece]


def chunk_tokens(chunks: Sequence[Chunk]) -> list[int]:
    """The prompt's token ids: the chunks' tokens concatenated."""
    return [t for c in chunks for t in c.tokens]


def chunk_spans(chunks: Sequence[Chunk]) -> tuple[list[int], list[int]]:
    """(starts, lens) of each chunk in the concatenated token sequence."""
    starts, lens, pos = [], [], 0
    for c in chunks:
        starts.append(pos)
        lens.append(len(c.tokens))
        pos += len(c.tokens)
    return starts, lens


def _message_parts(message: dict) -> list[str]:
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only {{'type': 'text', 'text': str}} content parts are supported, got {part!r}")
            parts.append(part["text"])
        return parts
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def flatten_messages(messages: Sequence[dict], part_separator: str = PART_SEPARATOR) -> list[dict]:
    """Messages with list-of-text-parts content joined into one string by ``part_separator``
    (the form string-content chat templates such as ChatML expect)."""
    out = []
    for m in messages:
        m2 = dict(m)
        if isinstance(m.get("content"), list):
            m2["content"] = part_separator.join(_message_parts(m))
        out.append(m2)
    return out


def render_chat_chunks(
    tokenizer: Any,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    part_separator: str = PART_SEPARATOR,
    **template_kwargs: Any,
) -> list[Chunk]:
    """Chat prompt as chunks: each message's content (each text part of a list content)
    is its own reusable chunk; the template's framing text between them (role headers,
    "<|im_end|>\\n", a default system prompt, the generation prompt, the ``part_separator``
    between parts) forms small non-reusable chunks.

    Framing is kept apart rather than glued to the content so a passage's key and tokens do
    not depend on its role or on what the template writes around it; framing is a few tokens
    and is recomputed. How: the template is rendered once with a unique sentinel in place of
    every content part, the rendering is cut at the sentinels, and the result is checked
    against the real rendering. Content a template trims is taken as trimmed (its chunk is
    the text the template wrote); a template that transforms content otherwise (escaping,
    ...) fails that check, and the whole prompt then becomes one non-reusable chunk (logged).
    Empty content produces no chunk. The concatenated chunk texts always equal the
    template's rendering of ``flatten_messages(messages, part_separator)``.
    """
    parts = [_message_parts(m) for m in messages]
    real_msgs = flatten_messages(messages, part_separator)

    def render(msgs: list[dict]) -> str:
        out = tokenizer.apply_chat_template(
            msgs,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **template_kwargs,
        )
        if not isinstance(out, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}")
        return out

    real = render(real_msgs)
    nonce = secrets.token_hex(8)
    sentinels: dict[str, str] = {}
    sentinel_msgs = []
    for i, (m, ps) in enumerate(zip(messages, parts)):
        m2 = dict(m)
        if m.get("content") is not None:
            names = []
            for j, text in enumerate(ps):
                name = f"\ue000{nonce}:{i}:{j}\ue001"
                sentinels[name] = text
                names.append(name)
            m2["content"] = part_separator.join(names)
        sentinel_msgs.append(m2)
    pieces = re.split(f"(\ue000{nonce}:[0-9]+:[0-9]+\ue001)", render(sentinel_msgs))

    # pieces alternate framing, sentinel, framing, ... ; every sentinel must appear once, in order.
    spliced = _splice(pieces, sentinels, real) if pieces[1::2] == list(sentinels) else None
    if spliced is None:
        log.warning("chat template does not render message content verbatim; prompt not chunked")
        return [Chunk(real, encode(tokenizer, real), False)]
    return [Chunk(text, encode(tokenizer, text), reusable) for text, reusable in spliced if text]


def _splice(pieces: list[str], sentinels: dict[str, str], real: str) -> list[tuple[str, bool]] | None:
    """The real rendering cut where the sentinel rendering is cut: (text, is content) pieces, each content as
    the template wrote it, verbatim or without the surrounding whitespace a `trim` took off (Gemma 3's template
    trims every message but a first system one: a later message ending in a newline, as Claude Code's
    reminders do, would otherwise leave the whole prompt one chunk, tokenized across what were chunk
    boundaries the turn before, and its cache hit would end at the first of them). None when the template
    changed content in any other way."""
    out: list[tuple[str, bool]] = []
    at = 0
    for k, piece in enumerate(pieces):
        if k % 2 == 0:  # framing: as rendered around the sentinels
            if not real.startswith(piece, at):
                return None
            out.append((piece, False))
            at += len(piece)
            continue
        text = sentinels[piece]
        after = pieces[k + 1] if k + 1 < len(pieces) else ""
        for written in dict.fromkeys((text, text.strip(), text.lstrip(), text.rstrip())):
            if real.startswith(written, at) and real.startswith(after, at + len(written)):
                out.append((written, True))
                at += len(written)
                break
        else:
            return None
    return out if at == len(real) else None


def chat_opening(tokenizer: Any, part_separator: str = PART_SEPARATOR) -> list[int]:
    """The tokens a chat prompt puts before the first user message's content (a default system prompt,
    the user header): what a chunk sees before it when it comes first. Empty for a tokenizer without a
    chat template, or one whose template rejects a lone user message."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        chunks = render_chat_chunks(tokenizer, [{"role": "user", "content": "x"}], add_generation_prompt=False,
                                    part_separator=part_separator)
    except TemplateError:
        return []
    opening: list[int] = []
    for chunk in chunks:
        if chunk.reusable:
            return opening
        opening.extend(chunk.tokens)
    return []
