"""Non-prefix KV reuse ("blending", CacheBlend): chunking, re-RoPE and token selection.

Importing this package does not import triton; ``blend.rope_triton`` does, on first use
of the Triton backend.
"""

from blend.chunking import (
    Chunk,
    chunk_spans,
    chunk_tokens,
    render_chat_chunks,
    split_by_separator,
    tokenize_chunks,
)
from blend.rope import apply_rope, default_inv_freq, rerope_, rerope_dense, rerope_layers_, rerope_torch_
from blend.selection import (
    GradualSchedule,
    count_for_ratio,
    first_tokens_mask,
    kv_deviation,
    select_top,
    select_top_k,
)

__all__ = [
    "Chunk",
    "GradualSchedule",
    "apply_rope",
    "chunk_spans",
    "chunk_tokens",
    "count_for_ratio",
    "default_inv_freq",
    "first_tokens_mask",
    "kv_deviation",
    "render_chat_chunks",
    "rerope_",
    "rerope_dense",
    "rerope_layers_",
    "rerope_torch_",
    "select_top",
    "select_top_k",
    "split_by_separator",
    "tokenize_chunks",
]
