"""A prompt as the engine takes it: token ids plus the (start, length) of each chunk that may be reused
at another position (blending). Chunks are tokenized alone and concatenated whether or not a request
blends, so turning blending on or off never changes the tokens the model sees."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from blend.chunking import Chunk, chunk_tokens, encode


class PromptChunks(NamedTuple):
    token_ids: list[int]
    chunk_spans: list[tuple[int, int]]  # reusable chunks only


def from_chunks(chunks: Sequence[Chunk], prefix: Sequence[int] = ()) -> PromptChunks:
    """Concatenate chunks after `prefix` (tokens that belong to no chunk, e.g. a BOS)."""
    spans, pos = [], len(prefix)
    for chunk in chunks:
        if chunk.reusable and chunk.tokens:
            spans.append((pos, len(chunk.tokens)))
        pos += len(chunk.tokens)
    return PromptChunks(list(prefix) + chunk_tokens(chunks), spans)


def leading_special_tokens(tokenizer: Any) -> list[int]:
    """The ids `tokenizer.encode(text)` puts before the text's own tokens (a BOS for Llama-style
    tokenizers, nothing for GPT-2-style ones), so a chunked text prompt starts the way an unchunked one does."""
    probe = "a"
    bare, full = list(encode(tokenizer, probe)), list(tokenizer.encode(probe))
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i]
    return []
